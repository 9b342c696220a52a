//! The HTTP monitoring listener of a broker. [`Monitor`] serves JSON views
//! of the running broker and Prometheus metrics:
//!
//! - `/varz`: the server (name, id, version, uptime, listeners, limits,
//!   the libfabric in use), its counters and its memory;
//! - `/connz`: the client connections, each with the links it negotiated
//!   (and on TCP why not the fabric), its counters and pending bytes;
//!   `?subs=1` lists subscriptions, `?sort=`, `?offset=` and `?limit=`
//!   page through them;
//! - `/routez`: the routes to other brokers, the same way, and the peers
//!   dialed;
//! - `/subsz`: subscription counts; `?test=SUBJECT` says which
//!   subscriptions a message on SUBJECT would reach;
//! - `/healthz`: 200 while every listener is up and the broker's event
//!   loop answers, else 503 with what is down (and, for a loop stuck in
//!   one round, where: [`Broker::stalled_round`]);
//! - `/metrics`: the counters in the Prometheus text format
//!   ([`metrics`]).
//!
//! Connection views ask the broker's event loop for a report between two
//! of its rounds ([`Broker::connections`]), with subscriptions only where
//! a view shows them; `/healthz` only waits for the loop's next round.
//!
//! The listener is an HTTP/1.1 server (hyper) on a thread of its own; the
//! views are built on at most four more (`/healthz` on two of its own).
//! A connection costs the server a task, not a thread, and each has
//! bounds ([`MonitorOptions`]): time to send a request's head, time for
//! each write of an answer to make progress (a client that stops reading
//! loses its connection), time served in all, and a number served at once
//! (more wait in the listen backlog), from one address fewer (more are
//! closed at once).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use efabus_broker::{Broker, ConnectionKind, ConnectionReport, ListenerReport};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{json, Value};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{oneshot, Semaphore};
use tokio::time::Sleep;

pub mod metrics;

/// How long a view waits for the event loop's report before it answers
/// 503.
const LOOP_ANSWER: Duration = Duration::from_secs(2);
/// What `/healthz` says of a broker whose event loop has ended.
const LOOP_ENDED: &str = "the event loop has ended: it panicked (its message is on standard error)";
/// Connections a `/connz` page lists unless asked otherwise, and at most.
const PAGE_DEFAULT: usize = 1024;
const PAGE_MAX: usize = 10_000;
/// Connections a `/connz?subs=1` page lists at most: the loop copies up to
/// 1,024 subscriptions of each between two rounds, so a page of 10,000
/// would copy ten million subjects while every peer waits.
const SUBS_PAGE_MAX: usize = 64;
/// Orders `/connz` and `/routez` can sort by.
const SORTS: &[&str] = &[
    "cid",
    "start",
    "msgs_to",
    "msgs_from",
    "bytes_to",
    "bytes_from",
    "pending",
    "dropped",
    "subs",
];

