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

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard};

/// The state of an event loop that runs in rounds.
pub(crate) trait Rounds: Send {
    /// Run one round for a driver: whether it found work, or `None` when
    /// the loop is not to be driven now (it is connecting, say: slow work
    /// that is the loop thread's).
    fn driven_round(&mut self) -> Option<bool>;
}

thread_local! {
    /// This thread is running a loop's rounds as a driver.
    static DRIVING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is running a loop's rounds as a driver: a
/// round it runs must not wait for something only this thread can do
/// (room in a queue it reads).
pub(crate) fn driving() -> bool {
    DRIVING.get()
}

/// An event loop's state, run by its own thread or by a driver.
pub(crate) struct Driven<L> {
    /// `None` once the loop thread has closed the loop.
    state: Mutex<Option<L>>,
    /// Application threads driving the loop now.
    drivers: AtomicUsize,
    /// Drives finished so far: the loop thread does not go to sleep on
    /// what it saw before a drive that came and went meanwhile.
    finished: AtomicU64,
    /// A driven round found work since the loop thread last looked: it
    /// polls on after the drivers leave, as after its own work.
    driven_work: AtomicBool,
    /// The loop thread's last round found work.
    loop_worked: AtomicBool,
    /// Wakes the loop thread if it sleeps: it may have slept through a
    /// drive, and what the driven rounds left for later (a held-back
    /// credit, a timer) is its again.
    wake: Box<dyn Fn() + Send + Sync>,
}

/// A driver's presence, withdrawn however the drive ends (a round that
/// panics included: the loop thread would otherwise step aside for good).
struct Presence<'a, L> {
    driven: &'a Driven<L>,
    /// A round ran: the loop thread's view of the loop may be stale.
    ran: bool,
}

impl<'a, L> Presence<'a, L> {
    fn enter(driven: &'a Driven<L>) -> Presence<'a, L> {
        driven.drivers.fetch_add(1, Ordering::SeqCst);
        DRIVING.set(true);
        Presence { driven, ran: false }
    }
}

impl<L> Drop for Presence<'_, L> {
    fn drop(&mut self) {
        DRIVING.set(false);
        if self.ran {
            self.driven.finished.fetch_add(1, Ordering::SeqCst);
        }
        self.driven.drivers.fetch_sub(1, Ordering::SeqCst);
        if self.ran {
            (self.driven.wake)();
        }
    }
}

/// Where the application threads of a broker or client find its loop to
/// drive: set once the loop is made, and empty once the loop thread has
/// ended with it.
pub(crate) struct DriveHandle<L>(OnceLock<Weak<Driven<L>>>);

impl<L: Rounds> DriveHandle<L> {
    pub fn new() -> DriveHandle<L> {
        DriveHandle(OnceLock::new())
    }

    /// Makes the loop of `state` drivable through this handle; the loop
    /// thread runs the returned loop. `wake` wakes the loop thread if it
    /// sleeps (after a drive).
    pub fn install(&self, state: L, wake: impl Fn() + Send + Sync + 'static) -> Arc<Driven<L>> {
        let driven = Arc::new(Driven::new(state, wake));
        let _ = self.0.set(Arc::downgrade(&driven));
        driven
    }

    /// The loop, while it exists.
    fn driven(&self) -> Option<Arc<Driven<L>>> {
        self.0.get().and_then(Weak::upgrade)
    }

    /// [`Driven::drive`] for a thread that waits: a request for its reply
    /// always, a subscription's `reader` only while the loop thread finds
    /// no work. The rounds it ran (none once the loop has ended).
    pub fn drive(
        &self,
        reader: bool,
        until: Instant,
        ready: &dyn Fn() -> bool,
        stop: &AtomicBool,
    ) -> u64 {
        match self.driven() {
            Some(driven) if !reader || driven.reader_may_drive() => {
                driven.drive(until, ready, stop)
            }
            _ => 0,
        }
    }

