//! The NATS listener's I/O thread: it owns the listening socket and every
//! client connection (sockets, TLS sessions, protocol state), reads and
//! parses what clients send into efabus frames, and formats and writes what
//! the broker sends them. The broker's event loop sees only frames, through
//! [`super::NatsEndpoint`], so the protocol work runs beside the routing on
//! another core.
//!
//! The two sides meet in [`Shared`]: events for the broker in one list,
//! commands for this thread in another, each behind a short lock, and a
//! wake-up descriptor for each side that is written only when its list
//! goes from empty to not. Per connection, [`ConnShared`] counts the bytes
//! queued for the client (frames handed over and not yet translated, and
//! translated output not yet written), which the endpoint holds to
//! `queue_bytes`.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};
use std::net::SocketAddr;
use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use efabus_core::transport::{CloseReason, Event, PeerId};
use mio::net::TcpListener;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::session::{Fatal, NatsSession, ServerInfo, MAX_CONNECT_LINE};
use crate::tls::{HandshakeWorkers, TlsContext, Wire};

/// Most bytes read from one connection in one round.
pub const READ_BUDGET: usize = 1 << 20;

/// Most connections accepted in one round.
const ACCEPT_BUDGET: usize = 256;

/// How long after a failed accept (out of descriptors, say) the backlog
/// is tried again.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// How long an ended connection may keep flushing.
pub const LINGER: Duration = Duration::from_secs(2);

/// Bytes one socket read takes at most.
const READ_CHUNK: usize = 64 << 10;

/// How long the thread keeps polling, yielding its core between polls,
/// after a round with work, before it sleeps: the broker's answer to what
/// was read (a delivery, a reply) and a client's answer to what was
/// written usually come within it, and taking them without a wake-up
/// keeps a round trip through the listener shorter than when the
/// broker's own loop did this work.
const SPIN: Duration = Duration::from_micros(50);

/// Most bytes of frames read from clients that may wait for the broker to
/// take them; past it the thread stops reading (and TCP holds the clients
/// back) until the broker catches up.
pub(super) const INBOUND_LIMIT: usize = 4 << 20;

pub(super) const WAKER: Token = Token(usize::MAX);
pub(super) const LISTENER: Token = Token(usize::MAX - 1);

/// What the endpoint asks of the I/O thread.
pub(super) enum Command {
    /// Frames for a client: one frame, or a run of them. Their length was
    /// counted in the client's `ConnShared::queued`.
    Send { peer: u64, frames: Bytes, run: bool },
    /// End a connection (the endpoint's `close`).
    Close(u64),
    /// Stop or resume reading a connection.
    Pause(u64, bool),
    /// A step of the connection's TLS handshake ended on a worker: read
    /// it again.
    Stepped(u64),
    /// Limits a reload changed, for every connection; answered once in
    /// force.
    Limits {
        max_subscriptions: usize,
        max_payload: usize,
        queue_bytes: usize,
        applied: std::sync::mpsc::SyncSender<()>,
    },
}

/// What one connection shows the endpoint.
#[derive(Debug, Default)]
pub(super) struct ConnShared {
    /// Bytes queued for the client: handed to the I/O thread and not yet
    /// translated, or translated and not yet written.
    pub queued: AtomicUsize,
    /// A send was refused: `Writable` is owed once the queue drains to half.
    pub owe: AtomicBool,
    /// The client certificate its TLS session verified, once known.
    pub certificate: Mutex<Option<Vec<u8>>>,
}

/// Where the endpoint and the I/O thread meet.
pub(super) struct Shared {
    /// Events for the broker, with the connections they introduce.
    pub inbox: Mutex<Inbox>,
    /// Commands for the I/O thread.
    pub commands: Mutex<Vec<Command>>,
    /// Wakes the I/O thread.
    pub worker_waker: Waker,
    /// Makes the endpoint's descriptor readable.
    pub endpoint_waker: Waker,
    /// The endpoint is gone: the thread ends.
    pub stop: AtomicBool,
    /// The thread is about to sleep, or sleeps, until woken.
    pub parked: AtomicBool,
    /// Bytes of frames in `inbox` (and on their way there) that the
    /// endpoint has not taken yet; reading stops at [`INBOUND_LIMIT`].
    pub inbound: AtomicUsize,
    /// The TLS settings, read again by the endpoint's `reload_tls`.
    pub tls: Mutex<Option<TlsContext>>,
}

