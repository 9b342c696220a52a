//! The byte layout of every buffer a fabric endpoint posts, and the small
//! endpoint header that names the sender and authenticates the message.
//!
//! ```text
//! | provider prefix | ver | tag  | flags | alen | sender address | link id | counter | efabus frames (u32 LE len + len bytes)... |
//! ^ pointer passed to fi_send/fi_recv                                8 B LE    8 B LE
//!                   ^ payload starts here, the tag's 16 bytes after the version
//! ```
//!
//! - With `FI_MSG_PREFIX` the provider owns the first `msg_prefix_size`
//!   bytes; the pointer posted is the start of the prefix and every length
//!   posted includes it. Received completions report lengths that include
//!   it too, and a completion no longer than the prefix is a provider packet
//!   without application data (fi_getinfo(3)), skipped.
//! - The endpoint header carries the sender's own `fi_getname` bytes (not
//!   every provider reports a source address: `tcp;ofi_rxm` in 1.17 offers
//!   no FI_SOURCE), the id the *receiver* gave the link, a counter the
//!   sender raises with every message, and a tag: GMAC's (AES-256-GCM
//!   with nothing to encrypt), under the link's key for this direction
//!   with the version and the counter as the nonce, over every byte after
//!   the tag, from the flags to the last frame (see [`tag`]; the message
//!   itself is not encrypted). The version byte is bound through the
//!   nonce rather than covered, and a receiver takes only its own. A
//!   receiver finds the link by its id, checks the address and the tag,
//!   and refuses a counter it has seen (see `ReplayWindow`); nothing in a
//!   message is trusted before that.
//! - A message carries one or more whole frames back to back (a sender
//!   packs the frames it is handed between two polls, up to the peer's
//!   frame limit); their own length prefixes must account for the rest of
//!   the message exactly.
//!
//! - A message with [`CONTROL_FLAG`] set in its flags byte carries the
//!   endpoint's own frames, never handed to or taken from its caller (whose
//!   frames may hold any bytes): rendezvous descriptors ([`RmaDescriptor`]:
//!   the id, remote address, key and length of a registered body, then the
//!   frame's head) and rendezvous dones ([`rma_done`]: the id whose read
//!   finished, so the sender releases the body). The flag is under the tag
//!   like the rest of the header; no other flag is defined, and a message
//!   with one is refused.
//!
//! The limits count the prefix against the provider's `max_msg_size` and
//! `inject_size` even though fi_getinfo(3) says the prefix is not counted:
//! that costs at most one prefix of each limit and is right whichever way a
//! provider reads the rule.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use bytes::Bytes;
use efabus_core::codec::PREFIX_LEN;
use efabus_core::secret::constant_time_eq;
use efabus_core::transport::OutFrame;

/// Version of the endpoint header (6: the tag comes first and is GMAC's
/// over everything after it, see [`tag`]).
pub const HEADER_VERSION: u8 = 6;
/// Set in the flags byte of a message of the endpoint's own frames.
pub const CONTROL_FLAG: u8 = 0x80;
/// Bytes of the authenticator: its tag.
pub const TAG_LEN: usize = 16;
/// Where the tag lies in the header: after the version byte.
pub const TAG_AT: usize = 1;
/// Where the flags byte lies in the header: right after the tag, which
/// covers it and everything after it.
pub const FLAGS_AT: usize = TAG_AT + TAG_LEN;
/// Bytes of the endpoint header before the sender address: version, tag,
/// flags and the address's length.
pub const HEADER_FIXED: usize = FLAGS_AT + 2;
/// Longest sender address a header carries (its length is one byte).
pub const MAX_ADDR_LEN: usize = u8::MAX as usize;
/// Bytes of the endpoint header after the sender address: link id and
/// counter.
pub const HEADER_IDS: usize = 8 + 8;
/// Slots start on this boundary (a cache line), so prefixes and payloads
/// never share lines between slots.
pub const SLOT_ALIGN: usize = 64;

/// Sizes of one posted buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferLayout {
    /// Bytes reserved for the provider in front of the payload.
    pub prefix: usize,
    /// Bytes after the prefix: endpoint header plus frame.
    pub payload: usize,
}

/// What a received buffer holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Received<'a> {
    /// A provider packet with no application data (length <= prefix).
    ProviderOnly,
    /// A message of whole frames, not authenticated yet.
    Frames(Message<'a>),
}

/// A received message as its header describes it. Nothing in it is
/// trusted until [`Message::is_authentic`] said so under the link's key.
#[derive(Debug, PartialEq, Eq)]
pub struct Message<'a> {
    /// The address the sender wrote.
    pub sender: &'a [u8],
    /// The id the receiver gave the link.
    pub link_id: u64,
    /// The sender's message counter.
    pub counter: u64,
    /// The bytes the tag covers: all after it, frames included.
    pub covered: &'a [u8],
    /// The frames are the endpoint's own ([`CONTROL_FLAG`]).
    pub control: bool,
    pub tag: &'a [u8],
    /// Whole frames, back to back (checked); [`frames`] splits them.
    pub frames: &'a [u8],
}

impl Message<'_> {
    /// Whether the tag is the one `key` gives this message.
    pub fn is_authentic(&self, key: &TagKey) -> bool {
        match tag(key, self.counter, &[self.covered]) {
            // The time taken tells a forger nothing of where it went wrong.
            Some(expected) => constant_time_eq(&expected, self.tag),
            None => false,
        }
    }
}

/// The key that tags one direction of a link: AES-256-GCM under the
/// link's 32-byte key for that direction, its key schedule prepared once.
pub struct TagKey(LessSafeKey);

impl TagKey {
    pub fn new(key: &[u8; 32]) -> TagKey {
        TagKey(LessSafeKey::new(
            UnboundKey::new(&AES_256_GCM, key).expect("AES-256 takes a 32-byte key"),
        ))
    }
}

impl std::fmt::Debug for TagKey {
    /// Nothing of the key reaches a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TagKey")
    }
}

/// Send keys an endpoint remembers (see [`UsedSendKeys`]).
pub const SEND_KEYS_KEPT: usize = 4096;

/// Fingerprints of the send keys an endpoint's latest links took, so that
/// none is taken again with its counter starting afresh: GCM must never
/// see one nonce twice under a key. Keys come from a fresh X25519
/// exchange for every session, so a repeat could only be a caller's bug,
/// which would repeat a recent link's (a retry of one that failed to
/// open, say); the oldest of [`SEND_KEYS_KEPT`] are forgotten, so that
/// this stays within about 300 KiB over a long life.
#[derive(Default)]
pub struct UsedSendKeys {
    seen: std::collections::HashSet<[u8; 16]>,
    order: std::collections::VecDeque<[u8; 16]>,
}