    /// Whether a subscription's reader would drive now (see
    /// [`DriveHandle::drive`]).
    pub fn reader_would_drive(&self) -> bool {
        self.driven()
            .is_some_and(|driven| driven.reader_may_drive())
    }
}

impl<L: Rounds> Driven<L> {
    /// `wake` wakes the loop thread if it sleeps (after a drive).
    pub fn new(state: L, wake: impl Fn() + Send + Sync + 'static) -> Driven<L> {
        Driven {
            state: Mutex::new(Some(state)),
            drivers: AtomicUsize::new(0),
            finished: AtomicU64::new(0),
            driven_work: AtomicBool::new(false),
            loop_worked: AtomicBool::new(false),
            wake: Box::new(wake),
        }
    }

    /// Runs rounds on the calling thread until `ready`, until `until`, or
    /// until `stop`; stops early when the loop is closed or not to be
    /// driven now, and while a round it ran has filled a queue this thread
    /// reads past its bound ([`crate::delivery::may_drive`]). While another
    /// thread holds the loop (the loop thread mid-round, another driver) it
    /// yields between tries. Returns the rounds it ran. A round may run
    /// past `until`: it is the loop's round, whatever it has to do. A
    /// drive that ran rounds ends by waking the loop thread if it sleeps,
    /// however it ends.
    pub fn drive(&self, until: Instant, ready: &dyn Fn() -> bool, stop: &AtomicBool) -> u64 {
        let mut presence = Presence::enter(self);
        let mut rounds = 0;
        while !ready()
            && !stop.load(Ordering::Relaxed)
            && Instant::now() < until
            && crate::delivery::may_drive()
        {
            let worked = match self.state.try_lock() {
                Some(mut guard) => match guard.as_mut().and_then(L::driven_round) {
                    Some(worked) => {
                        rounds += 1;
                        presence.ran = true;
                        worked
                    }
                    None => break,
                },
                None => false,
            };
            if worked {
                self.driven_work.store(true, Ordering::Relaxed);
            } else {
                std::thread::yield_now();
            }
        }
        rounds
    }

    /// For the loop thread, read while it holds the loop: how many drives
    /// have finished. Before it sleeps it checks that none finished since
    /// ([`Driven::may_sleep`]).
    pub fn drives_finished(&self) -> u64 {
        self.finished.load(Ordering::SeqCst)
    }

    /// For the loop thread, about to sleep on what it saw when
    /// [`Driven::drives_finished`] said `finished`: false if a driver is
    /// here or has come and gone since.
    pub fn may_sleep(&self, finished: u64) -> bool {
        !self.is_driven() && self.drives_finished() == finished
    }