/// Why the monitoring listener could not start.
#[derive(Debug, Error)]
pub enum MonitorError {
    #[error("cannot listen for monitoring on {address}: {reason}")]
    Bind { address: String, reason: String },
    #[error("cannot start the monitoring thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Views built at once; requests beyond wait for one to finish.
const WORKERS: usize = 4;
/// Health checks answered at once, apart from the views.
const HEALTH_WORKERS: usize = 2;
/// The least time a connection is served, whatever the options say: none
/// at all would close each before its first request.
const MIN_CONNECTION_TIME: Duration = Duration::from_millis(100);
/// How long a stopping listener waits for the views being built.
const STOP_WAIT: Duration = Duration::from_secs(3);

/// The bounds the listener holds each client to.
#[derive(Clone, Copy, Debug)]
pub struct MonitorOptions {
    /// Time a client has to send the head of a request, counted from when
    /// the connection opens or its last answer went out: an idle
    /// connection is closed after it.
    pub read_timeout: Duration,
    /// Time one write of an answer may go without progress: a client that
    /// stops reading loses its connection after it.
    pub write_timeout: Duration,
    /// Connections served at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// Connections served at once from one address (an IPv6 one with its
    /// /64), at most: more are closed as they come, so that one client
    /// cannot hold every slot.
    pub max_connections_per_address: usize,
    /// How long one connection is served: after it, the answer in hand
    /// goes out and the connection is closed (a client that keeps one
    /// open with a request now and then would hold its slot for ever).
    pub max_connection_time: Duration,
}

impl Default for MonitorOptions {
    fn default() -> Self {
        MonitorOptions {
            read_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(10),
            max_connections: 64,
            max_connections_per_address: 16,
            max_connection_time: Duration::from_secs(60),
        }
    }
}

/// A running monitoring listener; dropping it stops it.
pub struct Monitor {
    address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Monitor {
    /// Listen on `address` (`HOST:PORT`; port 0 picks one) and serve the
    /// views of `broker` until dropped, with the default bounds.
    pub fn start(broker: Arc<Broker>, address: &str) -> Result<Monitor, MonitorError> {
        Monitor::start_with(broker, address, &MonitorOptions::default())
    }

    /// [`Monitor::start`] with the given bounds.
    pub fn start_with(
        broker: Arc<Broker>,
        address: &str,
        options: &MonitorOptions,
    ) -> Result<Monitor, MonitorError> {
        let bind_error = |reason: String| MonitorError::Bind {
            address: address.to_string(),
            reason,
        };
        let listener =
            std::net::TcpListener::bind(address).map_err(|err| bind_error(err.to_string()))?;
        let local = listener
            .local_addr()
            .map_err(|err| bind_error(err.to_string()))?;
        listener
            .set_nonblocking(true)
            .map_err(|err| bind_error(err.to_string()))?;
        // The semaphores keep blocking threads to `WORKERS` and `HEALTH_WORKERS`.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .thread_name("efabus-monitor")
            .build()
            .map_err(MonitorError::Thread)?;
        let listener = {
            let _runtime = runtime.enter();
            tokio::net::TcpListener::from_std(listener)
                .map_err(|err| bind_error(err.to_string()))?
        };
        let views = Arc::new(Views {
            broker,
            workers: Arc::new(Semaphore::new(WORKERS)),
            health_workers: Arc::new(Semaphore::new(HEALTH_WORKERS)),
        });
        let (stop, stopped) = oneshot::channel();
        let options = *options;
        let thread = std::thread::Builder::new()
            .name("efabus-monitor".to_string())
            .spawn(move || {
                runtime.block_on(listen(listener, views, options, stopped));
                runtime.shutdown_timeout(STOP_WAIT);
            })
            .map_err(MonitorError::Thread)?;
        Ok(Monitor {
            address: local,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::warn!("monitoring thread panicked");
            }
        }
    }
}

/// What the views read.
struct Views {
    broker: Arc<Broker>,
    /// One per view being built: a request waits for one before its view
    /// is queued, so views queue no further than the workers (a client
    /// that closes while it waits takes its request with it).
    workers: Arc<Semaphore>,
    /// The same for `/healthz`, apart.
    health_workers: Arc<Semaphore>,
}

/// Accept connections until `stopped`, serving at most
/// `options.max_connections` at once.
async fn listen(
    listener: tokio::net::TcpListener,
    views: Arc<Views>,
    options: MonitorOptions,
    mut stopped: oneshot::Receiver<()>,
) {
    let slots = Arc::new(Semaphore::new(options.max_connections.max(1)));
    let per_address = Arc::new(Mutex::new(HashMap::new()));
    loop {
        let slot = tokio::select! {
            _ = &mut stopped => return,
            slot = Arc::clone(&slots).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return,
            },
        };
        let (stream, from) = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Out of descriptors, or a connection reset before it
                    // was taken: keep listening, a little later.
                    tracing::debug!(error = %err, "monitoring accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let Some(held) =
            AddressHold::take(&per_address, from.ip(), options.max_connections_per_address)
        else {
            // Closed at once, its slot free again.
            tracing::debug!(%from, "monitoring connections from one address at their bound");
            continue;
        };
        let views = Arc::clone(&views);
        tokio::spawn(async move {
            let _slot = slot;
            let _held = held;
            let io = TokioIo::new(WriteDeadline::new(stream, options.write_timeout));
            let service = service_fn(move |request| {
                let views = Arc::clone(&views);
                async move { Ok::<_, Infallible>(respond(views, request).await) }
            });
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(options.read_timeout);
            let connection = builder.serve_connection(io, service);
            tokio::pin!(connection);
            let served = tokio::select! {
                served = connection.as_mut() => served,
                _ = tokio::time::sleep(options.max_connection_time.max(MIN_CONNECTION_TIME)) => {
                    // The answer in hand goes out; no further request is read.
                    connection.as_mut().graceful_shutdown();
                    tokio::time::timeout(options.write_timeout, connection.as_mut())
                        .await
                        .unwrap_or(Ok(()))
                }
            };
            if let Err(err) = served {
                tracing::debug!(error = %err, "monitoring connection ended");
            }
        });
    }
}

/// One of the connections served from an address, counted while it lives.
struct AddressHold {
    counts: Arc<Mutex<HashMap<IpAddr, usize>>>,
    address: IpAddr,
}

impl AddressHold {
    /// A hold for a new connection from `address`, unless `max` are served
    /// from it already. Counted as the broker counts its peers: an IPv6
    /// address by its /64, which one host commonly holds whole.
    fn take(
        counts: &Arc<Mutex<HashMap<IpAddr, usize>>>,
        address: IpAddr,
        max: usize,
    ) -> Option<AddressHold> {
        let address = efabus_transports::address_key(address);
        let mut held = counts.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(address).or_insert(0);
        if *count >= max.max(1) {
            return None;
        }
        *count += 1;
        Some(AddressHold {
            counts: Arc::clone(counts),
            address,
        })
    }
}

impl Drop for AddressHold {
    fn drop(&mut self) {
        let mut held = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.address);
            }
        }
    }
}

