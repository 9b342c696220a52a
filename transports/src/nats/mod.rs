//! The NATS listener (scheme `nats`): NATS clients in any language connect
//! to it with their own client libraries, and the broker sees each as a
//! client session like a native one, with the same routing, limits,
//! permissions, slow-consumer policy, statistics and monitoring.
//!
//! The endpoint only listens (`nats/HOST:PORT`, 4222 by convention). Each
//! accepted connection gets the server's `INFO` at once; from then on
//! [`NatsSession`] translates: the client's protocol lines become efabus
//! frames in [`Event::Frame`]s, and the frames the broker sends become
//! protocol lines. The sockets are non-blocking on mio, as in the `tcp`
//! transport: `send` and `send_run` translate, append to the connection's
//! output and write at once what the socket takes; past `queue_bytes` a
//! message returns [`SendError::WouldBlock`] (control frames, an error
//! before a close above all, still go) and [`Event::Writable`] follows
//! when the output has drained to half. Reading takes at most
//! [`READ_BUDGET`] bytes per connection per poll, and nothing while the
//! caller has paused the connection, while its output is full (answers to
//! a client that does not read stop there), or beyond the CONNECT line
//! while the broker has not accepted it. An ended connection is told to
//! the caller at once and flushes for at most [`LINGER`].
//!
//! Settings come from [`EndpointConfig::options`]: `server_id`,
//! `server_name`, `version`, `max_payload`, `auth_required`,
//! `max_pings_out`, `max_control_line` and `max_subscriptions` (see
//! [`ServerInfo`]), and the TLS files of the `tcp` transport (`tls_cert`,
//! `tls_key`, `tls_ca`, `tls_verify_clients`; see [`crate::tls`]); the
//! broker fills them from its configuration.
//!
//! With a certificate the listener requires TLS as NATS servers do: the
//! `INFO` line goes in the clear with `tls_required` (and `tls_verify`
//! when client certificates are checked), the client then starts the TLS
//! handshake, and everything after it, `CONNECT` first, is read and
//! written through the TLS session. A client that does not start TLS gets
//! nothing more in the clear (a TLS alert, and the close); there is no
//! cleartext fallback. With
//! `tls_handshake_first=true` clients begin with the handshake instead
//! (NATS's "TLS first") and `INFO` is the first thing sent through it;
//! clients that wait for `INFO` first then get nothing.

mod session;

use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efabus_core::caps::FabricInfo;
use efabus_core::codec::{self, FrameKind};
use efabus_core::transport::{
    split_run, CloseReason, Endpoint, EndpointConfig, Event, OutFrame, PeerId, Readiness,
    SendError, Transport, TransportError,
};
use mio::net::TcpListener;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use rustc_hash::FxHashMap;

use crate::tls::{TlsContext, Wire};

pub use session::{
    Fatal, NatsSession, ServerInfo, DEFAULT_MAX_CONTROL_LINE, DEFAULT_MAX_PINGS_OUT,
    MAX_CONNECT_LINE,
};

/// The scheme naming this transport in endpoint strings.
pub const SCHEME: &str = "nats";

/// Most bytes read from one connection in one `poll`.
pub const READ_BUDGET: usize = 1 << 20;

/// Most connections accepted in one `poll`.
const ACCEPT_BUDGET: usize = 256;

/// How long an ended connection may keep flushing.
pub const LINGER: Duration = Duration::from_secs(2);

/// Bytes one socket read takes at most.
const READ_CHUNK: usize = 64 << 10;

const WAKER: Token = Token(usize::MAX);
const LISTENER: Token = Token(usize::MAX - 1);

/// The transport registered under `nats`.
#[derive(Debug, Default)]
pub struct NatsTransport;

impl Transport for NatsTransport {
    fn scheme(&self) -> &str {
        SCHEME
    }

    fn infos(&self) -> Result<Vec<FabricInfo>, TransportError> {
        // Not a data path: nothing to negotiate.
        Ok(Vec::new())
    }

    fn open(&self, config: &EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        Ok(Box::new(NatsEndpoint::open(config)?))
    }
}

