//! The link layer between a session and one peer's data path.
//!
//! A data path may be a libfabric endpoint that does not keep send order
//! (RDM without `FI_ORDER_SAS`, DGRAM), whose largest message is smaller than
//! a frame (EFA DGRAM: 8928 B minus a 40 B prefix; libfabric udp: 1472 B),
//! or that loses messages (DGRAM). This module hides all three: a
//! [`LinkSender`] turns each encoded frame into the wire frames to send, and
//! a [`LinkReceiver`] turns the wire frames received into the original
//! frames, whole, in the sender's order, each at most once. It builds on
//! [`Fragmenter`] and [`Reassembler`] for size and on [`ReorderBuffer`] for
//! order; it does no I/O and reads no clock.
//!
//! # Wire rules
//!
//! - **Unsequenced links** (ordered, e.g. TCP or RDM with `FI_ORDER_SAS`):
//!   a frame that fits the frame limit is sent untouched; a larger one is
//!   sent as `Fragment` frames, whose message ids number only the
//!   fragmented frames.
//! - **Sequenced links** (unordered): *every* frame is sent as `Fragment`
//!   frames (one piece for a frame that fits), so the message id, 1, 2, 3,
//!   …, doubles as the link's sequence number. A frame that is not a
//!   `Fragment` arriving on a sequenced link is a protocol error
//!   ([`LinkError::Unsequenced`]): it could be delivered neither in order
//!   nor exactly once.
//!
//! Both sides derive the same rule from the negotiated [`LinkParams`], which
//! are symmetric. Frames handed to the sender must not themselves be
//! `Fragment` frames: the receiver could not tell them from its own. A
//! sender and a receiver serve one peer for the life of one link: a peer
//! that reconnects starts again at sequence 1 and needs fresh ones.
//!
//! # Reliable and lossy links
//!
//! On a **reliable** link every piece should arrive, possibly more than
//! once (duplicates are dropped and counted) and out of order: frames wait
//! for a missing sequence and partial messages are kept. Nothing is ever
//! skipped, but the wait is bounded ([`GapPolicy::FailAfter`]): a provider
//! that promises delivery can still lose a message (a send that failed, a
//! fault), and the link would otherwise stall until the session's heartbeat
//! gave up. Once a frame has waited [`LinkConfig::reliable_gap_timeout`]
//! behind a missing sequence with no piece of the gap arriving meanwhile,
//! the receiver fails with [`LinkError::GapTimeout`], counted in
//! [`ReceiveStats::gap_failures`]. The owner polls at
//! [`LinkReceiver::next_deadline`] for this, after handing over what its
//! endpoint delivered, and must then end the session (nothing after the
//! gap could be delivered in order). An owner held up well past the
//! deadline gives the gap a fresh timeout rather than failing it unseen.
//! A partial message is timed too: once it has gone the reassembly timeout
//! (2 s) without a piece, the receiver fails with
//! [`LinkError::PartialTimeout`], counted the same way (its memory is
//! reserved for the whole message, which a peer sending first pieces only
//! would otherwise hold for ever). A piece whose sequence
//! is beyond the reorder window is refused with [`LinkError::Reorder`]
//! before anything is stored (the credit window of [`crate::credit`] keeps
//! the sender within it), and running out of reassembly slots is an error
//! too: either means the link is broken.
//!
//! On a **lossy** link a partial message is dropped once no piece of it
//! arrived for the reassembly timeout, and a missing sequence is skipped
//! once a later frame has waited [`LinkConfig::gap_timeout`]
//! ([`GapPolicy::SkipAfter`]), or once [`LinkConfig::skip_distance`]
//! pieces that passed it (of later sequences, or later pieces of its own
//! message) have been taken; a partial message that is the sequence due,
//! with nothing whole behind it, is given up once no piece of it arrived
//! for the gap timeout (the sender's credits may be stopped at it, so
//! that nothing later can come), or for a twentieth of it once its last
//! piece has come ([`LAST_PIECE_WAIT_SHARE`]); a frame beyond the reorder window skips
//! ahead at once. Every sequence
//! given up is counted exactly once in [`ReceiveStats::lost`], so after
//! the receiver has settled (nothing held, nothing partial) `delivered +
//! lost` equals the highest sequence any piece arrived for. Sequences after the last piece that
//! arrived cannot be known and are not counted, unless the sender's probe
//! ([`crate::frame::Frame::Probe`], outside the sequence) says they were
//! sent ([`LinkReceiver::note_sent_through`]): those still missing a gap
//! timeout later are then settled as any gap is. The gap timeout should
//! exceed the time one frame's pieces take to arrive, or large frames are
//! skipped while still arriving; once a frame's last piece has come, a
//! piece of it reordered further behind than a twentieth of the timeout
//! (with no piece between) is taken for lost. The owner hands over what
//! its endpoint delivered before it polls, so its own delays do not count.
//!
//! # Memory
//!
//! What a receiver holds for the peer, partial messages (as reserved) and
//! whole frames waiting for an earlier sequence together, stays within
//! `reassembly.max_bytes` of its link, and within the [`MemoryBudget`] it
//! shares with the other links of the process ([`LinkConfig::memory`]).
//! A sender within the credit window the owner grants (half of
//! `max_bytes`) never reaches the first bound. On a reliable link reaching
//! either is an error naming the bound ([`LinkError::MemoryBound`],
//! [`LinkError::SharedMemoryBound`]) and nothing more is stored; on a lossy
//! link the message is given up and counted ([`ReceiveStats::over_budget`],
//! and as lost). Memory is given back as frames are delivered or given up,
//! and when the receiver is dropped.

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use thiserror::Error;

use crate::budget::MemoryBudget;
use crate::caps::LinkParams;
use crate::codec::{
    self, CodecLimits, DecodeError, EncodeError, FrameKind, FRAGMENT_OVERHEAD, FRAME_OVERHEAD,
    PREFIX_LEN,
};
use crate::fragment::{
    FragmentError, Fragmenter, Fragments, Reassembler, ReassemblyConfig, ReassemblyError,
};
use crate::frame::{Fragment, Frame};
use crate::reorder::{GapPolicy, Pushed, ReorderBuffer, ReorderConfig, ReorderError};
use crate::transport::OutFrame;

/// The largest wire frame the 4-byte length can describe.
const MAX_WIRE_FRAME: usize = match (PREFIX_LEN as u64).checked_add(u32::MAX as u64) {
    Some(max) if max <= usize::MAX as u64 => max as usize,
    _ => usize::MAX,
};