impl UsedSendKeys {
    /// Records `key`; false when it was recorded before.
    pub fn take(&mut self, key: &[u8; 32]) -> bool {
        let mut fingerprint = [0u8; 16];
        fingerprint.copy_from_slice(&blake3::hash(key).as_bytes()[..16]);
        if !self.seen.insert(fingerprint) {
            return false;
        }
        self.order.push_back(fingerprint);
        if self.order.len() > SEND_KEYS_KEPT {
            if let Some(oldest) = self.order.pop_front() {
                self.seen.remove(&oldest);
            }
        }
        true
    }
}

/// Scratch bytes kept per thread for tagging, beyond which they are freed.
const SCRATCH_KEPT: usize = 1 << 20;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The tag of a message: GMAC under the link's key for its direction,
/// that is AES-256-GCM with nothing to encrypt and the message's bytes as
/// its associated data, with the header version and the message's counter
/// as the nonce (its first byte and its last 8, little endian; the rest
/// zero). `parts` are those bytes in order: one slice where the message
/// lies whole (a received one, one sent from its slot), or its slot's
/// bytes and a body sent from elsewhere, which are copied into a scratch
/// buffer of the thread's first (GCM takes its associated data in one
/// piece). `None` only for input GCM cannot take, which no message comes
/// near.
///
/// The tag is E_K(nonce, 1) xor GHASH_H(bytes, lengths): whatever the
/// bytes, even ones a forger chose or read, a forgery under a counter not
/// used yet means guessing a fresh AES output, and under a used one
/// knowing H, each with odds of about (blocks + 1) / 2^128 per try. Two
/// messages tagged under one counter would give H away, and with it
/// forgeries under every counter whose tag was seen and not yet taken by
/// the receiver: the counter rises with every message of a link, a link's
/// keys serve that link alone (see `LinkKeys`), and an endpoint refuses a
/// send key one of its latest links had ([`UsedSendKeys`]). GHASH ends
/// with the bytes' length, and where the frames start is read from the
/// covered header (the address's length), so no other reading of the
/// same bytes carries the same tag.
///
/// Keyed BLAKE3, the tag before GCM, needed no nonce; GCM was taken for
/// its speed, and GMAC for needing neither an AES pass over the bytes nor
/// (but for a body sent from elsewhere) a copy of them. A packed message
/// of 10,000 bytes took BLAKE3 3.8 us to seal, GCM over a scratch copy
/// 1.24 under ring and 0.89 under AWS-LC (512-bit VAES and carry-less
/// multiplication here), and takes GMAC 0.43 (`cargo bench --bench codec
/// -- fabric_tag`).
pub fn tag(key: &TagKey, counter: u64, parts: &[&[u8]]) -> Option<[u8; TAG_LEN]> {
    let mut nonce = [0u8; NONCE_LEN];
    nonce[0] = HEADER_VERSION;
    nonce[NONCE_LEN - 8..].copy_from_slice(&counter.to_le_bytes());
    let gmac = |bytes: &[u8]| {
        key.0
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(bytes),
                &mut [],
            )
            .ok()
            .map(|tag| {
                let mut out = [0u8; TAG_LEN];
                out.copy_from_slice(tag.as_ref());
                out
            })
    };
    let mut filled = parts.iter().filter(|part| !part.is_empty());
    match (filled.next(), filled.next()) {
        (None, _) => gmac(&[]),
        (Some(whole), None) => gmac(whole),
        (Some(_), Some(_)) => SCRATCH.with_borrow_mut(|scratch| {
            scratch.clear();
            // Exactly: grown by doubling, a message near the kept bound
            // would leave the scratch above it and have it freed every time.
            scratch.reserve_exact(parts.iter().map(|part| part.len()).sum());
            for part in parts {
                scratch.extend_from_slice(part);
            }
            let sealed = gmac(scratch);
            if scratch.capacity() > SCRATCH_KEPT {
                *scratch = Vec::new();
            }
            sealed
        }),
    }
}

/// The counters of one link's incoming messages seen lately: a counter is
/// taken once, and one older than the window is refused, so a message
/// recorded on the wire cannot be played again. Messages of one link may
/// arrive out of order (RDM without ordering, DGRAM; injected messages
/// overtaking a large one), but a sender has at most its credit window of
/// pieces (at most 4096, the reorder window) beyond what the receiver has
/// delivered, plus the few credits it sends itself, so a genuine message
/// is never older than the window.
#[derive(Debug, Clone)]
pub struct ReplayWindow {
    /// Highest counter taken (0: none yet; counters start at 1).
    highest: u64,
    /// A ring of marks: counter `c` is bit `c % 64` of word
    /// `(c / 64) % REPLAY_WORDS`. Moving `highest` on clears only the
    /// words it enters, so taking a new counter costs no shift of the
    /// whole window.
    seen: [u64; REPLAY_WORDS],
}

const REPLAY_WORDS: usize = 80;
/// Counters the window remembers below the highest: all of the ring but
/// the word being filled.
pub const REPLAY_WINDOW: u64 = ((REPLAY_WORDS - 1) * 64) as u64;

impl Default for ReplayWindow {
    fn default() -> Self {
        ReplayWindow {
            highest: 0,
            seen: [0; REPLAY_WORDS],
        }
    }
}

impl ReplayWindow {
    /// Whether `counter` is new; if so, it is taken.
    pub fn take(&mut self, counter: u64) -> bool {
        if counter == 0 {
            return false;
        }
        if counter > self.highest {
            self.advance_to(counter);
        } else if self.highest - counter >= REPLAY_WINDOW {
            return false;
        }
        let word = ((counter / 64) % REPLAY_WORDS as u64) as usize;
        let bit = 1u64 << (counter % 64);
        let fresh = self.seen[word] & bit == 0;
        self.seen[word] |= bit;
        fresh
    }

    /// Makes `counter` the highest, clearing the words entered on the way
    /// (the word holding the old highest keeps its marks).
    fn advance_to(&mut self, counter: u64) {
        let (from, to) = (self.highest / 64, counter / 64);
        if to - from >= REPLAY_WORDS as u64 {
            self.seen = [0; REPLAY_WORDS];
        } else {
            for word in from + 1..=to {
                self.seen[(word % REPLAY_WORDS as u64) as usize] = 0;
            }
        }
        self.highest = counter;
    }
}

