//! The TCP transport (scheme `tcp`): non-blocking sockets on mio, framed by
//! the 4-byte little-endian length prefix every frame starts with.
//!
//! With the `tls_*` options its connections speak TLS (rustls; see
//! [`crate::tls`]): the framing below is the same, over the session's
//! plaintext.
//!
//! An endpoint owns a `mio::Poll` holding its listener (when `bind` is set),
//! its connections and a `mio::Waker`; the poll's epoll descriptor is its
//! [`Readiness::Fd`], so the caller's poller nests it.
//!
//! Sending: `send` appends the frame's parts to the peer's bounded queue
//! and wakes the endpoint (once per batch), and the next `poll` hands every
//! queued part to `write_vectored`, many frames per system call.
//! `send_run` takes a run of frames its caller batched (one buffer) and,
//! when the socket has room, writes the queue at once, without a wake-up.
//! [`Endpoint::direct_sender`] gives a handle that does the same from other
//! threads: the queue (the connection's sending half) is shared behind a
//! lock, so frames from the endpoint and from handles keep one order. Past
//! `queue_frames` or `queue_bytes` a send returns [`SendError::WouldBlock`];
//! [`Event::Writable`] follows (for refusals of the endpoint's own sends)
//! once the queue has drained to half of both bounds.
//!
//! Receiving reads each ready socket until it is empty, at most
//! [`READ_BUDGET`] bytes per connection per poll (option `read_budget`
//! in [`EndpointConfig::options`] changes it) so one busy peer cannot
//! starve the others (the endpoint wakes itself to read the rest). A read
//! that returns less than asked ends the round (readiness is edge
//! triggered: more data raises a new event), unless the peer's close was
//! signalled. Frames are split off the connection's read buffer and frozen,
//! so each arrives as a `Bytes` without a copy beyond the socket read. A
//! busy connection reads into large buffers; a quiet one keeps a small one.
//! The buffer for a frame grows as its bytes arrive, not by its declared
//! length, so a peer that declares a large frame and sends little of it
//! holds little memory. A declared length above `max_frame`, or above the
//! peer's receive limit (see [`Endpoint::set_receive_limit`]: the broker
//! sets a small one until a peer has authenticated), ends the connection
//! before anything is allocated for it: the frames before it are still
//! delivered, the peer is sent an efabus error frame
//! ([`ErrorCode::PayloadTooLarge`], naming the declared size and the
//! limit) followed by an orderly close, and the caller
//! sees [`CloseReason::Error`] with the same text. The transport answers
//! itself because it is the only one that saw the length: the frame never
//! reaches the caller, and the caller cannot send to a peer it was told is
//! closed.
//!
//! `connect` returns the peer at once and never waits: an IP address is
//! dialed there (a non-blocking connect), a host name is resolved on a
//! thread of its own (a resolver can take seconds, and the caller is an
//! event loop serving everyone else) and dialed by the poll that finds the
//! answer (the answer then serves dials of that name for [`ANSWER_TTL`]).
//! Frames queue until the link is up, and a failed connect (a name that
//! does not resolve, or every resolved address tried) shows as
//! `Closed { Error }`; closing a peer whose name is still being looked up
//! drops what was queued for it, as nothing of it is on the wire. `close` flushes what is queued without
//! blocking, shuts the write side down and keeps draining the socket until
//! the peer closes too (or [`LINGER`] passes), so the peer reads every frame
//! and then an orderly close rather than a reset; past [`MAX_LINGERING`]
//! such connections, the one closed longest ago is dropped at once (reset,
//! if the peer sent what was not read).

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice};
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use efabus_core::caps::FabricInfo;
use efabus_core::codec;
use efabus_core::frame::{ErrorCode, ErrorFrame, Frame};
use efabus_core::log_limit::LogLimit;
use efabus_core::transport::{
    CloseReason, DirectSend, Endpoint, EndpointConfig, Event, OutFrame, PeerId, Readiness,
    SendError, Transport, TransportError,
};
use mio::net::{TcpListener, TcpStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::Mutex;

use crate::prefix;
use crate::tls::{host_of, HandshakeWorkers, TlsContext, Wire};

/// The scheme naming this transport in endpoint strings: the one
/// negotiation always falls back to ([`TCP_SCHEME`](efabus_core::caps::TCP_SCHEME)).
pub const SCHEME: &str = efabus_core::caps::TCP_SCHEME;

/// Most bytes read from one connection in one `poll`, unless the option
/// `read_budget` says otherwise.
pub const READ_BUDGET: usize = 1 << 20;

/// Most connections accepted in one `poll`.
pub const ACCEPT_BUDGET: usize = 256;

/// Errors of accept(2) that say nothing of the listener: a connection
/// that died in the backlog, or the network errors its manual says to
/// retry at once.
fn accept_retries_at_once(code: i32) -> bool {
    [
        libc::ECONNABORTED,
        libc::ENETDOWN,
        libc::EPROTO,
        libc::ENOPROTOOPT,
        libc::EHOSTDOWN,
        libc::ENONET,
        libc::EHOSTUNREACH,
        libc::EOPNOTSUPP,
        libc::ENETUNREACH,
    ]
    .contains(&code)
}

/// How long a locally closed connection may keep flushing and draining.
pub const LINGER: Duration = Duration::from_secs(5);

/// Locally closed connections left flushing and draining at most: past
/// it the one closed longest ago goes at once, so a flood of refused
/// connections cannot hold descriptors without bound.
pub const MAX_LINGERING: usize = 1024;

/// How long accepting waits after the system refused a connection for
/// want of descriptors or memory. The listener does not signal again for
/// connections already waiting in its backlog, so it is asked again then.
pub const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Room a busy connection's read buffer grows by when it must grow.
const READ_CHUNK: usize = 64 << 10;

/// Smallest free room a busy connection reads into: less than this, and the
/// buffer grows by [`READ_CHUNK`] first. (Frames received earlier may still
/// hold the buffer, so growing often means a new buffer to allocate and
/// zero.)
const READ_MIN: usize = 16 << 10;

/// The read buffer of a quiet connection (whose reads come back short):
/// small, so thousands of idle peers cost little memory and a message now
/// and then costs no large buffer to allocate and zero.
const QUIET_BUF: usize = 4 << 10;

/// Smallest free room a quiet connection reads into.
const QUIET_MIN: usize = 512;
/// Bytes read at a time from a closing connection, to be thrown away.
const DISCARD_CHUNK: usize = 8 << 10;

/// Most buffers handed to one `write_vectored` (well below `IOV_MAX`).
const MAX_IOV: usize = 256;

const WAKER: Token = Token(0);
const LISTENER: Token = Token(1);

/// Hashes connection tokens (small integers this endpoint issues, never
/// chosen by a peer) with one multiplication: looked up for every frame
/// sent, where SipHash would cost more than the rest of the lookup.
#[derive(Default, Clone, Copy)]
struct TokenHasher(u64);

impl std::hash::Hasher for TokenHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type TokenMap<V> = HashMap<Token, V, std::hash::BuildHasherDefault<TokenHasher>>;

/// Connection tokens follow the two fixed ones; an id this endpoint could
/// not have issued maps to no token.
fn token_of(peer: PeerId) -> Option<Token> {
    let n = usize::try_from(peer.0).ok()?.checked_add(2)?;
    Some(Token(n))
}

fn peer_of(token: Token) -> PeerId {
    PeerId(token.0.saturating_sub(2) as u64)
}

/// The TCP transport.
#[derive(Debug, Default, Clone, Copy)]
pub struct TcpTransport;

impl TcpTransport {
    pub fn new() -> Self {
        TcpTransport
    }

    /// Open an endpoint with its concrete type.
    pub fn open_tcp(&self, config: &EndpointConfig) -> Result<TcpEndpoint, TransportError> {
        TcpEndpoint::open(config)
    }
}

impl Transport for TcpTransport {
    fn scheme(&self) -> &str {
        SCHEME
    }

    fn infos(&self) -> Result<Vec<FabricInfo>, TransportError> {
        Ok(vec![FabricInfo::tcp(None)])
    }

    fn open(&self, config: &EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        Ok(Box::new(TcpEndpoint::open(config)?))
    }
}

/// Why a connection is being dropped.
enum Gone {
    Peer,
    Failed(String),
    /// The peer declared a frame above the limit: answer, then close.
    TooLarge(String),
}

/// The error frame a peer gets when it declares a frame above the limit.
fn too_large_frame(text: &str) -> OutFrame {
    codec::encode(&Frame::Error(ErrorFrame {
        code: ErrorCode::PayloadTooLarge,
        text: text.to_string(),
        fatal: true,
    }))
}

/// Frames and runs queued for a connection, in order, with their count.
#[derive(Default)]
struct Parts {
    /// Each part with the number of frames it completes (0 for a frame's
    /// head, 1 for its last part, n for a run of n whole frames).
    parts: VecDeque<(Bytes, usize)>,
    frames: usize,
    bytes: usize,
}

impl Parts {
    /// Whether the bounds take `frames` more frames of `len` bytes. An
    /// empty queue always takes one send, so a frame or run larger than
    /// the byte bound (but within `max_frame`) can still pass.
    fn takes(&self, frames: usize, len: usize, limits: &Limits) -> bool {
        self.frames == 0
            || (self.frames + frames <= limits.queue_frames
                && self.bytes + len <= limits.queue_bytes)
    }

    fn push_frame(&mut self, frame: OutFrame) {
        let len = frame.len();
        let OutFrame { head, body } = frame;
        if body.is_empty() {
            self.parts.push_back((head, 1));
        } else {
            if !head.is_empty() {
                self.parts.push_back((head, 0));
            }
            self.parts.push_back((body, 1));
        }
        self.frames += 1;
        self.bytes += len;
    }

    fn push_run(&mut self, run: Bytes, frames: usize) {
        self.frames += frames;
        self.bytes += run.len();
        self.parts.push_back((run, frames));
    }

    /// Puts `later` behind what is queued.
    fn append(&mut self, mut later: Parts) {
        self.frames += later.frames;
        self.bytes += later.bytes;
        self.parts.append(&mut later.parts);
    }

    fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }
}

/// The sending half of a connection. The endpoint and the peer's
/// [`DirectSend`] handles share it behind a lock, so frames from either
/// queue in one order.
struct Out {
    stream: Arc<Wire>,
    connected: bool,
    /// `close` was called: take nothing more, shut down once flushed.
    closing: bool,
    /// The write side has been shut down.
    shut: bool,
    queue: Parts,
    /// A send was refused; owe the caller a `Writable`.
    blocked: bool,
    /// The socket refused bytes; wait for its writable edge before writing.
    write_blocked: bool,
    /// A write made on the spot failed; the next poll drops the connection.
    broken: Option<String>,
    /// `write_vectored` calls made, for tests and diagnostics.
    writes: u64,
}

impl Out {
    fn new(stream: Arc<Wire>, connected: bool) -> Self {
        Out {
            stream,
            connected,
            closing: false,
            shut: false,
            queue: Parts::default(),
            blocked: false,
            write_blocked: false,
            broken: None,
            writes: 0,
        }
    }

    /// Write now if the socket may take it; a failure is kept in `broken`
    /// for the endpoint to report. True when nothing is left to write.
    fn write_now(&mut self) -> bool {
        if self.connected && !self.write_blocked && self.broken.is_none() {
            if let Err(err) = self.flush() {
                self.broken = Some(describe(&err));
            }
        }
        self.queue.is_empty() && !self.stream.has_pending()
    }

    /// Write queued parts until done or the socket is full.
    fn flush(&mut self) -> io::Result<()> {
        // During a worker's handshake step the session is the worker's; its
        // call back has the connection serviced, and flushed, again.
        if !self.connected || self.stream.in_handshake_step() {
            return Ok(());
        }
        while !self.queue.is_empty() {
            let mut iov = [IoSlice::new(&[]); MAX_IOV];
            let mut n = 0;
            for ((part, _), slot) in self.queue.parts.iter().zip(iov.iter_mut()) {
                *slot = IoSlice::new(part);
                n += 1;
            }
            self.writes += 1;
            match self.stream.write_vectored(&iov[..n]) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "socket accepted no bytes",
                    ))
                }
                Ok(written) => self.consume(written),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    self.write_blocked = true;
                    break;
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(err),
            }
        }
        // TLS records the socket did not take yet go before anything else.
        if self.queue.is_empty() && !self.write_blocked && !self.stream.flush_pending()? {
            self.write_blocked = true;
        }
        if self.queue.is_empty() && self.closing && !self.shut && !self.stream.has_pending() {
            self.shut = true;
            // Sends FIN once everything queued is out; the peer reads it as
            // an orderly close after the last frame.
            if let Err(err) = self.stream.shutdown_write() {
                if err.kind() != io::ErrorKind::NotConnected {
                    return Err(err);
                }
            }
        }
        Ok(())
    }

    fn consume(&mut self, mut written: usize) {
        let queue = &mut self.queue;
        queue.bytes -= written.min(queue.bytes);
        while written > 0 {
            let Some((part, frames)) = queue.parts.front_mut() else {
                return;
            };
            if part.len() <= written {
                written -= part.len();
                queue.frames -= (*frames).min(queue.frames);
                queue.parts.pop_front();
            } else {
                part.advance(written);
                written = 0;
            }
        }
    }

    /// True when a refused sender may go again.
    fn drained_to_half(&self, queue_frames: usize, queue_bytes: usize) -> bool {
        self.queue.frames <= queue_frames / 2 && self.queue.bytes <= queue_bytes / 2
    }
}

