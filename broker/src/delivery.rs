//! Messages as applications see them, subscriptions, and the bounded
//! in-process queue behind each subscription with its slow-consumer policy.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};

use crate::config::SlowConsumerPolicy;
use crate::error::RecvError;

/// A message received by a subscription.
///
/// Cloning is cheap: the subject is shared and the payload is a reference
/// counted buffer, so in-process fan-out never copies payload bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub subject: Arc<str>,
    /// Where to send a reply, for requests.
    pub reply: Option<Arc<str>>,
    pub payload: Bytes,
}

/// Counters of one subscription.
#[derive(Debug, Default)]
pub struct SubscriptionStats {
    delivered: AtomicU64,
    dropped: AtomicU64,
}

impl SubscriptionStats {
    /// Messages queued for this subscription.
    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }

    /// Messages discarded by the slow-consumer policy.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// What happened to one delivery attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    Queued,
    /// Queued after discarding this many older messages (counted).
    QueuedDroppingOldest(u64),
    /// Discarded (counted): the block timeout passed without room.
    Dropped,
    /// The subscription is closed (dropped by the application, or cut off
    /// under the disconnect policy).
    Closed,
}

/// The producer side of a subscription's bounded queue.
pub(crate) struct LocalSink {
    tx: Sender<Message>,
    /// Messages the queue may hold.
    capacity: usize,
    /// A receiver kept by the producer so drop-oldest can discard the head.
    head: Receiver<Message>,
    policy: SlowConsumerPolicy,
    block_timeout: Duration,
    stats: Arc<SubscriptionStats>,
    closed: AtomicBool,
}

impl LocalSink {
    /// A queue of `capacity` messages and the subscription reading it.
    pub(crate) fn new(
        capacity: usize,
        policy: SlowConsumerPolicy,
        block_timeout: Duration,
    ) -> (LocalSink, Receiver<Message>, Arc<SubscriptionStats>) {
        // An unbounded channel grows in small blocks as messages arrive; the
        // bound is enforced here. (A bounded channel would allocate and
        // initialise every slot up front, which makes short-lived
        // subscriptions such as request inboxes expensive.)
        let (tx, rx) = crossbeam_channel::unbounded();
        let stats = Arc::new(SubscriptionStats::default());
        let sink = LocalSink {
            tx,
            capacity: capacity.max(1),
            head: rx.clone(),
            policy,
            block_timeout,
            stats: stats.clone(),
            closed: AtomicBool::new(false),
        };
        (sink, rx, stats)
    }

    pub(crate) fn deliver(&self, message: Message) -> Delivery {
        if self.closed.load(Ordering::Relaxed) {
            return Delivery::Closed;
        }
        if self.tx.len() >= self.capacity {
            return self.deliver_when_full(message);
        }
        self.push(message, Delivery::Queued)
    }

    fn push(&self, message: Message, outcome: Delivery) -> Delivery {
        match self.tx.send(message) {
            Ok(()) => {
                self.stats.delivered.fetch_add(1, Ordering::Relaxed);
                outcome
            }
            Err(_) => Delivery::Closed,
        }
    }

