//! In-process publishes bound for remote subscribers (clients and routes),
//! on their way from the publishing threads to the event loop. They wait
//! as runs: messages in publish order, each run for one subject and one
//! set of targets. A stream costs its publishing thread a lock and a push
//! per message, and the loop one take per round; handed over one by one,
//! each message cost both threads the reference counts of its targets and
//! subject, cache lines the other thread had just written.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::error::Error;
use crate::subscriptions::SubRef;

/// One published message, without the subject and targets its run holds.
pub(crate) struct PublishedMessage {
    pub reply: Option<Arc<str>>,
    pub headers: Option<Bytes>,
    pub payload: Bytes,
}

impl PublishedMessage {
    /// What it counts against the queue's bound in bytes.
    pub fn size(&self) -> usize {
        self.payload.len() + self.headers.as_ref().map_or(0, Bytes::len)
    }
}

/// Messages published in a row on one subject for one set of targets.
pub(crate) struct PublishedRun {
    pub targets: Arc<[SubRef]>,
    pub subject: Arc<str>,
    pub messages: Vec<PublishedMessage>,
}

/// The runs waiting for the event loop, bounded in messages and in bytes.
pub(crate) struct PublishedQueue {
    state: Mutex<State>,
    /// Whether `state.runs` holds any, written under the lock: a loop
    /// round finds an idle queue without taking it.
    has_runs: AtomicBool,
    /// Signalled when the loop makes room or the queue closes.
    room: Condvar,
    /// Messages waiting or taken and not yet delivered, at most.
    capacity: usize,
    /// Their payload and header bytes: a message is taken while fewer
    /// wait (so they pass it by one message at most, and a large one is
    /// not passed over for small ones that fit).
    capacity_bytes: usize,
}

struct State {
    runs: Vec<PublishedRun>,
    /// Messages in `runs` and those the loop took and has not yet
    /// reported delivered: what the bound counts.
    queued: usize,
    /// Their payload and header bytes.
    queued_bytes: usize,
    /// Messages ever pushed: a flush waits for the loop to have delivered
    /// as many.
    pushed: u64,
    producers_waiting: usize,
    /// Set when the loop ends: no more messages are accepted (the loop
    /// still takes what waits).
    closed: bool,
}

impl PublishedQueue {
    pub fn new(capacity: usize, capacity_bytes: usize) -> PublishedQueue {
        PublishedQueue {
            state: Mutex::new(State {
                runs: Vec::new(),
                queued: 0,
                queued_bytes: 0,
                pushed: 0,
                producers_waiting: 0,
                closed: false,
            }),
            has_runs: AtomicBool::new(false),
            room: Condvar::new(),
            capacity,
            capacity_bytes,
        }
    }

    /// Whether `state` takes no more messages for now.
    fn full(&self, state: &State) -> bool {
        state.queued >= self.capacity || state.queued_bytes >= self.capacity_bytes
    }