/// On a lossy link, the part of the gap timeout a partial message that is
/// the sequence due waits once its last piece has come (see
/// [`LinkReceiver::poll`]): 5 ms of the default 100. A message larger than
/// half the link's window is alone in flight, so a lost piece of it used to
/// hold the link for the whole timeout (50 kB messages over `udp` with one
/// datagram in 200 dropped: 94 of them carried in 2 s, against 1,797 in
/// 0.6 s with none dropped).
pub const LAST_PIECE_WAIT_SHARE: u32 = 20;

/// Settings of a link that are not negotiated: the local policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkTuning {
    /// How long a frame waits for an earlier missing one on a lossy,
    /// sequenced link before that one is given up.
    pub gap_timeout: Duration,
    /// How long a frame may wait behind a missing sequence on a reliable,
    /// sequenced link, with no piece of the gap arriving, before the link
    /// fails ([`LinkError::GapTimeout`]). Above the time one frame's pieces
    /// take to come apart, well below the heartbeat timeout.
    pub reliable_gap_timeout: Duration,
    /// Width of the reorder window in sequences; the link's credit window
    /// ([`crate::credit`]) keeps the sender within it.
    pub reorder_window: usize,
    /// Bounds of reassembly (partial messages, largest frame, timeout on
    /// lossy links); its `max_bytes` bounds what one link's receiver holds,
    /// partial messages and frames waiting for reordering together.
    pub reassembly: ReassemblyConfig,
    /// Memory shared by the receivers of every link given a clone.
    pub memory: MemoryBudget,
}

impl Default for LinkTuning {
    /// A 100 ms gap timeout (250 ms on reliable links), a window of 4096
    /// sequences, the default reassembly bounds (64 MiB, 1024 partial
    /// messages, 2 s), and no shared memory bound.
    fn default() -> Self {
        LinkTuning {
            gap_timeout: Duration::from_millis(100),
            reliable_gap_timeout: Duration::from_millis(250),
            reorder_window: 4096,
            reassembly: ReassemblyConfig::default(),
            memory: MemoryBudget::unlimited(),
        }
    }
}

/// How one direction of a link is driven.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkConfig {
    /// Largest wire frame (its 4-byte length included) one message of the
    /// endpoint carries, any provider prefix already deducted.
    pub frame_limit: usize,
    /// The link may reorder: number every frame and restore the order.
    pub sequenced: bool,
    /// The link may lose messages: give up gaps and partial messages by
    /// time (and count them) instead of waiting.
    pub lossy: bool,
    /// See [`LinkTuning::gap_timeout`].
    pub gap_timeout: Duration,
    /// See [`LinkTuning::reliable_gap_timeout`].
    pub reliable_gap_timeout: Duration,
    /// See [`LinkTuning::reorder_window`].
    pub reorder_window: usize,
    /// On a lossy link, how many pieces of later sequences may be taken
    /// while one is missing (and frames wait for it) before it is given up
    /// at once, without waiting for `gap_timeout`: half the pieces the peer
    /// may have in flight (at least one). Credits stop at the first gap,
    /// so a sender that lost one datagram would otherwise send the rest of
    /// its window and then wait for the gap timeout, and what it was asked
    /// to send meanwhile would overflow its queue; a piece of the gap that
    /// comes later still is dropped as late.
    pub skip_distance: usize,
    /// See [`LinkTuning::reassembly`].
    pub reassembly: ReassemblyConfig,
    /// See [`LinkTuning::memory`].
    pub memory: MemoryBudget,
}

impl LinkConfig {
    /// The configuration for a negotiated link: the frame limit is the
    /// smaller of the negotiated one and what the opened endpoint accepts
    /// ([`crate::transport::Endpoint::max_frame`], provider prefix already
    /// deducted).
    pub fn from_params(
        params: &LinkParams,
        endpoint_max_frame: usize,
        tuning: &LinkTuning,
    ) -> LinkConfig {
        let negotiated = usize::try_from(params.frame_limit).unwrap_or(usize::MAX);
        let mut config = LinkConfig {
            frame_limit: negotiated.min(endpoint_max_frame),
            sequenced: params.sequence_and_reorder,
            lossy: !params.reliable,
            gap_timeout: tuning.gap_timeout,
            reliable_gap_timeout: tuning.reliable_gap_timeout,
            reorder_window: tuning.reorder_window,
            skip_distance: 1,
            reassembly: tuning.reassembly.clone(),
            memory: tuning.memory.clone(),
        };
        // Half the pieces the peer may have in flight: with its credits
        // stopped at the gap it sends at most that window, so a distance
        // of half the negotiated queues, when they are larger, never came.
        let window = params.recv_window.min(config.piece_limit());
        config.skip_distance = usize::try_from(window / 2).unwrap_or(usize::MAX).max(1);
        config
    }

    /// Most pieces a peer may have in flight towards this link (its credit
    /// window never grants more): within the reorder window, and twice the
    /// reassembly slots, since a fragmented message has at least two
    /// pieces in flight and the slots cannot run out.
    pub fn piece_limit(&self) -> u64 {
        self.reorder_window
            .min(self.reassembly.max_messages.saturating_mul(2))
            .max(1) as u64
    }
}