    /// Whether a subscription's reader should drive: only while the loop
    /// thread finds no work. A stream is delivered faster by the loop
    /// thread while the reader consumes it (1 MiB over `tcp;ofi_rxm` lost
    /// about a tenth of its rate with its reader driving).
    fn reader_may_drive(&self) -> bool {
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
    use std::sync::Arc;
    use std::time::Duration;

    /// A loop whose rounds count themselves where drivers can see it, find
    /// work in the first `busy` of them, refuse drivers from round
    /// `refuse_at` on and panic at round `panic_at`.
    struct Counting {
        rounds: Arc<AtomicU64>,
        busy: u64,
        refuse_at: u64,
        panic_at: u64,
    }

    impl Rounds for Counting {
        fn driven_round(&mut self) -> Option<bool> {
            let round = self.rounds.load(Ordering::SeqCst);
            assert!(round != self.panic_at, "a round failed");
            if round >= self.refuse_at {
                return None;
            }
            self.rounds.fetch_add(1, Ordering::SeqCst);
            Some(round < self.busy)
        }
    }

    fn counting(busy: u64) -> (Arc<Driven<Counting>>, Arc<AtomicU64>) {
        let rounds = Arc::new(AtomicU64::new(0));
        let state = Counting {
            rounds: rounds.clone(),
            busy,
            refuse_at: u64::MAX,
            panic_at: u64::MAX,
        };
        (Arc::new(Driven::new(state, || {})), rounds)
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[test]
    fn a_driver_runs_rounds_until_ready_and_reports_them() {
        let (driven, rounds) = counting(2);
        let stop = AtomicBool::new(false);
        let finished = driven.drives_finished();
        let ready = || rounds.load(Ordering::SeqCst) >= 5;
        assert_eq!(driven.drive(far(), &ready, &stop), 5);
        assert!(driven.take_driven_work(), "the first rounds found work");
        assert!(!driven.take_driven_work(), "taken once");
        assert!(!driven.is_driven(), "the driver left");
        assert!(!driving(), "and is no longer driving");
        assert!(!driven.may_sleep(finished), "a drive came and went");
        let finished = driven.drives_finished();
        assert!(driven.may_sleep(finished));
        // Already ready, past the deadline, or stopped: no round.
        assert_eq!(driven.drive(far(), &|| true, &stop), 0);
        assert_eq!(driven.drive(Instant::now(), &|| false, &stop), 0);
        stop.store(true, Ordering::Relaxed);
        assert_eq!(driven.drive(far(), &|| false, &stop), 0);
        assert!(!driven.take_driven_work(), "no round found work");
        assert!(
            driven.may_sleep(finished),
            "drives without a round change nothing"
        );
        // Closed: none, at once.
        stop.store(false, Ordering::Relaxed);
        assert!(driven.take().is_some());
        assert_eq!(driven.drive(far(), &|| false, &stop), 0);
        assert_eq!(rounds.load(Ordering::SeqCst), 5);
    }

    #[test]
    fn a_loop_not_to_be_driven_sends_the_driver_back_at_once() {
        let rounds = Arc::new(AtomicU64::new(0));
        let driven = Driven::new(
            Counting {
                rounds: rounds.clone(),
                busy: 0,
                refuse_at: 3,
                panic_at: u64::MAX,
            },
            || {},
        );
        let stop = AtomicBool::new(false);
        assert_eq!(driven.drive(far(), &|| false, &stop), 3);
        assert!(!driven.is_driven());
    }

    #[test]
    fn a_round_that_panics_withdraws_the_driver() {
        let rounds = Arc::new(AtomicU64::new(0));
        let woken = Arc::new(AtomicBool::new(false));
        let wake = {
            let woken = woken.clone();
            move || woken.store(true, Ordering::SeqCst)
        };
        let driven = Driven::new(
            Counting {
                rounds,
                busy: 0,
                refuse_at: u64::MAX,
                panic_at: 1,
            },
            wake,
        );
        let stop = AtomicBool::new(false);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            driven.drive(far(), &|| false, &stop)
        }));
        assert!(result.is_err());
        assert!(
            !driven.is_driven(),
            "the loop thread would step aside for good"
        );
        assert!(!driving());
        assert!(woken.load(Ordering::SeqCst), "the loop thread is woken");
    }

    #[test]
    fn a_driver_waits_while_the_loop_thread_holds_the_loop() {
        let (driven, rounds) = counting(0);
        let held = driven.lock();
        let driver = {
            let (driven, rounds) = (driven.clone(), rounds.clone());
            std::thread::spawn(move || {
                let stop = AtomicBool::new(false);
                driven.drive(far(), &|| rounds.load(Ordering::SeqCst) > 0, &stop)
            })
        };
        // The loop thread sees the driver and would step aside.
        while !driven.is_driven() {
            std::thread::yield_now();
        }
        assert!(!driven.may_sleep(driven.drives_finished()));
        assert_eq!(rounds.load(Ordering::SeqCst), 0, "no round while held");
        drop(held);
        assert_eq!(driver.join().unwrap(), 1);
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
