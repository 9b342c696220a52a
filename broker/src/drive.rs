//! An event loop that application threads may run while they wait.
//!
//! A broker's or a client's loop thread hands what it receives to the
//! application threads waiting for it (a request's caller, a
//! subscription's reader), and each hand-over costs the receiving thread a
//! turn on a core. [`Driven`] holds the loop's state behind a lock so that
//! a waiting thread can run the loop's rounds itself: what it waits for
//! then reaches it with no hand-over, and what it published just before
//! leaves in its own first round. The loop thread steps aside while such a
//! driver holds the loop: it sleeps rather than yields meanwhile
//! ([`Driven::sleep_while_driven`]), so the two do not take turns on the
//! cores. A round that
//! panics, on a driver's thread or the loop thread, breaks the loop: its
//! state may be half changed, so no round runs on it again and the loop
//! thread ends ([`HeldLoop`]).

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::Thread;
use std::time::{Duration, Instant};

use parking_lot::{MappedMutexGuard, Mutex, MutexGuard};

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
    /// This thread is about to drive: what it asks of the loop meanwhile
    /// (a request's publish) is for its own rounds to do.
    static ABOUT_TO_DRIVE: Cell<bool> = const { Cell::new(false) };
}

/// How long the loop thread sleeps at a time while a driver holds the
/// loop: how late, at most, it takes the loop back from a driver that
/// left with its answer (what arrives meanwhile waits that long; what an
/// application thread asks of the loop wakes it, at once or as the last
/// driver leaves).
pub(crate) const DRIVEN_SLEEP: Duration = Duration::from_micros(100);

/// Runs `publish`, whose sends the calling thread's drive right after
/// makes (a request's): they do not wake the loop thread from
/// [`Driven::sleep_while_driven`].
pub(crate) fn before_driving<T>(publish: impl FnOnce() -> T) -> T {
    /// Clears the mark however `publish` ends.
    struct Mark;
    impl Drop for Mark {
        fn drop(&mut self) {
            ABOUT_TO_DRIVE.set(false);
        }
    }
    ABOUT_TO_DRIVE.set(true);
    let _mark = Mark;
    publish()
}

/// Runs `wake`, a wake-up of the loop thread made before the calling
/// thread blocks (waiting for room in a queue), as a wake from any other
/// thread: even inside [`before_driving`], since no drive of this thread's
/// comes before the block ends.
pub(crate) fn before_blocking<T>(wake: impl FnOnce() -> T) -> T {
    /// Puts the mark back however `wake` ends.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ABOUT_TO_DRIVE.set(self.0);
        }
    }
    let _restore = Restore(ABOUT_TO_DRIVE.replace(false));
    wake()
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
    /// A round panicked ([`HeldLoop`]). Written and read under `state`'s
    /// lock (read without it only as a hint), which orders it.
    broken: AtomicBool,
    /// Records that a round panicked, on the thread that ran it.
    on_broken: Box<dyn Fn() + Send + Sync>,
    /// Who drives the loop, and the loop thread's sleep meanwhile.
    gate: Arc<Gate>,
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

/// The drivers of a loop and the loop thread's sleep while they drive,
/// shared with [`DriveHandle`] so that what application threads ask of
/// the loop checks them without reaching the loop itself.
#[derive(Default)]
struct Gate {
    /// Application threads driving the loop now.
    drivers: AtomicUsize,
    /// The loop thread sleeps while a driver holds the loop
    /// ([`Driven::sleep_while_driven`]).
    asleep: AtomicBool,
    /// A wake is owed to the loop thread while a driver holds the loop
    /// (something was asked of the loop, or a driver left without its
    /// answer): the last driver to leave makes it, in case the rounds
    /// missed what was asked.
    wanted: AtomicBool,
    /// The loop thread, to wake from that sleep.
    loop_thread: OnceLock<Thread>,
    /// Times the loop thread was woken from that sleep.
    sleeper_wakes: AtomicU64,
}

impl Gate {
    fn is_driven(&self) -> bool {
        self.drivers.load(Ordering::SeqCst) > 0
    }

