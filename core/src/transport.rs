//! The traits every efabus transport implements, and what they share:
//! [`EndpointConfig`] (with the libfabric endpoints' typed
//! [`FabricOptions`]), [`OutFrame`] and [`split_run`] for the runs of frames
//! [`Endpoint::send_run`] takes, the events and the errors.
//!
//! A [`Transport`] is a factory: it names its scheme, describes what it can do
//! as [`FabricInfo`]s, and opens [`Endpoint`]s. An endpoint is
//! message-oriented and peer-addressed, the shape of a libfabric RDM endpoint
//! with an address vector: stream transports such as TCP hide their framing
//! behind it.
//!
//! # Calling order
//!
//! 1. `Transport::open(config)` gives an endpoint, already listening when the
//!    config names a bind address.
//! 2. Register [`Endpoint::readiness`] with the caller's poller: a file
//!    descriptor that becomes readable when `poll` has work, or
//!    [`Readiness::MustPoll`] when the endpoint only makes progress when
//!    polled (libfabric completion queues without a wait object), or
//!    [`Readiness::PollOrWait`] (libfabric completion queues with a wait
//!    set): polled like `MustPoll`, but an idle caller may block on the
//!    descriptor once [`Endpoint::prepare_wait`] allows it.
//! 3. `connect`/`insert_peer` give a [`PeerId`] at once; frames may be sent to
//!    it immediately (they queue until the link is up, within the bound).
//! 4. `send` never blocks: a full queue returns [`SendError::WouldBlock`] with
//!    the frame handed back, and an [`Event::Writable`] for that peer follows
//!    once there is room again.
//! 5. `poll` drains what is ready into the caller's vector without blocking:
//!    accepted peers, whole received frames, writable peers, closed peers.
//! 6. `close(peer)` flushes what is queued, then releases the peer; dropping
//!    the endpoint releases everything.

use std::fmt;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;

use crate::caps::FabricInfo;
use crate::codec::PREFIX_LEN;

mod fabric;

pub use fabric::{
    FabricOptionError, FabricOptions, OrderWanted, DEFAULT_RDM_MSG_SIZE, FABRIC_OPTION_KEYS,
    MAX_MSG_SIZE,
};

/// A peer of one endpoint. Ids are never reused by an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer#{}", self.0)
    }
}

/// One encoded frame on its way out, in two parts so a payload can be sent
/// without being copied behind its header. The frame is `head` followed by
/// `body`; `body` may be empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutFrame {
    /// The start of the frame: prefix, kind, header and any small fields.
    pub head: Bytes,
    /// The rest (a payload or fragment data, shared with the caller), or
    /// empty.
    pub body: Bytes,
}

impl OutFrame {
    /// A frame held in one buffer.
    pub fn whole(bytes: Bytes) -> Self {
        OutFrame {
            head: bytes,
            body: Bytes::new(),
        }
    }

    /// Total length on the wire.
    pub fn len(&self) -> usize {
        self.head.len() + self.body.len()
    }

    /// Whether the frame has no bytes at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The frame as one contiguous buffer (copies only when it has a body).
    pub fn to_bytes(&self) -> Bytes {
        if self.body.is_empty() {
            return self.head.clone();
        }
        let mut all = Vec::with_capacity(self.len());
        all.extend_from_slice(&self.head);
        all.extend_from_slice(&self.body);
        all.into()
    }
}

/// Payloads up to this size are copied before they wait in a queue
/// ([`Detacher`], [`detach`]).
pub const DETACH_MAX: usize = 16 << 10;

/// `payload`, copied when it is at most [`DETACH_MAX`] bytes long, so that
/// it keeps no larger buffer alive while it waits.
pub fn detach(payload: &mut Bytes) {
    if !payload.is_empty() && payload.len() <= DETACH_MAX {
        *payload = Bytes::copy_from_slice(payload);
    }
}
/// Most bytes between two payloads read together from one stream (the
/// next frame's head: its header and subject).
const ADJACENT_GAP: usize = 1 << 10;
/// Payloads in a row, each following the one before it, after which the
/// next one that follows keeps its buffer ([`Detacher`])...
pub const CHAIN_TO_KEEP: u32 = 64;
/// ... or the payload bytes of such a chain.
pub const CHAIN_BYTES_TO_KEEP: usize = 16 << 10;

/// Copies the small payloads that would keep a larger buffer alive while
/// they wait in a queue. A payload sliced from a buffer read off the
/// network (64 KiB for a busy TCP connection) keeps that whole buffer, so
/// a queue of such slices, one from each buffer (a subscriber getting one
/// message in forty), would hold many times the bytes it counts.
///
/// A payload that follows the one before it (the next message read with
/// it, as in a stream to one subscriber) shares that buffer and is queued
/// as it is once the chain of payloads in a row, each following the one
/// before it, has [`CHAIN_TO_KEEP`] payloads or [`CHAIN_BYTES_TO_KEEP`]
/// bytes of them, or began with a payload that kept its buffer (one too
/// large to copy, or one [`Detacher::passed`]: handed on at once, or
/// first into an empty queue).
/// So a stream costs at most 64 copies per read buffer, not one per
/// message, also while its queue stays deep (a reader behind its
/// producer); and a queue holds at most one buffer per 64 payloads, or
/// per 16 KiB of them, beyond its own bytes (for 65,536 waiting payloads
/// and 64 KiB buffers, 64 MiB in the worst pattern: each buffer holding
/// just one such chain for it). A queue bounded in bytes rather than
/// messages takes [`Detacher::strict`].
#[derive(Debug)]
pub struct Detacher {
    /// Where the payload before ended.
    last_end: usize,
    /// Payloads in a row up to the one before, each following the one
    /// before it.
    chain: u32,
    /// The payload bytes of that chain.
    chain_bytes: usize,
    /// The chain after which a payload that follows keeps its buffer
    /// ([`STRICT`]: only a chain that began with a kept payload).
    chain_to_keep: u32,
}

