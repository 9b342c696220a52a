//! The HTTP monitoring listener of a broker. [`Monitor`] serves, on four
//! threads of its own (a client that stops reading holds up one), JSON
//! views of the running broker and Prometheus metrics:
//!
//! - `/varz`: the server (name, id, version, uptime, listeners, limits),
//!   its counters and its memory;
//! - `/connz`: the client connections, each with the links it negotiated
//!   (and on TCP why not the fabric), its counters and pending bytes;
//!   `?subs=1` lists subscriptions, `?sort=`, `?offset=` and `?limit=`
//!   page through them;
//! - `/routez`: the routes to other brokers, the same way, and the peers
//!   dialed;
//! - `/subsz`: subscription counts; `?test=SUBJECT` says which
//!   subscriptions a message on SUBJECT would reach;
//! - `/healthz`: 200 while every listener is up and the broker's event
//!   loop answers, else 503 with what is down;
//! - `/metrics`: the counters in the Prometheus text format
//!   ([`metrics`]).
//!
//! Connection views ask the broker's event loop for a report between two
//! of its rounds ([`Broker::connections`]), with subscriptions only where
//! a view shows them; `/healthz` only waits for the loop's next round.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use efabus_broker::{Broker, ConnectionKind, ConnectionReport, ListenerReport};
use serde_json::{json, Value};
use thiserror::Error;
use tiny_http::{Header, Method, Request, Response, Server};

pub mod metrics;

/// How long a view waits for the event loop's report before it answers
/// 503.
const LOOP_ANSWER: Duration = Duration::from_secs(2);
/// Connections a `/connz` page lists unless asked otherwise, and at most.
const PAGE_DEFAULT: usize = 1024;
const PAGE_MAX: usize = 10_000;
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

/// Requests served at once, each on its own thread: a client that stops
/// reading its answer holds one of them, not the listener.
const WORKERS: usize = 4;

/// A running monitoring listener; dropping it stops it.
pub struct Monitor {
    server: Arc<Server>,
    address: SocketAddr,
    threads: Vec<JoinHandle<()>>,
}

impl Monitor {
    /// Listen on `address` (`HOST:PORT`; port 0 picks one) and serve the
    /// views of `broker` until dropped.
    pub fn start(broker: Arc<Broker>, address: &str) -> Result<Monitor, MonitorError> {
        let bind_error = |reason: String| MonitorError::Bind {
            address: address.to_string(),
            reason,
        };
        let server = Server::http(address).map_err(|err| bind_error(err.to_string()))?;
        let local = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| bind_error("not an IP address".to_string()))?;
        let server = Arc::new(server);
        // Uptime is the broker's, whenever the monitor started.
        let started = broker.started();
        let mut monitor = Monitor {
            server,
            address: local,
            threads: Vec::with_capacity(WORKERS),
        };
        for _ in 0..WORKERS {
            let thread = std::thread::Builder::new()
                .name("efabus-monitor".to_string())
                .spawn({
                    let server = Arc::clone(&monitor.server);
                    let broker = Arc::clone(&broker);
                    move || serve(&server, &broker, started)
                })
                .map_err(MonitorError::Thread)?;
            monitor.threads.push(thread);
        }
        Ok(monitor)
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        // Each call lets one waiting thread go.
        for _ in &self.threads {
            self.server.unblock();
        }
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::warn!("monitoring thread panicked");
            }
        }
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

fn serve(server: &Server, broker: &Broker, started: SystemTime) {
    for request in server.incoming_requests() {
        // A view that fails answers 500; the listener stays.
        let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            answer(&request, broker, started)
        }))
        .unwrap_or_else(|_| Answer::error(500, "the view failed; see the broker's log"));
        let mut response = Response::from_string(answer.body).with_status_code(answer.status);
        if let Ok(header) = Header::from_bytes(&b"Content-Type"[..], answer.content_type.as_bytes())
        {
            response = response.with_header(header);
        }
        if let Err(err) = request.respond(response) {
            tracing::debug!(error = %err, "monitoring answer not sent");
        }
    }
}

fn answer(request: &Request, broker: &Broker, started: SystemTime) -> Answer {
    if !matches!(request.method(), Method::Get | Method::Head) {
        return Answer::error(405, "only GET is served");
    }
    let (path, query) = request.url().split_once('?').unwrap_or((request.url(), ""));
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
                "slow_consumer_policy": format!("{:?}", config.slow_consumer.policy).to_lowercase(),
            },
            "subscriptions": broker.subscription_count(),
            "totals": totals,
            "memory": { "resident_bytes": resident_bytes() },
        }),
    )
}

/// The broker's sessions (with their subscriptions when `subscriptions`),
/// or 503 when its event loop does not answer.
fn connections(broker: &Broker, subscriptions: bool) -> Result<Vec<ConnectionReport>, Answer> {
    broker
        .connections(subscriptions, LOOP_ANSWER)
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
    let limit = number(query, "limit", PAGE_DEFAULT)?.min(PAGE_MAX);
    let sort = query.get("sort").map_or("cid", String::as_str);
    if !SORTS.contains(&sort) {
        return Err(Answer::error(
            400,
            format!("sort={sort} is not one of {}", SORTS.join(", ")),
        ));
    }
    let subs = flag(query, "subs");
    let mut reports: Vec<ConnectionReport> = connections(broker, subs)?
        .into_iter()
        .filter(|report| report.kind == kind)
        .collect();
    sort_reports(&mut reports, sort);
    let total = reports.len();
    let page: Vec<Value> = reports
        .iter()
        .skip(offset)
        .take(limit)
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
        let sessions = connections(broker, false)?;
        let matches: Vec<Value> = matched
            .remote
            .iter()
            .map(|remote| {
                let session = sessions.iter().find(|report| report.id == remote.session);
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
    // Answered at the loop's next round, whatever its sessions have
    // queued: it runs, and nothing is built for the answer.
    match broker.responsive(LOOP_ANSWER) {
        Ok(()) => Answer::json(200, &json!({ "status": "ok" })),
        Err(err) => Answer::json(
            503,
            &json!({ "status": "unavailable", "error": err.to_string() }),
        ),
    }
}

fn metrics_page(broker: &Broker, started: SystemTime) -> Result<Answer, Answer> {
    let sessions = connections(broker, false)?;
    let body = metrics::render(broker, &sessions, seconds_since(started))
        .map_err(|err| Answer::error(500, format!("metrics did not encode: {err}")))?;
    Ok(Answer {
        status: 200,
        content_type: metrics::CONTENT_TYPE,
        body,
    })
}