/// One client connection.
struct Conn {
    /// The socket, through its TLS session on a listener with TLS.
    stream: Wire,
    /// What goes on the socket in the clear before the TLS session starts:
    /// the `INFO` line, on a listener with TLS.
    clear: BytesMut,
    remote: String,
    session: NatsSession,
    input: BytesMut,
    output: BytesMut,
    /// The caller paused reading.
    paused: bool,
    /// The socket may hold unread bytes (a budget, a pause or a full
    /// output stopped the reading), so it is read without a readiness
    /// event once it may be.
    unread: bool,
    /// A send was refused: `Writable` is owed once the output drains.
    owe_writable: bool,
    /// Ended (locally or by the endpoint): the caller was told, the output
    /// is flushing until this instant, and nothing more is read.
    closing: Option<Instant>,
    /// Listed in the endpoint's `to_read`.
    scheduled: bool,
}

impl Conn {
    /// Nothing is left to write: no output, and no ciphertext or INFO the
    /// socket has not taken.
    fn flushed(&self) -> bool {
        self.output.is_empty() && self.clear.is_empty() && !self.stream.has_pending()
    }

    /// Whether more may be read now. Reading waits while the caller paused
    /// it, while the client's output is full (a client that does not read
    /// gets no more answers queued), and while its CONNECT awaits the
    /// broker's verdict beyond what a CONNECT line needs.
    fn may_read(&self, queue_bytes: usize) -> bool {
        // With TLS, the client's handshake is read once all of INFO is
        // out: nothing goes through the session before it.
        !self.paused
            && self.clear.is_empty()
            && self.output.len() < queue_bytes
            && (self.session.welcomed() || self.input.len() <= MAX_CONNECT_LINE)
    }
}

/// A listening NATS endpoint. See the module docs.
pub struct NatsEndpoint {
    poll: Poll,
    events: Events,
    waker: Waker,
    woken: bool,
    listener: TcpListener,
    local: SocketAddr,
    conns: FxHashMap<u64, Conn>,
    next_peer: u64,
    info: ServerInfo,
    /// Set when the listener requires TLS.
    tls: Option<TlsContext>,
    /// Clients start TLS before `INFO`, which goes through it.
    handshake_first: bool,
    queue_bytes: usize,
    max_frame: usize,
    /// Events made outside `poll` (a closed connection, a subscription
    /// that reached its maximum), handed out by the next `poll`.
    pending: Vec<Event>,
    scratch: Vec<Bytes>,
    /// What each socket read lands in first.
    read_buf: Box<[u8]>,
    /// Connections to read without a readiness event (see `Conn::unread`).
    to_read: Vec<u64>,
    /// Connections ended and still flushing.
    lingering: Vec<u64>,
}

impl std::fmt::Debug for NatsEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsEndpoint")
            .field("local", &self.local)
            .field("connections", &self.conns.len())
            .finish()
    }
}

fn option_error(name: &str, text: &str, expected: &str) -> TransportError {
    TransportError::Other(format!("nats option {name}={text:?}: expected {expected}"))
}

fn server_info(config: &EndpointConfig) -> Result<ServerInfo, TransportError> {
    let mut info = ServerInfo::default();
    for (name, text) in &config.options {
        let number = || {
            text.parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| option_error(name, text, "a positive number"))
        };
        match name.as_str() {
            "server_id" => info.server_id = text.clone(),
            "server_name" => info.server_name = text.clone(),
            "version" => info.version = text.clone(),
            "max_payload" => info.max_payload = number()?,
            "max_pings_out" => info.max_pings_out = number()?,
            "max_control_line" => info.max_control_line = number()?,
            "max_subscriptions" => info.max_subscriptions = number()?,
            "auth_required" => {
                info.auth_required = text
                    .parse()
                    .map_err(|_| option_error(name, text, "true or false"))?
            }
            // TLS settings, read by `NatsEndpoint::open` and `TlsContext`.
            _ if name.starts_with("tls_") => {}
            _ => {
                return Err(TransportError::Other(format!(
                    "unknown nats option {name:?}"
                )))
            }
        }
    }
    Ok(info)
}