/// Connections whose direct senders need the endpoint's attention (a write
/// failed), and the waker that makes the endpoint poll them.
struct Attention {
    tokens: Mutex<Vec<Token>>,
    /// `tokens` may hold some: read without the lock by `has_own_work`.
    called: AtomicBool,
    waker: Waker,
}

impl Attention {
    fn call(&self, token: Token) {
        self.tokens.lock().push(token);
        self.called.store(true, Ordering::Release);
        if let Err(err) = self.waker.wake() {
            tracing::warn!("tcp: cannot wake endpoint: {err}");
        }
    }
}

/// A peer's [`DirectSend`] handle: writes on the caller's thread, into the
/// connection's shared sending half.
struct Direct {
    token: Token,
    out: Arc<Mutex<Out>>,
    limits: Limits,
    attention: Arc<Attention>,
}

impl Direct {
    fn after_write(&self, out: &Out) {
        if out.broken.is_some() {
            self.attention.call(self.token);
        }
    }
}

impl DirectSend for Direct {
    fn send(&self, frame: OutFrame) -> Result<(), SendError> {
        prefix::check(&frame, self.limits.max_frame)?;
        let mut out = self.out.lock();
        if out.closing || out.broken.is_some() {
            return Err(SendError::Closed(peer_of(self.token)));
        }
        if !out.queue.takes(1, frame.len(), &self.limits) {
            return Err(SendError::WouldBlock(frame));
        }
        out.queue.push_frame(frame);
        out.write_now();
        self.after_write(&out);
        Ok(())
    }

    fn send_run(&self, run: Bytes) -> Result<(), SendError> {
        let frames = count_run(&run, self.limits.max_frame)?;
        if frames == 0 {
            return Ok(());
        }
        let mut out = self.out.lock();
        if out.closing || out.broken.is_some() {
            return Err(SendError::Closed(peer_of(self.token)));
        }
        if !out.queue.takes(frames, run.len(), &self.limits) {
            return Err(SendError::WouldBlock(OutFrame::whole(run)));
        }
        out.queue.push_run(run, frames);
        out.write_now();
        self.after_write(&out);
        Ok(())
    }
}

/// The number of whole frames in a run, each checked against `max_frame`;
/// an error when the run ends inside a frame.
fn count_run(run: &[u8], max_frame: usize) -> Result<usize, SendError> {
    let mut frames = 0;
    let mut at = 0;
    while at < run.len() {
        let Some(total) = prefix::declared_total(&run[at..]) else {
            return Err(run_error(format!(
                "a run of {} bytes ends inside a length prefix at byte {at}",
                run.len()
            )));
        };
        if total > max_frame {
            return Err(SendError::TooLarge {
                len: total,
                max: max_frame,
            });
        }
        if at + total > run.len() {
            return Err(run_error(format!(
                "a run of {} bytes ends inside the frame at byte {at}",
                run.len()
            )));
        }
        at += total;
        frames += 1;
    }
    Ok(frames)
}

struct Conn {
    stream: Arc<Wire>,
    remote: String,
    /// The host a TLS client session verifies the server against (kept
    /// for a connect that moves on to the next address).
    tls_host: Option<String>,
    /// Addresses still to try if the current connect fails.
    fallbacks: Vec<SocketAddr>,
    /// Why earlier addresses failed, for the final error.
    failures: Vec<String>,
    connected: bool,
    /// `close` was called at this instant; the peer id is no longer visible.
    closing: Option<Instant>,
    out: Arc<Mutex<Out>>,
    /// Listed in the endpoint's flush list.
    dirty: bool,
    /// Stopped reading at the budget; read again on the next poll.
    read_more: bool,
    /// The caller asked to stop reading (backpressure); readiness seen
    /// meanwhile is remembered in `read_more`.
    read_paused: bool,
    /// The peer's close (or an error) was signalled: read until the end.
    hup: bool,
    /// The last read filled all the room it was given: read in large
    /// chunks.
    busy: bool,
    /// The poll round that last serviced this connection.
    round: u64,
    /// The largest frame accepted from this peer, when lower than the
    /// endpoint's `max_frame` (see `Endpoint::set_receive_limit`).
    frame_limit: Option<usize>,
    /// A frame over `frame_limit` waits in the buffer behind frames the
    /// caller had not seen yet; it is looked at again on the next read.
    deferred: bool,
    /// Received bytes: `[..filled]` is data, the rest is free room.
    rbuf: BytesMut,
    filled: usize,
    /// Scratch: where each whole frame of a read ends.
    ends: Vec<usize>,
}

/// What [`Conn::split_frames`] left in the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    /// At most part of a frame, waiting for more bytes.
    Done,
    /// A frame over the receive limit, to be looked at again once the
    /// caller has seen the frames before it.
    Deferred,
}

impl Conn {
    fn new(stream: Wire, remote: String, connected: bool) -> Self {
        let stream = Arc::new(stream);
        Conn {
            out: Arc::new(Mutex::new(Out::new(stream.clone(), connected))),
            stream,
            remote,
            tls_host: None,
            fallbacks: Vec::new(),
            failures: Vec::new(),
            connected,
            closing: None,
            dirty: false,
            read_more: false,
            read_paused: false,
            hup: false,
            busy: false,
            round: 0,
            frame_limit: None,
            deferred: false,
            rbuf: BytesMut::new(),
            filled: 0,
            ends: Vec::new(),
        }
    }

    /// Make sure at least `want` bytes of free room follow the data,
    /// growing by at least [`READ_CHUNK`] (busy) or [`QUIET_BUF`] (quiet)
    /// when it must grow.
    fn room(&mut self, want: usize) {
        if self.rbuf.len() < self.filled + want {
            let grow = if self.busy { READ_CHUNK } else { QUIET_BUF };
            let mut len = self.filled + want.max(grow);
            if let Some(limit) = self.frame_limit {
                // A limited peer's buffer stays near its limit.
                len = len.min((self.filled + want).max(limit));
            }
            // Only the new tail is zeroed; room left from earlier reads is
            // reused as it is.
            self.rbuf.resize(len, 0);
        }
    }

    /// Read until the socket would block or the budget is spent, delivering
    /// whole frames. `Err` means the connection is over.
    fn read(&mut self, peer: PeerId, limits: &Limits, events: &mut Vec<Event>) -> Result<(), Gone> {
        let (max_frame, runs) = (limits.max_frame, limits.runs);
        let mut budget = limits.read_budget;
        let mut read_now = 0;
        self.read_more = false;
        // A frame held back at the receive limit is looked at again first:
        // the frames before it may have lifted the limit.
        let handed_on = events.len();
        if std::mem::take(&mut self.deferred)
            && self.split_frames(peer, max_frame, runs, false, events)? == Split::Deferred
        {
            self.deferred = true;
            self.read_more = true;
            return Ok(());
        }
        loop {
            if budget == 0 {
                self.read_more = true;
                return Ok(());
            }
            // Room for the rest of the frame being received, if its length
            // is known (and was checked), else a chunk. The room grows with
            // what has arrived (to at most five times it, past a chunk), so
            // a declared length alone claims no memory, and a large frame
            // is copied by few regrowths.
            let least = if self.busy { READ_MIN } else { QUIET_MIN };
            let want = match prefix::declared_total(&self.rbuf[..self.filled]) {
                Some(total) if total > self.filled => (total - self.filled)
                    .min(self.filled.saturating_mul(4).max(READ_CHUNK))
                    .max(least),
                _ => least,
            };
            self.room(want);
            let end = self.rbuf.len().min(self.filled + budget);
            let free = &mut self.rbuf[self.filled..end];
            let asked = free.len();
            match self.stream.read(free) {
                Ok(0) => {
                    return Err(if self.filled == 0 {
                        Gone::Peer
                    } else if !self.stream.is_tls() && looks_like_tls(&self.rbuf[..self.filled]) {
                        Gone::Failed(
                            "the peer speaks TLS and this side does not: connect with TLS \
                             (a CA to verify the server with: tls.ca, --tls-ca)"
                                .to_string(),
                        )
                    } else {
                        Gone::Failed(format!(
                            "peer closed with {} bytes of an unfinished frame",
                            self.filled
                        ))
                    })
                }
                Ok(n) => {
                    self.busy = n == asked;
                    self.filled += n;
                    read_now += n;
                    budget = budget.saturating_sub(n);
                    // Frames handed on earlier in this call count as just
                    // handed on: the caller has not seen them yet either.
                    let behind_frames = events.len() > handed_on;
                    if self.split_frames(peer, max_frame, runs, behind_frames, events)?
                        == Split::Deferred
                    {
                        self.deferred = true;
                        self.read_more = true;
                        return Ok(());
                    }
                    // Less than asked: the socket is empty for now, and
                    // whatever arrives next raises a new (edge) event, so
                    // the read that would only say so is skipped. Not when
                    // the peer's close was signalled: that must be read.
                    // A TLS session may hold more than it handed over:
                    // read it until the socket would block.
                    if n < asked && !self.hup && !self.stream.is_tls() {
                        self.release_if_quiet(read_now);
                        return Ok(());
                    }
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    self.release_if_quiet(read_now);
                    return Ok(());
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(Gone::Failed(describe(&err))),
            }
        }
    }

    /// A connection gone quiet between frames gives back a large buffer,
    /// so thousands of idle peers cost little memory; busy ones keep it,
    /// and quiet ones keep a small one.
    fn release_if_quiet(&mut self, read_now: usize) {
        if self.filled == 0 && read_now < READ_CHUNK / 4 && self.rbuf.capacity() > QUIET_BUF {
            self.rbuf = BytesMut::new();
        }
    }

    /// Hand on the whole frames at the front of the buffer. A frame over
    /// the peer's receive limit (but within `max_frame`) right behind
    /// frames the caller has not seen yet (handed on now, or earlier in
    /// this read: `behind_frames`) is deferred: those frames (a hello) may
    /// lift the limit before it is looked at again.
    fn split_frames(
        &mut self,
        peer: PeerId,
        max_frame: usize,
        runs: bool,
        behind_frames: bool,
        events: &mut Vec<Event>,
    ) -> Result<Split, Gone> {
        let limit = self
            .frame_limit
            .map_or(max_frame, |limit| limit.min(max_frame));
        // The whole frames at the front leave the buffer in one piece; each
        // frame is a slice of that piece (cheaper than splitting one by one).
        let mut whole = 0;
        let mut ends = std::mem::take(&mut self.ends);
        ends.clear();
        let mut too_large = None;
        let mut deferred = false;
        while let Some(total) = prefix::declared_total(&self.rbuf[whole..self.filled]) {
            if total > limit {
                if total <= max_frame && (whole > 0 || behind_frames) {
                    deferred = true;
                } else {
                    // The frames before it still arrive.
                    too_large = Some(total);
                }
                break;
            }
            if self.filled - whole < total {
                break;
            }
            whole += total;
            ends.push(whole);
        }
        if whole > 0 && runs && ends.len() > 1 {
            let run = self.rbuf.split_to(whole).freeze();
            self.filled -= whole;
            events.push(Event::Frames { peer, run });
        } else if whole > 0 {
            let mut piece = self.rbuf.split_to(whole).freeze();
            self.filled -= whole;
            let mut start = 0;
            let last = ends.len() - 1;
            for &end in &ends[..last] {
                events.push(Event::Frame {
                    peer,
                    frame: piece.slice(start..end),
                });
                start = end;
            }
            // The last frame is what is left of the piece.
            piece.advance(start);
            events.push(Event::Frame { peer, frame: piece });
        }
        self.ends = ends;
        match too_large {
            Some(total) => Err(Gone::TooLarge(format!(
                "peer declared a frame of {total} bytes, above the limit of {limit}"
            ))),
            None if deferred => Ok(Split::Deferred),
            None => Ok(Split::Done),
        }
    }

    /// Read and discard (a closing connection): keeps the receive queue
    /// empty so closing sends FIN, not a reset. True when the peer is done.
    /// A closing connection keeps no read buffer: what still arrives is
    /// discarded (thousands of refused connections hold nothing).
    fn release_read_buffer(&mut self) {
        self.filled = 0;
        self.rbuf = BytesMut::new();
    }

    fn drain_discard(&mut self, limits: &Limits) -> bool {
        // Discarded bytes go through a small buffer on the stack.
        self.release_read_buffer();
        let mut sink = [0u8; DISCARD_CHUNK];
        let mut budget = limits.read_budget;
        loop {
            let end = sink.len().min(budget);
            match self.stream.read(&mut sink[..end]) {
                Ok(0) => return true,
                Ok(n) => {
                    budget = budget.saturating_sub(n);
                    if budget == 0 {
                        self.read_more = true;
                        return false;
                    }
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return false,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return true,
            }
        }
    }
}

/// Whether `bytes` start as a TLS record (an alert or a handshake, TLS
/// 1.x), which no efabus frame does at the sizes the handshake sends.
fn looks_like_tls(bytes: &[u8]) -> bool {
    matches!(bytes, [0x15 | 0x16, 0x03, 0x01..=0x04, ..])
}

fn run_error(text: String) -> SendError {
    SendError::Transport(TransportError::Other(text))
}

fn describe(err: &io::Error) -> String {
    match err.kind() {
        io::ErrorKind::ConnectionReset => "connection reset by peer".into(),
        io::ErrorKind::ConnectionAborted => "connection aborted".into(),
        io::ErrorKind::BrokenPipe => "broken pipe (peer gone)".into(),
        io::ErrorKind::TimedOut => "connection timed out".into(),
        _ => err.to_string(),
    }
}

/// Per-endpoint bounds, set at open; a reload may change the queue bounds
/// ([`Endpoint::reconfigure`]), for the endpoint's own sends from then on.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_frame: usize,
    queue_frames: usize,
    queue_bytes: usize,
    read_budget: usize,
    /// Frames read together go in one [`Event::Frames`]
    /// ([`Endpoint::deliver_runs`]).
    runs: bool,
}

impl Limits {
    fn from_config(config: &EndpointConfig) -> Result<Self, TransportError> {
        let read_budget = match config.option("read_budget") {
            None => READ_BUDGET,
            Some(text) => text
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| {
                    TransportError::Other(format!(
                        "tcp option read_budget={text:?}: expected a positive byte count"
                    ))
                })?,
        };
        let mut limits = Limits {
            max_frame: config.max_frame,
            queue_frames: 1,
            queue_bytes: 1,
            read_budget,
            runs: false,
        };
        limits.set_queue(config);
        Ok(limits)
    }