/// Why a received buffer was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("completion length {len} exceeds the {cap}-byte buffer")]
    Overrun { len: usize, cap: usize },
    #[error("message of {len} bytes is too short for the endpoint header")]
    Short { len: usize },
    #[error("unknown endpoint header version {0}")]
    Version(u8),
    #[error("unknown endpoint header flags {0:#04x}")]
    Flags(u8),
    #[error("sender address of {addr_len} bytes overruns a {len}-byte message")]
    Address { addr_len: usize, len: usize },
    #[error("frame length prefix says {declared} bytes but {actual} follow")]
    FrameLength { declared: usize, actual: usize },
    #[error("no frame follows the endpoint header")]
    NoFrame,
    #[error("sender address of {0} bytes does not fit the header")]
    AddressTooLong(usize),
}

/// Kind byte of a rendezvous descriptor frame (after the length prefix),
/// in a control message.
pub const RMA_DESCRIPTOR_KIND: u8 = 0xf0;
/// Kind byte of a rendezvous done frame, in a control message.
pub const RMA_DONE_KIND: u8 = 0xf1;
/// Kind byte of a rendezvous fence frame, in a control message: sent by a
/// transfer's sender when the reader's done arrives, where the provider
/// serves reads in order with later sends (see `LinkInfo::fenced_release`);
/// the reader ignores it.
pub const RMA_FENCE_KIND: u8 = 0xf2;
/// Bytes of a descriptor frame before the frame head it carries.
pub const RMA_DESCRIPTOR_FIXED: usize = PREFIX_LEN + 1 + 4 * 8;
const RMA_DONE_LEN: usize = PREFIX_LEN + 1 + 8;

/// The kind byte of an encoded frame.
pub fn frame_kind(frame: &[u8]) -> Option<u8> {
    frame.get(PREFIX_LEN).copied()
}

/// A frame's body, registered for one-sided reads, as the descriptor sent
/// in its place names it: the receiver reads `body_len` bytes at `addr`
/// under `key` and puts them after `head` (the frame's first bytes, sent
/// inline) to rebuild the frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RmaDescriptor {
    /// The sender's id for this transfer, echoed in the done frame.
    pub id: u64,
    /// Address of the body in the sender's registration, as the provider
    /// addresses it (virtual address or offset).
    pub addr: u64,
    pub key: u64,
    pub body_len: u64,
}

impl RmaDescriptor {
    /// The descriptor frame for a frame whose first bytes are `head`.
    pub fn encode(&self, head: &[u8]) -> Bytes {
        let len = RMA_DESCRIPTOR_FIXED + head.len();
        let mut out = Vec::with_capacity(len);
        out.extend_from_slice(&((len - PREFIX_LEN) as u32).to_le_bytes());
        out.push(RMA_DESCRIPTOR_KIND);
        for word in [self.id, self.addr, self.key, self.body_len] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out.extend_from_slice(head);
        out.into()
    }

    /// Reads a descriptor frame (prefix included): the descriptor and the
    /// frame head it carries. `None` when it is not one or is cut short.
    pub fn decode(frame: &[u8]) -> Option<(RmaDescriptor, &[u8])> {
        if frame.len() < RMA_DESCRIPTOR_FIXED || frame[PREFIX_LEN] != RMA_DESCRIPTOR_KIND {
            return None;
        }
        let word = |i: usize| {
            let at = PREFIX_LEN + 1 + 8 * i;
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&frame[at..at + 8]);
            u64::from_le_bytes(bytes)
        };
        let descriptor = RmaDescriptor {
            id: word(0),
            addr: word(1),
            key: word(2),
            body_len: word(3),
        };
        Some((descriptor, &frame[RMA_DESCRIPTOR_FIXED..]))
    }
}

/// The done frame for rendezvous `id`.
pub fn rma_done(id: u64) -> Bytes {
    id_frame(RMA_DONE_KIND, id)
}

/// The id a done frame (prefix included) names.
pub fn rma_done_id(frame: &[u8]) -> Option<u64> {
    id_of(RMA_DONE_KIND, frame)
}

/// The fence frame for rendezvous `id`.
pub fn rma_fence(id: u64) -> Bytes {
    id_frame(RMA_FENCE_KIND, id)
}

/// The id a fence frame (prefix included) names.
pub fn rma_fence_id(frame: &[u8]) -> Option<u64> {
    id_of(RMA_FENCE_KIND, frame)
}

/// A frame of `kind` carrying a rendezvous id alone.
fn id_frame(kind: u8, id: u64) -> Bytes {
    let mut out = Vec::with_capacity(RMA_DONE_LEN);
    out.extend_from_slice(&((RMA_DONE_LEN - PREFIX_LEN) as u32).to_le_bytes());
    out.push(kind);
    out.extend_from_slice(&id.to_le_bytes());
    out.into()
}

/// The id an [`id_frame`] of `kind` (prefix included) carries.
fn id_of(kind: u8, frame: &[u8]) -> Option<u64> {
    if frame.len() != RMA_DONE_LEN || frame[PREFIX_LEN] != kind {
        return None;
    }
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&frame[PREFIX_LEN + 1..]);
    Some(u64::from_le_bytes(bytes))
}

impl BufferLayout {
    /// A layout with the provider's prefix and the payload bytes after it.
    pub fn new(prefix: usize, payload: usize) -> Self {
        BufferLayout { prefix, payload }
    }

    /// The payload a provider allows: `max_msg_size` less the prefix,
    /// capped by `cap` (efabus's buffer size for providers without a
    /// practical limit, such as RDM's 2^64-1).
    pub fn payload_for(max_msg_size: u64, prefix: usize, cap: usize) -> usize {
        let max = usize::try_from(max_msg_size).unwrap_or(usize::MAX);
        max.saturating_sub(prefix).min(cap)
    }

    /// Bytes from one slot's start to the next.
    pub fn slot_stride(&self) -> usize {
        // Saturating: `efabus caps` lays out what any dump says.
        self.recv_len()
            .div_ceil(SLOT_ALIGN)
            .saturating_mul(SLOT_ALIGN)
    }

    /// Bytes posted for a receive: the prefix and the whole payload.
    pub fn recv_len(&self) -> usize {
        self.prefix.saturating_add(self.payload)
    }

