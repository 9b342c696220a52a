//! Fragmentation and reassembly of frames too large for a link.
//!
//! Links with a small message size (EFA DGRAM 8928 B, libfabric udp 1472 B)
//! carry a large encoded frame as [`Fragment`] frames. This module owns the
//! splitting ([`Fragmenter`]) and the bounded, time-driven reassembly
//! ([`Reassembler`]); it does no I/O and reads no clock.
//!
//! # Piece layout
//!
//! A frame of `total_len` bytes is cut into `count` pieces of `chunk` bytes
//! each, the last one holding the rest (1 to `chunk` bytes). Piece `index`
//! starts at `index * chunk`. From any single piece the receiver can thus
//! derive `chunk` and the piece's offset, so every piece is checked on its
//! own and against the pieces seen before it.
//!
//! # Message ids
//!
//! A [`Fragmenter`] numbers messages from 1, increasing. The reassembler
//! remembers, per peer, the ids it finished (completed or given up) within a
//! window, and treats ids below that window as finished: so a duplicated or
//! late piece never yields a frame twice nor holds memory. A peer whose
//! sender restarts its numbering must be given a fresh key (or be removed
//! with [`Reassembler::remove_peer`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::Hash;
use std::time::{Duration, Instant};

use bytes::Bytes;
use thiserror::Error;

use crate::budget::MemoryBudget;
use crate::codec::{DEFAULT_MAX_FRAME, FRAGMENT_OVERHEAD};
use crate::frame::Fragment;
use crate::transport::OutFrame;

/// Why a frame cannot be fragmented.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FragmentError {
    /// The limit leaves no room for data after the fragment header.
    #[error("frame limit of {frame_limit} bytes leaves no room for data (at least {min} needed)")]
    LimitTooSmall {
        /// The limit asked for.
        frame_limit: usize,
        /// The smallest limit that carries one byte of data per piece.
        min: usize,
    },
    /// Fragments address at most `u32::MAX` bytes.
    #[error("frame of {len} bytes is too large to fragment (max {max})")]
    TooLarge {
        /// Length of the frame.
        len: usize,
        /// The most fragments can address.
        max: usize,
    },
    /// A frame of no bytes has nothing to split.
    #[error("cannot fragment an empty frame")]
    Empty,
}

/// Splits encoded frames into [`Fragment`]s, numbering messages.
#[derive(Debug, Clone)]
pub struct Fragmenter {
    next_msg_id: u64,
}

impl Default for Fragmenter {
    fn default() -> Self {
        Self::new()
    }
}

impl Fragmenter {
    /// A fragmenter whose first message id is 1.
    pub fn new() -> Self {
        Fragmenter { next_msg_id: 1 }
    }

    /// The id the next fragmented frame will get.
    pub fn next_msg_id(&self) -> u64 {
        self.next_msg_id
    }

    /// Data bytes per piece when each encoded fragment frame may take
    /// `frame_limit` bytes, or `None` if that leaves no room.
    pub fn data_per_fragment(frame_limit: usize) -> Option<usize> {
        frame_limit
            .checked_sub(FRAGMENT_OVERHEAD)
            .filter(|&room| room > 0)
    }

    /// Whether an encoded frame of `frame_len` bytes must be fragmented.
    pub fn needs_fragmenting(frame_len: usize, frame_limit: usize) -> bool {
        frame_len > frame_limit
    }

    /// Cut a whole encoded frame (prefix included) into pieces whose encoded
    /// `Fragment` frames are each at most `frame_limit` bytes. Any prefix
    /// the link itself adds must already be deducted from `frame_limit`.
    /// Pieces share `frame`'s buffers; only a piece spanning its head and
    /// body is copied.
    pub fn fragment(
        &mut self,
        frame: &OutFrame,
        frame_limit: usize,
    ) -> Result<Fragments, FragmentError> {
        let chunk = Self::data_per_fragment(frame_limit).ok_or(FragmentError::LimitTooSmall {
            frame_limit,
            min: FRAGMENT_OVERHEAD + 1,
        })?;
        let total = frame.len();
        if total == 0 {
            return Err(FragmentError::Empty);
        }
        if total > u32::MAX as usize {
            return Err(FragmentError::TooLarge {
                len: total,
                max: u32::MAX as usize,
            });
        }
        // total fits in u32 and chunk >= 1, so count does too.
        let count = total.div_ceil(chunk) as u32;
        let msg_id = self.next_msg_id;
        self.next_msg_id = self.next_msg_id.wrapping_add(1);
        Ok(Fragments {
            msg_id,
            head: frame.head.clone(),
            body: frame.body.clone(),
            chunk,
            count,
            next: 0,
        })
    }
}