/// The `chain_to_keep` of [`Detacher::strict`].
const STRICT: u32 = u32::MAX;

impl Default for Detacher {
    fn default() -> Detacher {
        Detacher {
            last_end: 0,
            chain: 0,
            chain_bytes: 0,
            chain_to_keep: CHAIN_TO_KEEP,
        }
    }
}

impl Detacher {
    /// A detacher that lets a chain keep its buffer only when it began with
    /// a payload that kept it: a queue that does not empty copies every
    /// small payload past its first buffer, and holds beyond the bytes it
    /// counts at most the buffers of the payload last passed and of those
    /// too large to copy, whatever the pattern.
    pub fn strict() -> Detacher {
        Detacher {
            chain_to_keep: STRICT,
            ..Detacher::default()
        }
    }

    /// `payload`, about to wait in a queue: copied unless it may keep its
    /// buffer (see [`Detacher`]) or is larger than [`DETACH_MAX`]. True
    /// when it was copied: what else of its message lies in the same
    /// buffer (its headers) needs copying too.
    pub fn settle(&mut self, payload: &mut Bytes) -> bool {
        let long = self.chain >= self.chain_to_keep
            || (self.chain_to_keep != STRICT && self.chain_bytes >= CHAIN_BYTES_TO_KEEP);
        let keep = self.follows(payload) && long;
        let copy = !keep && !payload.is_empty() && payload.len() <= DETACH_MAX;
        if copy {
            *payload = Bytes::copy_from_slice(payload);
        } else if !payload.is_empty() {
            // It keeps its buffer: the next one may share it at once.
            self.chain = self.chain_to_keep;
        }
        copy
    }

    /// `payload` went on at once, or is the first in an empty queue (taken
    /// soon): the next one may follow it, and keep its buffer.
    pub fn passed(&mut self, payload: &Bytes) {
        self.follows(payload);
        self.chain = self.chain_to_keep;
    }

    fn follows(&mut self, payload: &Bytes) -> bool {
        // Addresses are only compared, never used.
        let start = payload.as_ptr() as usize;
        let follows = start >= self.last_end && start - self.last_end <= ADJACENT_GAP;
        self.last_end = start + payload.len();
        if follows {
            // Counting never takes a chain to `STRICT`: only a kept payload.
            self.chain = match self.chain {
                STRICT => STRICT,
                n => (n + 1).min(STRICT - 1),
            };
            self.chain_bytes = self.chain_bytes.saturating_add(payload.len());
        } else {
            self.chain = 1;
            self.chain_bytes = payload.len();
        }
        follows
    }
}

/// The frames of a run, in order, as [`OutFrame::whole`] slices of it (no
/// copy): `split_run(&run)` for the `run` given to [`Endpoint::send_run`]
/// or [`DirectSend::send_run`].
///
/// A run holds whole encoded frames back to back, each starting with its
/// 4-byte little-endian length prefix ([`PREFIX_LEN`]). Anything after the
/// last whole frame (a cut prefix or a frame that declares more bytes
/// than follow) is ignored; [`RunFrames::offset`] tells where the frames
/// ended, so a caller that must refuse such a run can. Frame lengths are
/// not checked against any limit.
///
/// ```
/// use bytes::Bytes;
/// use efabus_core::transport::split_run;
///
/// // Two frames ("ab" and "c"), then three bytes of a cut prefix.
/// let run = Bytes::from_static(b"\x02\0\0\0ab\x01\0\0\0c\x09\0\0");
/// let mut frames = split_run(&run);
/// assert_eq!(frames.next().unwrap().to_bytes(), &b"\x02\0\0\0ab"[..]);
/// assert_eq!(frames.next().unwrap().to_bytes(), &b"\x01\0\0\0c"[..]);
/// assert!(frames.next().is_none());
/// assert_eq!(frames.offset(), 11);
/// ```
pub fn split_run(run: &Bytes) -> RunFrames<'_> {
    RunFrames {
        run,
        slices: split_run_slices(run),
    }
}

/// The frames of a run as plain slices of it, for a reader that needs no
/// `Bytes` of its own; the same framing as [`split_run`].
pub fn split_run_slices(run: &[u8]) -> RunSlices<'_> {
    RunSlices { run, at: 0 }
}

/// The iterator [`split_run`] returns.
#[derive(Debug, Clone)]
pub struct RunFrames<'a> {
    run: &'a Bytes,
    slices: RunSlices<'a>,
}

impl RunFrames<'_> {
    /// Bytes of the run covered by the frames returned so far; once the
    /// iterator is exhausted, where the whole frames end (the run's length
    /// when nothing trails them).
    pub fn offset(&self) -> usize {
        self.slices.offset()
    }
}