impl NatsEndpoint {
    /// Listen at `config.bind` (`HOST:PORT`).
    pub fn open(config: &EndpointConfig) -> Result<Self, TransportError> {
        let Some(bind) = config.bind.as_deref() else {
            return Err(TransportError::Unsupported {
                scheme: SCHEME.to_string(),
                operation: "an endpoint without an address (NATS clients dial in)",
            });
        };
        let mut info = server_info(config)?;
        let tls = TlsContext::from_config(config, true)?;
        info.tls_required = tls.is_some();
        info.tls_verify = config.option("tls_verify_clients") == Some("true");
        let handshake_first = match config.option("tls_handshake_first") {
            None | Some("false") => false,
            Some("true") if tls.is_some() => true,
            Some("true") => {
                return Err(TransportError::Other(
                    "nats option tls_handshake_first needs TLS (tls_cert and tls_key)".to_string(),
                ))
            }
            Some(other) => return Err(option_error("tls_handshake_first", other, "true or false")),
        };
        let addr: SocketAddr = bind.parse().map_err(|err| TransportError::InvalidAddress {
            addr: bind.to_string(),
            reason: format!("{err}; expected IP:PORT, such as 127.0.0.1:4222"),
        })?;
        let mut listener = TcpListener::bind(addr).map_err(|source| TransportError::Bind {
            addr: bind.to_string(),
            source,
        })?;
        let local = listener.local_addr()?;
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        Ok(NatsEndpoint {
            poll,
            events: Events::with_capacity(256),
            waker,
            woken: false,
            listener,
            local,
            conns: FxHashMap::default(),
            next_peer: 1,
            info,
            tls,
            handshake_first,
            queue_bytes: config.queue_bytes.max(1),
            max_frame: config.max_frame,
            pending: Vec::new(),
            scratch: Vec::new(),
            read_buf: vec![0; READ_CHUNK].into_boxed_slice(),
            to_read: Vec::new(),
            lingering: Vec::new(),
        })
    }

    /// The bound address (with the port chosen when it was 0).
    pub fn local_socket_addr(&self) -> SocketAddr {
        self.local
    }

    /// Make the descriptor readable so the caller polls again soon.
    fn wake(&mut self) {
        if !self.woken {
            self.woken = true;
            if let Err(err) = self.waker.wake() {
                tracing::warn!("nats: cannot wake the endpoint: {err}");
            }
        }
    }

    fn accept(&mut self, events: &mut Vec<Event>) {
        for _ in 0..ACCEPT_BUDGET {
            let (mut stream, remote) = match self.listener.accept() {
                Ok(pair) => pair,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => {
                    tracing::warn!("nats: accept on {} failed: {err}", self.local);
                    return;
                }
            };
            let _ = stream.set_nodelay(true);
            let peer = self.next_peer;
            let Ok(token) = usize::try_from(peer) else {
                return;
            };
            if let Err(err) = self.poll.registry().register(
                &mut stream,
                Token(token),
                Interest::READABLE | Interest::WRITABLE,
            ) {
                tracing::warn!("nats: cannot register connection from {remote}: {err}");
                continue;
            }
            let session = match self.tls.as_ref().map(TlsContext::accept).transpose() {
                Ok(session) => session.flatten(),
                Err(err) => {
                    tracing::warn!("nats: no TLS session for the connection from {remote}: {err}");
                    let _ = self.poll.registry().deregister(&mut stream);
                    continue;
                }
            };
            self.next_peer += 1;
            let tls = session.is_some();
            let mut conn = Conn {
                stream: Wire::new(stream, session),
                clear: BytesMut::new(),
                remote: remote.to_string(),
                session: NatsSession::new(self.info.clone()),
                input: BytesMut::new(),
                output: BytesMut::new(),
                paused: false,
                unread: false,
                owe_writable: false,
                closing: None,
                scheduled: false,
            };
            let info = self.info.info_line(
                peer,
                &self.local.ip().to_string(),
                self.local.port(),
                &remote.ip().to_string(),
            );
            // With TLS only the INFO line goes in the clear; the client
            // starts the handshake once it has read it. Handshake first,
            // it waits in the session for the handshake to end.
            if tls && !self.handshake_first {
                conn.clear.extend_from_slice(info.as_bytes());
            } else {
                conn.output.extend_from_slice(info.as_bytes());
            }
            let _ = write_out(&mut conn);
            self.conns.insert(peer, conn);
            events.push(Event::Accepted {
                peer: PeerId(peer),
                remote: remote.to_string(),
            });
        }
        // More may wait: come back without a new readiness edge.
        self.wake();
    }