/// The pieces of one frame, in order. See [`Fragmenter::fragment`].
#[derive(Debug, Clone)]
pub struct Fragments {
    msg_id: u64,
    head: Bytes,
    body: Bytes,
    chunk: usize,
    count: u32,
    next: u32,
}

impl Fragments {
    /// The message id shared by the pieces.
    pub fn msg_id(&self) -> u64 {
        self.msg_id
    }

    /// Number of pieces in total.
    pub fn count(&self) -> u32 {
        self.count
    }

    fn piece(&self, start: usize, end: usize) -> Bytes {
        let split = self.head.len();
        if end <= split {
            self.head.slice(start..end)
        } else if start >= split {
            self.body.slice(start - split..end - split)
        } else {
            let mut joined = Vec::with_capacity(end - start);
            joined.extend_from_slice(&self.head[start..]);
            joined.extend_from_slice(&self.body[..end - split]);
            joined.into()
        }
    }
}

impl Iterator for Fragments {
    type Item = Fragment;

    fn next(&mut self) -> Option<Fragment> {
        if self.next >= self.count {
            return None;
        }
        let index = self.next;
        self.next += 1;
        let total = self.head.len() + self.body.len();
        let start = index as usize * self.chunk;
        let end = (start + self.chunk).min(total);
        Some(Fragment {
            msg_id: self.msg_id,
            index,
            count: self.count,
            total_len: total as u32,
            data: self.piece(start, end),
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = (self.count - self.next) as usize;
        (left, Some(left))
    }
}

impl ExactSizeIterator for Fragments {}

/// Bounds of a [`Reassembler`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReassemblyConfig {
    /// Memory reserved for partial messages, all peers together, plus what
    /// the owner holds elsewhere ([`Reassembler::set_held_elsewhere`]): a
    /// partial message reserves its `total_len` plus its piece bitmap when
    /// its first piece arrives.
    pub max_bytes: usize,
    /// Partial messages held at once, all peers together.
    pub max_messages: usize,
    /// Largest reassembled frame; larger `total_len`s are invalid.
    pub max_frame: usize,
    /// A partial message is dropped once no piece of it arrived for this long.
    pub timeout: Duration,
    /// Finished message ids remembered per peer to drop duplicate pieces.
    pub done_window: usize,
}

impl Default for ReassemblyConfig {
    /// 64 MiB and 1024 partial messages in flight, frames up to the codec's
    /// default limit, a 2 s timeout, 4096 remembered ids per peer.
    fn default() -> Self {
        ReassemblyConfig {
            max_bytes: 64 << 20,
            max_messages: 1024,
            max_frame: DEFAULT_MAX_FRAME,
            timeout: Duration::from_secs(2),
            done_window: 4096,
        }
    }
}

impl ReassemblyConfig {
    /// The defaults for frames up to `max_frame`, with room for at least
    /// one of them: a partial message reserves its whole length and its
    /// piece bitmap when its first piece arrives, so a frame larger than
    /// `max_bytes` could never be put together, and a link that must
    /// fragment it would lose it for good. (The bitmap is counted for
    /// pieces of 128 bytes or more; links carry at least 256 per message.)
    pub fn for_frames_up_to(max_frame: usize) -> Self {
        let defaults = ReassemblyConfig::default();
        ReassemblyConfig {
            max_frame,
            max_bytes: defaults.max_bytes.max(Self::reservation_for(max_frame)),
            ..defaults
        }
    }

    /// What putting together a frame of `frame_len` bytes reserves at
    /// most, in pieces of 128 bytes or more: the frame and its piece
    /// bitmap.
    pub fn reservation_for(frame_len: usize) -> usize {
        frame_len.saturating_add(frame_len / 1024 + 64)
    }
}

/// What a [`Reassembler`] has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReassemblyStats {
    /// Whole frames returned.
    pub completed: u64,
    /// Partial messages dropped by the timeout, pushed out of the done
    /// window while still incomplete, or given up by the owner
    /// ([`Reassembler::give_up_below`]).
    pub expired: u64,
    /// New messages refused for lack of memory or message slots.
    pub dropped_over_budget: u64,
    /// Pieces already held, or belonging to a completed message.
    pub duplicates: u64,
    /// Pieces of a message given up (expired or refused) earlier.
    pub late: u64,
    /// Pieces with inconsistent fields.
    pub invalid: u64,
}

