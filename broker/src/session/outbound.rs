//! What a session sends: the path a frame takes (the reliable data link
//! once in use, else the control link), the queue of what the path could
//! not take yet with its slow-consumer policy, and the batch the broker
//! encodes a round's deliveries into.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use efabus_core::codec;
use efabus_core::transport::{split_run_slices, Detacher, Endpoint, OutFrame, PeerId, SendError};
use tracing::{debug, warn};

use super::data_link::{DataLink, DataLinks, Sent};
use crate::config::SlowConsumerPolicy;

/// Largest buffer a run of frames is encoded into, by the broker's batches
/// and the client's outbox alike; a run is handed on when its buffer is
/// full.
pub(crate) const RUN_MAX: usize = 64 << 10;
/// Smallest buffer a broker's batch starts with: the broker keeps one per
/// session, thousands of them, so an idle one costs little (the client's
/// single outbox starts larger).
const BATCH_MIN: usize = 1 << 10;
/// A batch at least this long hands on only what it holds and keeps the
/// rest of its buffer; a shorter one takes its buffer along, so a session
/// gone idle keeps little memory.
const BATCH_KEEP: usize = 4 << 10;

/// A session's control link: the endpoint (an index into the owner's
/// endpoint list) and the peer on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Control {
    pub endpoint: usize,
    pub peer: PeerId,
}

/// One entry of the outbound queue.
pub(crate) struct Queued {
    pub frame: OutFrame,
    /// Messages it holds (a run holds many): only messages may be
    /// discarded by the drop-oldest policy, and each discarded one counts.
    pub messages: usize,
    /// Several whole frames back to back, for `send_run`.
    pub run: bool,
    /// Frames it holds, counted by the run's maker: a run that fits one
    /// piece of a data link goes without reading where each of its frames
    /// ends.
    pub frames: usize,
}

impl Queued {
    /// One frame; `is_message` when it carries a message.
    pub fn frame(frame: OutFrame, is_message: bool) -> Queued {
        Queued {
            frame,
            messages: usize::from(is_message),
            run: false,
            frames: 1,
        }
    }

    /// A run of `frames` whole frames holding `messages` messages.
    pub fn counted_run(run: Bytes, messages: usize, frames: usize) -> Queued {
        Queued {
            frame: OutFrame::whole(run),
            messages,
            run: true,
            frames,
        }
    }

    /// A run of `messages` frames, each a message.
    pub fn messages_run(run: Bytes, messages: usize) -> Queued {
        Queued::counted_run(run, messages, messages)
    }

    /// `Publish` frames the entry holds (the frames of a client's run of
    /// publishes, or the one frame).
    pub fn publishes(&self) -> u64 {
        publishes_in(&self.frame.head, self.run)
    }

    /// Call `f` with the subscription id of each `Message` frame the entry
    /// holds (the frames of a run of deliveries, or the one frame).
    pub fn for_each_sid(&self, mut f: impl FnMut(u64)) {
        if self.messages == 0 {
            return;
        }
        if self.run {
            for frame in split_run_slices(&self.frame.head) {
                if let Some(sid) = codec::message_sid(frame) {
                    f(sid);
                }
            }
        } else if let Some(sid) = codec::message_sid(&self.frame.head) {
            f(sid);
        }
    }
}

/// Counts a send adds to, for the owner's statistics.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SendCounts {
    /// Frames handed to a data link.
    pub fabric_frames_out: u64,
    /// Sends that found a data link's credit window full.
    pub credit_waits: u64,
    /// Messages in frames the control link refused outright (the peer
    /// closed, or its connection failed): lost with the connection.
    pub refused_messages: u64,
}

/// Send one frame or run on the session's current path: the reliable data
/// link once in use (nothing while its address is not proven yet), else
/// the control link. Gives back what the path could not take (a run's
/// untaken frames, as a run). A frame the control link refuses for another
/// reason than a full path is dropped here, its messages counted in
/// [`SendCounts::refused_messages`]: the link is failing (or was closed
/// already: a session flushed after its peer's timeout) and its closing
/// event, which counts what is still queued, follows. (A client's publishes
/// carry no message count: refused by a failing connection, they are lost
/// with it as those in flight are, at most once across a reconnect; keeping
/// a copy of each to send again cost 4 KiB publishes over TCP 5%.) A frame the reliable
/// data link fails to send is
/// lost with the link ([`DataLinks::failure`]): what comes after it is
/// given back, never sent behind the gap, and so is a frame the link
/// failed on earlier frames' pieces before it took it.
pub(crate) fn transmit(
    endpoints: &mut [Box<dyn Endpoint>],
    control: Control,
    links: &mut DataLinks,
    counts: &mut SendCounts,
    queued: Queued,
) -> Option<Queued> {
    if links.failure.is_some() || links.held() {
        return Some(queued);
    }
    if let Some(link) = links.sending() {
        let endpoint = endpoints[link.endpoint].as_mut();
        let (rest, failure) = if queued.run {
            send_run_on(link, endpoint, counts, queued)
        } else {
            match send_on(link, endpoint, counts, queued.frame, 1) {
                OnLink::Taken => (None, None),
                OnLink::Full(frame) => (Some(Queued { frame, ..queued }), None),
                OnLink::FailedBefore(frame, reason) => {
                    (Some(Queued { frame, ..queued }), Some(reason))
                }
                OnLink::Failed(reason) => (None, Some(reason)),
            }
        };
        links.failure = failure;
        return rest;
    }
    let endpoint = endpoints[control.endpoint].as_mut();
    let result = if queued.run {
        endpoint.send_run(control.peer, queued.frame.head)
    } else {
        endpoint.send(control.peer, queued.frame)
    };
    match result {
        Ok(()) => None,
        Err(SendError::WouldBlock(frame)) => {
            // What comes back may be the rest of a run: counted again
            // (every frame of a run of messages is one).
            let (mut messages, mut frames) = (queued.messages, queued.frames);
            if queued.run {
                frames = split_run_slices(&frame.head).count();
                messages = if messages > 0 { frames } else { 0 };
            }
            Some(Queued {
                frame,
                messages,
                run: queued.run,
                frames,
            })
        }
        Err(err) => {
            if let SendError::TooLarge { .. } = err {
                // Never sendable on this link; its senders check the limit
                // before they queue a frame, so this is a bug to hear of.
                warn!(error = %err, "a frame the control link cannot take was dropped");
            } else {
                debug!(error = %err, "send failed");
            }
            counts.refused_messages += queued.messages as u64;
            None
        }
    }
}

/// Data links carry a run of frames as runs of their own ([`Frame::Run`]),
/// each as long as the link carries in one eager piece, so the link
/// numbers, acknowledges and authenticates a run rather than each small
/// frame in it; a frame too long to share one goes alone. Gives back the
/// frames not taken (from the run the link was full for, or after the one
/// it failed on) and the failure.
///
/// [`Frame::Run`]: efabus_core::frame::Frame::Run
fn send_run_on(
    link: &mut DataLink,
    endpoint: &mut dyn Endpoint,
    counts: &mut SendCounts,
    queued: Queued,
) -> (Option<Queued>, Option<String>) {
    let run = queued.frame.head;
    let limit = link.run_limit();
    let totals = Totals {
        messages: queued.messages,
        frames: queued.frames,
    };
    if run.len() <= limit {
        // One piece, its frames counted when the run was made: where each
        // of them ends need not be read.
        let piece = (0, run.len(), queued.frames);
        return send_piece(link, endpoint, counts, &run, piece, totals, 0).unwrap_or((None, None));
    }
    // Only where each frame ends is needed: the groups are slices of `run`.
    let mut frames = split_run_slices(&run);
    // Frames taken so far, and the group being gathered: `run[start..at]`,
    // `count` frames.
    let (mut sent, mut start, mut count) = (0, 0, 0);
    loop {
        let at = frames.offset();
        let next = frames.next();
        if next.is_some() && (count == 0 || frames.offset() - start <= limit) {
            count += 1;
            continue;
        }
        if count > 0 {
            let piece = (start, at, count);
            if let Some(result) = send_piece(link, endpoint, counts, &run, piece, totals, sent) {
                return result;
            }
            sent += count;
        }
        if next.is_none() {
            return (None, None);
        }
        (start, count) = (at, 1);
    }
}

/// A run's messages and frames (see [`Queued`]).
#[derive(Clone, Copy)]
struct Totals {
    messages: usize,
    frames: usize,
}

/// Sends `run[start..end]`, `count` frames, as one piece, after `sent` of
/// the run's frames went: `None` when the link took it, else what
/// [`send_run_on`] gives back (the frames from `start`, or those after
/// `end` when the link failed on this piece) and the failure.
fn send_piece(
    link: &mut DataLink,
    endpoint: &mut dyn Endpoint,
    counts: &mut SendCounts,
    run: &Bytes,
    (start, end, count): (usize, usize, usize),
    totals: Totals,
    sent: usize,
) -> Option<(Option<Queued>, Option<String>)> {
    let outcome = match group(run, start, end, count) {
        Ok(frame) => send_on(link, endpoint, counts, frame, count as u64),
        Err(reason) => OnLink::Failed(reason),
    };
    // What is left after `done` of the run's frames.
    let rest = |from: usize, done: usize| {
        Queued::counted_run(
            run.slice(from..),
            totals.messages.saturating_sub(done),
            totals.frames.saturating_sub(done),
        )
    };
    match outcome {
        OnLink::Taken => None,
        OnLink::Full(_) => Some((Some(rest(start, sent)), None)),
        OnLink::FailedBefore(_, reason) => Some((Some(rest(start, sent)), Some(reason))),
        OnLink::Failed(reason) => {
            let after = (end < run.len()).then(|| rest(end, sent + count));
            Some((after, Some(reason)))
        }
    }
}

/// The frames `run[start..end]` (`count` of them) as one frame for a data
/// link: the frame itself when alone, else a [`Frame::Run`] around them,
/// which are not copied.
///
/// [`Frame::Run`]: efabus_core::frame::Frame::Run
fn group(run: &Bytes, start: usize, end: usize, count: usize) -> Result<OutFrame, String> {
    let frames = run.slice(start..end);
    if count == 1 {
        return Ok(OutFrame::whole(frames));
    }
    let head = codec::run_head(frames.len()).map_err(|err| err.to_string())?;
    Ok(OutFrame {
        head: Bytes::copy_from_slice(&head),
        body: frames,
    })
}

/// What a data link did with one frame.
enum OnLink {
    /// Sent, or on a datagram link possibly dropped and counted.
    Taken,
    /// The link is full: the frame comes back untouched.
    Full(OutFrame),
    /// The reliable link failed sending it: the frame is lost, and the
    /// link with it.
    Failed(String),
    /// The reliable link failed before it took the frame, which comes back
    /// untouched.
    FailedBefore(OutFrame, String),
}

/// Send one frame on a data link, a run of `frames` or a frame alone.
fn send_on(
    link: &mut DataLink,
    endpoint: &mut dyn Endpoint,
    counts: &mut SendCounts,
    frame: OutFrame,
    frames: u64,
) -> OnLink {
    let result = link.send(endpoint, frame, frames);
    counts.credit_waits += link.take_credit_waits();
    match result {
        Ok(Sent::Accepted) => counts.fabric_frames_out += frames,
        Ok(Sent::Blocked(frame)) => return OnLink::Full(frame),
        // The owner reports the failure, with its session.
        Ok(Sent::Failed(frame, reason)) => {
            debug!(%reason, "reliable data link send failed");
            return OnLink::FailedBefore(frame, reason.to_string());
        }
        Err(reason) => {
            debug!(%reason, "reliable data link send failed");
            return OnLink::Failed(reason.to_string());
        }
    }
    OnLink::Taken
}

/// `Publish` frames in `head`: a run of whole frames (`run`), or one frame.
pub(crate) fn publishes_in(head: &[u8], run: bool) -> u64 {
    if run {
        split_run_slices(head)
            .filter(|frame| codec::is_publish(frame))
            .count() as u64
    } else {
        u64::from(codec::is_publish(head))
    }
}

/// What the slow-consumer policy made of a queue over its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Overflow {
    /// Within the bound.
    Within,
    /// Oldest messages dropped to make room (counted).
    DroppedOldest(u64),
    /// The peer is to be cut off.
    Disconnect,
    /// Publishers are to be held back.
    Block,
}

