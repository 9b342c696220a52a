//! Warnings about what arrives from the network, at a bounded rate: a
//! flood of one kind of bad input is counted in full where it is counted,
//! but logged at most once per interval, each line saying how many like it
//! were held back. The caller passes the time; nothing here reads a clock.

use std::time::{Duration, Instant};

/// One line per interval.
#[derive(Debug)]
pub struct LogLimit {
    interval: Duration,
    /// When the next line may be logged; `None` before the first.
    next: Option<Instant>,
    held_back: u64,
}

impl LogLimit {
    /// A limit of one line per `interval`.
    pub const fn new(interval: Duration) -> LogLimit {
        LogLimit {
            interval,
            next: None,
            held_back: 0,
        }
    }

    /// Whether a line may be logged at `now`; if so, how many lines were
    /// held back since the last one.
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.next {
            Some(next) if now < next => {
                self.held_back += 1;
                None
            }
            _ => {
                self.next = Some(now + self.interval);
                Some(std::mem::take(&mut self.held_back))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_and_the_rest_counted() {
        let start = Instant::now();
        let second = Duration::from_secs(1);
        let mut limit = LogLimit::new(second);
        assert_eq!(limit.allow(start), Some(0), "the first line is logged");
        for i in 0..20_000u32 {
            let now = start + Duration::from_micros(u64::from(i) * 10);
            assert_eq!(limit.allow(now), None);
        }
        assert_eq!(limit.allow(start + second), Some(20_000));
        assert_eq!(limit.allow(start + second), None);
        assert_eq!(limit.allow(start + 3 * second), Some(1));
    }
}