impl Iterator for RunFrames<'_> {
    type Item = OutFrame;

    fn next(&mut self) -> Option<OutFrame> {
        let start = self.slices.offset();
        let frame = self.slices.next()?;
        Some(OutFrame::whole(self.run.slice(start..start + frame.len())))
    }
}

impl std::iter::FusedIterator for RunFrames<'_> {}

/// The iterator [`split_run_slices`] returns.
#[derive(Debug, Clone)]
pub struct RunSlices<'a> {
    run: &'a [u8],
    at: usize,
}

impl RunSlices<'_> {
    /// As [`RunFrames::offset`].
    pub fn offset(&self) -> usize {
        self.at
    }
}

impl<'a> Iterator for RunSlices<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let rest = self.run.get(self.at..)?;
        let prefix = rest.first_chunk::<PREFIX_LEN>()?;
        let total = (u32::from_le_bytes(*prefix) as usize).checked_add(PREFIX_LEN)?;
        let frame = rest.get(..total)?;
        self.at += total;
        Some(frame)
    }
}

impl std::iter::FusedIterator for RunSlices<'_> {}

/// How the caller learns that an endpoint has work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Becomes readable (level-triggered) when `poll` would return events.
    Fd(RawFd),
    /// Make progress only by calling `poll` repeatedly (busy-poll with backoff).
    MustPoll,
    /// Poll repeatedly as for `MustPoll`; between polls the caller may
    /// block on the descriptor (readable when `poll` may have work) for as
    /// long as it likes, but only after [`Endpoint::prepare_wait`] returned
    /// true.
    PollOrWait(RawFd),
}

impl Readiness {
    /// The descriptor to register with the caller's poller, if any.
    pub fn fd(self) -> Option<RawFd> {
        match self {
            Readiness::Fd(fd) | Readiness::PollOrWait(fd) => Some(fd),
            Readiness::MustPoll => None,
        }
    }

    /// Whether the caller must keep polling (with back-off) rather than
    /// rely on the descriptor alone.
    pub fn must_poll(self) -> bool {
        !matches!(self, Readiness::Fd(_))
    }
}

/// Why a peer's link ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseReason {
    /// `close` was called on this side.
    Local,
    /// The peer closed the link in an orderly way.
    PeerClosed,
    /// The link failed; the text names the cause.
    Error(String),
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseReason::Local => f.write_str("closed locally"),
            CloseReason::PeerClosed => f.write_str("closed by peer"),
            CloseReason::Error(text) => write!(f, "link error: {text}"),
        }
    }
}

/// What `poll` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A remote side connected to a listening endpoint.
    Accepted {
        /// The id given to the new peer.
        peer: PeerId,
        /// The remote address, as the transport prints it.
        remote: String,
    },
    /// One whole frame, exactly as the peer encoded it.
    Frame {
        /// The peer it came from.
        peer: PeerId,
        /// The frame, length prefix included.
        frame: Bytes,
    },
    /// Whole frames read together, back to back, each with its length
    /// prefix: read them with [`split_run`] or [`split_run_slices`]. Only
    /// from an endpoint that agreed to [`Endpoint::deliver_runs`]; others
    /// give each frame in a [`Event::Frame`] of its own.
    Frames {
        /// The peer they came from.
        peer: PeerId,
        /// The frames, in the order the peer sent them.
        run: Bytes,
    },
    /// The peer's send queue has room again after a `WouldBlock`.
    Writable {
        /// The peer that can take frames again.
        peer: PeerId,
    },
    /// The peer offered a frame whose read waits for its release
    /// ([`Endpoint::hold_reads`]): it is there, and its owner may now ask
    /// it to prove its address.
    ReadHeld {
        /// The peer whose read waits.
        peer: PeerId,
    },
    /// The peer is gone; its id will not appear again.
    Closed {
        /// The peer that is gone.
        peer: PeerId,
        /// Why.
        reason: CloseReason,
    },
}

/// Parameters for opening an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointConfig {
    /// What follows the scheme in an endpoint string (`127.0.0.1:7420` for
    /// `tcp/127.0.0.1:7420`); `None` opens an endpoint that only connects out.
    pub bind: Option<String>,
    /// Largest frame the endpoint accepts or sends, header included.
    pub max_frame: usize,
    /// Frames queued per peer before `send` returns `WouldBlock`.
    pub queue_frames: usize,
    /// Bytes queued per peer before `send` returns `WouldBlock`.
    pub queue_bytes: usize,
    /// Settings of the libfabric endpoints (`efa-rdm`, `efa-dgram`): the
    /// provider, buffer sizes and so on. `None` keeps the fabric
    /// transport's own (its defaults, or what it was built with); other
    /// transports ignore it.
    pub fabric: Option<FabricOptions>,
    /// Other transport-specific settings as text, by name (e.g. the tcp
    /// transport's `read_budget`, or the `fault_*` settings of a fault
    /// injector); each transport reads its own and ignores the rest. The
    /// fabric transport takes none: its settings are [`Self::fabric`].
    pub options: Vec<(String, String)>,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        EndpointConfig {
            bind: None,
            max_frame: 8 << 20,
            queue_frames: 4096,
            queue_bytes: 16 << 20,
            fabric: None,
            options: Vec::new(),
        }
    }
}

