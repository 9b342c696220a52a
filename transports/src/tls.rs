//! TLS for the TCP transport, with rustls: what a TCP endpoint needs to
//! speak TLS on its connections ([`TlsContext`], built from the endpoint's
//! options) and the connection's byte stream with or without it
//! ([`Wire`]).
//!
//! Options (in [`EndpointConfig::options`]):
//!
//! - `tls_cert`, `tls_key`: PEM files of this side's certificate chain and
//!   private key. A listening endpoint with them accepts TLS only; an
//!   endpoint that connects presents them when the server asks for a
//!   client certificate.
//! - `tls_ca`: PEM file of the certificate authorities this side trusts:
//!   the servers it connects to must present a certificate they issued
//!   for the name dialed (or `tls_server_name`), and with
//!   `tls_verify_clients=true` so must every client of a listener.
//! - `tls_server_name`: the name to verify servers against instead of the
//!   host of the address dialed.
//!
//! An endpoint connects with TLS when it has `tls_ca`, and accepts with
//! TLS when it has `tls_cert` and `tls_key` and listens; there is no
//! cleartext fallback on either. [`TlsContext::reload`] reads the files
//! again (for new connections; those up keep their session).
//!
//! [`Wire`] is the connection's socket: reads and writes go through the
//! TLS session when there is one. The session is shared by the reading
//! side (the endpoint) and the sending side (the endpoint and direct
//! senders) behind one lock; ciphertext the socket did not take waits in
//! the session and goes first on the next write.
//!
//! The costly steps of an accepted connection's handshake (the key
//! exchange and signature answering a client's hello, the check of a
//! client certificate: about 0.6 ms of CPU each on a small machine) run on
//! [`HandshakeWorkers`], not on the thread that reads the connection:
//! anyone who can reach a listener may start handshakes, and that thread
//! serves every other connection. While a step runs, the wire reads
//! nothing and writers leave the session to the worker, which then calls
//! the reader back to go on. A broker's own dials (routes) run their
//! handshakes on the dialing thread: it starts them itself.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice, Read, Write};
use std::net::IpAddr;
use std::net::Shutdown;
use std::ops::Deref;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use efabus_core::transport::{EndpointConfig, TransportError};
use mio::net::TcpStream;
use parking_lot::{Condvar, Mutex};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConnection;
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig};

fn error(message: String) -> TransportError {
    TransportError::Tls(message)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn read_certs(path: &str) -> Result<Vec<CertificateDer<'static>>, TransportError> {
    let certs = CertificateDer::pem_file_iter(Path::new(path))
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|err| error(format!("cannot read certificates from {path}: {err}")))?;
    if certs.is_empty() {
        return Err(error(format!("{path} holds no PEM certificate")));
    }
    Ok(certs)
}

fn read_key(path: &str) -> Result<PrivateKeyDer<'static>, TransportError> {
    PrivateKeyDer::from_pem_file(Path::new(path))
        .map_err(|err| error(format!("cannot read a private key from {path}: {err}")))
}

fn read_roots(path: &str) -> Result<Arc<RootCertStore>, TransportError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path)? {
        roots
            .add(cert)
            .map_err(|err| error(format!("{path}: not a usable CA certificate: {err}")))?;
    }
    Ok(Arc::new(roots))
}

/// The TLS settings of an endpoint, from its options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct TlsFiles {
    cert: Option<String>,
    key: Option<String>,
    ca: Option<String>,
    verify_clients: bool,
    server_name: Option<String>,
}

impl TlsFiles {
    fn from_config(config: &EndpointConfig) -> Result<TlsFiles, TransportError> {
        let text = |name: &str| config.option(name).map(str::to_string);
        let verify_clients = match config.option("tls_verify_clients") {
            None | Some("false") => false,
            Some("true") => true,
            Some(other) => {
                return Err(error(format!(
                    "tls_verify_clients={other:?}: expected true or false"
                )))
            }
        };
        let files = TlsFiles {
            cert: text("tls_cert"),
            key: text("tls_key"),
            ca: text("tls_ca"),
            verify_clients,
            server_name: text("tls_server_name"),
        };
        if files.cert.is_some() != files.key.is_some() {
            return Err(error(
                "tls_cert and tls_key go together: give both or neither".to_string(),
            ));
        }
        if files.verify_clients && files.ca.is_none() {
            return Err(error(
                "tls_verify_clients needs tls_ca, the authority client certificates must come from"
                    .to_string(),
            ));
        }
        Ok(files)
    }