    /// Wakes the loop thread from [`Driven::sleep_while_driven`] for what
    /// was just asked of the loop: now if no driver is there to do it,
    /// else when the driver leaves.
    fn wake_sleeper(&self) {
        // Awake and not stepping aside, the loop thread finds the work in
        // its rounds; this is the case of every publish in a stream.
        if !self.asleep.load(Ordering::SeqCst) && !self.is_driven() {
            return;
        }
        self.wake_or_leave_to_last_driver();
    }

    /// Wakes the loop thread now if no driver is there, else leaves the
    /// wake to the last driver to leave (`wanted`): for what was asked of
    /// the loop, or for a driver that leaves.
    fn wake_or_leave_to_last_driver(&self) {
        if self.is_driven() {
            self.wanted.store(true, Ordering::SeqCst);
            // Paired with a leaving driver's `drivers`, then `wanted`: the
            // other one gone meanwhile may not have seen the flag, and the
            // wake made here settles it.
            if self.is_driven() {
                return;
            }
            self.wanted.store(false, Ordering::SeqCst);
        }
        self.wake_if_asleep();
    }

    /// Wakes the loop thread if it sleeps for a driver and none is left.
    fn wake_if_asleep(&self) {
        if self.asleep.load(Ordering::SeqCst)
            && !self.is_driven()
            && self.asleep.swap(false, Ordering::SeqCst)
        {
            if let Some(thread) = self.loop_thread.get() {
                self.sleeper_wakes.fetch_add(1, Ordering::Relaxed);
                thread.unpark();
            }
        }
    }
}

/// A driver's presence, withdrawn however the drive ends (a round that
/// panics included: the loop thread would otherwise step aside for good).
struct Presence<'a, L> {
    driven: &'a Driven<L>,
    /// A round ran: the loop thread's view of the loop may be stale.
    ran: bool,
    /// The thread was unwinding already (a drive from a `Drop`): only a
    /// panic of the drive's own is one.
    unwinding_before: bool,
}

impl<'a, L> Presence<'a, L> {
    fn enter(driven: &'a Driven<L>) -> Presence<'a, L> {
        driven.gate.drivers.fetch_add(1, Ordering::SeqCst);
        DRIVING.set(true);
        Presence {
            driven,
            ran: false,
            unwinding_before: std::thread::panicking(),
        }
    }
}

impl<L> Drop for Presence<'_, L> {
    fn drop(&mut self) {
        DRIVING.set(false);
        // A round that panicked broke the loop (even as the drive's first
        // round): its thread is to see that now, wherever it waits.
        let panicked = std::thread::panicking() && !self.unwinding_before;
        let ran = self.ran || panicked;
        if ran {
            self.driven.finished.fetch_add(1, Ordering::SeqCst);
        }
        self.driven.gate.drivers.fetch_sub(1, Ordering::SeqCst);
        if ran {
            (self.driven.wake)();
        }
        if panicked {
            self.driven.gate.wake_or_leave_to_last_driver();
        }
    }
}

/// The loop, held for rounds by the loop thread or a driver. A panic
/// while it is held breaks the loop before the lock is let go, whoever
/// holds it: no one runs a round on state the panic left half changed.
pub(crate) struct HeldLoop<'a, L> {
    state: MappedMutexGuard<'a, L>,
    driven: &'a Driven<L>,
    /// The thread was unwinding already when it took the loop (from a
    /// `Drop`): only a panic of its own breaks the loop. (A panic of a
    /// round run so, caught within that `Drop`, goes unseen, as it does
    /// by `std`'s mutex poisoning; uncaught, it aborts the process.)
    unwinding_before: bool,
}

impl<L> Deref for HeldLoop<'_, L> {
    type Target = L;

    fn deref(&self) -> &L {
        &self.state
    }
}

impl<L> DerefMut for HeldLoop<'_, L> {
    fn deref_mut(&mut self) -> &mut L {
        &mut self.state
    }
}

impl<L> Drop for HeldLoop<'_, L> {
    fn drop(&mut self) {
        // Runs before the fields' drops, so before the lock is let go.
        if std::thread::panicking() && !self.unwinding_before {
            self.driven.broken.store(true, Ordering::Relaxed);
            (self.driven.on_broken)();
        }
    }
}