/// Whether `frame` is a `Message` (one a broker forwards).
fn is_message_frame(frame: &OutFrame) -> bool {
    frame.head.get(codec::PREFIX_LEN) == Some(&(codec::FrameKind::Message as u8))
}

/// The frames a session's path could not take yet, in order.
pub(crate) struct Outbound {
    queue: VecDeque<Queued>,
    bytes: usize,
    /// Of `bytes`, those in entries that hold no message.
    control_bytes: usize,
    /// Bytes of queued entries the path has taken, in total: whether a
    /// queue moves at all.
    taken: u64,
    /// Strict: the queue is bounded in the bytes it counts
    /// (`limits.max_pending_bytes`), which held buffers would exceed.
    detacher: Detacher,
}

impl Default for Outbound {
    fn default() -> Outbound {
        Outbound {
            queue: VecDeque::new(),
            bytes: 0,
            control_bytes: 0,
            taken: 0,
            detacher: Detacher::strict(),
        }
    }
}

impl Outbound {
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Bytes waiting.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes waiting in entries that hold no message (control frames such
    /// as answers to the peer's pings), which no slow-consumer policy
    /// trims.
    pub fn control_bytes(&self) -> usize {
        self.control_bytes
    }

    /// Bytes of queued entries the path has taken since the queue began.
    pub fn taken(&self) -> u64 {
        self.taken
    }

    /// Queue an entry behind what waits. The small body of a message a
    /// broker forwards may be copied ([`Detacher`]): sliced from a buffer
    /// read off the network, it would keep that whole buffer while it
    /// waits. (A client's publishes carry its application's payloads.)
    pub fn push(&mut self, mut queued: Queued) {
        if is_message_frame(&queued.frame) {
            self.detacher.settle(&mut queued.frame.body);
        }
        self.bytes += queued.frame.len();
        if queued.messages == 0 {
            self.control_bytes += queued.frame.len();
        }
        self.queue.push_back(queued);
    }

    /// A client sent its whole subscription table again: the subscribe
    /// and unsubscribe frames waiting from before are dropped (sent again,
    /// the server would refuse their ids as in use), and `first`, what of
    /// the table the path did not take, goes ahead of what stays.
    pub fn resubscribed(&mut self, first: Vec<Queued>) {
        let kinds = [
            codec::FrameKind::Subscribe as u8,
            codec::FrameKind::Unsubscribe as u8,
        ];
        let (bytes, control_bytes) = (&mut self.bytes, &mut self.control_bytes);
        self.queue.retain(|queued| {
            let stale = !queued.run
                && queued.messages == 0
                && queued
                    .frame
                    .head
                    .get(codec::PREFIX_LEN)
                    .is_some_and(|kind| kinds.contains(kind));
            if stale {
                *bytes -= queued.frame.len();
                *control_bytes -= queued.frame.len();
            }
            !stale
        });
        for queued in first.into_iter().rev() {
            self.bytes += queued.frame.len();
            self.control_bytes += queued.frame.len();
            self.queue.push_front(queued);
        }
    }

    /// Hand `queued` to the path when nothing waits before it, else queue
    /// it; true if any of it was left queued.
    pub fn send(
        &mut self,
        endpoints: &mut [Box<dyn Endpoint>],
        control: Control,
        links: &mut DataLinks,
        counts: &mut SendCounts,
        queued: Queued,
    ) -> bool {
        let rest = if self.queue.is_empty() {
            if is_message_frame(&queued.frame) {
                // The next one queued may follow it in its read buffer.
                self.detacher.passed(&queued.frame.body);
            }
            transmit(endpoints, control, links, counts, queued)
        } else {
            Some(queued)
        };
        match rest {
            Some(rest) => {
                self.push(rest);
                true
            }
            None => false,
        }
    }

    /// Hand queued entries to the path until it pushes back; true when
    /// nothing is left.
    pub fn flush(
        &mut self,
        endpoints: &mut [Box<dyn Endpoint>],
        control: Control,
        links: &mut DataLinks,
        counts: &mut SendCounts,
    ) -> bool {
        if links.failure.is_some() {
            return false;
        }
        if let Some(link) = links.sending() {
            match link.flush(endpoints[link.endpoint].as_mut()) {
                Ok(true) => {}
                Ok(false) => return false,
                Err(reason) => {
                    // The piece that failed is lost: nothing may follow it.
                    debug!(%reason, "reliable data link send failed");
                    links.failure = Some(reason.to_string());
                    return false;
                }
            }
        }
        while let Some(queued) = self.queue.pop_front() {
            let len = queued.frame.len();
            let holds_no_message = queued.messages == 0;
            let rest = transmit(endpoints, control, links, counts, queued);
            let sent = len - rest.as_ref().map_or(0, |rest| rest.frame.len());
            self.bytes -= sent;
            self.taken += sent as u64;
            if holds_no_message {
                self.control_bytes -= sent;
            }
            if let Some(rest) = rest {
                self.queue.push_front(rest);
                return false;
            }
        }
        true
    }

    /// Messages waiting (entries that are not messages, such as control
    /// frames, count none).
    pub fn messages(&self) -> u64 {
        self.queue.iter().map(|q| q.messages as u64).sum()
    }

    /// `Publish` frames waiting: what a client's queue holds of its
    /// publishes.
    pub fn publishes(&self) -> u64 {
        self.queue.iter().map(Queued::publishes).sum()
    }

    /// Apply the slow-consumer policy after a message was queued, when the
    /// queue is over `bound` bytes. Under drop-oldest, `discarded` sees
    /// each entry of messages discarded; entries that hold no message are
    /// never discarded.
    pub fn enforce(
        &mut self,
        policy: SlowConsumerPolicy,
        bound: usize,
        mut discarded: impl FnMut(&Queued),
    ) -> Overflow {
        if self.bytes <= bound {
            return Overflow::Within;
        }
        match policy {
            SlowConsumerPolicy::DropOldest => {
                let mut dropped = 0;
                while self.bytes > bound {
                    let Some(position) = self.queue.iter().position(|q| q.messages > 0) else {
                        break;
                    };
                    if let Some(oldest) = self.queue.remove(position) {
                        self.bytes -= oldest.frame.len();
                        dropped += oldest.messages as u64;
                        discarded(&oldest);
                    }
                }
                Overflow::DroppedOldest(dropped)
            }
            SlowConsumerPolicy::Disconnect => Overflow::Disconnect,
            SlowConsumerPolicy::Block => Overflow::Block,
        }
    }

    /// Forget everything queued.
    pub fn clear(&mut self) {
        self.queue.clear();
        self.bytes = 0;
        self.control_bytes = 0;
    }
}

/// Deliveries encoded back to back for one peer since the last hand-off;
/// handed on as one run at the end of the loop round, or when full.
#[derive(Default)]
pub(crate) struct Batch {
    buffer: BytesMut,
    messages: usize,
    /// Size of the last batch, to size the next one's first allocation.
    hint: usize,
}

impl Batch {
    /// Whether `need` more bytes fit the buffer without growing it, and
    /// the run within `limit` bytes (the most its path sends as one piece,
    /// [`DataLinks::run_limit`]): a batch never grows its buffer (growing
    /// copies, and large buffers come from fresh pages), and a run its
    /// path takes whole goes without being read again. It is handed on
    /// where its room ends.
    pub fn has_room(&self, need: usize, limit: usize) -> bool {
        let len = self.buffer.len() + need;
        self.messages == 0 || (len <= self.buffer.capacity() && len <= limit)
    }

    /// Append an encoded message for subscription `sid`, in a buffer of at
    /// most `limit` bytes (see [`has_room`](Self::has_room)) unless the
    /// message needs more; true if it is the batch's first.
    pub fn push(&mut self, encoded: &[u8], sid: u64, limit: usize) -> bool {
        let need = encoded.len();
        if self.buffer.capacity() - self.buffer.len() < need {
            let room = (self.hint * 2).clamp(BATCH_MIN, RUN_MAX);
            self.buffer.reserve(room.min(limit).max(need));
        }
        let at = self.buffer.len();
        self.buffer.extend_from_slice(encoded);
        codec::set_message_sid(&mut self.buffer[at..], sid);
        self.messages += 1;
        self.messages == 1
    }

    /// The batch as one run, if it holds anything.
    pub fn take(&mut self) -> Option<Queued> {
        if self.buffer.is_empty() {
            return None;
        }
        let run = if self.buffer.len() >= BATCH_KEEP {
            self.buffer.split().freeze()
        } else {
            std::mem::take(&mut self.buffer).freeze()
        };
        let messages = std::mem::take(&mut self.messages);
        self.hint = run.len().clamp(BATCH_MIN, RUN_MAX);
        Some(Queued::messages_run(run, messages))
    }

    /// Messages in the batch.
    pub fn messages(&self) -> u64 {
        self.messages as u64
    }