    /// Endpoint header bytes for a sender address of `addr_len` bytes.
    pub const fn header_len(addr_len: usize) -> usize {
        HEADER_FIXED + addr_len + HEADER_IDS
    }

    /// Largest frame (length prefix included) a sender with an address of
    /// `addr_len` bytes can put in one message.
    pub fn max_frame(&self, addr_len: usize) -> usize {
        self.payload.saturating_sub(Self::header_len(addr_len))
    }

    /// Largest frame an endpoint whose own address has `addr_len` bytes
    /// sends and takes. Every message carries its sender's address, and a
    /// posted receive must hold the largest a peer sends. Binary addresses
    /// of one format all have the same length (the address vector takes
    /// no other); text ones differ between peers (`shm` names an endpoint
    /// after its process, user and index), and a frame at the smaller
    /// side's limit from a peer with a longer name would overrun the
    /// receive (libfabric 1.17's `shm` hung the receiver in its poll on
    /// such a message of 16 KiB). So with text
    /// addresses frames are limited as if the sender's were the longest a
    /// header carries.
    pub fn frame_limit(&self, addr_len: usize, text_addresses: bool) -> usize {
        self.max_frame(if text_addresses {
            MAX_ADDR_LEN
        } else {
            addr_len
        })
    }

    /// Bytes posted to send `frame_len` bytes of frame.
    pub fn send_len(&self, addr_len: usize, frame_len: usize) -> usize {
        self.prefix + Self::header_len(addr_len) + frame_len
    }

    /// Whether a message of `posted_len` bytes (prefix, header and frames)
    /// may go with `fi_inject`: only when the provider allows inject at all
    /// and the whole posted length fits its `inject_size`.
    pub fn fits_inject(inject_size: usize, posted_len: usize) -> bool {
        inject_size > 0 && posted_len <= inject_size
    }

    /// Writes the header (its tag left for [`seal`](Self::seal)) and
    /// frame after the prefix of `slot` and returns the length to post. The
    /// prefix bytes are left as they are: they belong to the provider. The
    /// caller has checked the frame against [`max_frame`](Self::max_frame);
    /// a slot too small is a bug, reported as an error rather than a panic.
    pub fn encode(
        &self,
        slot: &mut [u8],
        sender: &[u8],
        link: (u64, u64),
        frame: &OutFrame,
    ) -> Result<usize, LayoutError> {
        let (link_id, counter) = link;
        let addr_len =
            u8::try_from(sender.len()).map_err(|_| LayoutError::AddressTooLong(sender.len()))?;
        let total = self.send_len(sender.len(), frame.len());
        if total > slot.len() || total > self.prefix + self.payload {
            return Err(LayoutError::Overrun {
                len: total,
                cap: slot.len().min(self.prefix + self.payload),
            });
        }
        let mut at = self.prefix;
        slot[at] = HEADER_VERSION;
        slot[at + FLAGS_AT] = 0;
        slot[at + FLAGS_AT + 1] = addr_len;
        at += HEADER_FIXED;
        slot[at..at + sender.len()].copy_from_slice(sender);
        at += sender.len();
        slot[at..at + 8].copy_from_slice(&link_id.to_le_bytes());
        slot[at + 8..at + 16].copy_from_slice(&counter.to_le_bytes());
        at += HEADER_IDS;
        slot[at..at + frame.head.len()].copy_from_slice(&frame.head);
        at += frame.head.len();
        slot[at..at + frame.body.len()].copy_from_slice(&frame.body);
        Ok(total)
    }

    /// Appends `frame` after the `used` bytes already encoded in `slot`
    /// (by [`encode`](Self::encode) and earlier appends) and returns the new
    /// length to post; `Overrun` when it does not fit.
    pub fn append(
        &self,
        slot: &mut [u8],
        used: usize,
        frame: &OutFrame,
    ) -> Result<usize, LayoutError> {
        let total = used + frame.len();
        let cap = slot.len().min(self.prefix + self.payload);
        if total > cap {
            return Err(LayoutError::Overrun { len: total, cap });
        }
        slot[used..used + frame.head.len()].copy_from_slice(&frame.head);
        slot[used + frame.head.len()..total].copy_from_slice(&frame.body);
        Ok(total)
    }

    /// Marks the message encoded in `slot` as carrying the endpoint's own
    /// frames ([`CONTROL_FLAG`]), before it is sealed.
    pub fn mark_control(&self, slot: &mut [u8]) {
        if let Some(flags) = slot.get_mut(self.prefix + FLAGS_AT) {
            *flags |= CONTROL_FLAG;
        }
    }

    /// Writes the tag of the `len` bytes encoded in `slot`, followed on
    /// the wire by `body` (sent from where it lies), under `key`.
    pub fn seal(&self, slot: &mut [u8], len: usize, body: &[u8], key: &TagKey) {
        let start = self.prefix;
        let Some(&addr_len) = slot.get(start + FLAGS_AT + 1) else {
            return;
        };
        let counter_at = start + Self::header_len(usize::from(addr_len)) - 8;
        if len < counter_at + 8 || len > slot.len() {
            return;
        }
        let mut counter = [0u8; 8];
        counter.copy_from_slice(&slot[counter_at..counter_at + 8]);
        // A message that cannot be tagged (none can: GCM takes far more
        // than any message) goes with a tag of zeros, which no receiver
        // accepts.
        let value = tag(
            key,
            u64::from_le_bytes(counter),
            &[&slot[start + FLAGS_AT..len], body],
        )
        .unwrap_or_default();
        slot[start + TAG_AT..start + FLAGS_AT].copy_from_slice(&value);
    }