    /// The queue bounds of `config` (at open, and from a reload).
    fn set_queue(&mut self, config: &EndpointConfig) {
        self.queue_frames = config.queue_frames.max(1);
        self.queue_bytes = config.queue_bytes.max(1);
    }
}

/// An endpoint of the TCP transport. See the module docs.
pub struct TcpEndpoint {
    poll: Poll,
    events: Events,
    /// The waker, shared with direct senders, and the connections they
    /// flag.
    attention: Arc<Attention>,
    /// A wake-up is outstanding (not yet consumed by `poll`).
    woken: bool,
    listener: Option<TcpListener>,
    local: String,
    accept_more: bool,
    conns: TokenMap<Conn>,
    next_peer: u64,
    limits: Limits,
    /// The receive limit accepted connections start with.
    accepted_frame_limit: Option<usize>,
    pending: VecDeque<Event>,
    /// Connections with frames queued since the last poll.
    dirty: Vec<Token>,
    /// Connections that stopped reading at the budget.
    read_more: Vec<Token>,
    /// Connections closed locally and still flushing or draining, in the
    /// order they were closed (so also the order their [`LINGER`] ends);
    /// those dropped since are skipped when their turn comes.
    lingering: VecDeque<(Instant, Token)>,
    /// Connections of `lingering` not dropped yet, and how many may be.
    lingering_live: usize,
    max_lingering: usize,
    /// When accepting is tried again after the system refused it (see
    /// [`ACCEPT_RETRY`]).
    accept_retry_at: Option<Instant>,
    /// Accept failures logged at a bounded rate.
    accept_failure_log: LogLimit,
    round: u64,
    /// Connections to service this poll: readable, writable, closed.
    scratch: Vec<(Token, bool, bool, bool)>,
    /// TLS for accepted and dialed connections, when the options ask.
    tls: Option<TlsContext>,
    /// Dialed host names whose addresses are being looked up.
    resolving: HashMap<Token, Resolving>,
    /// Lookups still running for peers closed meanwhile: their answers
    /// serve the next dial (a dial closed by its owner's handshake timeout
    /// while the resolver was slow is then answered at once).
    orphaned_lookups: Vec<(String, Receiver<LookupAnswer>)>,
    /// Addresses looked up lately, by `host:port`, and when.
    answers: HashMap<String, (Instant, Vec<SocketAddr>)>,
    /// How a host name is looked up ([`resolve`]; tests put theirs).
    lookup: Lookup,
}

type LookupAnswer = Result<Vec<SocketAddr>, TransportError>;
type Lookup = Arc<dyn Fn(&str) -> LookupAnswer + Send + Sync>;

/// Host names looked up at once (a thread each, closed dials' included); a
/// dial past them fails (and is retried by its owner).
const RESOLVING_MAX: usize = 64;
/// How long a looked-up address list serves later dials of the same name.
const ANSWER_TTL: Duration = Duration::from_secs(30);

/// A dial waiting for its host name's addresses (see the module docs), and
/// what was asked of the connection meanwhile.
struct Resolving {
    peer: PeerId,
    /// `host:port` as dialed, and the host alone (for TLS).
    addr: String,
    host: String,
    answer: Receiver<LookupAnswer>,
    /// Frames and runs sent meanwhile, within the connection's bounds.
    queued: Parts,
    /// A send was refused for room: `Writable` follows once it is dialed.
    blocked: bool,
    receive_limit: Option<Option<usize>>,
    read_paused: bool,
}

impl Resolving {
    /// Whether the connection's bounds take this much more; `Writable` is
    /// owed when not.
    fn has_room(&mut self, frames: usize, len: usize, limits: &Limits) -> bool {
        let room = self.queued.takes(frames, len, limits);
        self.blocked |= !room;
        room
    }
}

impl std::fmt::Debug for TcpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpEndpoint")
            .field("local", &self.local)
            .field("conns", &self.conns.len())
            .finish()
    }
}

fn resolve(addr: &str) -> Result<Vec<SocketAddr>, TransportError> {
    let invalid = |reason: String| TransportError::InvalidAddress {
        addr: addr.to_string(),
        reason,
    };
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|err| invalid(format!("expected host:port ({err})")))?
        .collect();
    if addrs.is_empty() {
        return Err(invalid("the name resolves to no address".into()));
    }
    Ok(addrs)
}

impl TcpEndpoint {
    /// Open an endpoint, listening when `config.bind` is set (`host:port`,
    /// port 0 picks a free port; see `local_addr`).
    pub fn open(config: &EndpointConfig) -> Result<Self, TransportError> {
        let tls = TlsContext::from_config(config, config.bind.is_some())?;
        Self::open_with_tls(config, tls)
    }

    /// [`open`](Self::open) with the TLS context given rather than read
    /// from the options.
    fn open_with_tls(
        config: &EndpointConfig,
        tls: Option<TlsContext>,
    ) -> Result<Self, TransportError> {
        let limits = Limits::from_config(config)?;
        let poll = Poll::new()?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        let (listener, local) = match &config.bind {
            Some(bind) => {
                let addr = resolve(bind)?[0];
                let mut listener =
                    TcpListener::bind(addr).map_err(|source| TransportError::Bind {
                        addr: bind.clone(),
                        source,
                    })?;
                let local = listener.local_addr()?.to_string();
                poll.registry()
                    .register(&mut listener, LISTENER, Interest::READABLE)?;
                (Some(listener), local)
            }
            None => (None, String::new()),
        };
        Ok(TcpEndpoint {
            poll,
            events: Events::with_capacity(256),
            attention: Arc::new(Attention {
                tokens: Mutex::new(Vec::new()),
                called: AtomicBool::new(false),
                waker,
            }),
            woken: false,
            listener,
            local,
            accept_more: false,
            conns: TokenMap::default(),
            next_peer: 1,
            limits,
            accepted_frame_limit: None,
            pending: VecDeque::new(),
            dirty: Vec::new(),
            read_more: Vec::new(),
            lingering: VecDeque::new(),
            lingering_live: 0,
            max_lingering: MAX_LINGERING,
            accept_retry_at: None,
            accept_failure_log: LogLimit::new(Duration::from_secs(10)),
            round: 0,
            scratch: Vec::new(),
            tls,
            resolving: HashMap::new(),
            orphaned_lookups: Vec::new(),
            answers: HashMap::new(),
            lookup: Arc::new(resolve),
        })
    }

    /// A TLS client session for a connection to `host`, if this endpoint
    /// dials with TLS.
    fn client_session(
        &self,
        host: Option<&str>,
    ) -> Result<Option<rustls::Connection>, TransportError> {
        match (&self.tls, host) {
            (Some(tls), Some(host)) => tls.connect(host).map(Some),
            _ => Ok(None),
        }
    }

    /// The address the listener is bound to (`ip:port`), empty when the
    /// endpoint only connects out.
    pub fn local_socket_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Connect to the first of `addrs` that answers, in order.
    fn connect_any(
        &mut self,
        addrs: Vec<SocketAddr>,
        host: &str,
    ) -> Result<PeerId, TransportError> {
        // A name TLS cannot verify against fails here, before connecting.
        self.client_session(self.tls.is_some().then_some(host))?;
        let (peer, token) = self.peek_id()?;
        self.next_peer += 1;
        self.dial(peer, token, addrs, host)?;
        Ok(peer)
    }

