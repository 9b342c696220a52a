//! The NATS listener (scheme `nats`): NATS clients in any language connect
//! to it with their own client libraries, and the broker sees each as a
//! client session like a native one, with the same routing, limits,
//! permissions, slow-consumer policy, statistics and monitoring.
//!
//! The endpoint only listens (`nats/IP:PORT`, 4222 by convention). Its
//! connections live on an I/O thread of their own ([`worker`]): each gets
//! the server's `INFO` at once; from then on [`NatsSession`] translates:
//! the client's protocol lines become efabus frames in [`Event::Frame`]s,
//! and the frames the broker sends become protocol lines, so the parsing,
//! formatting and socket calls run beside the broker's routing. `send` and
//! `send_run` hand frames to that thread; past `queue_bytes` queued for a
//! client (handed over or written out but not yet taken by its socket) a
//! message returns [`SendError::WouldBlock`] (control frames, an error
//! before a close above all, still go) and [`Event::Writable`] follows
//! when the queue has drained to half. Reading takes at most
//! [`READ_BUDGET`] bytes per connection per round, and nothing while the
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
//! cleartext fallback. With `tls_handshake_first=true` clients begin with
//! the handshake instead (NATS's "TLS first") and `INFO` is the first
//! thing sent through it; clients that wait for `INFO` first then get
//! nothing.

mod session;
mod worker;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use efabus_core::caps::FabricInfo;
use efabus_core::codec::{self, FrameKind};
use efabus_core::transport::{
    CloseReason, Endpoint, EndpointConfig, Event, OutFrame, PeerId, Readiness, SendError,
    Transport, TransportError,
};
use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::tls::TlsContext;
use worker::{Command, ConnShared, Inbox, Shared, Worker, LISTENER, WAKER};

pub use session::{
    Fatal, NatsSession, ServerInfo, DEFAULT_MAX_CONTROL_LINE, DEFAULT_MAX_PINGS_OUT,
    MAX_CONNECT_LINE,
};
pub use worker::{LINGER, READ_BUDGET};

/// The scheme naming this transport in endpoint strings.
pub const SCHEME: &str = "nats";

/// The token of the endpoint's own wake-up in its `Poll`.
const INBOX: Token = Token(0);

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