impl EndpointConfig {
    /// The value of a transport-specific option, if set.
    pub fn option(&self, name: &str) -> Option<&str> {
        self.options
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// Errors from opening endpoints and managing peers.
#[derive(Debug, Error)]
pub enum TransportError {
    /// The transport cannot work here (no provider, no device, ...).
    #[error("transport {scheme} is unavailable: {reason}")]
    Unavailable {
        /// The transport's scheme.
        scheme: String,
        /// Why not.
        reason: String,
    },
    /// An address the transport cannot use.
    #[error("invalid address {addr:?}: {reason}")]
    InvalidAddress {
        /// The address as given.
        addr: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Listening on the bind address failed.
    #[error("cannot bind {addr}: {source}")]
    Bind {
        /// The bind address.
        addr: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// Reaching a remote address failed.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The remote address.
        addr: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The endpoint has no such peer (never had, or it is closed).
    #[error("unknown {0}")]
    UnknownPeer(PeerId),
    /// The transport does not offer this operation.
    #[error("{operation} is not supported by the {scheme} transport")]
    Unsupported {
        /// The transport's scheme.
        scheme: String,
        /// The operation asked for.
        operation: &'static str,
    },
    /// Any other I/O failure.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// TLS settings that cannot be used (a file that cannot be read, a
    /// key that does not fit its certificate); the text says what.
    #[error("tls: {0}")]
    Tls(String),
    /// A failure specific to the transport; the text says what.
    #[error("{0}")]
    Other(String),
}

/// Errors from [`Endpoint::send`].
#[derive(Debug, Error)]
pub enum SendError {
    /// The peer's queue is full; the frame is handed back untouched.
    #[error("send queue full")]
    WouldBlock(OutFrame),
    /// The frame is over the endpoint's frame limit; it is never sent.
    #[error("frame of {len} bytes exceeds the link limit of {max}")]
    TooLarge {
        /// Length of the frame.
        len: usize,
        /// The endpoint's limit.
        max: usize,
    },
    /// The peer is unknown or already closed.
    #[error("unknown or closed {0}")]
    Closed(PeerId),
    /// The transport failed.
    #[error("{0}")]
    Transport(#[from] TransportError),
}

/// Sends to one peer of an endpoint from any thread (see
/// [`Endpoint::direct_sender`]). It never blocks: what the wire does not
/// take at once stays queued with the endpoint's other frames for that
/// peer, within the same bounds, and the endpoint's polling thread writes it
/// later. A refused frame or run is handed back as from [`Endpoint::send`];
/// refusals produce no `Writable` event.
pub trait DirectSend: Send + Sync {
    /// As [`Endpoint::send`].
    fn send(&self, frame: OutFrame) -> Result<(), SendError>;
    /// As [`Endpoint::send_run`]; the run is taken whole or not at all.
    fn send_run(&self, run: Bytes) -> Result<(), SendError>;
}

/// A factory of endpoints for one scheme.
pub trait Transport: Send + Sync {
    /// The scheme selecting this transport in endpoint strings (`tcp`, `mem`, `efa-rdm`).
    fn scheme(&self) -> &str;

    /// What this transport offers, in fi_info terms. An unavailable transport
    /// returns [`TransportError::Unavailable`] with the reason.
    fn infos(&self) -> Result<Vec<FabricInfo>, TransportError>;

    /// Open an endpoint.
    fn open(&self, config: &EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError>;
}

/// What authenticates one link of a connectionless endpoint: a key for
/// each direction and an id for each end. The session layer agrees them
/// over its control link; they never travel on the link they protect.
///
/// Keys serve one link only, once: a fabric endpoint tags each message
/// with AES-GCM using the link's message counter, which starts afresh with
/// each link, as the nonce, and two messages tagged under one nonce and
/// key would let anyone who saw them forge others. The session layer
/// derives keys from an X25519 exchange of its own for each session, with
/// both link ids and the scheme.
#[derive(Clone, PartialEq, Eq)]
pub struct LinkKeys {
    /// Key of the messages this side sends.
    pub send_key: [u8; 32],
    /// Key of the messages the peer sends.
    pub receive_key: [u8; 32],
    /// The id this side gave the link; messages to this side carry it, so
    /// a receiver finds the link (and its key) without trusting the
    /// sender's word for who it is.
    pub local_id: u64,
    /// The id the peer gave the link, carried by every message sent to it.
    pub remote_id: u64,
}

impl fmt::Debug for LinkKeys {
    /// Ids only: keys never reach a log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkKeys")
            .field("local_id", &self.local_id)
            .field("remote_id", &self.remote_id)
            .finish_non_exhaustive()
    }
}

/// What an endpoint's own buffers take, in bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BufferMemory {
    /// Address space of its buffer pools.
    pub held: usize,
    /// Of that, memory registered with the provider (pinned), where it
    /// requires registration (`FI_MR_LOCAL`, as efa does).
    pub registered: usize,
    /// Receives posted as multi-receive buffers (`FI_MULTI_RECV`), many
    /// messages to each: how many, and the bytes of each; `None` when each
    /// posted receive takes one message.
    pub multi_recv: Option<(usize, usize)>,
}

/// Messages an endpoint refused before they reached any peer, by reason,
/// since it opened.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// Naming no live link: from a sender that never had a session, or
    /// late, for a link closed since.
    pub unknown_link: u64,
    /// Failing authentication: another sender address than the link's,
    /// or a tag that does not check under the link's key.
    pub forged: u64,
    /// Authentic but seen before.
    pub replayed: u64,
    /// Not an efabus message at all: too short, an unknown header
    /// version, or lengths that do not add up.
    pub malformed: u64,
}

/// What an endpoint moved by rendezvous since it opened (see
/// [`Endpoint::rendezvous_max`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RendezvousCounts {
    /// Frames sent by rendezvous (a descriptor in their place).
    pub sent: u64,
    /// Bodies registered for them (a frame sent to several peers at once
    /// is registered once).
    pub registrations: u64,
    /// Frames received by rendezvous.
    pub read: u64,
    /// Their bytes.
    pub read_bytes: u64,
    /// Of those read, the ones landed in huge pages (a broker's large
    /// frames over `shm`).
    pub huge_landed: u64,
    /// Transfers released without their done: the peer closed first.
    pub abandoned: u64,
    /// Peers' frames whose read was given up because the peer closed
    /// first (offered and not read yet, or read after it closed): the
    /// receiving side's count of what the sender counts in `abandoned`.
    pub reads_given_up: u64,
    /// Frames whose body was registered already (sent to another peer
    /// too): served from the registration cache.
    pub cache_hits: u64,
    /// Registrations held right now: bodies offered to peers' reads and,
    /// where the provider needs local registrations (FI_MR_LOCAL), the
    /// buffers reads in flight land in.
    pub registered: u64,
    /// Their bytes.
    pub registered_bytes: u64,
}

/// What a fabric endpoint's provider did since the endpoint opened,
/// besides the frames it carried (see [`Endpoint::fabric_counts`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FabricCounts {
    /// Messages handed to the provider (sends and injects).
    pub messages_sent: u64,
    /// Messages the provider delivered (each may carry several frames).
    pub messages_received: u64,
    /// Completion-queue reads made. Each runs the provider's progress, so
    /// beside the messages it shows what polling costs in provider calls.
    pub completion_reads: u64,
    /// Operations that failed: completions reporting an error (sends,
    /// receives, reads) and posts the provider refused for another reason
    /// than a full queue.
    pub completion_errors: u64,
    /// Received buffers lent to the application instead of copied.
    pub lent: u64,
    /// Sends made from the frame's own memory instead of a copy.
    pub shared_sends: u64,
    /// Address-vector entries removed to make room for others.
    pub av_evictions: u64,
    /// Address-vector entries in use right now.
    pub addresses: u64,
    /// How many entries the address vector may hold.
    pub address_capacity: u64,
    /// Sends the provider failed because the receiver had no buffer
    /// posted (`FI_ENORX`), after its own receiver-not-ready retries ran
    /// out: on efa they happen inside the provider and only their end is
    /// visible.
    pub rnr_failures: u64,
    /// Sends handed back to the caller for now: the endpoint's send slots
    /// or the peer's share of them were full (the caller retries on
    /// `Writable`).
    pub queue_full: u64,
}

/// A message-oriented, peer-addressed endpoint. See the module docs for the
/// calling order.
pub trait Endpoint: Send {
    /// The scheme of the transport that opened this endpoint.
    fn scheme(&self) -> &str;