#[derive(Default)]
pub(super) struct Inbox {
    pub events: Vec<Event>,
    pub accepted: Vec<(u64, Arc<ConnShared>)>,
}

impl Shared {
    /// Queue a command; the thread is woken when the queue was empty and
    /// it sleeps (a thread still polling finds the command itself).
    pub fn command(&self, command: Command) {
        let was_empty = {
            let mut commands = self.commands.lock();
            commands.push(command);
            commands.len() == 1
        };
        if was_empty {
            self.wake_parked();
        }
    }

    /// Wake the thread if it sleeps. It says so before it looks at its
    /// work a last time, and this side looks after adding work: one of
    /// the two sees the other.
    pub fn wake_parked(&self) {
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            if let Err(err) = self.worker_waker.wake() {
                tracing::warn!("nats: cannot wake the I/O thread: {err}");
            }
        }
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
    /// What the endpoint reads of this connection.
    shared: Arc<ConnShared>,
    /// The output's length as last counted in `shared.queued`.
    counted: usize,
    /// The verified client certificate was handed to the endpoint.
    certificate_told: bool,
    /// Ended (locally or by the endpoint): the caller was told, the output
    /// is flushing until this instant, and nothing more is read.
    closing: Option<Instant>,
    /// Listed in the worker's `to_read`.
    scheduled: bool,
    /// Listed in the worker's `starved`.
    starved: bool,
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

/// The I/O thread's state. See the module docs.
pub(super) struct Worker {
    poll: Poll,
    listener: TcpListener,
    local: SocketAddr,
    info: ServerInfo,
    queue_bytes: usize,
    shared: Arc<Shared>,
    events: Events,
    woken: bool,
    conns: FxHashMap<u64, Conn>,
    next_peer: u64,
    /// Connections accepted since the broker was last told.
    accepted: Vec<(u64, Arc<ConnShared>)>,
    /// When to accept again without a readiness edge: connections left in
    /// the backlog after a round's budget (at once), or after an accept
    /// failed (out of descriptors: a little later).
    accept_at: Option<Instant>,
    scratch: Vec<Bytes>,
    /// What each socket read lands in first.
    read_buf: Box<[u8]>,
    /// Connections to read without a readiness event (see `Conn::unread`).
    to_read: Vec<u64>,
    /// Connections left unread because the broker had not taken enough of
    /// what was read ([`INBOUND_LIMIT`]), to read once it has.
    starved: Vec<u64>,
    /// Bytes of frames made this round, not yet counted in
    /// `Shared::inbound`.
    round_inbound: usize,
    /// Connections ended and still flushing.
    lingering: Vec<u64>,
}

impl Worker {
    pub fn new(
        poll: Poll,
        listener: TcpListener,
        local: SocketAddr,
        info: ServerInfo,
        queue_bytes: usize,
        shared: Arc<Shared>,
    ) -> Worker {
        Worker {
            poll,
            listener,
            local,
            info,
            queue_bytes,
            shared,
            events: Events::with_capacity(256),
            woken: false,
            conns: FxHashMap::default(),
            next_peer: 1,
            accepted: Vec::new(),
            accept_at: None,
            scratch: Vec::new(),
            read_buf: vec![0; READ_CHUNK].into_boxed_slice(),
            to_read: Vec::new(),
            starved: Vec::new(),
            round_inbound: 0,
            lingering: Vec::new(),
        }
    }

