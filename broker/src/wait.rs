//! How an event loop (the broker's or a client's) waits: on its
//! descriptors, with the adaptive back-off of endpoints that make progress
//! only when polled (libfabric endpoints without a wait object).

use std::time::{Duration, Instant};

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

/// While a loop is busy with endpoints that must be polled (the
/// fabric's), an endpoint with a descriptor (TCP) whose last poll found
/// nothing is polled at most this often: each of its polls is a system
/// call, and a stream over `shm` between two brokers made one per round,
/// about a million a second per loop.
const FD_POLL_GAP: Duration = Duration::from_micros(20);

/// Whether a loop puts off polling `endpoint` this round: one with a
/// descriptor whose last poll found nothing (at `quiet_since`) less than
/// [`FD_POLL_GAP`] ago and that has no work of its own, while the loop's
/// last round found work on endpoints that must be polled
/// (`busy_polling`). An idle loop polls every endpoint every round, so a
/// loop spinning after a reply finds the next request at once.
pub(crate) fn puts_off_polling(
    busy_polling: bool,
    quiet_since: Option<Instant>,
    now: Instant,
    endpoint: &dyn Endpoint,
) -> bool {
    busy_polling
        && quiet_since.is_some_and(|since| now.saturating_duration_since(since) < FD_POLL_GAP)
        && !endpoint.has_own_work()
}

/// How far the polling window after work may grow, in `spin_us`.
pub(crate) const SPIN_GROWTH: u32 = 5;
/// Gaps between rounds with work up to this many `spin_us` belong to one
/// exchange. More than the window's limit: a round trip that took longer
/// than the window because some loop on its way slept must not shrink the
/// window, or every loop on the way would keep sleeping.
const GAP_IN_EXCHANGE: u32 = 2 * SPIN_GROWTH;

/// How long a loop polls on (yielding its core between rounds) after a
/// round with work, rather than waits. At least `spin_us`. While rounds
/// with work come within `GAP_IN_EXCHANGE` times `spin_us` of each other
/// (a request/reply exchange, whose replies may take longer than
/// `spin_us`), it grows to twice the longest gap, up to `SPIN_GROWTH`
/// times `spin_us`, so the loop is still polling when the next reply or
/// request comes; one longer gap takes it back to `spin_us`, so rare work
/// costs `spin_us` of polling after each. On 2 cores, with the waiting
/// threads' windows (`delivery::YieldWindow`), it took 64 B request/reply
/// through the broker over `tcp;ofi_rxm` from 182-320 us to 84-114 us
/// (README, "Busy polling").
#[derive(Debug, Clone, Copy)]
pub(crate) struct SpinWindow {
    busy_at: Instant,
    window: Duration,
}

impl SpinWindow {
    pub fn new(now: Instant) -> SpinWindow {
        SpinWindow {
            busy_at: now,
            window: Duration::ZERO,
        }
    }

    /// A round that found work ended at `now`.
    pub fn worked(&mut self, now: Instant, spin: Duration) {
        let gap = now.saturating_duration_since(self.busy_at);
        self.window = if gap > spin * GAP_IN_EXCHANGE {
            spin
        } else {
            // Never below the window already reached: an exchange's short
            // gaps (a send's completion, a credit) come between its long
            // ones.
            (gap * 2).max(self.window).max(spin).min(spin * SPIN_GROWTH)
        };
        self.busy_at = now;
    }

    /// Whether the loop polls again at `now` rather than waits.
    pub fn spinning(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.busy_at) < self.window
    }
}

/// Idle rounds a loop spins before it sleeps on its fabric wait sets: a
/// wake-up from the descriptor is cheap, and spinning longer only takes
/// cores from the threads that do the work (measured on 2 cores, where 64
/// rounds tripled the round-trip time of 8).
const WAKEABLE_SPINS: u32 = 8;