    /// The address peers use to reach this endpoint: text for sockets
    /// (`127.0.0.1:7420`), provider bytes for fabrics.
    fn local_addr(&self) -> Vec<u8>;

    /// Largest frame one `send` may carry on this endpoint, header included.
    fn max_frame(&self) -> usize;

    /// Start a link to a peer named by its textual address.
    fn connect(&mut self, addr: &str) -> Result<PeerId, TransportError>;

    /// Add a peer by its raw address bytes (as `local_addr` returned them on
    /// the peer), for connectionless endpoints such as libfabric RDM/DGRAM,
    /// with the keys that authenticate every message of the link. Each call
    /// makes a new peer, even for an address already known: two links to
    /// one address are told apart by their ids. Keys serve one link only
    /// (see [`LinkKeys`]); a fabric endpoint refuses a send key that one of
    /// its latest links had.
    fn insert_peer(&mut self, addr: &[u8], keys: &LinkKeys) -> Result<PeerId, TransportError> {
        let _ = (addr, keys);
        Err(TransportError::Unsupported {
            scheme: self.scheme().to_string(),
            operation: "insert_peer",
        })
    }

    /// Memory the endpoint keeps for its own buffers, whatever the
    /// traffic (fabric endpoints' send and receive pools; none for others).
    fn buffers(&self) -> BufferMemory {
        BufferMemory::default()
    }

    /// Messages refused before they reached a peer (endpoints that
    /// authenticate messages count them; others refuse none this way).
    fn refused(&self) -> Refused {
        Refused::default()
    }

    /// Whether a frame from `peer` is on its way in a form the owner does
    /// not see yet: a rendezvous body being read, or waiting for a read
    /// slot. Frames sent after it may arrive first, and a reliable link
    /// waiting for it must not give it up meanwhile.
    fn receiving_from(&self, peer: PeerId) -> bool {
        let _ = peer;
        false
    }