    fn server_config(&self) -> Result<Option<Arc<ServerConfig>>, TransportError> {
        let (Some(cert), Some(key)) = (&self.cert, &self.key) else {
            return Ok(None);
        };
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|err| error(err.to_string()))?;
        let builder = match (&self.ca, self.verify_clients) {
            (Some(ca), true) => {
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(read_roots(ca)?, provider())
                        .build()
                        .map_err(|err| error(format!("client verification with {ca}: {err}")))?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let config = builder
            .with_single_cert(read_certs(cert)?, read_key(key)?)
            .map_err(|err| error(format!("{cert} with {key}: {err}")))?;
        Ok(Some(Arc::new(config)))
    }

    fn client_config(&self) -> Result<Option<Arc<ClientConfig>>, TransportError> {
        let Some(ca) = &self.ca else {
            return Ok(None);
        };
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|err| error(err.to_string()))?
            .with_root_certificates(read_roots(ca)?);
        let config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => builder
                .with_client_auth_cert(read_certs(cert)?, read_key(key)?)
                .map_err(|err| error(format!("{cert} with {key}: {err}")))?,
            _ => builder.with_no_client_auth(),
        };
        Ok(Some(Arc::new(config)))
    }
}

/// Reads the TLS files a broker's settings name, as its listeners and
/// dialed routes will (a certificate with its key, the authorities), so a
/// file that cannot be used is reported before anything opens.
pub fn check_files(
    cert: Option<&str>,
    key: Option<&str>,
    ca: Option<&str>,
    verify_clients: bool,
) -> Result<(), TransportError> {
    let files = TlsFiles {
        cert: cert.map(str::to_string),
        key: key.map(str::to_string),
        ca: ca.map(str::to_string),
        verify_clients,
        server_name: None,
    };
    files.server_config()?;
    files.client_config()?;
    Ok(())
}

/// What an endpoint needs to speak TLS: the server side (when it listens
/// with a certificate) and the client side (when it trusts a CA).
#[derive(Debug)]
pub struct TlsContext {
    files: TlsFiles,
    server: Option<Arc<ServerConfig>>,
    client: Option<Arc<ClientConfig>>,
    /// What the last reload replaced, for [`revert`](Self::revert).
    replaced: Option<Replaced>,
}

/// The server and client sides a reload replaced.
#[derive(Debug)]
struct Replaced {
    server: Option<Arc<ServerConfig>>,
    client: Option<Arc<ClientConfig>>,
}

impl TlsContext {
    /// The context the options of `config` ask for; `None` when they name
    /// no TLS file. `listens` says whether the endpoint accepts.
    pub fn from_config(
        config: &EndpointConfig,
        listens: bool,
    ) -> Result<Option<TlsContext>, TransportError> {
        let files = TlsFiles::from_config(config)?;
        if files == TlsFiles::default() {
            return Ok(None);
        }
        if listens && files.cert.is_none() {
            return Err(error(
                "a listener with TLS needs tls_cert and tls_key".to_string(),
            ));
        }
        let mut context = TlsContext {
            files,
            server: None,
            client: None,
            replaced: None,
        };
        context.reload()?;
        Ok(Some(context))
    }

    /// Reads the certificate, key and CA files again; on failure the
    /// configuration in use stays.
    pub fn reload(&mut self) -> Result<(), TransportError> {
        let server = self.files.server_config()?;
        let client = self.files.client_config()?;
        self.replaced = Some(Replaced {
            server: std::mem::replace(&mut self.server, server),
            client: std::mem::replace(&mut self.client, client),
        });
        Ok(())
    }

    /// Puts back what the last [`reload`](Self::reload) replaced (when
    /// another endpoint's reload failed: all take the new files or none).
    pub fn revert(&mut self) {
        if let Some(Replaced { server, client }) = self.replaced.take() {
            self.server = server;
            self.client = client;
        }
    }

    /// Whether accepted connections speak TLS.
    pub fn accepts(&self) -> bool {
        self.server.is_some()
    }

    /// A server session for an accepted connection.
    pub fn accept(&self) -> Result<Option<Connection>, TransportError> {
        match &self.server {
            None => Ok(None),
            Some(config) => ServerConnection::new(config.clone())
                .map(|session| Some(Connection::Server(session)))
                .map_err(|err| error(err.to_string())),
        }
    }