    /// Forget what the batch holds.
    pub fn clear(&mut self) {
        self.buffer.clear();
        self.messages = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::super::data_link::{GiveUp, LinkKind};
    use super::*;
    use efabus_core::transport::DETACH_MAX;
    use std::sync::{Arc, Mutex};

    const PREFIX: usize = codec::PREFIX_LEN;

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut out = (body.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(body);
        out
    }

    /// An endpoint whose sends are scripted: the `block_at`-th is refused
    /// as full, every one from the `fail_at`-th on fails, and it takes
    /// `room` frames in all, then pushes back.
    struct Scripted {
        scheme: &'static str,
        max_frame: usize,
        room: usize,
        block_at: Option<usize>,
        fail_at: usize,
        calls: usize,
        taken: Arc<Mutex<Vec<Bytes>>>,
        /// Peers inserted and not closed.
        peers: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Endpoint for Scripted {
        fn scheme(&self) -> &str {
            self.scheme
        }
        fn local_addr(&self) -> Vec<u8> {
            Vec::new()
        }
        fn max_frame(&self) -> usize {
            self.max_frame
        }
        fn connect(&mut self, _: &str) -> Result<PeerId, efabus_core::transport::TransportError> {
            Ok(PeerId(9))
        }
        fn insert_peer(
            &mut self,
            _: &[u8],
            _: &efabus_core::transport::LinkKeys,
        ) -> Result<PeerId, efabus_core::transport::TransportError> {
            self.peers
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(PeerId(9))
        }
        fn send(&mut self, _: PeerId, frame: OutFrame) -> Result<(), SendError> {
            self.calls += 1;
            if self.block_at == Some(self.calls) {
                self.block_at = None;
                return Err(SendError::WouldBlock(frame));
            }
            if self.calls >= self.fail_at {
                return Err(SendError::Transport(
                    efabus_core::transport::TransportError::Other("completion error".into()),
                ));
            }
            if self.room == 0 {
                return Err(SendError::WouldBlock(frame));
            }
            self.room -= 1;
            self.taken.lock().unwrap().push(frame.to_bytes());
            Ok(())
        }
        fn poll(
            &mut self,
            _: &mut Vec<efabus_core::transport::Event>,
        ) -> Result<(), efabus_core::transport::TransportError> {
            Ok(())
        }
        fn close(&mut self, _: PeerId) {
            self.peers
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
        fn readiness(&self) -> efabus_core::transport::Readiness {
            efabus_core::transport::Readiness::MustPoll
        }
        fn queued_bytes(&self, _: PeerId) -> usize {
            0
        }
    }

    /// A control link that takes `room` more frames, then pushes back.
    fn wire(room: usize, taken: &Arc<Mutex<Vec<Bytes>>>) -> Vec<Box<dyn Endpoint>> {
        vec![Box::new(Scripted {
            scheme: "wire",
            max_frame: 1 << 20,
            room,
            block_at: None,
            fail_at: usize::MAX,
            calls: 0,
            taken: taken.clone(),
            peers: Arc::default(),
        })]
    }

    const CONTROL: Control = Control {
        endpoint: 0,
        peer: PeerId(1),
    };

    fn run_of(bodies: &[&[u8]]) -> Bytes {
        Bytes::from(
            bodies
                .iter()
                .flat_map(|body| frame(body))
                .collect::<Vec<u8>>(),
        )
    }

    #[test]
    fn a_run_the_control_link_takes_in_part_comes_back_with_its_messages_counted() {
        let mut endpoints = wire(2, &Arc::default());
        let mut links = DataLinks::default();
        let mut counts = SendCounts::default();
        let run = run_of(&[b"a", b"bb", b"ccc"]);
        let rest = transmit(
            &mut endpoints,
            CONTROL,
            &mut links,
            &mut counts,
            Queued::messages_run(run, 3),
        )
        .expect("one frame left");
        assert!(rest.run);
        assert_eq!((rest.messages, rest.frames), (1, 1));
        assert_eq!(rest.frame.to_bytes(), run_of(&[b"ccc"]));
        assert_eq!(
            counts.fabric_frames_out, 0,
            "the control link is not the fabric"
        );
        // A client's run of publishes: frames counted, no messages.
        let counted = Queued::counted_run(run_of(&[b"a", b"bb", b"ccc"]), 0, 3);
        let mut endpoints = wire(2, &Arc::default());
        let rest = transmit(&mut endpoints, CONTROL, &mut links, &mut counts, counted)
            .expect("one frame left");
        assert_eq!((rest.messages, rest.frames), (0, 1));
    }

    #[test]
    fn messages_a_failing_control_link_refuses_are_counted() {
        let mut endpoints: Vec<Box<dyn Endpoint>> = vec![Box::new(Scripted {
            scheme: "wire",
            max_frame: 1 << 20,
            room: usize::MAX,
            block_at: None,
            fail_at: 1,
            calls: 0,
            taken: Arc::default(),
            peers: Arc::default(),
        })];
        let mut links = DataLinks::default();
        let mut counts = SendCounts::default();
        let mut out = Outbound::default();
        out.push(Queued::frame(
            OutFrame::whole(Bytes::from(frame(b"1"))),
            true,
        ));
        out.push(Queued::messages_run(run_of(&[b"a", b"bb"]), 2));
        out.push(Queued::frame(
            OutFrame::whole(Bytes::from(frame(b"x"))),
            false,
        ));
        assert_eq!(out.messages(), 3);
        assert!(out.flush(&mut endpoints, CONTROL, &mut links, &mut counts));
        assert_eq!(out.messages(), 0, "nothing waits for a failed link");
        assert_eq!(counts.refused_messages, 3, "each lost message counted");
    }

    #[test]
    fn what_waits_goes_first_and_in_order() {
        let taken = Arc::default();
        let mut endpoints = wire(1, &taken);
        let mut links = DataLinks::default();
        let mut counts = SendCounts::default();
        let mut out = Outbound::default();
        let one = || OutFrame::whole(Bytes::from(frame(b"1")));
        let two = || OutFrame::whole(Bytes::from(frame(b"2")));
        let three = || OutFrame::whole(Bytes::from(frame(b"3")));
        for frame in [one(), two(), three()] {
            out.send(
                &mut endpoints,
                CONTROL,
                &mut links,
                &mut counts,
                Queued::frame(frame, true),
            );
        }
        assert_eq!(out.bytes(), 10, "two frames of five bytes wait");
        assert!(!out.flush(&mut endpoints, CONTROL, &mut links, &mut counts));
        endpoints = wire(5, &taken);
        // A frame sent while others wait is queued behind them.
        assert!(out.send(
            &mut endpoints,
            CONTROL,
            &mut links,
            &mut counts,
            Queued::frame(one(), true)
        ));
        assert!(out.flush(&mut endpoints, CONTROL, &mut links, &mut counts));
        assert!(out.is_empty());
        assert_eq!(out.bytes(), 0);
        let order: Vec<u8> = taken.lock().unwrap().iter().map(|f| f[PREFIX]).collect();
        assert_eq!(order, b"1231");
    }

    /// What an endpoint took, in order.
    type Taken = Arc<Mutex<Vec<Bytes>>>;
    type Endpoints = Vec<Box<dyn Endpoint>>;

    /// A control link (endpoint 0, taking everything) and a reliable data
    /// link in use over a scripted fabric endpoint (endpoint 1).
    fn with_data_link(
        fail_at: usize,
        block_at: Option<usize>,
    ) -> (Vec<Box<dyn Endpoint>>, DataLinks, Taken, Taken) {
        let control = Arc::default();
        let mut endpoints = wire(usize::MAX, &control);
        // Small enough that a frame of a few hundred bytes goes in pieces.
        let max_frame = codec::FRAGMENT_OVERHEAD + 64;
        let (endpoint, link, fabric) =
            scripted_link(false, max_frame, (fail_at, block_at, usize::MAX));
        endpoints.push(endpoint);
        let links = DataLinks {
            reliable: Some(link),
            in_use: true,
            ..DataLinks::default()
        };
        (endpoints, links, control, fabric)
    }

    /// A data link over a scripted fabric endpoint, negotiated from the
    /// EFA fixture: its RDM endpoint, or with `datagram` its DGRAM one.
    /// The endpoint fails every send from call `fail_at` on, refuses call
    /// `block_at` once, and takes `room` pieces in all.
    fn scripted_link(
        datagram: bool,
        max_frame: usize,
        (fail_at, block_at, room): (usize, Option<usize>, usize),
    ) -> (Box<dyn Endpoint>, DataLink, Taken) {
        let choice = efa_choice(datagram);
        let fabric: Taken = Arc::default();
        let mut endpoint: Box<dyn Endpoint> = Box::new(Scripted {
            scheme: if datagram { "efa-dgram" } else { "efa-rdm" },
            max_frame,
            room,
            block_at,
            fail_at,
            calls: 0,
            taken: Arc::clone(&fabric),
            peers: Arc::default(),
        });
        let link = DataLink::open(
            1,
            endpoint.as_mut(),
            &choice,
            &efabus_core::link::LinkTuning::default(),
            &TEST_KEYS,
            super::super::data_link::Proof::Proven,
        )
        .unwrap_or_else(|_| panic!("the link opens"));
        (endpoint, link, fabric)
    }

    /// Keys for links the tests open.
    const TEST_KEYS: efabus_core::transport::LinkKeys = efabus_core::transport::LinkKeys {
        send_key: [1; 32],
        receive_key: [2; 32],
        local_id: 1,
        remote_id: 2,
    };

    /// What two EFA hosts (the fixture's) choose for a datagram link, or
    /// for a reliable one.
    fn efa_choice(datagram: bool) -> efabus_core::caps::Choice {
        use efabus_core::caps::{negotiate, parse_fi_info_dump, Offer};
        let infos = parse_fi_info_dump(include_str!(
            "../../../core/tests/fixtures/efa-fi_info-v.txt"
        ))
        .expect("fixture parses");
        let scheme_of = |datagram: bool| if datagram { "efa-dgram" } else { "efa-rdm" };
        let offer = |id: u8| {
            let of_info = |info: &efabus_core::caps::FabricInfo| {
                let scheme = scheme_of(info.ep_attr.ep_type.is_datagram());
                Offer::from_info(scheme, info, vec![id; 32])
            };
            infos.iter().map(of_info).collect::<Vec<_>>()
        };
        let negotiated =
            negotiate(&offer(1), &offer(2), &["efa-rdm", "efa-dgram"]).expect("both offer EFA");
        if datagram {
            negotiated.best_effort.expect("a datagram link")
        } else {
            negotiated.reliable
        }
    }

    /// A link whose negotiated parameters leave the link layer unusable (a
    /// frame limit too small for a fragment, as a peer may offer) fails
    /// before the peer's address goes into the endpoint: nothing is left
    /// there for a link that never opened.
    #[test]
    fn a_link_that_cannot_open_leaves_no_peer_in_the_endpoint() {
        let peers = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut endpoint = Scripted {
            scheme: "efa-dgram",
            max_frame: 1 << 20,
            room: usize::MAX,
            block_at: None,
            fail_at: usize::MAX,
            calls: 0,
            taken: Arc::default(),
            peers: Arc::clone(&peers),
        };
        let mut choice = efa_choice(true);
        choice.params.frame_limit = 8;
        let opened = DataLink::open(
            1,
            &mut endpoint,
            &choice,
            &efabus_core::link::LinkTuning::default(),
            &TEST_KEYS,
            super::super::data_link::Proof::Proven,
        );
        assert!(
            matches!(
                opened,
                Err(super::super::data_link::DataLinkError::Parameters { .. })
            ),
            "{:?}",
            opened.err()
        );
        assert_eq!(peers.load(std::sync::atomic::Ordering::Relaxed), 0);
        // The same with a usable limit opens, its peer inserted.
        choice.params.frame_limit = 4096;
        assert!(DataLink::open(
            1,
            &mut endpoint,
            &choice,
            &efabus_core::link::LinkTuning::default(),
            &TEST_KEYS,
            super::super::data_link::Proof::Proven,
        )
        .is_ok());
        assert_eq!(peers.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    /// A publish of `len` bytes in all, as the broker sends them.
    fn message(len: usize) -> Vec<u8> {
        frame(&[0x10u8].repeat(len - PREFIX))
    }

    #[test]
    fn a_run_of_small_frames_crosses_a_data_link_as_runs_and_opens_in_order() {
        use super::super::data_link::{open_released, released_frames, LinkKind};
        let (mut endpoints, mut links, _, fabric) = with_data_link(usize::MAX, None);
        let limit = links.reliable.as_ref().map(DataLink::run_limit);
        // Runs of up to 59 bytes of frames: two 20-byte frames share one,
        // a third would not fit; a 300-byte frame goes alone, in pieces.
        assert_eq!(limit, Some(59));
        let small = |n: u8| {
            let mut frame = message(20);
            frame[PREFIX + 1] = n;
            frame
        };
        let frames = [
            small(1),
            small(2),
            small(3),
            message(300),
            small(4),
            small(5),
        ];
        let run = Bytes::from(frames.concat());
        let mut counts = SendCounts::default();
        let rest = transmit(
            &mut endpoints,
            CONTROL,
            &mut links,
            &mut counts,
            Queued::messages_run(run, frames.len()),
        );
        assert!(rest.is_none(), "the link takes it all");
        assert_eq!(counts.fabric_frames_out, 6, "frames, not runs, are counted");
        assert_eq!(
            links.unacknowledged_frames(),
            6,
            "a run in flight counts its frames"
        );
        let pieces = fabric.lock().unwrap().clone();
        // [1, 2], [3], five pieces of the large frame, [4, 5].
        assert_eq!(pieces.len(), 8);

        // The link's receiving half releases what its sending half sent:
        // the runs whole, their frames read in place or split off.
        let mut out = Vec::new();
        let now = std::time::Instant::now();
        for piece in pieces {
            links
                .receive(LinkKind::Reliable, now, piece, &mut out)
                .expect("a well-formed piece");
        }
        assert_eq!(out.len(), 4, "[1, 2], [3], the large frame, [4, 5]");
        let in_place: Vec<Vec<u8>> = out
            .iter()
            .flat_map(|message| released_frames(message).map(|frame| message[frame].to_vec()))
            .collect();
        assert_eq!(in_place, frames);
        open_released(&mut out, &mut Vec::new());
        let split: Vec<Vec<u8>> = out.iter().map(|frame| frame.to_vec()).collect();
        assert_eq!(split, frames);
    }

    #[test]
    fn a_malformed_run_fails_a_reliable_link() {
        let (mut endpoints, mut links, _, fabric) = with_data_link(usize::MAX, None);
        // A run whose second frame claims more bytes than the run holds.
        let mut frames = message(20);
        frames.extend_from_slice(&[60, 0, 0, 0, 0x10, 1, 2]);
        let bad = OutFrame {
            head: Bytes::copy_from_slice(&codec::run_head(frames.len()).unwrap()),
            body: Bytes::from(frames),
        };
        let link = links.reliable.as_mut().expect("a reliable link");
        assert!(matches!(
            link.send(endpoints[1].as_mut(), bad, 2),
            Ok(Sent::Accepted)
        ));
        let mut out = Vec::new();
        let now = std::time::Instant::now();
        let mut results = Vec::new();
        for piece in fabric.lock().unwrap().clone() {
            results.push(links.receive(LinkKind::Reliable, now, piece, &mut out));
        }
        assert!(results.iter().any(Result::is_err), "{results:?}");
        assert!(out.is_empty(), "nothing of it is delivered: {out:?}");
    }

    /// A control link and a best-effort data link over a scripted
    /// endpoint whose frames of 300 bytes take five pieces each.
    fn with_best_effort_link(
        script: (usize, Option<usize>, usize),
    ) -> (Vec<Box<dyn Endpoint>>, DataLinks) {
        let mut endpoints = wire(usize::MAX, &Arc::default());
        let (endpoint, link, _) = scripted_link(true, codec::FRAGMENT_OVERHEAD + 64, script);
        endpoints.push(endpoint);
        let links = DataLinks {
            best_effort: Some(link),
            in_use: true,
            ..DataLinks::default()
        };
        (endpoints, links)
    }

    /// A best-effort data link over a scripted endpoint that takes every
    /// piece, frames up to `max_frame` bytes a piece, and what it took.
    fn best_effort_link_taking_all(max_frame: usize) -> (Vec<Box<dyn Endpoint>>, DataLinks, Taken) {
        let mut endpoints = wire(usize::MAX, &Arc::default());
        let (endpoint, link, taken) =
            scripted_link(true, max_frame, (usize::MAX, None, usize::MAX));
        endpoints.push(endpoint);
        let links = DataLinks {
            best_effort: Some(link),
            in_use: true,
            ..DataLinks::default()
        };
        (endpoints, links, taken)
    }

    /// Pieces the scripted endpoint took so far.
    fn taken(fabric: &Taken) -> usize {
        fabric.lock().unwrap().len()
    }

    /// Queue `count` frames of `size` bytes on a datagram link and pace
    /// them.
    fn send_best_effort(
        links: &mut DataLinks,
        endpoints: &mut [Box<dyn Endpoint>],
        count: usize,
        size: usize,
    ) {
        for _ in 0..count {
            assert!(links.queue_best_effort(OutFrame::whole(Bytes::from(message(size)))));
        }
        links.pace_best_effort(endpoints);
    }

    /// Hand `datagrams` to a datagram link's receiving side at `now`.
    fn receive_datagrams(
        links: &mut DataLinks,
        datagrams: impl IntoIterator<Item = Bytes>,
        now: std::time::Instant,
        out: &mut Vec<Bytes>,
    ) {
        for datagram in datagrams {
            links
                .receive(LinkKind::BestEffort, now, datagram, out)
                .expect("a datagram is taken");
        }
    }

    /// Poll a datagram link's receiving side at each of its deadlines
    /// from `now`, for a second at most.
    fn poll_until_settled(
        links: &mut DataLinks,
        endpoints: &[Box<dyn Endpoint>],
        now: std::time::Instant,
        out: &mut Vec<Bytes>,
    ) {
        let end = now + std::time::Duration::from_secs(1);
        let mut last = None;
        while let Some(at) = links.next_deadline().filter(|&at| at < end) {
            assert_ne!(Some(at), last, "polling leaves its deadline due");
            last = Some(at);
            links.poll(at, endpoints, out).unwrap();
        }
    }

    /// The peer's notice that it gave the datagram link up, having settled
    /// this side's frames up to `settled_through` and sent none there.
    fn told(settled_through: u64) -> GiveUp {
        GiveUp::Told {
            settled_through,
            sent_through: 0,
        }
    }

    /// The peer's credit arriving on the best-effort link at `now`.
    fn best_effort_credit(
        links: &mut DataLinks,
        now: std::time::Instant,
        ack_seq: u64,
        messages: u32,
    ) {
        use efabus_core::frame::{Credit, Frame};
        let frame = codec::encode(&Frame::Credit(Credit {
            messages,
            bytes: 1 << 30,
            ack_seq,
        }));
        links
            .receive(LinkKind::BestEffort, now, frame.to_bytes(), &mut Vec::new())
            .expect("a credit is taken");
    }

    /// Frames waiting for credit keep no larger buffer alive: a small body
    /// sliced from a publisher's read buffer is copied (the paced queue
    /// counts frame bytes), but for the first into an empty queue.
    #[test]
    fn best_effort_frames_waiting_for_credit_keep_no_read_buffer() {
        let (_endpoints, mut links) = with_best_effort_link((usize::MAX, None, 0));
        let buffers: Vec<Bytes> = (0..100).map(|_| Bytes::from(vec![7u8; 64 << 10])).collect();
        for buffer in &buffers {
            let frame = OutFrame {
                head: Bytes::from_static(b"head"),
                body: buffer.slice(100..164),
            };
            assert!(links.queue_best_effort(frame));
        }
        let kept = buffers.iter().filter(|buffer| !buffer.is_unique()).count();
        assert_eq!(kept, 1, "only the first, passed into an empty queue");
    }

    #[test]
    fn best_effort_frames_the_endpoint_refused_count_as_waiting() {
        // Room for seven pieces: the first frame goes, the second leaves
        // three of its pieces with the link, the third waits behind them.
        let (mut endpoints, mut links) = with_best_effort_link((usize::MAX, None, 7));
        send_best_effort(&mut links, &mut endpoints, 3, 300);
        assert!(links.best_effort_waiting());
        // Lost here if the session ends now: the frame behind the refused
        // one (part of which went, so the peer counts it).
        assert_eq!(links.best_effort_unsent_frames(), 1);
        assert_eq!(links.take_best_effort_drops(), 0);
    }

    /// Best-effort frames wait on the link for the peer's proof: none
    /// goes to an address not proven, and none sent on the link later is
    /// overtaken by one that went another way meanwhile (they went over
    /// the reliable link until the proof, then here). Given up unproven,
    /// the link hands them back, none sent, to go the reliable way.
    #[test]
    fn best_effort_frames_wait_on_the_link_for_its_proof() {
        use super::super::data_link::Proof;
        let (mut endpoints, mut links) = with_best_effort_link((usize::MAX, None, usize::MAX));
        let awaiting = Proof::Awaiting { nonce: 3, asked: 1 };
        if let Some(link) = links.best_effort.as_mut() {
            link.proof = awaiting;
        }
        send_best_effort(&mut links, &mut endpoints, 3, 100);
        assert_eq!(
            links.best_effort_unsent_frames(),
            3,
            "sent before the proof"
        );
        links.on_pong(3, &mut endpoints);
        links.pace_best_effort(&mut endpoints);
        assert_eq!(links.best_effort_unsent_frames(), 0);
        if let Some(link) = links.best_effort.as_mut() {
            link.proof = awaiting;
        }
        assert!(links.queue_best_effort(OutFrame::whole(Bytes::from(message(100)))));
        links.pace_best_effort(&mut endpoints);
        let closed = links.close_best_effort(&mut endpoints);
        assert_eq!(
            closed.map(|closed| (closed.unsent, closed.waiting.len())),
            Some((0, 1))
        );
    }

    /// A datagram link whose frames go unconfirmed sends a probe a while
    /// after they began to wait, then after each probe; a credit, or the
    /// `Pong` answering the latest probe (a peer holding its credits
    /// back), starts that over. Probes answered neither way give the link
    /// up, what it sent unconfirmed left to the peer to count.
    #[test]
    fn a_datagram_link_whose_frames_go_unconfirmed_is_pinged_then_given_up() {
        use super::super::data_link::MAX_PROBES;
        use std::time::Duration;
        // Pings each 400 ms (four gap timeouts); given up after 1 s.
        let every = Duration::from_millis(400);
        let give_up_after = Duration::from_secs(1);
        let (mut endpoints, mut links, fabric) = best_effort_link_taking_all(4096);
        assert_eq!(links.best_effort_probe_at(), None, "nothing sent");
        send_best_effort(&mut links, &mut endpoints, 4, 100);
        assert_eq!(taken(&fabric), 4);
        let due = links.best_effort_probe_at().expect("frames unconfirmed");
        let early = due - Duration::from_millis(1);
        assert!(links
            .probe_best_effort(&mut endpoints, early, give_up_after)
            .is_none());
        assert_eq!(taken(&fabric), 4, "no ping before it is due");
        // Two confirmed: the other two wait from this credit on.
        let now = due;
        best_effort_credit(&mut links, now, 2, 64);
        let due = links.best_effort_probe_at().expect("two unconfirmed");
        assert_eq!(due, now + every);
        // A probe (nonce 5, the next sequence), and an answer to another:
        // the next probe is due a while after this one; its own answer
        // starts them over.
        assert!(links
            .probe_best_effort(&mut endpoints, due, give_up_after)
            .is_none());
        assert_eq!(taken(&fabric), 5);
        links.on_probe_pong(99, due + Duration::from_millis(5));
        assert_eq!(links.best_effort_probe_at(), Some(due + every));
        let answered = due + Duration::from_millis(5);
        links.on_probe_pong(5, answered);
        assert_eq!(links.best_effort_probe_at(), Some(answered + every));
        // Pings unanswered, each a while after the one before, until
        // MAX_PROBES went and `give_up_after` passed since the first.
        let mut at = answered + every;
        let first = at;
        let mut pings = 0;
        let closed = loop {
            if let Some(closed) = links.probe_best_effort(&mut endpoints, at, give_up_after) {
                break closed;
            }
            pings += 1;
            assert_eq!(taken(&fabric), 5 + pings);
            assert_eq!(links.best_effort_probe_at(), Some(at + every));
            at += every;
        };
        assert!(pings >= MAX_PROBES as usize, "{pings} pings");
        assert!(at >= first + give_up_after && at < first + give_up_after + every);
        // The peer is told that four frames went (it settled two): the
        // two it lacks are its to count; nothing is counted here.
        assert_eq!((closed.unsent, closed.waiting.len()), (0, 0));
        assert_eq!(closed.sent_through, 4);
        assert!(links.best_effort_link().is_none());
    }

    /// A sender's and a receiver's datagram links, the sender's 4 frames
    /// of 100 bytes sent and the first `arrived` of them received:
    /// `(sender's endpoints, sender, receiver's endpoints, receiver)`.
    fn four_sent_some_arrived(arrived: usize) -> (Endpoints, DataLinks, Endpoints, DataLinks) {
        let (mut endpoints, mut sender, fabric) = best_effort_link_taking_all(4096);
        let (receiver_endpoints, mut receiver, _) = best_effort_link_taking_all(4096);
        send_best_effort(&mut sender, &mut endpoints, 4, 100);
        let sent = fabric.lock().unwrap().clone();
        let mut out = Vec::new();
        let now = std::time::Instant::now();
        receive_datagrams(&mut receiver, sent.into_iter().take(arrived), now, &mut out);
        assert_eq!(out.len(), arrived);
        (endpoints, sender, receiver_endpoints, receiver)
    }

    /// A side that gives its datagram link up tells the peer how far it
    /// sent, and counts none of it: frames whose credits were lost may
    /// have arrived, and only the peer can tell (it counted them too).
    /// The peer counts what it lacks of them as lost, once.
    #[test]
    fn a_link_given_up_leaves_its_unconfirmed_frames_to_the_peer() {
        use std::time::Duration;
        for arrived in [4, 2] {
            let (mut endpoints, mut sender, mut receiver_endpoints, mut receiver) =
                four_sent_some_arrived(arrived);
            // No credit comes back, nor an answer: given up.
            let mut at = sender.best_effort_probe_at().expect("unconfirmed");
            let closed = loop {
                if let Some(closed) = sender.probe_best_effort(&mut endpoints, at, Duration::ZERO) {
                    break closed;
                }
                at += Duration::from_secs(1);
            };
            assert_eq!((closed.unsent, closed.sent_through), (0, 4));
            let told = GiveUp::Told {
                settled_through: closed.settled_through,
                sent_through: closed.sent_through,
            };
            let peer = receiver
                .give_up_best_effort(&mut receiver_endpoints, told)
                .expect("the peer's side was open");
            assert_eq!(
                (peer.lost, peer.unsent),
                (4 - arrived as u64, 0),
                "{arrived} of 4 arrived"
            );
            // Until the peer answers the ping sent behind the notice, the
            // 4 are counted as unacknowledged if the session ends.
            assert_eq!(sender.unread_notice_frames(), 4);
            let nonce = closed.notice_ping.expect("a ping behind the notice");
            sender.on_notice_pong(nonce.wrapping_add(1));
            assert_eq!(sender.unread_notice_frames(), 4, "another ping's pong");
            sender.on_notice_pong(nonce);
            assert_eq!(sender.unread_notice_frames(), 0);
        }
    }

    /// A credit or probe that does not decode on a datagram link is
    /// counted and ignored: the link goes on, and the count is reported
    /// once.
    #[test]
    fn a_mangled_credit_or_probe_on_a_datagram_link_is_counted_and_ignored() {
        use efabus_core::frame::{Credit, Frame};
        let (_endpoints, mut links, _) = best_effort_link_taking_all(4096);
        let now = std::time::Instant::now();
        let credit = Frame::Credit(Credit {
            messages: 8,
            bytes: 1 << 20,
            ack_seq: 0,
        });
        let probe = Frame::Probe {
            nonce: 7,
            sent_through: 0,
        };
        let mut out = Vec::new();
        for frame in [credit, probe] {
            let mut mangled = codec::encode(&frame).to_bytes().to_vec();
            mangled.pop();
            links
                .receive(LinkKind::BestEffort, now, Bytes::from(mangled), &mut out)
                .expect("ignored on a datagram link");
        }
        assert!(out.is_empty(), "nothing answered or delivered: {out:?}");
        assert_eq!(links.take_bad_link_frames(), 2);
        assert_eq!(links.take_bad_link_frames(), 0, "reported once");
        assert!(links.best_effort.is_some(), "the link goes on");
    }

    /// Notices not yet known read add up; a pong to a later notice's ping
    /// shows the earlier ones read too (they went the same ordered way),
    /// links kept past the bound included; a late notice still finds its
    /// link after the pong. A link given up with every frame confirmed
    /// leaves the peer nothing to count, but is kept for a late notice.
    #[test]
    fn notices_of_given_up_links_are_unread_until_a_later_ping_is_answered() {
        use super::super::data_link::GIVEN_UP_KEPT;
        let mut links = DataLinks::default();
        let first = links.note_given_up(0, 10, 3);
        let second = links.note_given_up(1, 20, 2);
        assert_eq!(links.unread_notice_frames(), 5);
        links.on_notice_pong(first);
        assert_eq!(
            links.unread_notice_frames(),
            2,
            "the later notice unread still"
        );
        links.on_notice_pong(second);
        assert_eq!(links.unread_notice_frames(), 0);
        assert_eq!(links.late_notice(0, 8), 2, "kept for its late notice");
        assert_eq!(links.late_notice(0, 8), 0, "once");
        // A late notice before the pong: its frames counted there, and the
        // pong still shows the notices before it read.
        let third = links.note_given_up(2, 30, 4);
        let fourth = links.note_given_up(3, 40, 1);
        assert_eq!(links.late_notice(3, 39), 1);
        assert_eq!(links.unread_notice_frames(), 4);
        links.on_notice_pong(fourth);
        assert_eq!(links.unread_notice_frames(), 0);
        links.on_notice_pong(third);
        let mut newest = 0;
        for epoch in 4..24 {
            newest = links.note_given_up(epoch, 30, 1);
        }
        assert_eq!(links.unread_notice_frames(), 20, "none forgotten");
        assert_eq!(links.given_up.len(), GIVEN_UP_KEPT);
        assert_eq!(links.late_notice(4, 0), 0, "no longer kept");
        links.on_notice_pong(newest);
        assert_eq!(links.unread_notice_frames(), 0);

        let (mut endpoints, mut sender, _) = best_effort_link_taking_all(4096);
        send_best_effort(&mut sender, &mut endpoints, 2, 100);
        best_effort_credit(&mut sender, std::time::Instant::now(), 2, 64);
        assert_eq!(sender.best_effort_probe_at(), None, "all confirmed");
        let closed = sender
            .give_up_best_effort(&mut endpoints, GiveUp::Telling)
            .expect("open");
        assert_eq!(sender.unread_notice_frames(), 0);
        assert!(closed.notice_ping.is_some());
        assert_eq!(sender.given_up.len(), 1, "kept for a late notice");
    }

    /// Both sides give the datagram link up at once, each telling the
    /// other and counting on it: the notice each gets once its own side
    /// is closed makes it count what it sent beyond what the other
    /// settled, so every frame is still counted once.
    #[test]
    fn datagram_links_given_up_on_both_sides_at_once_count_each_frame_once() {
        for pong_first in [true, false] {
            both_sides_give_up_at_once(pong_first);
        }
    }

    /// [`datagram_links_given_up_on_both_sides_at_once_count_each_frame_once`],
    /// the peer's pong to the ping behind this side's notice coming before
    /// its own notice (it answers pings ahead of what it queued) or after.
    fn both_sides_give_up_at_once(pong_first: bool) {
        let (mut endpoints, mut sender, mut receiver_endpoints, mut receiver) =
            four_sent_some_arrived(2);
        let mine = sender
            .give_up_best_effort(&mut endpoints, GiveUp::Telling)
            .expect("open");
        let theirs = receiver
            .give_up_best_effort(&mut receiver_endpoints, GiveUp::Telling)
            .expect("open");
        assert_eq!((mine.unsent, mine.sent_through), (0, 4));
        assert_eq!((theirs.lost, theirs.settled_through), (0, 2));
        // Each notice finds the other side closed.
        let notice_of = |closed: &super::super::data_link::Closed| GiveUp::Told {
            settled_through: closed.settled_through,
            sent_through: closed.sent_through,
        };
        assert!(sender
            .give_up_best_effort(&mut endpoints, notice_of(&theirs))
            .is_none());
        let pong = mine.notice_ping.expect("a ping behind the notice");
        assert_eq!(sender.unread_notice_frames(), 4);
        if pong_first {
            sender.on_notice_pong(pong);
        }
        assert_eq!(sender.late_notice(0, theirs.settled_through), 2);
        assert_eq!(sender.late_notice(0, theirs.settled_through), 0, "once");
        // Counted now, by the peer up to what it settled and here beyond:
        // none is left for the session's end.
        assert_eq!(sender.unread_notice_frames(), 0);
        sender.on_notice_pong(pong);
        assert_eq!(sender.unread_notice_frames(), 0);
        assert!(receiver
            .give_up_best_effort(&mut receiver_endpoints, notice_of(&mine))
            .is_none());
        assert_eq!(receiver.late_notice(0, mine.settled_through), 0);
    }

    /// A datagram link's probes carry no sequence: the receiver counts
    /// no message lost for a probe that never came, answers one that
    /// comes as a ping, and settles the lost tail it announces.
    #[test]
    fn a_lost_probe_is_no_lost_message_and_a_probe_settles_a_lost_tail() {
        use std::time::Duration;
        let (mut endpoints, mut sender, fabric) = best_effort_link_taking_all(4096);
        let (_receiver_endpoints, mut receiver, _) = best_effort_link_taking_all(4096);
        let datagram = |n: usize| fabric.lock().unwrap()[n].clone();
        let mut now = std::time::Instant::now();
        let mut out = Vec::new();
        // Two frames, a probe that is lost, two frames more.
        send_best_effort(&mut sender, &mut endpoints, 2, 100);
        let due = sender.best_effort_probe_at().expect("frames unconfirmed");
        assert!(sender
            .probe_best_effort(&mut endpoints, due, Duration::from_secs(10))
            .is_none());
        send_best_effort(&mut sender, &mut endpoints, 2, 100);
        assert_eq!(taken(&fabric), 5);
        let arrived = [0, 1, 3, 4].map(datagram);
        receive_datagrams(&mut receiver, arrived, now, &mut out);
        now += Duration::from_secs(1);
        receiver.poll(now, &endpoints, &mut out).unwrap();
        assert_eq!(out.len(), 4, "every frame delivered");
        assert_eq!(receiver.take_best_effort_lost(), 0, "the probe is no loss");
        // Two frames lost, then a probe: answered as a ping, and the two
        // counted lost once their wait is over.
        send_best_effort(&mut sender, &mut endpoints, 2, 100);
        let due = sender.best_effort_probe_at().expect("frames unconfirmed");
        assert!(sender
            .probe_best_effort(&mut endpoints, due, Duration::from_secs(10))
            .is_none());
        assert_eq!(taken(&fabric), 8);
        out.clear();
        receive_datagrams(&mut receiver, [datagram(7)], now, &mut out);
        let nonce = 7; // the sequence the probe's sender would number next
        assert_eq!(out.len(), 1);
        assert!(matches!(
            codec::decode(out[0].clone(), &codec::CodecLimits::default()),
            Ok(efabus_core::frame::Frame::Ping { nonce: n }) if n == nonce
        ));
        poll_until_settled(&mut receiver, &endpoints, now, &mut out);
        assert_eq!(out.len(), 1, "nothing more delivered");
        assert_eq!(receiver.take_best_effort_lost(), 2, "the lost tail");
    }

    /// A probe belongs to datagram links: on a reliable (sequenced) one
    /// it is a frame outside the sequence, which fails the link, not a
    /// ping to answer.
    #[test]
    fn a_probe_on_a_reliable_link_fails_it() {
        let (_endpoints, mut links, _, _) = with_data_link(usize::MAX, None);
        let probe = codec::encode(&efabus_core::frame::Frame::Probe {
            nonce: 1,
            sent_through: 1,
        });
        let mut out = Vec::new();
        assert!(links
            .receive(
                LinkKind::Reliable,
                std::time::Instant::now(),
                probe.to_bytes(),
                &mut out
            )
            .is_err());
        assert!(out.is_empty(), "nothing to answer");
    }

    /// A frame whose send fails on a datagram link is lost as a datagram
    /// lost on the way is: the receiver counts its gap once a later frame
    /// comes, and the sender does not count it too.
    #[test]
    fn a_frame_whose_send_failed_is_counted_once() {
        let (mut endpoints, mut sender, fabric) = best_effort_link_taking_all(4096);
        let (_receiver_endpoints, mut receiver, _) = best_effort_link_taking_all(4096);
        let (mut failing, _, _) = scripted_link(true, 4096, (1, None, usize::MAX));
        send_best_effort(&mut sender, &mut endpoints, 1, 100);
        std::mem::swap(&mut endpoints[1], &mut failing);
        send_best_effort(&mut sender, &mut endpoints, 1, 100);
        std::mem::swap(&mut endpoints[1], &mut failing);
        send_best_effort(&mut sender, &mut endpoints, 1, 100);
        assert_eq!(taken(&fabric), 2, "the first and the third");
        assert_eq!(sender.take_best_effort_drops(), 0);
        let now = std::time::Instant::now();
        let mut out = Vec::new();
        let sent = fabric.lock().unwrap().clone();
        receive_datagrams(&mut receiver, sent, now, &mut out);
        receiver
            .poll(
                now + std::time::Duration::from_secs(1),
                &endpoints,
                &mut out,
            )
            .unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(receiver.take_best_effort_lost(), 1);
        // One failing last, with nothing after it to show its gap: the
        // session's end counts it here, as a link given up would.
        std::mem::swap(&mut endpoints[1], &mut failing);
        send_best_effort(&mut sender, &mut endpoints, 1, 100);
        assert_eq!(sender.best_effort_unsent_frames(), 1);
        assert_eq!(sender.take_best_effort_drops(), 0);
        // The other three, none confirmed, are what the peer may have
        // taken, counted lost, or never heard of.
        assert_eq!(sender.best_effort_unconfirmed_frames(), 3);
        // A probe that goes shows it: the peer counts it from then on.
        std::mem::swap(&mut endpoints[1], &mut failing);
        let due = sender.best_effort_probe_at().expect("frames unconfirmed");
        assert!(sender
            .probe_best_effort(&mut endpoints, due, std::time::Duration::from_secs(10))
            .is_none());
        assert_eq!(sender.best_effort_unsent_frames(), 0);
        let closed = sender
            .give_up_best_effort(&mut endpoints, told(3))
            .expect("the link was open");
        assert_eq!(closed.unsent, 1, "the last, beyond what the peer settled");
    }

    /// A datagram link whose peer gave it up, saying it settled what was
    /// sent there up to a sequence: what went beyond that unconfirmed is
    /// counted, not what the peer settled though its credits were lost.
    #[test]
    fn a_datagram_link_the_peer_gave_up_counts_what_went_beyond_its_settled() {
        let (mut endpoints, mut links, fabric) = best_effort_link_taking_all(4096);
        send_best_effort(&mut links, &mut endpoints, 6, 100);
        assert_eq!(taken(&fabric), 6);
        best_effort_credit(&mut links, std::time::Instant::now(), 1, 64);
        let closed = links
            .give_up_best_effort(&mut endpoints, told(4))
            .expect("the link was open");
        assert_eq!((closed.unsent, closed.waiting.len()), (2, 0));
        assert!(links.best_effort_link().is_none());
        assert!(links.give_up_best_effort(&mut endpoints, told(4)).is_none());
    }

    /// A credit that acknowledges a ping stops the pings: the link is live.
    #[test]
    fn a_credit_after_a_ping_keeps_the_datagram_link() {
        let (mut endpoints, mut links, fabric) = best_effort_link_taking_all(4096);
        assert!(links.queue_best_effort(OutFrame::whole(Bytes::from(message(100)))));
        links.pace_best_effort(&mut endpoints);
        let due = links.best_effort_probe_at().expect("a frame unconfirmed");
        let give_up_after = std::time::Duration::ZERO;
        assert!(links
            .probe_best_effort(&mut endpoints, due, give_up_after)
            .is_none());
        assert_eq!(taken(&fabric), 2, "the frame and a ping");
        best_effort_credit(&mut links, due, 2, 64);
        assert_eq!(links.best_effort_probe_at(), None, "all confirmed");
        assert_eq!(links.take_best_effort_drops(), 0);
    }

    /// A best-effort link that may open again, on the dialing side or
    /// not, with what the scripted endpoint took.
    fn reopenable_best_effort_link(dialed: bool) -> (Vec<Box<dyn Endpoint>>, DataLinks, Taken) {
        use super::super::data_link::Reopening;
        use super::super::link_auth::{HandshakeRole, LinkSecret};
        let (endpoints, mut links, taken) = best_effort_link_taking_all(4096);
        let (ours, theirs) = (LinkSecret::new().unwrap(), LinkSecret::new().unwrap());
        let role = if dialed {
            HandshakeRole::Dialer
        } else {
            HandshakeRole::Acceptor
        };
        let root = ours.reopen_root(role, theirs.auth()).unwrap();
        let tuning = efabus_core::link::LinkTuning::default();
        links.reopening = Some(Reopening::new(root, efa_choice(true), tuning));
        links.dialed = dialed;
        (endpoints, links, taken)
    }

    /// The dialing side opens a datagram link given up again once its wait
    /// is over, each time in the next epoch; the wait doubles while the
    /// links reopened fail, and starts over once one was credited and its
    /// switch done (credited alone, it still failed). A try on an endpoint
    /// out of service opens nothing and takes no epoch, but the wait grows.
    #[test]
    fn a_datagram_link_given_up_opens_again_after_a_wait_that_grows_while_it_fails() {
        use std::time::{Duration, Instant};
        let base = Duration::from_secs(1);
        let (mut endpoints, mut links, _) = reopenable_best_effort_link(true);
        assert_eq!(links.reopen_due(base), None, "open");
        let mut waits = Vec::new();
        let mut epochs = Vec::new();
        // Credited, and with its switch done.
        for (credited, switched) in [(false, false), (false, false), (true, true), (true, false)] {
            let before = Instant::now();
            links
                .close_best_effort(&mut endpoints)
                .expect("it was open");
            let due = links.reopen_due(base).expect("due to open again");
            waits.push((due - before).as_secs_f64().round() as u32);
            epochs.push(links.reopen_best_effort(&mut endpoints, |_| true, due));
            assert_eq!(links.reopen_due(base), None, "open again");
            if credited {
                best_effort_credit(&mut links, due, 0, 64);
                let switch = links.switch_due(due).expect("usable once credited");
                if switched {
                    assert!(links.on_switch_pong(switch));
                } else {
                    assert!(links.switch_deadline(base).is_some());
                }
            }
        }
        links
            .close_best_effort(&mut endpoints)
            .expect("it was open");
        let before = Instant::now();
        let due = links.reopen_due(base).expect("due to open again");
        waits.push((due - before).as_secs_f64().round() as u32);
        assert_eq!(waits, [1, 2, 4, 1, 2], "doubled for each failed, reset");
        assert_eq!(epochs, [Ok(1), Ok(2), Ok(3), Ok(4)]);
        assert_eq!(
            links.reopen_best_effort(&mut endpoints, |_| true, due),
            Ok(5)
        );
        assert_eq!(
            links.best_effort.as_ref().map(|link| link.proof),
            Some(super::super::data_link::Proof::Proven)
        );
        links
            .close_best_effort(&mut endpoints)
            .expect("it was open");
        let due = links.reopen_due(base).expect("due to open again");
        assert!(links
            .reopen_best_effort(&mut endpoints, |_| false, due)
            .is_err());
        assert!(links.best_effort.is_none());
        let next = links.reopen_due(base).expect("due to try again");
        assert!(next >= due + 2 * base, "it waits longer after a failed try");
        assert_eq!(
            links.reopen_best_effort(&mut endpoints, |_| true, next),
            Ok(6),
            "no epoch went to the try that could not reach the peer"
        );
    }

    /// The accepting side opens its datagram link again when the peer asks,
    /// for epochs just past its last alone, at most once a
    /// `REOPEN_MIN_INTERVAL`, asks the address's proof again, and never
    /// reopens by itself.
    #[test]
    fn an_accepting_side_opens_its_datagram_link_again_for_new_epochs_only() {
        use super::super::data_link::REOPEN_MIN_INTERVAL;
        let now = std::time::Instant::now();
        let base = std::time::Duration::from_secs(1);
        let (mut endpoints, mut links, _) = reopenable_best_effort_link(false);
        let mut ask = |links: &mut DataLinks, epoch: u32, at: std::time::Instant| {
            links
                .admit_reopen(Some(epoch), at)
                .and_then(|epoch| links.open_again(&mut endpoints, |_| true, epoch, at))
        };
        links.best_effort = None;
        assert_eq!(links.reopen_due(base), None, "the peer asks");
        assert!(ask(&mut links, 0, now).is_err(), "not past the last");
        assert!(ask(&mut links, 66, now).is_err(), "too far past the last");
        assert_eq!(ask(&mut links, 3, now), Ok(()));
        assert_eq!(links.best_effort_epoch(), 3);
        assert!(matches!(
            links.best_effort.as_ref().map(|link| link.proof),
            Some(super::super::data_link::Proof::Awaiting { asked: 0, .. })
        ));
        links.best_effort = None;
        let soon = now + REOPEN_MIN_INTERVAL / 2;
        assert!(ask(&mut links, 4, soon).is_err(), "asked again too soon");
        let later = now + REOPEN_MIN_INTERVAL;
        assert!(ask(&mut links, 3, later).is_err(), "replayed");
        assert_eq!(ask(&mut links, 4, later), Ok(()));
    }

    /// A datagram link opened again takes no best effort until the peer
    /// proved its address there; then a switch begins (once), and what is
    /// queued on the link waits for the switch's pong before it goes.
    #[test]
    fn a_reopened_datagram_link_takes_best_effort_only_after_its_switch() {
        use super::super::data_link::Proof;
        let now = std::time::Instant::now();
        let (mut endpoints, mut links, fabric) = reopenable_best_effort_link(false);
        best_effort_credit(&mut links, now, 0, 64);
        links.best_effort = None;
        let epoch = links.admit_reopen(Some(1), now).expect("a new epoch");
        links
            .open_again(&mut endpoints, |_| true, epoch, now)
            .expect("opens");
        assert!(!links.takes_best_effort(), "not proven yet");
        assert!(!links.queue_best_effort(OutFrame::whole(Bytes::from(message(100)))));
        assert_eq!(links.switch_due(now), None, "not usable yet");
        let Some(Proof::Awaiting { nonce, .. }) = links.best_effort.as_ref().map(|l| l.proof)
        else {
            panic!("the reopened link asks for its proof");
        };
        assert_eq!(links.on_pong(nonce, &mut endpoints).len(), 1);
        let switch = links
            .switch_due(now)
            .expect("the switch begins once proven");
        assert_eq!(links.switch_due(now), None, "once");
        assert!(links.takes_best_effort());
        let timeout = std::time::Duration::from_secs(10);
        assert_eq!(links.switch_deadline(timeout), Some(now + timeout));
        let before = taken(&fabric);
        send_best_effort(&mut links, &mut endpoints, 3, 100);
        assert_eq!(taken(&fabric), before, "held for the switch's pong");
        assert!(!links.on_switch_pong(switch ^ 1));
        assert!(links.on_switch_pong(switch));
        assert_eq!(links.switch_deadline(timeout), None);
        links.pace_best_effort(&mut endpoints);
        assert_eq!(taken(&fabric), before + 3, "sent once the switch is done");
    }

    /// The dialing side reopens by itself and takes no asking; its link
    /// opened again pings for the peer's credit once the peer has had
    /// time to read the asking, and those pings are no messages: given up
    /// by the peer, the link counts none of them dropped. Credited, it
    /// carries (a client sends no best effort to move).
    #[test]
    fn a_dialer_s_reopened_link_takes_no_asking_and_counts_no_ping_dropped() {
        use std::time::Duration;
        let now = std::time::Instant::now();
        let (second, give_up) = (Duration::from_secs(1), Duration::from_secs(8));
        let (mut endpoints, mut links, fabric) = reopenable_best_effort_link(true);
        links
            .close_best_effort(&mut endpoints)
            .expect("it was open");
        assert!(
            links.admit_reopen(Some(1), now).is_err(),
            "a dialer takes no asking"
        );
        assert_eq!(
            links.reopen_best_effort(&mut endpoints, |_| true, now),
            Ok(1)
        );
        let before = taken(&fabric);
        assert!(links
            .tend_best_effort(&mut endpoints, now, second, give_up)
            .is_none());
        assert_eq!(
            taken(&fabric),
            before,
            "the peer has not read the asking yet"
        );
        let mut at = now;
        for _ in 0..3 {
            at += second;
            assert!(links
                .tend_best_effort(&mut endpoints, at, second, give_up)
                .is_none());
        }
        assert_eq!(taken(&fabric), before + 3, "a ping a heartbeat");
        let closed = links
            .give_up_best_effort(&mut endpoints, told(0))
            .expect("it was open");
        assert_eq!(closed.unsent, 0, "pings are no messages");

        let due = links.reopen_due(second).expect("due to open again");
        assert_eq!(
            links.reopen_best_effort(&mut endpoints, |_| true, due),
            Ok(2)
        );
        assert!(!links.carry_once_credited(), "not credited yet");
        assert_eq!(links.best_effort_path(), None);
        best_effort_credit(&mut links, due, 0, 64);
        assert!(links.carry_once_credited());
        assert!(links.best_effort_path().is_some());
    }

    /// A best-effort frame of more pieces than the window goes a window
    /// at a time: more as the peer's credits grant what it holds of it,
    /// the frame behind it once a credit acknowledges it.
    #[test]
    fn a_best_effort_frame_larger_than_the_window_goes_as_credits_allow() {
        let (mut endpoints, mut links, fabric) =
            best_effort_link_taking_all(codec::FRAGMENT_OVERHEAD + 64);
        // Far more pieces than any window here.
        assert!(links.queue_best_effort(OutFrame::whole(Bytes::from(message(512 << 10)))));
        assert!(links.queue_best_effort(OutFrame::whole(Bytes::from(message(100)))));
        links.pace_best_effort(&mut endpoints);
        let window = taken(&fabric);
        assert!(window > 1 && window < 8000, "{window} pieces went");
        assert!(links.best_effort_waiting());
        links.pace_best_effort(&mut endpoints);
        assert_eq!(taken(&fabric), window, "nothing more without credit");
        // The peer holds ten of them: ten more go.
        best_effort_credit(&mut links, std::time::Instant::now(), 0, window as u32 + 10);
        links.pace_best_effort(&mut endpoints);
        assert_eq!(taken(&fabric), window + 10);
        // The frame acknowledged (taken or given up): the rest of it is
        // not sent, the frame behind it is.
        best_effort_credit(&mut links, std::time::Instant::now(), 1, window as u32);
        links.pace_best_effort(&mut endpoints);
        assert_eq!(
            taken(&fabric),
            window + 10 + 2,
            "the next frame's two pieces"
        );
        assert!(!links.best_effort_waiting());
        assert_eq!(links.take_best_effort_drops(), 0);
    }

    /// A frame sent a window at a time whose first window is lost whole:
    /// the probe counts it as sent, so the peer, holding nothing of it,
    /// gives it up and counts it lost (its credit then ends the trickle);
    /// with the probe saying less, the frame would wait for ever.
    #[test]
    fn a_probe_settles_a_large_frame_whose_first_window_was_lost() {
        use std::time::Duration;
        let max_frame = codec::FRAGMENT_OVERHEAD + 64;
        let (mut endpoints, mut sender, fabric) = best_effort_link_taking_all(max_frame);
        let (_receiver_endpoints, mut receiver, _) = best_effort_link_taking_all(max_frame);
        assert!(sender.queue_best_effort(OutFrame::whole(Bytes::from(message(512 << 10)))));
        sender.pace_best_effort(&mut endpoints);
        let window = taken(&fabric);
        let due = sender
            .best_effort_probe_at()
            .expect("the frame is unconfirmed");
        assert!(sender
            .probe_best_effort(&mut endpoints, due, Duration::from_secs(10))
            .is_none());
        assert_eq!(taken(&fabric), window + 1, "the probe");
        let probe = fabric.lock().unwrap()[window].clone();
        let now = std::time::Instant::now();
        let mut out = Vec::new();
        receive_datagrams(&mut receiver, [probe], now, &mut out);
        poll_until_settled(&mut receiver, &endpoints, now, &mut out);
        assert_eq!(receiver.take_best_effort_lost(), 1);
    }

    /// A frame sent a window at a time outlasts the stall reset while
    /// credits keep granting more of it (frames wait behind it all that
    /// while); a credit acknowledging a frame before it grants nothing of
    /// it (what the peer holds is of that other message).
    #[test]
    fn a_best_effort_frame_going_as_credits_allow_is_not_cut_off() {
        let (mut endpoints, mut links, fabric) =
            best_effort_link_taking_all(codec::FRAGMENT_OVERHEAD + 64);
        // A small frame confirmed first, then one of far more pieces than
        // the window, and one behind it.
        assert!(links.queue_best_effort(OutFrame::whole(Bytes::from(message(100)))));
        links.pace_best_effort(&mut endpoints);
        assert_eq!(taken(&fabric), 2);
        best_effort_credit(&mut links, std::time::Instant::now(), 1, 100);
        assert!(links.queue_best_effort(OutFrame::whole(Bytes::from(message(512 << 10)))));
        assert!(links.queue_best_effort(OutFrame::whole(Bytes::from(message(100)))));
        links.pace_best_effort(&mut endpoints);
        let window = taken(&fabric) - 2;
        assert_eq!(window, 100, "the window the credit granted");
        // A stale credit, below the frame: it grants nothing of it.
        best_effort_credit(
            &mut links,
            std::time::Instant::now(),
            0,
            window as u32 + 100,
        );
        links.pace_best_effort(&mut endpoints);
        assert_eq!(taken(&fabric), 2 + window);
        // Credits granting more of it, past the stall reset (400 ms).
        let mut granted = window;
        for _ in 0..6 {
            std::thread::sleep(std::time::Duration::from_millis(100));
            granted += 10;
            best_effort_credit(&mut links, std::time::Instant::now(), 1, granted as u32);
            links.pace_best_effort(&mut endpoints);
            assert_eq!(taken(&fabric), 2 + granted, "the frame was cut off");
        }
        assert!(links.best_effort_waiting());
        assert_eq!(links.take_best_effort_drops(), 0);
    }

    /// A frame part of which went, its other pieces refused, counts as
    /// sent when the link is given up: the peer, holding part of it,
    /// counts it; this side counts it neither way.
    #[test]
    fn a_frame_partly_sent_is_the_peer_s_to_count() {
        let (mut endpoints, mut links) = with_best_effort_link((usize::MAX, Some(7), usize::MAX));
        send_best_effort(&mut links, &mut endpoints, 2, 300);
        assert!(
            links.best_effort_waiting(),
            "the second frame's pieces wait"
        );
        let closed = links
            .give_up_best_effort(&mut endpoints, GiveUp::Telling)
            .expect("the link was open");
        assert_eq!((closed.sent_through, closed.unsent), (2, 0));
    }

    #[test]
    fn refused_best_effort_pieces_go_with_nothing_queued_behind_them() {
        // The last frame's second piece is refused once: pacing again
        // sends the rest though no frame waits for credit.
        let (mut endpoints, mut links) = with_best_effort_link((usize::MAX, Some(7), usize::MAX));
        send_best_effort(&mut links, &mut endpoints, 2, 300);
        assert!(links.best_effort_waiting());
        // Part of it went: the peer's to count if the session ends now.
        assert_eq!(links.best_effort_unsent_frames(), 0);
        links.pace_best_effort(&mut endpoints);
        assert!(!links.best_effort_waiting());
        assert_eq!(links.take_best_effort_drops(), 0);
    }

    #[test]
    fn a_best_effort_piece_that_fails_takes_the_rest_of_its_frame() {
        // The second frame's second piece is refused, then fails when it
        // is tried again before the third frame: its other pieces go with
        // it. The third, never numbered, is counted dropped; the second
        // is lost on the way, counted by the peer or, as here, with what
        // went unconfirmed when the link is given up.
        let (mut endpoints, mut links) = with_best_effort_link((8, Some(7), usize::MAX));
        send_best_effort(&mut links, &mut endpoints, 3, 300);
        assert_eq!(links.take_best_effort_drops(), 1);
        assert!(
            !links.best_effort_waiting(),
            "no piece of the failed frame is left to send"
        );
        // The peer holds a piece of the failed frame, and counts it lost
        // (its partial message expires), so the session's end would not
        // count it here; given up with the peer's side gone without a
        // word, the link counts it with the first, as it counts any frame
        // it sent that went unconfirmed.
        assert_eq!(links.best_effort_unsent_frames(), 0);
        let closed = links
            .give_up_best_effort(&mut endpoints, GiveUp::Alone)
            .expect("the link was open");
        assert_eq!((closed.unsent, closed.waiting.len()), (2, 0));
    }

    #[test]
    fn a_malformed_run_on_a_best_effort_link_is_dropped_and_counted() {
        let (mut endpoint, mut link, fabric) =
            scripted_link(true, 4096, (usize::MAX, None, usize::MAX));
        let run_of = |frames: Vec<u8>, count: u64| {
            let frame = OutFrame {
                head: Bytes::copy_from_slice(&codec::run_head(frames.len()).unwrap()),
                body: Bytes::from(frames),
            };
            (frame, count)
        };
        // A run whose second frame claims more bytes than the run holds,
        // between a frame alone and a good run.
        let mut bad = message(20);
        bad.extend_from_slice(&[60, 0, 0, 0, 0x10, 1, 2]);
        let sends = [
            (OutFrame::whole(Bytes::from(message(20))), 1),
            run_of(bad, 2),
            run_of([message(20), message(30)].concat(), 2),
        ];
        for (frame, count) in sends {
            assert!(matches!(
                link.send(endpoint.as_mut(), frame, count),
                Ok(Sent::Accepted)
            ));
        }
        let mut out = Vec::new();
        let now = std::time::Instant::now();
        for piece in fabric.lock().unwrap().clone() {
            link.receive(now, piece, &mut out)
                .expect("a lossy link drops what it cannot open");
        }
        assert_eq!(link.lost(), 1, "the bad run is counted as lost");
        let frames: Vec<usize> = out
            .iter()
            .flat_map(|message| super::super::data_link::released_frames(message).map(|f| f.len()))
            .collect();
        assert_eq!(
            frames,
            [20, 20, 30],
            "the frame alone and the good run's two"
        );
    }

    #[test]
    fn a_send_that_fails_part_way_fails_the_link_and_nothing_follows_it() {
        // Each 300-byte frame takes five pieces; the twelfth piece fails.
        let (mut endpoints, mut links, control, fabric) = with_data_link(12, None);
        let mut counts = SendCounts::default();
        let first = Queued::frame(OutFrame::whole(Bytes::from(message(300))), true);
        assert!(transmit(&mut endpoints, CONTROL, &mut links, &mut counts, first).is_none());
        assert!(links.failure.is_none());
        // A run of three: the second frame fails on its second piece; it is
        // lost with the link, the third is given back unsent.
        let run = Bytes::from([message(300), message(300), message(200)].concat());
        let rest = transmit(
            &mut endpoints,
            CONTROL,
            &mut links,
            &mut counts,
            Queued::messages_run(run, 3),
        )
        .expect("what follows the failed frame comes back");
        assert!(rest.run);
        assert_eq!(rest.messages, 1);
        assert_eq!(rest.frame.to_bytes(), Bytes::from(message(200)));
        let reason = links.failure.clone().expect("the link has failed");
        assert!(reason.contains("completion error"), "{reason}");
        assert_eq!(
            fabric.lock().unwrap().len(),
            11,
            "ten pieces, then one of the failed frame"
        );
        assert_eq!(counts.fabric_frames_out, 2);

        // Nothing more goes out, on the data link or the control link.
        let mut out = Outbound::default();
        assert!(out.send(
            &mut endpoints,
            CONTROL,
            &mut links,
            &mut counts,
            Queued::frame(OutFrame::whole(Bytes::from(message(20))), true),
        ));
        assert!(!out.flush(&mut endpoints, CONTROL, &mut links, &mut counts));
        assert_eq!(out.bytes(), 20);
        assert_eq!(fabric.lock().unwrap().len(), 11);
        assert!(control.lock().unwrap().is_empty());
        // Closing the links clears the failure for the next connection.
        links.close(&mut endpoints);
        assert!(links.failure.is_none());
    }

    #[test]
    fn a_backlog_piece_that_fails_fails_the_link() {
        // The third piece finds the endpoint full (the frame's other pieces
        // wait in the backlog), and the first try again fails.
        let (mut endpoints, mut links, control, fabric) = with_data_link(4, Some(3));
        let mut counts = SendCounts::default();
        let mut out = Outbound::default();
        let frame = Queued::frame(OutFrame::whole(Bytes::from(message(300))), true);
        assert!(!out.send(&mut endpoints, CONTROL, &mut links, &mut counts, frame));
        assert!(links.has_backlog());
        assert!(links.failure.is_none());
        assert!(!out.flush(&mut endpoints, CONTROL, &mut links, &mut counts));
        assert!(links.failure.is_some());
        assert_eq!(fabric.lock().unwrap().len(), 2);
        assert!(transmit(
            &mut endpoints,
            CONTROL,
            &mut links,
            &mut counts,
            Queued::frame(OutFrame::whole(Bytes::from(message(20))), true),
        )
        .is_some());
        assert_eq!(fabric.lock().unwrap().len(), 2);
        assert!(control.lock().unwrap().is_empty());
    }

    #[test]
    fn a_frame_the_failing_backlog_kept_from_the_link_comes_back() {
        // The third piece finds the endpoint full, so the first frame's
        // last pieces wait in the backlog; the next try fails.
        let (mut endpoints, mut links, _, fabric) = with_data_link(4, Some(3));
        let mut counts = SendCounts::default();
        let first = Queued::frame(OutFrame::whole(Bytes::from(message(300))), true);
        assert!(transmit(&mut endpoints, CONTROL, &mut links, &mut counts, first).is_none());
        assert!(links.has_backlog());
        // A run sent now is not handed to the link: it comes back whole,
        // its messages counted, to be dropped and counted with the queue.
        let run = Bytes::from([message(20), message(30)].concat());
        let rest = transmit(
            &mut endpoints,
            CONTROL,
            &mut links,
            &mut counts,
            Queued::messages_run(run.clone(), 2),
        )
        .expect("the run comes back");
        assert!(links.failure.is_some());
        assert_eq!((rest.frame.to_bytes(), rest.messages), (run, 2));
        assert_eq!(fabric.lock().unwrap().len(), 2);
        // So does a frame alone.
        let (mut endpoints, mut links, _, _) = with_data_link(4, Some(3));
        let first = Queued::frame(OutFrame::whole(Bytes::from(message(300))), true);
        assert!(transmit(&mut endpoints, CONTROL, &mut links, &mut counts, first).is_none());
        let alone = Bytes::from(message(20));
        let rest = transmit(
            &mut endpoints,
            CONTROL,
            &mut links,
            &mut counts,
            Queued::frame(OutFrame::whole(alone.clone()), true),
        )
        .expect("the frame comes back");
        assert!(links.failure.is_some());
        assert_eq!((rest.frame.to_bytes(), rest.messages), (alone, 1));
    }

    /// The peer's first message on its datagram link asks for that link's
    /// proof alone: its reliable side may never have opened (its own
    /// opening failed), and a reliable link asked in vain ends the session.
    /// Unanswered, the datagram link is given up alone; the reliable one,
    /// never used, is left to the handshake timeout.
    #[test]
    fn a_first_message_asks_for_its_own_link_s_proof_alone() {
        use super::super::data_link::{Ask, LinkKind, Proof, MAX_CHALLENGES};
        let control = Arc::default();
        let mut endpoints = wire(usize::MAX, &control);
        let room = (usize::MAX, None, usize::MAX);
        let (rdm, mut reliable, _) = scripted_link(false, codec::FRAGMENT_OVERHEAD + 64, room);
        let (dgram, mut best_effort, _) = scripted_link(true, 2048, room);
        endpoints.push(rdm);
        reliable.endpoint = 1;
        reliable.proof = Proof::Awaiting { nonce: 1, asked: 0 };
        endpoints.push(dgram);
        best_effort.endpoint = 2;
        best_effort.proof = Proof::Awaiting { nonce: 2, asked: 0 };
        let mut links = DataLinks {
            reliable: Some(reliable),
            best_effort: Some(best_effort),
            opened_at: Some(std::time::Instant::now()),
            ..DataLinks::default()
        };
        let proof = |links: &DataLinks, kind| match kind {
            LinkKind::Reliable => links.reliable.as_ref().map(|link| link.proof),
            LinkKind::BestEffort => links.best_effort.as_ref().map(|link| link.proof),
        };
        assert!(links.challenge_due(LinkKind::BestEffort));
        let unanswered = links.send_challenges(&mut endpoints, Ask::First(LinkKind::BestEffort));
        assert!(!unanswered.session_ends);
        assert_eq!(
            proof(&links, LinkKind::Reliable),
            Some(Proof::Awaiting { nonce: 1, asked: 0 })
        );
        assert_eq!(
            proof(&links, LinkKind::BestEffort),
            Some(Proof::Awaiting { nonce: 2, asked: 1 })
        );
        let mut given_up = None;
        for _ in 0..MAX_CHALLENGES {
            let unanswered = links.send_challenges(&mut endpoints, Ask::Again);
            assert!(!unanswered.session_ends, "the reliable link was asked");
            given_up = given_up.or(unanswered.best_effort_given_up);
        }
        assert!(given_up.is_some(), "the datagram link was kept");
        assert!(links.challenge_due(LinkKind::Reliable));
        assert!(links
            .unused_deadline(std::time::Duration::from_secs(5))
            .is_some());
    }

    #[test]
    fn a_challenge_the_reliable_link_fails_to_send_fails_the_link() {
        // Every send fails: the challenge's ping cannot go.
        let (mut endpoints, mut links, _, _) = with_data_link(1, None);
        if let Some(link) = links.reliable.as_mut() {
            link.proof = super::super::data_link::Proof::Awaiting { nonce: 7, asked: 0 };
        }
        let unanswered = links.send_challenges(
            &mut endpoints,
            super::super::data_link::Ask::First(super::super::data_link::LinkKind::Reliable),
        );
        assert!(!unanswered.session_ends && unanswered.best_effort_given_up.is_none());
        let reason = links.failure.clone().expect("the link has failed");
        assert!(reason.contains("completion error"), "{reason}");
    }

    #[test]
    fn a_batch_is_handed_on_as_one_run_of_its_messages() {
        let mut batch = Batch::default();
        let mut encoded = BytesMut::new();
        codec::routed_into(
            &mut encoded,
            codec::FrameKind::Message,
            0,
            codec::RoutedFields::new("s", None),
            b"x",
        )
        .expect("encodes");
        assert!(
            batch.push(&encoded, 7, usize::MAX),
            "the first message opens the batch"
        );
        assert!(!batch.push(&encoded, 8, usize::MAX));
        let run = batch.take().expect("a run");
        assert!(run.run);
        assert_eq!(run.messages, 2);
        assert_eq!(run.frames, 2, "every frame of a batch is a message");
        assert_eq!(split_run_slices(&run.frame.head).count(), 2);
        assert!(batch.take().is_none(), "taken once");
    }

    #[test]
    fn a_batch_ends_where_its_path_takes_one_piece() {
        let mut batch = Batch::default();
        let encoded = [7u8; 20];
        let limit = 50;
        assert!(
            batch.has_room(encoded.len(), limit),
            "an empty batch takes any"
        );
        batch.push(&encoded, 1, limit);
        assert!(batch.has_room(encoded.len(), limit), "40 bytes of 50");
        batch.push(&encoded, 2, limit);
        assert!(!batch.has_room(encoded.len(), limit), "60 bytes of 50");
        let run = batch.take().expect("a run");
        assert_eq!((run.frame.head.len(), run.frames), (40, 2));
        // The buffers are no larger than the limit: closing one there
        // leaves no unused room behind.
        batch.push(&encoded, 3, limit);
        assert!(batch.buffer.capacity() < BATCH_MIN);
    }

    #[test]
    fn a_counted_run_within_a_piece_goes_whole_as_a_walked_one_does() {
        use super::super::data_link::{released_frames, LinkKind};
        let (mut endpoints, mut links, _, fabric) = with_data_link(usize::MAX, None);
        let small = |n: u8| {
            let mut frame = message(20);
            frame[PREFIX + 1] = n;
            frame
        };
        let frames = [small(1), small(2)];
        let run = Bytes::from(frames.concat());
        let mut counts = SendCounts::default();
        let queued = Queued::messages_run(run, 2);
        let rest = transmit(&mut endpoints, CONTROL, &mut links, &mut counts, queued);
        assert!(rest.is_none(), "taken");
        assert_eq!(counts.fabric_frames_out, 2);
        let pieces = fabric.lock().unwrap().clone();
        assert_eq!(pieces.len(), 1, "one piece");
        let mut out = Vec::new();
        links
            .receive(
                LinkKind::Reliable,
                std::time::Instant::now(),
                pieces[0].clone(),
                &mut out,
            )
            .expect("a well-formed piece");
        let released: Vec<Vec<u8>> = out
            .iter()
            .flat_map(|message| released_frames(message).map(|frame| message[frame].to_vec()))
            .collect();
        assert_eq!(released, frames);
    }

    #[test]
    fn drop_oldest_names_the_subscription_of_each_message_it_discards() {
        let message = |sid: u64| {
            let mut encoded = BytesMut::new();
            codec::routed_into(
                &mut encoded,
                codec::FrameKind::Message,
                sid,
                codec::RoutedFields::new("s", None),
                &[0; 40],
            )
            .expect("encodes");
            encoded.freeze()
        };
        let mut out = Outbound::default();
        let mut run = BytesMut::new();
        for sid in [1, 2, 1] {
            run.extend_from_slice(&message(sid));
        }
        out.push(Queued::messages_run(run.freeze(), 3));
        out.push(Queued::frame(
            codec::encode(&efabus_core::frame::Frame::Ping { nonce: 1 }),
            false,
        ));
        out.push(Queued::frame(OutFrame::whole(message(3)), true));
        out.push(Queued::frame(OutFrame::whole(message(4)), true));
        let mut sids = Vec::new();
        let overflow = out.enforce(SlowConsumerPolicy::DropOldest, 100, |queued| {
            queued.for_each_sid(|sid| sids.push(sid));
        });
        assert_eq!(overflow, Overflow::DroppedOldest(4));
        assert_eq!(sids, [1, 2, 1, 3], "the run's three, then the next message");
        assert_eq!(out.messages(), 1, "the newest message is kept");
        // The ping is kept and counted as the queue's control bytes.
        let ping = codec::encode(&efabus_core::frame::Frame::Ping { nonce: 1 }).len();
        assert_eq!(out.control_bytes(), ping);
        out.clear();
        assert_eq!(out.control_bytes(), 0);
    }

    #[test]
    fn drop_oldest_keeps_control_frames_and_counts_messages() {
        let mut out = Outbound::default();
        out.push(Queued::frame(
            OutFrame::whole(Bytes::from(frame(b"ctrl"))),
            false,
        ));
        out.push(Queued::messages_run(Bytes::from(frame(&[0; 100])), 1));
        out.push(Queued::frame(
            OutFrame::whole(Bytes::from(frame(&[0; 50]))),
            true,
        ));
        assert_eq!(out.messages(), 2);
        let overflow = out.enforce(SlowConsumerPolicy::DropOldest, 70, |_| {});
        assert_eq!(overflow, Overflow::DroppedOldest(1));
        assert_eq!(out.bytes(), 8 + 54);
        assert_eq!(out.messages(), 1);
        assert_eq!(
            out.enforce(SlowConsumerPolicy::Disconnect, 60, |_| {}),
            Overflow::Disconnect
        );
        assert_eq!(
            out.enforce(SlowConsumerPolicy::Block, 1000, |_| {}),
            Overflow::Within
        );
    }

    /// Bodies queued from scattered parts of a read buffer are copied (they
    /// would keep it whole); a body that follows the one queued before it
    /// shares that one's buffer and is not; nor is a large one.
    #[test]
    fn queued_bodies_keep_no_larger_buffer_alive_but_a_stream_is_not_copied() {
        let read = Bytes::from(vec![7u8; 64 << 10]);
        let mut out = Outbound::default();
        // A message's head: a length prefix, then its kind.
        let head = Bytes::from(vec![0, 0, 0, 0, codec::FrameKind::Message as u8]);
        let queue = |out: &mut Outbound, body: Bytes| {
            let head = head.clone();
            out.push(Queued::frame(OutFrame { head, body }, true));
        };
        queue(&mut out, read.slice(100..1600));
        queue(&mut out, read.slice(20_000..21_500));
        assert!(read.is_unique(), "a queued body holds the read buffer");
        assert_eq!(out.bytes(), 2 * (5 + 1500));
        // Following a copied one, a body is copied too.
        queue(&mut out, read.slice(21_540..23_040));
        assert!(
            read.is_unique(),
            "a body after a copied one holds the buffer"
        );
        // Following one that went on at once, it is not.
        let stream = Bytes::from(vec![6u8; 64 << 10]);
        out.detacher.passed(&stream.slice(..1500));
        queue(&mut out, stream.slice(1540..3040));
        assert!(!stream.is_unique(), "a body following the last was copied");
        let stream = Bytes::from(vec![8u8; 64 << 10]);
        queue(&mut out, stream.slice(..DETACH_MAX + 1));
        assert!(!stream.is_unique(), "a large body was copied");
        // A publish's body is its publisher's own.
        let publish = Bytes::from(vec![0, 0, 0, 0, codec::FrameKind::Publish as u8]);
        let body = stream.slice(30_000..31_000);
        out.push(Queued::frame(
            OutFrame {
                head: publish,
                body: body.clone(),
            },
            true,
        ));
        assert_eq!(
            out.queue.back().map(|q| q.frame.body.as_ptr()),
            Some(body.as_ptr())
        );
    }

    #[test]
    fn a_resubscription_replaces_the_interest_frames_waiting_and_goes_first() {
        use efabus_core::frame::{DeliveryClass, Frame, Subscribe};
        let subscribe = |sid| {
            Queued::frame(
                codec::encode(&Frame::Subscribe(Subscribe {
                    sid,
                    pattern: "a".into(),
                    queue: None,
                    class: DeliveryClass::Reliable,
                })),
                false,
            )
        };
        let publish = || Queued::frame(OutFrame::whole(Bytes::from(frame(&[1, 2, 3]))), true);
        let mut out = Outbound::default();
        out.push(subscribe(1));
        out.push(publish());
        out.push(Queued::frame(
            codec::encode(&Frame::Unsubscribe { sid: 1 }),
            false,
        ));
        out.resubscribed(vec![subscribe(7), subscribe(8)]);
        let heads: Vec<Bytes> = out.queue.iter().map(|q| q.frame.head.clone()).collect();
        assert_eq!(
            heads,
            [
                subscribe(7).frame.head,
                subscribe(8).frame.head,
                publish().frame.head
            ]
        );
        let total: usize = out.queue.iter().map(|q| q.frame.len()).sum();
        assert_eq!(out.bytes(), total);
        assert_eq!(out.control_bytes(), total - publish().frame.len());
    }
}