    /// Reads a received buffer whose completion reported `len` bytes
    /// (prefix included).
    pub fn decode<'a>(&self, slot: &'a [u8], len: usize) -> Result<Received<'a>, LayoutError> {
        let cap = slot.len().min(self.prefix + self.payload);
        if len > cap {
            return Err(LayoutError::Overrun { len, cap });
        }
        if len <= self.prefix {
            return Ok(Received::ProviderOnly);
        }
        let message = &slot[self.prefix..len];
        if message.len() < HEADER_FIXED {
            return Err(LayoutError::Short { len: message.len() });
        }
        if message[0] != HEADER_VERSION {
            return Err(LayoutError::Version(message[0]));
        }
        let flags = message[FLAGS_AT];
        if flags & !CONTROL_FLAG != 0 {
            return Err(LayoutError::Flags(flags));
        }
        let control = flags & CONTROL_FLAG != 0;
        let addr_len = usize::from(message[FLAGS_AT + 1]);
        let rest = &message[HEADER_FIXED..];
        if addr_len > rest.len() {
            return Err(LayoutError::Address {
                addr_len,
                len: message.len(),
            });
        }
        if addr_len + HEADER_IDS > rest.len() {
            return Err(LayoutError::Short { len: message.len() });
        }
        let (sender, rest) = rest.split_at(addr_len);
        let (ids, frames) = rest.split_at(HEADER_IDS);
        let word = |at: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&ids[at..at + 8]);
            u64::from_le_bytes(bytes)
        };
        let tag = &message[TAG_AT..FLAGS_AT];
        let covered = &message[FLAGS_AT..];
        let (link_id, counter) = (word(0), word(8));
        if frames.is_empty() {
            return Err(LayoutError::NoFrame);
        }
        let mut at = 0;
        while at < frames.len() {
            let frame = &frames[at..];
            if frame.len() < PREFIX_LEN {
                return Err(LayoutError::Short { len: message.len() });
            }
            let declared = frame_declared_len(frame).unwrap_or(usize::MAX);
            let actual = frame.len() - PREFIX_LEN;
            if declared > actual {
                return Err(LayoutError::FrameLength { declared, actual });
            }
            at += PREFIX_LEN + declared;
        }
        Ok(Received::Frames(Message {
            sender,
            link_id,
            counter,
            covered,
            control,
            tag,
            frames,
        }))
    }
}

/// The frames of a [`Received::Frames`] run, as ranges of it. The run was
/// checked by [`BufferLayout::decode`]; anything else ends the iteration.
pub fn frames(run: &[u8]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        let declared = frame_declared_len(run.get(at..)?)?;
        let end = at.checked_add(PREFIX_LEN)?.checked_add(declared)?;
        if end > run.len() {
            return None;
        }
        let range = at..end;
        at = end;
        Some(range)
    })
}

/// The length a frame's 4-byte little-endian prefix declares.
pub fn frame_declared_len(frame: &[u8]) -> Option<usize> {
    let bytes: [u8; PREFIX_LEN] = frame.get(..PREFIX_LEN)?.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(bytes)).ok()
}

