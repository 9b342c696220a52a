//! `efabus bench`: throughput and request/reply latency, against an
//! embedded broker or a running server on any endpoint.
//!
//! Throughput: P publishers each send N messages of B bytes on one subject;
//! S subscribers (optionally a queue group) count what they receive. The
//! figure is messages delivered to subscribers per second, from the first
//! publish to the last delivery. Latency: one requester, one responder,
//! round trips recorded in an HDR histogram.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Args, ValueEnum};
use efabus_broker::{
    Broker, Client, ClientOptions, Config, Error, PubSub, RecvError, SlowConsumerPolicy,
    Subscription,
};
use efabus_transports::{mem, tcp};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use crate::cli::{check_server, explain, secret_from, Failure, SECRET_FLAGS};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchMode {
    Throughput,
    Latency,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// What to measure.
    #[arg(long, value_enum, default_value_t = BenchMode::Throughput)]
    pub mode: BenchMode,
    /// A running broker to measure; without it an embedded broker is started.
    #[arg(long, short)]
    pub server: Option<String>,
    /// With no --server: reach the embedded broker in-process through its
    /// API (`embedded`) or through clients over `mem` or `tcp`; or `route`:
    /// two embedded brokers routed to each other (over the fabric of
    /// --config where both have it, else TCP), publishers on one and
    /// subscribers on the other, so every message crosses the route.
    #[arg(long, default_value = "embedded")]
    pub via: String,
    /// Publishers (at most 4096), each on a thread of its own.
    #[arg(long, short, default_value_t = 1)]
    pub pubs: usize,
    /// Subscribers (at most 4096), each on a thread of its own.
    #[arg(long = "subs", short = 'S', default_value_t = 1)]
    pub subs: usize,
    /// Subscribers share one queue group (each message reaches one of them).
    #[arg(long)]
    pub queue: bool,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 16)]
    pub size: usize,
    /// Messages per publisher (throughput) or round trips (latency).
    #[arg(long, short = 'n', default_value_t = 1_000_000)]
    pub count: u64,
    /// Publish (or make round trips) for this many seconds instead of a
    /// fixed --count.
    #[arg(long, conflicts_with = "count", value_name = "SECONDS")]
    pub duration: Option<f64>,
    /// Untimed messages per publisher (or round trips) before the measured
    /// ones, delivered in full before the clock starts: they set up fabric
    /// connections and fault in buffers, which a short run would count.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Shared secret for --server.
    #[arg(long, env = "EFABUS_SECRET", hide_env_values = true)]
    pub secret: Option<String>,
    /// With --server: the bench clients' config, as for the other client
    /// commands (their fabric endpoints, secret, [tls], limits). With
    /// `--via route`: the fabric endpoints both brokers listen on.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Latency: the responder answers with `respond` (the far broker's
    /// with `--via route`, its client's with --server), on the thread that
    /// delivers each request, instead of a thread of the bench reading a
    /// subscription.
    #[arg(long)]
    pub inline: bool,
}

#[derive(Debug, Serialize)]
struct ThroughputReport {
    mode: &'static str,
    target: String,
    publishers: usize,
    subscribers: usize,
    queue_group: bool,
    payload_bytes: usize,
    link: String,
    published: u64,
    delivered: u64,
    expected: u64,
    seconds: f64,
    published_per_sec: f64,
    delivered_per_sec: f64,
    delivered_mb_per_sec: f64,
}

#[derive(Debug, Serialize)]
struct LatencyReport {
    mode: &'static str,
    target: String,
    payload_bytes: usize,
    link: String,
    /// `inline` (`Broker::respond`) or `thread` (a subscription's reader).
    responder: &'static str,
    round_trips: u64,
    seconds: f64,
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
    p999_us: f64,
    max_us: f64,
}

/// Something to publish and subscribe through: the embedded broker or clients.
struct Target {
    description: String,
    broker: Option<Broker>,
    endpoint: Option<String>,
    secret: Option<String>,
    /// Client options from --config, before the bench's own settings.
    base: ClientOptions,
    /// The reliable path the last client negotiated (`embedded` without
    /// clients; the route's path with `--via route`).
    link: parking_lot::Mutex<String>,
    /// With `--via route`: the broker routed to `broker`, where the
    /// subscribers (and the latency responder) are.
    far: Option<Broker>,
}