/// Why a piece was rejected. Duplicates and late pieces are not errors:
/// they are expected on lossy links and only counted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ReassemblyError {
    /// The piece contradicts itself or earlier pieces of its message.
    #[error("invalid fragment {index}/{count} of message {msg_id}: {reason}")]
    Invalid {
        /// Message the piece claims to belong to.
        msg_id: u64,
        /// The piece's index.
        index: u32,
        /// The piece count it declares.
        count: u32,
        /// What is inconsistent.
        reason: &'static str,
    },
    /// Starting this message would exceed the memory or message budget.
    #[error("no room to reassemble message {msg_id} of {total_len} bytes ({in_flight} bytes in {messages} partial messages held)")]
    OverBudget {
        /// The message refused.
        msg_id: u64,
        /// Its declared total length.
        total_len: u32,
        /// Bytes already reserved by partial messages.
        in_flight: usize,
        /// Partial messages already held.
        messages: usize,
    },
    /// Starting this message would exceed the [`MemoryBudget`] shared with
    /// other holders.
    #[error("no room in the shared budget to reassemble message {msg_id}: {needed} bytes needed, {used} of {limit} in use")]
    SharedBudget {
        /// The message refused.
        msg_id: u64,
        /// Bytes it would reserve.
        needed: usize,
        /// Bytes all holders of the budget had reserved.
        used: usize,
        /// The budget's limit.
        limit: usize,
    },
}

/// Which bound refused a new partial message.
enum Refused {
    Slots,
    Bytes,
    Shared(crate::budget::BudgetRefusal),
}

/// How a message id ended, remembered to classify later pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Finished {
    Completed,
    GivenUp,
}

#[derive(Debug)]
struct Partial {
    buf: Vec<u8>,
    have: Vec<u64>,
    received: u32,
    count: u32,
    total_len: u32,
    chunk: usize,
    reserved: usize,
    last_seen: Instant,
}

impl Partial {
    /// Whether piece `index` is among those taken.
    fn has(&self, index: u32) -> bool {
        let index = index as usize;
        self.have
            .get(index / 64)
            .is_some_and(|word| word & (1u64 << (index % 64)) != 0)
    }
}

/// How far a partial message has come ([`Reassembler::progress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialProgress {
    /// Pieces taken so far.
    pub received: u32,
    /// When the last of them was taken.
    pub last_seen: Instant,
    /// Whether the message's last piece (the highest index) is among them.
    pub last_piece_taken: bool,
    /// Pieces of the message in all.
    pub count: u32,
}

#[derive(Debug, Default)]
struct PeerState {
    partials: HashMap<u64, Partial>,
    done: BTreeMap<u64, Finished>,
    /// Ids below this are finished, whatever `done` says.
    floor: u64,
    /// Ids in `run.0..run.1` finished, one after the other, and are not in
    /// `done`: in-order traffic, the common case, costs no map entry. They
    /// completed, except those in `given_up` (losses: few).
    run: (u64, u64),
    given_up: BTreeSet<u64>,
}

impl PeerState {
    fn finished(&self, msg_id: u64) -> Option<Finished> {
        if msg_id < self.floor {
            return Some(Finished::GivenUp);
        }
        if (self.run.0..self.run.1).contains(&msg_id) {
            return Some(if self.given_up.contains(&msg_id) {
                Finished::GivenUp
            } else {
                Finished::Completed
            });
        }
        self.done.get(&msg_id).copied()
    }