    fn deliver_when_full(&self, message: Message) -> Delivery {
        match self.policy {
            SlowConsumerPolicy::Block => {
                // Wait for the reader to make room, sleeping in short steps:
                // blocking is the rare, already slow path.
                let deadline = Instant::now() + self.block_timeout;
                while self.tx.len() >= self.capacity {
                    if self.closed.load(Ordering::Relaxed) {
                        return Delivery::Closed;
                    }
                    if Instant::now() >= deadline {
                        self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                        return Delivery::Dropped;
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
                self.push(message, Delivery::Queued)
            }
            SlowConsumerPolicy::DropOldest => {
                // The reader may drain concurrently; each discarded head is
                // counted.
                let mut dropped = 0;
                while self.tx.len() >= self.capacity && self.head.try_recv().is_ok() {
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    dropped += 1;
                }
                self.push(message, Delivery::QueuedDroppingOldest(dropped))
            }
            SlowConsumerPolicy::Disconnect => {
                self.close();
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                Delivery::Closed
            }
        }
    }

    /// Stop accepting messages. What is queued stays readable; the
    /// subscription ends once it is drained and the sink is dropped.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

/// Called when a [`Subscription`] is dropped, to remove its interest.
pub(crate) trait Unsubscriber: Send + Sync {
    fn unsubscribe(&self, sid: u64);
}

/// A stream of messages matching a pattern. Dropping it unsubscribes.
///
/// `recv` blocks; `recv_timeout` and `try_recv` bound the wait; iterating
/// yields messages until the subscription ends (unsubscribed, cut off as a
/// slow consumer, or the broker or client shut down).
pub struct Subscription {
    sid: u64,
    pattern: String,
    queue: Option<String>,
    rx: Receiver<Message>,
    stats: Arc<SubscriptionStats>,
    owner: Arc<dyn Unsubscriber>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("sid", &self.sid)
            .field("pattern", &self.pattern)
            .field("queue", &self.queue)
            .finish()
    }
}

impl Subscription {
    pub(crate) fn new(
        sid: u64,
        pattern: String,
        queue: Option<String>,
        rx: Receiver<Message>,
        stats: Arc<SubscriptionStats>,
        owner: Arc<dyn Unsubscriber>,
    ) -> Subscription {
        Subscription {
            sid,
            pattern,
            queue,
            rx,
            stats,
            owner,
        }
    }

    /// The subscription id, unique within its broker or client.
    pub fn sid(&self) -> u64 {
        self.sid
    }

    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    pub fn queue_group(&self) -> Option<&str> {
        self.queue.as_deref()
    }

    /// Delivery and drop counters.
    pub fn stats(&self) -> &SubscriptionStats {
        &self.stats
    }

    /// Messages waiting to be read.
    pub fn pending(&self) -> usize {
        self.rx.len()
    }

    /// Wait for the next message.
    pub fn recv(&self) -> Result<Message, RecvError> {
        self.rx.recv().map_err(|_| RecvError::Closed)
    }

    /// Wait at most `timeout` for the next message.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Message, RecvError> {
        self.rx.recv_timeout(timeout).map_err(|err| match err {
            RecvTimeoutError::Timeout => RecvError::Timeout,
            RecvTimeoutError::Disconnected => RecvError::Closed,
        })
    }

    /// The next message if one is waiting.
    pub fn try_recv(&self) -> Result<Message, RecvError> {
        self.rx.try_recv().map_err(|err| match err {
            TryRecvError::Empty => RecvError::Empty,
            TryRecvError::Disconnected => RecvError::Closed,
        })
    }
}

impl Iterator for Subscription {
    type Item = Message;

    fn next(&mut self) -> Option<Message> {
        self.rx.recv().ok()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.owner.unsubscribe(self.sid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(n: u8) -> Message {
        Message {
            subject: "a".into(),
            reply: None,
            payload: Bytes::from(vec![n]),
        }
    }

    #[test]
    fn drop_oldest_keeps_the_newest_and_counts() {
        let (sink, rx, stats) = LocalSink::new(2, SlowConsumerPolicy::DropOldest, Duration::ZERO);
        for n in 0..5 {
            sink.deliver(message(n));
        }
        let kept: Vec<u8> = rx.try_iter().map(|m| m.payload[0]).collect();
        assert_eq!(kept, vec![3, 4]);
        assert_eq!(stats.dropped(), 3);
    }

    #[test]
    fn block_waits_then_drops_and_counts() {
        let (sink, rx, stats) =
            LocalSink::new(1, SlowConsumerPolicy::Block, Duration::from_millis(20));
        assert_eq!(sink.deliver(message(0)), Delivery::Queued);
        assert_eq!(sink.deliver(message(1)), Delivery::Dropped);
        assert_eq!(stats.dropped(), 1);
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            rx.recv().map(|m| m.payload[0])
        });
        let sink = LocalSink {
            block_timeout: Duration::from_secs(5),
            ..sink
        };
        assert_eq!(
            sink.deliver(message(2)),
            Delivery::Queued,
            "reader made room"
        );
        assert_eq!(reader.join().unwrap(), Ok(0));
    }

    #[test]
    fn disconnect_closes_the_sink() {
        let (sink, rx, stats) = LocalSink::new(1, SlowConsumerPolicy::Disconnect, Duration::ZERO);
        assert_eq!(sink.deliver(message(0)), Delivery::Queued);
        assert_eq!(sink.deliver(message(1)), Delivery::Closed);
        assert_eq!(sink.deliver(message(2)), Delivery::Closed);
        assert_eq!(stats.dropped(), 1);
        assert_eq!(rx.try_recv().map(|m| m.payload[0]), Ok(0));
    }
}