impl Target {
    fn open(args: &BenchArgs) -> Result<Target, Failure> {
        if let Some(server) = &args.server {
            check_server(server)?;
            let base = match &args.config {
                Some(path) => ClientOptions::from_config(&Config::from_file(path)?),
                None => ClientOptions::default(),
            };
            return Ok(Target {
                description: server.clone(),
                broker: None,
                endpoint: Some(server.clone()),
                secret: secret_from(&args.secret, &None, SECRET_FLAGS)?
                    .or(base.credentials.clone()),
                base,
                link: parking_lot::Mutex::new(String::new()),
                far: None,
            });
        }
        if args.via == "route" {
            return Target::route(args);
        }
        if args.config.is_some() {
            return Err(Failure::usage("--config needs --server or --via route"));
        }
        let listen = match args.via.as_str() {
            "embedded" => Vec::new(),
            mem::SCHEME => vec![format!("{}/bench-{}", mem::SCHEME, std::process::id())],
            tcp::SCHEME => vec![format!("{}/127.0.0.1:0", tcp::SCHEME)],
            other => {
                return Err(Failure::usage(format!(
                    "unknown --via {other:?}; use embedded, mem, tcp or route"
                )))
            }
        };
        let config = Config {
            log_level: "warn".into(),
            listen,
            ..Config::default()
        };
        let broker = start_lossless(config, args)?;
        let endpoint = match args.via.as_str() {
            "embedded" => None,
            scheme => broker.endpoint(scheme),
        };
        Ok(Target {
            description: format!("embedded broker via {}", args.via),
            broker: Some(broker),
            link: parking_lot::Mutex::new(if endpoint.is_some() {
                String::new()
            } else {
                "embedded".to_string()
            }),
            endpoint,
            secret: None,
            base: ClientOptions::default(),
            far: None,
        })
    }