    /// What the endpoint moved by rendezvous, for the owner's statistics.
    fn rendezvous_counts(&self) -> RendezvousCounts {
        RendezvousCounts::default()
    }

    /// What the provider did since the endpoint opened; zero for
    /// transports that are not a fabric.
    fn fabric_counts(&self) -> FabricCounts {
        FabricCounts::default()
    }

    /// Reads the endpoint's TLS certificate, key and authority files
    /// again, for the connections made from now on; `Ok(false)` for an
    /// endpoint without TLS. On failure the files in use stay.
    fn reload_tls(&mut self) -> Result<bool, TransportError> {
        Ok(false)
    }

    /// Puts back the TLS configuration the last successful
    /// [`reload_tls`](Self::reload_tls) replaced: a broker whose other
    /// endpoint failed to reload keeps every endpoint on the files in use.
    /// An endpoint that wraps another and passes `reload_tls` on must pass
    /// this on too (the default does nothing).
    fn revert_tls(&mut self) {}

    /// New values, from a configuration reload, for what the endpoint was
    /// opened with (its [`EndpointConfig::options`] and queue bounds). An
    /// endpoint applies those it can change while running and ignores the
    /// others.
    fn reconfigure(&mut self, config: &EndpointConfig) -> Result<(), TransportError> {
        let _ = config;
        Ok(())
    }

    /// The certificate (DER) a peer presented and this endpoint verified
    /// (a TLS client certificate under `tls_verify_clients`); `None`
    /// without one.
    fn peer_certificate(&self, peer: PeerId) -> Option<Vec<u8>> {
        let _ = peer;
        None
    }

    /// Queue one frame for a peer without blocking.
    fn send(&mut self, peer: PeerId, frame: OutFrame) -> Result<(), SendError>;

    /// Queue a run of whole frames for a peer without blocking: `run` holds
    /// one or more encoded frames back to back, each with its length
    /// prefix, as a sender that batches builds them. The same as `send` of
    /// each frame in order (which is what this default does); a stream
    /// transport may take the run as it is, in one piece.
    ///
    /// On [`SendError::WouldBlock`] the frame handed back is the part of
    /// the run not taken (whole frames, back to back): the frames before it
    /// were queued. A run that ends inside a frame is refused from that
    /// frame on.
    fn send_run(&mut self, peer: PeerId, run: Bytes) -> Result<(), SendError> {
        let mut frames = split_run(&run);
        while let Some(frame) = frames.next() {
            let at = frames.offset() - frame.len();
            match self.send(peer, frame) {
                Ok(()) => {}
                Err(SendError::WouldBlock(_)) => {
                    return Err(SendError::WouldBlock(OutFrame::whole(run.slice(at..))))
                }
                Err(err) => return Err(err),
            }
        }
        if frames.offset() < run.len() {
            return Err(SendError::Transport(TransportError::Other(format!(
                "a run of {} bytes ends inside the frame at byte {}",
                run.len(),
                frames.offset()
            ))));
        }
        Ok(())
    }

    /// Append what is ready to `events` without blocking.
    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), TransportError>;

    /// Asks the endpoint to give frames read together as one
    /// [`Event::Frames`] instead of an [`Event::Frame`] each, for a caller
    /// that reads them in place: one buffer reference per read rather than
    /// per frame. True when it will; the default does not.
    fn deliver_runs(&mut self) -> bool {
        false
    }

    /// Hand what `send` queued to the wire now, reading nothing: called
    /// once a round of the caller's loop has made its sends, so they need
    /// not wait for its next poll of every endpoint. Endpoints that send
    /// from `send` itself need nothing here (the default).
    fn flush(&mut self) {}

    /// A handle through which other threads may send to the peer directly,
    /// without handing frames to the thread that polls this endpoint; `None`
    /// when the transport has none (the default) or the peer is unknown.
    /// Frames sent through it queue in the same order as `send`'s.
    fn direct_sender(&mut self, peer: PeerId) -> Option<Arc<dyn DirectSend>> {
        let _ = peer;
        None
    }

    /// Flush what is queued for the peer (best effort), then release it.
    /// A `Closed { reason: Local }` event follows.
    fn close(&mut self, peer: PeerId);

    /// How the caller learns there is work.
    fn readiness(&self) -> Readiness;

    /// For a [`Readiness::Fd`] endpoint: whether `poll` has work the
    /// descriptor may not show (frames queued for writing, reads left over
    /// from the last poll, a wake-up not yet taken). A caller busy with
    /// other endpoints may put off polling one whose last poll found
    /// nothing, but never while this says true. The default always does.
    fn has_own_work(&self) -> bool {
        true
    }

    /// Largest frame the endpoint sends and takes by rendezvous (a
    /// descriptor sent eagerly, the bytes read one-sided by the receiver);
    /// 0 when it has none. Offered to peers, see
    /// [`crate::caps::Offer::rendezvous_max`].
    fn rendezvous_max(&self) -> usize {
        0
    }

    /// Frames to `peer` above its frame limit and up to `limit` bytes go by
    /// rendezvous, as negotiated (0: none). Only called with a limit both
    /// sides offered.
    fn set_peer_rendezvous(&mut self, peer: PeerId, limit: usize) {
        let _ = (peer, limit);
    }

