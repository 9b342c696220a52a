//! Messages as applications see them, subscriptions, and the bounded
//! in-process queue behind each subscription with its slow-consumer policy.
//!
//! # The queue
//!
//! Producers (publishing threads, the event loop, a client's I/O thread)
//! append under one short lock (a client's I/O thread and the event loop
//! queue the messages they read in a row for one subscription under one
//! hold while the queue has room, then one by one). The reader takes up
//! to a batch of messages per visit into its own buffer and hands them out
//! from there, so a reader that keeps up takes the shared lock once per
//! batch rather than once per message. A producer wakes the reader only
//! when it is parked; a reader that finds nothing spins briefly, then
//! yields, then parks. While it would yield, a reader may run its owner's
//! event loop itself (a client's readers, an embedded broker's reply
//! inbox; [`SubscriptionOwner::drive`]), so its next message needs no
//! hand-over from the loop thread; under
//! `block`, what a round run by a thread delivers into a queue that same
//! thread reads may go past the bound by one round's messages, since the
//! round cannot wait for a reader that is running it ([`may_drive`]).
//!
//! The bound counts every message not yet handed to the application: those
//! in the shared queue and those in the reader's buffer. The reader publishes
//! how many it has handed out, so the count is exact when it matters. Its
//! batch is limited so that the policies keep their meaning: under
//! `drop-oldest` and `disconnect` at most a quarter of the bound sits in the
//! reader's buffer, and `drop-oldest` discards the oldest messages the reader
//! has not taken yet (the ones it has taken are already on their way out).
//!
//! Entries are the payloads alone (32 bytes, two per cache line). Subjects
//! and reply subjects travel beside them as marks, by sequence number: a
//! subject mark only where the subject changes, a reply mark only for a
//! request. A stream on one subject therefore queues no string at all, and
//! a reader that keeps seeing one subject switches to its own copy of it, so
//! the reference counting of the messages it hands out stays on its thread.
//!
//! # Responders
//!
//! A [`Responder`]'s sink has no reader: the thread that delivers a message
//! to it (the event loop, a thread driving it, or an in-process publisher)
//! runs the handler at once and keeps the reply in a per-thread list
//! ([`take_answers`]); the delivering code publishes it once it is done
//! delivering, so a request is answered with no hand-over to another
//! thread.

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::transport::{detach, Detacher};
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::config::SlowConsumerPolicy;
use crate::error::RecvError;

/// Entries per chunk of the shared queue. The reader takes a whole chunk
/// per visit (moving a buffer, not its entries), so this is also its
/// largest batch.
const CHUNK: usize = 256;
/// Emptied chunks kept for reuse.
const SPARE_CHUNKS: usize = 2;
/// Rounds of busy waiting (doubling each round) before a reader yields.
const SPIN_ROUNDS: u32 = 7;
/// How long a thread waiting for a message yields before it sleeps, at
/// least (see [`YieldWindow`]).
const YIELD_MIN: Duration = Duration::from_micros(20);
/// A reader that finds more than one but fewer entries than this waits a
/// little longer before looking again next time, and so takes fewer,
/// larger batches: each visit moves the lock's cache lines away from the
/// producer.
const SMALL_BATCH: usize = 64;
/// Most spin-loop hints a reader waits before looking for a new batch
/// (some microseconds; a hint takes tens of nanoseconds).
const MAX_GAP: u32 = 256;
/// Messages in a row on one subject after which a reader switches to its
/// own copy of the subject string.
const OWN_SUBJECT_AFTER: u32 = 64;
/// A reader that took its last batch less than this long ago is streaming:
/// only then does it wait for a batch to gather. Otherwise (a request now
/// and then) it takes what is there at once.
const STREAMING: Duration = Duration::from_micros(20);

/// A message received by a subscription.
///
/// Cloning is cheap: the subject is shared and the payload is a reference
/// counted buffer, so in-process fan-out never copies payload bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub subject: Arc<str>,
    /// Where to send a reply, for requests.
    pub reply: Option<Arc<str>>,
    /// The publisher's header block (`NATS/1.0\r\nName: value\r\n\r\n`),
    /// as it was published; see [`efabus_core::headers`].
    pub headers: Option<Bytes>,
    pub payload: Bytes,
}

/// Counters of one subscription.
#[derive(Debug, Default)]
pub struct SubscriptionStats {
    delivered: AtomicU64,
    /// Discarded by this subscription's own queue.
    dropped: AtomicU64,
    /// Discarded by the broker before they reached this side.
    dropped_by_broker: AtomicU64,
}

impl SubscriptionStats {
    /// Messages queued for this subscription.
    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }

    /// Messages discarded by the slow-consumer policy: the sum of those its
    /// own queue discarded (`limits.subscription_queue`, or the client's
    /// `subscription_queue`) and, for a [`crate::Client`]'s subscription,
    /// those the broker discarded for it under `drop-oldest` before they
    /// reached the client ([`Self::dropped_by_broker`]). So for a
    /// subscription nothing else takes from, `delivered() + dropped()` is
    /// what was published to it while its connection was up, once the
    /// broker's last report has arrived (it reports at most every 100 ms,
    /// and while the subscriber takes nothing, only once it takes again).
    /// Messages lost with a connection are not in it (the broker counts
    /// them in `connection_drops`).
    pub fn dropped(&self) -> u64 {
        self.dropped
            .load(Ordering::Relaxed)
            .saturating_add(self.dropped_by_broker())
    }

    /// A responder's reply that could not be published.
    pub(crate) fn count_unanswered(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Of [`Self::dropped`], the messages the broker reported it discarded
    /// for this subscription (always 0 for an in-process subscription).
    pub fn dropped_by_broker(&self) -> u64 {
        self.dropped_by_broker.load(Ordering::Relaxed)
    }
}

/// Adds to a counter that is only written under the queue's lock: a plain
/// load and store, no locked instruction. (`dropped` is also counted
/// outside the lock, by the event loop, so it is always added to
/// atomically.)
fn bump(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed) + n, Ordering::Relaxed);
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
    /// Not queued: the queue is full under the block policy, and the
    /// caller holds the message rather than wait ([`LocalSink::try_deliver`]).
    Full,
}

/// What changes at one entry of the queue, besides its payload.
struct Mark {
    /// The entry's sequence number (see [`State::head_seq`]).
    seq: u64,
    /// The subject from this entry on.
    subject: Option<Arc<str>>,
    /// This entry's reply subject.
    reply: Option<Arc<str>>,
    /// This entry's header block.
    headers: Option<Bytes>,
}

/// The part of a queue behind its lock.
struct State {
    /// The oldest payloads, in full chunks of [`CHUNK`], oldest first.
    full: VecDeque<VecDeque<Bytes>>,
    /// The newest payloads, after those in `full`: the chunk being filled.
    tail: VecDeque<Bytes>,
    /// Entries in `full` and `tail`.
    len: usize,
    spare: Vec<VecDeque<Bytes>>,
    /// Every entry has a sequence number, counted from 0 in push order;
    /// this is the oldest one's still in the shared queue (taken or
    /// discarded entries advance it).
    head_seq: u64,
    /// Subject and reply changes, oldest first: those of entries still in
    /// the shared queue, and at most one subject mark left by discarded
    /// entries (sequence number below `head_seq`).
    marks: VecDeque<Mark>,
    /// The subject of the newest entry. Holding it also keeps its address
    /// from being reused, so a producer passing the same string again can
    /// be recognised by address.
    last_subject: Option<Arc<str>>,
    /// Messages moved to the reader's buffer, in total.
    taken: u64,
    /// The reader's `handed` count as last seen (never above the real one).
    handed_seen: u64,
    /// The reader's `handed` count when a producer last waited out the
    /// block timeout: while the reader has taken nothing since, the next
    /// messages are dropped without waiting again (a run received for a
    /// stalled reader would otherwise wait the timeout once per message).
    stalled_at: Option<u64>,
    /// No more messages are accepted; the reader drains what is queued.
    closed: bool,
    readers_waiting: usize,
    producers_waiting: usize,
    /// Copies received payloads that would hold their read buffers.
    detacher: Detacher,
}

impl State {
    /// Messages not yet handed to the application, counting the reader's
    /// buffer as of `handed_seen`.
    fn queued(&self) -> u64 {
        self.len as u64 + self.taken.saturating_sub(self.handed_seen)
    }

    #[inline]
    fn push(&mut self, payload: Bytes) {
        if self.tail.len() >= CHUNK {
            self.seal_tail();
        }
        self.tail.push_back(payload);
        self.len += 1;
    }

    /// Moves the full tail chunk behind the older ones and starts a new
    /// one. (A queue's first chunk grows with use, so that subscriptions
    /// that see a message or two, such as request inboxes, stay small.)
    #[cold]
    fn seal_tail(&mut self) {
        let mut fresh = self
            .spare
            .pop()
            .unwrap_or_else(|| VecDeque::with_capacity(CHUNK));
        // A backlog is building up. Write every slot of the new chunk once,
        // now: the reader read these cache lines last (or they are new),
        // and claiming them back in one burst costs far less than one
        // stalled push per line.
        fresh.extend(std::iter::repeat_with(Bytes::new).take(CHUNK));
        fresh.clear();
        let sealed = std::mem::replace(&mut self.tail, fresh);
        self.full.push_back(sealed);
    }

    fn pop_front(&mut self) -> Option<Bytes> {
        let entry = match self.full.front_mut() {
            Some(chunk) => {
                let entry = chunk.pop_front();
                if chunk.is_empty() {
                    if let Some(spent) = self.full.pop_front() {
                        self.recycle(spent);
                    }
                }
                entry
            }
            None => self.tail.pop_front(),
        };
        if entry.is_some() {
            self.len -= 1;
            self.head_seq += 1;
        }
        entry
    }

    /// After entries were discarded: drops the marks of discarded entries,
    /// keeping the subject they leave in force for the entries after them.
    fn prune_marks(&mut self) {
        let mut subject = None;
        while let Some(mark) = self.marks.front() {
            if mark.seq >= self.head_seq {
                break;
            }
            if let Some(Mark {
                subject: Some(changed),
                ..
            }) = self.marks.pop_front()
            {
                subject = Some(changed);
            }
        }
        if let Some(subject) = subject {
            self.marks.push_front(Mark {
                seq: self.head_seq.saturating_sub(1),
                subject: Some(subject),
                reply: None,
                headers: None,
            });
        }
    }

    /// Moves the oldest chunk into `buf` (which must be empty), or its
    /// first `limit` entries if it holds more; returns how many.
    fn take(&mut self, limit: usize, buf: &mut VecDeque<Bytes>) -> usize {
        if self.len == 0 {
            return 0;
        }
        let count = match self.full.front_mut() {
            Some(chunk) if chunk.len() <= limit => {
                let count = chunk.len();
                if let Some(chunk) = self.full.pop_front() {
                    let spent = std::mem::replace(buf, chunk);
                    self.recycle(spent);
                }
                count
            }
            Some(chunk) => {
                buf.extend(chunk.drain(..limit));
                limit
            }
            None if self.tail.len() <= limit => {
                // The reader's emptied buffer becomes the new tail.
                std::mem::swap(buf, &mut self.tail);
                buf.len()
            }
            None => {
                buf.extend(self.tail.drain(..limit));
                limit
            }
        };
        self.len -= count;
        self.head_seq += count as u64;
        count
    }