/// A listening NATS endpoint: the broker's side of it. See the module docs.
pub struct NatsEndpoint {
    shared: Arc<Shared>,
    /// Holds the wake-up the I/O thread writes when it has events: its
    /// descriptor is this endpoint's readiness.
    poll: Poll,
    events: Events,
    local: SocketAddr,
    /// Open connections, as the broker knows them.
    conns: FxHashMap<u64, Arc<ConnShared>>,
    /// Connections whose `Closed` the last poll handed out: forgotten at
    /// the next, once the broker has handled the events before it (a
    /// CONNECT's hello looks its certificate up here).
    closed: Vec<u64>,
    queue_bytes: usize,
    max_frame: usize,
    worker: Option<JoinHandle<()>>,
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

fn server_info(options: &[(String, String)]) -> Result<ServerInfo, TransportError> {
    let mut info = ServerInfo::default();
    for (name, text) in options {
        let number = || {
            text.parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| option_error(name, text, "a positive number"))
        };
        let flag = || {
            text.parse::<bool>()
                .map_err(|_| option_error(name, text, "true or false"))
        };
        match name.as_str() {
            "server_id" => info.server_id = text.clone(),
            "server_name" => info.server_name = text.clone(),
            "version" => info.version = text.clone(),
            "max_payload" => info.max_payload = number()?,
            "max_pings_out" => info.max_pings_out = number()?,
            "max_control_line" => info.max_control_line = number()?,
            "max_subscriptions" => info.max_subscriptions = number()?,
            "auth_required" => info.auth_required = flag()?,
            "tls_verify_clients" => info.tls_verify = flag()?,
            "tls_handshake_first" => info.handshake_first = flag()?,
            // The TLS files, read by `TlsContext`.
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
    /// Listen at `config.bind` (`HOST:PORT`) and start the I/O thread.
    pub fn open(config: &EndpointConfig) -> Result<Self, TransportError> {
        let Some(bind) = config.bind.as_deref() else {
            return Err(TransportError::Unsupported {
                scheme: SCHEME.to_string(),
                operation: "an endpoint without an address (NATS clients dial in)",
            });
        };
        let mut info = server_info(&config.options)?;
        let tls = TlsContext::from_config(config, true)?;
        info.tls_required = tls.is_some();
        if info.handshake_first && tls.is_none() {
            return Err(TransportError::Other(
                "nats option tls_handshake_first needs TLS (tls_cert and tls_key)".to_string(),
            ));
        }
        let addr: SocketAddr = bind.parse().map_err(|err| TransportError::InvalidAddress {
            addr: bind.to_string(),
            reason: format!("{err}; expected IP:PORT, such as 127.0.0.1:4222"),
        })?;
        let mut listener = TcpListener::bind(addr).map_err(|source| TransportError::Bind {
            addr: bind.to_string(),
            source,
        })?;
        let local = listener.local_addr()?;
        let worker_poll = Poll::new()?;
        worker_poll
            .registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let poll = Poll::new()?;
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox::default()),
            commands: Mutex::new(Vec::new()),
            worker_waker: Waker::new(worker_poll.registry(), WAKER)?,
            endpoint_waker: Waker::new(poll.registry(), INBOX)?,
            stop: Default::default(),
            parked: Default::default(),
            inbound: Default::default(),
            tls: Mutex::new(tls),
        });
        let queue_bytes = config.queue_bytes.max(1);
        let worker = Worker::new(
            worker_poll,
            listener,
            local,
            info,
            queue_bytes,
            shared.clone(),
        );
        let worker = std::thread::Builder::new()
            .name("efabus-nats".to_string())
            .spawn(move || worker.run())?;
        Ok(NatsEndpoint {
            shared,
            poll,
            events: Events::with_capacity(4),
            local,
            conns: FxHashMap::default(),
            closed: Vec::new(),
            queue_bytes,
            max_frame: config.max_frame,
            worker: Some(worker),
        })
    }

    /// The bound address (with the port chosen when it was 0).
    pub fn local_socket_addr(&self) -> SocketAddr {
        self.local
    }

    /// Hand frames for a client to the I/O thread; messages wait while
    /// its queue is full.
    fn hand_over(
        &mut self,
        peer: PeerId,
        frames: Bytes,
        run: bool,
        message: bool,
    ) -> Result<(), SendError> {
        let conn = self.conns.get(&peer.0).ok_or(SendError::Closed(peer))?;
        if message && conn.queued.load(Ordering::SeqCst) >= self.queue_bytes {
            // Owed before the queue is looked at again: the I/O thread
            // lowers the queue before it looks at what is owed, so one of
            // the two sees the other (see `worker::owe_writable`).
            conn.owe.store(true, Ordering::SeqCst);
            if conn.queued.load(Ordering::SeqCst) >= self.queue_bytes {
                return Err(SendError::WouldBlock(OutFrame::whole(frames)));
            }
        }
        conn.queued.fetch_add(frames.len(), Ordering::SeqCst);
        self.shared.command(Command::Send {
            peer: peer.0,
            frames,
            run,
        });
        Ok(())
    }
}