/// Where the application threads of a broker or client find its loop to
/// drive: set once the loop is made, and empty once the loop thread has
/// ended with it.
pub(crate) struct DriveHandle<L>(OnceLock<(Weak<Driven<L>>, Arc<Gate>)>);

impl<L: Rounds> DriveHandle<L> {
    pub fn new() -> DriveHandle<L> {
        DriveHandle(OnceLock::new())
    }

    /// Makes the loop of `state` drivable through this handle; the loop
    /// thread runs the returned loop. `wake` wakes the loop thread if it
    /// sleeps (after a drive); `on_broken` records a round that panicked,
    /// on the thread that ran it, while that thread still holds the loop:
    /// it must neither take the loop nor wait.
    pub fn install(
        &self,
        state: L,
        wake: impl Fn() + Send + Sync + 'static,
        on_broken: impl Fn() + Send + Sync + 'static,
    ) -> Arc<Driven<L>> {
        let driven = Arc::new(Driven::new(state, wake, on_broken));
        let _ = self.0.set((Arc::downgrade(&driven), driven.gate.clone()));
        driven
    }

    /// The loop, while it exists.
    fn driven(&self) -> Option<Arc<Driven<L>>> {
        self.0.get().and_then(|(driven, _)| driven.upgrade())
    }

    /// The loop, for a test to hold it (no round runs meanwhile).
    #[cfg(test)]
    pub fn driven_loop(&self) -> Option<Arc<Driven<L>>> {
        self.driven()
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

    /// Wakes the loop thread from [`Driven::sleep_while_driven`] for what
    /// was just asked of the loop, unless the calling thread is about to
    /// drive ([`before_driving`]).
    pub fn wake_sleeper(&self) {
        if !ABOUT_TO_DRIVE.get() {
            if let Some((_, gate)) = self.0.get() {
                gate.wake_sleeper();
            }
        }
    }
}

impl<L: Rounds> Driven<L> {
    /// `wake` wakes the loop thread if it sleeps (after a drive);
    /// `on_broken` records a round that panicked (see
    /// [`DriveHandle::install`]).
    pub fn new(
        state: L,
        wake: impl Fn() + Send + Sync + 'static,
        on_broken: impl Fn() + Send + Sync + 'static,
    ) -> Driven<L> {
        Driven {
            state: Mutex::new(Some(state)),
            broken: AtomicBool::new(false),
            on_broken: Box::new(on_broken),
            gate: Arc::new(Gate::default()),
            finished: AtomicU64::new(0),
            driven_work: AtomicBool::new(false),
            loop_worked: AtomicBool::new(false),
            wake: Box::new(wake),
        }
    }