    /// Two embedded brokers, the second routed to the first, both listening
    /// on the fabric endpoints of --config (and TCP, which carries the
    /// route where they have no fabric in common).
    fn route(args: &BenchArgs) -> Result<Target, Failure> {
        let base = match &args.config {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        let fabric: Vec<String> = base
            .listen
            .iter()
            .filter(|entry| !entry.starts_with("tcp/") && !entry.starts_with("mem/"))
            .cloned()
            .collect();
        let config = |name: &str, peers: Vec<String>| Config {
            name: name.into(),
            log_level: "warn".into(),
            listen: std::iter::once(format!("{}/127.0.0.1:0", tcp::SCHEME))
                .chain(fabric.iter().cloned())
                .collect(),
            peers,
            fabric: base.fabric.clone(),
            negotiation: base.negotiation.clone(),
            ..Config::default()
        };
        let near = start_lossless(config("bench-near", Vec::new()), args)?;
        let near_tcp = near
            .endpoint(tcp::SCHEME)
            .ok_or_else(|| Failure::runtime("the first broker has no TCP listener"))?;
        let far = start_lossless(config("bench-far", vec![near_tcp]), args)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        let route = loop {
            if let (Some(route), 1) = (far.routes().pop(), near.routes().len()) {
                break route;
            }
            if Instant::now() > deadline {
                return Err(Failure::runtime(
                    "the two brokers did not route to each other within 10 s",
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        Ok(Target {
            description: "two embedded brokers, across their route".to_string(),
            broker: Some(near),
            endpoint: None,
            secret: None,
            base: ClientOptions::default(),
            link: parking_lot::Mutex::new(route.reliable),
            far: Some(far),
        })
    }

    /// Where subscribers subscribe: the far broker with `--via route`.
    fn subscribing_broker(&self) -> Option<&Broker> {
        self.far.as_ref().or(self.broker.as_ref())
    }

    /// With `--via route`, wait until the near broker has learned the far
    /// one's interest (`entries` of it), so no message is published before
    /// the route wants it.
    fn await_route_interest(&self, entries: usize) -> Result<(), Failure> {
        let (Some(near), Some(_)) = (&self.broker, &self.far) else {
            return Ok(());
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while near.route_interest_count() < entries {
            if Instant::now() > deadline {
                return Err(Failure::runtime(
                    "the subscriptions did not reach the other broker within 10 s",
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// A handle for one publisher or subscriber.
    fn handle(&self) -> Result<Arc<dyn PubSub>, Failure> {
        Ok(Arc::new(self.client()?))
    }

    /// A client of the broker under test, for one publisher or subscriber.
    fn client(&self) -> Result<Client, Failure> {
        match (&self.endpoint, &self.broker) {
            (Some(endpoint), _) => {
                let options = ClientOptions {
                    name: "efabus-bench".into(),
                    credentials: self.secret.clone(),
                    subscription_queue: 1 << 20,
                    slow_consumer: SlowConsumerPolicy::Block,
                    block_timeout: Duration::from_secs(30),
                    max_pending_bytes: 64 << 20,
                    // A broker that is not there, or goes away, ends the
                    // measurement with the reason.
                    reconnect: false,
                    ..self.base.clone()
                };
                let client = Client::connect_with(
                    endpoint,
                    options,
                    efabus_transports::registry::Registry::with_builtins(),
                )
                .map_err(|err| explain(err, Some(endpoint)))?;
                *self.link.lock() = client.link().reliable;
                Ok(client)
            }
            (None, Some(_)) => Err(Failure::runtime(
                "embedded handles are borrowed, not opened",
            )),
            (None, None) => Err(Failure::runtime("no target")),
        }
    }
}

impl Target {
    /// What a bench thread publishes or subscribes through: its own client
    /// `handle` when it has one, else the embedded broker.
    fn through<'a>(
        &'a self,
        handle: &'a Option<Arc<dyn PubSub>>,
    ) -> Result<&'a dyn PubSub, Failure> {
        match (handle, &self.broker) {
            (Some(handle), _) => Ok(handle.as_ref()),
            (None, Some(broker)) => Ok(broker),
            (None, None) => Err(Failure::runtime("no target")),
        }
    }
}

/// A progress bar for `total` messages, or a counter when the total is
/// not known before the end (`--duration`).
fn progress(total: Option<u64>, json: bool) -> ProgressBar {
    match total {
        _ if json => ProgressBar::hidden(),
        Some(total) if total < 100_000 => ProgressBar::hidden(),
        Some(total) => {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} {bar:40} {pos}/{len} delivered {per_sec} {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        }
        None => {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} {pos} delivered {per_sec} {elapsed}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            bar
        }
    }
}

/// How long a warm-up runs before its bar is drawn: most take less, and
/// print nothing but the run's report.
const WARM_UP_BAR_AFTER: Duration = Duration::from_secs(1);

/// A warm-up's progress: `total` messages (or round trips), drawn once it
/// has run for [`WARM_UP_BAR_AFTER`] (never with `--json`; indicatif draws
/// on a terminal only), cleared when dropped.
struct WarmUpBar {
    bar: ProgressBar,
    started: Instant,
    shown: bool,
    json: bool,
}

impl WarmUpBar {
    fn new(total: u64, what: &str, json: bool) -> WarmUpBar {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden());
        let template = format!("warm-up {{bar:40}} {{pos}}/{{len}} {what} {{per_sec}} {{eta}}");
        bar.set_style(
            ProgressStyle::with_template(&template)
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        WarmUpBar {
            bar,
            started: Instant::now(),
            shown: false,
            json,
        }
    }

    fn update(&mut self, done: u64) {
        self.bar.set_position(done);
        if !self.shown && !self.json && self.started.elapsed() >= WARM_UP_BAR_AFTER {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
            self.shown = true;
        }
    }
}

impl Drop for WarmUpBar {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// " (over LINK)" when clients negotiated a path, for the text report.
fn link_note(link: &str) -> String {
    if link.is_empty() || link == "embedded" {
        String::new()
    } else {
        format!(" (over {link})")
    }
}

/// An embedded broker for the bench: lossless (`block`), with room for the
/// whole run in its queues.
fn start_lossless(mut config: Config, args: &BenchArgs) -> Result<Broker, Failure> {
    config.limits.subscription_queue = 1 << 20;
    config.limits.max_pending_bytes = 64 << 20;
    config.limits.max_payload = (args.size as u64).max(1 << 20);
    config.limits.max_link_memory = config.limits.max_link_memory.max(config.max_frame());
    config.slow_consumer.policy = SlowConsumerPolicy::Block;
    config.slow_consumer.block_timeout_ms = 30_000;
    Broker::start(config).map_err(|err| Failure::runtime(err.to_string()))
}

/// Largest payload a bench sends (each publisher holds one).
const MAX_SIZE: usize = 1 << 30;

/// Messages a publisher sends between two looks at the stop flag.
const STOP_CHECK_EVERY: u64 = 1024;

/// Most publishers, and most subscribers, a bench runs: each has a thread.
const MAX_SIDE_THREADS: usize = 4096;

fn bench_error(err: Error) -> Failure {
    match err {
        Error::PayloadTooLarge { .. } => Failure::usage(format!("{err}; ask for a smaller --size")),
        err => Failure::runtime(err.to_string()),
    }
}

/// A bench thread the system would not start.
fn thread_failure(role: &str, flag: &str, err: &std::io::Error) -> Failure {
    Failure::runtime(format!(
        "cannot start a {role} thread: {err}; ask for fewer with {flag}"
    ))
}

pub fn run(args: BenchArgs) -> Result<(), Failure> {
    if args.pubs == 0 || args.subs == 0 || args.count == 0 {
        return Err(Failure::usage(
            "--pubs, --subs and --count must be at least 1",
        ));
    }
    if args.pubs > MAX_SIDE_THREADS || args.subs > MAX_SIDE_THREADS {
        return Err(Failure::usage(format!(
            "--pubs and --subs take at most {MAX_SIDE_THREADS} each (a thread apiece)"
        )));
    }
    // Every delivery is counted in a u64.
    let deliveries = |per_publisher: u64| {
        (args.pubs as u64)
            .checked_mul(per_publisher)
            .and_then(|sent| sent.checked_mul(args.subs as u64))
    };
    if deliveries(args.count).is_none() || deliveries(args.warmup).is_none() {
        return Err(Failure::usage(
            "--pubs x --count (or --warmup) x --subs is too large to count; ask for fewer \
             messages",
        ));
    }
    if args.size > MAX_SIZE {
        return Err(Failure::usage(format!(
            "--size must be at most {MAX_SIZE} bytes (1 GiB), not {}",
            args.size
        )));
    }
    if let Some(seconds) = args.duration {
        if !(seconds > 0.0 && seconds <= MAX_DURATION_SECS) {
            return Err(Failure::usage(format!(
                "--duration must be more than 0 and at most {MAX_DURATION_SECS} seconds, not {seconds}"
            )));
        }
    }
    if args.inline && args.mode != BenchMode::Latency {
        return Err(Failure::usage(
            "--inline chooses how latency round trips are answered: use it with --mode latency",
        ));
    }
    let target = Target::open(&args)?;
    match args.mode {
        BenchMode::Throughput => throughput(&args, &target),
        BenchMode::Latency => latency(&args, &target),
    }
}

fn with_handle<R>(
    target: &Target,
    f: impl FnOnce(&dyn PubSub) -> Result<R, Failure>,
) -> Result<R, Failure> {
    match (&target.endpoint, &target.broker) {
        (None, Some(broker)) => f(broker),
        _ => {
            let handle = target.handle()?;
            f(handle.as_ref())
        }
    }
}

/// Longest `--duration` (a day).
const MAX_DURATION_SECS: f64 = 86_400.0;

/// Payload bytes published between two looks at the clock in a
/// `--duration` run (at most 256 messages, at least one).
const BYTES_PER_CLOCK_READ: usize = 1 << 20;

/// Most messages a throughput reader takes from its subscription at once.
const RECV_BATCH: usize = 256;
/// How long a throughput reader waits for a message before checking
/// whether the run is over.
const WAIT_SLICE: Duration = Duration::from_millis(100);
/// How long a throughput reader waits without any message before it gives
/// up (the report then counts what is missing).
const IDLE_LIMIT: Duration = Duration::from_secs(3);

fn throughput(args: &BenchArgs, target: &Target) -> Result<(), Failure> {
    // Ctrl-C stops the publishers; what they sent is still delivered and
    // reported, as a partial run.
    let stop = crate::cli::stop_on_signals()?;
    let subject = format!("bench.{}", std::process::id());
    let duration = args.duration.map(Duration::from_secs_f64);
    // Deliveries per published message: one per subscriber, or one for the
    // whole queue group.
    let copies = if args.queue { 1 } else { args.subs as u64 };
    // Messages each subscriber (or the queue group together) waits for:
    // known up front with --count, once the publishers stop with --duration.
    let goal = AtomicU64::new(match duration {
        Some(_) => u64::MAX,
        None => args.pubs as u64 * args.count,
    });
    let delivered = AtomicU64::new(0);
    let bar = progress(
        duration
            .is_none()
            .then(|| args.pubs as u64 * args.count * copies),
        args.json,
    );
    let payload = Bytes::from(vec![0x5a; args.size]);

    // Subscribers first, each on its own thread and handle.
    let mut subscriptions = Vec::new();
    let mut keep = Vec::new();
    for _ in 0..args.subs {
        let sub = match (&target.endpoint, target.subscribing_broker()) {
            (None, Some(broker)) => if args.queue {
                broker.queue_subscribe(&subject, "bench")
            } else {
                broker.subscribe(&subject)
            }
            .map_err(bench_error)?,
            _ => {
                let handle = target.handle()?;
                let sub = if args.queue {
                    handle.queue_subscribe(&subject, "bench")
                } else {
                    handle.subscribe(&subject)
                }
                .map_err(bench_error)?;
                handle.flush(Duration::from_secs(10)).map_err(bench_error)?;
                keep.push(handle);
                sub
            }
        };
        subscriptions.push(sub);
    }
    target.await_route_interest(1)?;
    let own_handles: Vec<Option<Arc<dyn PubSub>>> = (0..args.pubs)
        .map(|_| match target.endpoint {
            Some(_) => target.handle().map(Some),
            None => Ok(None),
        })
        .collect::<Result<_, _>>()?;

    let publishers: Vec<&dyn PubSub> = own_handles
        .iter()
        .map(|publisher| target.through(publisher))
        .collect::<Result<_, _>>()?;
    if args.warmup > 0 {
        warm_up(args, &subject, &payload, &publishers, &subscriptions, &stop)?;
    }
    let started = Instant::now();
    let done_at = parking_lot::Mutex::new(started);
    let published = std::thread::scope(|scope| -> Result<u64, Failure> {
        let mut readers = Vec::new();
        for sub in &subscriptions {
            let (goal, delivered, done_at, bar) = (&goal, &delivered, &done_at, &bar);
            let reader = std::thread::Builder::new().spawn_scoped(scope, move || {
                let mut local = 0u64;
                // Each reader counts for itself and adds to the shared count
                // now and then (a shared counter bumped by every reader for
                // every message costs more than receiving it); a queue group
                // needs the shared count per batch to know when to stop.
                let mut unshared = 0u64;
                let share_every = if args.queue { 1 } else { 4096 };
                let mut goal_now = goal.load(Ordering::Acquire);
                // When this reader last received a message, taken once per
                // burst (when the queue runs empty) and at the end: the run
                // ends with the last delivery, not when readers notice.
                let mut last_receipt = None;
                let mut receipt_unmarked = false;
                // A reader waits in short slices, so as to notice a goal
                // fixed or reached elsewhere, and gives up after IDLE_LIMIT.
                let mut idle = Duration::ZERO;
                let mut batch = Vec::with_capacity(RECV_BATCH);
                loop {
                    let reached = if args.queue {
                        delivered.load(Ordering::Relaxed) >= goal_now
                    } else {
                        local >= goal_now
                    };
                    if reached {
                        break;
                    }
                    // What is already queued is taken without a timed
                    // wait (which reads the clock on every call).
                    let next = match sub.recv_many(&mut batch, RECV_BATCH, Duration::ZERO) {
                        Err(RecvError::Empty) => {
                            if std::mem::take(&mut receipt_unmarked) {
                                last_receipt = Some(Instant::now());
                            }
                            let fresh = goal.load(Ordering::Acquire);
                            if fresh != goal_now {
                                goal_now = fresh;
                                continue;
                            }
                            sub.recv_many(&mut batch, RECV_BATCH, WAIT_SLICE)
                        }
                        other => other,
                    };
                    match next {
                        Ok(received) => {
                            batch.clear();
                            idle = Duration::ZERO;
                            receipt_unmarked = true;
                            local += received as u64;
                            unshared += received as u64;
                            if unshared >= share_every {
                                let total = delivered.fetch_add(unshared, Ordering::Relaxed);
                                if total / 65_536 != (total + unshared) / 65_536 {
                                    bar.set_position(total + unshared);
                                }
                                unshared = 0;
                            }
                        }
                        Err(RecvError::Timeout | RecvError::Empty) => {
                            idle += WAIT_SLICE;
                            if idle >= IDLE_LIMIT {
                                break;
                            }
                        }
                        Err(RecvError::Closed) => break,
                    }
                }
                if receipt_unmarked {
                    last_receipt = Some(Instant::now());
                }
                if let Some(at) = last_receipt {
                    let mut done = done_at.lock();
                    *done = (*done).max(at);
                }
                delivered.fetch_add(unshared, Ordering::Relaxed);
            });
            readers.push(reader.map_err(|err| thread_failure("subscriber", "--subs", &err))?);
        }
        let deadline = duration.map(|d| started + d);
        let mut writers = Vec::new();
        for &handle in &publishers {
            let payload = payload.clone();
            let subject = subject.as_str();
            let stop = &*stop;
            let writer =
                std::thread::Builder::new().spawn_scoped(scope, move || -> Result<u64, Error> {
                    let mut sent = 0;
                    match deadline {
                        None => {
                            while sent < args.count && !stop.load(Ordering::Relaxed) {
                                let burst = STOP_CHECK_EVERY.min(args.count - sent);
                                for _ in 0..burst {
                                    handle.publish(subject, payload.clone())?;
                                }
                                sent += burst;
                            }
                        }
                        Some(deadline) => {
                            let per_clock_read =
                                (BYTES_PER_CLOCK_READ / args.size.max(1)).clamp(1, 256);
                            while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                                for _ in 0..per_clock_read {
                                    handle.publish(subject, payload.clone())?;
                                }
                                sent += per_clock_read as u64;
                            }
                        }
                    }
                    handle.flush(Duration::from_secs(60))?;
                    Ok(sent)
                });
            writers.push(writer.map_err(|err| thread_failure("publisher", "--pubs", &err))?);
        }
        let mut published = 0;
        let mut failure = None;
        for writer in writers {
            match writer.join() {
                Ok(Ok(sent)) => published += sent,
                Ok(Err(err)) => failure = failure.or(Some(bench_error(err))),
                Err(_) => failure = failure.or(Some(Failure::runtime("publisher thread panicked"))),
            }
        }
        // The readers stop at this goal (a failed publisher's readers give
        // up after IDLE_LIMIT instead).
        goal.store(published, Ordering::Release);
        for reader in readers {
            reader
                .join()
                .map_err(|_| Failure::runtime("subscriber thread panicked"))?;
        }
        failure.map_or(Ok(published), Err)
    })?;
    bar.finish_and_clear();
    let seconds = done_at
        .lock()
        .duration_since(started)
        .as_secs_f64()
        .max(1e-9);
    let delivered = delivered.load(Ordering::Relaxed);
    let expected = published * copies;
    let report = ThroughputReport {
        mode: "throughput",
        target: target.description.clone(),
        publishers: args.pubs,
        subscribers: args.subs,
        queue_group: args.queue,
        payload_bytes: args.size,
        link: target.link.lock().clone(),
        published,
        delivered,
        expected,
        seconds,
        published_per_sec: published as f64 / seconds,
        delivered_per_sec: delivered as f64 / seconds,
        delivered_mb_per_sec: delivered as f64 * args.size as f64 / seconds / 1e6,
    };
    let mut out = crate::cli::Output::new();
    if args.json {
        out.line(format_args!(
            "{}",
            serde_json::to_string(&report).unwrap_or_default()
        ))?;
    } else {
        out.line(format_args!(
            "{}{}: {} pub -> {} sub{}, {} B: {:.0} msg/s delivered ({:.1} MB/s), {} of {} in {:.3} s",
            report.target,
            link_note(&report.link),
            report.publishers,
            report.subscribers,
            if report.queue_group {
                " (queue group)"
            } else {
                ""
            },
            report.payload_bytes,
            report.delivered_per_sec,
            report.delivered_mb_per_sec,
            report.delivered,
            report.expected,
            report.seconds
        ))?;
    }
    if stop.load(Ordering::Relaxed) {
        return Err(Failure {
            message: format!(
                "interrupted: {published} messages published{}, {delivered} of {expected} delivered",
                match duration {
                    None => format!(" of {}", args.pubs as u64 * args.count),
                    Some(_) => String::new(),
                }
            ),
            code: 130,
        });
    }
    if delivered < expected {
        return Err(Failure::runtime(format!(
            "only {delivered} of {expected} messages arrived (dropped by a slow-consumer policy?)"
        )));
    }
    Ok(())
}

/// What the warm-up keeps in flight, in bytes of payload and framing: well
/// under what a server queues for a subscriber (`max_pending_bytes`,
/// 16 MiB by default and rarely below 64 KiB), so that a server dropping
/// for slow consumers drops none of it.
const WARMUP_IN_FLIGHT: u64 = 32 * 1024;
/// But never fewer messages than this: large ones then still travel
/// several at once, as the measured run's do, and the warm-up fills the
/// fabric's concurrent rendezvous reads and their landing buffers.
const WARMUP_MIN_IN_FLIGHT: u64 = 8;

/// Publishes `args.warmup` messages from each publisher and waits until
/// the subscribers have received all of them (one copy per message in a
/// queue group, one per subscriber otherwise). The subscriptions are
/// drained while the warm-up is published: a warm-up larger than what a
/// subscription queues would otherwise leave the publisher waiting for
/// room and the subscriber for a reader, until the server gives one up.
/// And the publishers keep at most [`WARMUP_IN_FLIGHT`] ahead of the
/// subscribers (at least [`WARMUP_MIN_IN_FLIGHT`] messages): published at
/// full speed, a warm-up outran a subscriber on a loaded machine and the
/// server's default policy dropped some of it.
fn warm_up(
    args: &BenchArgs,
    subject: &str,
    payload: &Bytes,
    publishers: &[&dyn PubSub],
    subscriptions: &[Subscription],
    stop: &AtomicBool,
) -> Result<(), Failure> {
    const WARMUP_LIMIT: Duration = Duration::from_secs(60);
    let copies = if args.queue {
        1
    } else {
        subscriptions.len() as u64
    };
    let expected = args.warmup * publishers.len() as u64 * copies;
    let deadline = Instant::now() + WARMUP_LIMIT;
    let ahead = (WARMUP_IN_FLIGHT / (payload.len() as u64 + 64)).max(WARMUP_MIN_IN_FLIGHT) * copies;
    let arrived = AtomicU64::new(0);
    let mut bar = WarmUpBar::new(expected, "arrived", args.json);
    std::thread::scope(|scope| {
        let mut publishing = Some(scope.spawn(|| -> Result<(), Failure> {
            let mut sent = 0;
            for publisher in publishers {
                for _ in 0..args.warmup {
                    if stop.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    // Past the deadline the reader reports what is missing.
                    while sent >= arrived.load(Ordering::Relaxed) + ahead
                        && Instant::now() <= deadline
                    {
                        std::thread::yield_now();
                    }
                    publisher
                        .publish(subject, payload.clone())
                        .map_err(bench_error)?;
                    sent += copies;
                }
                publisher.flush(WARMUP_LIMIT).map_err(bench_error)?;
            }
            Ok(())
        }));
        let mut received = 0;
        loop {
            for sub in subscriptions {
                while sub.try_recv().is_ok() {
                    received += 1;
                }
            }
            arrived.store(received, Ordering::Relaxed);
            bar.update(received);
            // A publisher's error ends the warm-up as soon as it is known.
            if let Some(handle) = publishing.take_if(|handle| handle.is_finished()) {
                handle
                    .join()
                    .map_err(|_| Failure::runtime("the warm-up publisher panicked"))??;
            }
            if received >= expected && publishing.is_none() {
                return Ok(());
            }
            if stop.load(Ordering::Relaxed) {
                return Err(interrupted_in_warm_up(received, expected));
            }
            if Instant::now() > deadline {
                return Err(Failure::runtime(format!(
                    "only {received} of {expected} warm-up messages arrived in {WARMUP_LIMIT:?}"
                )));
            }
            std::thread::yield_now();
        }
    })
}

/// Ctrl-C during a warm-up: nothing was measured yet.
fn interrupted_in_warm_up(done: u64, of: u64) -> Failure {
    Failure {
        message: format!("interrupted in the warm-up, {done} of {of} done: nothing measured"),
        code: 130,
    }
}

fn latency(args: &BenchArgs, target: &Target) -> Result<(), Failure> {
    let subject = format!("bench.rpc.{}", std::process::id());
    let payload = Bytes::from(vec![0x5a; args.size]);
    let responder_client = match target.endpoint {
        Some(_) => Some(target.client()?),
        None => None,
    };
    let responder_ref: &dyn PubSub = match (&responder_client, &target.far, &target.broker) {
        (Some(client), ..) => client,
        (None, Some(far), _) => far,
        (None, None, Some(broker)) => broker,
        (None, None, None) => return Err(Failure::runtime("no target")),
    };
    // An inline responder answers on the thread that delivers each request:
    // a client's loop against a server, the far broker's loop across a
    // route, the requesting thread in process.
    let echo = |request: &efabus_broker::Message| Some(request.payload.clone());
    let inline = if args.inline {
        let responder = match (&responder_client, &target.far, &target.broker) {
            (Some(client), ..) => client.respond(&subject, echo),
            (None, Some(far), _) => far.respond(&subject, echo),
            (None, None, Some(broker)) => broker.respond(&subject, echo),
            (None, None, None) => return Err(Failure::runtime("no target")),
        };
        Some(responder.map_err(bench_error)?)
    } else {
        None
    };
    let requests = match inline {
        None => Some(responder_ref.subscribe(&subject).map_err(bench_error)?),
        Some(_) => None,
    };
    responder_ref
        .flush(Duration::from_secs(10))
        .map_err(bench_error)?;
    target.await_route_interest(1)?;
    // Ctrl-C ends the round trips; those measured are reported.
    let stop = crate::cli::stop_on_signals()?;
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)
        .map_err(|err| Failure::runtime(err.to_string()))?;
    let duration = args.duration.map(Duration::from_secs_f64);
    let bar = progress(duration.is_none().then_some(args.count), args.json);
    let mut started = Instant::now();
    let mut elapsed = Duration::ZERO;
    std::thread::scope(|scope| -> Result<(), Failure> {
        let echo = scope.spawn(|| {
            for request in requests.into_iter().flatten() {
                // A request without reply subject is the signal to stop.
                let Some(reply) = request.reply else { break };
                if responder_ref.publish(&reply, request.payload).is_err() {
                    break;
                }
            }
        });
        let result = with_handle(target, |requester| {
            let mut warm_up = WarmUpBar::new(args.warmup, "round trips", args.json);
            for done in 0..args.warmup {
                if stop.load(Ordering::Relaxed) {
                    return Err(interrupted_in_warm_up(done, args.warmup));
                }
                requester
                    .request(&subject, payload.clone(), Duration::from_secs(10))
                    .map_err(bench_error)?;
                warm_up.update(done + 1);
            }
            drop(warm_up);
            started = Instant::now();
            let deadline = duration.map(|d| started + d);
            let rounds = if deadline.is_some() {
                u64::MAX
            } else {
                args.count
            };
            for i in 0..rounds {
                if deadline.is_some_and(|at| Instant::now() >= at) || stop.load(Ordering::Relaxed) {
                    break;
                }
                let sent = Instant::now();
                requester
                    .request(&subject, payload.clone(), Duration::from_secs(10))
                    .map_err(bench_error)?;
                let nanos = sent.elapsed().as_nanos() as u64;
                let _ = histogram.record(nanos.max(1));
                if i % 1024 == 0 {
                    bar.set_position(i);
                }
            }
            elapsed = started.elapsed();
            Ok(())
        });
        // Ends the responder's iteration (an inline responder answers
        // nothing without a reply subject).
        let _ = responder_ref.publish(&subject, Bytes::new());
        let _ = echo.join();
        result
    })?;
    bar.finish_and_clear();
    let us = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
    let report = LatencyReport {
        mode: "latency",
        target: target.description.clone(),
        payload_bytes: args.size,
        link: target.link.lock().clone(),
        responder: if inline.is_some() { "inline" } else { "thread" },
        round_trips: histogram.len(),
        seconds: elapsed.as_secs_f64(),
        p50_us: us(0.5),
        p90_us: us(0.9),
        p99_us: us(0.99),
        p999_us: us(0.999),
        max_us: histogram.max() as f64 / 1000.0,
    };
    let mut out = crate::cli::Output::new();
    if args.json {
        out.line(format_args!(
            "{}",
            serde_json::to_string(&report).unwrap_or_default()
        ))?;
    } else {
        out.line(format_args!(
            "{}{}: {} round trips of {} B: p50 {:.1} us, p90 {:.1} us, p99 {:.1} us, p99.9 {:.1} us, max {:.1} us",
            report.target,
            link_note(&report.link),
            report.round_trips,
            report.payload_bytes,
            report.p50_us,
            report.p90_us,
            report.p99_us,
            report.p999_us,
            report.max_us
        ))?;
    }
    if stop.load(Ordering::Relaxed) {
        return Err(Failure {
            message: format!(
                "interrupted after {} round trips{}",
                report.round_trips,
                match duration {
                    None => format!(" of {}", args.count),
                    Some(_) => String::new(),
                }
            ),
            code: 130,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warm_up_bar_is_drawn_only_once_the_warm_up_runs_long() {
        let mut bar = WarmUpBar::new(100, "arrived", false);
        bar.update(1);
        assert!(!bar.shown, "a short warm-up draws nothing");
        bar.started -= WARM_UP_BAR_AFTER;
        bar.update(2);
        assert!(bar.shown);
        assert_eq!(bar.bar.position(), 2);

        let mut quiet = WarmUpBar::new(100, "arrived", true);
        quiet.started -= WARM_UP_BAR_AFTER;
        quiet.update(2);
        assert!(!quiet.shown, "--json prints the report alone");
    }
}