    /// Records `msg_id` as finished `how`, and keeps what is remembered
    /// within `window` ids: the oldest of `done` beyond it, and every id
    /// more than `window` below the run's end, fall below `floor`.
    fn record(&mut self, msg_id: u64, how: Finished, window: usize) {
        // Once the floor has passed the run, the run starts again there,
        // taking in what finished from there on.
        if self.run.1 < self.floor {
            self.run = (self.floor, self.floor);
            self.absorb();
        }
        let extends = msg_id == self.run.1 || self.run.0 == self.run.1;
        match msg_id.checked_add(1) {
            Some(after) if extends => {
                if self.run.0 == self.run.1 {
                    self.run.0 = msg_id;
                }
                self.run.1 = after;
                if how == Finished::GivenUp {
                    self.given_up.insert(msg_id);
                }
                self.absorb();
            }
            _ => {
                self.done.insert(msg_id, how);
                while self.done.len() > window {
                    let Some((oldest, _)) = self.done.pop_first() else {
                        break;
                    };
                    self.floor = self.floor.max(oldest.saturating_add(1));
                }
            }
        }
        self.floor = self.floor.max(self.run.1.saturating_sub(window as u64));
        // Below the floor every id reads as given up anyway.
        while self.given_up.first().is_some_and(|&id| id < self.floor)
            || self.given_up.len() > window
        {
            self.given_up.pop_first();
        }
    }

    /// Ids finished out of order join the run once it reaches them, given
    /// up or completed alike, so a lossy link keeps its run after a loss.
    fn absorb(&mut self) {
        while let Some(&how) = self.done.get(&self.run.1) {
            let Some(after) = self.run.1.checked_add(1) else {
                break;
            };
            self.done.remove(&self.run.1);
            if how == Finished::GivenUp {
                self.given_up.insert(self.run.1);
            }
            self.run.1 = after;
        }
    }
}

/// Reassembles [`Fragment`]s into whole frames with bounded memory.
///
/// Feed every received piece to [`handle_fragment`](Reassembler::handle_fragment)
/// with the current time and the sending peer's key, and call
/// [`expire`](Reassembler::expire) periodically (e.g. every `timeout / 2`).
/// Partial messages reserve their memory from a [`MemoryBudget`] too, and
/// give it back when they complete, are dropped, or the reassembler is.
#[derive(Debug)]
pub struct Reassembler<K> {
    config: ReassemblyConfig,
    peers: HashMap<K, PeerState>,
    in_flight: usize,
    partials: usize,
    /// Bytes the owner holds outside, counted against `max_bytes`.
    elsewhere: usize,
    budget: MemoryBudget,
    stats: ReassemblyStats,
}

/// Where one piece goes, derived from its own fields.
struct Placement {
    chunk: usize,
    offset: usize,
}

fn place(f: &Fragment, max_frame: usize) -> Result<Placement, &'static str> {
    let (total, count, len) = (
        u64::from(f.total_len),
        u64::from(f.count),
        f.data.len() as u64,
    );
    if f.count == 0 {
        return Err("zero piece count");
    }
    if f.index >= f.count {
        return Err("index not below count");
    }
    if f.total_len == 0 {
        return Err("empty message");
    }
    if total > max_frame as u64 {
        return Err("total length over the frame limit");
    }
    if count > total {
        return Err("more pieces than bytes");
    }
    if len == 0 {
        return Err("empty piece");
    }
    let chunk = if count == 1 {
        if len != total {
            return Err("single piece is not the whole message");
        }
        len
    } else if f.index < f.count - 1 {
        // A full piece: the last one must hold 1..=chunk bytes.
        let before_last = len.checked_mul(count - 1).filter(|&b| b < total);
        match before_last {
            Some(b) if total - b <= len => len,
            _ => return Err("piece length inconsistent with total and count"),
        }
    } else {
        if len >= total {
            return Err("last piece as long as the message");
        }
        let rest = total - len;
        if rest % (count - 1) != 0 || len > rest / (count - 1) {
            return Err("last piece inconsistent with total and count");
        }
        rest / (count - 1)
    };
    // chunk <= total <= max_frame and index * chunk < total: both fit usize.
    Ok(Placement {
        chunk: chunk as usize,
        offset: (u64::from(f.index) * chunk) as usize,
    })
}

impl<K: Hash + Eq + Clone> Reassembler<K> {
    /// An empty reassembler within the bounds of `config`.
    pub fn new(config: ReassemblyConfig) -> Self {
        Reassembler::with_budget(config, MemoryBudget::unlimited())
    }