    /// Look `addr`'s host name up on a thread of its own; the poll that
    /// finds the answer dials it ([`TcpEndpoint::settle_resolutions`]).
    fn connect_by_name(&mut self, addr: &str) -> Result<PeerId, TransportError> {
        let invalid = |reason: &str| TransportError::InvalidAddress {
            addr: addr.to_string(),
            reason: reason.to_string(),
        };
        let Some((host, port)) = addr.rsplit_once(':') else {
            return Err(invalid("expected host:port"));
        };
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(invalid("expected host:port"));
        }
        let host = host_of(addr).to_string();
        match self.answers.get(addr) {
            Some((at, addrs)) if at.elapsed() < ANSWER_TTL => {
                let addrs = addrs.clone();
                return self.connect_any(addrs, &host);
            }
            Some(_) => {
                self.answers.remove(addr);
            }
            None => {}
        }
        self.client_session(self.tls.is_some().then_some(host.as_str()))?;
        let (peer, token) = self.peek_id()?;
        // A lookup of the name left running by a closed dial serves this one.
        let answer = match self
            .orphaned_lookups
            .iter()
            .position(|(name, _)| name == addr)
        {
            Some(at) => self.orphaned_lookups.swap_remove(at).1,
            None => self.start_lookup(addr)?,
        };
        self.next_peer += 1;
        self.resolving.insert(
            token,
            Resolving {
                peer,
                addr: addr.to_string(),
                host,
                answer,
                queued: Parts::default(),
                blocked: false,
                receive_limit: None,
                read_paused: false,
            },
        );
        Ok(peer)
    }

    /// A thread that looks `addr` up and wakes the endpoint with the answer.
    fn start_lookup(&self, addr: &str) -> Result<Receiver<LookupAnswer>, TransportError> {
        if self.resolving.len() + self.orphaned_lookups.len() >= RESOLVING_MAX {
            return Err(TransportError::Other(format!(
                "{RESOLVING_MAX} host names are being looked up already; dial {addr} again later"
            )));
        }
        let (tell, answer) = std::sync::mpsc::channel();
        let attention = Arc::clone(&self.attention);
        let lookup = Arc::clone(&self.lookup);
        let name = addr.to_string();
        std::thread::Builder::new()
            .name("efabus-resolve".into())
            .spawn(move || {
                // The endpoint may be gone, and its receiver with it.
                let _ = tell.send(lookup(&name));
                if let Err(err) = attention.waker.wake() {
                    tracing::warn!("tcp: cannot wake endpoint: {err}");
                }
            })
            .map_err(|err| TransportError::Other(format!("cannot look {addr} up: {err}")))?;
        Ok(answer)
    }

    /// Keeps `addrs` for later dials of `addr`, forgetting those past
    /// [`ANSWER_TTL`].
    fn remember(&mut self, addr: &str, addrs: Vec<SocketAddr>, now: Instant) {
        self.answers
            .retain(|_, (at, _)| now.duration_since(*at) < ANSWER_TTL);
        self.answers.insert(addr.to_string(), (now, addrs));
    }

    /// Dial the host names whose addresses have come, handing each the
    /// frames sent meanwhile; a name that did not resolve closes its peer.
    fn settle_resolutions(&mut self, events: &mut Vec<Event>) {
        let now = Instant::now();
        let mut found = Vec::new();
        self.orphaned_lookups
            .retain(|(addr, answer)| match answer.try_recv() {
                Ok(Ok(addrs)) => {
                    found.push((addr.clone(), addrs));
                    false
                }
                Ok(Err(_)) | Err(TryRecvError::Disconnected) => false,
                Err(TryRecvError::Empty) => true,
            });
        for (addr, addrs) in found {
            self.remember(&addr, addrs, now);
        }
        let answered: Vec<(Token, LookupAnswer)> = self
            .resolving
            .iter()
            .filter_map(|(&token, waiting)| match waiting.answer.try_recv() {
                Ok(answer) => Some((token, answer)),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => Some((
                    token,
                    Err(TransportError::Other(
                        "the name lookup ended without an answer".into(),
                    )),
                )),
            })
            .collect();
        for (token, answer) in answered {
            let Some(waiting) = self.resolving.remove(&token) else {
                continue;
            };
            let peer = waiting.peer;
            if let Ok(addrs) = &answer {
                self.remember(&waiting.addr, addrs.clone(), now);
            }
            if let Err(err) = answer.and_then(|addrs| self.dial(peer, token, addrs, &waiting.host))
            {
                events.push(Event::Closed {
                    peer,
                    reason: CloseReason::Error(err.to_string()),
                });
                continue;
            }
            let Some(conn) = self.conns.get_mut(&token) else {
                // No address answered: its `Closed` is pending.
                continue;
            };
            if let Some(limit) = waiting.receive_limit {
                conn.frame_limit = limit;
            }
            conn.read_paused = waiting.read_paused;
            if !waiting.queued.is_empty() {
                // Taken within the queue's bounds already.
                conn.out.lock().queue.append(waiting.queued);
                if !conn.dirty {
                    conn.dirty = true;
                    self.dirty.push(token);
                }
                self.nudge();
            }
            if waiting.blocked {
                events.push(Event::Writable { peer });
            }
        }
    }

    /// Start connecting `peer` (its id issued, under `token`) to the first
    /// of `addrs` that answers; a connect that fails at once is reported
    /// as the peer's `Closed`, as a later failure is.
    fn dial(
        &mut self,
        peer: PeerId,
        token: Token,
        mut addrs: Vec<SocketAddr>,
        host: &str,
    ) -> Result<(), TransportError> {
        let tls_host = self.tls.is_some().then(|| host.to_string());
        let mut failures = Vec::new();
        match self.start_connect(token, &mut addrs, &mut failures) {
            Some((stream, addr)) => {
                let session = self.client_session(tls_host.as_deref())?;
                let mut conn = Conn::new(Wire::new(stream, session), addr.to_string(), false);
                conn.tls_host = tls_host;
                conn.fallbacks = addrs;
                conn.failures = failures;
                self.conns.insert(token, conn);
            }
            None => {
                // Same shape as a connect that fails later: an id, then Closed.
                self.pending.push_back(Event::Closed {
                    peer,
                    reason: CloseReason::Error(failures.join("; ")),
                });
                self.nudge();
            }
        }
        Ok(())
    }

    /// This endpoint described in fi_info terms, with its listening
    /// address as `src_addr`.
    pub fn info(&self) -> FabricInfo {
        FabricInfo::tcp(self.local_socket_addr())
    }

    /// Make the readiness descriptor readable so the caller polls again.
    fn nudge(&mut self) {
        if !self.woken {
            self.woken = true;
            if let Err(err) = self.attention.waker.wake() {
                tracing::warn!("tcp: cannot wake endpoint: {err}");
            }
        }
    }

    /// The next peer id and its token, without issuing it yet.
    fn peek_id(&self) -> Result<(PeerId, Token), TransportError> {
        let peer = PeerId(self.next_peer);
        let token =
            token_of(peer).ok_or_else(|| TransportError::Other("peer ids exhausted".into()))?;
        Ok((peer, token))
    }

    fn accept(&mut self, events: &mut Vec<Event>) {
        let Some(listener) = self.listener.as_ref() else {
            return;
        };
        self.accept_more = false;
        self.accept_retry_at = None;
        for _ in 0..ACCEPT_BUDGET {
            let (mut stream, remote) = match listener.accept() {
                Ok(pair) => pair,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
                // A connection that died in the backlog, or a network
                // error accept(2) says to retry at once: the next may do.
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) if err.raw_os_error().is_some_and(accept_retries_at_once) => continue,
                Err(err) => {
                    // Out of descriptors or memory (or worse): the
                    // listener itself stays usable, asked again later.
                    let now = Instant::now();
                    self.accept_retry_at = Some(now + ACCEPT_RETRY);
                    if let Some(held_back) = self.accept_failure_log.allow(now) {
                        let hint = if err.raw_os_error() == Some(libc::EMFILE) {
                            " (raise the descriptor limit, `ulimit -n`, if this goes on)"
                        } else {
                            ""
                        };
                        tracing::warn!(
                            held_back,
                            "tcp: accept on {} failed: {err}; trying again every \
                             {ACCEPT_RETRY:?}{hint}",
                            self.local
                        );
                    }
                    return;
                }
            };
            if let Err(err) = stream.set_nodelay(true) {
                tracing::debug!("tcp: TCP_NODELAY on {remote}: {err}");
            }
            let Ok((peer, token)) = self.peek_id() else {
                tracing::warn!("tcp: refusing {remote}: peer ids exhausted");
                return;
            };
            if let Err(err) = self.poll.registry().register(
                &mut stream,
                token,
                Interest::READABLE | Interest::WRITABLE,
            ) {
                tracing::warn!("tcp: cannot register connection from {remote}: {err}");
                continue;
            }
            let session = match self.tls.as_ref().map(TlsContext::accept).transpose() {
                Ok(session) => session.flatten(),
                Err(err) => {
                    tracing::warn!("tcp: refusing {remote}: {err}");
                    let _ = self.poll.registry().deregister(&mut stream);
                    continue;
                }
            };
            let mut wire = Wire::new(stream, session);
            // Without workers, handshakes run here, as they can; a plain
            // connection starts none.
            if let Some(workers) = wire.is_tls().then(HandshakeWorkers::shared).flatten() {
                let attention = Arc::clone(&self.attention);
                let call_back = Arc::new(move || attention.call(token));
                wire = wire.with_handshake_workers(workers, remote.ip(), call_back);
            }
            self.next_peer += 1;
            let mut conn = Conn::new(wire, remote.to_string(), true);
            conn.frame_limit = self.accepted_frame_limit;
            self.conns.insert(token, conn);
            events.push(Event::Accepted {
                peer,
                remote: remote.to_string(),
            });
        }
        self.accept_more = true;
    }

    /// Start a non-blocking connect to the first of `addrs` that gets going.
    /// Failures along the way are appended to `failures`.
    fn start_connect(
        &self,
        token: Token,
        addrs: &mut Vec<SocketAddr>,
        failures: &mut Vec<String>,
    ) -> Option<(TcpStream, SocketAddr)> {
        while !addrs.is_empty() {
            let addr = addrs.remove(0);
            match TcpStream::connect(addr) {
                Ok(mut stream) => {
                    if let Err(err) = stream.set_nodelay(true) {
                        tracing::debug!("tcp: TCP_NODELAY towards {addr}: {err}");
                    }
                    match self.poll.registry().register(
                        &mut stream,
                        token,
                        Interest::READABLE | Interest::WRITABLE,
                    ) {
                        Ok(()) => return Some((stream, addr)),
                        Err(err) => failures.push(format!("connect to {addr}: {err}")),
                    }
                }
                Err(err) => failures.push(format!("connect to {addr}: {}", describe(&err))),
            }
        }
        None
    }

    /// A connecting socket reported an event: settle whether it is up.
    /// `Err` carries every failure once no address is left to try.
    fn check_connect(&mut self, token: Token) -> Result<(), String> {
        let Some(conn) = self.conns.get_mut(&token) else {
            return Ok(());
        };
        let failure = match conn.stream.take_error() {
            Ok(Some(err)) | Err(err) => Some(err),
            Ok(None) => match conn.stream.peer_addr() {
                Ok(_) => None,
                Err(err) if err.kind() == io::ErrorKind::NotConnected => return Ok(()),
                Err(err) => Some(err),
            },
        };
        let Some(err) = failure else {
            conn.connected = true;
            conn.out.lock().connected = true;
            return Ok(());
        };
        let mut failures = std::mem::take(&mut conn.failures);
        failures.push(format!("connect to {}: {}", conn.remote, describe(&err)));
        let mut fallbacks = std::mem::take(&mut conn.fallbacks);
        let fd = conn.stream.as_raw_fd();
        let tls_host = conn.tls_host.clone();
        let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
        match self.start_connect(token, &mut fallbacks, &mut failures) {
            Some((stream, addr)) => {
                let session = self
                    .client_session(tls_host.as_deref())
                    .map_err(|err| err.to_string())?;
                let Some(conn) = self.conns.get_mut(&token) else {
                    return Ok(());
                };
                conn.remote = addr.to_string();
                conn.stream = Arc::new(Wire::new(stream, session));
                conn.out.lock().stream = conn.stream.clone();
                conn.fallbacks = fallbacks;
                conn.failures = failures;
                Ok(())
            }
            None => Err(failures.join("; ")),
        }
    }

    /// Remove a connection; report it unless it was closed locally.
    fn drop_conn(&mut self, token: Token, reason: CloseReason, events: &mut Vec<Event>) {
        if let Some(conn) = self.conns.remove(&token) {
            let fd = conn.stream.as_raw_fd();
            let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
            // Direct senders still holding the sending half find it closed,
            // and the socket goes now, whoever still holds it.
            conn.out.lock().closing = true;
            let _ = conn.stream.shutdown(Shutdown::Both);
            if conn.closing.is_none() {
                events.push(Event::Closed {
                    peer: peer_of(token),
                    reason,
                });
            } else {
                self.lingering_live -= 1;
            }
        }
    }

    /// A connection just closed locally lingers: past [`MAX_LINGERING`]
    /// of them, those closed longest ago go now (entries of connections
    /// dropped since are passed over).
    fn linger(&mut self, closed: Instant, token: Token) {
        self.lingering.push_back((closed, token));
        self.lingering_live += 1;
        while self.lingering_live > self.max_lingering {
            let Some((_, token)) = self.lingering.pop_front() else {
                break;
            };
            // Closed before, so dropping it reports nothing.
            self.drop_conn(token, CloseReason::Local, &mut Vec::new());
        }
    }

    /// A peer declared a frame above the limit: tell it why, flush that,
    /// then close as `close` does (the peer reads the error, then EOF),
    /// and report the connection closed with the reason.
    fn refuse_oversized(&mut self, token: Token, text: String, events: &mut Vec<Event>) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let now = Instant::now();
        conn.closing = Some(now);
        conn.release_read_buffer();
        // Whatever else the peer sent is read and discarded while lingering.
        conn.read_more = true;
        conn.read_paused = false;
        self.linger(now, token);
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let mut out = conn.out.lock();
        // Past the queue bounds if need be: one small frame, and nothing
        // more is queued after it.
        out.queue.push_frame(too_large_frame(&text));
        out.closing = true;
        let failed = out.flush().is_err();
        drop(out);
        if failed {
            self.drop_conn(token, CloseReason::Local, &mut Vec::new());
        }
        events.push(Event::Closed {
            peer: peer_of(token),
            reason: CloseReason::Error(text),
        });
    }

    /// Handle readiness of one connection.
    fn service(&mut self, token: Token, readable: bool, writable: bool, events: &mut Vec<Event>) {
        let Some(conn) = self.conns.get(&token) else {
            return;
        };
        if !conn.connected {
            match self.check_connect(token) {
                Ok(()) => {}
                Err(message) => {
                    self.drop_conn(token, CloseReason::Error(message), events);
                    return;
                }
            }
        }
        let limits = self.limits;
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        if !conn.connected {
            return;
        }
        let peer = peer_of(token);
        let mut out = conn.out.lock();
        if writable {
            out.write_blocked = false;
        }
        if let Some(text) = out.broken.take() {
            drop(out);
            self.drop_conn(token, CloseReason::Error(text), events);
            return;
        }
        if conn.closing.is_some() {
            let flushed = out.flush().is_ok();
            drop(out);
            // Drained to `WouldBlock`, the socket signals again when more
            // arrives: it is read again only if the budget stopped it.
            let read =
                readable || std::mem::take(&mut conn.read_more) || conn.stream.take_stepped();
            let done = read && conn.drain_discard(&limits);
            // A TLS read may have finished the handshake what is queued
            // waited for.
            let flushed = flushed && (!conn.stream.is_tls() || conn.out.lock().flush().is_ok());
            let expired = conn.closing.is_some_and(|t| t.elapsed() >= LINGER);
            if !flushed || done || expired {
                self.drop_conn(token, CloseReason::Local, events);
            }
            return;
        }
        drop(out);
        // A handshake step that ended on a worker left the rest to this
        // thread: the socket need not signal again.
        let readable = readable || conn.stream.take_stepped();
        // Read before writing: a peer that sent frames and then went away
        // makes writes fail, and its last frames must not be lost to that.
        if conn.read_paused {
            // Readiness is edge-triggered: remember it for the resume.
            conn.read_more |= readable;
        } else if readable || conn.read_more {
            let gone = match conn.read(peer, &limits, events) {
                Ok(()) => None,
                Err(Gone::Peer) => Some(CloseReason::PeerClosed),
                Err(Gone::Failed(text)) => Some(CloseReason::Error(text)),
                Err(Gone::TooLarge(text)) => {
                    self.refuse_oversized(token, text, events);
                    return;
                }
            };
            if let Some(reason) = gone {
                self.drop_conn(token, reason, events);
                return;
            }
        }
        // A TLS read may have finished the handshake that held back what
        // was queued, or left records of its own to send.
        if writable || conn.dirty || conn.stream.is_tls() {
            let mut out = conn.out.lock();
            if let Err(err) = out.flush() {
                drop(out);
                let reason = CloseReason::Error(describe(&err));
                self.drop_conn(token, reason, events);
                return;
            }
            if out.blocked && out.drained_to_half(limits.queue_frames, limits.queue_bytes) {
                out.blocked = false;
                events.push(Event::Writable { peer });
            }
        }
    }
}