/// Rounds, per `busy_polls`, that a loop without a wake-up descriptor
/// polls and then yields its core, between spinning and sleeping. A
/// sleep, however short, costs a timer wake-up (50 us or more with the
/// kernel's default timer slack); a yield returns at once when no other
/// thread wants the core, and hands it over when one does, but each round
/// still costs its polls' system calls. The window after work (`spin_us`)
/// already keeps a loop serving an exchange yielding; these rounds add
/// only what follows it. Measured over shm on 2 cores through the broker
/// (medians of 3 alternated runs), against 64 rounds per `busy_polls`:
/// 16 B streaming 6.5M to 8.2M msg/s and 1 MiB 8.5 to 9.3 GB/s, with 64 B
/// round trips unchanged (13.3 and 12.9 us): a broker streaming 1 MiB had
/// made 153,000 `epoll_wait` and 85,000 `sched_yield` calls a second
/// between its reads. Sleeping straight after the spin (none) had cost
/// round trips twice as long, when they took 200 us or more.
const YIELD_ROUNDS_PER_BUSY_POLL: u32 = 1;

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
    /// rounds, nor for the rounds it [`yields`](Self::yields) after them,
    /// then 50 us for `busy_polls` rounds, then `idle_sleep_us`.
    pub fn backoff(self, idle_rounds: u32, polling: &crate::config::Polling) -> Duration {
        let yielded = Self::yield_end(polling);
        if self.wakeable {
            if idle_rounds <= polling.busy_polls.min(WAKEABLE_SPINS) {
                Duration::ZERO
            } else {
                Duration::MAX
            }
        } else if idle_rounds <= yielded {
            Duration::ZERO
        } else if idle_rounds <= yielded.saturating_add(polling.busy_polls) {
            Duration::from_micros(50.min(polling.idle_sleep_us))
        } else {
            Duration::from_micros(polling.idle_sleep_us)
        }
    }

    /// Whether an idle loop yields its core after this round's poll: a
    /// loop without a wake-up descriptor does, once it has spun its
    /// `busy_polls` rounds and until it starts sleeping.
    pub fn yields(self, idle_rounds: u32, polling: &crate::config::Polling) -> bool {
        self.must_poll
            && !self.wakeable
            && idle_rounds > polling.busy_polls
            && idle_rounds <= Self::yield_end(polling)
    }

    fn yield_end(polling: &crate::config::Polling) -> u32 {
        polling
            .busy_polls
            .saturating_mul(YIELD_ROUNDS_PER_BUSY_POLL + 1)
    }
}