    /// A client session towards `host` (or the configured
    /// `tls_server_name`). An endpoint with TLS dials only with TLS: one
    /// that accepts TLS but has no authority to verify servers with cannot
    /// dial at all.
    pub fn connect(&self, host: &str) -> Result<Connection, TransportError> {
        let Some(config) = &self.client else {
            return Err(error(
                "this endpoint speaks TLS and has no authority to verify the server it dials \
                 (tls_ca); it does not dial in cleartext"
                    .to_string(),
            ));
        };
        let name = self.files.server_name.as_deref().unwrap_or(host);
        let name = ServerName::try_from(name.to_string()).map_err(|err| {
            error(format!(
                "{name:?} is not a name to verify a server certificate against: {err}"
            ))
        })?;
        ClientConnection::new(config.clone(), name)
            .map(Connection::Client)
            .map_err(|err| error(err.to_string()))
    }
}

/// The host part of `HOST:PORT` (`[v6]:port` gives `v6`).
pub fn host_of(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// A connection's socket, with its TLS session when it has one.
#[derive(Debug)]
pub struct Wire {
    stream: TcpStream,
    session: Option<Arc<Session>>,
    /// Where this (accepted) connection's handshake steps run, and how the
    /// worker calls the reader back; `None`: on the reading thread.
    steps: Option<HandshakeSteps>,
}

/// A TLS session, and what a handshake step on a worker tells the reader.
#[derive(Debug)]
struct Session {
    connection: Mutex<Connection>,
    /// A worker holds the session for a step: the reader leaves it alone.
    stepping: AtomicBool,
    /// A step ended since the reader last looked: read again (for readers
    /// that learn of the end from this flag rather than the call back).
    stepped: AtomicBool,
    /// A step failed: the next read or write reports it (the session
    /// keeps its error, and gives it again).
    failed: AtomicBool,
    /// Where the handshake's records end, while steps go to workers.
    records: Mutex<RecordScan>,
}

/// Where the records of a handshake's bytes end: a step goes to a worker
/// only once a whole record has come (a client that trickles its hello
/// costs no hand-over per byte; a part of a record is no work).
#[derive(Debug, Default)]
struct RecordScan {
    header: [u8; RECORD_HEADER],
    header_len: usize,
    body_left: usize,
    /// Whether a whole record was seen since last asked.
    whole: bool,
}

/// A TLS record's header: its type, version and length.
const RECORD_HEADER: usize = 5;

impl RecordScan {
    fn scan(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.body_left > 0 {
                let taken = self.body_left.min(bytes.len());
                self.body_left -= taken;
                bytes = &bytes[taken..];
                self.whole |= self.body_left == 0;
                continue;
            }
            let taken = (RECORD_HEADER - self.header_len).min(bytes.len());
            self.header[self.header_len..self.header_len + taken].copy_from_slice(&bytes[..taken]);
            self.header_len += taken;
            bytes = &bytes[taken..];
            if self.header_len == RECORD_HEADER {
                self.header_len = 0;
                self.body_left = usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
                self.whole |= self.body_left == 0;
            }
        }
    }

    /// Whether a whole record came since last asked.
    fn take_whole(&mut self) -> bool {
        std::mem::take(&mut self.whole)
    }
}

/// A socket read that shows its bytes to a [`RecordScan`].
struct Scanned<'a> {
    stream: &'a TcpStream,
    records: &'a mut RecordScan,
}

impl Read for Scanned<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let read = self.stream.read(buf)?;
        self.records.scan(&buf[..read]);
        Ok(read)
    }
}

/// A connection's way to the [`HandshakeWorkers`].
struct HandshakeSteps {
    workers: HandshakeWorkers,
    /// The peer's address ([`crate::address_key`]): steps are taken an
    /// address at a time in turn.
    from: IpAddr,
    /// Calls the connection's reader back once a step has ended.
    call_back: Arc<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for HandshakeSteps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandshakeSteps").finish_non_exhaustive()
    }
}

/// One step of a handshake, handed to a worker. Weak: a connection dropped
/// while its step waits costs the worker nothing.
struct Step {
    session: Weak<Session>,
    call_back: Arc<dyn Fn() + Send + Sync>,
}

impl Step {
    fn run(self) {
        let Some(session) = self.session.upgrade() else {
            return;
        };
        // A panic fails the connection; the worker serves the others.
        let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| {
            session.connection.lock().process_new_packets().is_ok()
        }));
        if !matches!(stepped, Ok(true)) {
            session.failed.store(true, Ordering::Release);
        }
        // Released before the reader is told, so that a reader that sees
        // `stepped` finds the session free.
        session.stepping.store(false, Ordering::Release);
        session.stepped.store(true, Ordering::Release);
        (self.call_back)();
    }
}

