//! The bounded queue through which application threads hand work to an
//! event loop thread, waking the loop only when it is about to sleep.

use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::time::Duration;

use crossbeam_channel::{Receiver, SendTimeoutError, Sender, TrySendError};
use mio::Waker;

use crate::error::Error;

/// The sending side, shared by application threads.
pub(crate) struct LoopInbox<C> {
    commands: Sender<C>,
    waker: Waker,
    /// Set by the loop before it sleeps, so senders wake it only then.
    parked: AtomicBool,
}

impl<C> LoopInbox<C> {
    /// An inbox of `capacity` commands, and the receiver the loop drains.
    pub fn new(waker: Waker, capacity: usize) -> (LoopInbox<C>, Receiver<C>) {
        let (commands, receiver) = crossbeam_channel::bounded(capacity);
        let inbox = LoopInbox {
            commands,
            waker,
            parked: AtomicBool::new(false),
        };
        (inbox, receiver)
    }

    /// Queue a command; when the queue is full, wait up to `timeout`.
    pub fn send(&self, command: C, timeout: Duration) -> Result<(), Error> {
        let result = match self.commands.try_send(command) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(command)) => {
                self.wake_if_parked();
                self.commands
                    .send_timeout(command, timeout)
                    .map_err(|err| match err {
                        SendTimeoutError::Timeout(_) => Error::Blocked(timeout),
                        SendTimeoutError::Disconnected(_) => Error::Closed,
                    })
            }
            Err(TrySendError::Disconnected(_)) => Err(Error::Closed),
        };
        self.wake_if_parked();
        result
    }

    fn wake_if_parked(&self) {
        if self.parked.swap(false, Ordering::SeqCst) {
            self.wake();
        }
    }

    /// Wake the loop whether or not it sleeps (e.g. for shutdown).
    pub fn wake(&self) {
        // A failed wake means the loop is gone; nothing is left to tell.
        let _ = self.waker.wake();
    }

    /// Called by the loop before it sleeps: announces the sleep, then looks
    /// at the queue once more. The full fence pairs with the senders' swap,
    /// so either a sender sees the flag or the loop sees its command. Returns
    /// false (and stays awake) when commands are waiting.
    pub fn park(&self, receiver: &Receiver<C>) -> bool {
        self.parked.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if receiver.is_empty() {
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