    /// An empty reassembler within the bounds of `config` whose partial
    /// messages also draw from `budget`.
    pub fn with_budget(config: ReassemblyConfig, budget: MemoryBudget) -> Self {
        Reassembler {
            config,
            peers: HashMap::new(),
            in_flight: 0,
            partials: 0,
            elsewhere: 0,
            budget,
            stats: ReassemblyStats::default(),
        }
    }

    /// Bytes the owner holds outside the reassembler (frames waiting for
    /// reordering, say) that count against `max_bytes` with the partial
    /// messages.
    pub fn set_held_elsewhere(&mut self, bytes: usize) {
        self.elsewhere = bytes;
    }

    /// The bounds and timeout in force.
    pub fn config(&self) -> &ReassemblyConfig {
        &self.config
    }

    /// Counters since creation.
    pub fn stats(&self) -> &ReassemblyStats {
        &self.stats
    }

    /// Bytes reserved by partial messages now.
    pub fn in_flight_bytes(&self) -> usize {
        self.in_flight
    }

    /// Partial messages held now.
    pub fn partial_messages(&self) -> usize {
        self.partials
    }

    /// How far `peer`'s message `msg_id` has come while it is partial.
    pub fn progress(&self, peer: &K, msg_id: u64) -> Option<PartialProgress> {
        self.peers
            .get(peer)
            .and_then(|state| state.partials.get(&msg_id))
            .map(|partial| PartialProgress {
                received: partial.received,
                last_seen: partial.last_seen,
                last_piece_taken: partial.has(partial.count.saturating_sub(1)),
                count: partial.count,
            })
    }

    /// Take one piece from `peer`. Returns the whole frame (as the sender
    /// passed it to [`Fragmenter::fragment`]) when this piece completes it.
    pub fn handle_fragment(
        &mut self,
        now: Instant,
        peer: K,
        fragment: Fragment,
    ) -> Result<Option<Bytes>, ReassemblyError> {
        let invalid = |reason| ReassemblyError::Invalid {
            msg_id: fragment.msg_id,
            index: fragment.index,
            count: fragment.count,
            reason,
        };
        let placement = match place(&fragment, self.config.max_frame) {
            Ok(p) => p,
            Err(reason) => {
                self.stats.invalid += 1;
                return Err(invalid(reason));
            }
        };
        let msg_id = fragment.msg_id;
        let state = self.peers.entry(peer.clone()).or_default();
        match state.finished(msg_id) {
            Some(Finished::Completed) => {
                self.stats.duplicates += 1;
                return Ok(None);
            }
            Some(Finished::GivenUp) => {
                self.stats.late += 1;
                return Ok(None);
            }
            None => {}
        }

        // A whole piece completes its message, unless pieces of another
        // form of that message are held (checked below, with the others).
        if fragment.count == 1 && !state.partials.contains_key(&msg_id) {
            self.stats.completed += 1;
            self.finish(&peer, msg_id, Finished::Completed);
            return Ok(Some(fragment.data));
        }

        if !state.partials.contains_key(&msg_id) {
            let bitmap_words = (fragment.count as usize).div_ceil(64);
            let reserved = fragment.total_len as usize + bitmap_words * 8;
            let mut admitted = self.reserve(reserved);
            if admitted.is_err() {
                self.expire(now);
                admitted = self.reserve(reserved);
            }
            if let Err(refused) = admitted {
                self.stats.dropped_over_budget += 1;
                self.finish(&peer, msg_id, Finished::GivenUp);
                return Err(match refused {
                    Refused::Slots | Refused::Bytes => ReassemblyError::OverBudget {
                        msg_id,
                        total_len: fragment.total_len,
                        in_flight: self.in_flight,
                        messages: self.partials,
                    },
                    Refused::Shared(refusal) => ReassemblyError::SharedBudget {
                        msg_id,
                        needed: refusal.needed,
                        used: refusal.used,
                        limit: refusal.limit,
                    },
                });
            }
            let partial = Partial {
                buf: vec![0; fragment.total_len as usize],
                have: vec![0; bitmap_words],
                received: 0,
                count: fragment.count,
                total_len: fragment.total_len,
                chunk: placement.chunk,
                reserved,
                last_seen: now,
            };
            self.in_flight += reserved;
            self.partials += 1;
            // expire() above may have removed this peer's entry if it held
            // nothing else; re-enter it.
            self.peers
                .entry(peer.clone())
                .or_default()
                .partials
                .insert(msg_id, partial);
        }

        let Some(state) = self.peers.get_mut(&peer) else {
            return Ok(None);
        };
        let Some(partial) = state.partials.get_mut(&msg_id) else {
            return Ok(None);
        };
        if partial.count != fragment.count
            || partial.total_len != fragment.total_len
            || partial.chunk != placement.chunk
        {
            self.stats.invalid += 1;
            return Err(invalid("fields differ from earlier pieces"));
        }
        let word = fragment.index as usize / 64;
        let bit = 1u64 << (fragment.index % 64);
        let (Some(have), Some(dest)) = (
            partial.have.get_mut(word),
            partial
                .buf
                .get_mut(placement.offset..placement.offset + fragment.data.len()),
        ) else {
            // place() guarantees both ranges; never trust that blindly.
            self.stats.invalid += 1;
            return Err(invalid("piece outside the message"));
        };
        if *have & bit != 0 {
            self.stats.duplicates += 1;
            return Ok(None);
        }
        *have |= bit;
        dest.copy_from_slice(&fragment.data);
        partial.received += 1;
        partial.last_seen = now;
        if partial.received < partial.count {
            return Ok(None);
        }
        let Some(done) = state.partials.remove(&msg_id) else {
            return Ok(None);
        };
        self.forget(done.reserved);
        self.stats.completed += 1;
        self.finish(&peer, msg_id, Finished::Completed);
        Ok(Some(Bytes::from(done.buf)))
    }