    /// Whether reads of `peer`'s rendezvous frames wait (`held`) or may
    /// start. A read goes to the peer's address with the offset and key
    /// its descriptor gives; where the provider does not report each
    /// message's source (the sender's address is what the frame says),
    /// or checks no key on a read (`shm`'s reads straight from the other
    /// process), that address is known to be the sender's own only once
    /// the peer has proven it. Descriptors queue meanwhile, within their
    /// per-peer bound. Endpoints without rendezvous ignore it.
    fn hold_reads(&mut self, peer: PeerId, held: bool) {
        let _ = (peer, held);
    }

    /// The most frame bytes one message to `peer` may carry, as the link
    /// to it negotiated (its buffers may be smaller than this endpoint's).
    /// An endpoint that packs several frames into one message keeps each
    /// message within it, and packs nothing for a peer without one.
    fn set_peer_frame_limit(&mut self, peer: PeerId, limit: usize) {
        let _ = (peer, limit);
    }

    /// The largest frame this endpoint accepts from `peer`, below its own
    /// [`max_frame`](Endpoint::max_frame); `None` lifts the limit. A frame
    /// declared above it is refused as one above `max_frame` is. A caller
    /// holds a peer that has not authenticated yet to a small claim on
    /// memory with it. Endpoints that keep no partial frames per peer may
    /// ignore it.
    fn set_receive_limit(&mut self, peer: PeerId, limit: Option<usize>) {
        let _ = (peer, limit);
    }

    /// The receive limit (see [`Self::set_receive_limit`]) every peer
    /// accepted from now on starts with, before it has sent anything.
    fn set_accepted_receive_limit(&mut self, limit: Option<usize>) {
        let _ = limit;
    }

    /// Called right before the caller sleeps, for endpoints that must be
    /// polled ([`Readiness::MustPoll`] and [`Readiness::PollOrWait`]): the
    /// endpoint may hand on what it still holds, and answers false when
    /// work is pending (the descriptor might not signal it), so the caller
    /// polls again instead of sleeping.
    fn prepare_wait(&mut self) -> bool {
        true
    }

    /// The longest the caller may sleep now before polling again, when
    /// the endpoint needs calls to make progress on work in flight even
    /// though no descriptor will announce it; `None` for no limit.
    fn wait_cap(&self) -> Option<Duration> {
        None
    }

    /// What this endpoint actually is, in fi_info terms (after the
    /// provider's choices), for the offers made in the handshake. `None`
    /// when the transport does not describe itself.
    fn info(&self) -> Option<FabricInfo> {
        None
    }

    /// Bytes queued towards a peer and not yet handed to the wire.
    fn queued_bytes(&self, peer: PeerId) -> usize;