    /// Read and translate what a connection sent, within the budget.
    fn read(&mut self, peer: u64, events: &mut Vec<Event>) {
        let Some(conn) = self.conns.get_mut(&peer) else {
            return;
        };
        if conn.closing.is_some() {
            if discard(conn) {
                conn.closing = Some(Instant::now());
            }
            return;
        }
        let mut taken = 0;
        let mut gone = None;
        // A failed TLS session delivers nothing more: no flushing to wait for.
        let mut session_failed = false;
        while conn.may_read(self.queue_bytes) && taken < READ_BUDGET {
            // Read into the endpoint's buffer and keep what came: cheaper
            // than zeroing room in each connection's buffer for every read.
            match conn.stream.read(&mut self.read_buf) {
                Ok(0) => {
                    gone = Some(CloseReason::PeerClosed);
                    break;
                }
                Ok(n) => {
                    conn.input.extend_from_slice(&self.read_buf[..n]);
                    taken += n;
                }
                Err(err) => match err.kind() {
                    io::ErrorKind::WouldBlock => break,
                    io::ErrorKind::Interrupted => continue,
                    _ => {
                        session_failed =
                            conn.stream.is_tls() && err.kind() == io::ErrorKind::InvalidData;
                        gone = Some(CloseReason::Error(err.to_string()));
                        break;
                    }
                },
            }
        }
        let mut frames = std::mem::take(&mut self.scratch);
        // A paused connection's held input waits too.
        let result = if conn.paused {
            Ok(())
        } else {
            conn.session
                .receive(&mut conn.input, &mut frames, &mut conn.output)
        };
        // Stopped before the socket was empty: read on at once for a spent
        // budget (or an obstacle the parse removed), else when the
        // obstacle goes.
        let may_read = conn.may_read(self.queue_bytes);
        conn.unread = gone.is_none() && (taken >= READ_BUDGET || !may_read);
        let again = conn.unread && may_read;
        for frame in frames.drain(..) {
            events.push(Event::Frame {
                peer: PeerId(peer),
                frame,
            });
        }
        self.scratch = frames;
        let written = write_out(conn);
        if let Err(Fatal(text)) = result {
            tracing::debug!(remote = %conn.remote, %text, "nats: closing a client");
            let reason = CloseReason::Error(format!("NATS protocol: {text}"));
            self.end(peer, reason, events);
        } else if let Some(reason) = gone {
            self.end(peer, reason, events);
            // The client is gone: once nothing is left to flush, nothing
            // is left to wait for.
            if let Some(conn) = self.conns.get_mut(&peer) {
                if conn.flushed() || session_failed {
                    conn.closing = Some(Instant::now());
                }
            }
        } else if let Err(err) = written {
            self.end(peer, CloseReason::Error(err.to_string()), events);
        } else if again {
            self.read_later(peer);
        }
    }

    /// Read a connection on the next poll, without a readiness event.
    fn read_later(&mut self, peer: u64) {
        if let Some(conn) = self.conns.get_mut(&peer) {
            conn.unread = true;
            if !conn.scheduled {
                conn.scheduled = true;
                self.to_read.push(peer);
            }
            self.wake();
        }
    }

    /// A connection ends: the caller hears of it at once, what is queued
    /// for the client is flushed as far as it reads (an `-ERR` last), for
    /// at most [`LINGER`], and nothing more is read from it.
    fn end(&mut self, peer: u64, reason: CloseReason, events: &mut Vec<Event>) {
        let Some(conn) = self.conns.get_mut(&peer) else {
            return;
        };
        if conn.closing.is_some() {
            // Told already.
            return;
        }
        let _ = write_out(conn);
        if conn.flushed() {
            let _ = conn.stream.shutdown_write();
        }
        conn.closing = Some(Instant::now() + LINGER);
        self.lingering.push(peer);
        events.push(Event::Closed {
            peer: PeerId(peer),
            reason,
        });
    }

    /// Translate frames for a client and write what the socket takes.
    fn translate(&mut self, peer: PeerId, frames: &[Bytes]) -> Result<(), SendError> {
        let Some(conn) = self.conns.get_mut(&peer.0) else {
            return Err(SendError::Closed(peer));
        };
        if conn.closing.is_some() {
            return Err(SendError::Closed(peer));
        }
        let mut to_broker = std::mem::take(&mut self.scratch);
        let mut result = Ok(());
        for frame in frames {
            result = conn
                .session
                .deliver(frame, &mut conn.output, &mut to_broker);
            if result.is_err() {
                break;
            }
        }
        let write = write_out(conn);
        // A welcome lets the operations behind the CONNECT go on.
        let resume = conn.unread && conn.may_read(self.queue_bytes) || conn.session.take_resumed();
        let mut made = Vec::new();
        for frame in to_broker.drain(..) {
            made.push(Event::Frame { peer, frame });
        }
        self.scratch = to_broker;
        if !made.is_empty() {
            self.pending.extend(made);
            self.wake();
        }
        if let Err(Fatal(text)) = result {
            // The broker ended it (an error it reported, a goodbye) or the
            // client stopped answering pings.
            let mut events = Vec::new();
            self.end(peer.0, CloseReason::Error(text), &mut events);
            self.pending.extend(events);
            self.wake();
            return Ok(());
        }
        if let Err(err) = write {
            let mut events = Vec::new();
            self.end(peer.0, CloseReason::Error(err.to_string()), &mut events);
            self.pending.extend(events);
            self.wake();
        } else if resume {
            self.read_later(peer.0);
        }
        Ok(())
    }