/// Handshake steps that may wait for the workers, all listeners of the
/// process together: past them a connection's handshake fails at once
/// (its client may try again) rather than wait behind more than about
/// half a second of steps per worker on a small machine. Each connection
/// has at most one step waiting, and the broker bounds the connections in
/// their handshake (`limits.max_handshakes`, 1,024 by default).
pub const STEPS_WAITING_MAX: usize = 1024;

/// How long after workers failed to start they are not tried again.
const START_RETRY: Duration = Duration::from_secs(10);

/// The threads that run handshake steps of accepted connections, one set
/// for the process (see the module docs): half its cores, from one to
/// four, so that a flood of handshakes leaves cores to everything else.
#[derive(Clone)]
pub struct HandshakeWorkers {
    queue: Arc<StepQueue>,
}

/// The steps waiting for the workers.
struct StepQueue {
    waiting: Mutex<TakenInTurn<Step>>,
    /// Set when the workers could not all start: those that did end.
    closed: AtomicBool,
    /// Signalled when a step is handed over.
    handed_over: Condvar,
}

/// Items waiting by the address they came from, taken one address at a
/// time in turn: an address with many waiting (a flood) holds each of the
/// others up by one of its items, not by all of them.
#[derive(Debug)]
struct TakenInTurn<T> {
    by_address: HashMap<IpAddr, VecDeque<T>>,
    /// Addresses with items waiting, the next to be served first.
    turns: VecDeque<IpAddr>,
    len: usize,
    max: usize,
}

impl<T> TakenInTurn<T> {
    fn new(max: usize) -> Self {
        TakenInTurn {
            by_address: HashMap::new(),
            turns: VecDeque::new(),
            len: 0,
            max,
        }
    }

    /// Queues `item` from `from`; gives it back when `max` wait.
    fn push(&mut self, from: IpAddr, item: T) -> Result<(), T> {
        if self.len >= self.max {
            return Err(item);
        }
        let waiting = self.by_address.entry(from).or_default();
        if waiting.is_empty() {
            self.turns.push_back(from);
        }
        waiting.push_back(item);
        self.len += 1;
        Ok(())
    }

    /// The next item of the address whose turn it is.
    fn pop(&mut self) -> Option<T> {
        let from = self.turns.pop_front()?;
        let waiting = self.by_address.get_mut(&from)?;
        let item = waiting.pop_front();
        if waiting.is_empty() {
            self.by_address.remove(&from);
        } else {
            self.turns.push_back(from);
        }
        self.len -= usize::from(item.is_some());
        item
    }
}

impl std::fmt::Debug for HandshakeWorkers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandshakeWorkers").finish_non_exhaustive()
    }
}

/// The process's workers, or when starting them last failed.
static WORKERS: Mutex<Option<Result<HandshakeWorkers, Instant>>> = Mutex::new(None);

impl HandshakeWorkers {
    /// The process's workers, started on first use. `None` when they
    /// cannot start (logged, and tried again after [`START_RETRY`]):
    /// handshakes then run on the reading thread, as they can.
    pub fn shared() -> Option<HandshakeWorkers> {
        let mut workers = WORKERS.lock();
        match &*workers {
            Some(Ok(running)) => return Some(running.clone()),
            Some(Err(failed)) if failed.elapsed() < START_RETRY => return None,
            _ => {}
        }
        let threads =
            std::thread::available_parallelism().map_or(1, |cores| (cores.get() / 2).clamp(1, 4));
        match Self::start(threads, STEPS_WAITING_MAX) {
            Ok(started) => {
                *workers = Some(Ok(started.clone()));
                Some(started)
            }
            Err(err) => {
                tracing::warn!(
                    "tls: cannot start handshake workers ({err}); handshakes run on the \
                     listeners' threads, workers tried again in {START_RETRY:?}"
                );
                *workers = Some(Err(Instant::now()));
                None
            }
        }
    }

    /// Starts `threads` workers, which wait for steps for as long as the
    /// process runs, `waiting_max` steps at most waiting for them.
    fn start(threads: usize, waiting_max: usize) -> io::Result<HandshakeWorkers> {
        let queue = Arc::new(StepQueue {
            waiting: Mutex::new(TakenInTurn::new(waiting_max)),
            closed: AtomicBool::new(false),
            handed_over: Condvar::new(),
        });
        for n in 0..threads {
            let worker = Arc::clone(&queue);
            let started = std::thread::Builder::new()
                .name(format!("efabus-tls-{n}"))
                .spawn(move || loop {
                    let step = {
                        let mut waiting = worker.waiting.lock();
                        loop {
                            if worker.closed.load(Ordering::Acquire) {
                                return;
                            }
                            match waiting.pop() {
                                Some(step) => break step,
                                None => worker.handed_over.wait(&mut waiting),
                            }
                        }
                    };
                    step.run();
                });
            if let Err(err) = started {
                // Set under the lock, so no worker misses it.
                let waiting = queue.waiting.lock();
                queue.closed.store(true, Ordering::Release);
                drop(waiting);
                queue.handed_over.notify_all();
                return Err(err);
            }
        }
        Ok(HandshakeWorkers { queue })
    }