    /// Reserve room for a new partial message of `reserved` bytes, within
    /// the message and byte bounds and the shared budget.
    fn reserve(&mut self, reserved: usize) -> Result<(), Refused> {
        if self.partials >= self.config.max_messages {
            return Err(Refused::Slots);
        }
        let held = self.in_flight.saturating_add(self.elsewhere);
        if held.saturating_add(reserved) > self.config.max_bytes {
            return Err(Refused::Bytes);
        }
        self.budget.try_reserve(reserved).map_err(Refused::Shared)
    }

    /// Account for a partial message of `reserved` bytes going away.
    fn forget(&mut self, reserved: usize) {
        self.in_flight -= reserved;
        self.partials -= 1;
        self.budget.release(reserved);
    }

    /// Record a finished id; slide the peer's window, dropping partials
    /// that fall below it.
    fn finish(&mut self, peer: &K, msg_id: u64, how: Finished) {
        let Some(state) = self.peers.get_mut(peer) else {
            return;
        };
        let floor_before = state.floor;
        state.record(msg_id, how, self.config.done_window);
        let floor = state.floor;
        if floor != floor_before {
            self.give_up_below(peer, floor);
        }
    }

    /// Drop partial messages whose last piece arrived `timeout` or more
    /// before `now`. Returns how many were dropped.
    pub fn expire(&mut self, now: Instant) -> usize {
        let timeout = self.config.timeout;
        let mut dropped = Vec::new();
        let mut freed = 0;
        for (peer, state) in &mut self.peers {
            let stale: Vec<u64> = state
                .partials
                .iter()
                .filter(|(_, p)| now.saturating_duration_since(p.last_seen) >= timeout)
                .map(|(&id, _)| id)
                .collect();
            for id in stale {
                if let Some(p) = state.partials.remove(&id) {
                    freed += p.reserved;
                    dropped.push((peer.clone(), id));
                }
            }
        }
        self.in_flight -= freed;
        self.partials -= dropped.len();
        self.budget.release(freed);
        let n = dropped.len();
        self.stats.expired += n as u64;
        for (peer, id) in dropped {
            self.finish(&peer, id, Finished::GivenUp);
        }
        n
    }

    /// Drop `peer`'s partial messages whose ids are below `floor`, which
    /// can no longer complete (their sequences were given up); counted as
    /// expired. Their ids are not remembered: the caller drops later
    /// pieces below `floor` itself. Returns how many were dropped.
    pub fn give_up_below(&mut self, peer: &K, floor: u64) -> usize {
        let Some(state) = self.peers.get_mut(peer) else {
            return 0;
        };
        let stale: Vec<u64> = state
            .partials
            .keys()
            .copied()
            .filter(|&id| id < floor)
            .collect();
        let freed: Vec<usize> = stale
            .iter()
            .filter_map(|id| state.partials.remove(id).map(|p| p.reserved))
            .collect();
        for &reserved in &freed {
            self.stats.expired += 1;
            self.forget(reserved);
        }
        freed.len()
    }