impl Endpoint for TcpEndpoint {
    fn scheme(&self) -> &str {
        SCHEME
    }

    fn deliver_runs(&mut self) -> bool {
        self.limits.runs = true;
        true
    }

    fn local_addr(&self) -> Vec<u8> {
        self.local.clone().into_bytes()
    }

    fn max_frame(&self) -> usize {
        self.limits.max_frame
    }

    fn connect(&mut self, addr: &str) -> Result<PeerId, TransportError> {
        match addr.parse::<SocketAddr>() {
            Ok(socket) => self.connect_any(vec![socket], host_of(addr)),
            Err(_) => self.connect_by_name(addr),
        }
    }

    fn send(&mut self, peer: PeerId, frame: OutFrame) -> Result<(), SendError> {
        prefix::check(&frame, self.limits.max_frame)?;
        if let Some(waiting) = token_of(peer).and_then(|token| self.resolving.get_mut(&token)) {
            if !waiting.has_room(1, frame.len(), &self.limits) {
                return Err(SendError::WouldBlock(frame));
            }
            waiting.queued.push_frame(frame);
            return Ok(());
        }
        let Some((token, conn)) =
            token_of(peer).and_then(|token| Some((token, self.conns.get_mut(&token)?)))
        else {
            return Err(SendError::Closed(peer));
        };
        if conn.closing.is_some() {
            return Err(SendError::Closed(peer));
        }
        let mut out = conn.out.lock();
        if !out.queue.takes(1, frame.len(), &self.limits) {
            out.blocked = true;
            return Err(SendError::WouldBlock(frame));
        }
        out.queue.push_frame(frame);
        drop(out);
        if !conn.dirty {
            conn.dirty = true;
            self.dirty.push(token);
        }
        self.nudge();
        Ok(())
    }

    /// A run is queued as one part and, when the socket has room, written
    /// on the spot (with whatever was queued before it): a caller that
    /// batches its frames gets one system call per run and no wake-up.
    fn send_run(&mut self, peer: PeerId, run: Bytes) -> Result<(), SendError> {
        let frames = count_run(&run, self.limits.max_frame)?;
        if frames == 0 {
            return Ok(());
        }
        if let Some(waiting) = token_of(peer).and_then(|token| self.resolving.get_mut(&token)) {
            if !waiting.has_room(frames, run.len(), &self.limits) {
                return Err(SendError::WouldBlock(OutFrame::whole(run)));
            }
            waiting.queued.push_run(run, frames);
            return Ok(());
        }
        let Some((token, conn)) =
            token_of(peer).and_then(|token| Some((token, self.conns.get_mut(&token)?)))
        else {
            return Err(SendError::Closed(peer));
        };
        let mut out = conn.out.lock();
        if conn.closing.is_some() || out.broken.is_some() {
            return Err(SendError::Closed(peer));
        }
        if !out.queue.takes(frames, run.len(), &self.limits) {
            out.blocked = true;
            return Err(SendError::WouldBlock(OutFrame::whole(run)));
        }
        out.queue.push_run(run, frames);
        let settled = out.write_now() || (out.connected && out.write_blocked);
        let broken = out.broken.is_some();
        drop(out);
        if !settled || broken {
            // Reported (or written) by the next poll.
            if !conn.dirty {
                conn.dirty = true;
                self.dirty.push(token);
            }
            self.nudge();
        }
        Ok(())
    }