    /// Hands over `step`, from a connection with `from`; gives it back
    /// when [`STEPS_WAITING_MAX`] wait.
    fn hand_over(&self, from: IpAddr, step: Step) -> Result<(), Step> {
        self.queue.waiting.lock().push(from, step)?;
        self.queue.handed_over.notify_one();
        Ok(())
    }
}

impl Deref for Wire {
    type Target = TcpStream;

    fn deref(&self) -> &TcpStream {
        &self.stream
    }
}

fn tls_failure(err: rustls::Error) -> io::Error {
    let hint = match err {
        // What arrives where a TLS record should be is not one.
        rustls::Error::InvalidMessage(_) => {
            "; the peer does not speak TLS (connect with TLS, \
             given the authority to verify the server with)"
        }
        _ => "",
    };
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {err}{hint}"))
}

impl Wire {
    pub fn new(stream: TcpStream, session: Option<Connection>) -> Wire {
        Wire {
            stream,
            session: session.map(|connection| {
                Arc::new(Session {
                    connection: Mutex::new(connection),
                    stepping: AtomicBool::new(false),
                    stepped: AtomicBool::new(false),
                    failed: AtomicBool::new(false),
                    records: Mutex::new(RecordScan::default()),
                })
            }),
            steps: None,
        }
    }

    /// Has this connection's handshake steps (its peer at `from`) run on
    /// `workers`, which call `call_back` when one ends: the reader should
    /// then [`read`](Self::read) again (see
    /// [`take_stepped`](Self::take_stepped)).
    pub fn with_handshake_workers(
        mut self,
        workers: HandshakeWorkers,
        from: IpAddr,
        call_back: Arc<dyn Fn() + Send + Sync>,
    ) -> Wire {
        if self.session.is_some() {
            self.steps = Some(HandshakeSteps {
                workers,
                from: crate::address_key(from),
                call_back,
            });
        }
        self
    }

    pub fn is_tls(&self) -> bool {
        self.session.is_some()
    }

    /// Whether a handshake step ended on a worker since last asked: the
    /// connection is to be read again, though its socket may not signal.
    pub fn take_stepped(&self) -> bool {
        self.session
            .as_ref()
            .is_some_and(|session| session.stepped.swap(false, Ordering::AcqRel))
    }

    /// Whether a worker holds the session for a handshake step: writers
    /// wait for its call back rather than for the session.
    pub fn in_handshake_step(&self) -> bool {
        self.session
            .as_ref()
            .is_some_and(|session| session.stepping.load(Ordering::Acquire))
    }