    fn recycle(&mut self, mut chunk: VecDeque<Bytes>) {
        chunk.clear();
        if self.spare.len() < SPARE_CHUNKS && chunk.capacity() > 0 && chunk.capacity() <= 2 * CHUNK
        {
            self.spare.push(chunk);
        }
    }

    fn clear(&mut self) {
        self.full.clear();
        self.tail.clear();
        self.spare.clear();
        self.marks.clear();
        self.head_seq += self.len as u64;
        self.len = 0;
        self.last_subject = None;
    }
}

/// Written by the reader for every message; on a cache line of its own so
/// that producers' traffic on the lock does not share it.
#[repr(align(64))]
struct Handed(AtomicU64);

struct Queue {
    state: Mutex<State>,
    /// Whether the shared queue holds entries, for a spinning reader to watch
    /// without taking the lock. Written only when that changes, so a
    /// reader watching it does not take its cache line from the producer
    /// once per message.
    waiting: AtomicBool,
    /// `state.closed`, likewise.
    closed: AtomicBool,
    /// Signalled when entries arrive or the queue closes.
    ready: Condvar,
    /// Signalled when the reader makes room or the queue closes.
    room: Condvar,
    /// Messages the reader has handed to the application, in total.
    handed: Handed,
    /// Most entries the reader takes per visit.
    batch: usize,
    /// The thread that last waited for entries (its [`thread_token`]): a
    /// loop round that thread runs as a driver must not wait for room
    /// only it can make.
    reader: AtomicU64,
}

thread_local! {
    /// The queue this thread waits on while it drives its owner's loop
    /// (its address; 0 for none).
    static WAITING_ON: Cell<usize> = const { Cell::new(0) };
    /// A queue this thread reads that a round it drove filled past its
    /// bound, with that bound: the thread drives no more rounds until the
    /// queue is back under it ([`may_drive`]).
    static OVERFILLED: RefCell<Option<(Weak<Queue>, u64)>> = const { RefCell::new(None) };
}

/// Marks `WAITING_ON` for a drive, and puts the outer mark back however
/// the drive ends (a round that panics included: the thread lives on).
struct WaitingOn(usize);

impl WaitingOn {
    fn mark(queue: &Queue) -> WaitingOn {
        WaitingOn(WAITING_ON.replace(queue as *const Queue as usize))
    }
}

impl Drop for WaitingOn {
    fn drop(&mut self) {
        WAITING_ON.set(self.0);
    }
}

/// Whether the calling thread may run a loop's rounds: not while a queue
/// it reads is over the bound its own rounds took it past, so that those
/// rounds take it over by one round's messages at most.
pub(crate) fn may_drive() -> bool {
    OVERFILLED.with_borrow_mut(|overfilled| {
        let Some((queue, capacity)) = overfilled else {
            return true;
        };
        let under = queue.upgrade().is_none_or(|queue| {
            let mut state = queue.state.lock();
            state.handed_seen = queue.handed.0.load(Ordering::Acquire);
            state.closed || state.queued() < *capacity
        });
        if under {
            *overfilled = None;
        }
        under
    })
}

/// A number for the calling thread, unique in the process (never 0).
fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TOKEN: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    TOKEN.with(|token| *token)
}

impl Queue {
    fn close(&self) {
        let mut state = self.state.lock();
        state.closed = true;
        self.closed.store(true, Ordering::Release);
        self.ready.notify_all();
        self.room.notify_all();
    }
}

/// A received payload about to be queued: copied, with its headers, when
/// it would keep a larger buffer alive ([`Detacher`]).
#[inline(always)]
fn settle_received(state: &mut State, payload: &mut Bytes, headers: &mut Option<Bytes>) {
    if state.len == 0 {
        state.detacher.passed(payload);
    } else if state.detacher.settle(payload) {
        if let Some(headers) = headers.as_mut() {
            detach(headers);
        }
    }
}

/// How a producer passes the subject.
enum SubjectArg<'a> {
    /// A string made for this message.
    Owned(Arc<str>),
    /// A string the producer keeps and passes again for later messages.
    Kept(&'a Arc<str>),
    /// A string of the producer's own, copied only if the queue keeps it
    /// (a subject other than the last one queued): once into the cell,
    /// which the producer's other queues for the same message share.
    Borrowed(&'a str, &'a OnceCell<Arc<str>>),
}

impl SubjectArg<'_> {
    fn into_shared(self) -> Arc<str> {
        match self {
            SubjectArg::Owned(owned) => owned,
            SubjectArg::Kept(kept) => kept.clone(),
            SubjectArg::Borrowed(text, shared) => shared.get_or_init(|| Arc::from(text)).clone(),
        }
    }
}

/// The producer side of a subscription's bounded queue.
pub(crate) struct LocalSink {
    queue: Arc<Queue>,
    /// Messages the queue may hold.
    capacity: u64,
    policy: SlowConsumerPolicy,
    block_timeout: Duration,
    stats: Arc<SubscriptionStats>,
    /// Set when the disconnect policy cut the subscription off.
    cut_off: AtomicBool,
    /// Set with `cut_off` until the cutting delivery is counted
    /// ([`Self::take_cutting_delivery`]).
    cutting_delivery: AtomicBool,
    /// A queue group's member: a message picked for it as it closes was
    /// taken from the group's other members ([`Self::in_queue_group`]).
    grouped: bool,
    /// Messages the event loop holds for this queue ([`Delivery::Full`]).
    /// While it holds any, producers that may wait do, even with room:
    /// the held ones go first.
    held: AtomicUsize,
    /// A responder's handler, and the broker or client it answers through
    /// ([`new_answer_origin`]): messages go to it instead of the queue.
    /// Weak: the [`Responder`] owns the handler, so that what it captured
    /// is dropped where the responder is, never where a sink's last
    /// reference goes (under a subscription table's lock, from a
    /// publisher's cache or a lookup's list: a captured subscription's
    /// unsubscribe there would wait for that lock for ever).
    answer: Option<(WeakAnswer, usize)>,
}

/// What a responder's sink keeps of its handler.
type WeakAnswer = std::sync::Weak<dyn Fn(&Message) -> Option<Bytes> + Send + Sync>;

/// A responder's handler ([`crate::Broker::respond`]).
pub(crate) type Answer = Arc<dyn Fn(&Message) -> Option<Bytes> + Send + Sync>;

/// A reply a handler made, to be published by the code that delivered the
/// request once it is done delivering; `stats` counts it if it cannot be.
pub(crate) struct Answered {
    /// The broker or client whose responder made it: a thread may deliver
    /// for several (a handler publishing through another broker, say), and
    /// each publishes only its own replies.
    origin: usize,
    pub subject: Arc<str>,
    pub payload: Bytes,
    pub stats: Arc<SubscriptionStats>,
}

thread_local! {
    /// The replies handlers made on this thread, not yet published.
    static ANSWERS: RefCell<Vec<Answered>> = const { RefCell::new(Vec::new()) };
}

/// A new broker's or client's mark on its responders' replies, which tells
/// them from another's: unique in the process, never reused.
pub(crate) fn new_answer_origin() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Whether handlers on this thread made replies for `origin` not yet
/// published.
pub(crate) fn answers_waiting(origin: usize) -> bool {
    ANSWERS.with(|answers| answers.borrow().iter().any(|a| a.origin == origin))
}

/// The replies handlers on this thread made for `origin`, oldest first,
/// for the caller to publish; those over `max_payload` are dropped here
/// and counted.
pub(crate) fn take_answers(origin: usize, max_payload: u64) -> Vec<Answered> {
    let mut mine = take_all_answers(origin);
    mine.retain(|answered| {
        let fits = answered.payload.len() as u64 <= max_payload;
        if !fits {
            answered.stats.count_unanswered();
        }
        fits
    });
    mine
}

fn take_all_answers(origin: usize) -> Vec<Answered> {
    ANSWERS.with(|answers| {
        let mut answers = answers.borrow_mut();
        let mine: Vec<Answered> = if answers.iter().all(|a| a.origin == origin) {
            std::mem::take(&mut *answers)
        } else {
            let (mine, others) = std::mem::take(&mut *answers)
                .into_iter()
                .partition(|a| a.origin == origin);
            *answers = others;
            mine
        };
        mine
    })
}

/// The reading half of a queue, made by [`LocalSink::new`] for
/// [`Subscription::new`].
pub(crate) struct QueueReader {
    queue: Arc<Queue>,
}

impl LocalSink {
    /// A queue of `capacity` messages and the subscription reading it.
    pub(crate) fn new(
        capacity: usize,
        policy: SlowConsumerPolicy,
        block_timeout: Duration,
    ) -> (LocalSink, QueueReader, Arc<SubscriptionStats>) {
        let capacity = capacity.max(1);
        let batch = match policy {
            // Nothing is discarded: the reader may hold the whole bound.
            SlowConsumerPolicy::Block => capacity.min(CHUNK),
            SlowConsumerPolicy::DropOldest | SlowConsumerPolicy::Disconnect => {
                (capacity / 4).clamp(1, CHUNK)
            }
        };
        // The buffer grows with use: short-lived subscriptions such as
        // request inboxes stay cheap.
        let queue = Arc::new(Queue {
            state: Mutex::new(State {
                full: VecDeque::new(),
                tail: VecDeque::new(),
                len: 0,
                spare: Vec::new(),
                head_seq: 0,
                marks: VecDeque::new(),
                last_subject: None,
                taken: 0,
                handed_seen: 0,
                stalled_at: None,
                closed: false,
                readers_waiting: 0,
                producers_waiting: 0,
                detacher: Detacher::default(),
            }),
            waiting: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            ready: Condvar::new(),
            room: Condvar::new(),
            handed: Handed(AtomicU64::new(0)),
            batch,
            reader: AtomicU64::new(0),
        });
        let stats = Arc::new(SubscriptionStats::default());
        let sink = LocalSink {
            queue: queue.clone(),
            capacity: capacity as u64,
            policy,
            block_timeout,
            stats: stats.clone(),
            cut_off: AtomicBool::new(false),
            cutting_delivery: AtomicBool::new(false),
            grouped: false,
            held: AtomicUsize::new(0),
            answer: None,
        };
        (sink, QueueReader { queue }, stats)
    }

    /// The sink, as a queue group's member when `grouped`.
    pub(crate) fn in_queue_group(mut self, grouped: bool) -> LocalSink {
        self.grouped = grouped;
        self
    }

    /// Whether the sink is a queue group's member.
    pub(crate) fn is_grouped(&self) -> bool {
        self.grouped
    }

    /// Whether a `Closed` delivery being counted is the one that cut the
    /// subscription off (counted in its `dropped` already), the first
    /// time it is asked after the cut.
    pub(crate) fn take_cutting_delivery(&self) -> bool {
        self.cutting_delivery.swap(false, Ordering::Relaxed)
    }

    /// A responder's sink: every message goes to `answer` on the thread
    /// that delivers it, its replies for `origin` to publish. The queue
    /// only marks the responder closed.
    pub(crate) fn answering(
        answer: &Answer,
        origin: usize,
    ) -> (LocalSink, QueueReader, Arc<SubscriptionStats>) {
        let (mut sink, reader, stats) =
            LocalSink::new(1, SlowConsumerPolicy::DropOldest, Duration::ZERO);
        sink.answer = Some((Arc::downgrade(answer), origin));
        (sink, reader, stats)
    }