/// Checks an outgoing frame's own length prefix against its length, so a
/// malformed frame fails at the sender instead of being dropped remotely.
pub fn check_frame(frame: &OutFrame) -> Result<(), LayoutError> {
    let len = frame.len();
    if len < PREFIX_LEN {
        return Err(LayoutError::Short { len });
    }
    let mut prefix = [0u8; PREFIX_LEN];
    let head = frame.head.len().min(PREFIX_LEN);
    prefix[..head].copy_from_slice(&frame.head[..head]);
    prefix[head..].copy_from_slice(&frame.body[..PREFIX_LEN - head]);
    let declared = u32::from_le_bytes(prefix) as usize;
    if declared != len - PREFIX_LEN {
        return Err(LayoutError::FrameLength {
            declared,
            actual: len - PREFIX_LEN,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    /// Values from the EFA fixture (`efa-fi_info-v.txt`).
    const EFA_RDM_PREFIX: usize = 176;
    const EFA_RDM_INJECT: usize = 4096;
    const EFA_DGRAM_PREFIX: usize = 40;
    const EFA_DGRAM_MAX_MSG: u64 = 8928;
    const EFA_ADDR_LEN: usize = 32;

    fn frame(payload: &[u8]) -> OutFrame {
        let mut head = (payload.len() as u32).to_le_bytes().to_vec();
        head.extend_from_slice(&payload[..payload.len() / 2]);
        OutFrame {
            head: head.into(),
            body: Bytes::copy_from_slice(&payload[payload.len() / 2..]),
        }
    }

    const KEY_BYTES: [u8; 32] = [7; 32];
    static KEY: std::sync::LazyLock<TagKey> = std::sync::LazyLock::new(|| TagKey::new(&KEY_BYTES));

    fn message<'a>(layout: &BufferLayout, slot: &'a [u8], len: usize) -> Message<'a> {
        match layout.decode(slot, len).unwrap() {
            Received::Frames(message) => message,
            other => panic!("unexpected {other:?}"),
        }
    }

    fn round_trip(layout: BufferLayout, sender: &[u8], payload: &[u8]) {
        let mut slot = vec![0xAAu8; layout.slot_stride()];
        let out = frame(payload);
        let len = layout.encode(&mut slot, sender, (41, 9), &out).unwrap();
        layout.seal(&mut slot, len, &[], &KEY);
        assert_eq!(
            len,
            layout.prefix + BufferLayout::header_len(sender.len()) + 4 + payload.len()
        );
        // The provider's prefix is untouched.
        assert!(slot[..layout.prefix].iter().all(|&b| b == 0xAA));
        // The payload starts right after the prefix.
        assert_eq!(slot[layout.prefix], HEADER_VERSION);
        assert_eq!(
            usize::from(slot[layout.prefix + FLAGS_AT + 1]),
            sender.len()
        );
        let got = message(&layout, &slot, len);
        assert_eq!(got.sender, sender);
        assert_eq!((got.link_id, got.counter), (41, 9));
        assert_eq!(got.frames, &out.to_bytes()[..]);
        assert_eq!(
            frames(got.frames).collect::<Vec<_>>(),
            vec![0..got.frames.len()]
        );
        assert!(got.is_authentic(&KEY));
        assert!(!got.is_authentic(&TagKey::new(&[8; 32])), "another key");
    }

    /// The sender of [`sealed`]'s messages.
    const SENDER: [u8; 16] = [3; 16];

    /// A message from [`SENDER`] carrying the frame of `payload`, sealed
    /// under `KEY`: its slot and length.
    fn sealed(layout: &BufferLayout, payload: &[u8]) -> (Vec<u8>, usize) {
        let mut slot = vec![0u8; layout.slot_stride()];
        let len = layout
            .encode(&mut slot, &SENDER, (5, 1), &frame(payload))
            .unwrap();
        layout.seal(&mut slot, len, &[], &KEY);
        (slot, len)
    }

    #[test]
    fn any_changed_byte_fails_the_tag() {
        let layout = BufferLayout::new(8, 256);
        let (slot, len) = sealed(&layout, b"publish this");
        assert!(message(&layout, &slot, len).is_authentic(&KEY));
        let start = layout.prefix;
        let sent_tag = &slot[start + TAG_AT..start + FLAGS_AT];
        // A changed version is not read at all.
        let mut forged = slot.clone();
        forged[start] ^= 0x01;
        assert!(layout.decode(&forged, len).is_err());
        // A changed tag byte fails the check.
        for at in start + TAG_AT..start + FLAGS_AT {
            let mut forged = slot.clone();
            forged[at] ^= 0x01;
            assert!(
                !message(&layout, &forged, len).is_authentic(&KEY),
                "tag byte {at}"
            );
        }
        // Every byte after the tag is covered (flags, address length,
        // address, ids, frames), whether or not the changed message would
        // still be read.
        for at in start + FLAGS_AT..len {
            let mut forged = slot.clone();
            forged[at] ^= 0x01;
            let counter = message(&layout, &slot, len).counter;
            let retagged = tag(&KEY, counter, &[&forged[start + FLAGS_AT..len]]);
            assert_ne!(
                retagged.as_ref().map(|t| &t[..]),
                Some(sent_tag),
                "byte {at}"
            );
        }
    }

    #[test]
    fn the_tag_is_gmac_over_every_byte_after_it() {
        let layout = BufferLayout::new(8, 4096);
        let (slot, len) = sealed(&layout, &[0x5a; 3000]);
        // Worked out here with AES-256-GCM directly: the version and the
        // counter (1) as the nonce, nothing to encrypt, the bytes after the
        // tag as the associated data.
        let mut nonce = [0u8; NONCE_LEN];
        nonce[0] = 6;
        nonce[NONCE_LEN - 8..].copy_from_slice(&1u64.to_le_bytes());
        let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &KEY_BYTES).unwrap());
        let expected = key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&slot[layout.prefix + FLAGS_AT..len]),
                &mut [],
            )
            .unwrap();
        assert_eq!(
            &slot[layout.prefix + TAG_AT..layout.prefix + FLAGS_AT],
            expected.as_ref()
        );
        assert!(message(&layout, &slot, len).is_authentic(&KEY));
        // And pinned, so that a change of the tag on the wire is seen.
        assert_eq!(
            tag(&KEY, 1, &[b"efabus fabric message"]).map(|t| hex(&t)),
            Some(PINNED_TAG.to_string())
        );
    }

    /// The tag of `b"efabus fabric message"` under `KEY` and counter 1,
    /// as another implementation of AES-GCM (OpenSSL's, through Python's
    /// `cryptography`) gives it for that associated data, nothing to
    /// encrypt and the nonce `06 00 00 00` then 1 as 8 bytes little endian.
    const PINNED_TAG: &str = "26c3fd424bb1707da06cbd9c6f0cb886";

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn parts_are_tagged_as_the_bytes_they_make_together() {
        let bytes = b"a slot's bytes then a body";
        let whole = tag(&KEY, 1, &[bytes]);
        assert_eq!(whole, tag(&KEY, 1, &[&bytes[..6], &bytes[6..]]));
        assert_eq!(whole, tag(&KEY, 1, &[&bytes[..], &[]]));
        assert_eq!(whole, tag(&KEY, 1, &[&[], &bytes[..7], &bytes[7..]]));
    }

    #[test]
    fn descriptors_and_done_frames_decode_only_whole() {
        let descriptor = RmaDescriptor {
            id: 1,
            addr: 2,
            key: 3,
            body_len: 4,
        };
        let frame = descriptor.encode(b"head");
        assert_eq!(
            RmaDescriptor::decode(&frame),
            Some((descriptor.clone(), &b"head"[..]))
        );
        assert_eq!(
            RmaDescriptor::decode(&descriptor.encode(&[])),
            Some((descriptor, &[][..]))
        );
        for cut in 0..RMA_DESCRIPTOR_FIXED {
            assert_eq!(RmaDescriptor::decode(&frame[..cut]), None, "cut at {cut}");
        }
        let done = rma_done(9);
        assert_eq!(RmaDescriptor::decode(&done), None, "another kind");
        assert_eq!(rma_done_id(&done), Some(9));
        assert_eq!(rma_done_id(&done[..done.len() - 1]), None);
        assert_eq!(rma_done_id(&[&done[..], &[0]].concat()), None);
        assert_eq!(rma_done_id(&frame), None, "another kind");
        assert_eq!(rma_fence_id(&rma_fence(9)), Some(9));
        assert_eq!(rma_fence_id(&done), None, "a done is no fence");
    }

    #[test]
    fn trailing_zeros_change_the_tag() {
        // GHASH pads the last block with zeros and then takes the length:
        // bytes that differ only by zeros at the end are told apart.
        assert_ne!(tag(&KEY, 1, &[b"frames"]), tag(&KEY, 1, &[b"frames\0"]));
        assert_ne!(
            tag(&KEY, 1, &[&[7u8; 16]]),
            tag(&KEY, 1, &[&[7u8; 16], &[0u8; 16]])
        );
    }

    #[test]
    fn the_same_bytes_under_another_counter_get_another_tag() {
        let bytes: &[u8] = b"the same frames";
        let first = tag(&KEY, 1, &[bytes]);
        assert_eq!(first, tag(&KEY, 1, &[bytes]));
        assert_ne!(first, tag(&KEY, 2, &[bytes]));
    }

    #[test]
    fn a_tag_of_zeros_or_a_flipped_control_flag_is_refused() {
        let layout = BufferLayout::new(0, 256);
        let (mut slot, len) = sealed(&layout, b"publish this");
        let mut control = slot.clone();
        control[layout.prefix + FLAGS_AT] ^= CONTROL_FLAG;
        let got = message(&layout, &control, len);
        assert!(got.control, "the flag decodes");
        assert!(!got.is_authentic(&KEY));
        slot[layout.prefix + TAG_AT..layout.prefix + FLAGS_AT].fill(0);
        assert!(!message(&layout, &slot, len).is_authentic(&KEY));
    }

    #[test]
    fn a_marked_control_message_is_sealed_with_its_flag() {
        let layout = BufferLayout::new(8, 256);
        let mut slot = vec![0u8; layout.slot_stride()];
        let len = layout
            .encode(&mut slot, &SENDER, (5, 1), &frame(b"done"))
            .unwrap();
        layout.mark_control(&mut slot);
        layout.seal(&mut slot, len, &[], &KEY);
        let got = message(&layout, &slot, len);
        assert!(got.control);
        assert!(got.is_authentic(&KEY));
    }

    #[test]
    fn other_versions_and_unknown_flags_are_refused() {
        let layout = BufferLayout::new(0, 256);
        let (slot, len) = sealed(&layout, b"publish this");
        let mut old = slot.clone();
        old[layout.prefix] = 5;
        assert_eq!(layout.decode(&old, len), Err(LayoutError::Version(5)));
        let mut flagged = slot;
        flagged[layout.prefix + FLAGS_AT] |= 0x01;
        assert_eq!(layout.decode(&flagged, len), Err(LayoutError::Flags(0x01)));
    }

    #[test]
    fn a_send_key_is_taken_once_and_the_oldest_are_forgotten() {
        let mut used = UsedSendKeys::default();
        assert!(used.take(&[1; 32]));
        assert!(!used.take(&[1; 32]), "taken again");
        for n in 0..SEND_KEYS_KEPT as u32 {
            let mut key = [2u8; 32];
            key[..4].copy_from_slice(&n.to_le_bytes());
            assert!(used.take(&key));
        }
        assert_eq!(used.order.len(), SEND_KEYS_KEPT);
        assert!(used.take(&[1; 32]), "forgotten past the bound");
    }

    #[test]
    fn a_body_larger_than_the_scratch_kept_is_tagged_and_not_kept() {
        let layout = BufferLayout::new(0, SCRATCH_KEPT * 2);
        let mut slot = vec![0u8; layout.slot_stride()];
        let body = vec![9u8; SCRATCH_KEPT + 1];
        let head = OutFrame::whole(Bytes::from((body.len() as u32).to_le_bytes().to_vec()));
        let len = layout.encode(&mut slot, &[1u8; 4], (2, 3), &head).unwrap();
        // Sent from elsewhere: tagged through the scratch buffer.
        layout.seal(&mut slot, len, &body, &KEY);
        assert!(SCRATCH.with_borrow(|scratch| scratch.capacity()) <= SCRATCH_KEPT);
        let mut wire = slot[..len].to_vec();
        wire.extend_from_slice(&body);
        let got = message(&layout, &wire, wire.len());
        assert!(got.is_authentic(&KEY));
        let last = wire.len() - 1;
        wire[last] ^= 1;
        assert!(!message(&layout, &wire, wire.len()).is_authentic(&KEY));
    }

    #[test]
    fn a_body_sent_from_elsewhere_is_covered() {
        let layout = BufferLayout::new(0, 256);
        let mut slot = vec![0u8; layout.slot_stride()];
        let body = b"the body";
        let head = OutFrame::whole(Bytes::from(
            [&(body.len() as u32).to_le_bytes()[..]].concat(),
        ));
        let len = layout.encode(&mut slot, &[1u8; 4], (2, 3), &head).unwrap();
        layout.seal(&mut slot, len, body, &KEY);
        // On the wire the body follows the slot's bytes.
        let mut wire = slot[..len].to_vec();
        wire.extend_from_slice(body);
        wire.resize(slot.len(), 0);
        let got = message(&layout, &wire, len + body.len());
        assert_eq!(&got.frames[4..], body);
        assert!(got.is_authentic(&KEY));
    }

    #[test]
    fn replayed_and_stale_counters_are_refused() {
        let mut window = ReplayWindow::default();
        assert!(!window.take(0), "counters start at 1");
        assert!(window.take(1));
        assert!(!window.take(1));
        // Out of order within the window: each once.
        assert!(window.take(5));
        assert!(window.take(3));
        assert!(!window.take(3));
        assert!(window.take(2));
        assert!(window.take(4));
        assert!(!window.take(5));
        // Far ahead: what fell out of the window is refused.
        let far = 5 + REPLAY_WINDOW + 70;
        assert!(window.take(far));
        assert!(!window.take(6), "older than the window");
        assert!(window.take(far - 1));
        assert!(window.take(far - REPLAY_WINDOW + 1));
        assert!(!window.take(far - REPLAY_WINDOW + 1));
        assert!(!window.take(far - REPLAY_WINDOW));
        // Shifts by a word and more keep the marks in place.
        let mut window = ReplayWindow::default();
        for counter in 1..=200 {
            assert!(window.take(counter));
        }
        for counter in 1..=200 {
            assert!(!window.take(counter), "{counter} again");
        }
        assert!(window.take(1000));
        for counter in 1..=200 {
            assert!(!window.take(counter), "{counter} after a shift");
        }
        // Round the ring many times, one counter at a time, skipping some:
        // the skipped ones within the window are still new, once.
        let mut window = ReplayWindow::default();
        for counter in (1..=20_000).filter(|c| c % 7 != 0) {
            assert!(window.take(counter));
        }
        for counter in 20_000 - REPLAY_WINDOW + 1..=20_000 {
            assert_eq!(window.take(counter), counter % 7 == 0, "{counter}");
            assert!(!window.take(counter), "{counter} again");
        }
        assert!(!window.take(20_000 - REPLAY_WINDOW), "out of the window");
    }

    #[test]
    fn appended_frames_come_back_one_by_one() {
        let layout = BufferLayout::new(EFA_DGRAM_PREFIX, 100);
        let mut slot = vec![0u8; layout.slot_stride()];
        let sender = [5u8; 8];
        let mut len = layout
            .encode(&mut slot, &sender, (1, 1), &frame(b"first"))
            .unwrap();
        len = layout.append(&mut slot, len, &frame(b"")).unwrap();
        len = layout.append(&mut slot, len, &frame(b"third one")).unwrap();
        // 40 prefix + 43 header + (9 + 4 + 13) frames = 109; 32 more do not fit.
        assert_eq!(len, 109);
        assert_eq!(
            layout.append(&mut slot, len, &frame(&[0u8; 28])),
            Err(LayoutError::Overrun { len: 141, cap: 140 })
        );
        layout.seal(&mut slot, len, &[], &KEY);
        let got = message(&layout, &slot, len);
        assert_eq!(got.sender, sender);
        assert!(got.is_authentic(&KEY));
        let run = got.frames;
        let payloads: Vec<&[u8]> = frames(run).map(|r| &run[r][4..]).collect();
        assert_eq!(payloads, vec![&b"first"[..], &b""[..], &b"third one"[..]]);
        // A run whose last frame is cut short is refused as a whole.
        assert!(matches!(
            layout.decode(&slot, len - 1),
            Err(LayoutError::FrameLength { .. })
        ));
    }

    #[test]
    fn efa_rdm_layout_reserves_the_prefix() {
        let payload = BufferLayout::payload_for(u64::MAX, EFA_RDM_PREFIX, 65536);
        assert_eq!(payload, 65536);
        let layout = BufferLayout::new(EFA_RDM_PREFIX, payload);
        assert_eq!(layout.recv_len(), 176 + 65536);
        assert_eq!(layout.slot_stride() % SLOT_ALIGN, 0);
        assert!(layout.slot_stride() >= layout.recv_len());
        assert_eq!(layout.max_frame(EFA_ADDR_LEN), 65536 - 67);
        round_trip(layout, &[7u8; EFA_ADDR_LEN], b"hello over srd");
        let max = vec![0x5Au8; layout.max_frame(EFA_ADDR_LEN) - 4];
        round_trip(layout, &[7u8; EFA_ADDR_LEN], &max);
    }

    #[test]
    fn efa_dgram_layout_counts_the_prefix_against_max_msg_size() {
        let payload = BufferLayout::payload_for(EFA_DGRAM_MAX_MSG, EFA_DGRAM_PREFIX, 1 << 20);
        assert_eq!(payload, 8928 - 40);
        let layout = BufferLayout::new(EFA_DGRAM_PREFIX, payload);
        // The whole posted length never exceeds what the provider allows.
        assert_eq!(layout.recv_len(), 8928);
        let max_frame = layout.max_frame(EFA_ADDR_LEN);
        assert_eq!(max_frame, 8928 - 40 - 67);
        assert_eq!(layout.send_len(EFA_ADDR_LEN, max_frame), 8928);
        round_trip(layout, &[1u8; EFA_ADDR_LEN], &vec![3u8; max_frame - 4]);
    }

    #[test]
    fn inject_only_within_the_limit_prefix_included() {
        let layout = BufferLayout::new(EFA_RDM_PREFIX, 65536);
        let fits = EFA_RDM_INJECT - EFA_RDM_PREFIX - BufferLayout::header_len(EFA_ADDR_LEN);
        let posted = |frame_len| layout.send_len(EFA_ADDR_LEN, frame_len);
        assert!(BufferLayout::fits_inject(EFA_RDM_INJECT, posted(fits)));
        assert!(!BufferLayout::fits_inject(EFA_RDM_INJECT, posted(fits + 1)));
        // EFA DGRAM has inject_size 0: never inject.
        let dgram = BufferLayout::new(EFA_DGRAM_PREFIX, 8888);
        assert!(!BufferLayout::fits_inject(
            0,
            dgram.send_len(EFA_ADDR_LEN, 4)
        ));
    }

    #[test]
    fn short_completions_are_provider_packets() {
        let layout = BufferLayout::new(EFA_DGRAM_PREFIX, 1024);
        let slot = vec![0u8; layout.slot_stride()];
        assert_eq!(layout.decode(&slot, 0).unwrap(), Received::ProviderOnly);
        assert_eq!(
            layout.decode(&slot, EFA_DGRAM_PREFIX).unwrap(),
            Received::ProviderOnly
        );
    }

    #[test]
    fn no_prefix_layout_starts_at_zero() {
        let layout = BufferLayout::new(0, 1472);
        round_trip(layout, &[9u8; 16], b"x");
        assert_eq!(layout.max_frame(16), 1472 - 51);
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        let layout = BufferLayout::new(8, 64);
        let mut slot = vec![0u8; layout.slot_stride()];
        // Longer than the buffer.
        assert!(matches!(
            layout.decode(&slot, 1000),
            Err(LayoutError::Overrun { .. })
        ));
        // One byte of payload.
        assert!(matches!(
            layout.decode(&slot, 9),
            Err(LayoutError::Short { .. })
        ));
        // Wrong version.
        slot[8] = 9;
        assert_eq!(layout.decode(&slot, 40), Err(LayoutError::Version(9)));
        // Address longer than the message.
        slot[8] = HEADER_VERSION;
        slot[8 + FLAGS_AT + 1] = 200;
        assert!(matches!(
            layout.decode(&slot, 40),
            Err(LayoutError::Address { .. })
        ));
        // Address and ids longer than the message.
        slot[8 + FLAGS_AT + 1] = 2;
        assert!(matches!(
            layout.decode(&slot, 40),
            Err(LayoutError::Short { .. })
        ));
        // Frame length prefix disagrees with the message length.
        let frame_at = 8 + BufferLayout::header_len(2);
        slot[frame_at..frame_at + 4].copy_from_slice(&100u32.to_le_bytes());
        assert_eq!(
            layout.decode(&slot, frame_at + 8),
            Err(LayoutError::FrameLength {
                declared: 100,
                actual: 4
            })
        );
        // Every length over arbitrary contents decodes or errs, never panics.
        for (i, b) in slot.iter_mut().enumerate() {
            *b = (i * 37) as u8;
        }
        for len in 0..=layout.slot_stride() + 1 {
            let _ = layout.decode(&slot, len);
        }
    }

    #[test]
    fn encode_refuses_what_does_not_fit() {
        let layout = BufferLayout::new(16, 32);
        let mut slot = vec![0u8; layout.slot_stride()];
        let big = frame(&[0u8; 40]);
        assert!(matches!(
            layout.encode(&mut slot, &[0u8; 4], (1, 1), &big),
            Err(LayoutError::Overrun { .. })
        ));
        assert!(matches!(
            layout.encode(&mut slot, &[0u8; 300], (1, 1), &frame(b"")),
            Err(LayoutError::AddressTooLong(300))
        ));
    }

    #[test]
    fn frames_are_checked_against_their_length_prefix() {
        assert!(check_frame(&frame(b"abc")).is_ok());
        assert!(check_frame(&frame(b"")).is_ok());
        // Prefix split across head and body.
        let split = OutFrame {
            head: Bytes::from_static(&[2, 0]),
            body: Bytes::from_static(&[0, 0, 1, 2]),
        };
        assert!(check_frame(&split).is_ok());
        let wrong = OutFrame::whole(Bytes::from_static(&[5, 0, 0, 0, 1]));
        assert!(matches!(
            check_frame(&wrong),
            Err(LayoutError::FrameLength { .. })
        ));
        let short = OutFrame::whole(Bytes::from_static(&[1, 0]));
        assert!(matches!(
            check_frame(&short),
            Err(LayoutError::Short { .. })
        ));
    }
}