    /// The end-entity certificate the peer presented (verified by the
    /// session's configuration), if any: none while the handshake goes on.
    pub fn peer_certificate(&self) -> Option<Vec<u8>> {
        if self.in_handshake_step() {
            return None;
        }
        let session = self.session.as_ref()?.connection.lock();
        session
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|cert| cert.as_ref().to_vec())
    }

    /// Reads plaintext: `Ok(0)` at the end of the stream, `WouldBlock`
    /// when nothing more has arrived (or a handshake step runs on a
    /// worker, which calls back). With TLS it reads until the socket would
    /// block or plaintext is there (the session may hold more than one
    /// read returns: read until `WouldBlock`).
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(shared) = &self.session else {
            return (&self.stream).read(buf);
        };
        if shared.stepping.load(Ordering::Acquire) {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let mut session = shared.connection.lock();
        if let Some(err) = self.failed_step(shared, &mut session) {
            return Err(err);
        }
        // What a worker's step left to send (the answer to a hello). A
        // socket that fails here fails the read below too, once what the
        // peer sent before is read.
        let _ = Self::push(&mut session, &self.stream);
        let mut at_end = false;
        loop {
            match session.reader().read(buf) {
                Ok(n) => return Ok(n),
                // A peer that went without a close_notify ends the stream
                // as a TCP peer would; a frame it cut short is still seen
                // as unfinished.
                Err(err) if err.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    if at_end {
                        return Ok(0);
                    }
                }
                Err(err) => return Err(err),
            }
            // While steps go to workers, the records read are scanned.
            let handing_over = self.steps.is_some() && session.is_handshaking();
            let (read, whole) = if handing_over {
                let mut records = shared.records.lock();
                let read = session.read_tls(&mut Scanned {
                    stream: &self.stream,
                    records: &mut records,
                });
                (read, records.take_whole())
            } else {
                (session.read_tls(&mut &self.stream), false)
            };
            match read {
                Ok(0) => at_end = true,
                Ok(_) => {
                    if let (true, Some(steps)) = (whole, &self.steps) {
                        shared.stepping.store(true, Ordering::Release);
                        drop(session);
                        let step = Step {
                            session: Arc::downgrade(shared),
                            call_back: Arc::clone(&steps.call_back),
                        };
                        if steps.workers.hand_over(steps.from, step).is_ok() {
                            return Err(io::ErrorKind::WouldBlock.into());
                        }
                        shared.stepping.store(false, Ordering::Release);
                        return Err(io::Error::other(format!(
                            "TLS: {STEPS_WAITING_MAX} handshake steps wait for the workers \
                             (a flood of handshakes); connect again"
                        )));
                    }
                }
                Err(err) => return Err(err),
            }
            if let Err(err) = session.process_new_packets() {
                let _ = session.write_tls(&mut &self.stream);
                return Err(tls_failure(err));
            }
            // Handshake messages, and what waited for the handshake.
            Self::push(&mut session, &self.stream)?;
        }
    }

    /// The error of a step that failed on a worker, the alert sent.
    fn failed_step(&self, shared: &Session, session: &mut Connection) -> Option<io::Error> {
        if !shared.failed.load(Ordering::Acquire) {
            return None;
        }
        let err = session
            .process_new_packets()
            .err()
            .unwrap_or_else(|| rustls::Error::General("the handshake step failed".into()));
        // The alert tells the peer why, where the socket takes it.
        let _ = session.write_tls(&mut &self.stream);
        Some(tls_failure(err))
    }

    /// Writes ciphertext the session holds until the socket would block.
    /// `Ok(true)` when none is left.
    fn push(session: &mut Connection, stream: &TcpStream) -> io::Result<bool> {
        while session.wants_write() {
            match session.write_tls(&mut &*stream) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "socket accepted no bytes",
                    ))
                }
                Ok(_) => {}
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(err),
            }
        }
        Ok(true)
    }

    /// Writes plaintext; with TLS, ciphertext still waiting goes first and
    /// nothing more is taken until it is out (`WouldBlock`). During a
    /// worker's handshake step it waits for the session: callers on the
    /// reading thread wait for the call back instead (see
    /// [`in_handshake_step`](Self::in_handshake_step)); other threads
    /// write only to connections whose handshake is over.
    pub fn write_vectored(&self, parts: &[IoSlice<'_>]) -> io::Result<usize> {
        let Some(shared) = &self.session else {
            return (&self.stream).write_vectored(parts);
        };
        let mut session = shared.connection.lock();
        // Reported as the read reports it: the session's own error, which
        // the writer would give, lacks the hint.
        if let Some(err) = self.failed_step(shared, &mut session) {
            return Err(err);
        }
        if !Self::push(&mut session, &self.stream)? {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let taken = session.writer().write_vectored(parts)?;
        Self::push(&mut session, &self.stream)?;
        if taken == 0 && parts.iter().any(|part| !part.is_empty()) {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(taken)
    }

    /// Whether the session holds bytes not yet on the socket: ciphertext
    /// the socket did not take, or plaintext waiting for the handshake.
    pub fn has_pending(&self) -> bool {
        self.in_handshake_step()
            || self.session.as_ref().is_some_and(|session| {
                let session = session.connection.lock();
                session.wants_write() || session.is_handshaking()
            })
    }

    /// Writes waiting ciphertext; `Ok(true)` when nothing is left
    /// pending (see [`has_pending`](Self::has_pending)). During a worker's
    /// handshake step nothing is written: the step's answer goes out on
    /// the read that follows it.
    pub fn flush_pending(&self) -> io::Result<bool> {
        match &self.session {
            None => Ok(true),
            Some(_) if self.in_handshake_step() => Ok(false),
            Some(session) => {
                let mut session = session.connection.lock();
                Ok(Self::push(&mut session, &self.stream)? && !session.is_handshaking())
            }
        }
    }

    /// Ends the sending side: a TLS close_notify (best effort), then FIN.
    pub fn shutdown_write(&self) -> io::Result<()> {
        if let Some(session) = &self.session {
            let mut session = session.connection.lock();
            session.send_close_notify();
            let _ = Self::push(&mut session, &self.stream);
        }
        self.stream.shutdown(Shutdown::Write)
    }
}

/// A server context whose check of client certificates can be held, to
/// see what runs while a handshake step does.
#[cfg(test)]
pub(crate) mod held {
    use std::time::Duration;

    use parking_lot::Condvar;
    use rustls::client::danger::HandshakeSignatureValid;
    use rustls::pki_types::UnixTime;
    use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
    use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

    use super::*;
    use crate::conformance::pki::Pki;

    /// How long a held check waits for its release before it goes on.
    const HELD_AT_MOST: Duration = Duration::from_secs(30);

    /// Holds the next certificate checks once armed, until released.
    #[derive(Debug, Default)]
    pub struct Gate {
        state: Mutex<GateState>,
        changed: Condvar,
    }

    #[derive(Debug, Default)]
    struct GateState {
        armed: bool,
        holding: bool,
    }

    impl Gate {
        pub fn arm(&self) {
            self.state.lock().armed = true;
        }

        pub fn release(&self) {
            self.state.lock().armed = false;
            self.changed.notify_all();
        }

        /// Whether a check is being held right now.
        pub fn holding(&self) -> bool {
            self.state.lock().holding
        }

        fn pass(&self) {
            let mut state = self.state.lock();
            state.holding = state.armed;
            let _ = self
                .changed
                .wait_while_for(&mut state, |state| state.armed, HELD_AT_MOST);
            state.holding = false;
        }
    }

    #[derive(Debug)]
    struct HeldVerifier {
        inner: Arc<dyn ClientCertVerifier>,
        gate: Arc<Gate>,
    }

    impl ClientCertVerifier for HeldVerifier {
        fn root_hint_subjects(&self) -> &[DistinguishedName] {
            self.inner.root_hint_subjects()
        }

        fn verify_client_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            now: UnixTime,
        ) -> Result<ClientCertVerified, rustls::Error> {
            self.gate.pass();
            self.inner
                .verify_client_cert(end_entity, intermediates, now)
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls12_signature(message, cert, dss)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls13_signature(message, cert, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.inner.supported_verify_schemes()
        }
    }

    /// A listener's context for `pki`'s server certificate, asking clients
    /// for theirs and checking them through `gate`.
    pub fn server_context(pki: &Pki, gate: Arc<Gate>) -> TlsContext {
        let inner = WebPkiClientVerifier::builder_with_provider(
            read_roots(&pki.ca).expect("test CA"),
            provider(),
        )
        .build()
        .expect("client verifier");
        let config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_client_cert_verifier(Arc::new(HeldVerifier { inner, gate }))
            .with_single_cert(
                read_certs(&pki.server_cert).expect("test certificate"),
                read_key(&pki.server_key).expect("test key"),
            )
            .expect("server config");
        TlsContext {
            files: TlsFiles::default(),
            server: Some(Arc::new(config)),
            client: None,
            replaced: None,
        }
    }

    /// A client session over `socket` (blocking), through its handshake
    /// with a server named `localhost`.
    pub fn client_over(
        socket: std::net::TcpStream,
        config: Arc<ClientConfig>,
    ) -> rustls::StreamOwned<ClientConnection, std::net::TcpStream> {
        let name = ServerName::try_from("localhost").expect("a server name");
        let session = ClientConnection::new(config, name).expect("a client session");
        let mut stream = rustls::StreamOwned::new(session, socket);
        while stream.conn.is_handshaking() {
            stream
                .conn
                .complete_io(&mut stream.sock)
                .expect("the handshake");
        }
        stream
    }

    /// A client's configuration with `pki`'s client certificate; each
    /// connection goes through a whole handshake (no resumption, which
    /// would skip the certificate's check).
    pub fn client_config(pki: &Pki) -> Arc<ClientConfig> {
        let files = TlsFiles {
            cert: Some(pki.client_cert.clone()),
            key: Some(pki.client_key.clone()),
            ca: Some(pki.ca.clone()),
            verify_clients: false,
            server_name: None,
        };
        let mut config = files
            .client_config()
            .expect("client config")
            .expect("a CA given");
        Arc::make_mut(&mut config).resumption = rustls::client::Resumption::disabled();
        config
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::conformance::pki;

    const LOOPBACK: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    /// An address with many waiting holds each of the others up by one of
    /// its items; within an address, first come first served; past the
    /// bound, an item is given back.
    #[test]
    fn items_are_taken_one_address_at_a_time() {
        let flood = IpAddr::from([10, 0, 0, 1]);
        let (a, b) = (IpAddr::from([10, 0, 0, 2]), IpAddr::from([10, 0, 0, 3]));
        let mut queue = TakenInTurn::new(8);
        for n in 0..5 {
            queue.push(flood, n).unwrap();
        }
        queue.push(a, 10).unwrap();
        queue.push(b, 20).unwrap();
        queue.push(a, 11).unwrap();
        assert_eq!(queue.push(b, 21), Err(21), "past the bound");
        let order: Vec<u32> = std::iter::from_fn(|| queue.pop()).collect();
        assert_eq!(order, [0, 10, 20, 1, 11, 2, 3, 4]);
        assert!(queue.by_address.is_empty() && queue.turns.is_empty());
        queue.push(b, 21).unwrap();
        assert_eq!(queue.pop(), Some(21));
    }

    /// Turns are kept per IPv4 address and per IPv6 /64, an IPv4-mapped
    /// IPv6 address counting as its IPv4 one.
    #[test]
    fn an_ipv6_host_takes_one_turn_for_its_64() {
        let key = |text: &str| crate::address_key(text.parse().unwrap());
        assert_eq!(key("2001:db8:1:2::1"), key("2001:db8:1:2:ffff::9"));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
        assert_eq!(key("::ffff:192.0.2.7"), key("192.0.2.7"));
        assert_ne!(key("192.0.2.7"), key("192.0.2.8"));
    }

    /// A step the workers have no room for fails its connection at once,
    /// saying why, rather than wait.
    #[test]
    fn a_step_the_workers_have_no_room_for_fails_its_connection() {
        let pki = pki::shared();
        let gate = Arc::new(held::Gate::default());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        accepted.set_nonblocking(true).unwrap();
        let server = held::server_context(pki, gate).accept().unwrap();
        // No worker, and no room to wait for one.
        let workers = HandshakeWorkers::start(0, 0).unwrap();
        let wire = Wire::new(TcpStream::from_std(accepted), server).with_handshake_workers(
            workers,
            LOOPBACK,
            Arc::new(|| {}),
        );
        let name = ServerName::try_from("localhost").unwrap();
        let mut hello = ClientConnection::new(held::client_config(pki), name).unwrap();
        hello.write_tls(&mut client).unwrap();

        let deadline = Instant::now() + Duration::from_secs(10);
        let err = loop {
            match wire.read(&mut [0; 64]) {
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "the hello never came");
                    std::thread::sleep(Duration::from_millis(1));
                }
                other => break other.expect_err("no plaintext before the handshake"),
            }
        };
        assert!(err.to_string().contains("wait for the workers"), "{err}");
        assert!(
            !wire.in_handshake_step(),
            "the session was left with no worker"
        );
    }

    /// A client that sends its hello a byte at a time makes one step, not
    /// one per byte: parts of a record are no work for a worker.
    #[test]
    fn a_hello_trickled_a_byte_at_a_time_is_one_step() {
        use std::sync::atomic::AtomicUsize;
        let pki = pki::shared();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        client.set_nodelay(true).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        accepted.set_nonblocking(true).unwrap();
        let server = held::server_context(pki, Arc::new(held::Gate::default()))
            .accept()
            .unwrap();
        let steps = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&steps);
        let wire = Wire::new(TcpStream::from_std(accepted), server).with_handshake_workers(
            HandshakeWorkers::start(1, 16).unwrap(),
            LOOPBACK,
            Arc::new(move || {
                counted.fetch_add(1, Ordering::SeqCst);
            }),
        );
        let name = ServerName::try_from("localhost").unwrap();
        let mut session = ClientConnection::new(held::client_config(pki), name).unwrap();
        let mut hello = Vec::new();
        session.write_tls(&mut hello).unwrap();
        assert!(hello.len() > 100, "a hello of {} bytes", hello.len());

        // A byte at a time, each read (mostly) before the next is sent.
        for byte in &hello {
            client.write_all(&[*byte]).unwrap();
            std::thread::sleep(Duration::from_micros(200));
            match wire.read(&mut [0; 64]) {
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                other => panic!("no plaintext before the handshake: {other:?}"),
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while steps.load(Ordering::SeqCst) == 0 {
            assert!(
                Instant::now() < deadline,
                "the hello never went to a worker"
            );
            // A last byte that came late is read here.
            let _ = wire.read(&mut [0; 64]);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            steps.load(Ordering::SeqCst),
            1,
            "one step for the whole hello"
        );
    }
}