    /// Queue a message received off the network: one that waits behind
    /// others may get its own copy of a small payload ([`Detacher`]), since
    /// a slice of the buffer it was read into would keep that whole
    /// buffer.
    pub(crate) fn deliver(&self, message: Message) -> Delivery {
        self.push_message(message, true, false)
    }

    /// [`deliver`](Self::deliver) for a thread that must not wait (the
    /// event loop): under the block policy a full queue answers
    /// [`Delivery::Full`], with nothing queued or counted.
    /// The subject is copied only when the queue keeps it, into `shared`
    /// (see [`SubjectArg::Borrowed`]).
    pub(crate) fn try_deliver(
        &self,
        subject: &str,
        shared: &OnceCell<Arc<str>>,
        reply: Option<Arc<str>>,
        headers: Option<Bytes>,
        payload: Bytes,
    ) -> Delivery {
        self.push(
            SubjectArg::Borrowed(subject, shared),
            reply,
            headers,
            payload,
            true,
            true,
        )
    }

    /// A message the event loop held for this queue, offered again as
    /// [`try_deliver`](Self::try_deliver) does; its payload was copied
    /// when it was held, so it is not copied again.
    pub(crate) fn offer_held(&self, message: Message) -> Delivery {
        self.push_message(message, false, true)
    }

    fn push_message(&self, message: Message, received: bool, hold: bool) -> Delivery {
        let Message {
            subject,
            reply,
            headers,
            payload,
        } = message;
        self.push(
            SubjectArg::Owned(subject),
            reply,
            headers,
            payload,
            received,
            hold,
        )
    }

    /// A message held for this queue (see [`Delivery::Full`]) was dropped
    /// after the block timeout: counted, and the reader taken for stalled
    /// until it takes one, as [`Self::wait_for_room`] does.
    pub(crate) fn drop_held(&self) {
        self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        let mut state = self.queue.state.lock();
        // The count that last proved the queue full: a reader that took
        // one since is not taken for stalled.
        state.stalled_at = Some(state.handed_seen);
    }

    /// Whether the event loop holds messages for this queue: the next
    /// ones go behind them.
    pub(crate) fn is_held(&self) -> bool {
        self.held.load(Ordering::Acquire) > 0
    }

    /// The event loop holds one more message for this queue.
    pub(crate) fn hold_one(&self) {
        self.held.fetch_add(1, Ordering::AcqRel);
    }

    /// A message the event loop held for this queue went (queued,
    /// dropped, or the queue closed).
    pub(crate) fn unhold_one(&self) {
        if self.held.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last one: producers waiting behind it go. Under the
            // lock, so none misses this between its check and its wait.
            let _state = self.queue.state.lock();
            self.queue.room.notify_all();
        }
    }

    /// How long a message waits for room here (fixed when the
    /// subscription was made).
    pub(crate) fn block_timeout(&self) -> Duration {
        self.block_timeout
    }

    /// Whether a producer that may wait must, for messages the loop holds.
    fn behind_held(&self, hold: bool) -> bool {
        !hold && self.is_held()
    }

    /// Like [`deliver`](Self::deliver), for a producer that keeps `subject`
    /// and passes the same string again for its next messages: those are
    /// queued without touching the string's reference count.
    #[inline(always)]
    pub(crate) fn deliver_kept(
        &self,
        subject: &Arc<str>,
        reply: Option<Arc<str>>,
        headers: Option<Bytes>,
        payload: Bytes,
    ) -> Delivery {
        self.push(
            SubjectArg::Kept(subject),
            reply,
            headers,
            payload,
            false,
            false,
        )
    }

    #[inline(always)]
    fn push(
        &self,
        subject: SubjectArg<'_>,
        reply: Option<Arc<str>>,
        headers: Option<Bytes>,
        payload: Bytes,
        received: bool,
        hold: bool,
    ) -> Delivery {
        if let Some((answer, origin)) = &self.answer {
            // Gone with its responder, which closed the queue first.
            let Some(answer) = answer.upgrade() else {
                return Delivery::Closed;
            };
            return self.answer_now(&answer, *origin, subject, reply, headers, payload);
        }
        let queue = &*self.queue;
        let mut state = queue.state.lock();
        let outcome =
            self.push_locked(&mut state, subject, reply, headers, payload, received, hold);
        let wake = state.readers_waiting > 0;
        drop(state);
        // Outside the lock, so the reader wakes to an unlocked queue. A
        // waiting reader joined the condition variable before releasing
        // the lock, so it cannot miss this.
        if wake {
            queue.ready.notify_one();
        }
        outcome
    }

    /// Queue messages received off the network for one subscription, in
    /// order, as [`deliver`] does one by one: under one hold of the queue's
    /// lock while the queue has room, then (the reader woken) one by one,
    /// so that the reader takes what is queued between them as it would
    /// have before the policy acts. True when the queue is closed: what
    /// was left of `run` is dropped, as a message delivered to a closed
    /// queue is.
    ///
    /// [`deliver`]: Self::deliver
    pub(crate) fn deliver_run(&self, run: &mut Vec<Message>) -> bool {
        let mut messages = run.drain(..);
        self.queue_while_room(&mut messages, false);
        for message in messages {
            if self.deliver(message) == Delivery::Closed {
                return true;
            }
        }
        false
    }

    /// Queues `messages` (received off the network) under one hold of the
    /// lock for as long as the queue has room (open, not full, nothing held
    /// for it), each as [`Delivery::Queued`], and leaves the rest to the
    /// caller; returns how many it queued. With `copy_subjects`, a subject
    /// the caller still shares goes as [`SubjectArg::Borrowed`], so the
    /// queue keeps a copy of its own. A responder's sink queues none: its
    /// handler runs per message.
    pub(crate) fn queue_while_room(
        &self,
        messages: &mut impl Iterator<Item = Message>,
        copy_subjects: bool,
    ) -> usize {
        self.queue_items_while_room(messages, |sink, state, message| {
            let Message {
                subject,
                reply,
                headers,
                payload,
            } = message;
            let copy = OnceCell::new();
            // A string no one else holds is the queue's to keep.
            let subject = match copy_subjects && Arc::strong_count(&subject) > 1 {
                true => SubjectArg::Borrowed(&subject, &copy),
                false => SubjectArg::Owned(subject),
            };
            let outcome = sink.push_locked(state, subject, reply, headers, payload, true, false);
            debug_assert_eq!(outcome, Delivery::Queued);
        })
    }

    /// Takes `items` under one hold of the lock for as long as the queue
    /// has room, each queued by `push`; returns how many it took, and
    /// wakes a waiting reader.
    #[inline(always)]
    fn queue_items_while_room<T>(
        &self,
        items: &mut impl Iterator<Item = T>,
        mut push: impl FnMut(&Self, &mut MutexGuard<'_, State>, T),
    ) -> usize {
        if self.answer.is_some() {
            return 0;
        }
        let queue = &*self.queue;
        let mut state = queue.state.lock();
        let mut queued = 0;
        while !state.closed && state.queued() < self.capacity && !self.is_held() {
            let Some(item) = items.next() else {
                break;
            };
            push(self, &mut state, item);
            queued += 1;
        }
        let wake = queued > 0 && state.readers_waiting > 0;
        drop(state);
        if wake {
            queue.ready.notify_one();
        }
        queued
    }

    /// [`deliver_run`](Self::deliver_run) for plain messages (no reply
    /// subject, no headers) on one subject, given as their payloads: the
    /// subject is looked at once for the run, not per message. `payloads`
    /// is left empty. True if the queue is closed.
    pub(crate) fn deliver_plain_run(&self, subject: &Arc<str>, payloads: &mut Vec<Bytes>) -> bool {
        let mut payloads = payloads.drain(..);
        self.queue_plain_while_room(SubjectArg::Kept(subject), &mut payloads);
        for payload in payloads {
            let subject = SubjectArg::Kept(subject);
            if self.push(subject, None, None, payload, true, false) == Delivery::Closed {
                return true;
            }
        }
        false
    }

    /// [`queue_while_room`](Self::queue_while_room) for plain messages
    /// (no reply subject, no headers) on `subject`, a string the caller
    /// keeps, given as their payloads: it is copied only if the queue
    /// keeps it.
    pub(crate) fn queue_plain_while_room_copied(
        &self,
        subject: &str,
        payloads: &mut impl Iterator<Item = Bytes>,
    ) -> usize {
        let copy = OnceCell::new();
        self.queue_plain_while_room(SubjectArg::Borrowed(subject, &copy), payloads)
    }

    /// Queues plain payloads on `subject` while there is room: after the
    /// first, a payload needs no subject check and no mark, since the
    /// message queued just before it, under the same hold of the lock,
    /// had the same subject.
    #[inline(always)]
    fn queue_plain_while_room(
        &self,
        subject: SubjectArg<'_>,
        payloads: &mut impl Iterator<Item = Bytes>,
    ) -> usize {
        let mut subject = Some(subject);
        self.queue_items_while_room(payloads, |sink, state, mut payload| match subject.take() {
            Some(subject) => {
                let outcome = sink.push_locked(state, subject, None, None, payload, true, false);
                debug_assert_eq!(outcome, Delivery::Queued);
            }
            None => {
                settle_received(state, &mut payload, &mut None);
                sink.append_locked(state, payload);
            }
        })
    }

    /// [`push`](Self::push) with the queue's lock held; the caller wakes a
    /// waiting reader once it lets the lock go.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn push_locked(
        &self,
        state: &mut MutexGuard<'_, State>,
        subject: SubjectArg<'_>,
        reply: Option<Arc<str>>,
        mut headers: Option<Bytes>,
        mut payload: Bytes,
        received: bool,
        hold: bool,
    ) -> Delivery {
        let mut outcome = Delivery::Queued;
        if state.closed || state.queued() >= self.capacity || self.behind_held(hold) {
            match self.make_room(state, hold) {
                Ok(made) => outcome = made,
                Err(refused) => return refused,
            }
        }
        if received {
            settle_received(state, &mut payload, &mut headers);
        }
        let same = match (&state.last_subject, &subject) {
            (Some(last), SubjectArg::Kept(kept)) => Arc::ptr_eq(last, kept) || **last == ***kept,
            (Some(last), SubjectArg::Owned(owned)) => **last == **owned,
            (Some(last), SubjectArg::Borrowed(text, _)) => **last == **text,
            (None, _) => false,
        };
        if !same || reply.is_some() || headers.is_some() {
            let subject = (!same).then(|| {
                let subject = subject.into_shared();
                state.last_subject = Some(subject.clone());
                subject
            });
            let seq = state.head_seq + state.len as u64;
            state.marks.push_back(Mark {
                seq,
                subject,
                reply,
                headers,
            });
        }
        self.append_locked(state, payload);
        outcome
    }

    /// Appends a payload whose subject, reply and headers are marked (or
    /// need no mark), and counts it.
    #[inline(always)]
    fn append_locked(&self, state: &mut MutexGuard<'_, State>, payload: Bytes) {
        state.push(payload);
        if state.len == 1 {
            self.queue.waiting.store(true, Ordering::Relaxed);
        }
        bump(&self.stats.delivered, 1);
    }

    /// Whether this is a responder's sink, whose deliveries run user code.
    pub(crate) fn is_answering(&self) -> bool {
        self.answer.is_some()
    }

    /// A responder's delivery: the handler runs here, and its reply to a
    /// request waits in this thread's [`ANSWERS`]. A handler that panics
    /// loses its reply (counted as dropped), not the delivering thread.
    #[inline(never)]
    fn answer_now(
        &self,
        answer: &Answer,
        origin: usize,
        subject: SubjectArg<'_>,
        reply: Option<Arc<str>>,
        headers: Option<Bytes>,
        payload: Bytes,
    ) -> Delivery {
        if self.queue.closed.load(Ordering::Acquire) {
            return Delivery::Closed;
        }
        let subject = subject.into_shared();
        let message = Message {
            subject,
            reply,
            headers,
            payload,
        };
        // Handlers may run on several threads at once: no queue lock here.
        self.stats.delivered.fetch_add(1, Ordering::Relaxed);
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| answer(&message))) {
            Ok(Some(payload)) => {
                if let Some(subject) = message.reply {
                    let stats = self.stats.clone();
                    ANSWERS.with(|answers| {
                        answers.borrow_mut().push(Answered {
                            origin,
                            subject,
                            payload,
                            stats,
                        })
                    });
                }
            }
            Ok(None) => {}
            Err(_) => {
                if message.reply.is_some() {
                    self.stats.count_unanswered();
                }
                tracing::warn!(subject = %message.subject, "a responder's handler panicked");
            }
        }
        Delivery::Queued
    }

    /// The slow path of a push: the queue is closed or looks full. `Ok`
    /// with the outcome once the message may be queued, `Err` with the
    /// outcome if it may not. With `hold`, the block policy does not wait.
    #[cold]
    #[inline(never)]
    fn make_room(
        &self,
        state: &mut MutexGuard<'_, State>,
        hold: bool,
    ) -> Result<Delivery, Delivery> {
        let queue = &*self.queue;
        if state.closed {
            return Err(Delivery::Closed);
        }
        if !self.is_full(state) && !self.behind_held(hold) {
            return Ok(Delivery::Queued);
        }
        match self.policy {
            // The delivering thread reads this queue and runs a loop's
            // round while it waits (for this queue or another): room only
            // it can make would never come, so the round's messages go
            // over the bound.
            SlowConsumerPolicy::Block if crate::drive::driving() && self.is_read_here() => {
                OVERFILLED.set(Some((Arc::downgrade(&self.queue), self.capacity)));
                Ok(Delivery::Queued)
            }
            // A reader stalled past a timeout already is not waited for
            // again (the loop's reads would be held with it each time):
            // dropped at once until it takes one.
            SlowConsumerPolicy::Block if hold => {
                if state.stalled_at == Some(queue.handed.0.load(Ordering::Acquire)) {
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    return Err(Delivery::Dropped);
                }
                Err(Delivery::Full)
            }
            SlowConsumerPolicy::Block => match self.wait_for_room(state) {
                Some(refused) => Err(refused),
                None => Ok(Delivery::Queued),
            },
            SlowConsumerPolicy::DropOldest => {
                Ok(Delivery::QueuedDroppingOldest(self.drop_oldest(state)))
            }
            SlowConsumerPolicy::Disconnect => {
                state.closed = true;
                queue.closed.store(true, Ordering::Release);
                self.cut_off.store(true, Ordering::Relaxed);
                if self.grouped {
                    self.cutting_delivery.store(true, Ordering::Relaxed);
                }
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                queue.ready.notify_all();
                queue.room.notify_all();
                Err(Delivery::Closed)
            }
        }
    }

    /// Whether the bound is reached; reads the reader's progress only when
    /// the cheap estimate says so.
    fn is_full(&self, state: &mut State) -> bool {
        if state.queued() < self.capacity {
            return false;
        }
        state.handed_seen = self.queue.handed.0.load(Ordering::Acquire);
        state.queued() >= self.capacity
    }

    /// Whether the calling thread reads this queue: it waits on it now, or
    /// was the last to wait on it.
    fn is_read_here(&self) -> bool {
        let queue = &*self.queue;
        WAITING_ON.get() == queue as *const Queue as usize
            || queue.reader.load(Ordering::Relaxed) == thread_token()
    }

    /// Waits for the reader to make room, up to the block timeout (not at
    /// all once a wait timed out and the reader has taken nothing since).
    /// `None` when there is room; otherwise the outcome (dropped and
    /// counted, or closed).
    fn wait_for_room(&self, state: &mut MutexGuard<'_, State>) -> Option<Delivery> {
        let handed = self.queue.handed.0.load(Ordering::Acquire);
        if state.stalled_at == Some(handed) {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return Some(Delivery::Dropped);
        }
        let deadline = Instant::now() + self.block_timeout;
        loop {
            state.producers_waiting += 1;
            let timed_out = self.queue.room.wait_until(state, deadline).timed_out();
            state.producers_waiting -= 1;
            if state.closed {
                return Some(Delivery::Closed);
            }
            if !self.is_full(state) && !self.behind_held(false) {
                return None;
            }
            if timed_out {
                // The count that proved the queue full: a reader that took
                // one since is not taken for stalled.
                state.stalled_at = Some(state.handed_seen);
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                return Some(Delivery::Dropped);
            }
        }
    }

    /// Discards the oldest entries the reader has not taken until one more
    /// fits; returns how many.
    fn drop_oldest(&self, state: &mut State) -> u64 {
        let mut dropped = 0;
        while state.queued() >= self.capacity {
            if state.pop_front().is_none() {
                // Everything is in the reader's buffer (only possible while
                // it takes its first message of a batch): accept one more.
                break;
            }
            dropped += 1;
        }
        state.prune_marks();
        self.stats.dropped.fetch_add(dropped, Ordering::Relaxed);
        dropped
    }

    /// Stop accepting messages. What is queued stays readable; the
    /// subscription ends once it is drained.
    pub(crate) fn close(&self) {
        self.queue.close();
    }

    /// Whether the disconnect policy cut this subscription off.
    pub(crate) fn is_cut_off(&self) -> bool {
        self.cut_off.load(Ordering::Relaxed)
    }

    /// The broker reports it discarded `count` messages for this (a
    /// client's) subscription.
    pub(crate) fn count_dropped_by_broker(&self, count: u64) {
        // The count comes off the network: it saturates rather than wraps.
        let _ = self.stats.dropped_by_broker.fetch_update(
            Ordering::Relaxed,
            Ordering::Relaxed,
            |total| Some(total.saturating_add(count)),
        );
    }
}