    fn room(&self, peer: PeerId) -> Result<bool, SendError> {
        let conn = self.conns.get(&peer.0).ok_or(SendError::Closed(peer))?;
        if conn.closing.is_some() {
            return Err(SendError::Closed(peer));
        }
        Ok(conn.output.len() < self.queue_bytes)
    }

    fn owe(&mut self, peer: PeerId) {
        if let Some(conn) = self.conns.get_mut(&peer.0) {
            conn.owe_writable = true;
        }
    }

    fn service_writable(&mut self, peer: u64, events: &mut Vec<Event>) {
        let Some(conn) = self.conns.get_mut(&peer) else {
            return;
        };
        let written = write_out(conn);
        if conn.closing.is_some() {
            match written {
                Ok(()) if conn.flushed() => {
                    let _ = conn.stream.shutdown_write();
                }
                Ok(()) => {}
                // The client is gone: nothing more to flush.
                Err(_) => conn.closing = Some(Instant::now()),
            }
            return;
        }
        if let Err(err) = written {
            self.end(peer, CloseReason::Error(err.to_string()), events);
            return;
        }
        if conn.owe_writable && conn.output.len() <= self.queue_bytes / 2 {
            conn.owe_writable = false;
            events.push(Event::Writable { peer: PeerId(peer) });
        }
        if conn.unread && conn.may_read(self.queue_bytes) {
            self.read_later(peer);
        }
    }

    /// Drop ended connections that flushed or ran out of time.
    fn reap(&mut self, now: Instant) {
        let conns = &mut self.conns;
        let registry = self.poll.registry();
        self.lingering.retain(|peer| {
            let done = conns
                .get(peer)
                .is_none_or(|conn| conn.closing.is_some_and(|until| now >= until));
            if done {
                if let Some(conn) = conns.remove(peer) {
                    use std::os::fd::AsRawFd;
                    let _ = registry.deregister(&mut SourceFd(&conn.stream.as_raw_fd()));
                }
            }
            !done
        });
    }
}

/// Write as much of the output as the socket takes (through the TLS
/// session, after what goes in the clear).
fn write_out(conn: &mut Conn) -> io::Result<()> {
    while !conn.clear.is_empty() {
        match (&*conn.stream).write(&conn.clear) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                let _ = conn.clear.split_to(n);
            }
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        }
    }
    // Ciphertext the socket did not take goes first.
    conn.stream.flush_pending()?;
    while !conn.output.is_empty() {
        match conn.stream.write_vectored(&[IoSlice::new(&conn.output)]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                let _ = conn.output.split_to(n);
            }
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        }
    }
    if conn.output.is_empty() && conn.output.capacity() > READ_CHUNK {
        conn.output = BytesMut::new();
    }
    Ok(())
}

/// Read and throw away what an ended connection still sends; true once
/// the client closed its side (or the socket failed).
fn discard(conn: &mut Conn) -> bool {
    let mut sink = [0u8; 4096];
    for _ in 0..64 {
        match conn.stream.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => return false,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return true,
        }
    }
    false
}

impl Endpoint for NatsEndpoint {
    fn scheme(&self) -> &str {
        SCHEME
    }

    fn local_addr(&self) -> Vec<u8> {
        self.local.to_string().into_bytes()
    }

    fn max_frame(&self) -> usize {
        self.max_frame
    }

    fn connect(&mut self, _: &str) -> Result<PeerId, TransportError> {
        Err(TransportError::Unsupported {
            scheme: SCHEME.to_string(),
            operation: "connect (NATS clients dial in; brokers route over tcp)",
        })
    }

