//! An event loop that application threads may run while they wait.
//!
//! A broker's or a client's loop thread hands what it receives to the
//! application threads waiting for it (a request's caller, a
//! subscription's reader), and each hand-over costs the receiving thread a
//! turn on a core. [`Driven`] holds the loop's state behind a lock so that
//! a waiting thread can run the loop's rounds itself: what it waits for
//! then reaches it with no hand-over, and what it published just before
//! leaves in its own first round. The loop thread steps aside while such a
//! driver holds the loop, so the two do not take turns on the cores.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard};

/// The state of an event loop that runs in rounds.
pub(crate) trait Rounds: Send {
    /// Run one round; whether it found work.
    fn driven_round(&mut self) -> bool;
}

/// An event loop's state, run by its own thread or by a driver.
pub(crate) struct Driven<L> {
    /// `None` once the loop thread has closed the loop.
    state: Mutex<Option<L>>,
    /// Application threads driving the loop now.
    drivers: AtomicUsize,
    /// A driven round found work since the loop thread last looked: it
    /// polls on after the drivers leave, as after its own work.
    driven_work: AtomicBool,
    /// The loop thread's last round found work.
    loop_worked: AtomicBool,
}

impl<L: Rounds> Driven<L> {
    pub fn new(state: L) -> Driven<L> {
        Driven {
            state: Mutex::new(Some(state)),
            drivers: AtomicUsize::new(0),
            driven_work: AtomicBool::new(false),
            loop_worked: AtomicBool::new(false),
        }
    }

    /// Runs rounds on the calling thread until `ready`, until `until`, or
    /// until `stop`. While another thread holds the loop (the loop thread
    /// mid-round, another driver) it yields between tries. Returns the
    /// rounds it ran, `None` (at once) when the loop is closed. The caller
    /// then wakes the loop thread if it sleeps: it may have slept through
    /// the driving, and what the driven rounds left for later (a held-back
    /// credit, a timer) is its again.
    pub fn drive(
        &self,
        until: Instant,
        ready: &dyn Fn() -> bool,
        stop: &AtomicBool,
    ) -> Option<u64> {
        self.drivers.fetch_add(1, Ordering::SeqCst);
        let mut rounds = Some(0);
        while !ready() && !stop.load(Ordering::Relaxed) && Instant::now() < until {
            let worked = match self.state.try_lock() {
                Some(mut guard) => match guard.as_mut() {
                    Some(state) => {
                        rounds = rounds.map(|n| n + 1);
                        state.driven_round()
                    }
                    None => {
                        rounds = None;
                        break;
                    }
                },
                None => false,
            };
            if worked {
                self.driven_work.store(true, Ordering::Relaxed);
            } else {
                std::thread::yield_now();
            }
        }
        self.drivers.fetch_sub(1, Ordering::SeqCst);
        rounds
    }

    /// Whether a subscription's reader should drive: only while the loop
    /// thread finds no work. A stream is delivered faster by the loop
    /// thread while the reader consumes it (1 MiB over `tcp;ofi_rxm` lost
    /// about a tenth of its rate with its reader driving).
    pub fn reader_may_drive(&self) -> bool {
        !self.loop_worked.load(Ordering::Relaxed)
    }

    /// For the loop thread: whether a driver has the loop now (the loop
    /// thread then yields rather than runs a round).
    pub fn is_driven(&self) -> bool {
        self.drivers.load(Ordering::SeqCst) > 0
    }

    /// For the loop thread: whether driven rounds found work since it last
    /// asked.
    pub fn take_driven_work(&self) -> bool {
        self.driven_work.swap(false, Ordering::Relaxed)
    }

    /// For the loop thread: the loop, for one of its own rounds.
    pub fn lock(&self) -> MutexGuard<'_, Option<L>> {
        self.state.lock()
    }

    /// For the loop thread: what its last round found.
    pub fn loop_worked(&self, worked: bool) {
        self.loop_worked.store(worked, Ordering::Relaxed);
    }

    /// For the loop thread, at its end: the loop, to close; drivers find
    /// it closed from then on.
    pub fn take(&self) -> Option<L> {
        self.state.lock().take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;
    use std::time::Duration;

    /// A loop whose rounds count themselves where drivers can see it and
    /// find work in the first `busy` of them.
    struct Counting {
        rounds: Arc<AtomicU64>,
        busy: u64,
    }

    impl Rounds for Counting {
        fn driven_round(&mut self) -> bool {
            self.rounds.fetch_add(1, Ordering::SeqCst) < self.busy
        }
    }

    fn counting(busy: u64) -> (Arc<Driven<Counting>>, Arc<AtomicU64>) {
        let rounds = Arc::new(AtomicU64::new(0));
        let state = Counting {
            rounds: rounds.clone(),
            busy,
        };
        (Arc::new(Driven::new(state)), rounds)
    }

    #[test]
    fn a_driver_runs_rounds_until_ready_and_reports_them() {
        let (driven, rounds) = counting(2);
        let stop = AtomicBool::new(false);
        let far = Instant::now() + Duration::from_secs(10);
        let ready = || rounds.load(Ordering::SeqCst) >= 5;
        assert_eq!(driven.drive(far, &ready, &stop), Some(5));
        assert!(driven.take_driven_work(), "the first rounds found work");
        assert!(!driven.take_driven_work(), "taken once");
        assert!(!driven.is_driven(), "the driver left");
        // Already ready, past the deadline, or stopped: no round.
        assert_eq!(driven.drive(far, &|| true, &stop), Some(0));
        assert_eq!(driven.drive(Instant::now(), &|| false, &stop), Some(0));
        stop.store(true, Ordering::Relaxed);
        assert_eq!(driven.drive(far, &|| false, &stop), Some(0));
        assert!(!driven.take_driven_work(), "no round found work");
        // Closed: none, at once.
        stop.store(false, Ordering::Relaxed);
        assert!(driven.take().is_some());
        assert_eq!(driven.drive(far, &|| false, &stop), None);
        assert_eq!(rounds.load(Ordering::SeqCst), 5);
    }

    #[test]
    fn a_driver_waits_while_the_loop_thread_holds_the_loop() {
        let (driven, rounds) = counting(0);
        let held = driven.lock();
        let driver = {
            let (driven, rounds) = (driven.clone(), rounds.clone());
            std::thread::spawn(move || {
                let stop = AtomicBool::new(false);
                let far = Instant::now() + Duration::from_secs(10);
                driven.drive(far, &|| rounds.load(Ordering::SeqCst) > 0, &stop)
            })
        };
        // The loop thread sees the driver and would step aside.
        while !driven.is_driven() {
            std::thread::yield_now();
        }
        assert_eq!(rounds.load(Ordering::SeqCst), 0, "no round while held");
        drop(held);
        assert_eq!(driver.join().unwrap(), Some(1));
        assert!(!driven.is_driven());
    }

    #[test]
    fn readers_drive_only_while_the_loop_thread_finds_nothing() {
        let (driven, _) = counting(0);
        assert!(driven.reader_may_drive());
        driven.loop_worked(true);
        assert!(!driven.reader_may_drive());
        driven.loop_worked(false);
        assert!(driven.reader_may_drive());
    }
}