impl Drop for LocalSink {
    fn drop(&mut self) {
        self.queue.close();
    }
}

/// What a [`Subscription`] belongs to: a broker or a client.
pub(crate) trait SubscriptionOwner: Send + Sync {
    /// Called when the subscription is dropped, to remove its interest.
    fn unsubscribe(&self, sid: u64);

    /// Runs the owner's event loop on the calling thread (the reader of
    /// subscription `sid`, waiting for its next message) until `until` or
    /// until `ready`, so that what it waits for reaches it without a
    /// hand-over between threads. False when no round ran (the owner lends
    /// no loop to this reader, or not now): then the reader yields.
    fn drive(&self, _sid: u64, _until: Instant, _ready: &dyn Fn() -> bool) -> bool {
        false
    }

    /// Whether [`SubscriptionOwner::drive`] would run rounds for the reader
    /// of `sid` now. That reader then drives at once instead of spinning
    /// first: while it may drive, the loop thread's rounds find nothing,
    /// and what it waits for comes in a round it runs itself.
    fn would_drive(&self, _sid: u64) -> bool {
        false
    }
}

/// The reader's side: its batch and the current subject.
struct Local {
    buf: VecDeque<Bytes>,
    /// The sequence number of the first entry in `buf`.
    next_seq: u64,
    /// The marks of the entries in `buf` (and possibly one before them).
    marks: VecDeque<Mark>,
    /// The subject of the last entry handed out.
    subject: Arc<str>,
    /// Messages handed out on `subject` since it last changed.
    run: u32,
    /// Messages handed to the application, in total.
    handed: u64,
    /// Spin-loop hints to wait, once the buffer is empty, before taking the
    /// next batch (adapted to the producers' pace).
    gap: u32,
    /// When the last batch was taken.
    last_batch: Option<Instant>,
    /// How long the reader yields before it parks.
    yield_window: YieldWindow,
}

/// How long a thread waiting for a message (a subscription's reader, a
/// request's caller) yields its core before it sleeps. A sleeping reader
/// costs the producer a system call to wake it, and itself a scheduler
/// wake-up; yielding first keeps a short pause in a stream (the producer
/// descheduled for a moment) or a quick reply from costing one. The window
/// is twice the last wait that ended with a message, from [`YIELD_MIN`] up
/// to the event loops' largest polling window (`SPIN_GROWTH` times
/// `fabric.polling.spin_us`); a wait longer than twice that (ten polling
/// windows, as for the loops) takes it back to the minimum, so that a
/// reader of rare messages does not burn its core between them. Not one
/// just longer than the maximum: a round trip slowed by a thread on its
/// way that slept would keep the reader sleeping too, and so slow.
/// Measured on 2 cores, two services meshed over `tcp;ofi_rxm` asking each
/// other 64 B requests: the median round trip went from 106-168 us with a
/// fixed 20 us window (the reply came after the reader had parked) to
/// 63-71 us.
#[derive(Debug, Clone, Copy)]
pub(crate) struct YieldWindow {
    current: Duration,
    max: Duration,
}

impl YieldWindow {
    /// A window for loops polling `spin` (`fabric.polling.spin_us`).
    pub fn new(spin: Duration) -> YieldWindow {
        YieldWindow {
            current: YIELD_MIN,
            max: (spin * crate::wait::SPIN_GROWTH).max(YIELD_MIN),
        }
    }

    pub fn get(self) -> Duration {
        self.current
    }

    /// A wait of `waited` ended with a message.
    pub fn waited(&mut self, waited: Duration) {
        self.current = if waited > 2 * self.max {
            YIELD_MIN
        } else {
            (waited * 2).clamp(YIELD_MIN, self.max)
        };
    }
}

/// How long a receive may wait.
#[derive(Clone, Copy)]
enum Wait {
    No,
    For(Duration),
    Forever,
}

/// A stream of messages matching a pattern. Dropping it unsubscribes.
///
/// `recv` blocks; `recv_timeout` and `try_recv` bound the wait; iterating
/// yields messages until the subscription ends (unsubscribed, cut off as a
/// slow consumer, or the broker or client shut down).
pub struct Subscription {
    sid: u64,
    pattern: String,
    queue_group: Option<String>,
    queue: Arc<Queue>,
    local: Mutex<Local>,
    stats: Arc<SubscriptionStats>,
    owner: Arc<dyn SubscriptionOwner>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("sid", &self.sid)
            .field("pattern", &self.pattern)
            .field("queue", &self.queue_group)
            .finish()
    }
}