    fn reload_tls(&mut self) -> Result<bool, TransportError> {
        match self.tls.as_mut() {
            Some(tls) => tls.reload().map(|()| true),
            None => Ok(false),
        }
    }

    fn peer_certificate(&self, peer: PeerId) -> Option<Vec<u8>> {
        self.conns.get(&peer.0)?.stream.peer_certificate()
    }

    fn send(&mut self, peer: PeerId, frame: OutFrame) -> Result<(), SendError> {
        // Messages wait for room; the broker's few control frames (an error
        // before a close above all) go behind them at once, so a client cut
        // off as a slow consumer still reads why, last.
        let kind = frame.head.get(codec::PREFIX_LEN).copied();
        let message = kind == Some(FrameKind::Message as u8) || kind == Some(FrameKind::Run as u8);
        if message && !self.room(peer)? {
            self.owe(peer);
            return Err(SendError::WouldBlock(frame));
        }
        self.translate(peer, &[frame.to_bytes()])
    }

    fn send_run(&mut self, peer: PeerId, run: Bytes) -> Result<(), SendError> {
        if !self.room(peer)? {
            self.owe(peer);
            return Err(SendError::WouldBlock(OutFrame::whole(run)));
        }
        let mut frames = split_run(&run);
        let whole: Vec<Bytes> = frames.by_ref().map(|frame| frame.head).collect();
        if frames.offset() < run.len() {
            return Err(SendError::Transport(TransportError::Other(format!(
                "a run of {} bytes ends inside the frame at byte {}",
                run.len(),
                frames.offset()
            ))));
        }
        self.translate(peer, &whole)
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), TransportError> {
        events.append(&mut self.pending);
        self.poll
            .poll(&mut self.events, Some(Duration::ZERO))
            .or_else(|err| match err.kind() {
                io::ErrorKind::Interrupted => Ok(()),
                _ => Err(err),
            })?;
        let mut ready: VecDeque<(Token, bool, bool)> = self
            .events
            .iter()
            .map(|event| {
                let readable = event.is_readable() || event.is_read_closed() || event.is_error();
                (event.token(), readable, event.is_writable())
            })
            .collect();
        self.woken = false;
        // Connections left with unread bytes are read again.
        for peer in std::mem::take(&mut self.to_read) {
            if let Some(conn) = self.conns.get_mut(&peer) {
                conn.scheduled = false;
            }
            if let Ok(token) = usize::try_from(peer) {
                ready.push_back((Token(token), true, false));
            }
        }
        while let Some((token, readable, writable)) = ready.pop_front() {
            match token {
                WAKER => {}
                LISTENER => self.accept(events),
                Token(token) => {
                    let peer = token as u64;
                    if writable {
                        self.service_writable(peer, events);
                    }
                    if readable {
                        self.read(peer, events);
                    }
                }
            }
        }
        self.reap(Instant::now());
        Ok(())
    }

    fn close(&mut self, peer: PeerId) {
        let Some(conn) = self.conns.get_mut(&peer.0) else {
            return;
        };
        if conn.closing.is_none() {
            let mut events = Vec::new();
            self.end(peer.0, CloseReason::Local, &mut events);
            self.pending.extend(events);
            self.wake();
        }
    }

    fn readiness(&self) -> Readiness {
        use std::os::fd::AsRawFd;
        Readiness::Fd(self.poll.as_raw_fd())
    }

    /// A closing connection is dropped by a poll after its deadline, which
    /// no descriptor announces. (A wait under a millisecond would be a
    /// sleep deaf to the descriptors: the deadline may pass by up to one.)
    fn wait_cap(&self) -> Option<Duration> {
        let now = Instant::now();
        self.lingering
            .iter()
            .filter_map(|peer| self.conns.get(peer)?.closing)
            .min()
            .map(|until| match until.saturating_duration_since(now) {
                Duration::ZERO => Duration::ZERO,
                left => left.max(Duration::from_millis(1)),
            })
    }

    fn queued_bytes(&self, peer: PeerId) -> usize {
        self.conns.get(&peer.0).map_or(0, |conn| conn.output.len())
    }

    fn set_read_paused(&mut self, peer: PeerId, paused: bool) {
        if let Some(conn) = self.conns.get_mut(&peer.0) {
            conn.paused = paused;
            if !paused && conn.unread {
                self.read_later(peer.0);
            }
        }
    }
}