/// The answer to one request, built on a worker thread: the views wait on
/// the broker's event loop.
async fn respond(views: Arc<Views>, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let answer = if matches!(*request.method(), Method::GET | Method::HEAD) {
        let target = request
            .uri()
            .path_and_query()
            .map_or_else(|| "/".to_string(), |target| target.as_str().to_string());
        // A health check waits for no view: probes must not fail because
        // heavy views hold the workers (it only waits for a loop round).
        let path = target.split('?').next().unwrap_or_default();
        let workers = if path == "/healthz" {
            &views.health_workers
        } else {
            &views.workers
        };
        let worker = match Arc::clone(workers).acquire_owned().await {
            Ok(worker) => worker,
            Err(_) => return response(Answer::error(503, "the monitor is stopping")),
        };
        tokio::task::spawn_blocking(move || {
            let _worker = worker;
            answer(&target, &views.broker)
        })
        .await
        // A view that fails answers 500; the listener stays.
        .unwrap_or_else(|_| Answer::error(500, "the view failed; see the broker's log"))
    } else {
        Answer::error(405, "only GET is served")
    };
    response(answer)
}

fn response(answer: Answer) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(answer.body)));
    *response.status_mut() =
        StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(answer.content_type));
    response
}

/// A connection whose writes fail once one has gone `limit` without
/// progress, so that a client that stops reading cannot keep its
/// connection (and the answer buffered for it) for ever.
struct WriteDeadline<S> {
    inner: S,
    limit: Duration,
    /// Running while a write waits.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    fn new(inner: S, limit: Duration) -> Self {
        WriteDeadline {
            inner,
            limit,
            stalled: None,
        }
    }

    /// After a write that could not go on: pending until the deadline,
    /// then the error that ends the connection.
    fn wait<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let limit = self.limit;
        let deadline = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client stopped reading its answer",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn progress<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match poll {
            Poll::Pending => self.wait(cx),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.progress(cx, poll)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.progress(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    // A socket's flush and shutdown wait for nothing the client does.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// An answer: status, content type and body.
struct Answer {
    status: u16,
    content_type: &'static str,
    body: String,
}

impl Answer {
    fn json(status: u16, value: &Value) -> Answer {
        Answer {
            status,
            content_type: "application/json",
            body: format!("{value:#}\n"),
        }
    }

    fn error(status: u16, message: impl Into<String>) -> Answer {
        Answer::json(status, &json!({ "error": message.into() }))
    }
}

/// The view `target` (path and query) names.
fn answer(target: &str, broker: &Broker) -> Answer {
    // Uptime is the broker's, whenever the monitor started.
    let started = broker.started();
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let query: HashMap<String, String> = form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect();
    let result = match path {
        "/" => Ok(Answer::json(
            200,
            &json!({ "endpoints": ["/varz", "/connz", "/routez", "/subsz", "/healthz", "/metrics"] }),
        )),
        "/varz" => Ok(varz(broker, started)),
        "/connz" => list(broker, &query, ConnectionKind::Client),
        "/routez" => list(broker, &query, ConnectionKind::Route),
        "/subsz" => subsz(broker, &query),
        "/healthz" => Ok(healthz(broker)),
        "/metrics" => metrics_page(broker, started),
        _ => Err(Answer::error(
            404,
            format!("no page {path}; try /varz, /connz, /routez, /subsz, /healthz or /metrics"),
        )),
    };
    result.unwrap_or_else(|answer| answer)
}

fn unix_seconds(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

fn seconds_since(time: SystemTime) -> u64 {
    SystemTime::now()
        .duration_since(time)
        .map_or(0, |since| since.as_secs())
}

/// The process's resident memory, from `/proc/self/status`.
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn varz(broker: &Broker, started: SystemTime) -> Answer {
    // The limits in force, with what a reload changed.
    let config = broker.running_config();
    let limits = &config.limits;
    let listeners: Vec<Value> = broker.listeners().iter().map(listener_view).collect();
    let totals: serde_json::Map<String, Value> = broker
        .stats()
        .snapshot()
        .into_iter()
        .map(|(name, value)| (name.to_string(), json!(value)))
        .collect();
    Answer::json(
        200,
        &json!({
            "server_name": config.name,
            "server_id": format!("{:016x}", broker.broker_id()),
            "version": env!("CARGO_PKG_VERSION"),
            "start_unix": unix_seconds(started),
            "now_unix": unix_seconds(SystemTime::now()),
            "uptime_secs": seconds_since(started),
            "listeners": listeners,
            "peers": broker.peers(),
            "limits": {
                "max_payload": limits.max_payload,
                "max_subject_len": limits.max_subject_len,
                "max_connections": limits.max_connections,
                "max_subscriptions_per_peer": limits.max_subscriptions_per_peer,
                "max_pending_bytes": limits.max_pending_bytes,
                "max_link_memory": limits.max_link_memory,
                "subscription_queue": limits.subscription_queue,
                "block_timeout_ms": config.slow_consumer.block_timeout_ms,
                "slow_consumer_policy": config.slow_consumer.policy,
            },
            "subscriptions": broker.subscription_count(),
            "totals": totals,
            "memory": { "resident_bytes": resident_bytes() },
            "libfabric": libfabric_view(),
        }),
    )
}

/// The libfabric the process uses: null until a fabric endpoint has loaded
/// it (asking does not load it).
fn libfabric_view() -> Value {
    match efabus_transports::fabric::libfabric_in_use() {
        Some(loaded) => json!({
            "path": loaded.path,
            "version": format!("{}.{}", loaded.version.0, loaded.version.1),
            "built_with": format!("{}.{}", loaded.built_with.0, loaded.built_with.1),
        }),
        None => Value::Null,
    }
}

/// The broker's sessions (with the subscriptions of those
/// `subscriptions_of` names), or 503 when its event loop does not answer.
fn connections(broker: &Broker, subscriptions_of: &[u64]) -> Result<Vec<ConnectionReport>, Answer> {
    broker
        .connections(subscriptions_of, LOOP_ANSWER)
        .map_err(|err| Answer::error(503, format!("the broker did not answer: {err}")))
}

fn number(query: &HashMap<String, String>, key: &str, default: usize) -> Result<usize, Answer> {
    match query.get(key) {
        None => Ok(default),
        Some(text) => text
            .parse()
            .map_err(|_| Answer::error(400, format!("{key}={text} is not a number"))),
    }
}

fn flag(query: &HashMap<String, String>, key: &str) -> bool {
    query
        .get(key)
        .is_some_and(|value| matches!(value.as_str(), "1" | "true" | "yes"))
}

/// `/connz` (clients) or `/routez` (routes): sorted, paged.
fn list(
    broker: &Broker,
    query: &HashMap<String, String>,
    kind: ConnectionKind,
) -> Result<Answer, Answer> {
    let offset = number(query, "offset", 0)?;
    let subs = flag(query, "subs");
    let most = if subs && kind == ConnectionKind::Client {
        SUBS_PAGE_MAX
    } else {
        PAGE_MAX
    };
    let limit = number(query, "limit", PAGE_DEFAULT)?.min(most);
    let sort = query.get("sort").map_or("cid", String::as_str);
    if !SORTS.contains(&sort) {
        return Err(Answer::error(
            400,
            format!("sort={sort} is not one of {}", SORTS.join(", ")),
        ));
    }
    let mut reports: Vec<ConnectionReport> = connections(broker, &[])?
        .into_iter()
        .filter(|report| report.kind == kind)
        .collect();
    sort_reports(&mut reports, sort);
    let total = reports.len();
    let mut page: Vec<ConnectionReport> = reports.into_iter().skip(offset).take(limit).collect();
    if subs && kind == ConnectionKind::Client {
        // Asked for the page alone: the loop copies no other connection's
        // subscriptions. A connection gone meanwhile lists none.
        let ids: Vec<u64> = page.iter().map(|report| report.id).collect();
        let mut listed: HashMap<u64, Vec<_>> = connections(broker, &ids)?
            .into_iter()
            .map(|report| (report.id, report.subscriptions))
            .collect();
        for report in &mut page {
            report.subscriptions = listed.remove(&report.id).unwrap_or_default();
        }
    }
    let page: Vec<Value> = page
        .iter()
        .map(|report| connection_json(report, subs))
        .collect();
    let key = match kind {
        ConnectionKind::Client => "connections",
        ConnectionKind::Route => "routes",
    };
    let mut view = json!({
        "now_unix": unix_seconds(SystemTime::now()),
        "total": total,
        "offset": offset,
        "limit": limit,
        "sort": sort,
        key: page,
    });
    if kind == ConnectionKind::Route {
        view["peers"] = json!(broker.peers());
        // What the route handshakes told: which broker, which side dialed.
        let known: Vec<Value> = broker
            .routes()
            .into_iter()
            .map(|route| {
                json!({
                    "name": route.name,
                    "broker_id": route.broker_id,
                    "remote": route.remote,
                    "dialed": route.dialed,
                })
            })
            .collect();
        view["brokers"] = json!(known);
    }
    Ok(Answer::json(200, &view))
}

/// Counters sort highest first; ids and start times oldest first.
fn sort_reports(reports: &mut [ConnectionReport], sort: &str) {
    let key = |report: &ConnectionReport| -> u64 {
        let counts = &report.counts;
        match sort {
            "msgs_to" => counts.messages_out,
            "msgs_from" => counts.messages_in,
            "bytes_to" => counts.bytes_out,
            "bytes_from" => counts.bytes_in,
            "pending" => report.pending_bytes,
            "dropped" => counts.dropped,
            "subs" => report.subscription_count as u64,
            _ => 0,
        }
    };
    match sort {
        "cid" => reports.sort_by_key(|report| report.id),
        "start" => reports.sort_by_key(|report| (report.since, report.id)),
        _ => reports.sort_by_key(|report| (std::cmp::Reverse(key(report)), report.id)),
    }
}

fn connection_json(report: &ConnectionReport, subs: bool) -> Value {
    let counts = &report.counts;
    let mut view = json!({
        "cid": report.id,
        "kind": report.kind.name(),
        "name": report.name,
        "user": report.user,
        "remote": report.remote,
        "start_unix": unix_seconds(report.since),
        "uptime_secs": seconds_since(report.since),
        "ready": report.ready,
        "link": {
            "reliable": report.reliable,
            "kind": report.link_kind(),
            "provider": report.provider(),
            "on_fabric": report.on_fabric(),
            "best_effort": report.best_effort,
            "reasons": report.reasons,
        },
        "in_msgs": counts.messages_in,
        "in_bytes": counts.bytes_in,
        "out_msgs": counts.messages_out,
        "out_bytes": counts.bytes_out,
        "pending_bytes": report.pending_bytes,
        "dropped": counts.dropped,
        "subscriptions": report.subscription_count,
    });
    if subs {
        view["subscriptions_list"] = report
            .subscriptions
            .iter()
            .map(|sub| {
                json!({
                    "sid": sub.sid,
                    "subject": sub.pattern,
                    "queue": sub.queue,
                    "best_effort": sub.best_effort,
                })
            })
            .collect();
    }
    view
}

fn subsz(broker: &Broker, query: &HashMap<String, String>) -> Result<Answer, Answer> {
    let mut view = json!({
        "subscriptions": broker.subscription_count(),
        "route_interest": broker.route_interest_count(),
    });
    if let Some(subject) = query.get("test") {
        let matched = broker
            .matching(subject)
            .map_err(|err| Answer::error(400, err.to_string()))?;
        // Names only: the patterns come with the match.
        let sessions = connections(broker, &[])?;
        let by_id: HashMap<u64, &ConnectionReport> =
            sessions.iter().map(|report| (report.id, report)).collect();
        let matches: Vec<Value> = matched
            .remote
            .iter()
            .map(|remote| {
                let session = by_id.get(&remote.session);
                json!({
                    "cid": remote.session,
                    "sid": remote.sid,
                    "kind": session.map(|report| report.kind.name()),
                    "name": session.map(|report| report.name.as_str()),
                    "subject": remote.pattern,
                    "queue": remote.queue,
                })
            })
            .collect();
        view["test"] = json!({
            "subject": subject,
            "local": matched.local,
            "remote": matches,
            "total": matched.local + matched.remote.len(),
        });
    }
    Ok(Answer::json(200, &view))
}

fn listener_view(listener: &ListenerReport) -> Value {
    json!({
        "scheme": listener.scheme,
        "address": listener.address,
        "up": listener.is_up(),
        "error": listener.failure,
    })
}

fn healthz(broker: &Broker) -> Answer {
    // First: a loop that ended also marks the broker shut down.
    if broker.loop_ended() {
        return Answer::json(
            503,
            &json!({ "status": "unavailable", "error": LOOP_ENDED }),
        );
    }
    if broker.is_shut_down() {
        return Answer::json(503, &json!({ "status": "stopped" }));
    }
    let down: Vec<Value> = broker
        .listeners()
        .iter()
        .filter(|listener| !listener.is_up())
        .map(listener_view)
        .collect();
    if !down.is_empty() {
        return Answer::json(
            503,
            &json!({ "status": "unavailable", "listeners_down": down }),
        );
    }
    // A round stuck this long will not answer either: say where it is.
    if let Some(stall) = broker.stalled_round(LOOP_ANSWER) {
        return Answer::json(
            503,
            &json!({ "status": "unavailable", "error": stall.to_string() }),
        );
    }
    // Answered at the loop's next round, whatever its sessions have
    // queued: it runs, and nothing is built for the answer.
    match broker.responsive(LOOP_ANSWER) {
        Ok(()) => Answer::json(200, &json!({ "status": "ok" })),
        Err(err) => {
            let error = broker
                .stalled_round(LOOP_ANSWER)
                .map_or_else(|| err.to_string(), |stall| stall.to_string());
            Answer::json(503, &json!({ "status": "unavailable", "error": error }))
        }
    }
}

fn metrics_page(broker: &Broker, started: SystemTime) -> Result<Answer, Answer> {
    let sessions = connections(broker, &[])?;
    let body = metrics::render(broker, &sessions, seconds_since(started))
        .map_err(|err| Answer::error(500, format!("metrics did not encode: {err}")))?;
    Ok(Answer {
        status: 200,
        content_type: metrics::CONTENT_TYPE,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Addresses of one IPv6 /64 share one address's connections, as an
    /// IPv4 address's connections share them; another /64 has its own.
    #[test]
    fn an_ipv6_host_s_connections_share_its_64_s_bound() {
        let counts = Arc::new(Mutex::new(HashMap::new()));
        let ip = |text: &str| text.parse::<IpAddr>().expect("an address");
        let first = AddressHold::take(&counts, ip("2001:db8:1:2::1"), 2);
        let second = AddressHold::take(&counts, ip("2001:db8:1:2:ffff::9"), 2);
        assert!(first.is_some() && second.is_some());
        assert!(
            AddressHold::take(&counts, ip("2001:db8:1:2:abcd::7"), 2).is_none(),
            "a third address of the same /64 took a connection past the bound"
        );
        assert!(AddressHold::take(&counts, ip("2001:db8:1:3::1"), 2).is_some());
        drop(first);
        assert!(AddressHold::take(&counts, ip("2001:db8:1:2::5"), 2).is_some());
    }
}