    /// Queues `message` for `targets`, behind the last run when it is for
    /// the same targets and subject (the same shared values, as a
    /// publishing thread's cache passes them). While the queue is full it
    /// waits up to `timeout` for room, then fails with
    /// [`Error::Blocked`]; [`Error::Closed`] once the loop has shut down.
    /// `wake` wakes the loop, given whether the queue had nothing waiting
    /// (a loop that took everything before finds the others when it next
    /// looks); also called before waiting for room.
    pub fn push(
        &self,
        targets: &Arc<[SubRef]>,
        subject: &Arc<str>,
        message: PublishedMessage,
        timeout: Duration,
        wake: impl Fn(bool),
    ) -> Result<(), Error> {
        let size = message.size();
        let mut state = self.state.lock();
        if self.full(&state) && !state.closed {
            self.wait_for_room(&mut state, timeout, &wake)?;
        }
        if state.closed {
            return Err(Error::Closed);
        }
        let first = state.runs.is_empty();
        if first {
            self.has_runs.store(true, Ordering::Release);
        }
        match state.runs.last_mut() {
            Some(run)
                if Arc::ptr_eq(&run.targets, targets) && Arc::ptr_eq(&run.subject, subject) =>
            {
                run.messages.push(message)
            }
            _ => state.runs.push(PublishedRun {
                targets: Arc::clone(targets),
                subject: Arc::clone(subject),
                messages: vec![message],
            }),
        }
        state.queued += 1;
        state.queued_bytes += size;
        state.pushed += 1;
        drop(state);
        wake(first);
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn wait_for_room(
        &self,
        state: &mut MutexGuard<'_, State>,
        timeout: Duration,
        wake: &impl Fn(bool),
    ) -> Result<(), Error> {
        let deadline = Instant::now().checked_add(timeout);
        while self.full(state) && !state.closed {
            MutexGuard::unlocked(state, || crate::drive::before_blocking(|| wake(true)));
            state.producers_waiting += 1;
            let timed_out = match deadline {
                Some(deadline) => self.room.wait_until(state, deadline).timed_out(),
                None => {
                    self.room.wait(state);
                    false
                }
            };
            state.producers_waiting -= 1;
            if timed_out && self.full(state) && !state.closed {
                return Err(Error::Blocked(timeout));
            }
        }
        Ok(())
    }

    /// For the loop: moves the waiting runs into `runs`, which must be
    /// empty. They count against the bound until reported [`delivered`].
    /// A push that comes while this looks is found next time.
    ///
    /// [`delivered`]: Self::delivered
    pub fn take(&self, runs: &mut Vec<PublishedRun>) {
        debug_assert!(runs.is_empty());
        if !self.has_runs.load(Ordering::Acquire) {
            return;
        }
        let mut state = self.state.lock();
        std::mem::swap(&mut state.runs, runs);
        self.has_runs.store(false, Ordering::Release);
    }

    /// For the loop: `count` messages it took, of `bytes` in all (as
    /// [`PublishedMessage::size`] counts them), are delivered, which makes
    /// room for them.
    pub fn delivered(&self, count: usize, bytes: usize) {
        let mut state = self.state.lock();
        state.queued -= count.min(state.queued);
        state.queued_bytes -= bytes.min(state.queued_bytes);
        if state.producers_waiting > 0 {
            self.room.notify_all();
        }
    }

    /// Whether messages wait to be delivered: in the queue, or taken by
    /// the loop and not yet reported delivered.
    pub fn outstanding(&self) -> bool {
        self.state.lock().queued > 0
    }

    /// Messages pushed so far.
    pub fn pushed(&self) -> u64 {
        self.state.lock().pushed
    }

    /// For the loop as it ends (shut down, or broken by a panic): later
    /// pushes fail with [`Error::Closed`], and producers waiting for room
    /// stop waiting. What waits still is the loop's to take.
    pub fn close(&self) {
        let mut state = self.state.lock();
        state.closed = true;
        self.room.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn message(byte: u8) -> PublishedMessage {
        PublishedMessage {
            reply: None,
            headers: None,
            payload: Bytes::from(vec![byte]),
        }
    }

    fn payloads(runs: &[PublishedRun]) -> Vec<Vec<u8>> {
        runs.iter()
            .map(|run| run.messages.iter().map(|m| m.payload[0]).collect())
            .collect()
    }

    fn targets(sid: u64) -> Arc<[SubRef]> {
        Arc::from(vec![SubRef { owner: 1, sid }])
    }

    /// A producer pushing `byte` on a thread of its own, once it waits
    /// for room.
    fn push_waiting(
        queue: &Arc<PublishedQueue>,
        targets: &Arc<[SubRef]>,
        subject: &Arc<str>,
        byte: u8,
    ) -> std::thread::JoinHandle<Result<(), Error>> {
        let (shared, targets, subject) = (queue.clone(), targets.clone(), subject.clone());
        let waiting = std::thread::spawn(move || {
            shared.push(
                &targets,
                &subject,
                message(byte),
                Duration::from_secs(30),
                |_| {},
            )
        });
        while queue.state.lock().producers_waiting == 0 {
            std::thread::yield_now();
        }
        waiting
    }

    #[test]
    fn messages_for_the_same_targets_and_subject_join_one_run_in_order() {
        let queue = PublishedQueue::new(16, usize::MAX);
        let (a, b) = (targets(1), targets(2));
        let (x, y): (Arc<str>, Arc<str>) = (Arc::from("x"), Arc::from("y"));
        let wakes = Cell::new(0);
        let wake = |first: bool| wakes.set(wakes.get() + u32::from(first));
        let second = Duration::from_secs(1);
        for (targets, subject, byte) in [
            (&a, &x, 1),
            (&a, &x, 2),
            (&b, &x, 3),
            (&b, &y, 4),
            (&b, &y, 5),
        ] {
            queue
                .push(targets, subject, message(byte), second, wake)
                .unwrap();
        }
        // Only the first push found the queue empty.
        assert_eq!(wakes.get(), 1);
        assert_eq!(queue.pushed(), 5);
        let mut runs = Vec::new();
        queue.take(&mut runs);
        assert_eq!(payloads(&runs), vec![vec![1, 2], vec![3], vec![4, 5]]);
        assert!(Arc::ptr_eq(&runs[2].targets, &b) && Arc::ptr_eq(&runs[2].subject, &y));
        // Taken, the messages wait until reported delivered.
        assert!(queue.outstanding());
        queue.delivered(5, 5);
        assert!(!queue.outstanding());
        // Emptied by the take, the queue wakes the loop again.
        queue.push(&a, &x, message(6), second, wake).unwrap();
        assert_eq!(wakes.get(), 2);
    }

    #[test]
    fn a_full_queue_blocks_until_the_loop_reports_delivery() {
        let queue = Arc::new(PublishedQueue::new(2, usize::MAX));
        let (a, x): (Arc<[SubRef]>, Arc<str>) = (targets(1), Arc::from("x"));
        let short = Duration::from_millis(20);
        queue.push(&a, &x, message(1), short, |_| {}).unwrap();
        queue.push(&a, &x, message(2), short, |_| {}).unwrap();
        assert!(matches!(
            queue.push(&a, &x, message(3), short, |_| {}),
            Err(Error::Blocked(_))
        ));
        // Taken but not delivered: still counted against the bound.
        let mut runs = Vec::new();
        queue.take(&mut runs);
        assert!(matches!(
            queue.push(&a, &x, message(3), short, |_| {}),
            Err(Error::Blocked(_))
        ));
        // A producer waiting for room goes on once the loop reports the
        // two delivered.
        let waiting = push_waiting(&queue, &a, &x, 3);
        queue.delivered(2, 2);
        waiting.join().unwrap().unwrap();
        let mut last = Vec::new();
        queue.take(&mut last);
        assert_eq!(payloads(&last), vec![vec![3]]);
    }

    #[test]
    fn the_bytes_waiting_are_bounded_past_by_one_message_at_most() {
        let queue = Arc::new(PublishedQueue::new(100, 10));
        let (a, x): (Arc<[SubRef]>, Arc<str>) = (targets(1), Arc::from("x"));
        let sized = |len: usize| PublishedMessage {
            reply: None,
            headers: Some(Bytes::from(vec![0; 2])),
            payload: Bytes::from(vec![7; len]),
        };
        let short = Duration::from_millis(20);
        // A message larger than the bound goes in while less waits.
        queue.push(&a, &x, sized(30), short, |_| {}).unwrap();
        assert!(matches!(
            queue.push(&a, &x, sized(1), short, |_| {}),
            Err(Error::Blocked(_))
        ));
        let mut runs = Vec::new();
        queue.take(&mut runs);
        queue.delivered(1, 32);
        // Headers count: 4 + 4 bytes are under 10, 12 are not.
        for _ in 0..3 {
            queue.push(&a, &x, sized(2), short, |_| {}).unwrap();
        }
        assert!(matches!(
            queue.push(&a, &x, sized(2), short, |_| {}),
            Err(Error::Blocked(_))
        ));
    }

    #[test]
    fn a_closed_queue_refuses_pushes_and_releases_waiting_producers() {
        let queue = Arc::new(PublishedQueue::new(1, usize::MAX));
        let (a, x): (Arc<[SubRef]>, Arc<str>) = (targets(1), Arc::from("x"));
        queue
            .push(&a, &x, message(1), Duration::ZERO, |_| {})
            .unwrap();
        let waiting = push_waiting(&queue, &a, &x, 2);
        queue.close();
        assert!(matches!(waiting.join().unwrap(), Err(Error::Closed)));
        // What was queued before the close is still the loop's.
        let mut runs = Vec::new();
        queue.take(&mut runs);
        assert_eq!(payloads(&runs), vec![vec![1]]);
    }
}