impl Subscription {
    /// `spin` is the event loops' `fabric.polling.spin_us`, which bounds
    /// how long the reader yields before it parks ([`YieldWindow`]).
    pub(crate) fn new(
        sid: u64,
        pattern: String,
        queue: Option<String>,
        reader: QueueReader,
        stats: Arc<SubscriptionStats>,
        owner: Arc<dyn SubscriptionOwner>,
        spin: Duration,
    ) -> Subscription {
        Subscription {
            sid,
            pattern,
            queue_group: queue,
            queue: reader.queue,
            local: Mutex::new(Local {
                buf: VecDeque::new(),
                next_seq: 0,
                marks: VecDeque::new(),
                subject: Arc::from(""),
                run: 0,
                handed: 0,
                gap: 0,
                last_batch: None,
                yield_window: YieldWindow::new(spin),
            }),
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
        self.queue_group.as_deref()
    }

    /// Delivery and drop counters.
    pub fn stats(&self) -> &SubscriptionStats {
        &self.stats
    }

    /// How long the reader yields before it parks, as adapted so far.
    #[cfg(test)]
    fn yield_window(&self) -> YieldWindow {
        self.local.lock().yield_window
    }

    /// Messages waiting to be read.
    pub fn pending(&self) -> usize {
        let local = self.local.lock();
        local.buf.len() + self.queue.state.lock().len
    }

    /// Wait for the next message.
    pub fn recv(&self) -> Result<Message, RecvError> {
        self.receive(Wait::Forever)
    }

    /// Wait at most `timeout` for the next message.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Message, RecvError> {
        self.receive(Wait::For(timeout))
    }

    /// The next message if one is waiting.
    pub fn try_recv(&self) -> Result<Message, RecvError> {
        self.receive(Wait::No)
    }

    /// Waits at most `timeout` for the next message (not at all for
    /// [`Duration::ZERO`]), then appends it to `out` with those behind it
    /// in the batch the reader took from the queue, up to `max` in all;
    /// returns how many it appended. A reader of a fast stream takes its
    /// messages this way, for one lock of its batch and one count
    /// published to the producers per call rather than per message. The
    /// errors are [`recv_timeout`](Self::recv_timeout)'s, and `Empty` for
    /// a zero `timeout` that found nothing; nothing is appended then. A
    /// `max` of 0 takes nothing and returns at once.
    pub fn recv_many(
        &self,
        out: &mut Vec<Message>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, RecvError> {
        if max == 0 {
            return Ok(0);
        }
        let mut local = self.local.lock();
        let mut appended = 0;
        if local.buf.is_empty() {
            drop(local);
            let wait = match timeout.is_zero() {
                true => Wait::No,
                false => Wait::For(timeout),
            };
            out.push(self.receive(wait)?);
            appended = 1;
            local = self.local.lock();
        }
        while appended < max {
            let Some(entry) = local.buf.pop_front() else {
                break;
            };
            local.handed += 1;
            let message = self.hand_out(&mut local, entry);
            out.push(message);
            appended += 1;
        }
        self.queue.handed.0.store(local.handed, Ordering::Release);
        Ok(appended)
    }

    #[inline(always)]
    fn receive(&self, wait: Wait) -> Result<Message, RecvError> {
        // The common case: the reader's batch has a message.
        let mut local = self.local.lock();
        if let Some(entry) = local.buf.pop_front() {
            local.handed += 1;
            self.queue.handed.0.store(local.handed, Ordering::Release);
            return Ok(self.hand_out(&mut local, entry));
        }
        drop(local);
        self.receive_slow(wait)
    }

    #[inline(never)]
    fn receive_slow(&self, wait: Wait) -> Result<Message, RecvError> {
        let queue = &*self.queue;
        let me = thread_token();
        if queue.reader.load(Ordering::Relaxed) != me {
            queue.reader.store(me, Ordering::Relaxed);
        }
        // A poll (`try_recv`) leaves the yield window alone: no clock read.
        let started = (!matches!(wait, Wait::No)).then(Instant::now);
        // Computed only once the reader has to wait.
        let mut deadline = None;
        let mut yielding_since = None;
        let mut round = 0;
        let mut gap_waited = false;
        // A full batch is what the queue gives at most.
        let good_batch = SMALL_BATCH.min(queue.batch);
        loop {
            let mut local = self.local.lock();
            if let Some(entry) = local.buf.pop_front() {
                local.handed += 1;
                queue.handed.0.store(local.handed, Ordering::Release);
                return Ok(self.hand_out(&mut local, entry));
            }
            // The hints are written under the lock with every change; one
            // that happened before this call is seen here. While they say
            // there is nothing, the reader stays off the lock.
            let waiting = queue.waiting.load(Ordering::Relaxed);
            let closed = queue.closed.load(Ordering::Acquire);
            if !gap_waited && !closed && !matches!(wait, Wait::No) {
                gap_waited = true;
                let streaming = local.last_batch.is_some_and(|at| at.elapsed() < STREAMING);
                let gap = local.gap;
                if streaming && gap > 0 {
                    // Reading faster than the producers write: let a batch
                    // gather rather than take the lock for a message or two.
                    drop(local);
                    spin(gap);
                    continue;
                }
            }
            let park = match yielding_since {
                Some(since) => Instant::now().duration_since(since) >= local.yield_window.get(),
                None => false,
            };
            if !waiting && !closed && !park {
                let at = wait_deadline(wait, &mut deadline)?;
                let window = local.yield_window.get();
                drop(local);
                if at.is_some_and(|at| Instant::now() >= at) {
                    return Err(RecvError::Timeout);
                }
                if round == 0 && self.owner.would_drive(self.sid) {
                    round = SPIN_ROUNDS;
                }
                if round < SPIN_ROUNDS {
                    spin(1 << round);
                    round += 1;
                } else {
                    let since = *yielding_since.get_or_insert_with(Instant::now);
                    let until = since + window;
                    let until = at.map_or(until, |at| at.min(until));
                    let ready = || {
                        queue.waiting.load(Ordering::Relaxed)
                            || queue.closed.load(Ordering::Acquire)
                    };
                    let drove = {
                        let _waiting = WaitingOn::mark(queue);
                        self.owner.drive(self.sid, until, &ready)
                    };
                    if !drove {
                        std::thread::yield_now();
                    }
                }
                continue;
            }
            let mut state = queue.state.lock();
            if let Some((entry, count)) = self.take_batch(&mut local, &mut state) {
                drop(state);
                let now = Instant::now();
                local.last_batch = Some(now);
                if let Some(started) = started {
                    local.yield_window.waited(now.duration_since(started));
                }
                // Several messages but not a full batch: a stream the reader
                // outpaces, so wait longer next time. A full batch (the
                // reader is behind) or a lone message (no stream, e.g. a
                // request) waits less.
                local.gap = if count > 1 && count < good_batch {
                    (local.gap * 2).clamp(1, MAX_GAP)
                } else {
                    local.gap / 2
                };
                return Ok(self.hand_out(&mut local, entry));
            }
            if state.closed {
                return Err(RecvError::Closed);
            }
            let at = wait_deadline(wait, &mut deadline)?;
            if !park {
                continue;
            }
            // Going idle: give back the buffers a burst left behind.
            local.buf = VecDeque::new();
            state.spare.clear();
            drop(local);
            state.readers_waiting += 1;
            let timed_out = match at {
                Some(at) => queue.ready.wait_until(&mut state, at).timed_out(),
                None => {
                    queue.ready.wait(&mut state);
                    false
                }
            };
            state.readers_waiting -= 1;
            if timed_out && state.len == 0 && !state.closed {
                return Err(RecvError::Timeout);
            }
        }
    }

    /// Moves up to a batch of entries from the shared queue into the
    /// reader's buffer and returns the first, already counted as handed out
    /// (so producers never see it as queued), with the batch's size. `None`
    /// if the queue is empty.
    fn take_batch(&self, local: &mut Local, state: &mut State) -> Option<(Bytes, usize)> {
        let queue = &*self.queue;
        let first_seq = state.head_seq;
        let count = state.take(queue.batch, &mut local.buf);
        if count == 0 {
            return None;
        }
        local.next_seq = first_seq;
        while state
            .marks
            .front()
            .is_some_and(|mark| mark.seq < state.head_seq)
        {
            if let Some(mark) = state.marks.pop_front() {
                local.marks.push_back(mark);
            }
        }
        state.taken += count as u64;
        queue.waiting.store(state.len > 0, Ordering::Relaxed);
        let first = local.buf.pop_front()?;
        local.handed += 1;
        queue.handed.0.store(local.handed, Ordering::Release);
        state.handed_seen = local.handed;
        if state.producers_waiting > 0 {
            queue.room.notify_all();
        }
        Some((first, count))
    }

    /// Turns the next entry of the reader's buffer into the application's
    /// message.
    #[inline(always)]
    fn hand_out(&self, local: &mut Local, payload: Bytes) -> Message {
        let seq = local.next_seq;
        local.next_seq += 1;
        let mut reply = None;
        let mut headers = None;
        while local.marks.front().is_some_and(|mark| mark.seq <= seq) {
            if let Some(mark) = local.marks.pop_front() {
                if let Some(subject) = mark.subject {
                    if *local.subject != *subject {
                        local.subject = subject;
                        local.run = 0;
                    }
                }
                if mark.seq == seq {
                    reply = mark.reply;
                    headers = mark.headers;
                }
            }
        }
        local.run = local.run.saturating_add(1);
        if local.run == OWN_SUBJECT_AFTER {
            // A stream: from now on hand out a copy of the subject that only
            // this side counts references to.
            local.subject = Arc::from(&*local.subject);
        }
        Message {
            subject: local.subject.clone(),
            reply,
            headers,
            payload,
        }
    }
}

/// When a receive must give up, computed once into `deadline`: `Err(Empty)`
/// for one that may not wait, `Ok(None)` for one that waits for ever (and
/// for a timeout too long for the clock).
fn wait_deadline(
    wait: Wait,
    deadline: &mut Option<Option<Instant>>,
) -> Result<Option<Instant>, RecvError> {
    match wait {
        Wait::No => Err(RecvError::Empty),
        Wait::Forever => Ok(None),
        Wait::For(timeout) => {
            Ok(*deadline.get_or_insert_with(|| Instant::now().checked_add(timeout)))
        }
    }
}

/// Busy-waits for `hints` spin-loop hints (each some tens of nanoseconds).
fn spin(hints: u32) {
    #[cfg(test)]
    tests::SPINS.set(tests::SPINS.get() + 1);
    for _ in 0..hints {
        std::hint::spin_loop();
    }
}

impl Iterator for Subscription {
    type Item = Message;

    fn next(&mut self) -> Option<Message> {
        self.recv().ok()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        // Close the queue first: a producer waiting for room in it (the
        // `block` policy) may hold the owner's table of subscriptions,
        // which unsubscribing takes. Closed, it refuses the waiting message
        // and lets go. Producers that still hold the sink for a moment (a
        // publishing thread's cached route) are refused too, and what is
        // queued is freed.
        let mut state = self.queue.state.lock();
        state.closed = true;
        state.clear();
        self.queue.waiting.store(false, Ordering::Relaxed);
        self.queue.closed.store(true, Ordering::Release);
        self.queue.room.notify_all();
        drop(state);
        self.local.lock().buf.clear();
        self.owner.unsubscribe(self.sid);
    }
}

/// Messages matching a pattern, each handed to a handler on the thread
/// that delivers it, which publishes the handler's reply to a request
/// ([`crate::Broker::respond`], [`crate::Client::respond`]). Dropping it
/// unsubscribes; a message a publishing thread is delivering meanwhile may
/// still reach the handler.
///
/// Its [`stats`](Self::stats) count the messages handled as delivered, and
/// as dropped the replies to requests lost: the handler panicked, or its
/// reply was over the payload limit (`limits.max_payload`, or a client's
/// server's), or could not be published from an in-process request (the
/// broker shutting down). A client's responder counts there too the
/// requests its broker discarded for it
/// ([`SubscriptionStats::dropped_by_broker`]).
pub struct Responder {
    sid: u64,
    pattern: String,
    queue_group: Option<String>,
    queue: Arc<Queue>,
    stats: Arc<SubscriptionStats>,
    owner: Arc<dyn SubscriptionOwner>,
    /// The handler, dropped with this (its sink holds it weakly).
    _handler: Answer,
}

impl std::fmt::Debug for Responder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Responder")
            .field("sid", &self.sid)
            .field("pattern", &self.pattern)
            .field("queue", &self.queue_group)
            .finish()
    }
}

