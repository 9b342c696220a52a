//! How application threads hand work to an event loop thread and wake it
//! only when it is about to sleep: [`Parker`] holds the wake-on-park logic,
//! [`CommandQueue`] is a bounded queue of commands built on it.

use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::time::Duration;

use crossbeam_channel::{Receiver, SendTimeoutError, Sender, TrySendError};
use mio::Waker;

use crate::error::Error;

/// The loop's side announces that it is about to sleep; producers wake it
/// only then, so a busy loop costs them no system call.
pub(crate) struct Parker {
    waker: Waker,
    /// Set by the loop before it sleeps, so producers wake it only then.
    parked: AtomicBool,
}

impl Parker {
    pub fn new(waker: Waker) -> Parker {
        Parker {
            waker,
            parked: AtomicBool::new(false),
        }
    }

    /// Called by a producer after it made work visible to the loop. The
    /// fence orders that work before the read of the flag (it pairs with
    /// the fence in [`Parker::park`]).
    pub fn wake_if_parked(&self) {
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) && self.parked.swap(false, Ordering::SeqCst) {
            self.wake();
        }
    }

    /// Wake the loop whether or not it sleeps (e.g. for shutdown).
    pub fn wake(&self) {
        // A failed wake means the loop is gone; nothing is left to tell.
        let _ = self.waker.wake();
    }

    /// Called by the loop before it sleeps: announces the sleep, then asks
    /// `idle` once more whether there is work. The full fence pairs with the
    /// producers' read of the flag, so either a producer sees the flag or the
    /// loop sees its work. Returns false (and stays awake) when work is
    /// waiting.
    pub fn park(&self, idle: impl FnOnce() -> bool) -> bool {
        self.parked.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if idle() {
            return true;
        }
        self.unpark();
        false
    }

    /// Called by the loop when it wakes.
    pub fn unpark(&self) {
        self.parked.store(false, Ordering::Release);
    }
}

/// The sending side of a bounded command queue, shared by application
/// threads.
pub(crate) struct CommandQueue<C> {
    commands: Sender<C>,
    parker: Parker,
}

impl<C> CommandQueue<C> {
    /// A queue of `capacity` commands, and the receiver the loop drains.
    pub fn new(waker: Waker, capacity: usize) -> (CommandQueue<C>, Receiver<C>) {
        let (commands, receiver) = crossbeam_channel::bounded(capacity);
        let queue = CommandQueue {
            commands,
            parker: Parker::new(waker),
        };
        (queue, receiver)
    }

    /// Queue a command; when the queue is full, wait up to `timeout`.
    /// `also_wake` wakes the loop thread where it may sleep outside the
    /// parker, each time this does (before waiting for room, and after).
    pub fn send(&self, command: C, timeout: Duration, also_wake: impl Fn()) -> Result<(), Error> {
        let result = match self.commands.try_send(command) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(command)) => {
                self.parker.wake_if_parked();
                crate::drive::before_blocking(&also_wake);
                self.commands
                    .send_timeout(command, timeout)
                    .map_err(|err| match err {
                        SendTimeoutError::Timeout(_) => Error::Blocked(timeout),
                        SendTimeoutError::Disconnected(_) => Error::Closed,
                    })
            }
            Err(TrySendError::Disconnected(_)) => Err(Error::Closed),
        };
        self.parker.wake_if_parked();
        also_wake();
        result
    }

    /// Whether commands wait for the loop.
    pub fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }

    /// Wake the loop whether or not it sleeps (e.g. for shutdown).
    pub fn wake(&self) {
        self.parker.wake();
    }

    /// Wake the loop if it sleeps.
    pub fn wake_if_parked(&self) {
        self.parker.wake_if_parked();
    }

    /// Called by the loop before it sleeps; false (stay awake) when
    /// commands are waiting (unless the loop `holds_commands`: it reads
    /// none for now) or `idle` says there is other work. See
    /// [`Parker::park`].
    pub fn park(
        &self,
        receiver: &Receiver<C>,
        holds_commands: bool,
        idle: impl FnOnce() -> bool,
    ) -> bool {
        self.parker
            .park(|| (holds_commands || receiver.is_empty()) && idle())
    }

    /// Called by the loop when it wakes.
    pub fn unpark(&self) {
        self.parker.unpark();
    }
}
