//! Warnings about what arrives from the network, at a bounded rate: a flood
//! of bad messages is counted in full (the endpoint's statistics) but
//! logged at most once per interval, each line saying how many like it
//! were held back.

use std::time::{Duration, Instant};

/// How often a flood of bad input may log a line.
pub(crate) const BAD_INPUT_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// The endpoint's limits, one per kind of bad input.
#[derive(Debug)]
pub(crate) struct BadInputLog {
    pub malformed: LogLimit,
    pub unknown_link: LogLimit,
    pub forged: LogLimit,
    pub receive_failed: LogLimit,
    pub send_failed: LogLimit,
}

impl Default for BadInputLog {
    fn default() -> Self {
        let limit = || LogLimit::new(BAD_INPUT_LOG_INTERVAL);
        BadInputLog {
            malformed: limit(),
            unknown_link: limit(),
            forged: limit(),
            receive_failed: limit(),
            send_failed: limit(),
        }
    }
}

/// One line per interval.
#[derive(Debug)]
pub(crate) struct LogLimit {
    interval: Duration,
    /// When the next line may be logged; `None` before the first.
    next: Option<Instant>,
    held_back: u64,
}

impl LogLimit {
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