impl Responder {
    pub(crate) fn new(
        sid: u64,
        pattern: String,
        queue_group: Option<String>,
        reader: QueueReader,
        stats: Arc<SubscriptionStats>,
        owner: Arc<dyn SubscriptionOwner>,
        handler: Answer,
    ) -> Responder {
        Responder {
            sid,
            pattern,
            queue_group,
            queue: reader.queue,
            stats,
            owner,
            _handler: handler,
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
        self.queue_group.as_deref()
    }

    /// Messages handled and replies lost (see [`Responder`]).
    pub fn stats(&self) -> &SubscriptionStats {
        &self.stats
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        // Closed first: a publishing thread's cached route still holding
        // the sink is refused from now on.
        self.queue.close();
        self.owner.unsubscribe(self.sid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drive::{Driven, Rounds};

    #[test]
    fn a_reader_yields_for_twice_its_recent_wait_within_bounds() {
        let us = Duration::from_micros;
        let mut window = YieldWindow::new(us(50));
        assert_eq!(window.get(), YIELD_MIN);
        let mut after = |waited| {
            window.waited(waited);
            window.get()
        };
        assert_eq!(after(us(0)), YIELD_MIN);
        assert_eq!(after(us(60)), us(120));
        assert_eq!(after(us(200)), us(250));
        assert_eq!(after(us(500)), us(250));
        // Rarer messages: the reader parks soon again.
        assert_eq!(after(us(501)), YIELD_MIN);
        assert_eq!(after(Duration::from_secs(1)), YIELD_MIN);
        // No polling after work (`spin_us = 0`): the minimum throughout.
        let mut window = YieldWindow::new(Duration::ZERO);
        window.waited(us(60));
        assert_eq!(window.get(), YIELD_MIN);
    }

    thread_local! {
        /// Calls of `spin` on this thread.
        pub(super) static SPINS: Cell<u64> = const { Cell::new(0) };
    }

    struct Nobody;

    impl SubscriptionOwner for Nobody {
        fn unsubscribe(&self, _sid: u64) {}
    }

    /// An owner that would drive (or not): a drive records how often its
    /// reader had spun and delivers the message the reader waits for.
    struct Driving {
        would: bool,
        sink: LocalSink,
        spins_before_drive: Mutex<Option<u64>>,
    }

    impl SubscriptionOwner for Driving {
        fn unsubscribe(&self, _sid: u64) {}

        fn drive(&self, _sid: u64, _until: Instant, _ready: &dyn Fn() -> bool) -> bool {
            self.spins_before_drive
                .lock()
                .get_or_insert_with(|| SPINS.get());
            self.sink.deliver(message(1));
            true
        }

        fn would_drive(&self, _sid: u64) -> bool {
            self.would
        }
    }

    #[test]
    fn a_reader_that_would_drive_drives_before_it_spins() {
        for would in [true, false] {
            let (sink, reader, stats) =
                LocalSink::new(8, SlowConsumerPolicy::Block, Duration::ZERO);
            let owner = Arc::new(Driving {
                would,
                sink,
                spins_before_drive: Mutex::new(None),
            });
            let spin = Duration::from_micros(50);
            let sub = Subscription::new(1, "a".into(), None, reader, stats, owner.clone(), spin);
            SPINS.set(0);
            let received = sub.recv_timeout(Duration::from_secs(10));
            assert_eq!(received.map(|m| m.payload[0]), Ok(1));
            let spun = owner.spins_before_drive.lock().expect("the reader drove");
            if would {
                // Its messages come in rounds it runs: spinning first
                // would only delay them.
                assert_eq!(spun, 0);
            } else {
                assert_eq!(spun, u64::from(SPIN_ROUNDS));
            }
        }
    }

    fn message(n: u8) -> Message {
        Message {
            headers: None,
            subject: "a".into(),
            reply: None,
            payload: Bytes::from(vec![n]),
        }
    }

    fn queue(
        capacity: usize,
        policy: SlowConsumerPolicy,
        block_timeout: Duration,
    ) -> (LocalSink, Subscription) {
        let (sink, reader, stats) = LocalSink::new(capacity, policy, block_timeout);
        let spin = Duration::from_micros(50);
        let sub = Subscription::new(1, "a".into(), None, reader, stats, Arc::new(Nobody), spin);
        (sink, sub)
    }

    fn drain(sub: &Subscription) -> Vec<u8> {
        std::iter::from_fn(|| sub.try_recv().ok())
            .map(|m| m.payload[0])
            .collect()
    }

    /// A run longer than the queue's room, queued under `block` for a
    /// reader asleep on the empty queue: the reader is woken before the
    /// producer waits for room, and every message arrives, in order, with
    /// none dropped.
    #[test]
    fn a_run_larger_than_the_room_reaches_a_sleeping_reader_whole() {
        let (sink, sub) = queue(2, SlowConsumerPolicy::Block, Duration::from_secs(2));
        std::thread::scope(|scope| {
            let reader = scope.spawn(|| {
                (0..6)
                    .map_while(|_| sub.recv_timeout(Duration::from_secs(10)).ok())
                    .map(|m| m.payload[0])
                    .collect::<Vec<u8>>()
            });
            let deadline = Instant::now() + Duration::from_secs(10);
            while sink.queue.state.lock().readers_waiting == 0 {
                assert!(Instant::now() < deadline, "the reader never waited");
                std::thread::sleep(Duration::from_millis(1));
            }
            let mut run: Vec<Message> = (0..6).map(message).collect();
            assert!(!sink.deliver_run(&mut run), "the queue is open");
            assert!(run.is_empty());
            assert_eq!(reader.join().expect("the reader"), vec![0, 1, 2, 3, 4, 5]);
        });
        assert_eq!(sub.stats().dropped(), 0);
        assert_eq!(sub.stats().delivered(), 6);
    }

    /// A run for a queue closed part-way (the disconnect policy at the
    /// bound) says so, queues what came before, and drops the rest.
    #[test]
    fn a_run_into_a_queue_that_closes_reports_it_closed() {
        let (sink, sub) = queue(2, SlowConsumerPolicy::Disconnect, Duration::ZERO);
        let mut run: Vec<Message> = (0..5).map(message).collect();
        assert!(sink.deliver_run(&mut run));
        assert!(run.is_empty());
        assert_eq!(drain(&sub), vec![0, 1]);
        // The message that found the queue full is counted; those after
        // it went to a closed queue, as one by one.
        assert_eq!(sub.stats().delivered(), 2);
        assert_eq!(sub.stats().dropped(), 1);
        let mut more = vec![message(9)];
        assert!(sink.deliver_run(&mut more), "a closed queue takes no more");
    }

    /// A plain run goes as its messages one by one would: under its one
    /// subject, after a message on another, and past the queue's room to a
    /// reader that makes room.
    #[test]
    fn a_plain_run_is_queued_as_its_messages_one_by_one() {
        let (sink, sub) = queue(4, SlowConsumerPolicy::Block, Duration::from_secs(10));
        let read = Bytes::from((0..=255u8).collect::<Vec<u8>>());
        sink.deliver(Message {
            subject: "other".into(),
            ..message(0)
        });
        let subject: Arc<str> = "a.b".into();
        let mut plain: Vec<Bytes> = (1..7).map(|n| read.slice(n..n + 1)).collect();
        std::thread::scope(|scope| {
            // Room for three: the rest wait for the reader.
            let reader = scope.spawn(|| {
                (0..7)
                    .map_while(|_| sub.recv_timeout(Duration::from_secs(10)).ok())
                    .map(|m| (m.subject.to_string(), m.reply, m.headers, m.payload[0]))
                    .collect::<Vec<_>>()
            });
            assert!(!sink.deliver_plain_run(&subject, &mut plain));
            assert!(plain.is_empty());
            let got = reader.join().expect("the reader");
            let expected: Vec<_> = (0..7)
                .map(|n| {
                    let subject = if n == 0 { "other" } else { "a.b" };
                    (subject.to_string(), None, None, n)
                })
                .collect();
            assert_eq!(got, expected);
        });
        assert_eq!(sub.stats().delivered(), 7);
    }

    /// A plain run into a closed queue says so.
    #[test]
    fn a_plain_run_into_a_closed_queue_reports_it_closed() {
        let (sink, sub) = queue(4, SlowConsumerPolicy::Block, Duration::ZERO);
        sink.close();
        let mut plain = vec![Bytes::from_static(b"x")];
        assert!(sink.deliver_plain_run(&"a".into(), &mut plain));
        assert!(plain.is_empty());
        assert_eq!(sub.try_recv(), Err(RecvError::Closed));
    }

    /// A plain run longer than the room: under `drop-oldest` the oldest
    /// go, counted; under `disconnect` the queue closes at the bound and
    /// the run says so.
    #[test]
    fn a_plain_run_past_the_room_follows_the_policy() {
        let payloads = || (0..6u8).map(|n| Bytes::from(vec![n])).collect::<Vec<_>>();
        let (sink, sub) = queue(4, SlowConsumerPolicy::DropOldest, Duration::ZERO);
        assert!(!sink.deliver_plain_run(&"a".into(), &mut payloads()));
        assert_eq!(drain(&sub), vec![2, 3, 4, 5]);
        assert_eq!(sub.stats().delivered(), 6);
        assert_eq!(sub.stats().dropped(), 2);
        let (sink, sub) = queue(4, SlowConsumerPolicy::Disconnect, Duration::ZERO);
        assert!(sink.deliver_plain_run(&"a".into(), &mut payloads()));
        assert_eq!(drain(&sub), vec![0, 1, 2, 3]);
        assert_eq!(sub.stats().dropped(), 1);
    }

    /// Under `block`, a message the event loop held for the block timeout
    /// and then dropped leaves the reader taken for stalled: the next are
    /// dropped at once, not held for the timeout again (the loop's reads
    /// held with them each time), until it takes one.
    #[test]
    fn a_reader_stalled_past_a_held_message_s_timeout_is_not_waited_for_again() {
        let (sink, sub) = queue(1, SlowConsumerPolicy::Block, Duration::from_millis(20));
        assert_eq!(sink.offer_held(message(0)), Delivery::Queued);
        assert_eq!(sink.offer_held(message(1)), Delivery::Full);
        sink.drop_held();
        assert_eq!(sink.offer_held(message(2)), Delivery::Dropped);
        assert_eq!(drain(&sub), vec![0]);
        assert_eq!(sink.offer_held(message(3)), Delivery::Queued);
        assert_eq!(sink.offer_held(message(4)), Delivery::Full);
        assert_eq!(sub.stats().dropped(), 2);
    }

    /// The broker's drop reports carry counts off the network: a huge one
    /// saturates the totals instead of wrapping them (or, in a debug
    /// build, panicking the reader that asks).
    #[test]
    fn drop_counts_from_the_broker_saturate() {
        let (sink, sub) = queue(4, SlowConsumerPolicy::DropOldest, Duration::ZERO);
        sink.drop_held();
        sink.count_dropped_by_broker(u64::MAX - 1);
        sink.count_dropped_by_broker(5);
        assert_eq!(sub.stats().dropped_by_broker(), u64::MAX);
        assert_eq!(sub.stats().dropped(), u64::MAX);
    }

    /// `recv_many` takes the first message as `recv_timeout` would, then
    /// what waits behind it, up to `max`, and never more than it finds.
    #[test]
    fn recv_many_takes_what_waits_up_to_its_maximum() {
        let (sink, sub) = queue(16, SlowConsumerPolicy::Block, Duration::ZERO);
        let mut out = Vec::new();
        assert_eq!(
            sub.recv_many(&mut out, 4, Duration::ZERO),
            Err(RecvError::Empty)
        );
        assert_eq!(
            sub.recv_many(&mut out, 4, Duration::from_millis(20)),
            Err(RecvError::Timeout)
        );
        assert!(out.is_empty());
        for n in 0..6 {
            sink.deliver(message(n));
        }
        assert_eq!(sub.recv_many(&mut out, 0, Duration::ZERO), Ok(0));
        assert_eq!(sub.recv_many(&mut out, 4, Duration::ZERO), Ok(4));
        assert_eq!(sub.recv_many(&mut out, 4, Duration::from_secs(1)), Ok(2));
        let got: Vec<u8> = out.iter().map(|m| m.payload[0]).collect();
        assert_eq!(got, vec![0, 1, 2, 3, 4, 5]);
        // The bound counts them handed out: room for 16 again.
        for n in 0..16 {
            assert_eq!(sink.deliver(message(n)), Delivery::Queued);
        }
        sink.close();
        out.clear();
        assert_eq!(sub.recv_many(&mut out, 100, Duration::ZERO), Ok(16));
        assert_eq!(
            sub.recv_many(&mut out, 100, Duration::ZERO),
            Err(RecvError::Closed)
        );
    }

    /// A run is queued as the same messages one by one would be: subjects,
    /// replies and payloads in order.
    #[test]
    fn a_run_keeps_each_message_s_subject_and_reply() {
        let (sink, sub) = queue(8, SlowConsumerPolicy::Block, Duration::ZERO);
        let mut run = vec![
            Message {
                reply: Some("r.1".into()),
                ..message(1)
            },
            Message {
                subject: "b".into(),
                ..message(2)
            },
            message(3),
        ];
        assert!(!sink.deliver_run(&mut run));
        let got: Vec<(String, Option<String>, u8)> = std::iter::from_fn(|| sub.try_recv().ok())
            .map(|m| {
                let reply = m.reply.as_deref().map(str::to_string);
                (m.subject.to_string(), reply, m.payload[0])
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("a".to_string(), Some("r.1".to_string()), 1),
                ("b".to_string(), None, 2),
                ("a".to_string(), None, 3),
            ]
        );
    }

    /// Received payloads that wait behind others, each from another part
    /// of the buffer they were read into (a subscriber getting a few of
    /// the messages read), hold copies, not the buffer; the first, taken
    /// at once, is not copied.
    #[test]
    fn sparse_received_payloads_that_wait_keep_no_larger_buffer_alive() {
        let (sink, sub) = queue(8, SlowConsumerPolicy::DropOldest, Duration::ZERO);
        let read = Bytes::from(vec![3u8; 64 << 10]);
        let received = |at: usize| Message {
            headers: Some(read.slice(at..at + 8)),
            subject: "a".into(),
            reply: None,
            payload: read.slice(at + 8..at + 1500),
        };
        for at in [0, 10_000, 20_000] {
            sink.deliver(received(at));
        }
        let first = sub.try_recv().expect("the first message");
        assert_eq!(first.payload.as_ptr(), read.slice(8..).as_ptr());
        drop(first);
        assert!(read.is_unique(), "a waiting payload holds the read buffer");
        let second = sub.try_recv().expect("the second message");
        assert_eq!(&second.payload[..], &read[10_008..11_500]);
    }

    /// Payloads read one after another (a stream to one subscriber) share
    /// their buffer while they wait: none is copied.
    #[test]
    fn a_stream_of_received_payloads_is_queued_without_copies() {
        let (sink, sub) = queue(8, SlowConsumerPolicy::DropOldest, Duration::ZERO);
        let read = Bytes::from(vec![4u8; 64 << 10]);
        let payloads: Vec<Bytes> = (0..4)
            .map(|n| read.slice(n * 1540..n * 1540 + 1500))
            .collect();
        for payload in &payloads {
            sink.deliver(Message {
                headers: None,
                subject: "a".into(),
                reply: None,
                payload: payload.clone(),
            });
        }
        for payload in &payloads {
            let got = sub.try_recv().expect("a message");
            assert_eq!(got.payload.as_ptr(), payload.as_ptr());
        }
    }

    #[test]
    fn a_wait_for_a_message_sets_the_reader_s_window_and_a_poll_does_not() {
        // Loops polling 5 ms: windows of up to 25 ms, kept after waits of
        // up to 50 ms, so a busy machine's delays (other tests' threads
        // spinning on both cores) do not decide the outcome.
        let spin = Duration::from_millis(5);
        let (sink, reader, stats) = LocalSink::new(8, SlowConsumerPolicy::Block, Duration::ZERO);
        let sub = Subscription::new(1, "a".into(), None, reader, stats, Arc::new(Nobody), spin);
        // A wait longer than 50 ms (the deliverer kept off both cores that
        // long) rightly resets the window, and a reader kept off its core
        // until the message is there finds it without waiting: try again,
        // a few times, until a timely wait has set the window.
        let timely = Duration::from_millis(2)..Duration::from_millis(40);
        let mut waits = Vec::new();
        for n in 1..=10 {
            let ready = std::sync::Barrier::new(2);
            let waited = std::thread::scope(|scope| {
                scope.spawn(|| {
                    ready.wait();
                    std::thread::sleep(Duration::from_millis(5));
                    sink.deliver(message(n));
                });
                ready.wait();
                let start = Instant::now();
                let received = sub.recv_timeout(Duration::from_secs(10));
                assert_eq!(received.map(|m| m.payload[0]), Ok(n));
                start.elapsed()
            });
            waits.push(waited);
            if timely.contains(&waited) && sub.yield_window().get() >= 10 * YIELD_MIN {
                break;
            }
        }
        // About twice the wait, far above the minimum.
        let window = sub.yield_window().get();
        assert!(
            window >= 10 * YIELD_MIN,
            "window {window:?} after {waits:?}"
        );
        // `try_recv` does not wait: neither an empty poll nor a message
        // found by one changes the window.
        assert!(sub.try_recv().is_err());
        sink.deliver(message(20));
        assert_eq!(sub.try_recv().map(|m| m.payload[0]), Ok(20));
        assert_eq!(sub.yield_window().get(), window);
    }

    #[test]
    fn a_timeout_beyond_the_clock_waits_for_the_message() {
        let (sink, sub) = queue(8, SlowConsumerPolicy::Block, Duration::ZERO);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                sink.deliver(message(7));
            });
            let received = sub.recv_timeout(Duration::MAX);
            assert_eq!(received.map(|m| m.payload[0]), Ok(7));
        });
    }

    #[test]
    fn drop_oldest_keeps_the_newest_and_counts() {
        let (sink, sub) = queue(2, SlowConsumerPolicy::DropOldest, Duration::ZERO);
        for n in 0..5 {
            sink.deliver(message(n));
        }
        assert_eq!(drain(&sub), vec![3, 4]);
        assert_eq!(sub.stats().dropped(), 3);
        assert_eq!(sub.stats().delivered(), 5);
    }

    #[test]
    fn drop_oldest_discards_only_what_the_reader_has_not_taken() {
        let (sink, sub) = queue(8, SlowConsumerPolicy::DropOldest, Duration::ZERO);
        for n in 0..8 {
            sink.deliver(message(n));
        }
        // The reader takes a batch of two (a quarter of the bound) and
        // hands out the first.
        assert_eq!(sub.try_recv().map(|m| m.payload[0]), Ok(0));
        for n in 8..12 {
            sink.deliver(message(n));
        }
        // Message 1 was in the reader's hands; 2 to 4 were discarded.
        assert_eq!(drain(&sub), vec![1, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(sub.stats().dropped(), 3);
    }

    #[test]
    fn block_waits_then_drops_and_counts() {
        let (sink, sub) = queue(1, SlowConsumerPolicy::Block, Duration::from_millis(20));
        assert_eq!(sink.deliver(message(0)), Delivery::Queued);
        assert_eq!(sink.deliver(message(1)), Delivery::Dropped);
        assert_eq!(sub.stats().dropped(), 1);
        assert_eq!(drain(&sub), vec![0]);
    }

    #[test]
    fn block_resumes_when_the_reader_makes_room() {
        let (sink, sub) = queue(1, SlowConsumerPolicy::Block, Duration::from_secs(30));
        assert_eq!(sink.deliver(message(0)), Delivery::Queued);
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            let got: Vec<u8> = (0..3)
                .map(|_| sub.recv().map(|m| m.payload[0]))
                .collect::<Result<_, _>>()
                .expect("messages");
            (got, sub.stats().dropped())
        });
        assert_eq!(
            sink.deliver(message(1)),
            Delivery::Queued,
            "reader made room"
        );
        assert_eq!(
            sink.deliver(message(2)),
            Delivery::Queued,
            "reader made room"
        );
        assert_eq!(reader.join().unwrap(), (vec![0, 1, 2], 0));
    }

    /// A loop whose first round delivers a burst into each of its sinks.
    struct BurstLoop {
        sinks: Vec<LocalSink>,
        burst: u8,
        done: bool,
    }

    impl Rounds for BurstLoop {
        fn driven_round(&mut self) -> Option<bool> {
            if self.done {
                return Some(false);
            }
            self.done = true;
            for sink in &self.sinks {
                for n in 0..self.burst {
                    sink.deliver(message(n));
                }
            }
            Some(true)
        }
    }

    /// The owner of subscriptions fed by a [`BurstLoop`], which their
    /// readers drive.
    struct Burst {
        driven: Driven<BurstLoop>,
        stop: AtomicBool,
    }

    impl SubscriptionOwner for Burst {
        fn unsubscribe(&self, _sid: u64) {}

        fn drive(&self, _sid: u64, until: Instant, ready: &dyn Fn() -> bool) -> bool {
            // No loop thread here takes over when a drive's window has
            // passed (as it may before a loaded machine runs the reader):
            // the reader's drive is the only way anything is delivered.
            let until = until.max(Instant::now() + Duration::from_secs(1));
            self.driven.drive(until, ready, &self.stop) > 0
        }
    }

    fn burst(sinks: Vec<LocalSink>, burst: u8) -> Arc<Burst> {
        Arc::new(Burst {
            driven: Driven::new(
                BurstLoop {
                    sinks,
                    burst,
                    done: false,
                },
                || {},
                || {},
            ),
            stop: AtomicBool::new(false),
        })
    }

    #[test]
    fn a_reader_s_own_round_queues_past_the_bound_rather_than_wait_for_itself() {
        // Under `block` a full queue waits for its reader; when the reader
        // is the thread delivering (it runs its owner's loop while it
        // waits, here for `first`), that wait could only time out and drop,
        // in the queue it waits on and in another it reads (`second`).
        let timeout = Duration::from_millis(50);
        let (first_sink, first_reader, first_stats) =
            LocalSink::new(2, SlowConsumerPolicy::Block, timeout);
        let (second_sink, second_reader, second_stats) =
            LocalSink::new(2, SlowConsumerPolicy::Block, timeout);
        let owner = burst(vec![first_sink, second_sink], 8);
        let spin = Duration::from_micros(50);
        let subscription = |reader, stats| {
            Subscription::new(1, "a".into(), None, reader, stats, owner.clone(), spin)
        };
        let first = subscription(first_reader, first_stats);
        let second = subscription(second_reader, second_stats);
        // This thread reads `second` too.
        assert_eq!(second.try_recv().err(), Some(RecvError::Empty));
        let got: Vec<u8> = (0..8)
            .map(|_| {
                first
                    .recv_timeout(Duration::from_secs(10))
                    .map(|m| m.payload[0])
            })
            .collect::<Result<_, _>>()
            .expect("the whole burst");
        assert_eq!(got, (0..8).collect::<Vec<u8>>());
        // Past its bound by one round: this thread drives no more rounds
        // until it has read `second` back under it.
        assert!(!may_drive());
        let soon = Instant::now() + Duration::from_secs(10);
        assert_eq!(owner.driven.drive(soon, &|| false, &owner.stop), 0);
        assert_eq!(drain(&second), (0..8).collect::<Vec<u8>>());
        assert!(may_drive());
        assert_eq!((first.stats().dropped(), second.stats().dropped()), (0, 0));

        // A round run by a thread that does not read the queue still waits
        // for room, and drops after the block timeout.
        let (sink, reader, stats) =
            LocalSink::new(1, SlowConsumerPolicy::Block, Duration::from_millis(20));
        let owner = burst(vec![sink], 2);
        let other = Subscription::new(1, "a".into(), None, reader, stats, owner.clone(), spin);
        std::thread::scope(|scope| {
            scope.spawn(|| assert_eq!(other.try_recv().err(), Some(RecvError::Empty)));
        });
        let far = Instant::now() + Duration::from_secs(10);
        assert_eq!(
            owner
                .driven
                .drive(far, &|| other.pending() > 0, &owner.stop),
            1
        );
        assert_eq!(other.stats().dropped(), 1);
        assert_eq!(drain(&other), vec![0]);
    }

    #[test]
    fn disconnect_closes_the_sink() {
        let (sink, sub) = queue(1, SlowConsumerPolicy::Disconnect, Duration::ZERO);
        assert_eq!(sink.deliver(message(0)), Delivery::Queued);
        assert!(!sink.is_cut_off());
        assert_eq!(sink.deliver(message(1)), Delivery::Closed);
        assert!(sink.is_cut_off());
        assert_eq!(sink.deliver(message(2)), Delivery::Closed);
        assert_eq!(sub.stats().dropped(), 1);
        assert_eq!(sub.try_recv().map(|m| m.payload[0]), Ok(0));
        assert_eq!(sub.try_recv(), Err(RecvError::Closed));
    }

    #[test]
    fn closing_or_dropping_the_sink_ends_the_stream_after_the_queue() {
        let (sink, sub) = queue(4, SlowConsumerPolicy::Block, Duration::ZERO);
        sink.deliver(message(0));
        sink.close();
        assert_eq!(sink.deliver(message(1)), Delivery::Closed);
        assert!(!sink.is_cut_off());
        assert_eq!(sub.recv().map(|m| m.payload[0]), Ok(0));
        assert_eq!(sub.recv(), Err(RecvError::Closed));

        let (sink, sub) = queue(4, SlowConsumerPolicy::Block, Duration::ZERO);
        let reader = std::thread::spawn(move || sub.recv_timeout(Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(20));
        drop(sink);
        assert_eq!(reader.join().unwrap(), Err(RecvError::Closed));
    }

    #[test]
    fn dropping_the_subscription_refuses_further_messages() {
        let (sink, sub) = queue(4, SlowConsumerPolicy::Block, Duration::from_secs(30));
        sink.deliver(message(0));
        drop(sub);
        assert_eq!(sink.deliver(message(1)), Delivery::Closed);
        assert!(!sink.is_cut_off());
    }

    #[test]
    fn timeouts_and_empty_queues() {
        let (sink, sub) = queue(4, SlowConsumerPolicy::Block, Duration::ZERO);
        assert_eq!(sub.try_recv(), Err(RecvError::Empty));
        assert_eq!(
            sub.recv_timeout(Duration::from_millis(5)),
            Err(RecvError::Timeout)
        );
        sink.deliver(message(7));
        assert_eq!(sub.pending(), 1);
        assert_eq!(
            sub.recv_timeout(Duration::from_millis(5))
                .map(|m| m.payload[0]),
            Ok(7)
        );
        assert_eq!(sub.pending(), 0);
    }

    #[test]
    fn kept_subjects_are_stored_once_and_survive_drops() {
        let (sink, sub) = queue(3, SlowConsumerPolicy::DropOldest, Duration::ZERO);
        let a: Arc<str> = Arc::from("a.one");
        let b: Arc<str> = Arc::from("b.two");
        let payload = |n: u8| Bytes::from(vec![n]);
        sink.deliver_kept(&a, None, None, payload(0));
        sink.deliver_kept(&a, None, None, payload(1));
        sink.deliver_kept(&b, None, None, payload(2));
        sink.deliver_kept(&b, None, None, payload(3));
        sink.deliver_kept(&b, None, None, payload(4));
        // 0 and 1 were discarded; 2 carried b's string, and 3 and 4 refer
        // to it.
        let got: Vec<(String, u8)> = std::iter::from_fn(|| sub.try_recv().ok())
            .map(|m| (m.subject.to_string(), m.payload[0]))
            .collect();
        assert_eq!(
            got,
            [
                ("b.two".into(), 2),
                ("b.two".into(), 3),
                ("b.two".into(), 4)
            ]
        );
        // The head that carried the string was discarded with the queue
        // emptied: the next entry carries it again.
        for n in 5..9 {
            sink.deliver_kept(&a, None, None, payload(n));
        }
        sink.deliver(Message {
            headers: None,
            subject: Arc::from("c"),
            reply: Some(Arc::from("r")),
            payload: payload(9),
        });
        // Headers belong to their own message only.
        let block = Bytes::from_static(b"NATS/1.0\r\nA: 1\r\n\r\n");
        sink.deliver_kept(&a, None, Some(block.clone()), payload(10));
        sink.deliver_kept(&a, None, None, payload(11));
        let got: Vec<_> = std::iter::from_fn(|| sub.try_recv().ok())
            .map(|m| {
                (
                    m.subject.to_string(),
                    m.reply.as_deref().map(str::to_string),
                    m.headers,
                    m.payload[0],
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                // 8 made room for 11 (three are kept).
                ("c".into(), Some("r".into()), None, 9),
                ("a.one".into(), None, Some(block), 10),
                ("a.one".into(), None, None, 11)
            ]
        );
    }

    #[test]
    fn subjects_and_replies_survive_switches_drops_and_batches() {
        // A deterministic mix of subjects (kept and owned strings), replies,
        // discards and reads; every message read must carry what it was
        // published with.
        let (sink, sub) = queue(16, SlowConsumerPolicy::DropOldest, Duration::ZERO);
        let kept: Vec<Arc<str>> = ["k.one", "k.two", "k.three"]
            .iter()
            .map(|s| Arc::from(*s))
            .collect();
        let mut sent: Vec<(String, Option<String>)> = Vec::new();
        let mut seed = 12345u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let mut read = 0;
        for n in 0..5000u32 {
            // Long runs on one subject now and then, so the reader switches
            // to its own copy, and frequent switches otherwise.
            let pick = if n % 1000 < 200 { 0 } else { next(3) as usize };
            let reply = (next(10) == 0).then(|| format!("r.{n}"));
            let payload = Bytes::copy_from_slice(&n.to_le_bytes());
            if next(2) == 0 {
                sink.deliver_kept(&kept[pick], reply.as_deref().map(Arc::from), None, payload);
            } else {
                sink.deliver(Message {
                    headers: None,
                    subject: Arc::from(&*kept[pick]),
                    reply: reply.as_deref().map(Arc::from),
                    payload,
                });
            }
            sent.push((kept[pick].to_string(), reply));
            for _ in 0..next(3) {
                let Ok(m) = sub.try_recv() else { break };
                let id = u32::from_le_bytes(m.payload[..4].try_into().expect("4 bytes"));
                let (subject, reply) = &sent[id as usize];
                assert_eq!(&*m.subject, subject, "message {id}");
                assert_eq!(m.reply.as_deref(), reply.as_deref(), "message {id}");
                read += 1;
            }
        }
        read += drain(&sub).len();
        assert_eq!(read as u64 + sub.stats().dropped(), 5000);
        assert!(sub.stats().dropped() > 0, "the mix discards some");
    }

    #[test]
    fn the_bound_counts_what_the_reader_holds() {
        let (sink, sub) = queue(4, SlowConsumerPolicy::Block, Duration::ZERO);
        for n in 0..4 {
            assert_eq!(sink.deliver(message(n)), Delivery::Queued);
        }
        // The reader takes all four and hands out one: three are still
        // queued, so one more fits and the next does not.
        assert_eq!(sub.try_recv().map(|m| m.payload[0]), Ok(0));
        assert_eq!(sink.deliver(message(4)), Delivery::Queued);
        assert_eq!(sink.deliver(message(5)), Delivery::Dropped);
        assert_eq!(sub.pending(), 4);
        // Handing out the rest of the batch makes room again.
        assert_eq!(sub.try_recv().map(|m| m.payload[0]), Ok(1));
        assert_eq!(sub.try_recv().map(|m| m.payload[0]), Ok(2));
        assert_eq!(sink.deliver(message(6)), Delivery::Queued);
        assert_eq!(sink.deliver(message(7)), Delivery::Queued);
        assert_eq!(sink.deliver(message(8)), Delivery::Dropped);
        assert_eq!(drain(&sub), vec![3, 4, 6, 7]);
    }

    #[test]
    fn one_producer_one_reader_in_order() {
        let (sink, sub) = queue(64, SlowConsumerPolicy::Block, Duration::from_secs(30));
        let total = 20_000u32;
        let reader = std::thread::spawn(move || {
            let mut next = 0u32;
            while let Ok(m) = sub.recv_timeout(Duration::from_secs(30)) {
                let n = u32::from_le_bytes(m.payload[..4].try_into().expect("4 bytes"));
                assert_eq!(n, next);
                next += 1;
            }
            next
        });
        let subject: Arc<str> = Arc::from("s");
        for n in 0..total {
            let payload = Bytes::copy_from_slice(&n.to_le_bytes());
            assert_eq!(
                sink.deliver_kept(&subject, None, None, payload),
                Delivery::Queued
            );
        }
        drop(sink);
        assert_eq!(reader.join().unwrap(), total);
    }
}