    /// Forget a peer: its partial messages and remembered ids.
    pub fn remove_peer(&mut self, peer: &K) {
        if let Some(state) = self.peers.remove(peer) {
            for p in state.partials.values() {
                self.forget(p.reserved);
            }
        }
    }

    /// The partial message whose last piece is oldest, if that was
    /// `timeout` or more before `now`: its id, pieces received and
    /// expected, and how long it went without one.
    pub fn stalled(&self, now: Instant) -> Option<(u64, u32, u32, Duration)> {
        self.peers
            .values()
            .flat_map(|s| s.partials.iter())
            .map(|(&id, p)| (id, p, now.saturating_duration_since(p.last_seen)))
            .filter(|(_, _, waited)| *waited >= self.config.timeout)
            .max_by_key(|(_, _, waited)| *waited)
            .map(|(id, p, waited)| (id, p.received, p.count, waited))
    }

    /// The earliest time at which [`expire`](Reassembler::expire) would drop
    /// something, if anything is held.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.peers
            .values()
            .flat_map(|s| s.partials.values())
            .map(|p| p.last_seen + self.config.timeout)
            .min()
    }
}

impl<K> Drop for Reassembler<K> {
    /// Partial messages still held give their memory back to the budget.
    fn drop(&mut self) {
        self.budget.release(self.in_flight);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In-order ids stay a run; ids finished out of order, given up or
    /// skipped join it or fall below the window; memory stays bounded.
    #[test]
    fn finished_ids_keep_a_run_and_a_bounded_window() {
        let window = 8;
        let mut state = PeerState::default();
        for id in 1..=50 {
            state.record(id, Finished::Completed, window);
        }
        assert!(state.done.is_empty());
        assert_eq!(state.finished(50), Some(Finished::Completed));
        assert_eq!(state.finished(51), None);
        assert_eq!(
            state.floor,
            51 - window as u64,
            "older ids count as finished"
        );
        assert_eq!(state.finished(3), Some(Finished::GivenUp));

        // 51 is late: 52..=55 wait in the map, then 51, given up, joins
        // the run and brings them along.
        for id in 52..=55 {
            state.record(id, Finished::Completed, window);
        }
        assert_eq!(state.done.len(), 4);
        state.record(51, Finished::GivenUp, window);
        assert!(state.done.is_empty());
        assert_eq!(state.run.1, 56);
        assert_eq!(state.finished(51), Some(Finished::GivenUp));
        assert_eq!(state.finished(52), Some(Finished::Completed));

        // 56 never finishes (a lossy link skipped it): later ids fill the
        // map up to the window, the floor passes 56, and the run starts
        // again from the floor.
        for id in 57..=200 {
            state.record(id, Finished::Completed, window);
            assert!(state.done.len() <= window);
        }
        assert!(state.floor > 56);
        assert!(state.done.is_empty(), "the run caught up: {:?}", state.done);
        assert_eq!(state.run.1, 201);
        assert_eq!(state.finished(200), Some(Finished::Completed));

        // The last id there is cannot end a run: it is remembered alone.
        state.record(u64::MAX, Finished::Completed, window);
        assert_eq!(state.finished(u64::MAX), Some(Finished::Completed));
    }

    fn frag(msg_id: u64, index: u32, count: u32, total_len: u32, len: usize) -> Fragment {
        Fragment {
            msg_id,
            index,
            count,
            total_len,
            data: Bytes::from(vec![1u8; len]),
        }
    }

    #[test]
    fn placement_rules() {
        let max = 1 << 20;
        // 10 bytes as 4+4+2
        assert_eq!(place(&frag(1, 0, 3, 10, 4), max).map(|p| p.offset), Ok(0));
        assert_eq!(place(&frag(1, 2, 3, 10, 2), max).map(|p| p.offset), Ok(8));
        assert_eq!(place(&frag(1, 2, 3, 10, 2), max).map(|p| p.chunk), Ok(4));
        assert!(place(&frag(1, 0, 3, 10, 3), max).is_err()); // 3+3 leaves 4 > 3
        assert!(place(&frag(1, 0, 3, 10, 5), max).is_err()); // 5+5 leaves 0
        assert!(place(&frag(1, 2, 3, 10, 3), max).is_err()); // 7 not divisible by 2
        assert!(place(&frag(1, 3, 3, 10, 2), max).is_err());
        assert!(place(&frag(1, 0, 0, 10, 2), max).is_err());
        assert!(place(&frag(1, 0, 1, 10, 9), max).is_err());
        assert!(place(&frag(1, 0, 2, u32::MAX, 1 << 20), max).is_err());
        assert!(place(&frag(1, 0, u32::MAX, u32::MAX, 1), usize::MAX).is_ok());
    }

    #[test]
    fn a_frame_at_the_limit_can_be_put_together() {
        let max_frame = (100 << 20) + 4096;
        let mut r = Reassembler::new(ReassemblyConfig::for_frames_up_to(max_frame));
        let t0 = Instant::now();
        let total = max_frame as u32;
        let piece = 8192;
        let count = total.div_ceil(piece);
        assert_eq!(
            r.handle_fragment(t0, 1, frag(1, 0, count, total, piece as usize)),
            Ok(None),
            "the first piece of the largest frame is taken"
        );
        assert_eq!(r.partial_messages(), 1);
        // The defaults stay where frames are smaller.
        assert_eq!(
            ReassemblyConfig::for_frames_up_to(1 << 20).max_bytes,
            ReassemblyConfig::default().max_bytes
        );
    }

    #[test]
    fn a_whole_piece_does_not_complete_a_message_partly_held() {
        let mut r = Reassembler::new(ReassemblyConfig::default());
        let t0 = Instant::now();
        assert_eq!(r.handle_fragment(t0, 1, frag(1, 0, 2, 10, 5)), Ok(None));
        assert!(
            matches!(
                r.handle_fragment(t0, 1, frag(1, 0, 1, 5, 5)),
                Err(ReassemblyError::Invalid { .. })
            ),
            "a message cannot be both in one piece and in two"
        );
        assert_eq!(r.stats().completed, 0);
    }

    #[test]
    fn partials_draw_from_the_shared_budget_and_give_it_back() {
        let budget = MemoryBudget::new(100);
        let config = ReassemblyConfig {
            timeout: Duration::from_millis(10),
            ..ReassemblyConfig::default()
        };
        let mut r = Reassembler::with_budget(config.clone(), budget.clone());
        let t0 = Instant::now();
        // 40 bytes in two pieces reserve 40 plus an 8-byte bitmap.
        assert_eq!(r.handle_fragment(t0, 1, frag(1, 0, 2, 40, 20)), Ok(None));
        assert_eq!(budget.used(), 48);
        assert_eq!(
            r.handle_fragment(t0, 2, frag(1, 0, 2, 60, 30)),
            Err(ReassemblyError::SharedBudget {
                msg_id: 1,
                needed: 68,
                used: 48,
                limit: 100
            })
        );
        // Completion, expiry and dropping each give their share back.
        assert!(r
            .handle_fragment(t0, 1, frag(1, 1, 2, 40, 20))
            .unwrap()
            .is_some());
        assert_eq!(budget.used(), 0);
        r.handle_fragment(t0, 1, frag(2, 0, 2, 40, 20)).unwrap();
        r.handle_fragment(t0, 3, frag(1, 0, 2, 40, 20)).unwrap();
        assert_eq!(budget.used(), 96);
        assert_eq!(r.expire(t0 + Duration::from_millis(10)), 2);
        assert_eq!(budget.used(), 0);
        let mut other = Reassembler::with_budget(config, budget.clone());
        other.handle_fragment(t0, 1, frag(1, 0, 2, 40, 20)).unwrap();
        assert_eq!(budget.used(), 48);
        drop(other);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn straddling_piece_is_joined() {
        let out = OutFrame {
            head: Bytes::from_static(b"abcdef"),
            body: Bytes::from_static(b"ghij"),
        };
        let limit = FRAGMENT_OVERHEAD + 4;
        let pieces: Vec<_> = Fragmenter::new().fragment(&out, limit).unwrap().collect();
        let datas: Vec<&[u8]> = pieces.iter().map(|f| &f.data[..]).collect();
        assert_eq!(datas, vec![&b"abcd"[..], b"efgh", b"ij"]);
        assert!(pieces.iter().all(|f| f.count == 3 && f.total_len == 10));
    }
}