    /// Stop (or resume) reading frames from a peer, so that a receiver that
    /// cannot keep up pushes back on the sender through the transport.
    /// Transports that cannot pause (datagram fabrics) ignore it.
    fn set_read_paused(&mut self, peer: PeerId, paused: bool) {
        let _ = (peer, paused);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slices of `buffer` one after another, `gap` bytes apart: a stream's
    /// payloads with the heads of their frames between them.
    fn stream(buffer: &Bytes, count: usize, len: usize, gap: usize) -> Vec<Bytes> {
        (0..count)
            .map(|n| buffer.slice(n * (len + gap)..n * (len + gap) + len))
            .collect()
    }

    /// A stream that reaches a new read buffer while its queue holds
    /// messages (a reader behind its producer) goes back to sharing its
    /// buffer after a chain of copies, rather than copying every payload
    /// from then on; payloads apart from one another are all copied.
    #[test]
    fn a_stream_copies_a_few_payloads_per_buffer_and_sparse_ones_all() {
        let mut detacher = Detacher::default();
        let first = Bytes::from(vec![1u8; 64 << 10]);
        let second = Bytes::from(vec![2u8; 64 << 10]);
        detacher.passed(&first.slice(..16));
        let mut copied = 0;
        for buffer in [&first, &second] {
            for mut payload in stream(buffer, 1_000, 16, 24).into_iter().skip(1) {
                copied += usize::from(detacher.settle(&mut payload));
            }
        }
        // The second buffer's first payload follows nothing it kept: it
        // and the chain behind it are copied, then the buffer is shared.
        assert_eq!(copied, CHAIN_TO_KEEP as usize);
        // A strict one copies the whole of the second buffer's stream.
        let mut strict = Detacher::strict();
        strict.passed(&first.slice(..16));
        let copied: usize = [&first, &second]
            .into_iter()
            .flat_map(|buffer| stream(buffer, 1_000, 16, 24).into_iter().skip(1))
            .map(|mut payload| usize::from(strict.settle(&mut payload)))
            .sum();
        assert_eq!(copied, 999);
        // Larger payloads: after a chain of 16 KiB.
        let third = Bytes::from(vec![4u8; 64 << 10]);
        let copied: usize = stream(&third, 30, 2_000, 24)
            .into_iter()
            .map(|mut payload| usize::from(detacher.settle(&mut payload)))
            .sum();
        assert_eq!(copied, CHAIN_BYTES_TO_KEEP.div_ceil(2_000));
        // One too large to copy keeps its buffer, and so may the next.
        let fourth = Bytes::from(vec![5u8; 64 << 10]);
        let mut large = fourth.slice(..DETACH_MAX + 1);
        assert!(!detacher.settle(&mut large));
        let mut next = fourth.slice(DETACH_MAX + 30..DETACH_MAX + 46);
        assert!(!detacher.settle(&mut next), "a payload after a kept one");
        // The same with a strict one, which no chain of copies satisfies.
        let mut strict = Detacher::strict();
        let mut large = fourth.slice(..DETACH_MAX + 1);
        assert!(!strict.settle(&mut large));
        let mut next = fourth.slice(DETACH_MAX + 30..DETACH_MAX + 46);
        assert!(!strict.settle(&mut next), "a payload after a kept one");
        // Payloads 1 KiB apart (others' messages between them) are copied
        // until 64 follow one another: their bytes count, not the span.
        let sixth = Bytes::from(vec![6u8; 256 << 10]);
        let copied: usize = stream(&sixth, 100, 16, 1_000)
            .into_iter()
            .map(|mut payload| usize::from(detacher.settle(&mut payload)))
            .sum();
        assert_eq!(copied, CHAIN_TO_KEEP as usize);
        let sparse = Bytes::from(vec![3u8; 64 << 10]);
        for at in (0..40).map(|n| n * 1_500) {
            let mut payload = sparse.slice(at..at + 16);
            assert!(detacher.settle(&mut payload), "a payload at {at} was kept");
            assert_ne!(payload.as_ptr(), sparse[at..].as_ptr(), "not a copy");
        }
    }

    /// Takes up to `room` frames, then refuses.
    struct Recorder {
        frames: Vec<Bytes>,
        room: usize,
    }

    impl Endpoint for Recorder {
        fn scheme(&self) -> &str {
            "recorder"
        }
        fn local_addr(&self) -> Vec<u8> {
            Vec::new()
        }
        fn max_frame(&self) -> usize {
            1024
        }
        fn connect(&mut self, _: &str) -> Result<PeerId, TransportError> {
            Ok(PeerId(1))
        }
        fn send(&mut self, _: PeerId, frame: OutFrame) -> Result<(), SendError> {
            if self.frames.len() == self.room {
                return Err(SendError::WouldBlock(frame));
            }
            self.frames.push(frame.to_bytes());
            Ok(())
        }
        fn poll(&mut self, _: &mut Vec<Event>) -> Result<(), TransportError> {
            Ok(())
        }
        fn close(&mut self, _: PeerId) {}
        fn readiness(&self) -> Readiness {
            Readiness::MustPoll
        }
        fn queued_bytes(&self, _: PeerId) -> usize {
            0
        }
    }

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(body);
        frame
    }

    #[test]
    fn split_run_gives_whole_frames_and_ignores_a_cut_tail() {
        let frames: Vec<Vec<u8>> = [&b"a"[..], b"", b"ccc", b"dddd"]
            .iter()
            .map(|b| framed(b))
            .collect();
        let run = Bytes::from(frames.concat());
        let mut split = split_run(&run);
        let got: Vec<Bytes> = split.by_ref().map(|f| f.to_bytes()).collect();
        assert_eq!(got, frames);
        assert_eq!(split.offset(), run.len());
        assert_eq!(split.next(), None, "stays exhausted");

        // Slices of the run, not copies.
        let first = split_run(&run).next().unwrap();
        assert!(first.body.is_empty());
        assert_eq!(first.head.as_ptr(), run.as_ptr());

        // A frame cut short, and a prefix cut short, end the frames.
        for cut in [run.len() - 1, frames[..3].concat().len() + 2] {
            let short = run.slice(..cut);
            let mut split = split_run(&short);
            assert_eq!(split.by_ref().count(), 3, "cut at {cut}");
            assert_eq!(split.offset(), frames[..3].concat().len());
        }

        assert_eq!(split_run(&Bytes::new()).count(), 0);
        let huge = Bytes::from_static(&[0xff, 0xff, 0xff, 0xff, 1, 2]);
        assert_eq!(split_run(&huge).offset(), 0);
        assert_eq!(split_run(&huge).count(), 0);
    }

    #[test]
    fn default_send_run_sends_each_frame_and_hands_back_the_rest() {
        let frames: Vec<Vec<u8>> = [&b"a"[..], b"", b"ccc", b"dddd"]
            .iter()
            .map(|b| framed(b))
            .collect();
        let run = Bytes::from(frames.concat());
        let mut all = Recorder {
            frames: Vec::new(),
            room: 10,
        };
        all.send_run(PeerId(1), run.clone()).unwrap();
        assert_eq!(all.frames, frames);

        let mut two = Recorder {
            frames: Vec::new(),
            room: 2,
        };
        match two.send_run(PeerId(1), run.clone()) {
            Err(SendError::WouldBlock(rest)) => assert_eq!(rest.to_bytes(), frames[2..].concat()),
            other => panic!("expected WouldBlock, got {other:?}"),
        }
        assert_eq!(two.frames, frames[..2]);

        let mut cut = Recorder {
            frames: Vec::new(),
            room: 10,
        };
        let short = run.slice(..run.len() - 1);
        assert!(matches!(
            cut.send_run(PeerId(1), short),
            Err(SendError::Transport(_))
        ));
        assert_eq!(cut.frames, frames[..3]);
    }
}