/// Why a frame could not be sent or a message was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LinkError {
    /// The frame limit leaves no room for fragment data.
    #[error("link frame limit of {limit} bytes is too small: at least {min} needed")]
    FrameLimitTooSmall {
        /// The limit configured.
        limit: usize,
        /// The smallest limit that works.
        min: usize,
    },
    /// A frame handed to the sender is empty.
    #[error("cannot send an empty frame")]
    EmptyFrame,
    /// A frame handed to the sender, or reassembled by the receiver, is a
    /// `Fragment` frame itself.
    #[error("a fragment frame cannot be carried inside the link's own fragments")]
    NestedFragment,
    /// The frame could not be split into pieces.
    #[error("cannot fragment frame: {0}")]
    Fragment(#[from] FragmentError),
    /// A piece could not be encoded.
    #[error("cannot encode fragment: {0}")]
    Encode(#[from] EncodeError),
    /// A received message is not one whole, well-formed frame.
    #[error("malformed link message: {0}")]
    Decode(#[from] DecodeError),
    /// A frame other than a fragment arrived on a sequenced link.
    #[error("unsequenced {kind} frame on a sequenced link")]
    Unsequenced {
        /// Kind of the frame that arrived.
        kind: FrameKind,
    },
    /// Sequences start at 1.
    #[error("fragment with sequence number 0 on a sequenced link")]
    ZeroSequence,
    /// An inconsistent piece; or, on a reliable link, no room to reassemble.
    #[error("reassembly: {0}")]
    Reassembly(#[from] ReassemblyError),
    /// On a reliable link, a sequence beyond the reorder window.
    #[error("reorder: {0}")]
    Reorder(#[from] ReorderError),
    /// The pieces of message `msg_id` joined into something that is not one
    /// whole frame: the peer's sender is broken.
    #[error("message {msg_id} reassembled into an invalid frame: {reason}")]
    BadFrame {
        /// The message whose pieces were joined.
        msg_id: u64,
        /// Why the result is not a frame.
        reason: String,
    },
    /// On a reliable link, stale partial messages were dropped to make room.
    #[error("{count} partial messages dropped on a reliable link")]
    ReliableLoss {
        /// Partial messages dropped.
        count: u64,
    },
    /// On a reliable link, frames waited [`LinkConfig::reliable_gap_timeout`]
    /// behind a missing sequence with no piece of it arriving: the message
    /// is taken as lost, and the link can deliver nothing more in order.
    #[error("reliable link stalled: sequence {missing} still missing after {waited:?} with {held} frames waiting behind it")]
    GapTimeout {
        /// The first missing sequence.
        missing: u64,
        /// Frames waiting behind it.
        held: usize,
        /// How long the gap went without progress.
        waited: Duration,
    },
    /// On a reliable link, a partial message went the reassembly timeout
    /// without a piece: the rest is taken as lost. (Its memory was
    /// reserved for the whole message: a peer that sent first pieces only
    /// would otherwise hold it for ever.)
    #[error("reliable link stalled: message {msg_id} has {received} of {count} pieces and none came for {waited:?}")]
    PartialTimeout {
        /// The message's id.
        msg_id: u64,
        /// Pieces that arrived.
        received: u32,
        /// Pieces it has.
        count: u32,
        /// How long since the last piece.
        waited: Duration,
    },
    /// On a reliable link, holding what arrived would take the link past
    /// its memory bound (`reassembly.max_bytes`): the peer sent beyond the
    /// credit window.
    #[error("link memory bound reached: {needed} more bytes needed with {held} held, limit {limit} (reassembly.max_bytes)")]
    MemoryBound {
        /// Bytes the message would have taken.
        needed: usize,
        /// Bytes the link held: partial messages and frames waiting.
        held: usize,
        /// The link's bound.
        limit: usize,
    },
    /// On a reliable link, holding what arrived would take the links of
    /// this process together past their shared [`MemoryBudget`].
    #[error("shared link memory bound reached: {needed} more bytes needed with {used} held by all links, limit {limit}")]
    SharedMemoryBound {
        /// Bytes the message would have taken.
        needed: usize,
        /// Bytes all links held.
        used: usize,
        /// The shared bound.
        limit: usize,
    },
}

/// Counters of a [`LinkSender`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendStats {
    /// Frames handed to [`LinkSender::prepare`] and accepted.
    pub frames: u64,
    /// Frames sent untouched (unsequenced links only).
    pub passed_through: u64,
    /// Frames split into more than one piece.
    pub fragmented: u64,
    /// `Fragment` frames emitted (one-piece wrappers included).
    pub fragments: u64,
}

/// Counters of a [`LinkReceiver`]. Nothing is dropped without being counted
/// here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiveStats {
    /// Messages handed to [`LinkReceiver::receive`].
    pub messages: u64,
    /// Of those, `Fragment` frames.
    pub fragments: u64,
    /// Whole frames yielded.
    pub delivered: u64,
    /// Frames rebuilt from more than one piece.
    pub reassembled: u64,
    /// Frames that arrived while an earlier sequence was missing.
    pub reordered: u64,
    /// Pieces or frames dropped because their message was already
    /// delivered, held, or given up.
    pub duplicates: u64,
    /// Sequences given up (lossy, sequenced links), each counted once:
    /// skipped gaps and messages whose reassembly was abandoned.
    pub lost: u64,
    /// Partial messages dropped by the reassembly timeout; on sequenced
    /// links their sequences are also counted in `lost` (once each).
    pub expired_partials: u64,
    /// Messages refused for lack of memory (the link's bound or the shared
    /// one) or of reassembly slots.
    pub over_budget: u64,
    /// Pieces refused beyond the reorder window (reliable links).
    pub window_exceeded: u64,
    /// Messages refused with an error: malformed, or beyond what a
    /// reliable link allows.
    pub refused: u64,
    /// Reliable links: gaps not filled within the reliable gap timeout
    /// (at most one: the link is failed).
    pub gap_failures: u64,
}

/// The sending half of a link: frames in, wire frames out.
#[derive(Debug)]
pub struct LinkSender {
    frame_limit: usize,
    sequenced: bool,
    /// Data bytes per piece at `frame_limit`.
    chunk: usize,
    fragmenter: Fragmenter,
    stats: SendStats,
    /// Where piece headers are written: many share one allocation.
    heads: BytesMut,
}

/// Bytes of piece headers one allocation holds.
const HEAD_ARENA: usize = 16 << 10;

impl LinkSender {
    /// A sender for `config`; fails when the frame limit cannot hold a
    /// fragment with at least one byte of data.
    pub fn new(config: &LinkConfig) -> Result<LinkSender, LinkError> {
        // Above what the 4-byte length can express, a piece would not encode.
        let frame_limit = config.frame_limit.min(MAX_WIRE_FRAME);
        let chunk =
            Fragmenter::data_per_fragment(frame_limit).ok_or(LinkError::FrameLimitTooSmall {
                limit: config.frame_limit,
                min: FRAGMENT_OVERHEAD + 1,
            })?;
        Ok(LinkSender {
            frame_limit,
            sequenced: config.sequenced,
            chunk,
            fragmenter: Fragmenter::new(),
            stats: SendStats::default(),
            heads: BytesMut::new(),
        })
    }

    /// `parts` joined, in the header arena.
    fn head(&mut self, parts: [&[u8]; 2]) -> Bytes {
        let len = parts[0].len() + parts[1].len();
        if self.heads.capacity() - self.heads.len() < len {
            self.heads = BytesMut::with_capacity(HEAD_ARENA.max(len));
        }
        self.heads.extend_from_slice(parts[0]);
        self.heads.extend_from_slice(parts[1]);
        self.heads.split().freeze()
    }

    /// Counters since creation.
    pub fn stats(&self) -> &SendStats {
        &self.stats
    }

    /// The sequence number the next frame gets on a sequenced link (the
    /// message id of the next fragmented frame otherwise).
    pub fn next_sequence(&self) -> u64 {
        self.fragmenter.next_msg_id()
    }

    /// How many wire frames [`Self::prepare`] makes of a frame of
    /// `frame_len` bytes, and their total length.
    pub fn wire_size(&self, frame_len: usize) -> (u32, u64) {
        if !self.sequenced && !Fragmenter::needs_fragmenting(frame_len, self.frame_limit) {
            return (1, frame_len as u64);
        }
        let pieces = frame_len.div_ceil(self.chunk).max(1);
        let bytes = (frame_len + pieces * FRAGMENT_OVERHEAD) as u64;
        (u32::try_from(pieces).unwrap_or(u32::MAX), bytes)
    }

    /// Append to `out` the wire frames that carry `frame` (one whole encoded
    /// frame, length prefix included), each at most the frame limit. A
    /// frame passed through is the same buffers; pieces are slices of them,
    /// except that a piece spanning `head` and `body` copies its `head`
    /// part. On error nothing is appended.
    pub fn prepare(&mut self, frame: OutFrame, out: &mut Vec<OutFrame>) -> Result<(), LinkError> {
        if frame.is_empty() {
            return Err(LinkError::EmptyFrame);
        }
        if byte_at(&frame, PREFIX_LEN) == Some(FrameKind::Fragment as u8) {
            return Err(LinkError::NestedFragment);
        }
        if !self.sequenced && !Fragmenter::needs_fragmenting(frame.len(), self.frame_limit) {
            self.stats.frames += 1;
            self.stats.passed_through += 1;
            out.push(frame);
            return Ok(());
        }
        let pieces = self.fragmenter.fragment(&frame, self.frame_limit)?;
        let (msg_id, count) = (pieces.msg_id(), Fragments::count(&pieces));
        // The fragmenter checked the frame fits u32; the pieces are cut as it
        // cuts them (same chunk), but without joining buffers. Every piece
        // fits the wire's length field (see `new`), so the header encodes.
        let total = frame.len();
        let split = frame.head.len();
        let start_len = out.len();
        for index in 0..count {
            let start = index as usize * self.chunk;
            let end = (start + self.chunk).min(total);
            let header = Fragment {
                msg_id,
                index,
                count,
                total_len: total as u32,
                data: Bytes::new(),
            };
            let head_bytes = match codec::fragment_head(&header, end - start) {
                Ok(h) => h,
                Err(err) => {
                    out.truncate(start_len);
                    return Err(err.into());
                }
            };
            let piece = if end <= split {
                OutFrame {
                    head: self.head([&head_bytes, &[]]),
                    body: frame.head.slice(start..end),
                }
            } else if start >= split {
                OutFrame {
                    head: self.head([&head_bytes, &[]]),
                    body: frame.body.slice(start - split..end - split),
                }
            } else {
                // The one piece spanning both buffers: its head part (the
                // frame's header, usually small) joins the fragment header;
                // the payload part stays shared.
                OutFrame {
                    head: self.head([&head_bytes, &frame.head[start..]]),
                    body: frame.body.slice(..end - split),
                }
            };
            out.push(piece);
        }
        self.stats.frames += 1;
        self.stats.fragments += u64::from(count);
        if count > 1 {
            self.stats.fragmented += 1;
        }
        Ok(())
    }
}

/// The byte at `index` of a frame held in two parts.
fn byte_at(frame: &OutFrame, index: usize) -> Option<u8> {
    match frame.head.get(index) {
        Some(&b) => Some(b),
        None => frame.body.get(index - frame.head.len()).copied(),
    }
}

/// What the reorder buffer holds: a frame with the bytes reserved for it
/// (none for one released at once), or the mark of a sequence whose
/// reassembly was abandoned (released in its turn and counted as lost).
#[derive(Debug)]
enum Slot {
    Frame(Bytes, usize),
    Lost,
}

/// No frame limit when checking a message already in memory: its length is
/// what the endpoint delivered.
const UNBOUNDED: CodecLimits = CodecLimits {
    max_frame: usize::MAX,
    max_subject_len: u16::MAX as usize,
};

/// The receiving half of a link: wire frames in, original frames out.
#[derive(Debug)]
pub struct LinkReceiver {
    lossy: bool,
    reassembler: Reassembler<()>,
    /// Present on sequenced links.
    reorder: Option<ReorderBuffer<Slot>>,
    /// Released slots, drained into the caller's vector at once.
    released: Vec<Slot>,
    /// Highest sequence a valid piece arrived for.
    highest_seen: u64,
    /// Bytes of the frames held in the reorder buffer, also reserved in
    /// `memory`.
    held_bytes: usize,
    /// Bound of `held_bytes` and the reassembler's partial messages together.
    max_bytes: usize,
    memory: MemoryBudget,
    /// Frames refused (or given up, on lossy links) for lack of memory.
    held_over_budget: u64,
    stats: ReceiveStats,
    /// Lost marks released (the reorder buffer counts skipped gaps).
    marks_released: u64,
    /// Lossy links: pieces seen far beyond the window, as (lowest, highest,
    /// how many). One piece alone never moves the link that far.
    far_ahead: Option<(u64, u64, u32)>,
    /// Lossy links: [`LinkConfig::skip_distance`].
    skip_distance: usize,
    /// Lossy links: [`LinkConfig::gap_timeout`].
    gap_timeout: Duration,
    /// Lossy, sequenced links: the highest sequence the sender's probe
    /// said it sent, beyond any piece seen, and when the probe came.
    announced: Option<(u64, Instant)>,
    /// Lossy links: the next sequence due and the pieces of later ones
    /// taken since it became due.
    behind_gap: Option<(u64, usize)>,
    /// Reliable links: the gap that timed out (reported from then on;
    /// the link is dead).
    gap_failure: Option<LinkError>,
    /// Reliable links: the gap deadline as of the last call, to tell an
    /// owner that slept until it from one held up well past it.
    gap_deadline: Option<Instant>,
}

/// On a lossy link, a piece this many windows beyond the next expected
/// sequence, and at least [`FAR_AHEAD_MIN`] beyond it, needs corroboration
/// before the receiver skips to it.
const FAR_AHEAD_WINDOWS: u64 = 4;
/// The least distance that counts as far: with a small window, ordinary
/// loss bursts must not be mistaken for corruption.
const FAR_AHEAD_MIN: u64 = 1024;
/// Pieces, close together, that corroborate a far jump.
const FAR_AHEAD_VOTES: u32 = 3;
/// Windows past the next sequence due that a closing link takes the
/// sender's word for (see [`LinkReceiver::settle_at_close`]): a sender
/// resets a full window after 400 ms, so this covers well over the time
/// a link goes unanswered before it is given up.
pub const CLOSE_CLAIM_WINDOWS: u64 = 64;

impl LinkReceiver {
    /// A receiver for `config`. On sequenced links the reassembler
    /// remembers at least `reorder_window` finished ids, so that no message
    /// still awaited in the window is ever forgotten by it.
    pub fn new(config: &LinkConfig) -> LinkReceiver {
        let mut reassembly = config.reassembly.clone();
        let reorder = config.sequenced.then(|| {
            reassembly.done_window = reassembly.done_window.max(config.reorder_window);
            ReorderBuffer::new(ReorderConfig {
                capacity: config.reorder_window,
                gap_policy: if config.lossy {
                    GapPolicy::SkipAfter(config.gap_timeout)
                } else {
                    GapPolicy::FailAfter(config.reliable_gap_timeout)
                },
            })
        });
        LinkReceiver {
            lossy: config.lossy,
            max_bytes: reassembly.max_bytes,
            reassembler: Reassembler::with_budget(reassembly, config.memory.clone()),
            reorder,
            released: Vec::new(),
            highest_seen: 0,
            held_bytes: 0,
            memory: config.memory.clone(),
            held_over_budget: 0,
            stats: ReceiveStats::default(),
            marks_released: 0,
            far_ahead: None,
            skip_distance: config.skip_distance.max(1),
            gap_timeout: config.gap_timeout,
            announced: None,
            behind_gap: None,
            gap_failure: None,
            gap_deadline: None,
        }
    }

    /// The counters, as of now.
    pub fn stats(&self) -> ReceiveStats {
        let r = self.reassembler.stats();
        let mut stats = self.stats;
        stats.duplicates += r.duplicates + r.late;
        stats.expired_partials = r.expired;
        stats.over_budget = r.dropped_over_budget + self.held_over_budget;
        stats.lost = self.marks_released + self.reorder.as_ref().map_or(0, |buf| buf.stats().lost);
        stats
    }

    /// The next sequence to be delivered (sequenced links), else `None`.
    pub fn expected_sequence(&self) -> Option<u64> {
        self.reorder.as_ref().map(ReorderBuffer::expected)
    }

    /// Lossy links: the sequences up to the highest any piece came for
    /// that are neither delivered nor counted lost (waiting behind a gap,
    /// partial, or missing), which are lost if the link ends now.
    pub fn unsettled(&self) -> u64 {
        match &self.reorder {
            Some(reorder) if self.lossy && self.highest_seen >= reorder.expected() => {
                (self.highest_seen - reorder.expected()).saturating_add(1)
            }
            _ => 0,
        }
    }

    /// Lossy links: the highest sequence through which every one is
    /// delivered, counted lost, or counted in [`Self::unsettled`]: what a
    /// sender learns, when the link ends, is accounted for here.
    pub fn settled_through(&self) -> u64 {
        let delivered = self
            .expected_sequence()
            .map_or(0, |next| next.saturating_sub(1));
        delivered.max(self.highest_seen)
    }

    /// Sequenced links: pieces taken of the next sequence due while it is
    /// partial, and its pieces in all; `(0, 0)` when it is not.
    pub fn next_partial(&self) -> (u32, u32) {
        self.expected_sequence()
            .and_then(|next| self.reassembler.progress(&(), next))
            .map_or((0, 0), |progress| (progress.received, progress.count))
    }

    /// Frames held waiting for an earlier sequence.
    pub fn held(&self) -> usize {
        self.reorder.as_ref().map_or(0, ReorderBuffer::held)
    }

    /// Partial messages being reassembled.
    pub fn partial_messages(&self) -> usize {
        self.reassembler.partial_messages()
    }

    /// Bytes held: partial messages (as reserved) plus frames waiting in the
    /// reorder buffer.
    pub fn buffered_bytes(&self) -> usize {
        self.reassembler.in_flight_bytes() + self.held_bytes
    }

    /// Take one received message (one whole wire frame), appending to `out`
    /// every original frame now deliverable, in order. Dropped duplicates
    /// and losses on a lossy link are counted, not errors. After an error
    /// the receiver stays consistent, but on a reliable link the error means
    /// the link is broken. A reliable link's gap fails only in
    /// [`poll`](LinkReceiver::poll): a missing frame that arrives before
    /// it, however late, still fills the gap; after it, nothing is taken.
    pub fn receive(
        &mut self,
        now: Instant,
        message: Bytes,
        out: &mut Vec<Bytes>,
    ) -> Result<(), LinkError> {
        self.stats.messages += 1;
        if let Some(failure) = &self.gap_failure {
            return Err(failure.clone());
        }
        self.owner_called(now);
        let given_up = self.sequences_given_up();
        let result = self.receive_inner(now, message, out);
        if result.is_err() {
            self.stats.refused += 1;
        }
        self.skip_gap_at_distance();
        if self.lossy {
            self.expire_due_partial(now);
        }
        self.forget_skipped_partials(given_up);
        // Expiry on the way in may have left only abandoned sequences.
        self.settle_tail(now);
        // Whatever happened, hand over what was released.
        self.drain(out);
        self.note_gap_deadline();
        result
    }

    fn receive_inner(
        &mut self,
        now: Instant,
        message: Bytes,
        out: &mut Vec<Bytes>,
    ) -> Result<(), LinkError> {
        let kind = whole_frame_kind(&message)?;
        if kind != FrameKind::Fragment {
            if self.reorder.is_some() {
                return Err(LinkError::Unsequenced { kind });
            }
            self.stats.delivered += 1;
            out.push(message);
            return Ok(());
        }
        self.stats.fragments += 1;
        let Frame::Fragment(fragment) = codec::decode(message, &UNBOUNDED)? else {
            // The kind byte said fragment; decode cannot say otherwise.
            return Err(LinkError::Decode(DecodeError::UnknownKind(
                FrameKind::Fragment as u8,
            )));
        };
        let (msg_id, count, index) = (fragment.msg_id, fragment.count, fragment.index);

        // Sequenced: drop what is already settled, refuse what is beyond a
        // reliable window, before anything is stored.
        let mut expected_before = 0;
        if let Some(reorder) = &self.reorder {
            if msg_id == 0 {
                return Err(LinkError::ZeroSequence);
            }
            expected_before = reorder.expected();
            if msg_id < expected_before {
                self.stats.duplicates += 1;
                return Ok(());
            }
            let capacity = reorder.config().capacity;
            // Sequences count up from 1: one within a window of the end of
            // the range is no real one, and following it would carry the
            // next expected sequence past `u64::MAX`.
            let refuse = if msg_id > u64::MAX - capacity as u64 {
                true
            } else if self.lossy {
                // A corrupted sequence number would make the link skip far
                // ahead and then drop every genuine frame as stale. A real
                // jump (after a long loss) shows up as several pieces close
                // together; a lone far piece is refused.
                let window = capacity as u64;
                let far = window.saturating_mul(FAR_AHEAD_WINDOWS).max(FAR_AHEAD_MIN);
                let mut refuse = false;
                if msg_id - expected_before >= far {
                    let votes = match self.far_ahead {
                        Some((low, high, votes))
                            if msg_id.saturating_add(window) >= low
                                && msg_id <= high.saturating_add(window) =>
                        {
                            self.far_ahead = Some((low.min(msg_id), high.max(msg_id), votes + 1));
                            votes + 1
                        }
                        _ => {
                            self.far_ahead = Some((msg_id, msg_id, 1));
                            1
                        }
                    };
                    refuse = votes < FAR_AHEAD_VOTES;
                }
                if !refuse {
                    self.far_ahead = None;
                }
                refuse
            } else {
                msg_id - expected_before >= capacity as u64
            };
            if refuse {
                self.stats.window_exceeded += 1;
                return Err(ReorderError::WindowExceeded {
                    seq: msg_id,
                    expected: expected_before,
                    capacity,
                }
                .into());
            }
        }

        // Short of room, the reassembler drops partials idle for its
        // timeout: on a lossy link a loss like any other (settled by the
        // gap timeout or the tail rule), on a reliable one a broken link.
        let expired_before = self.reassembler.stats().expired;
        let repeats_before = self.reassembler.stats().duplicates + self.reassembler.stats().late;
        let needed = fragment.total_len as usize + (count as usize).div_ceil(64) * 8;
        // A piece of the message the link waits for that comes after one
        // of its pieces still missing passes that piece, as pieces of
        // later messages do: with its sender's credits stopped at the gap,
        // no later message may be able to come at all.
        let passes_gap = msg_id > expected_before
            || (self.lossy && msg_id == expected_before && index > self.pieces_received(msg_id));
        self.reassembler.set_held_elsewhere(self.held_bytes);
        let result = self.reassembler.handle_fragment(now, (), fragment);
        if !self.lossy && self.reassembler.stats().expired > expired_before {
            return Err(LinkError::ReliableLoss {
                count: self.reassembler.stats().expired - expired_before,
            });
        }
        let whole = match result {
            Ok(whole) => whole,
            Err(ReassemblyError::OverBudget { .. } | ReassemblyError::SharedBudget { .. })
                if self.lossy =>
            {
                // Counted by the reassembler; the sequence is settled by the
                // gap timeout or the tail rule.
                self.note_seen(msg_id);
                return Ok(());
            }
            Err(ReassemblyError::OverBudget {
                in_flight,
                messages,
                ..
            }) if messages < self.reassembler.config().max_messages => {
                // Slots were left: the bytes were not.
                return Err(LinkError::MemoryBound {
                    needed,
                    held: in_flight + self.held_bytes,
                    limit: self.max_bytes,
                });
            }
            Err(ReassemblyError::SharedBudget { used, limit, .. }) => {
                return Err(LinkError::SharedMemoryBound {
                    needed,
                    used,
                    limit,
                });
            }
            Err(err) => return Err(err.into()),
        };
        self.note_seen(msg_id);
        let Some(frame) = whole else {
            // A new piece of a message still incomplete: if it belongs to
            // the gap frames are waiting behind, the gap is filling.
            let repeats = self.reassembler.stats().duplicates + self.reassembler.stats().late;
            if repeats == repeats_before {
                if let Some(reorder) = &mut self.reorder {
                    reorder.note_progress(now, msg_id);
                }
                self.count_behind_gap(passes_gap, expected_before);
            }
            return Ok(());
        };
        if count > 1 {
            self.stats.reassembled += 1;
        }
        let checked = check_whole(msg_id, &frame);
        let Some(reorder) = &mut self.reorder else {
            checked?;
            self.stats.delivered += 1;
            out.push(frame);
            return Ok(());
        };
        // A bad frame still settles its sequence, so order is kept if the
        // caller carries on. A frame that has to wait is charged to the
        // link's memory and the shared budget first.
        let slot = match checked {
            Ok(()) if msg_id == expected_before => Slot::Frame(frame, 0),
            Ok(()) => {
                let held = self.reassembler.in_flight_bytes() + self.held_bytes;
                let charged = if held.saturating_add(frame.len()) > self.max_bytes {
                    Err(LinkError::MemoryBound {
                        needed: frame.len(),
                        held,
                        limit: self.max_bytes,
                    })
                } else {
                    self.memory.try_reserve(frame.len()).map_err(|refusal| {
                        LinkError::SharedMemoryBound {
                            needed: refusal.needed,
                            used: refusal.used,
                            limit: refusal.limit,
                        }
                    })
                };
                match charged {
                    Ok(()) => {
                        let len = frame.len();
                        Slot::Frame(frame, len)
                    }
                    Err(err) => {
                        self.held_over_budget += 1;
                        if !self.lossy {
                            return Err(err);
                        }
                        // Given up like a message whose pieces did not all
                        // arrive: settled in turn and counted as lost.
                        Slot::Lost
                    }
                }
            }
            Err(_) => Slot::Lost,
        };
        let (is_frame, charged) = match &slot {
            Slot::Frame(_, charged) => (true, *charged),
            Slot::Lost => (false, 0),
        };
        let pushed = reorder.push(now, msg_id, slot, &mut self.released);
        match pushed {
            Ok(Pushed::Accepted { .. }) => {
                self.held_bytes += charged;
                if is_frame && msg_id != expected_before {
                    self.stats.reordered += 1;
                }
                self.count_behind_gap(msg_id > expected_before, expected_before);
            }
            Ok(Pushed::Duplicate { .. }) => {
                self.memory.release(charged);
                self.stats.duplicates += 1;
            }
            Err(err) => {
                self.memory.release(charged);
                return Err(err.into());
            }
        }
        checked
    }

    /// Release what the timeouts allow at `now` and drop partial messages
    /// that timed out (lossy links), appending deliverable frames to `out`;
    /// on a reliable link, fail if the gap frames wait behind is overdue
    /// ([`LinkError::GapTimeout`]), and keep failing. Call it at
    /// [`next_deadline`](LinkReceiver::next_deadline), after handing
    /// [`receive`](LinkReceiver::receive) what the endpoint delivered by
    /// then.
    ///
    /// An owner held up for a while (its loop blocked, its thread not
    /// scheduled) cannot have seen the gap fill meanwhile, nor let the
    /// provider make progress on it: a call more than the gap timeout past
    /// the deadline starts the gap's clock again instead of failing it.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<Bytes>) -> Result<(), LinkError> {
        self.owner_called(now);
        if self.lossy {
            self.expire(now);
            let given_up = self.sequences_given_up();
            self.expire_due_partial(now);
            if let Some(reorder) = &mut self.reorder {
                reorder.poll(now, &mut self.released);
            }
            self.forget_skipped_partials(given_up);
            self.take_announced(now);
            self.settle_tail(now);
        }
        self.drain(out);
        let result = self.check_gap(now);
        self.note_gap_deadline();
        result
    }

    /// Lossy links: gives the missing sequence up once
    /// [`LinkConfig::skip_distance`] pieces that passed it have been taken
    /// since it became due: up to the first whole frame waiting, or, with
    /// none, that sequence alone.
    fn skip_gap_at_distance(&mut self) {
        let Some(reorder) = self.reorder.as_mut().filter(|_| self.lossy) else {
            return;
        };
        let far_enough = self
            .behind_gap
            .is_some_and(|(gap, pieces)| gap == reorder.expected() && pieces >= self.skip_distance);
        if far_enough {
            if reorder.held() > 0 {
                reorder.skip_first_gap(&mut self.released);
            } else {
                reorder.skip_expected(&mut self.released);
            }
            self.behind_gap = None;
        }
    }

    /// Lossy links, once sequences were given up since the count was
    /// `given_up_before` (by the gap timeout, a piece beyond the window, or
    /// [`LinkConfig::skip_distance`]): their partial messages can no longer
    /// complete (later pieces of them are dropped as late before they reach
    /// the reassembler), so their memory goes back now rather than at the
    /// reassembly timeout. The partials are scanned only then.
    fn forget_skipped_partials(&mut self, given_up_before: u64) {
        if self.sequences_given_up() == given_up_before {
            return;
        }
        if let Some(reorder) = &self.reorder {
            self.reassembler.give_up_below(&(), reorder.expected());
        }
    }

    /// Reliable links: a frame is on its way to the owner in a form it
    /// cannot see (the endpoint is reading its body): the gap frames wait
    /// behind may be that frame, so its clock starts again at `now`.
    pub fn note_frame_in_transit(&mut self, now: Instant) {
        if let (false, Some(reorder)) = (self.lossy, &mut self.reorder) {
            reorder.restart_gap_clock(now);
        }
    }

    /// Lossy, sequenced links: the sender's probe says it sent every
    /// sequence up to `sent_through`. Those beyond the highest seen that
    /// have not come a gap timeout from `now` are then settled as a gap
    /// is (counted lost, a gap timeout later still): without it, a link
    /// whose last frames were lost could not tell them from frames never
    /// sent. A claim beyond the reorder window is taken to the window's
    /// end (a sender whose window was reset may have sent further; its
    /// next probe settles the rest), so a probe settles at most a window
    /// of sequences.
    pub fn note_sent_through(&mut self, sent_through: u64, now: Instant) {
        let Some(reorder) = self.reorder.as_ref().filter(|_| self.lossy) else {
            return;
        };
        let window_end = reorder
            .expected()
            .saturating_add(reorder.config().capacity as u64);
        let through = sent_through.min(window_end.saturating_sub(1));
        let pending = self.announced.map_or(0, |(through, _)| through);
        if through <= self.highest_seen.max(pending) {
            return;
        }
        self.announced = Some((through, now));
    }

    /// Lossy, sequenced links closing on the sender's word that it sent
    /// every sequence up to `sent_through` (see
    /// [`crate::frame::Frame::BestEffortClosed`]): those beyond the
    /// highest seen count in [`Self::unsettled`] now, as lost with the
    /// link. A sender whose window was reset may have sent well past the
    /// window, and nothing arrives any more to show it, so the claim is
    /// taken up to [`CLOSE_CLAIM_WINDOWS`] windows past the next sequence
    /// due: a peer that overstates it inflates this side's count of
    /// losses by no more than that.
    pub fn settle_at_close(&mut self, sent_through: u64) {
        let Some(reorder) = self.reorder.as_ref().filter(|_| self.lossy) else {
            return;
        };
        let span = (reorder.config().capacity as u64).saturating_mul(CLOSE_CLAIM_WINDOWS);
        let bound = reorder.expected().saturating_add(span);
        self.highest_seen = self.highest_seen.max(sent_through.min(bound));
        self.announced = None;
    }

    /// Lossy links: once a gap timeout has passed since the probe of
    /// [`Self::note_sent_through`], its sequences count as seen, so that
    /// [`Self::settle_tail`] gives those still missing up.
    fn take_announced(&mut self, now: Instant) {
        let Some((through, at)) = self.announced else {
            return;
        };
        if at
            .checked_add(self.gap_timeout)
            .is_some_and(|due| now < due)
        {
            return;
        }
        self.announced = None;
        self.highest_seen = self.highest_seen.max(through);
    }

    /// When [`poll`](LinkReceiver::poll) next has something to do; `None`
    /// when nothing is due by time. On a reliable link, the time the gap
    /// frames wait behind fails the link, if nothing fills it first.
    pub fn next_deadline(&self) -> Option<Instant> {
        let gap = self.reorder.as_ref().and_then(ReorderBuffer::next_deadline);
        let announced = self
            .announced
            .and_then(|(_, at)| at.checked_add(self.gap_timeout));
        [
            self.reassembler.next_deadline(),
            gap,
            self.due_partial_deadline(),
            announced,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Reliable links: fail once the gap frames wait behind is overdue, or
    /// a partial message has gone the reassembly timeout without a piece.
    fn check_gap(&mut self, now: Instant) -> Result<(), LinkError> {
        if let Some(failure) = &self.gap_failure {
            return Err(failure.clone());
        }
        if !self.lossy {
            if let Some((msg_id, received, count, waited)) = self.reassembler.stalled(now) {
                let failure = LinkError::PartialTimeout {
                    msg_id,
                    received,
                    count,
                    waited,
                };
                self.stats.gap_failures += 1;
                self.gap_failure = Some(failure.clone());
                return Err(failure);
            }
        }
        let Some(reorder) = &mut self.reorder else {
            return Ok(());
        };
        match reorder.check_gap(now) {
            Ok(()) => Ok(()),
            Err(ReorderError::GapTimeout {
                missing,
                held,
                waited,
            }) => {
                let failure = LinkError::GapTimeout {
                    missing,
                    held,
                    waited,
                };
                self.stats.gap_failures += 1;
                self.gap_failure = Some(failure.clone());
                Err(failure)
            }
            Err(err) => Err(err.into()),
        }
    }

    /// Reliable links: the owner calls at `now`. Past the gap deadline by
    /// more than the timeout, it was held up rather than asleep until the
    /// deadline (it would have been woken for it): the gap gets a fresh
    /// clock.
    fn owner_called(&mut self, now: Instant) {
        let (Some(deadline), Some(reorder)) = (self.gap_deadline, &mut self.reorder) else {
            return;
        };
        if let GapPolicy::FailAfter(limit) = reorder.config().gap_policy {
            if now > deadline + limit {
                reorder.restart_gap_clock(now);
            }
        }
    }

    /// Reliable links: remember the gap deadline the owner was given.
    fn note_gap_deadline(&mut self) {
        if !self.lossy {
            self.gap_deadline = self.reorder.as_ref().and_then(ReorderBuffer::next_deadline);
        }
    }

    fn expire(&mut self, now: Instant) {
        if self.reassembler.partial_messages() > 0 {
            self.reassembler.expire(now);
        }
    }

    /// Pieces of partial message `msg_id` taken so far.
    fn pieces_received(&self, msg_id: u64) -> u32 {
        self.reassembler
            .progress(&(), msg_id)
            .map_or(0, |progress| progress.received)
    }

    /// Lossy links: when the sequence due is a partial message and nothing
    /// waits behind it (what waits has the gap timeout's own clock), the
    /// time it is given up unless a piece of it comes. With the sender's
    /// credits stopped at it, no later message may come to settle it.
    /// Once its last piece has come, the sender has sent all of it (pieces
    /// go in order), so a piece still missing was lost or reordered far
    /// behind: [`LAST_PIECE_WAIT_SHARE`] of the gap timeout tells which.
    fn due_partial_deadline(&self) -> Option<Instant> {
        let reorder = self.reorder.as_ref().filter(|_| self.lossy)?;
        let GapPolicy::SkipAfter(limit) = reorder.config().gap_policy else {
            return None;
        };
        if reorder.held() > 0 || self.reassembler.partial_messages() == 0 {
            return None;
        }
        let due = reorder.expected();
        let progress = self.reassembler.progress(&(), due)?;
        let wait = if progress.last_piece_taken {
            limit / LAST_PIECE_WAIT_SHARE
        } else {
            limit
        };
        Some(progress.last_seen + wait)
    }

    /// Lossy links: gives the sequence due up once its partial message is
    /// past [`Self::due_partial_deadline`].
    fn expire_due_partial(&mut self, now: Instant) {
        if self
            .due_partial_deadline()
            .is_some_and(|deadline| now >= deadline)
        {
            if let Some(reorder) = &mut self.reorder {
                reorder.skip_expected(&mut self.released);
            }
        }
    }

    fn note_seen(&mut self, msg_id: u64) {
        if self.reorder.is_some() {
            self.highest_seen = self.highest_seen.max(msg_id);
        }
    }

    /// Lossy links: a new piece was taken while `due` was the next
    /// sequence; one that `passes` a piece of `due` still missing (of a
    /// later sequence, or a later piece of `due`) counts towards giving
    /// `due` up ([`LinkConfig::skip_distance`]).
    fn count_behind_gap(&mut self, passes: bool, due: u64) {
        if !self.lossy || !passes {
            return;
        }
        let pieces = match self.behind_gap {
            Some((gap, pieces)) if gap == due => pieces + 1,
            _ => 1,
        };
        self.behind_gap = Some((due, pieces));
    }

    /// Sequences the reorder buffer has given up so far.
    fn sequences_given_up(&self) -> u64 {
        self.reorder
            .as_ref()
            .map_or(0, |reorder| reorder.stats().lost)
    }

    /// Lossy, sequenced links: once nothing is held or partial, every
    /// sequence up to the highest seen is either settled or abandoned (its
    /// reassembly given up). Mark the highest as lost, so that the gap
    /// timeout settles the ones before it even though no later frame will
    /// come to trigger it.
    fn settle_tail(&mut self, now: Instant) {
        let Some(reorder) = &mut self.reorder else {
            return;
        };
        if self.lossy
            && reorder.held() == 0
            && self.reassembler.partial_messages() == 0
            && self.highest_seen >= reorder.expected()
        {
            // highest_seen >= expected >= 1, and lossy links skip rather
            // than refuse beyond the window: this cannot fail.
            let _ = reorder.push(now, self.highest_seen, Slot::Lost, &mut self.released);
        }
    }

    fn drain(&mut self, out: &mut Vec<Bytes>) {
        let mut freed = 0;
        for slot in self.released.drain(..) {
            match slot {
                Slot::Frame(frame, charged) => {
                    freed += charged;
                    self.stats.delivered += 1;
                    out.push(frame);
                }
                Slot::Lost => self.marks_released += 1,
            }
        }
        self.held_bytes -= freed;
        self.memory.release(freed);
    }
}

impl Drop for LinkReceiver {
    /// Frames still waiting give their memory back to the shared budget
    /// (the reassembler does the same for partial messages).
    fn drop(&mut self) {
        self.memory.release(self.held_bytes);
    }
}

/// The kind of a message that must be one whole frame: its length prefix
/// matches its length and its kind byte is known.
fn whole_frame_kind(message: &[u8]) -> Result<FrameKind, DecodeError> {
    let total = codec::frame_len(message, &UNBOUNDED)?.ok_or(DecodeError::Truncated {
        needed: FRAME_OVERHEAD,
        available: message.len(),
    })?;
    if total != message.len() {
        return Err(DecodeError::LengthMismatch {
            declared: total - PREFIX_LEN,
            actual: message.len().saturating_sub(PREFIX_LEN),
        });
    }
    // frame_len refuses a zero length, so the kind byte is there.
    let byte = message.get(PREFIX_LEN).copied().unwrap_or(0);
    FrameKind::from_byte(byte).ok_or(DecodeError::UnknownKind(byte))
}

/// A reassembled message must be one whole frame, and not a fragment.
fn check_whole(msg_id: u64, frame: &[u8]) -> Result<(), LinkError> {
    match whole_frame_kind(frame) {
        Ok(FrameKind::Fragment) => Err(LinkError::NestedFragment),
        Ok(_) => Ok(()),
        Err(err) => Err(LinkError::BadFrame {
            msg_id,
            reason: err.to_string(),
        }),
    }
}