    /// Runs rounds on the calling thread until `ready`, until `until`, or
    /// until `stop`; stops early when the loop is closed, broken or not to
    /// be driven now, and while a round it ran has filled a queue this thread
    /// reads past its bound ([`crate::delivery::may_drive`]). While another
    /// thread holds the loop (the loop thread mid-round, another driver) it
    /// yields between tries. Returns the rounds it ran. A round may run
    /// past `until`: it is the loop's round, whatever it has to do. A
    /// drive that ran rounds ends by waking the loop thread if it waits for
    /// events, however it ends; one that ends before `ready` also wakes it
    /// from its sleep for a driver ([`Driven::sleep_while_driven`]), or
    /// leaves that to the last driver to leave while another drives.
    pub fn drive(&self, until: Instant, ready: &dyn Fn() -> bool, stop: &AtomicBool) -> u64 {
        // A hint, read without the lock: drivers of a broken loop keep
        // away, so that its thread, which steps aside for them, ends.
        if self.broken.load(Ordering::Relaxed) {
            return 0;
        }
        let mut presence = Presence::enter(self);
        let mut rounds = 0;
        let mut got_it = false;
        loop {
            if ready() {
                got_it = true;
                break;
            }
            if stop.load(Ordering::Relaxed)
                || Instant::now() >= until
                || !crate::delivery::may_drive()
            {
                break;
            }
            let worked = match self.state.try_lock() {
                Some(guard) => {
                    // Broken or closed: no round, now or later.
                    let Some(mut held) = self.hold(guard) else {
                        break;
                    };
                    match held.driven_round() {
                        Some(worked) => {
                            rounds += 1;
                            presence.ran = true;
                            worked
                        }
                        None => break,
                    }
                }
                None => false,
            };
            if worked {
                self.driven_work.store(true, Ordering::Relaxed);
            } else {
                std::thread::yield_now();
            }
        }
        drop(presence);
        // A driver that leaves without what it waited for goes on waiting
        // for the loop thread to bring it; and what was asked of the loop
        // while this one drove may have come after its last round.
        if !got_it || self.gate.wanted.swap(false, Ordering::SeqCst) {
            self.gate.wake_or_leave_to_last_driver();
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
    /// thread finds no work, or sleeps for a driver that has just left. A
    /// stream is delivered faster by the loop thread while the reader
    /// consumes it (1 MiB over `tcp;ofi_rxm` lost about a tenth of its
    /// rate with its reader driving).
    fn reader_may_drive(&self) -> bool {
        !self.loop_worked.load(Ordering::Relaxed) || self.gate.asleep.load(Ordering::SeqCst)
    }

    /// For the loop thread while a driver holds the loop: sleeps up to
    /// `limit` instead of yielding. A thread that yields stays runnable,
    /// and where cores are few it takes turns from the driver and from
    /// the peer process the driver exchanges with. It is woken early by
    /// what an application thread asks of the loop ([`DriveHandle::wake_sleeper`])
    /// and by a driver that leaves without its answer (the last one to
    /// leave, while several drive), not as every drive ends: a requester
    /// leaves with its reply and drives again
    /// microseconds later, and the loop thread woken in between would take
    /// the loop from it.
    pub fn sleep_while_driven(&self, limit: Duration) {
        let gate = &self.gate;
        let _ = gate.loop_thread.set(std::thread::current());
        gate.asleep.store(true, Ordering::SeqCst);
        if gate.is_driven() {
            std::thread::park_timeout(limit);
        }
        gate.asleep.store(false, Ordering::SeqCst);
    }

    /// For the loop thread: whether a driver has the loop now (the loop
    /// thread then sleeps rather than runs a round).
    pub fn is_driven(&self) -> bool {
        self.gate.is_driven()
    }

    /// For the loop thread: whether driven rounds found work since it last
    /// asked.
    pub fn take_driven_work(&self) -> bool {
        self.driven_work.swap(false, Ordering::Relaxed)
    }

    /// For the loop thread: the loop, for one of its own rounds; `None`
    /// once it is closed, or broken by a round that panicked (the loop
    /// thread then ends without the shutdown's drain, which would run on
    /// state the panic left half changed).
    pub fn lock(&self) -> Option<HeldLoop<'_, L>> {
        self.hold(self.state.lock())
    }

    /// The loop under `guard`, unless it is closed or broken.
    fn hold<'a>(&'a self, guard: MutexGuard<'a, Option<L>>) -> Option<HeldLoop<'a, L>> {
        if self.broken.load(Ordering::Relaxed) {
            return None;
        }
        let state = MutexGuard::try_map(guard, Option::as_mut).ok()?;
        Some(HeldLoop {
            state,
            driven: self,
            unwinding_before: std::thread::panicking(),
        })
    }

    /// For the loop thread: what its last round found.
    pub fn loop_worked(&self, worked: bool) {
        self.loop_worked.store(worked, Ordering::Relaxed);
    }

    /// For the loop thread, at its end: the loop, to close (none if it is
    /// broken, see [`Driven::lock`]); drivers find it closed from then on.
    pub fn take(&self) -> Option<L> {
        let mut guard = self.state.lock();
        if self.broken.load(Ordering::Relaxed) {
            return None;
        }
        guard.take()
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
        (Arc::new(Driven::new(state, || {}, || {})), rounds)
    }

    /// A loop of [`Counting`] rounds, never busy, that panics at round
    /// `panic_at`; with its rounds run and the panics it recorded
    /// (`on_broken`).
    fn breakable(
        panic_at: u64,
        wake: impl Fn() + Send + Sync + 'static,
    ) -> (Driven<Counting>, Arc<AtomicU64>, Arc<AtomicU64>) {
        let rounds = Arc::new(AtomicU64::new(0));
        let broke = Arc::new(AtomicU64::new(0));
        let on_broken = {
            let broke = broke.clone();
            move || {
                broke.fetch_add(1, Ordering::SeqCst);
            }
        };
        let state = Counting {
            rounds: rounds.clone(),
            busy: 0,
            refuse_at: u64::MAX,
            panic_at,
        };
        (Driven::new(state, wake, on_broken), rounds, broke)
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
            || {},
        );
        let stop = AtomicBool::new(false);
        assert_eq!(driven.drive(far(), &|| false, &stop), 3);
        assert!(!driven.is_driven());
    }