impl Drop for NatsEndpoint {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.shared.worker_waker.wake();
        if let Some(worker) = self.worker.take() {
            // The thread drops every connection, unflushed, as it ends.
            let _ = worker.join();
        }
    }
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
        match self.shared.tls.lock().as_mut() {
            Some(tls) => tls.reload().map(|()| true),
            None => Ok(false),
        }
    }

    fn revert_tls(&mut self) {
        if let Some(tls) = self.shared.tls.lock().as_mut() {
            tls.revert();
        }
    }

    /// A reload's `max_subscriptions`, `max_payload` and queue bound reach
    /// the clients connected and those to come (`INFO` announces the new
    /// payload limit); the other options keep the values the endpoint
    /// opened with.
    fn reconfigure(&mut self, config: &EndpointConfig) -> Result<(), TransportError> {
        let info = server_info(&config.options)?;
        let queue_bytes = config.queue_bytes.max(1);
        let (applied, wait) = std::sync::mpsc::sync_channel(1);
        self.shared.command(Command::Limits {
            max_subscriptions: info.max_subscriptions,
            max_payload: info.max_payload,
            queue_bytes,
            applied,
        });
        // The thread takes the command sooner or later: the endpoint's side
        // of the bound follows it now.
        self.queue_bytes = queue_bytes;
        // Operations read after this are held to the new limits. The
        // thread answers between two rounds, without waiting on anyone.
        wait.recv_timeout(Duration::from_secs(1)).map_err(|_| {
            TransportError::Other("the NATS I/O thread did not take the new limits".to_string())
        })
    }

    fn peer_certificate(&self, peer: PeerId) -> Option<Vec<u8>> {
        self.conns.get(&peer.0)?.certificate.lock().clone()
    }

    fn send(&mut self, peer: PeerId, frame: OutFrame) -> Result<(), SendError> {
        // Messages wait for room; the broker's few control frames (an error
        // before a close above all) go behind them at once, so a client cut
        // off as a slow consumer still reads why, last.
        let kind = frame.head.get(codec::PREFIX_LEN).copied();
        let message = kind == Some(FrameKind::Message as u8) || kind == Some(FrameKind::Run as u8);
        self.hand_over(peer, frame.to_bytes(), false, message)
    }

    fn send_run(&mut self, peer: PeerId, run: Bytes) -> Result<(), SendError> {
        self.hand_over(peer, run, true, true)
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), TransportError> {
        for peer in self.closed.drain(..) {
            self.conns.remove(&peer);
        }
        // Only a fault ends the thread early: what it told is handed out,
        // its connections end, and the listener is down.
        let ended = self.worker.as_ref().is_some_and(JoinHandle::is_finished);
        // Consume the wake-up before the inbox: events added after this
        // wake the descriptor again.
        self.poll
            .poll(&mut self.events, Some(Duration::ZERO))
            .or_else(|err| match err.kind() {
                std::io::ErrorKind::Interrupted => Ok(()),
                _ => Err(err),
            })?;
        let Inbox {
            events: mut arrived,
            accepted,
        } = std::mem::take(&mut *self.shared.inbox.lock());
        self.conns.extend(accepted);
        let mut taken = 0;
        for event in &arrived {
            match event {
                Event::Frame { frame, .. } => taken += frame.len(),
                Event::Closed { peer, .. } => self.closed.push(peer.0),
                _ => {}
            }
        }
        events.append(&mut arrived);
        if taken > 0 {
            let before = self.shared.inbound.fetch_sub(taken, Ordering::SeqCst);
            if before >= worker::INBOUND_LIMIT {
                // Connections may wait for this room.
                self.shared.wake_parked();
            }
        }
        if ended {
            let text = "the NATS listener's I/O thread has ended";
            let told: std::collections::HashSet<u64> = self.closed.iter().copied().collect();
            for &peer in self.conns.keys() {
                if !told.contains(&peer) {
                    events.push(Event::Closed {
                        peer: PeerId(peer),
                        reason: CloseReason::Error(text.to_string()),
                    });
                    self.closed.push(peer);
                }
            }
            return Err(TransportError::Other(text.to_string()));
        }
        Ok(())
    }

    fn close(&mut self, peer: PeerId) {
        if self.conns.contains_key(&peer.0) {
            self.shared.command(Command::Close(peer.0));
        }
    }

    fn readiness(&self) -> Readiness {
        use std::os::fd::AsRawFd;
        Readiness::Fd(self.poll.as_raw_fd())
    }

    fn queued_bytes(&self, peer: PeerId) -> usize {
        self.conns
            .get(&peer.0)
            .map_or(0, |conn| conn.queued.load(Ordering::Relaxed))
    }

    fn set_read_paused(&mut self, peer: PeerId, paused: bool) {
        if self.conns.contains_key(&peer.0) {
            self.shared.command(Command::Pause(peer.0, paused));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Instant;

    use efabus_core::codec;

    use super::*;

    fn endpoint() -> NatsEndpoint {
        let config = EndpointConfig {
            bind: Some("127.0.0.1:0".to_string()),
            queue_bytes: 1 << 20,
            max_frame: 1 << 20,
            ..EndpointConfig::default()
        };
        NatsEndpoint::open(&config).expect("listens")
    }

    /// Poll until `done` holds for what came, within ten seconds.
    fn poll_until(
        endpoint: &mut NatsEndpoint,
        seen: &mut Vec<Event>,
        done: impl Fn(&[Event]) -> bool,
    ) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(seen) {
            assert!(Instant::now() < deadline, "not within the wait: {seen:?}");
            endpoint.poll(seen).expect("polls");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_publisher_faster_than_the_broker_is_read_only_as_the_broker_takes() {
        let mut endpoint = endpoint();
        let mut client =
            std::net::TcpStream::connect(endpoint.local_socket_addr()).expect("connects");
        client.write_all(b"CONNECT {}\r\n").expect("writes");
        let mut seen = Vec::new();
        poll_until(&mut endpoint, &mut seen, |seen| {
            seen.iter()
                .any(|event| matches!(event, Event::Frame { .. }))
        });
        let Some(Event::Accepted { peer, .. }) = seen.first().cloned() else {
            panic!("{seen:?}")
        };
        let welcome = session::tests::welcome(1 << 20);
        endpoint
            .send(peer, codec::encode(&welcome))
            .expect("welcomed");
        // Far more than the bound, written while the broker takes nothing.
        const COUNT: usize = 400_000;
        let writer = std::thread::spawn(move || {
            let line = b"PUB flood 16\r\n0123456789abcdef\r\n";
            let mut batch = Vec::new();
            for _ in 0..1000 {
                batch.extend_from_slice(line);
            }
            for _ in 0..COUNT / 1000 {
                client.write_all(&batch).expect("the client writes");
            }
            client
        });
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut most = 0;
        while Instant::now() < deadline {
            most = most.max(endpoint.shared.inbound.load(Ordering::SeqCst));
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(most > 0, "the I/O thread read nothing");
        assert!(
            most <= worker::INBOUND_LIMIT + READ_BUDGET * 2,
            "{most} bytes waited for the broker"
        );
        // Taken, everything comes, in order.
        seen.clear();
        let mut publishes = 0;
        let deadline = Instant::now() + Duration::from_secs(30);
        while publishes < COUNT {
            assert!(Instant::now() < deadline, "{publishes} of {COUNT} came");
            endpoint.poll(&mut seen).expect("polls");
            publishes += seen
                .drain(..)
                .filter(|event| matches!(event, Event::Frame { .. }))
                .count();
        }
        assert_eq!(publishes, COUNT);
        let _client = writer.join().expect("the writer ends");
    }

    /// A NATS client over TLS: reads `INFO` in the clear, goes through its
    /// handshake, then writes each line `lines` gives it.
    fn tls_client(
        addr: SocketAddr,
        config: Arc<rustls::ClientConfig>,
        lines: std::sync::mpsc::Receiver<&'static [u8]>,
    ) {
        use std::io::{BufRead, BufReader};
        let socket = std::net::TcpStream::connect(addr).expect("connects");
        let mut info = String::new();
        BufReader::new(&socket).read_line(&mut info).expect("INFO");
        assert!(info.starts_with("INFO "), "{info}");
        let mut stream = crate::tls::held::client_over(socket, config);
        for line in lines {
            stream.write_all(line).expect("a line written");
            stream.flush().expect("a line sent");
        }
    }

    /// A step of a TLS handshake (the client certificate's check, held)
    /// runs beside the I/O thread: meanwhile it serves its other clients.
    #[test]
    fn a_tls_handshake_step_holds_up_no_other_client() {
        use crate::tls::held;
        use std::sync::mpsc::channel;
        let pki = crate::conformance::pki::shared();
        let gate = Arc::new(held::Gate::default());
        let mut endpoint = endpoint();
        *endpoint.shared.tls.lock() = Some(held::server_context(pki, Arc::clone(&gate)));
        let addr = endpoint.local_socket_addr();
        let config = held::client_config(pki);
        let frames_from = |peer: PeerId, count: usize| {
            move |seen: &[Event]| {
                seen.iter()
                    .filter(
                        |event| matches!(event, Event::Frame { peer: from, .. } if *from == peer),
                    )
                    .count()
                    >= count
            }
        };

        // One client in, its handshake over on both sides.
        let (to_a, a_lines) = channel();
        let config_a = Arc::clone(&config);
        let a = std::thread::spawn(move || tls_client(addr, config_a, a_lines));
        to_a.send(&b"CONNECT {}\r\n"[..])
            .expect("the first client writes");
        let mut seen = Vec::new();
        poll_until(&mut endpoint, &mut seen, frames_from(PeerId(1), 1));
        let welcome = session::tests::welcome(1 << 20);
        endpoint
            .send(PeerId(1), codec::encode(&welcome))
            .expect("welcomed");

        // Another, whose certificate check is held.
        gate.arm();
        let (to_b, b_lines) = channel();
        let b = std::thread::spawn(move || tls_client(addr, config, b_lines));
        poll_until(&mut endpoint, &mut seen, |_| gate.holding());
        to_a.send(&b"SUB orders 1\r\n"[..])
            .expect("the first client writes");
        poll_until(&mut endpoint, &mut seen, frames_from(PeerId(1), 2));
        assert!(gate.holding(), "the check ended before the other's SUB");

        gate.release();
        to_b.send(&b"CONNECT {}\r\n"[..])
            .expect("the second client writes");
        poll_until(&mut endpoint, &mut seen, frames_from(PeerId(2), 1));
        drop((to_a, to_b));
        a.join().expect("the first client ends");
        b.join().expect("the second client ends");
    }
}