/// Asks every endpoint that must be polled whether the loop may sleep now,
/// and every endpoint for how long: `None` when one has work pending, else
/// the longest sleep they allow (`timeout` at most; a TCP endpoint's
/// lingering connections and accept retries have no descriptor to wake
/// the loop).
pub(crate) fn prepare_wait(
    endpoints: &mut [Box<dyn Endpoint>],
    timeout: Duration,
) -> Option<Duration> {
    let mut allowed = timeout;
    for endpoint in endpoints.iter_mut() {
        if endpoint.readiness().must_poll() && !endpoint.prepare_wait() {
            return None;
        }
        if let Some(cap) = endpoint.wait_cap() {
            allowed = allowed.min(cap);
        }
    }
    Some(allowed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Polling;
    use efabus_core::transport::EndpointConfig;
    use efabus_transports::tcp::TcpEndpoint;

    fn loopback_listener() -> TcpEndpoint {
        TcpEndpoint::open(&EndpointConfig {
            bind: Some("127.0.0.1:0".into()),
            ..EndpointConfig::default()
        })
        .expect("a loopback listener")
    }

    #[test]
    fn a_quiet_descriptor_endpoint_is_put_off_only_while_the_loop_is_busy_polling() {
        let endpoint = loopback_listener();
        assert!(!endpoint.has_own_work());
        let quiet = Instant::now();
        let soon = quiet + FD_POLL_GAP / 2;
        assert!(puts_off_polling(true, Some(quiet), soon, &endpoint));
        // An idle loop, an endpoint that found work, a gap gone by.
        assert!(!puts_off_polling(false, Some(quiet), soon, &endpoint));
        assert!(!puts_off_polling(true, None, soon, &endpoint));
        assert!(!puts_off_polling(
            true,
            Some(quiet),
            quiet + FD_POLL_GAP,
            &endpoint
        ));
    }

    /// A TCP endpoint has a descriptor, but a connection it closed
    /// lingers with nothing to wake the loop when its time is up: the
    /// sleep is capped by it all the same.
    #[test]
    fn a_descriptor_endpoint_caps_the_sleep_for_what_it_must_come_back_to() {
        let endpoint = loopback_listener();
        let addr = endpoint.local_socket_addr().expect("an address");
        let idle = Duration::from_secs(60);
        let mut endpoints: Vec<Box<dyn Endpoint>> = vec![Box::new(endpoint)];
        assert_eq!(prepare_wait(&mut endpoints, idle), Some(idle));
        let _client = std::net::TcpStream::connect(addr).expect("a connection");
        let deadline = Instant::now() + Duration::from_secs(10);
        let peer = loop {
            let mut events = Vec::new();
            endpoints[0].poll(&mut events).expect("a poll");
            let accepted = events.iter().find_map(|event| match event {
                efabus_core::transport::Event::Accepted { peer, .. } => Some(*peer),
                _ => None,
            });
            if let Some(peer) = accepted {
                break peer;
            }
            assert!(Instant::now() < deadline, "never accepted");
            std::thread::sleep(Duration::from_millis(1));
        };
        endpoints[0].close(peer);
        let allowed = prepare_wait(&mut endpoints, idle).expect("nothing pending");
        assert!(allowed <= efabus_transports::tcp::LINGER, "{allowed:?}");
    }

    fn polled(wakeable: bool) -> Polled {
        Polled {
            must_poll: true,
            wakeable,
        }
    }

    #[test]
    fn a_loop_spins_only_within_its_window_after_work() {
        let spin = Duration::from_micros(50);
        let start = Instant::now();
        let mut window = SpinWindow::new(start);
        assert!(!window.spinning(start), "no work yet");
        // Work long after the last: the window is `spin`.
        let busy = start + Duration::from_millis(10);
        window.worked(busy, spin);
        assert!(window.spinning(busy + Duration::from_micros(49)));
        assert!(!window.spinning(busy + spin));

        // Work again 100 us later: the window grows to twice that gap.
        let next = busy + Duration::from_micros(100);
        window.worked(next, spin);
        assert!(window.spinning(next + Duration::from_micros(199)));
        assert!(!window.spinning(next + Duration::from_micros(200)));
        // At most five times `spin`.
        let next = next + Duration::from_micros(200);
        window.worked(next, spin);
        assert!(window.spinning(next + Duration::from_micros(249)));
        assert!(!window.spinning(next + Duration::from_micros(250)));
        // A gap longer than the window but within an exchange (a loop on
        // the way slept) keeps the largest window, and so do the short
        // gaps between an exchange's long ones.
        let next = next + Duration::from_micros(400);
        window.worked(next, spin);
        assert!(window.spinning(next + Duration::from_micros(249)));
        let next = next + Duration::from_micros(1);
        window.worked(next, spin);
        assert!(window.spinning(next + Duration::from_micros(249)));
        // A gap beyond that: back to `spin`.
        let next = next + Duration::from_micros(501);
        window.worked(next, spin);
        assert!(window.spinning(next + Duration::from_micros(49)));
        assert!(!window.spinning(next + spin));

        // `spin_us = 0` never spins, even after a larger window.
        let zero = Duration::ZERO;
        window.worked(next + Duration::from_micros(100), spin);
        window.worked(next + Duration::from_micros(200), zero);
        assert!(!window.spinning(next + Duration::from_micros(200)));
    }

    #[test]
    fn a_loop_without_a_descriptor_spins_yields_then_sleeps() {
        let polling = Polling {
            busy_polls: 4,
            idle_sleep_us: 1_000,
            wait_fd: true,
            ..Polling::default()
        };
        let loop_ = polled(false);
        let yield_end = 4 * (YIELD_ROUNDS_PER_BUSY_POLL + 1);
        for round in 0..=4 {
            assert_eq!(loop_.backoff(round, &polling), Duration::ZERO);
            assert!(!loop_.yields(round, &polling), "spins at round {round}");
        }
        for round in [5, yield_end] {
            assert_eq!(loop_.backoff(round, &polling), Duration::ZERO);
            assert!(loop_.yields(round, &polling), "yields at round {round}");
        }
        let first_sleep = yield_end + 1;
        assert!(!loop_.yields(first_sleep, &polling));
        assert_eq!(
            loop_.backoff(first_sleep, &polling),
            Duration::from_micros(50)
        );
        assert_eq!(
            loop_.backoff(yield_end + 5, &polling),
            Duration::from_micros(1_000)
        );
    }

    #[test]
    fn a_loop_with_a_descriptor_never_yields() {
        let polling = Polling::default();
        let loop_ = polled(true);
        for round in [0, 8, 9, 100, 10_000] {
            assert!(!loop_.yields(round, &polling));
        }
        assert_eq!(loop_.backoff(9, &polling), Duration::MAX);
    }
}