    /// A round that panics on a driver's thread withdraws the driver, wakes
    /// the loop thread and breaks the loop: the loop thread and later
    /// drivers find it gone, its shutdown's drain included. Whether the
    /// panic comes in the drive's first round or a later one.
    #[test]
    fn a_round_that_panics_withdraws_the_driver_and_ends_the_loop() {
        for panic_at in [0, 1] {
            let woken = Arc::new(AtomicBool::new(false));
            let wake = {
                let woken = woken.clone();
                move || woken.store(true, Ordering::SeqCst)
            };
            let (driven, rounds, broke) = breakable(panic_at, wake);
            assert!(driven.lock().is_some(), "whole before the panic");
            let finished = driven.drives_finished();
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
            assert!(
                !driven.may_sleep(finished),
                "nor does it sleep on what it saw before"
            );
            assert_eq!(broke.load(Ordering::SeqCst), 1, "the panic is recorded");
            assert!(driven.lock().is_none(), "the loop thread ends");
            assert_eq!(
                driven.drive(far(), &|| false, &stop),
                0,
                "no round runs on the broken loop"
            );
            assert_eq!(rounds.load(Ordering::SeqCst), panic_at);
            assert!(driven.take().is_none(), "nor its drain");
        }
    }

    /// A panic while the loop thread holds the loop breaks it too, before
    /// a driver can take it.
    #[test]
    fn a_panic_on_the_loop_thread_breaks_the_loop() {
        let (driven, rounds, broke) = breakable(u64::MAX, || {});
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _held = driven.lock();
            panic!("a bug in the loop thread's round");
        }));
        assert!(result.is_err());
        assert_eq!(broke.load(Ordering::SeqCst), 1);
        assert!(driven.lock().is_none());
        // A driver keeps away, not even stepping in: the loop thread
        // steps aside for drivers, and is to end.
        let stop = AtomicBool::new(false);
        let stepped_in = Cell::new(false);
        let ready = || {
            stepped_in.set(true);
            false
        };
        assert_eq!(driven.drive(far(), &ready, &stop), 0);
        assert!(!stepped_in.get());
        assert_eq!(rounds.load(Ordering::SeqCst), 0);
    }

    /// A thread already unwinding from a panic of its own (a `Drop` that
    /// makes a request) may drive: its rounds that end well break nothing.
    #[test]
    fn a_drive_from_a_drop_while_unwinding_breaks_nothing() {
        /// Drives until 3 rounds have run, and counts the drive's rounds
        /// (an assertion failing in a `Drop` while unwinding would abort).
        struct DrivesOnDrop<'a>(&'a Driven<Counting>, &'a AtomicU64, &'a AtomicU64);
        impl Drop for DrivesOnDrop<'_> {
            fn drop(&mut self) {
                let stop = AtomicBool::new(false);
                let rounds = self.1;
                let ran = self
                    .0
                    .drive(far(), &|| rounds.load(Ordering::SeqCst) >= 3, &stop);
                self.2.store(ran, Ordering::SeqCst);
            }
        }
        let (driven, rounds, broke) = breakable(u64::MAX, || {});
        let ran = AtomicU64::new(0);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _drives = DrivesOnDrop(&driven, &rounds, &ran);
            panic!("the application's own");
        }));
        assert!(result.is_err());
        assert_eq!(ran.load(Ordering::SeqCst), 3);
        assert_eq!(rounds.load(Ordering::SeqCst), 3);
        assert_eq!(broke.load(Ordering::SeqCst), 0, "no round panicked");
        assert!(driven.lock().is_some(), "the loop goes on");
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

    /// A loop thread sleeping in [`Driven::sleep_while_driven`] while a
    /// driver is present, once it is asleep. It sleeps again after any
    /// early return that is not a wake (a spurious one, or its 30 s), so
    /// what the tests see is who woke it.
    fn sleeper_under_a_driver(
        driven: &Arc<Driven<Counting>>,
    ) -> (Presence<'_, Counting>, std::thread::JoinHandle<()>) {
        let driver = Presence::enter(driven);
        DRIVING.set(false);
        let (task_tx, task_rx) = std::sync::mpsc::channel();
        let sleeper = {
            let driven = driven.clone();
            std::thread::spawn(move || {
                let _ = task_tx.send(std::fs::read_link("/proc/thread-self"));
                let wakes = driven.gate.sleeper_wakes.load(Ordering::SeqCst);
                while driven.gate.sleeper_wakes.load(Ordering::SeqCst) == wakes {
                    driven.sleep_while_driven(Duration::from_secs(30));
                }
            })
        };
        // Parked, not only about to: a driver that left before the sleeper
        // saw it would leave it looping, never woken, instead.
        let task = task_rx
            .recv()
            .expect("the sleeper's task")
            .expect("/proc/thread-self");
        let parked = || {
            std::fs::read_to_string(std::path::Path::new("/proc").join(&task).join("stat"))
                .ok()
                .and_then(|stat| {
                    stat.rsplit_once(") ")
                        .map(|(_, rest)| rest.starts_with('S'))
                })
                .unwrap_or(false)
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(driven.gate.asleep.load(Ordering::SeqCst) && parked()) {
            assert!(Instant::now() < deadline, "the loop thread did not sleep");
            std::thread::yield_now();
        }
        (driver, sleeper)
    }

    /// A loop thread still asleep after the driver it slept for left with
    /// its answer.
    fn sleeper_after_a_driver(driven: &Arc<Driven<Counting>>) -> std::thread::JoinHandle<()> {
        let (driver, sleeper) = sleeper_under_a_driver(driven);
        drop(driver);
        sleeper
    }

    /// Waits for the sleeper to be woken, failing if it is not.
    fn woken(sleeper: std::thread::JoinHandle<()>) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !sleeper.is_finished() {
            assert!(Instant::now() < deadline, "the loop thread was not woken");
            std::thread::sleep(Duration::from_millis(1));
        }
        sleeper.join().expect("the sleep ended");
    }

    fn wakes(driven: &Driven<Counting>) -> u64 {
        driven.gate.sleeper_wakes.load(Ordering::SeqCst)
    }

    #[test]
    fn the_loop_thread_sleeps_for_a_driver_and_is_woken_by_what_is_asked_of_it() {
        let (driven, _) = counting(0);
        let (driver, sleeper) = sleeper_under_a_driver(&driven);
        // Whatever the loop thread's last round found, a reader drives.
        driven.loop_worked(true);
        assert!(driven.reader_may_drive());
        // A driver is there to do what is asked: the sleep goes on.
        driven.gate.wake_sleeper();
        assert_eq!(wakes(&driven), 0);
        // The driver leaves: that alone does not wake the loop thread...
        drop(driver);
        assert_eq!(wakes(&driven), 0);
        // ...what is asked of the loop with no driver there does.
        driven.gate.wake_sleeper();
        assert_eq!(wakes(&driven), 1);
        woken(sleeper);
        driven.loop_worked(true);
        assert!(!driven.reader_may_drive(), "awake and busy again");
    }

    #[test]
    fn what_is_asked_during_a_drive_wakes_the_loop_thread_when_the_driver_leaves() {
        let (driven, _) = counting(0);
        let sleeper = sleeper_after_a_driver(&driven);
        let stop = AtomicBool::new(false);
        // A drive that ends with its answer, nothing asked meanwhile:
        // the requester will be back.
        assert_eq!(driven.drive(far(), &|| true, &stop), 0);
        assert_eq!(wakes(&driven), 0);
        // Asked while a driver holds the loop, after its last round.
        let asked = || {
            driven.gate.wake_sleeper();
            true
        };
        driven.drive(far(), &asked, &stop);
        assert_eq!(wakes(&driven), 1, "woken as the driver left");
        woken(sleeper);
    }

    #[test]
    fn of_two_drivers_the_last_to_leave_wakes_the_loop_thread() {
        let (driven, _) = counting(0);
        let sleeper = sleeper_after_a_driver(&driven);
        // Another driver, there until its answer comes.
        let answered = Arc::new(AtomicBool::new(false));
        let other = {
            let (driven, answered) = (driven.clone(), answered.clone());
            std::thread::spawn(move || {
                let stop = AtomicBool::new(false);
                driven.drive(far(), &|| answered.load(Ordering::SeqCst), &stop)
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !driven.is_driven() {
            assert!(Instant::now() < deadline, "the other driver did not come");
            std::thread::yield_now();
        }
        // Asked of the loop during this drive, which leaves with its
        // answer while the other driver is still there: nothing to wake
        // yet...
        let stop = AtomicBool::new(false);
        let asked = || {
            driven.gate.wake_sleeper();
            true
        };
        driven.drive(far(), &asked, &stop);
        assert_eq!(wakes(&driven), 0);
        // ...until the other leaves, with its answer too.
        answered.store(true, Ordering::SeqCst);
        other.join().expect("the other drive ended");
        assert_eq!(wakes(&driven), 1, "woken as the last driver left");
        woken(sleeper);
    }

    #[test]
    fn a_wake_made_at_once_owes_none_to_a_later_driver() {
        let (driven, _) = counting(0);
        let sleeper = sleeper_after_a_driver(&driven);
        // No driver is there: what is asked wakes the loop thread now...
        driven.gate.wake_sleeper();
        assert_eq!(wakes(&driven), 1);
        woken(sleeper);
        // ...and leaves no wake owed, which the next driver to leave with
        // its answer would make for nothing.
        assert!(!driven.gate.wanted.load(Ordering::SeqCst));
    }

    #[test]
    fn a_driver_that_gives_up_wakes_the_loop_thread() {
        let (driven, _) = counting(0);
        let sleeper = sleeper_after_a_driver(&driven);
        let stop = AtomicBool::new(false);
        // Out of time without its answer: the loop thread must bring it.
        driven.drive(Instant::now(), &|| false, &stop);
        assert_eq!(wakes(&driven), 1);
        woken(sleeper);
    }

    /// A handle with a loop of [`Counting`] rounds, never busy, installed.
    fn installed() -> (DriveHandle<Counting>, Arc<Driven<Counting>>) {
        let handle = DriveHandle::new();
        let driven = handle.install(
            Counting {
                rounds: Arc::new(AtomicU64::new(0)),
                busy: 0,
                refuse_at: u64::MAX,
                panic_at: u64::MAX,
            },
            || {},
            || {},
        );
        (handle, driven)
    }

    #[test]
    fn a_thread_about_to_drive_leaves_the_loop_thread_asleep() {
        let (handle, driven) = installed();
        let sleeper = sleeper_after_a_driver(&driven);
        // A request's publish: its own drive will send it.
        before_driving(|| handle.wake_sleeper());
        assert_eq!(wakes(&driven), 0);
        // Any other publish wakes the loop thread.
        handle.wake_sleeper();
        assert_eq!(wakes(&driven), 1);
        woken(sleeper);
    }

    #[test]
    fn a_thread_about_to_drive_that_blocks_first_wakes_the_loop_thread() {
        let (handle, driven) = installed();
        let sleeper = sleeper_after_a_driver(&driven);
        // A request's publish that finds its queue full: it waits for the
        // loop thread to make room before any drive of its own.
        before_driving(|| {
            before_blocking(|| handle.wake_sleeper());
            assert!(ABOUT_TO_DRIVE.get(), "still about to drive once room came");
        });
        assert_eq!(wakes(&driven), 1);
        woken(sleeper);
    }

    #[test]
    fn a_sleep_for_a_driver_who_has_gone_is_no_sleep() {
        let (driven, _) = counting(0);
        let started = Instant::now();
        driven.sleep_while_driven(Duration::from_secs(30));
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(!driven.gate.asleep.load(Ordering::SeqCst));
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