    fn direct_sender(&mut self, peer: PeerId) -> Option<Arc<dyn DirectSend>> {
        let token = token_of(peer)?;
        let conn = self.conns.get(&token)?;
        if conn.closing.is_some() {
            return None;
        }
        Some(Arc::new(Direct {
            token,
            out: conn.out.clone(),
            limits: self.limits,
            attention: self.attention.clone(),
        }))
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), TransportError> {
        // Consume readiness before doing the work, so anything arriving
        // after this point leaves the descriptor readable.
        self.woken = false;
        match self.poll.poll(&mut self.events, Some(Duration::ZERO)) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err.into()),
        }
        events.extend(self.pending.drain(..));
        if !self.resolving.is_empty() || !self.orphaned_lookups.is_empty() {
            self.settle_resolutions(events);
        }

        // Each connection is serviced at most once per poll: what epoll
        // reported, then those with unread data left over from the last
        // poll (budget), then those with frames queued since.
        self.round += 1;
        let round = self.round;
        let mut ready = std::mem::take(&mut self.scratch);
        ready.clear();
        let retry_due = self.accept_retry_at.is_some_and(|at| Instant::now() >= at);
        let mut listener_ready = self.accept_more || retry_due;
        for event in self.events.iter() {
            match event.token() {
                WAKER => {}
                LISTENER => listener_ready = true,
                token => {
                    if let Some(conn) = self.conns.get_mut(&token) {
                        conn.round = round;
                        ready.push((
                            token,
                            event.is_readable() || event.is_read_closed() || event.is_error(),
                            event.is_writable() || event.is_write_closed() || event.is_error(),
                            event.is_read_closed() || event.is_error(),
                        ));
                    }
                }
            }
        }
        let leftover = std::mem::take(&mut self.read_more);
        // Cleared before the take: a call after it is seen next time.
        self.attention.called.store(false, Ordering::Relaxed);
        let called = std::mem::take(&mut *self.attention.tokens.lock());
        for token in leftover
            .into_iter()
            .chain(self.dirty.drain(..))
            .chain(called)
        {
            if let Some(conn) = self.conns.get_mut(&token) {
                if conn.round != round {
                    conn.round = round;
                    ready.push((token, false, false, false));
                }
            }
        }
        for &(token, readable, writable, hup) in &ready {
            if hup {
                if let Some(conn) = self.conns.get_mut(&token) {
                    conn.hup = true;
                }
            }
            self.service(token, readable, writable, events);
            if let Some(conn) = self.conns.get_mut(&token) {
                conn.dirty = false;
                if conn.read_more && !conn.read_paused {
                    self.read_more.push(token);
                }
            }
        }
        self.scratch = ready;
        if listener_ready {
            self.accept(events);
        }

        // Locally closed connections that are past their time.
        while let Some(&(closed, token)) = self.lingering.front() {
            if closed.elapsed() < LINGER {
                break;
            }
            self.lingering.pop_front();
            self.drop_conn(token, CloseReason::Local, events);
        }

        if self.accept_more || !self.read_more.is_empty() {
            self.nudge();
        }
        Ok(())
    }

    fn close(&mut self, peer: PeerId) {
        let Some(token) = token_of(peer) else {
            return;
        };
        if let Some(waiting) = self.resolving.remove(&token) {
            // What was queued goes with it; the answer still serves the
            // next dial of the name.
            self.orphaned_lookups.push((waiting.addr, waiting.answer));
            self.pending.push_back(Event::Closed {
                peer,
                reason: CloseReason::Local,
            });
            self.nudge();
            return;
        }
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        if conn.closing.is_some() {
            return;
        }
        let now = Instant::now();
        conn.closing = Some(now);
        conn.release_read_buffer();
        self.linger(now, token);
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let mut out = conn.out.lock();
        out.closing = true;
        // A socket that fails now has nothing left to flush or drain.
        let failed = out.flush().is_err();
        drop(out);
        if failed {
            self.drop_conn(token, CloseReason::Local, &mut Vec::new());
        }
        self.pending.push_back(Event::Closed {
            peer,
            reason: CloseReason::Local,
        });
        self.nudge();
    }

    fn peer_certificate(&self, peer: PeerId) -> Option<Vec<u8>> {
        let conn = self.conns.get(&token_of(peer)?)?;
        conn.stream.peer_certificate()
    }

    fn reload_tls(&mut self) -> Result<bool, TransportError> {
        match self.tls.as_mut() {
            Some(tls) => tls.reload().map(|()| true),
            None => Ok(false),
        }
    }

    fn revert_tls(&mut self) {
        if let Some(tls) = self.tls.as_mut() {
            tls.revert();
        }
    }

    /// A reload's queue bounds hold the endpoint's own sends from now on
    /// (direct senders handed out keep the bounds they were made with).
    fn reconfigure(&mut self, config: &EndpointConfig) -> Result<(), TransportError> {
        self.limits.set_queue(config);
        Ok(())
    }

    fn set_accepted_receive_limit(&mut self, limit: Option<usize>) {
        self.accepted_frame_limit = limit;
    }

    fn set_receive_limit(&mut self, peer: PeerId, limit: Option<usize>) {
        let Some(token) = token_of(peer) else {
            return;
        };
        if let Some(waiting) = self.resolving.get_mut(&token) {
            waiting.receive_limit = Some(limit);
        } else if let Some(conn) = self.conns.get_mut(&token) {
            conn.frame_limit = limit;
        }
    }

    fn set_read_paused(&mut self, peer: PeerId, paused: bool) {
        let Some(token) = token_of(peer) else {
            return;
        };
        if let Some(waiting) = self.resolving.get_mut(&token) {
            waiting.read_paused = paused;
            return;
        }
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        conn.read_paused = paused;
        if !paused && conn.read_more {
            self.read_more.push(token);
            self.nudge();
        }
    }

    fn readiness(&self) -> Readiness {
        Readiness::Fd(self.poll.as_raw_fd())
    }

    fn has_own_work(&self) -> bool {
        self.woken
            || self.accept_more
            || !self.pending.is_empty()
            || !self.dirty.is_empty()
            || !self.read_more.is_empty()
            || !self.lingering.is_empty()
            || !self.resolving.is_empty()
            || !self.orphaned_lookups.is_empty()
            || self.attention.called.load(Ordering::Acquire)
    }

    fn wait_cap(&self) -> Option<Duration> {
        // Nothing signals these: the caller comes back for them (a
        // millisecond late at most, rather than sleep blind below one).
        let lingering_ends = self.lingering.front().map(|&(closed, _)| closed + LINGER);
        let at = match (self.accept_retry_at, lingering_ends) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        let cap = at.saturating_duration_since(Instant::now());
        Some(cap.max(Duration::from_millis(1)))
    }

    fn info(&self) -> Option<FabricInfo> {
        Some(TcpEndpoint::info(self))
    }

    fn queued_bytes(&self, peer: PeerId) -> usize {
        if let Some(waiting) = token_of(peer).and_then(|token| self.resolving.get(&token)) {
            return waiting.queued.bytes;
        }
        token_of(peer)
            .and_then(|token| self.conns.get(&token))
            .filter(|c| c.closing.is_none())
            .map(|c| c.out.lock().queue.bytes)
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use efabus_core::transport::split_run;
    use std::io::{Read, Write};
    use std::net::TcpStream as StdStream;

    const WAIT: Duration = Duration::from_secs(20);

    fn listener(options: Vec<(String, String)>) -> TcpEndpoint {
        TcpEndpoint::open(&EndpointConfig {
            bind: Some("127.0.0.1:0".into()),
            options,
            ..EndpointConfig::default()
        })
        .unwrap()
    }

    fn framed(payload: &[u8]) -> Vec<u8> {
        let mut v = (payload.len() as u32).to_le_bytes().to_vec();
        v.extend_from_slice(payload);
        v
    }

    /// Poll until `done` holds over everything polled so far.
    fn poll_until(ep: &mut TcpEndpoint, events: &mut Vec<Event>, done: impl Fn(&[Event]) -> bool) {
        let deadline = Instant::now() + WAIT;
        while !done(events) {
            assert!(Instant::now() < deadline, "timed out; got {events:?}");
            ep.poll(events).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// A raw client, and the peer id the endpoint gave it.
    fn raw_client(ep: &mut TcpEndpoint) -> (StdStream, PeerId) {
        let stream = StdStream::connect(ep.local_socket_addr().unwrap()).unwrap();
        let mut events = Vec::new();
        poll_until(ep, &mut events, |e| {
            e.iter().any(|e| matches!(e, Event::Accepted { .. }))
        });
        let peer = events
            .iter()
            .find_map(|e| match e {
                Event::Accepted { peer, .. } => Some(*peer),
                _ => None,
            })
            .unwrap();
        (stream, peer)
    }

    /// Connections closed locally and left lingering past the bound: the
    /// ones closed longest ago go at once, the latest linger on. (A bound
    /// of 8 here: the test holds both ends of each connection.)
    #[test]
    fn closed_connections_linger_within_a_bound() {
        let mut ep = listener(Vec::new());
        ep.max_lingering = 8;
        let addr = ep.local_socket_addr().unwrap();
        let count = 12;
        // Clients that neither read nor close: their connections linger.
        // Accepted as they come, within the listener's backlog.
        let mut events = Vec::new();
        let clients: Vec<StdStream> = (0..count)
            .map(|_| {
                let client = StdStream::connect(addr).unwrap();
                ep.poll(&mut events).unwrap();
                client
            })
            .collect();
        poll_until(&mut ep, &mut events, |e| {
            e.iter()
                .filter(|e| matches!(e, Event::Accepted { .. }))
                .count()
                == count
        });
        let peers: Vec<PeerId> = events
            .iter()
            .filter_map(|e| match e {
                Event::Accepted { peer, .. } => Some(*peer),
                _ => None,
            })
            .collect();
        // One drained and dropped before its time: the bound counts the
        // live ones only.
        ep.close(peers[0]);
        ep.drop_conn(token_of(peers[0]).unwrap(), CloseReason::Local, &mut events);
        for &peer in &peers[1..] {
            ep.close(peer);
        }
        assert_eq!(ep.conns.len(), 8);
        assert_eq!(ep.lingering_live, 8);
        let last = peers.last().and_then(|&peer| token_of(peer)).unwrap();
        assert!(ep.conns.contains_key(&last), "the latest closed went");
        let oldest = token_of(peers[3]).unwrap();
        assert!(!ep.conns.contains_key(&oldest), "the oldest closed lingers");
        let kept = token_of(peers[4]).unwrap();
        assert!(ep.conns.contains_key(&kept), "one closed later went");
        // The loop is called back when the oldest's time is up.
        let cap = ep.wait_cap().unwrap();
        assert!(cap > Duration::ZERO && cap <= LINGER, "{cap:?}");
        drop(clients);
    }

    /// Set in the child process of the test below, whose descriptors it
    /// exhausts.
    const OUT_OF_DESCRIPTORS_CHILD: &str = "EFABUS_TEST_OUT_OF_DESCRIPTORS_CHILD";

    /// A connection waiting in the backlog while the process has no
    /// descriptor left is accepted once one is free, though no other
    /// connection comes to make the listener signal again. Run in a child
    /// process: running out of descriptors would fail the tests beside it.
    #[test]
    fn accepting_resumes_once_descriptors_are_free() {
        let name = "tcp::tests::accepting_resumes_once_descriptors_are_free";
        if std::env::var_os(OUT_OF_DESCRIPTORS_CHILD).is_none() {
            // A low limit, so the child fills its table quickly.
            let exe = std::env::current_exe().unwrap();
            let out = std::process::Command::new("sh")
                .args(["-c", "ulimit -n 256 && exec \"$0\" \"$@\""])
                .arg(exe)
                .args([name, "--exact", "--nocapture", "--test-threads=1"])
                .env(OUT_OF_DESCRIPTORS_CHILD, "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{text}");
            assert!(text.contains("1 passed"), "the child ran no test: {text}");
            return;
        }
        let mut ep = listener(Vec::new());
        // The kernel completes its handshake: it waits in the backlog.
        let _client = StdStream::connect(ep.local_socket_addr().unwrap()).unwrap();
        let mut fillers = Vec::new();
        while let Ok(file) = std::fs::File::open("/dev/null") {
            fillers.push(file);
            assert!(fillers.len() <= 256, "the descriptor limit was not lowered");
        }
        let mut events = Vec::new();
        for _ in 0..20 {
            ep.poll(&mut events).unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(events.is_empty(), "{events:?}");
        assert!(ep.wait_cap().is_some_and(|cap| cap <= ACCEPT_RETRY));
        drop(fillers);
        poll_until(&mut ep, &mut events, |e| {
            e.iter().any(|e| matches!(e, Event::Accepted { .. }))
        });
    }

    /// A TLS client on a blocking socket, through its handshake.
    fn tls_client(
        addr: SocketAddr,
        config: Arc<rustls::ClientConfig>,
    ) -> rustls::StreamOwned<rustls::ClientConnection, StdStream> {
        crate::tls::held::client_over(StdStream::connect(addr).unwrap(), config)
    }

    fn has_frame(events: &[Event], payload: &[u8]) -> bool {
        let framed = framed(payload);
        events
            .iter()
            .any(|e| matches!(e, Event::Frame { frame, .. } if frame[..] == framed[..]))
    }

    /// A step of an accepted connection's TLS handshake (here the check of
    /// its client certificate, held) runs beside the endpoint: meanwhile
    /// the endpoint serves its other connections. On the endpoint's
    /// thread, the held check held every connection with it.
    #[test]
    fn a_tls_handshake_step_holds_up_no_other_connection() {
        use crate::tls::held;
        let pki = crate::conformance::pki::shared();
        let gate = Arc::new(held::Gate::default());
        let config = EndpointConfig {
            bind: Some("127.0.0.1:0".into()),
            ..EndpointConfig::default()
        };
        let tls = held::server_context(pki, Arc::clone(&gate));
        let mut ep = TcpEndpoint::open_with_tls(&config, Some(tls)).unwrap();
        let addr = ep.local_socket_addr().unwrap();
        let client_config = held::client_config(pki);

        // One client through its handshake, sending a frame when asked.
        let (ask, asked) = std::sync::mpsc::channel::<u8>();
        let config_a = Arc::clone(&client_config);
        let a = std::thread::spawn(move || {
            let mut stream = tls_client(addr, config_a);
            for byte in asked {
                stream.write_all(&framed(&[byte])).unwrap();
                stream.flush().unwrap();
            }
        });
        ask.send(1).unwrap();
        let mut events = Vec::new();
        poll_until(&mut ep, &mut events, |e| has_frame(e, &[1]));

        // Another, whose certificate check is held.
        gate.arm();
        let b = std::thread::spawn(move || {
            let mut stream = tls_client(addr, client_config);
            stream.write_all(&framed(b"b")).unwrap();
            stream.flush().unwrap();
            // Open until the endpoint has read the frame.
            let _ = stream.sock.read(&mut [0; 1]);
        });
        poll_until(&mut ep, &mut events, |_| gate.holding());
        ask.send(2).unwrap();
        poll_until(&mut ep, &mut events, |e| has_frame(e, &[2]));
        assert!(gate.holding(), "the check ended before the other's frame");

        gate.release();
        poll_until(&mut ep, &mut events, |e| has_frame(e, b"b"));
        drop(ask);
        drop(ep);
        a.join().unwrap();
        b.join().unwrap();
    }

    /// Many TLS handshakes at once, their steps queued for the workers
    /// and called back in any order: every client gets through, and its
    /// frame arrives (a call back lost would leave one waiting for good).
    #[test]
    fn many_tls_handshakes_at_once_all_get_through() {
        use crate::tls::held;
        const CLIENTS: u8 = 48;
        let pki = crate::conformance::pki::shared();
        let config = EndpointConfig {
            bind: Some("127.0.0.1:0".into()),
            ..EndpointConfig::default()
        };
        let tls = held::server_context(pki, Arc::new(held::Gate::default()));
        let mut ep = TcpEndpoint::open_with_tls(&config, Some(tls)).unwrap();
        let addr = ep.local_socket_addr().unwrap();
        let client_config = held::client_config(pki);
        let clients: Vec<_> = (0..CLIENTS)
            .map(|n| {
                let config = Arc::clone(&client_config);
                std::thread::spawn(move || {
                    let mut stream = tls_client(addr, config);
                    stream.write_all(&framed(&[n])).unwrap();
                    stream.flush().unwrap();
                    // Open until the endpoint has read the frame.
                    let _ = stream.sock.read(&mut [0; 1]);
                })
            })
            .collect();
        let mut events = Vec::new();
        poll_until(&mut ep, &mut events, |e| {
            (0..CLIENTS).all(|n| has_frame(e, &[n]))
        });
        drop(ep);
        for client in clients {
            client.join().unwrap();
        }
    }

    /// Poll until the endpoint says it has no work of its own.
    fn poll_until_quiet(ep: &mut TcpEndpoint) {
        let deadline = Instant::now() + WAIT;
        let mut events = Vec::new();
        while ep.has_own_work() {
            assert!(Instant::now() < deadline, "still busy; got {events:?}");
            ep.poll(&mut events).unwrap();
        }
    }

    /// A loop busy with other endpoints polls this one only when its
    /// descriptor says so, unless it has work of its own: a frame queued
    /// for a peer, or a direct sender's call, until a poll has taken it.
    #[test]
    fn a_queued_frame_or_a_call_is_work_of_the_endpoints_own() {
        let mut ep = listener(Vec::new());
        let (mut stream, peer) = raw_client(&mut ep);
        poll_until_quiet(&mut ep);
        ep.send(
            peer,
            OutFrame::whole(Bytes::from_static(b"\x05\0\0\0hello")),
        )
        .unwrap();
        assert!(ep.has_own_work());
        poll_until_quiet(&mut ep);
        let mut read = [0u8; 9];
        stream.set_read_timeout(Some(WAIT)).unwrap();
        stream.read_exact(&mut read).unwrap();
        assert_eq!(&read[4..], b"hello");
        ep.attention.call(token_of(peer).unwrap());
        assert!(ep.has_own_work());
        poll_until_quiet(&mut ep);
    }

    #[test]
    fn a_frame_over_the_receive_limit_waits_behind_a_hello_and_is_refused_alone() {
        let mut ep = listener(Vec::new());
        ep.set_accepted_receive_limit(Some(100));
        let frames_of = |events: &[Event], who: PeerId| -> Vec<usize> {
            events
                .iter()
                .filter_map(|e| match e {
                    Event::Frame { peer, frame } if *peer == who => Some(frame.len()),
                    _ => None,
                })
                .collect()
        };
        // A small frame (the hello) and a large one in one write: the
        // large one waits until the caller has seen the small one (and,
        // here, lifted the limit, as the broker does for a good hello).
        let (mut greeter, greeted) = raw_client(&mut ep);
        let mut both = framed(b"hello");
        both.extend(framed(&[1; 1000]));
        greeter.write_all(&both).unwrap();
        let mut events = Vec::new();
        poll_until(&mut ep, &mut events, |e| !frames_of(e, greeted).is_empty());
        assert_eq!(frames_of(&events, greeted), [9], "only the hello so far");
        assert_eq!(closed_reason(&events, greeted), None);
        ep.set_receive_limit(greeted, None);
        poll_until(&mut ep, &mut events, |e| frames_of(e, greeted).len() == 2);
        assert_eq!(frames_of(&events, greeted), [9, 1004]);

        // The same large frame with nothing before it is refused.
        let (mut stranger, refused) = raw_client(&mut ep);
        stranger.write_all(&framed(&[1; 1000])).unwrap();
        let mut events = Vec::new();
        poll_until(&mut ep, &mut events, |e| {
            closed_reason(e, refused).is_some()
        });
        let reason = closed_reason(&events, refused).unwrap();
        assert!(
            matches!(&reason, CloseReason::Error(text) if text.contains("above the limit of 100")),
            "{reason:?}"
        );
        assert!(frames_of(&events, refused).is_empty());
    }

    fn closed_reason(events: &[Event], peer: PeerId) -> Option<CloseReason> {
        events.iter().find_map(|e| match e {
            Event::Closed { peer: p, reason } if *p == peer => Some(reason.clone()),
            _ => None,
        })
    }

    #[test]
    fn local_addr_is_the_bound_port() {
        let ep = listener(Vec::new());
        let text = String::from_utf8(ep.local_addr()).unwrap();
        let addr: SocketAddr = text.parse().unwrap();
        assert_eq!(Some(addr), ep.local_socket_addr());
        assert_ne!(addr.port(), 0);
        let client = TcpEndpoint::open(&EndpointConfig::default()).unwrap();
        assert!(client.local_addr().is_empty());
    }

    #[test]
    fn absurd_declared_length_closes_with_the_reason() {
        let mut ep = listener(Vec::new());
        let (mut raw, peer) = raw_client(&mut ep);
        raw.write_all(&framed(b"fine")).unwrap();
        raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
        let mut events = Vec::new();
        poll_until(&mut ep, &mut events, |e| closed_reason(e, peer).is_some());
        assert!(events
            .iter()
            .any(|e| matches!(e, Event::Frame { frame, .. } if frame[..] == framed(b"fine")[..])));
        match closed_reason(&events, peer) {
            Some(CloseReason::Error(text)) => {
                assert!(
                    text.contains("4294967299") && text.contains("limit"),
                    "{text}"
                )
            }
            other => panic!("expected an error close, got {other:?}"),
        }
        // The peer is told why, in an error frame, and then sees an
        // orderly close.
        // (Written and shut down on the spot: no further poll is needed.)
        raw.set_read_timeout(Some(WAIT)).unwrap();
        let mut received = Vec::new();
        raw.read_to_end(&mut received)
            .expect("the error frame, then EOF");
        let frame = codec::decode(Bytes::from(received), &codec::CodecLimits::default())
            .expect("exactly one whole error frame");
        match frame {
            Frame::Error(error) => {
                assert_eq!(error.code, ErrorCode::PayloadTooLarge);
                assert!(error.fatal);
                assert!(
                    error.text.contains("4294967299") && error.text.contains("limit"),
                    "{}",
                    error.text
                );
            }
            other => panic!("expected an error frame, got {other:?}"),
        }
    }

    #[test]
    fn eof_inside_a_frame_is_an_error_and_eof_between_frames_is_not() {
        let mut ep = listener(Vec::new());
        let (mut raw, peer) = raw_client(&mut ep);
        let whole = framed(b"cut short");
        raw.write_all(&whole[..7]).unwrap();
        drop(raw);
        let mut events = Vec::new();
        poll_until(&mut ep, &mut events, |e| closed_reason(e, peer).is_some());
        assert!(
            matches!(closed_reason(&events, peer), Some(CloseReason::Error(t)) if t.contains("unfinished"))
        );

        let (mut raw, peer) = raw_client(&mut ep);
        raw.write_all(&whole).unwrap();
        drop(raw);
        let mut events = Vec::new();
        poll_until(&mut ep, &mut events, |e| closed_reason(e, peer).is_some());
        assert_eq!(closed_reason(&events, peer), Some(CloseReason::PeerClosed));
    }

    #[test]
    fn frames_written_byte_by_byte_reassemble() {
        let mut ep = listener(Vec::new());
        let (mut raw, peer) = raw_client(&mut ep);
        raw.set_nodelay(true).unwrap();
        let mut wire = Vec::new();
        for i in 0..5u8 {
            wire.extend(framed(&vec![i; 3 + i as usize * 10]));
        }
        let mut events = Vec::new();
        for byte in &wire {
            raw.write_all(std::slice::from_ref(byte)).unwrap();
            ep.poll(&mut events).unwrap();
        }
        poll_until(&mut ep, &mut events, |e| {
            e.iter()
                .filter(|e| matches!(e, Event::Frame { .. }))
                .count()
                == 5
        });
        let got: Vec<u8> = events
            .iter()
            .filter_map(|e| match e {
                Event::Frame { peer: p, frame } if *p == peer => Some(frame.to_vec()),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(got, wire);
    }

    #[test]
    fn read_budget_bounds_what_one_poll_takes_from_one_peer() {
        const BUDGET: usize = 16 << 10;
        let mut ep = listener(vec![("read_budget".into(), BUDGET.to_string())]);
        let (mut flood, flooder) = raw_client(&mut ep);
        let (mut quiet, quieter) = raw_client(&mut ep);
        let frame = framed(&[7; 1020]);
        let mut burst = Vec::new();
        for _ in 0..64 {
            burst.extend_from_slice(&frame);
        }
        // 64 KiB: within what loopback buffers take without a reader.
        flood.write_all(&burst).unwrap();
        quiet.write_all(&framed(b"me too")).unwrap();
        let mut total = 0;
        let mut quiet_seen = false;
        let deadline = Instant::now() + WAIT;
        while total < 64 || !quiet_seen {
            assert!(Instant::now() < deadline, "timed out after {total} frames");
            let mut events = Vec::new();
            ep.poll(&mut events).unwrap();
            let this_poll = events
                .iter()
                .filter(|e| matches!(e, Event::Frame { peer, .. } if *peer == flooder))
                .count();
            assert!(
                this_poll * frame.len() <= BUDGET,
                "{this_poll} frames in one poll exceed the budget"
            );
            total += this_poll;
            quiet_seen |= events
                .iter()
                .any(|e| matches!(e, Event::Frame { peer, .. } if *peer == quieter));
            std::thread::sleep(Duration::from_micros(200));
        }
        assert_eq!(total, 64);
    }

    #[test]
    fn infos_describe_a_reliable_stream() {
        use efabus_core::caps::EpType;
        let infos = TcpTransport.infos().unwrap();
        assert_eq!(infos.len(), 1);
        assert_eq!(infos[0].ep_attr.ep_type, EpType::Msg);
        let ep = listener(Vec::new());
        let info = ep.info();
        let src = info.src_addr.clone().unwrap();
        assert!(
            src.ends_with(&String::from_utf8(ep.local_addr()).unwrap()),
            "{src}"
        );
    }

    #[test]
    fn bad_read_budget_is_refused() {
        let err = TcpEndpoint::open(&EndpointConfig {
            options: vec![("read_budget".into(), "lots".into())],
            ..EndpointConfig::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("read_budget"), "{err}");
    }

    #[test]
    fn unparsable_addresses_are_invalid() {
        let mut ep = TcpEndpoint::open(&EndpointConfig::default()).unwrap();
        for bad in ["no-port", "127.0.0.1:notaport", ""] {
            assert!(
                matches!(ep.connect(bad), Err(TransportError::InvalidAddress { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            TcpEndpoint::open(&EndpointConfig {
                bind: Some("nonsense".into()),
                ..EndpointConfig::default()
            }),
            Err(TransportError::InvalidAddress { .. })
        ));
    }

    #[test]
    fn host_names_connect_through_any_resolved_address() {
        let mut server = listener(Vec::new());
        let port = server.local_socket_addr().unwrap().port();
        let mut client = TcpEndpoint::open(&EndpointConfig::default()).unwrap();
        // `localhost` may resolve to ::1 first, where nobody listens; the
        // connect must fall back to 127.0.0.1.
        let peer = client.connect(&format!("localhost:{port}")).unwrap();
        client
            .send(peer, OutFrame::whole(framed(b"hello").into()))
            .unwrap();
        let mut got = Vec::new();
        let deadline = Instant::now() + WAIT;
        while !got.iter().any(|e| matches!(e, Event::Frame { .. })) {
            assert!(Instant::now() < deadline, "timed out; got {got:?}");
            let mut events = Vec::new();
            client.poll(&mut events).unwrap();
            assert!(closed_reason(&events, peer).is_none(), "{events:?}");
            server.poll(&mut got).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Polls `server` once, adding the payloads of the frames it got.
    fn take_payloads(server: &mut TcpEndpoint, got: &mut Vec<Vec<u8>>) {
        let mut arrived = Vec::new();
        server.poll(&mut arrived).unwrap();
        got.extend(arrived.into_iter().filter_map(|e| match e {
            Event::Frame { frame, .. } => Some(frame[codec::PREFIX_LEN..].to_vec()),
            _ => None,
        }));
    }

    /// Makes `client` look names up as counted in `lookups`: a name under
    /// `nowhere.` resolves to nothing at once; any other is held until the
    /// returned sender lets it go (the tests do so only once `connect` has
    /// returned), then resolves to `127.0.0.1:port`.
    fn held_lookups(
        client: &mut TcpEndpoint,
        port: u16,
        lookups: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> std::sync::mpsc::Sender<()> {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let held = Mutex::new(held);
        let counted = Arc::clone(lookups);
        client.lookup = Arc::new(move |name: &str| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if name.starts_with("nowhere.") {
                return Err(TransportError::InvalidAddress {
                    addr: name.to_string(),
                    reason: "the name resolves to no address".into(),
                });
            }
            if held.lock().recv_timeout(WAIT).is_err() {
                return Err(TransportError::Other("the lookup was never let go".into()));
            }
            resolve(&format!("127.0.0.1:{port}"))
        });
        release
    }

    /// A host name is looked up off the caller's thread: `connect` returns
    /// while the lookup is held, frames sent meanwhile wait (past the queue
    /// bounds `WouldBlock`, then `Writable`) and arrive in order once the
    /// answer comes; a name that resolves to nothing closes its peer with
    /// the reason.
    #[test]
    fn host_names_are_looked_up_without_holding_up_the_caller() {
        let mut server = listener(Vec::new());
        let port = server.local_socket_addr().unwrap().port();
        let mut client = TcpEndpoint::open(&EndpointConfig {
            queue_frames: 2,
            ..EndpointConfig::default()
        })
        .unwrap();
        let release = held_lookups(&mut client, port, &Default::default());
        let peer = client.connect(&format!("held.example:{port}")).unwrap();
        for n in 0..2u8 {
            client
                .send(peer, OutFrame::whole(framed(&[n]).into()))
                .expect("queued while the name is looked up");
        }
        let refused = client.send(peer, OutFrame::whole(framed(&[2]).into()));
        assert!(
            matches!(refused, Err(SendError::WouldBlock(_))),
            "{refused:?}"
        );
        assert_eq!(client.queued_bytes(peer), 2 * 5);
        let mut events = Vec::new();
        client.poll(&mut events).unwrap();
        assert!(events.is_empty(), "nothing before the answer: {events:?}");

        release.send(()).unwrap();
        let mut got = Vec::new();
        let mut writable = false;
        let deadline = Instant::now() + WAIT;
        while got.len() < 2 || !writable {
            assert!(Instant::now() < deadline, "timed out; got {got:?}");
            let mut events = Vec::new();
            client.poll(&mut events).unwrap();
            assert!(closed_reason(&events, peer).is_none(), "{events:?}");
            writable |= events
                .iter()
                .any(|e| matches!(e, Event::Writable { peer: p } if *p == peer));
            take_payloads(&mut server, &mut got);
            std::thread::sleep(Duration::from_micros(200));
        }
        assert_eq!(got, [vec![0u8], vec![1u8]]);

        let nowhere = client.connect(&format!("nowhere.example:{port}")).unwrap();
        let mut events = Vec::new();
        poll_until(&mut client, &mut events, |events| {
            closed_reason(events, nowhere).is_some()
        });
        match closed_reason(&events, nowhere) {
            Some(CloseReason::Error(reason)) => {
                assert!(reason.contains("resolves to no address"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    /// A dial closed while its name is looked up ends with one local
    /// `Closed` and nothing sent; the lookup goes on and serves the next
    /// dial of the name, and its answer the one after, with no other
    /// lookup.
    #[test]
    fn a_lookup_outlives_its_closed_dial_and_serves_the_next() {
        let mut server = listener(Vec::new());
        let port = server.local_socket_addr().unwrap().port();
        let lookups = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut client = TcpEndpoint::open(&EndpointConfig::default()).unwrap();
        let release = held_lookups(&mut client, port, &lookups);
        let name = format!("slow.example:{port}");
        let first = client.connect(&name).unwrap();
        client
            .send(first, OutFrame::whole(framed(b"dropped").into()))
            .unwrap();
        client.close(first);
        let mut events = Vec::new();
        client.poll(&mut events).unwrap();
        assert_eq!(closed_reason(&events, first), Some(CloseReason::Local));

        // Still held: the second dial waits on the same lookup.
        let second = client.connect(&name).unwrap();
        release.send(()).unwrap();
        let mut got = Vec::new();
        let mut send_and_receive = |client: &mut TcpEndpoint, peer: PeerId, text: &[u8]| {
            client
                .send(peer, OutFrame::whole(framed(text).into()))
                .unwrap();
            let deadline = Instant::now() + WAIT;
            let before = got.len();
            while got.len() == before {
                assert!(Instant::now() < deadline, "timed out; got {got:?}");
                let mut events = Vec::new();
                client.poll(&mut events).unwrap();
                assert!(closed_reason(&events, peer).is_none(), "{events:?}");
                take_payloads(&mut server, &mut got);
                std::thread::sleep(Duration::from_micros(200));
            }
        };
        send_and_receive(&mut client, second, b"second");
        let third = client.connect(&name).unwrap();
        send_and_receive(&mut client, third, b"third");
        assert_eq!(
            got,
            [b"second".to_vec(), b"third".to_vec()],
            "nothing of the closed dial"
        );
        assert_eq!(lookups.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn connect_falls_back_to_the_next_address() {
        let mut server = listener(Vec::new());
        let live = server.local_socket_addr().unwrap();
        let dead = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap()
        };
        let mut client = TcpEndpoint::open(&EndpointConfig::default()).unwrap();
        let peer = client.connect_any(vec![dead, live], "127.0.0.1").unwrap();
        client
            .send(peer, OutFrame::whole(framed(b"via the second").into()))
            .unwrap();
        let mut got = Vec::new();
        let deadline = Instant::now() + WAIT;
        while !got.iter().any(|e| matches!(e, Event::Frame { .. })) {
            assert!(Instant::now() < deadline, "timed out; got {got:?}");
            let mut events = Vec::new();
            client.poll(&mut events).unwrap();
            assert!(closed_reason(&events, peer).is_none(), "{events:?}");
            server.poll(&mut got).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
        assert_eq!(
            client.conns[&token_of(peer).unwrap()].remote,
            live.to_string()
        );

        // With no address left, every failure is reported.
        let peer = client.connect_any(vec![dead, dead], "127.0.0.1").unwrap();
        let mut events = Vec::new();
        poll_until(&mut client, &mut events, |e| {
            closed_reason(e, peer).is_some()
        });
        match closed_reason(&events, peer) {
            Some(CloseReason::Error(text)) => {
                assert_eq!(text.matches(&dead.to_string()).count(), 2, "{text}")
            }
            other => panic!("expected an error close, got {other:?}"),
        }
    }

    /// A connected client endpoint and the server's peer id for it.
    fn connected_pair() -> (TcpEndpoint, TcpEndpoint, PeerId, PeerId) {
        let mut server = listener(Vec::new());
        let addr = server.local_socket_addr().unwrap();
        let mut client = TcpEndpoint::open(&EndpointConfig::default()).unwrap();
        let peer = client.connect(&addr.to_string()).unwrap();
        let mut events = Vec::new();
        poll_until(&mut server, &mut events, |e| {
            e.iter().any(|e| matches!(e, Event::Accepted { .. }))
        });
        let accepted = events
            .iter()
            .find_map(|e| match e {
                Event::Accepted { peer, .. } => Some(*peer),
                _ => None,
            })
            .unwrap();
        let deadline = Instant::now() + WAIT;
        while !client.conns[&token_of(peer).unwrap()].connected {
            assert!(Instant::now() < deadline, "connect never completed");
            client.poll(&mut Vec::new()).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
        (server, client, accepted, peer)
    }

    fn frames_of(events: &[Event]) -> Vec<Vec<u8>> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Frame { frame, .. } => Some(frame.to_vec()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn runs_are_written_at_once_and_arrive_as_their_frames() {
        let (mut server, mut client, _, peer) = connected_pair();
        let mut expect = Vec::new();
        let mut run = Vec::new();
        for i in 0..100u32 {
            let frame = framed(&i.to_le_bytes().repeat(1 + i as usize % 5));
            run.extend_from_slice(&frame);
            expect.push(frame);
        }
        let single = framed(b"between runs");
        client
            .send(peer, OutFrame::whole(single.clone().into()))
            .unwrap();
        client.send_run(peer, Bytes::from(run.clone())).unwrap();
        // The socket had room: the single frame queued before and the run
        // left in the call, with no poll.
        assert_eq!(client.queued_bytes(peer), 0);
        assert_eq!(client.conns[&token_of(peer).unwrap()].out.lock().writes, 1);
        client.send_run(peer, Bytes::from(run)).unwrap();
        let mut all = vec![single];
        all.extend(expect.iter().cloned());
        all.extend(expect);
        let mut events = Vec::new();
        poll_until(&mut server, &mut events, |e| {
            frames_of(e).len() == all.len()
        });
        assert_eq!(frames_of(&events), all);
    }

    /// Asked for runs, an endpoint gives the frames of one read in one
    /// `Frames` event (a frame read alone still in a `Frame`): every frame
    /// once, in order, split as `split_run` reads them.
    #[test]
    fn frames_read_together_arrive_as_one_run_when_asked() {
        let (mut server, mut client, _, peer) = connected_pair();
        assert!(server.deliver_runs());
        let expect: Vec<Vec<u8>> = (0..200u32)
            .map(|i| framed(&i.to_le_bytes().repeat(1 + i as usize % 7)))
            .collect();
        client.send_run(peer, Bytes::from(expect.concat())).unwrap();
        let lone = framed(b"alone");
        let mut events = Vec::new();
        let mut got: Vec<Vec<u8>> = Vec::new();
        let mut runs = 0;
        let mut sent_lone = false;
        let deadline = Instant::now() + WAIT;
        while got.len() < expect.len() + 1 {
            assert!(Instant::now() < deadline, "{} of the frames", got.len());
            if got.len() == expect.len() && !sent_lone {
                client
                    .send(peer, OutFrame::whole(lone.clone().into()))
                    .unwrap();
                sent_lone = true;
            }
            client.poll(&mut Vec::new()).unwrap();
            server.poll(&mut events).unwrap();
            for event in events.drain(..) {
                match event {
                    Event::Frames { run, .. } => {
                        runs += 1;
                        let frames = split_run(&run);
                        let before = got.len();
                        got.extend(frames.map(|f| f.head.to_vec()));
                        assert!(got.len() - before > 1, "a run of one frame");
                    }
                    Event::Frame { frame, .. } => got.push(frame.to_vec()),
                    _ => {}
                }
            }
        }
        assert!(runs >= 1, "no run was delivered");
        let mut all = expect;
        all.push(lone);
        assert_eq!(got, all);
    }

    #[test]
    fn malformed_runs_are_refused_whole() {
        let (_server, mut client, _, peer) = connected_pair();
        let good = framed(b"fine");
        let cases: Vec<Vec<u8>> = vec![
            // Ends inside the second frame's prefix.
            [good.clone(), vec![3, 0]].concat(),
            // Ends inside the second frame.
            [good.clone(), framed(b"cut")[..5].to_vec()].concat(),
        ];
        for bad in cases {
            assert!(matches!(
                client.send_run(peer, Bytes::from(bad)),
                Err(SendError::Transport(_))
            ));
        }
        let huge = framed(&vec![0; EndpointConfig::default().max_frame]);
        assert!(matches!(
            client.send_run(peer, Bytes::from([good, huge].concat())),
            Err(SendError::TooLarge { .. })
        ));
        assert_eq!(
            client.conns[&token_of(peer).unwrap()]
                .out
                .lock()
                .queue
                .frames,
            0
        );
        assert!(matches!(
            client.send_run(PeerId(999), Bytes::from(framed(b"x"))),
            Err(SendError::Closed(_))
        ));
    }

    #[test]
    fn a_full_queue_hands_the_run_back() {
        let mut server = listener(Vec::new());
        let addr = server.local_socket_addr().unwrap();
        let mut client = TcpEndpoint::open(&EndpointConfig {
            queue_frames: 4,
            ..EndpointConfig::default()
        })
        .unwrap();
        // Not connected yet: nothing leaves, the queue fills.
        let peer = client.connect(&addr.to_string()).unwrap();
        let run: Vec<u8> = (0..3u8).flat_map(|i| framed(&[i])).collect();
        client.send_run(peer, Bytes::from(run.clone())).unwrap();
        match client.send_run(peer, Bytes::from(run.clone())) {
            Err(SendError::WouldBlock(back)) => assert_eq!(back.to_bytes(), run),
            other => panic!("expected WouldBlock, got {other:?}"),
        }
        let mut events = Vec::new();
        poll_until(&mut client, &mut events, |e| {
            e.iter().any(|e| matches!(e, Event::Writable { .. }))
        });
        client.send_run(peer, Bytes::from(run.clone())).unwrap();
        let mut got = Vec::new();
        let deadline = Instant::now() + WAIT;
        while frames_of(&got).len() < 6 {
            assert!(Instant::now() < deadline, "timed out; got {got:?}");
            client.poll(&mut Vec::new()).unwrap();
            server.poll(&mut got).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
        let expect: Vec<Vec<u8>> = (0..2)
            .flat_map(|_| (0..3u8).map(|i| framed(&[i])))
            .collect();
        assert_eq!(frames_of(&got), expect);
    }

    #[test]
    fn a_reload_changes_the_queue_bound() {
        let server = listener(Vec::new());
        let addr = server.local_socket_addr().unwrap();
        let small = EndpointConfig {
            queue_bytes: 3 * framed(b"a").len(),
            ..EndpointConfig::default()
        };
        let mut client = TcpEndpoint::open(&small).unwrap();
        // Not connected yet: nothing leaves, the queue fills.
        let peer = client.connect(&addr.to_string()).unwrap();
        let taken = |client: &mut TcpEndpoint| {
            (0..100)
                .take_while(|_| {
                    client
                        .send(peer, OutFrame::whole(framed(b"a").into()))
                        .is_ok()
                })
                .count()
        };
        assert_eq!(taken(&mut client), 3);
        client
            .reconfigure(&EndpointConfig {
                queue_bytes: 10 * framed(b"a").len(),
                ..small
            })
            .unwrap();
        assert_eq!(taken(&mut client), 7, "the raised bound takes seven more");
    }

    #[test]
    fn direct_senders_write_from_other_threads_in_queue_order() {
        let (mut server, mut client, _, peer) = connected_pair();
        let direct = client
            .direct_sender(peer)
            .expect("a connected peer has one");
        // Queued by the endpoint first (not yet written: no poll).
        client
            .send(peer, OutFrame::whole(framed(b"first").into()))
            .unwrap();
        let writer = std::thread::spawn(move || {
            for i in 0..50u32 {
                let run: Vec<u8> = (0..4u32)
                    .flat_map(|j| framed(&(i * 4 + j).to_le_bytes()))
                    .collect();
                direct.send_run(Bytes::from(run)).unwrap();
            }
            let head = Bytes::from(framed(b"last")[..6].to_vec());
            let body = Bytes::from(framed(b"last")[6..].to_vec());
            direct.send(OutFrame { head, body }).unwrap();
            direct
        });
        let direct = writer.join().unwrap();
        let mut expect = vec![framed(b"first")];
        expect.extend((0..200u32).map(|n| framed(&n.to_le_bytes())));
        expect.push(framed(b"last"));
        let mut events = Vec::new();
        let deadline = Instant::now() + WAIT;
        while frames_of(&events).len() < expect.len() {
            assert!(Instant::now() < deadline, "timed out");
            client.poll(&mut Vec::new()).unwrap();
            server.poll(&mut events).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
        assert_eq!(frames_of(&events), expect);

        // Once the peer is closed, the handle refuses.
        client.close(peer);
        assert!(matches!(
            direct.send_run(Bytes::from(framed(b"late"))),
            Err(SendError::Closed(_))
        ));
        assert!(client.direct_sender(peer).is_none());
    }

    #[test]
    fn a_full_queue_refuses_direct_sends_without_a_writable_debt() {
        let server = listener(Vec::new());
        let addr = server.local_socket_addr().unwrap();
        let mut client = TcpEndpoint::open(&EndpointConfig {
            queue_frames: 2,
            ..EndpointConfig::default()
        })
        .unwrap();
        // Not connected yet: nothing leaves, the queue fills.
        let peer = client.connect(&addr.to_string()).unwrap();
        let direct = client.direct_sender(peer).unwrap();
        direct.send_run(Bytes::from(framed(b"a"))).unwrap();
        direct.send_run(Bytes::from(framed(b"b"))).unwrap();
        match direct.send_run(Bytes::from(framed(b"c"))) {
            Err(SendError::WouldBlock(back)) => assert_eq!(back.to_bytes(), framed(b"c")),
            other => panic!("expected WouldBlock, got {other:?}"),
        }
        assert!(!client.conns[&token_of(peer).unwrap()].out.lock().blocked);
        assert_eq!(client.queued_bytes(peer), 2 * framed(b"a").len());
    }

    #[test]
    fn many_small_frames_leave_in_few_writes() {
        // Queued frames leave together: one write call per MAX_IOV parts,
        // not one per frame.
        let mut server = listener(Vec::new());
        let addr = server.local_socket_addr().unwrap();
        let mut client = TcpEndpoint::open(&EndpointConfig::default()).unwrap();
        let peer = client.connect(&addr.to_string()).unwrap();
        let mut events = Vec::new();
        poll_until(&mut server, &mut events, |e| {
            e.iter().any(|e| matches!(e, Event::Accepted { .. }))
        });
        for i in 0..1000u32 {
            client
                .send(peer, OutFrame::whole(framed(&i.to_le_bytes()).into()))
                .unwrap();
        }
        assert_eq!(client.queued_bytes(peer), 8000);
        let deadline = Instant::now() + WAIT;
        while client.queued_bytes(peer) > 0 {
            assert!(Instant::now() < deadline);
            client.poll(&mut Vec::new()).unwrap();
        }
        let writes = client.conns[&token_of(peer).unwrap()].out.lock().writes;
        assert!(
            writes <= (1000 / MAX_IOV as u64) + 1,
            "{writes} write calls for 1000 queued frames"
        );
        let mut events = Vec::new();
        poll_until(&mut server, &mut events, |e| {
            e.iter()
                .filter(|e| matches!(e, Event::Frame { .. }))
                .count()
                == 1000
        });
        let seqs: Vec<u32> = events
            .iter()
            .filter_map(|e| match e {
                Event::Frame { frame, .. } => {
                    Some(u32::from_le_bytes(frame[4..8].try_into().unwrap()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(seqs, (0..1000).collect::<Vec<_>>());
    }
}