    /// Serve until the endpoint is dropped.
    pub fn run(mut self) {
        let mut events = Vec::new();
        // When a round last had work.
        let mut busy_at: Option<Instant> = None;
        let mut busy = false;
        while !self.shared.stop.load(Ordering::Acquire) {
            let spinning = busy_at.is_some_and(|at| at.elapsed() < SPIN);
            let mut timeout =
                if self.woken || !self.to_read.is_empty() || spinning || self.may_feed_starved() {
                    Some(Duration::ZERO)
                } else {
                    self.idle_wait()
                };
            // Nothing to do last round: let another thread have the core
            // before looking again.
            if spinning && !busy && !self.woken {
                std::thread::yield_now();
            }
            let parks = timeout != Some(Duration::ZERO);
            if parks {
                self.shared.parked.store(true, Ordering::SeqCst);
                fence(Ordering::SeqCst);
                // Work added before the flag was seen woke no one.
                if !self.shared.commands.lock().is_empty() || self.may_feed_starved() {
                    timeout = Some(Duration::ZERO);
                }
            }
            let polled = self.poll.poll(&mut self.events, timeout);
            if parks {
                self.shared.parked.store(false, Ordering::SeqCst);
            }
            if let Err(err) = polled {
                if err.kind() != io::ErrorKind::Interrupted {
                    tracing::warn!("nats: poll failed: {err}");
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            busy = self.round(&mut events);
            if busy {
                busy_at = Some(Instant::now());
            }
            if self.round_inbound > 0 {
                // Counted before the endpoint can take them.
                self.shared
                    .inbound
                    .fetch_add(self.round_inbound, Ordering::SeqCst);
                self.round_inbound = 0;
            }
            if !events.is_empty() || !self.accepted.is_empty() {
                let was_empty = {
                    let mut inbox = self.shared.inbox.lock();
                    let was_empty = inbox.events.is_empty() && inbox.accepted.is_empty();
                    inbox.accepted.append(&mut self.accepted);
                    inbox.events.append(&mut events);
                    was_empty
                };
                if was_empty {
                    if let Err(err) = self.shared.endpoint_waker.wake() {
                        tracing::warn!("nats: cannot wake the endpoint: {err}");
                    }
                }
            }
        }
    }

    /// The broker has taken enough of what was read for the connections
    /// left unread to be read again.
    fn may_feed_starved(&self) -> bool {
        !self.starved.is_empty() && !self.inbound_full()
    }

    fn inbound_full(&self) -> bool {
        self.shared.inbound.load(Ordering::SeqCst) + self.round_inbound >= INBOUND_LIMIT
    }

    /// How long to wait with nothing to do: until the first closing
    /// connection's deadline or the next accept, at least a millisecond
    /// (epoll's unit).
    fn idle_wait(&self) -> Option<Duration> {
        let now = Instant::now();
        self.lingering
            .iter()
            .filter_map(|peer| self.conns.get(peer)?.closing)
            .chain(self.accept_at)
            .min()
            .map(|until| match until.saturating_duration_since(now) {
                Duration::ZERO => Duration::ZERO,
                left => left.max(Duration::from_millis(1)),
            })
    }

    /// One round: the endpoint's commands, then the sockets that are
    /// ready. True when there was any.
    fn round(&mut self, events: &mut Vec<Event>) -> bool {
        if self.may_feed_starved() {
            for peer in std::mem::take(&mut self.starved) {
                if let Some(conn) = self.conns.get_mut(&peer) {
                    conn.starved = false;
                }
                self.read_later(peer);
            }
        }
        let commands = std::mem::take(&mut *self.shared.commands.lock());
        let busy = !commands.is_empty() || !self.events.is_empty() || !self.to_read.is_empty();
        for command in commands {
            match command {
                Command::Send { peer, frames, run } => self.send(peer, frames, run, events),
                Command::Close(peer) => {
                    if self
                        .conns
                        .get(&peer)
                        .is_some_and(|conn| conn.closing.is_none())
                    {
                        self.end(peer, CloseReason::Local, events);
                    }
                }
                Command::Limits {
                    max_subscriptions,
                    max_payload,
                    queue_bytes,
                    applied,
                } => {
                    self.queue_bytes = queue_bytes;
                    self.info.max_subscriptions = max_subscriptions;
                    self.info.max_payload = max_payload;
                    for conn in self.conns.values_mut() {
                        conn.session.set_limits(max_subscriptions, max_payload);
                    }
                    let _ = applied.send(());
                }
                Command::Stepped(peer) => {
                    if let Some(conn) = self.conns.get(&peer) {
                        conn.stream.take_stepped();
                    }
                    self.read_later(peer);
                }
                Command::Pause(peer, paused) => {
                    if let Some(conn) = self.conns.get_mut(&peer) {
                        conn.paused = paused;
                        conn.session.set_reads_held(paused);
                        if !paused && conn.unread {
                            self.read_later(peer);
                        }
                    }
                }
            }
        }
        // Connections left with unread bytes are read again, first: those
        // the broker's backlog held back have waited longest.
        let mut ready: VecDeque<(Token, bool, bool)> = VecDeque::new();
        for peer in std::mem::take(&mut self.to_read) {
            if let Some(conn) = self.conns.get_mut(&peer) {
                conn.scheduled = false;
            }
            if let Ok(token) = usize::try_from(peer) {
                ready.push_back((Token(token), true, false));
            }
        }
        ready.extend(self.events.iter().map(|event| {
            let readable = event.is_readable() || event.is_read_closed() || event.is_error();
            (event.token(), readable, event.is_writable())
        }));
        if self.accept_at.is_some_and(|at| at <= Instant::now()) {
            ready.push_back((LISTENER, true, false));
        }
        self.woken = false;
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
        busy
    }

    /// Frames the broker sent a client: uncounted from its queue as they
    /// are translated (the output they become is counted instead).
    fn send(&mut self, peer: u64, frames: Bytes, run: bool, events: &mut Vec<Event>) {
        if let Some(conn) = self.conns.get(&peer) {
            conn.shared.queued.fetch_sub(frames.len(), Ordering::SeqCst);
        }
        self.translate(PeerId(peer), &frames, run, events);
        if let Some(conn) = self.conns.get_mut(&peer) {
            owe_writable(conn, peer, self.queue_bytes, events);
        }
    }

    /// Make the next round come at once.
    fn wake(&mut self) {
        self.woken = true;
    }

    fn accept(&mut self, events: &mut Vec<Event>) {
        self.accept_at = None;
        for _ in 0..ACCEPT_BUDGET {
            let (mut stream, remote) = match self.listener.accept() {
                Ok(pair) => pair,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => {
                    // The backlog stays; no new edge may come for it.
                    tracing::warn!("nats: accept on {} failed: {err}", self.local);
                    self.accept_at = Some(Instant::now() + ACCEPT_RETRY);
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
            let session = match self
                .shared
                .tls
                .lock()
                .as_ref()
                .map(TlsContext::accept)
                .transpose()
            {
                Ok(session) => session.flatten(),
                Err(err) => {
                    tracing::warn!("nats: no TLS session for the connection from {remote}: {err}");
                    let _ = self.poll.registry().deregister(&mut stream);
                    continue;
                }
            };
            self.next_peer += 1;
            let mut wire = Wire::new(stream, session);
            // Without workers, handshakes run here, as they can; a plain
            // connection starts none.
            if let Some(workers) = wire.is_tls().then(HandshakeWorkers::shared).flatten() {
                let shared = Arc::clone(&self.shared);
                let call_back = Arc::new(move || shared.command(Command::Stepped(peer)));
                wire = wire.with_handshake_workers(workers, remote.ip(), call_back);
            }
            let mut conn = Conn {
                stream: wire,
                clear: BytesMut::new(),
                remote: remote.to_string(),
                session: NatsSession::new(self.info.clone()),
                input: BytesMut::new(),
                output: BytesMut::new(),
                paused: false,
                unread: false,
                shared: Arc::new(ConnShared::default()),
                counted: 0,
                certificate_told: false,
                closing: None,
                scheduled: false,
                starved: false,
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
            if conn.stream.is_tls() && !self.info.handshake_first {
                conn.clear.extend_from_slice(info.as_bytes());
            } else {
                conn.output.extend_from_slice(info.as_bytes());
            }
            let _ = write_out(&mut conn);
            count_output(&mut conn);
            self.accepted.push((peer, conn.shared.clone()));
            self.conns.insert(peer, conn);
            events.push(Event::Accepted {
                peer: PeerId(peer),
                remote: remote.to_string(),
            });
        }
        // More may wait: come back without a new readiness edge.
        self.accept_at = Some(Instant::now());
        self.wake();
    }

    /// Read and translate what a connection sent, within the budget.
    fn read(&mut self, peer: u64, events: &mut Vec<Event>) {
        let full = self.inbound_full();
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
        while !full && conn.may_read(self.queue_bytes) && taken < READ_BUDGET {
            // Read into the thread's buffer and keep what came: cheaper
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
        conn.unread = gone.is_none() && (taken >= READ_BUDGET || !may_read || full);
        let again = conn.unread && may_read && !full;
        // Held back only by what the broker has yet to take.
        let starve = conn.unread && may_read && full && !conn.starved;
        conn.starved |= starve;
        // The broker looks the certificate up when the CONNECT's hello
        // arrives, so it is told before the first frame (which comes after
        // the handshake).
        if !conn.certificate_told && !frames.is_empty() {
            conn.certificate_told = true;
            *conn.shared.certificate.lock() = conn.stream.peer_certificate();
        }
        for frame in frames.drain(..) {
            self.round_inbound += frame.len();
            events.push(Event::Frame {
                peer: PeerId(peer),
                frame,
            });
        }
        self.scratch = frames;
        let written = write_out(conn);
        count_output(conn);
        owe_writable(conn, peer, self.queue_bytes, events);
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
        if starve {
            self.starved.push(peer);
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
        count_output(conn);
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

    /// Translate frames from the broker for a client and write what the
    /// socket takes; frames for an ended connection are dropped.
    fn translate(&mut self, peer: PeerId, frames: &[u8], run: bool, events: &mut Vec<Event>) {
        let Some(conn) = self.conns.get_mut(&peer.0) else {
            return;
        };
        if conn.closing.is_some() {
            return;
        }
        let mut to_broker = std::mem::take(&mut self.scratch);
        let output = &mut conn.output;
        let result = if run {
            conn.session
                .deliver_run(frames, output, &mut to_broker)
                .and_then(|end| {
                    if end == frames.len() {
                        return Ok(());
                    }
                    // The broker hands whole frames only.
                    let text = format!(
                        "a run of {} bytes ends inside the frame at byte {end}",
                        frames.len()
                    );
                    tracing::warn!("nats: {text}");
                    Err(Fatal(text))
                })
        } else {
            conn.session.deliver(frames, output, &mut to_broker)
        };
        let write = write_out(conn);
        count_output(conn);
        // A welcome lets the operations behind the CONNECT go on.
        let resume = conn.unread && conn.may_read(self.queue_bytes) || conn.session.take_resumed();
        for frame in to_broker.drain(..) {
            self.round_inbound += frame.len();
            events.push(Event::Frame { peer, frame });
        }
        self.scratch = to_broker;
        if let Err(Fatal(text)) = result {
            // The broker ended it (an error it reported, a goodbye) or the
            // client stopped answering pings.
            self.end(peer.0, CloseReason::Error(text), events);
            return;
        }
        if let Err(err) = write {
            self.end(peer.0, CloseReason::Error(err.to_string()), events);
        } else if resume {
            self.read_later(peer.0);
        }
    }

    fn service_writable(&mut self, peer: u64, events: &mut Vec<Event>) {
        let Some(conn) = self.conns.get_mut(&peer) else {
            return;
        };
        let written = write_out(conn);
        count_output(conn);
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
        owe_writable(conn, peer, self.queue_bytes, events);
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
    let stream = &conn.stream;
    if !drain(&mut conn.clear, |bytes| (&**stream).write(bytes))? {
        return Ok(());
    }
    // The session is a worker's for now; its call back brings a read,
    // and this write, again.
    if stream.in_handshake_step() {
        return Ok(());
    }
    // Ciphertext the socket did not take goes first.
    stream.flush_pending()?;
    drain(&mut conn.output, |bytes| {
        stream.write_vectored(&[IoSlice::new(bytes)])
    })?;
    if conn.output.is_empty() && conn.output.capacity() > READ_CHUNK {
        conn.output = BytesMut::new();
    }
    Ok(())
}

/// Write `buf` with `write` until it is empty (true) or the socket would
/// block (false).
fn drain(
    buf: &mut BytesMut,
    mut write: impl FnMut(&[u8]) -> io::Result<usize>,
) -> io::Result<bool> {
    while !buf.is_empty() {
        match write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf.advance(n),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(true)
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

/// Count a change of the connection's output in its shared queue.
fn count_output(conn: &mut Conn) {
    let now = conn.output.len();
    if now > conn.counted {
        conn.shared
            .queued
            .fetch_add(now - conn.counted, Ordering::SeqCst);
    } else {
        conn.shared
            .queued
            .fetch_sub(conn.counted - now, Ordering::SeqCst);
    }
    conn.counted = now;
}

/// `Writable` for a connection the endpoint refused a send, once its queue
/// is down to half.
fn owe_writable(conn: &mut Conn, peer: u64, queue_bytes: usize, events: &mut Vec<Event>) {
    if conn.closing.is_some() {
        // Ended: the broker was told, and sends nothing more.
        return;
    }
    // The endpoint sets `owe` before it looks at `queued` again, and this
    // side lowers `queued` before it looks at `owe`: one of the two sees
    // the other's change.
    if conn.shared.queued.load(Ordering::SeqCst) <= queue_bytes / 2
        && conn.shared.owe.swap(false, Ordering::SeqCst)
    {
        events.push(Event::Writable { peer: PeerId(peer) });
    }
}
