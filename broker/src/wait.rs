//! How an event loop (the broker's or a client's) waits: on its
//! descriptors, with the adaptive back-off of endpoints that make progress
//! only when polled (libfabric endpoints without a wait object).

use std::time::Duration;

use efabus_core::transport::{Endpoint, Readiness};
use mio::Poll;

/// Wait for readiness for up to `timeout`. epoll counts in milliseconds, so
/// mio rounds shorter waits up to a whole millisecond; below that, look at
/// the descriptors without waiting and sleep the rest (nanosleep keeps
/// microseconds), so the fabric polling steps keep their length.
pub(crate) fn wait(
    poll: &mut Poll,
    events: &mut mio::Events,
    timeout: Duration,
) -> std::io::Result<()> {
    if timeout.is_zero() || timeout >= Duration::from_millis(1) {
        return poll.poll(events, Some(timeout));
    }
    poll.poll(events, Some(Duration::ZERO))?;
    if events.is_empty() {
        std::thread::sleep(timeout);
    }
    Ok(())
}

/// Idle rounds a loop spins before it sleeps on its fabric wait sets: a
/// wake-up from the descriptor is cheap, and spinning longer only takes
/// cores from the threads that do the work (measured on 2 cores, where 64
/// rounds tripled the round-trip time of 8).
const WAKEABLE_SPINS: u32 = 8;

/// How a loop's endpoints want to be waited on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Polled {
    /// Some endpoint makes progress only when polled.
    pub must_poll: bool,
    /// Every such endpoint also has a descriptor that ends the wait early.
    pub wakeable: bool,
}

impl Polled {
    pub fn of(readiness: impl IntoIterator<Item = Readiness>) -> Polled {
        let mut polled = Polled {
            must_poll: false,
            wakeable: true,
        };
        for readiness in readiness {
            polled.must_poll |= readiness.must_poll();
            polled.wakeable &= readiness != Readiness::MustPoll;
        }
        polled
    }

    /// How long an idle loop may wait. When a descriptor ends the wait as
    /// soon as work arrives: not at all for `WAKEABLE_SPINS` idle rounds (at
    /// most `busy_polls`), then as long as the loop's own timers allow
    /// (`Duration::MAX`). Otherwise: not at all for `busy_polls` idle
    /// rounds, then 50 us for as many rounds again, then `idle_sleep_us`.
    pub fn backoff(self, idle_rounds: u32, polling: &crate::config::Polling) -> Duration {
        if self.wakeable {
            if idle_rounds <= polling.busy_polls.min(WAKEABLE_SPINS) {
                Duration::ZERO
            } else {
                Duration::MAX
            }
        } else if idle_rounds <= polling.busy_polls {
            Duration::ZERO
        } else if idle_rounds <= polling.busy_polls.saturating_mul(2) {
            Duration::from_micros(50.min(polling.idle_sleep_us))
        } else {
            Duration::from_micros(polling.idle_sleep_us)
        }
    }
}

/// Asks every endpoint that must be polled whether the loop may sleep now;
/// false when one has work pending.
pub(crate) fn prepare_wait(endpoints: &mut [Box<dyn Endpoint>]) -> bool {
    endpoints
        .iter_mut()
        .filter(|endpoint| endpoint.readiness().must_poll())
        .all(|endpoint| endpoint.prepare_wait())
}
