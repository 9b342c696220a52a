//! The broker: the embedded [`Broker`] handle and the event loop that owns
//! the listening endpoints and one session per connected peer.
//!
//! Threads: in-process publishers route on their own thread through the
//! shared [`Router`]; the event loop thread owns every endpoint and session,
//! decodes frames, answers the handshake, applies subscriptions and
//! delivers to remote peers. Publishes are read in place; the deliveries a
//! loop round produces for one peer are encoded back to back into that
//! peer's batch and handed to its endpoint as one run at the end of the
//! round (payloads over 1 KiB travel shared behind their own head). Deliveries from in-process publishers to
//! remote peers reach the loop through a bounded command queue.

use std::collections::VecDeque;

// Session and peer maps are keyed by small integers the broker assigns:
// a fast non-keyed hash is safe there and cheaper than SipHash.
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use crossbeam_channel::{Receiver, Sender};
use efabus_core::caps::{negotiate, Offer};
use efabus_core::codec::{self, CodecLimits, FrameKind};
use efabus_core::frame::{
    self, DeliveryClass, ErrorCode, ErrorFrame, Frame, Goodbye, Welcome, PROTOCOL_VERSION,
};
use efabus_core::link::LinkTuning;
use efabus_core::subject::{self, SubjectLimits};
use efabus_core::transport::{
    CloseReason, Endpoint, Event, OutFrame, PeerId, Readiness, SendError, TransportError,
};
use efabus_transports::registry::{EndpointSpec, Registry, RegistryError};
use mio::unix::SourceFd;
use mio::{Interest, Poll, Token, Waker};
use parking_lot::{Mutex, RwLock};
use tracing::{debug, info, warn};

use crate::config::{Config, SlowConsumerPolicy};
use crate::datapath::{DataLink, Sent};
use crate::delivery::{Delivery, LocalSink, Message, Subscription, Unsubscriber};
use crate::endpoints::{self, listener_config, with_faults};
use crate::error::Error;
use crate::inbox::LoopInbox;
use crate::router::{Router, SubRef, Targets, LOCAL_OWNER};

mod cluster;
use cluster::{Cluster, RouteRole};

const WAKER: Token = Token(0);
/// Commands queued from in-process publishers to the loop before they wait.
const COMMAND_QUEUE: usize = 65_536;
/// Payloads up to this size are copied into a peer's batch of deliveries;
/// larger ones travel as their own part, shared rather than copied.
const COPY_MAX: usize = 1 << 10;
/// Largest buffer a batch of deliveries is encoded into; a batch is handed
/// on when its buffer is full, and at the end of every loop round.
const RUN_MAX: usize = 64 << 10;
/// Smallest buffer a batch starts with.
const RUN_MIN: usize = 1 << 10;

/// Counters of a running broker.
#[derive(Debug, Default)]
pub struct BrokerStats {
    pub connections: AtomicU64,
    pub connections_total: AtomicU64,
    pub messages_in: AtomicU64,
    pub messages_out: AtomicU64,
    pub bytes_in: AtomicU64,
    pub slow_consumer_drops: AtomicU64,
    pub slow_consumer_disconnects: AtomicU64,
    pub bad_frames: AtomicU64,
    pub auth_failures: AtomicU64,
    pub refused_connections: AtomicU64,
    /// Bytes queued towards remote peers by the broker, right now.
    pub queued_bytes: AtomicU64,
    /// Frames received and sent over negotiated fabric data links.
    pub fabric_frames_in: AtomicU64,
    pub fabric_frames_out: AtomicU64,
    /// Best-effort messages the datagram link could not take.
    pub best_effort_drops: AtomicU64,
    /// Sends to data links that found the peer's credit window full (the
    /// frame waited, or on a datagram link was dropped and counted in
    /// `best_effort_drops`).
    pub credit_waits: AtomicU64,
    /// Routes to other brokers that are up, right now.
    pub routes: AtomicU64,
    /// Messages received from and forwarded to other brokers over routes.
    pub route_messages_in: AtomicU64,
    pub route_messages_out: AtomicU64,
}

impl BrokerStats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// A plain snapshot for printing.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("connections", get(&self.connections)),
            ("connections_total", get(&self.connections_total)),
            ("messages_in", get(&self.messages_in)),
            ("messages_out", get(&self.messages_out)),
            ("bytes_in", get(&self.bytes_in)),
            ("slow_consumer_drops", get(&self.slow_consumer_drops)),
            (
                "slow_consumer_disconnects",
                get(&self.slow_consumer_disconnects),
            ),
            ("bad_frames", get(&self.bad_frames)),
            ("auth_failures", get(&self.auth_failures)),
            ("refused_connections", get(&self.refused_connections)),
            ("queued_bytes", get(&self.queued_bytes)),
            ("fabric_frames_in", get(&self.fabric_frames_in)),
            ("fabric_frames_out", get(&self.fabric_frames_out)),
            ("best_effort_drops", get(&self.best_effort_drops)),
            ("credit_waits", get(&self.credit_waits)),
            ("routes", get(&self.routes)),
            ("route_messages_in", get(&self.route_messages_in)),
            ("route_messages_out", get(&self.route_messages_out)),
        ]
    }
}

/// Work handed to the event loop by other threads.
enum Command {
    /// Deliver a message published in-process to remote subscribers.
    Deliver {
        targets: Vec<SubRef>,
        message: Message,
    },
    /// Answer once everything queued before it has been handed to the endpoints.
    Flush(Sender<()>),
    /// Route to one more broker (an endpoint string, checked).
    AddPeer(String),
}

pub(crate) struct Shared {
    config: Config,
    subject_limits: SubjectLimits,
    router: RwLock<Router>,
    /// The router's generation, read without its lock (see [`LastRoute`]).
    generation: Arc<AtomicU64>,
    next_sid: AtomicU64,
    inbox: LoopInbox<Command>,
    shutdown: AtomicBool,
    stats: BrokerStats,
    inbox_prefix: String,
    listening: Vec<(String, String)>,
    /// This broker process among route peers (random per start).
    broker_id: u64,
    /// Whether an endpoint exists to dial routes from.
    can_dial: bool,
}

impl Shared {
    /// Wake the loop when a subscription change is to be announced to
    /// route peers (the loop sends announcements before anything else).
    fn announce(&self, router: &Router) {
        if router.interest_changed() {
            self.inbox.wake();
        }
    }

    fn send_command(&self, command: Command) -> Result<(), Error> {
        if self.shutdown.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        self.inbox.send(command, self.config.block_timeout())
    }
}

impl Unsubscriber for Shared {
    fn unsubscribe(&self, sid: u64) {
        let mut router = self.router.write();
        router.remove(SubRef {
            owner: LOCAL_OWNER,
            sid,
        });
        self.announce(&router);
    }
}

thread_local! {
    static ROUTES: std::cell::RefCell<KeptRoutes> = const { std::cell::RefCell::new(KeptRoutes::EMPTY) };
}

/// Routes a thread keeps, for the subjects it published on last.
const KEPT_ROUTES: usize = 4;

/// The routes a thread last published on. While the router's generation is
/// unchanged, publishing again on one of these subjects takes no lock and
/// looks nothing up, and the subject string is shared rather than
/// allocated.
struct KeptRoutes {
    routes: [LastRoute; KEPT_ROUTES],
    /// The route used last, looked at first.
    last: usize,
    /// The route to replace next when none is stale.
    victim: usize,
}

impl KeptRoutes {
    const EMPTY: KeptRoutes = KeptRoutes {
        routes: [LastRoute::EMPTY; KEPT_ROUTES],
        last: 0,
        victim: 0,
    };

    #[inline(always)]
    fn publish(
        &mut self,
        shared: &Shared,
        generation: u64,
        subject: &str,
        reply: Option<Arc<str>>,
        payload: Bytes,
    ) -> Result<usize, Error> {
        let last = self.last % KEPT_ROUTES;
        let index = if self.routes[last].serves(generation, subject) {
            last
        } else {
            self.find(shared, generation, subject)?
        };
        let route = &self.routes[index];
        match &route.subject {
            Some(kept) => deliver_route(shared, kept, &route.targets, reply, payload),
            None => Ok(0),
        }
    }

    /// The index of a route for `subject`, routing it afresh if no kept one
    /// serves.
    #[cold]
    #[inline(never)]
    fn find(&mut self, shared: &Shared, generation: u64, subject: &str) -> Result<usize, Error> {
        let index = match (0..KEPT_ROUTES).find(|&i| self.routes[i].serves(generation, subject)) {
            Some(index) => index,
            None => {
                let index =
                    match (0..KEPT_ROUTES).find(|&i| self.routes[i].generation != generation) {
                        Some(stale) => stale,
                        None => {
                            self.victim = (self.victim + 1) % KEPT_ROUTES;
                            self.victim
                        }
                    };
                self.routes[index].refresh(shared, subject)?;
                index
            }
        };
        self.last = index;
        Ok(index)
    }
}

/// A route kept by a publishing thread.
struct LastRoute {
    /// The router generation `targets` was computed at; 0 when they may not
    /// be reused (generations start at 1).
    generation: u64,
    subject: Option<Arc<str>>,
    targets: Targets,
}

impl LastRoute {
    const EMPTY: LastRoute = LastRoute {
        generation: 0,
        subject: None,
        targets: Targets::new(),
    };

    /// Whether this route is current and for `subject`.
    #[inline(always)]
    fn serves(&self, generation: u64, subject: &str) -> bool {
        self.generation == generation && self.subject.as_deref().is_some_and(|kept| kept == subject)
    }

    /// Route `subject` afresh under the read lock. A route with a queue
    /// group is used for this message only (its member is picked per
    /// message), and so is not kept.
    fn refresh(&mut self, shared: &Shared, subject: &str) -> Result<(), Error> {
        self.generation = 0;
        let router = shared.router.read();
        // Read under the lock: no change can happen before routing below.
        let generation = shared.generation.load(Ordering::Acquire);
        let stable = router
            .route_stable(subject, &mut self.targets)
            .map_err(|source| Error::Subject {
                subject: subject.to_string(),
                source,
            })?;
        drop(router);
        if self.subject.as_deref() != Some(subject) {
            self.subject = Some(Arc::from(subject));
        }
        if stable {
            self.generation = generation;
        }
        Ok(())
    }
}

/// An embedded broker. Cheap to share: all methods take `&self`, and the
/// handle is `Send + Sync`. Dropping it shuts the broker down.
pub struct Broker {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("name", &self.shared.config.name)
            .field("listening", &self.shared.listening)
            .finish()
    }
}

impl Broker {
    /// Start a broker with the built-in transports.
    pub fn start(config: Config) -> Result<Broker, Error> {
        Broker::start_with_registry(config, Registry::with_builtins())
    }

    /// Start a broker whose endpoint strings may also name transports an
    /// application registered itself.
    pub fn start_with_registry(config: Config, registry: Registry) -> Result<Broker, Error> {
        config.validate("(given)")?;
        config.check_schemes("(given)", &registry.schemes())?;
        let poll = Poll::new().map_err(Error::Thread)?;
        let waker = Waker::new(poll.registry(), WAKER).map_err(Error::Thread)?;
        let codec_limits = CodecLimits {
            max_frame: config.max_frame(),
            max_subject_len: config.limits.max_subject_len,
        };
        let mut endpoints = Vec::new();
        let mut listening = Vec::new();
        let mut unavailable = None;
        for text in &config.listen {
            let spec = EndpointSpec::parse(text).map_err(|err| Error::Endpoint {
                endpoint: text.clone(),
                source: err.into(),
            })?;
            let bind = Some(spec.address().unwrap_or_default().to_string());
            let endpoint_config = listener_config(&config, spec.scheme(), bind);
            let endpoint = match registry.open(&spec, &endpoint_config) {
                Ok(endpoint) => endpoint,
                // A fabric this host lacks (no EFA device, no provider)
                // leaves its peers on TCP, as negotiation would.
                Err(
                    source @ RegistryError::Transport {
                        source: TransportError::Unavailable { .. },
                        ..
                    },
                ) if endpoints::is_data_scheme(spec.scheme()) => {
                    warn!(endpoint = %text, reason = %source, "fabric unavailable; peers use the TCP data path");
                    unavailable = Some(Error::Endpoint {
                        endpoint: text.clone(),
                        source,
                    });
                    continue;
                }
                Err(source) => {
                    return Err(Error::Endpoint {
                        endpoint: text.clone(),
                        source,
                    })
                }
            };
            let endpoint = with_faults(endpoint, config.testing.faults.as_ref(), endpoints.len());
            // Socket addresses are text; fabric addresses are raw bytes.
            let local = if endpoints::is_data_scheme(spec.scheme()) {
                efabus_transports::fabric::addr_to_hex(&endpoint.local_addr())
            } else {
                String::from_utf8_lossy(&endpoint.local_addr()).into_owned()
            };
            info!(endpoint = %text, address = %local, "listening");
            listening.push((spec.scheme().to_string(), local));
            let token = Token(endpoints.len() + 1);
            if let Some(fd) = endpoint.readiness().fd() {
                poll.registry()
                    .register(&mut SourceFd(&fd), token, Interest::READABLE)
                    .map_err(Error::Thread)?;
            }
            endpoints.push(endpoint);
        }
        if let (true, Some(err)) = (endpoints.is_empty(), unavailable) {
            // Nothing else to fall back to.
            return Err(err);
        }
        // Routes are dialed from a TCP listener, or from an endpoint that
        // only connects out when there is none.
        let mut dialer = endpoints.iter().position(|e| e.scheme() == "tcp");
        if dialer.is_none() && !config.peers.is_empty() {
            let spec = EndpointSpec::parse("tcp").map_err(|err| Error::Endpoint {
                endpoint: "tcp".into(),
                source: err.into(),
            })?;
            let endpoint_config = listener_config(&config, spec.scheme(), None);
            let endpoint =
                registry
                    .open(&spec, &endpoint_config)
                    .map_err(|source| Error::Endpoint {
                        endpoint: "tcp (for peers)".into(),
                        source,
                    })?;
            if let Readiness::Fd(fd) = endpoint.readiness() {
                poll.registry()
                    .register(
                        &mut SourceFd(&fd),
                        Token(endpoints.len() + 1),
                        Interest::READABLE,
                    )
                    .map_err(Error::Thread)?;
            }
            dialer = Some(endpoints.len());
            endpoints.push(endpoint);
        }
        let (inbox, command_rx) = LoopInbox::new(waker, COMMAND_QUEUE);
        let subject_limits = SubjectLimits {
            max_len: config.limits.max_subject_len,
            max_tokens: config.limits.max_subject_tokens,
        };
        let router = Router::new(subject_limits);
        let shared = Arc::new(Shared {
            subject_limits,
            config,
            generation: router.generation(),
            router: RwLock::new(router),
            next_sid: AtomicU64::new(1),
            inbox,
            shutdown: AtomicBool::new(false),
            stats: BrokerStats::default(),
            inbox_prefix: format!("_INBOX.{:016x}", unique_seed()),
            listening,
            broker_id: unique_seed(),
            can_dial: dialer.is_some(),
        });
        let cluster = Cluster::new(&shared, dialer);
        let event_loop = EventLoop::new(
            shared.clone(),
            poll,
            endpoints,
            command_rx,
            codec_limits,
            cluster,
        );
        let thread = std::thread::Builder::new()
            .name("efabus-broker".into())
            .spawn(move || event_loop.run())
            .map_err(Error::Thread)?;
        Ok(Broker {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// `(scheme, address)` of each listening endpoint, with actual ports.
    pub fn listening(&self) -> &[(String, String)] {
        &self.shared.listening
    }

    /// The address of the first listener of a scheme (e.g. the TCP port
    /// chosen when the config said port 0), as an endpoint string.
    pub fn endpoint(&self, scheme: &str) -> Option<String> {
        self.shared
            .listening
            .iter()
            .find(|(s, _)| s == scheme)
            .map(|(s, addr)| format!("{s}/{addr}"))
    }

    pub fn config(&self) -> &Config {
        &self.shared.config
    }

    pub fn stats(&self) -> &BrokerStats {
        &self.shared.stats
    }

    /// Number of subscriptions, local and remote.
    pub fn subscription_count(&self) -> usize {
        self.shared.router.read().len()
    }

    /// This broker process's id among route peers (random per start).
    pub fn broker_id(&self) -> u64 {
        self.shared.broker_id
    }

    /// Number of interest entries (distinct pattern and queue group pairs)
    /// that route peers announced to this broker, over all routes.
    pub fn route_interest_count(&self) -> usize {
        self.shared.router.read().route_interest_len()
    }

    /// Route to one more broker, as if its endpoint string (`tcp/HOST:PORT`)
    /// were listed in `peers`: connect to it and keep reconnecting. Needs a
    /// TCP endpoint to dial from (a `tcp` listener, or `peers` configured).
    pub fn add_peer(&self, endpoint: &str) -> Result<(), Error> {
        let invalid = |message: String| {
            Error::Config(crate::config::ConfigError::Invalid {
                origin: "add_peer".to_string(),
                line: None,
                key: "peers".to_string(),
                message,
            })
        };
        crate::config::check_peer(endpoint).map_err(invalid)?;
        if !self.shared.can_dial {
            return Err(invalid(
                "this broker has no tcp endpoint to dial routes from: listen on tcp".to_string(),
            ));
        }
        self.shared
            .send_command(Command::AddPeer(endpoint.to_string()))
    }

    /// Publish a message. In-process subscribers receive the same payload
    /// buffer, not a copy.
    pub fn publish(&self, subject: &str, payload: impl Into<Bytes>) -> Result<(), Error> {
        self.publish_inner(subject, None, payload.into())
            .map(|_| ())
    }

    /// Publish with a reply subject.
    pub fn publish_request(
        &self,
        subject: &str,
        reply: &str,
        payload: impl Into<Bytes>,
    ) -> Result<(), Error> {
        self.publish_inner(subject, Some(reply), payload.into())
            .map(|_| ())
    }

    fn publish_inner(
        &self,
        subject: &str,
        reply: Option<&str>,
        payload: Bytes,
    ) -> Result<usize, Error> {
        let shared = &self.shared;
        if shared.shutdown.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        if let Some(reply) = reply {
            subject::validate_subject(reply, &shared.subject_limits).map_err(|source| {
                Error::Subject {
                    subject: reply.to_string(),
                    source,
                }
            })?;
        }
        if payload.len() as u64 > shared.config.limits.max_payload {
            return Err(Error::PayloadTooLarge {
                len: payload.len(),
                max: shared.config.limits.max_payload,
            });
        }
        let reply = reply.map(Arc::from);
        let generation = shared.generation.load(Ordering::Acquire);
        ROUTES.with(|cell| match cell.try_borrow_mut() {
            Ok(mut routes) => routes.publish(shared, generation, subject, reply, payload),
            // Only a re-entrant publish (none exists today) would find the
            // cell taken; it routes with routes of its own.
            Err(_) => {
                let mut own = KeptRoutes::EMPTY;
                own.publish(shared, generation, subject, reply, payload)
            }
        })
    }

    /// Subscribe to a pattern (`*` one token, `>` the rest).
    pub fn subscribe(&self, pattern: &str) -> Result<Subscription, Error> {
        self.subscribe_inner(pattern, None)
    }

    /// Subscribe as a member of a queue group: each message matching the
    /// pattern goes to one member of the group.
    pub fn queue_subscribe(&self, pattern: &str, group: &str) -> Result<Subscription, Error> {
        self.subscribe_inner(pattern, Some(group))
    }

    fn subscribe_inner(&self, pattern: &str, queue: Option<&str>) -> Result<Subscription, Error> {
        let shared = &self.shared;
        if shared.shutdown.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        subject::validate_pattern(pattern, &shared.subject_limits).map_err(|source| {
            Error::Subject {
                subject: pattern.to_string(),
                source,
            }
        })?;
        let sid = shared.next_sid.fetch_add(1, Ordering::Relaxed);
        let (sink, rx, stats) = LocalSink::new(
            shared.config.limits.subscription_queue,
            shared.config.slow_consumer.policy,
            shared.config.block_timeout(),
        );
        shared
            .router
            .write()
            .insert(
                pattern,
                queue,
                SubRef {
                    owner: LOCAL_OWNER,
                    sid,
                },
                Some(Arc::new(sink)),
            )
            .map_err(|source| Error::Subscription {
                pattern: pattern.to_string(),
                source,
            })?;
        shared.announce(&shared.router.read());
        let owner: Arc<dyn Unsubscriber> = shared.clone();
        Ok(Subscription::new(
            sid,
            pattern.to_string(),
            queue.map(str::to_string),
            rx,
            stats,
            owner,
        ))
    }

    /// Send a request and wait for the first reply.
    pub fn request(
        &self,
        subject: &str,
        payload: impl Into<Bytes>,
        timeout: Duration,
    ) -> Result<Message, Error> {
        let n = self.shared.next_sid.fetch_add(1, Ordering::Relaxed);
        let inbox = format!("{}.{n}", self.shared.inbox_prefix);
        let replies = self.subscribe(&inbox)?;
        let matched = self.publish_inner(subject, Some(&inbox), payload.into())?;
        if matched == 0 {
            return Err(Error::NoResponders(subject.to_string()));
        }
        replies.recv_timeout(timeout).map_err(|err| match err {
            crate::RecvError::Closed => Error::Closed,
            _ => Error::Timeout(timeout),
        })
    }

    /// Wait until every message published so far has been handed to
    /// subscriber queues or to the transports.
    pub fn flush(&self, timeout: Duration) -> Result<(), Error> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.shared.send_command(Command::Flush(tx))?;
        rx.recv_timeout(timeout)
            .map_err(|_| Error::Timeout(timeout))
    }

    /// Stop accepting, flush what is queued (within the configured drain
    /// time), say goodbye to every peer and stop the loop.
    pub fn shutdown(&self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.inbox.wake();
        if let Some(thread) = self.thread.lock().take() {
            if thread.join().is_err() {
                warn!("broker event loop panicked");
            }
        }
        self.shared.router.write().close_locals();
    }

    /// Whether shutdown has begun.
    pub fn is_shut_down(&self) -> bool {
        self.shared.shutdown.load(Ordering::Relaxed)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Deliver a message published in-process along a route: to its local
/// subscriptions (the payload moves to the last one) and, through the event
/// loop, to remote peers. Returns how many subscriptions matched.
#[inline(always)]
fn deliver_route(
    shared: &Shared,
    subject: &Arc<str>,
    targets: &Targets,
    reply: Option<Arc<str>>,
    payload: Bytes,
) -> Result<usize, Error> {
    let stats = &shared.stats;
    if let ([(sid, sink)], true) = (targets.local.as_slice(), targets.remote.is_empty()) {
        // The common case: one in-process subscription.
        BrokerStats::add(&stats.messages_in, 1);
        match sink.deliver_kept(subject, reply, payload) {
            Delivery::Queued => BrokerStats::add(&stats.messages_out, 1),
            outcome => settle_one(shared, *sid, sink, outcome),
        }
        return Ok(1);
    }
    deliver_route_all(shared, subject, targets, reply, payload)
}

#[cold]
#[inline(never)]
fn settle_one(shared: &Shared, sid: u64, sink: &LocalSink, outcome: Delivery) {
    let mut closed = Vec::new();
    count_delivery(&shared.stats, sid, sink, outcome, &mut closed);
    if !closed.is_empty() {
        remove_closed(shared, closed);
    }
}

/// [`deliver_route`] for any number of targets.
#[inline(never)]
fn deliver_route_all(
    shared: &Shared,
    subject: &Arc<str>,
    targets: &Targets,
    reply: Option<Arc<str>>,
    mut payload: Bytes,
) -> Result<usize, Error> {
    let stats = &shared.stats;
    BrokerStats::add(&stats.messages_in, 1);
    let remote = !targets.remote.is_empty();
    let mut closed = Vec::new();
    if let Some(((last_sid, last), others)) = targets.local.split_last() {
        for (sid, sink) in others {
            let outcome = sink.deliver_kept(subject, reply.clone(), payload.clone());
            count_delivery(stats, *sid, sink, outcome, &mut closed);
        }
        let body = if remote {
            payload.clone()
        } else {
            std::mem::take(&mut payload)
        };
        let outcome = last.deliver_kept(subject, reply.clone(), body);
        count_delivery(stats, *last_sid, last, outcome, &mut closed);
    }
    if !closed.is_empty() {
        remove_closed(shared, closed);
    }
    if remote {
        shared.send_command(Command::Deliver {
            targets: targets.remote.clone(),
            message: Message {
                subject: subject.clone(),
                reply,
                payload,
            },
        })?;
    }
    Ok(targets.len())
}

/// Hand a message to the in-process subscriptions among `targets`, count
/// the outcome, and remove subscriptions that were cut off as slow consumers
/// so their readers see the end of the stream.
fn deliver_local(shared: &Shared, targets: &mut Targets, message: &Message) {
    let mut closed = Vec::new();
    for (sid, sink) in targets.local.drain(..) {
        let outcome = sink.deliver(message.clone());
        count_delivery(&shared.stats, sid, &sink, outcome, &mut closed);
    }
    if !closed.is_empty() {
        remove_closed(shared, closed);
    }
}

/// Count one delivery's outcome; a closed subscription is noted in `closed`
/// with whether this delivery's policy cut it off.
fn count_delivery(
    stats: &BrokerStats,
    sid: u64,
    sink: &LocalSink,
    outcome: Delivery,
    closed: &mut Vec<(u64, bool)>,
) {
    match outcome {
        Delivery::Queued => BrokerStats::add(&stats.messages_out, 1),
        Delivery::QueuedDroppingOldest(dropped) => {
            BrokerStats::add(&stats.messages_out, 1);
            BrokerStats::add(&stats.slow_consumer_drops, dropped);
        }
        Delivery::Dropped => BrokerStats::add(&stats.slow_consumer_drops, 1),
        Delivery::Closed => closed.push((sid, sink.is_cut_off())),
    }
}

/// Remove closed subscriptions from the router. Each one cut off by the
/// disconnect policy is counted once, by whoever removes it (a subscription
/// that was dropped, or a broker shutting down, is not a disconnect).
#[cold]
fn remove_closed(shared: &Shared, closed: Vec<(u64, bool)>) {
    let mut router = shared.router.write();
    for (sid, cut_off) in closed {
        let removed = router.remove(SubRef {
            owner: LOCAL_OWNER,
            sid,
        });
        if removed && cut_off {
            BrokerStats::add(&shared.stats.slow_consumer_disconnects, 1);
        }
    }
}

/// A per-process seed for inbox names, so two brokers' inboxes differ.
pub(crate) fn unique_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    hasher.write_u32(std::process::id());
    hasher.finish()
}

/// Compare two secrets in time independent of where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    diff == 0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SessionState {
    /// The handshake is under way: waiting for the peer's hello, or, on a
    /// route this broker dialed, for the peer's welcome.
    AwaitHello {
        deadline: Instant,
    },
    Ready,
    /// An error or goodbye was sent; close once it is flushed.
    Closing,
}

struct Queued {
    frame: OutFrame,
    /// Messages it holds (a run holds many): only messages may be
    /// discarded by the drop-oldest policy, and each discarded one counts.
    messages: usize,
    /// Several whole frames back to back (a closed batch), for `send_run`.
    run: bool,
}

struct Session {
    endpoint: usize,
    peer: PeerId,
    remote: String,
    name: String,
    state: SessionState,
    /// Subscription ids and how each wants its messages carried.
    subscriptions: HashMap<u64, DeliveryClass>,
    /// The negotiated reliable data path, when it is not the control link.
    reliable: Option<DataLink>,
    /// Whether the peer has started using `reliable`; until then frames
    /// to it still go over the control link.
    switched: bool,
    /// The negotiated datagram path for best-effort subscriptions.
    best_effort: Option<DataLink>,
    queue: VecDeque<Queued>,
    queued_bytes: usize,
    /// Deliveries encoded back to back since the last hand-off, newer than
    /// everything in `queue`; handed on at the end of the loop round.
    batch: BytesMut,
    batch_messages: usize,
    /// Size of the last batch, to size the next one's first allocation.
    batch_hint: usize,
    /// Since when the queue has been over its bound under the block policy.
    over_since: Option<Instant>,
    /// Disconnected as a slow consumer: its queue was dropped, and what is
    /// still routed to it before it is gone is dropped too.
    cut_off: bool,
    last_heard: Instant,
    last_ping: Instant,
    /// Set when the session is a route to another broker.
    route: Option<Box<RouteRole>>,
}

impl Session {
    fn new(
        endpoint: usize,
        peer: PeerId,
        remote: String,
        now: Instant,
        deadline: Instant,
    ) -> Session {
        Session {
            endpoint,
            peer,
            remote,
            name: String::new(),
            state: SessionState::AwaitHello { deadline },
            subscriptions: HashMap::default(),
            reliable: None,
            switched: false,
            best_effort: None,
            queue: VecDeque::new(),
            queued_bytes: 0,
            batch: BytesMut::new(),
            batch_messages: 0,
            batch_hint: RUN_MIN,
            over_since: None,
            cut_off: false,
            last_heard: now,
            last_ping: now,
            route: None,
        }
    }

    /// Whether the session is a route that completed its handshake.
    fn is_route(&self) -> bool {
        self.route.as_ref().is_some_and(|route| route.is_up())
    }
}

struct EventLoop {
    shared: Arc<Shared>,
    poll: Poll,
    endpoints: Vec<Box<dyn Endpoint>>,
    polling: Polled,
    sessions: HashMap<u64, Session>,
    by_peer: HashMap<(usize, PeerId), u64>,
    commands: Receiver<Command>,
    codec: CodecLimits,
    next_session: u64,
    flushes: Vec<Sender<()>>,
    /// Sessions whose queue is over its bound under the block policy: while
    /// any exist, reading from publishers is paused.
    blocking: HashSet<u64>,
    reads_paused: bool,
    targets: Targets,
    /// What this broker offers in handshakes, one per endpoint that
    /// describes itself.
    offers: Vec<Offer>,
    tuning: LinkTuning,
    /// Scratch space for frames released by the link layer.
    released: Vec<Bytes>,
    /// Sessions whose data links owe the peer a credit.
    credit_owed: HashSet<u64>,
    /// Sessions with deliveries in their batch.
    dirty: Vec<u64>,
    /// The time of this loop round, read once per round rather than per frame.
    now: Instant,
    /// Counters gathered during a round, added to the shared stats at its end.
    tally: Tally,
    /// The subject of the last publish, and a spare buffer for the next.
    known_subject: String,
    spare_subject: String,
    /// The message being delivered, encoded once for every peer's batch
    /// (valid while `encoded_valid`; reset for every message).
    encoded: BytesMut,
    encoded_valid: bool,
    /// Routes to other brokers: the peers to dial and the routes up.
    cluster: Cluster,
}

/// A payload being routed: its bytes, and the buffer they lie in, so a
/// shared slice is made only where one is needed (large payloads,
/// in-process subscribers) and small ones are copied without touching the
/// buffer's reference count.
#[derive(Clone, Copy)]
struct Payload<'a> {
    bytes: &'a [u8],
    frame: &'a Bytes,
    /// Where `bytes` start in `frame`.
    at: usize,
}

impl Payload<'_> {
    fn to_bytes(self) -> Bytes {
        self.frame.slice(self.at..self.at + self.bytes.len())
    }
}

/// Per-round counts of the busiest statistics (one atomic add per round
/// instead of one per message).
#[derive(Default)]
struct Tally {
    messages_in: u64,
    messages_out: u64,
    bytes_in: u64,
    route_messages_in: u64,
    route_messages_out: u64,
}

impl EventLoop {
    fn new(
        shared: Arc<Shared>,
        poll: Poll,
        endpoints: Vec<Box<dyn Endpoint>>,
        commands: Receiver<Command>,
        codec: CodecLimits,
        cluster: Cluster,
    ) -> EventLoop {
        let polling = Polled::of(endpoints.iter().map(|e| e.readiness()));
        // An endpoint opened only to dial routes offers nothing.
        let offers = endpoints
            .iter()
            .enumerate()
            .filter(|(index, _)| !cluster.dials_only(*index))
            .filter_map(|(_, endpoint)| endpoints::offer_for(endpoint.as_ref()))
            .collect();
        EventLoop {
            shared,
            poll,
            endpoints,
            polling,
            sessions: HashMap::default(),
            by_peer: HashMap::default(),
            commands,
            codec,
            next_session: 1,
            flushes: Vec::new(),
            blocking: HashSet::default(),
            reads_paused: false,
            targets: Targets::default(),
            offers,
            tuning: LinkTuning::default(),
            released: Vec::new(),
            credit_owed: HashSet::default(),
            dirty: Vec::new(),
            now: Instant::now(),
            tally: Tally::default(),
            known_subject: String::new(),
            spare_subject: String::new(),
            encoded: BytesMut::new(),
            encoded_valid: false,
            cluster,
        }
    }

    fn run(mut self) {
        let mut mio_events = mio::Events::with_capacity(256);
        let mut events = Vec::with_capacity(256);
        let mut idle_spins = 0u32;
        let tick = self
            .shared
            .config
            .heartbeat_interval()
            .min(Duration::from_millis(100));
        let mut next_tick = Instant::now() + tick;
        while !self.shared.shutdown.load(Ordering::Relaxed) {
            let busy = self.poll_endpoints(&mut events) | self.drain_commands(4096);
            if !self.credit_owed.is_empty() {
                self.grant_credits(Instant::now());
            }
            if busy {
                idle_spins = 0;
            } else {
                idle_spins = idle_spins.saturating_add(1);
            }
            let now = Instant::now();
            if now >= next_tick {
                self.on_tick(now);
                next_tick = now + tick;
            }
            if busy {
                continue;
            }
            // Sleep until an fd is ready, a command arrives or the next
            // tick; endpoints that must be polled cap the sleep. The tick may
            // run up to a millisecond late: a shorter wait for it would be a
            // blind sleep (see `wait`), deaf to the descriptors.
            let mut timeout = next_tick
                .saturating_duration_since(now)
                .max(Duration::from_millis(1));
            if self.polling.must_poll {
                let config = &self.shared.config.fabric.polling;
                timeout = timeout.min(self.polling.backoff(idle_spins, config));
            }
            if !timeout.is_zero() && !prepare_wait(&mut self.endpoints) {
                continue;
            }
            if !self.shared.inbox.park(&self.commands) {
                continue;
            }
            if let Err(err) = wait(&mut self.poll, &mut mio_events, timeout) {
                if err.kind() != std::io::ErrorKind::Interrupted {
                    warn!(error = %err, "poll failed");
                }
            }
            self.shared.inbox.unpark();
        }
        self.shutdown(&mut events);
    }

    /// Poll every endpoint once and handle its events; true if any. The
    /// deliveries this produces are batched per peer and handed to the
    /// endpoints once the events are handled.
    fn poll_endpoints(&mut self, events: &mut Vec<Event>) -> bool {
        let mut busy = false;
        self.now = Instant::now();
        for index in 0..self.endpoints.len() {
            events.clear();
            if let Err(err) = self.endpoints[index].poll(events) {
                warn!(error = %err, "endpoint poll failed");
            }
            busy |= !events.is_empty();
            // Frames come in runs from one peer: its session is looked up
            // once per run (and whether this is its control link).
            let mut last: Option<(PeerId, u64, bool)> = None;
            for event in events.drain(..) {
                match event {
                    Event::Frame { peer, frame } => {
                        let known = match last {
                            Some((known, id, control)) if known == peer => Some((id, control)),
                            _ => self.by_peer.get(&(index, peer)).map(|&id| {
                                let control =
                                    self.sessions.get(&id).is_some_and(|s| s.endpoint == index);
                                (id, control)
                            }),
                        };
                        let Some((id, control)) = known else {
                            continue;
                        };
                        last = Some((peer, id, control));
                        if control {
                            self.on_frame(id, frame);
                        } else {
                            self.on_wire(id, index, frame);
                        }
                    }
                    other => {
                        last = None;
                        self.handle_event(index, other);
                    }
                }
            }
        }
        self.close_batches();
        self.flush_tally();
        busy
    }

    /// Add the round's counts to the shared statistics.
    fn flush_tally(&mut self) {
        let tally = std::mem::take(&mut self.tally);
        let stats = &self.shared.stats;
        if tally.messages_in > 0 {
            BrokerStats::add(&stats.messages_in, tally.messages_in);
        }
        if tally.messages_out > 0 {
            BrokerStats::add(&stats.messages_out, tally.messages_out);
        }
        if tally.bytes_in > 0 {
            BrokerStats::add(&stats.bytes_in, tally.bytes_in);
        }
        if tally.route_messages_in > 0 {
            BrokerStats::add(&stats.route_messages_in, tally.route_messages_in);
        }
        if tally.route_messages_out > 0 {
            BrokerStats::add(&stats.route_messages_out, tally.route_messages_out);
        }
    }

    fn drain_commands(&mut self, max: usize) -> bool {
        // Interest goes to route peers ahead of any message queued after it.
        self.sync_interest();
        if !self.blocking.is_empty() {
            // Under the block policy, in-process publishers wait too.
            return false;
        }
        let mut handled = 0;
        while handled < max {
            let Ok(command) = self.commands.try_recv() else {
                break;
            };
            handled += 1;
            match command {
                Command::Deliver { targets, message } => {
                    // Announcements made before this publish go first.
                    self.sync_interest();
                    let payload = Payload {
                        bytes: &message.payload,
                        frame: &message.payload,
                        at: 0,
                    };
                    self.encoded_valid = false;
                    for target in targets {
                        self.deliver_remote(
                            target,
                            &message.subject,
                            message.reply.as_deref(),
                            payload,
                        );
                    }
                }
                Command::Flush(done) => self.flushes.push(done),
                Command::AddPeer(endpoint) => self.add_peer(endpoint),
            }
        }
        self.close_batches();
        self.flush_tally();
        self.answer_flushes();
        handled > 0
    }

    fn answer_flushes(&mut self) {
        if self.flushes.is_empty() {
            return;
        }
        if self.sessions.values().all(|s| s.queue.is_empty()) {
            for done in self.flushes.drain(..) {
                let _ = done.send(());
            }
        }
    }

    fn handle_event(&mut self, endpoint: usize, event: Event) {
        match event {
            Event::Accepted { peer, remote } => self.on_accepted(endpoint, peer, remote),
            Event::Frame { peer, frame } => {
                if let Some(&id) = self.by_peer.get(&(endpoint, peer)) {
                    self.on_wire(id, endpoint, frame);
                }
            }
            Event::Writable { peer } => {
                if let Some(&id) = self.by_peer.get(&(endpoint, peer)) {
                    self.flush_session(id);
                }
            }
            Event::Closed { peer, reason } => {
                let Some(id) = self.by_peer.remove(&(endpoint, peer)) else {
                    return;
                };
                let data_link = self
                    .sessions
                    .get(&id)
                    .is_some_and(|s| s.endpoint != endpoint);
                if data_link {
                    // The data path failed under a live control link: end
                    // the session so the peer reconnects and renegotiates.
                    self.fail(id, ErrorCode::Internal, format!("data link lost: {reason}"));
                } else {
                    self.forget_session(id, &reason);
                }
            }
        }
    }

    fn on_accepted(&mut self, endpoint: usize, peer: PeerId, remote: String) {
        let now = Instant::now();
        let stats = &self.shared.stats;
        let refuse = if self.shared.shutdown.load(Ordering::Relaxed) {
            Some((ErrorCode::Internal, "server is shutting down".to_string()))
        } else if self.sessions.len() >= self.shared.config.limits.max_connections {
            Some((
                ErrorCode::TooManyConnections,
                format!(
                    "connection limit of {} reached",
                    self.shared.config.limits.max_connections
                ),
            ))
        } else {
            None
        };
        if let Some((code, text)) = refuse {
            BrokerStats::add(&stats.refused_connections, 1);
            warn!(%remote, %text, "connection refused");
            let frame = codec::encode(&Frame::Error(ErrorFrame {
                code,
                text,
                fatal: true,
            }));
            let ep = &mut self.endpoints[endpoint];
            let _ = ep.send(peer, frame);
            ep.close(peer);
            return;
        }
        let id = self.next_session;
        self.next_session += 1;
        BrokerStats::add(&stats.connections, 1);
        BrokerStats::add(&stats.connections_total, 1);
        debug!(session = id, %remote, "accepted");
        self.by_peer.insert((endpoint, peer), id);
        let deadline = now + self.shared.config.handshake_timeout();
        self.sessions
            .insert(id, Session::new(endpoint, peer, remote, now, deadline));
        if self.reads_paused {
            self.endpoints[endpoint].set_read_paused(peer, true);
        }
    }

    /// A message from one of a session's links: frames from the control
    /// link go straight to the session; data links pass through the link
    /// layer first.
    fn on_wire(&mut self, id: u64, endpoint: usize, bytes: Bytes) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if endpoint == session.endpoint {
            self.on_frame(id, bytes);
            return;
        }
        let now = Instant::now();
        let mut released = std::mem::take(&mut self.released);
        let (result, reliable) = match (&mut session.reliable, &mut session.best_effort) {
            (Some(link), _) if link.endpoint == endpoint => {
                // The peer has moved its traffic to the data link: so do we.
                session.switched = true;
                (link.receive(now, bytes, &mut released), true)
            }
            (_, Some(link)) if link.endpoint == endpoint => {
                (link.receive(now, bytes, &mut released), false)
            }
            _ => (Ok(()), false),
        };
        self.credit_owed.insert(id);
        for frame in released.drain(..) {
            BrokerStats::add(&self.shared.stats.fabric_frames_in, 1);
            self.on_frame(id, frame);
        }
        self.released = released;
        if self.sessions.get(&id).is_some_and(|s| !s.queue.is_empty()) {
            // The message may have been a credit opening the window.
            self.flush_session(id);
        }
        if let Err(err) = result {
            if reliable {
                BrokerStats::add(&self.shared.stats.bad_frames, 1);
                self.fail(id, ErrorCode::Malformed, format!("data link: {err}"));
            } else {
                debug!(session = id, error = %err, "best-effort link refused a message");
            }
        }
    }

    fn on_frame(&mut self, id: u64, bytes: Bytes) {
        self.tally.bytes_in += bytes.len() as u64;
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        session.last_heard = self.now;
        if session.state == SessionState::Closing {
            return;
        }
        let route = session.route.is_some();
        // Publishes, the bulk of the traffic, are read in place: nothing
        // is allocated for them, and a subject like the last one is not
        // checked again. Everything else is decoded into a value. (Routes
        // carry messages instead, read in place the same way.)
        let in_place = if route {
            session.is_route().then_some(FrameKind::Message)
        } else {
            Some(FrameKind::Publish)
        };
        if session.state == SessionState::Ready && in_place.is_some() {
            let known = std::mem::take(&mut self.known_subject);
            match codec::peek_routed_known(&bytes, &self.codec, &known) {
                Ok(Some(view)) if Some(view.kind) == in_place => {
                    let changed = !std::ptr::eq(view.subject, known.as_str());
                    if changed {
                        // Remember this subject, in the spare buffer.
                        self.spare_subject.clear();
                        self.spare_subject.push_str(view.subject);
                    }
                    let payload = Payload {
                        bytes: view.payload,
                        frame: &bytes,
                        at: view.payload_at,
                    };
                    if route {
                        self.on_route_message(id, view.sid, view.subject, view.reply, payload);
                    } else {
                        self.on_publish(id, view.subject, view.reply, payload);
                    }
                    self.known_subject = known;
                    if changed {
                        std::mem::swap(&mut self.known_subject, &mut self.spare_subject);
                    }
                    return;
                }
                // Other kinds, and malformed frames, go the general way
                // (which reports the same error).
                _ => {}
            }
            self.known_subject = known;
            // Statistics are current before anything is answered.
            self.flush_tally();
        }
        let stats = &self.shared.stats;
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let frame = match codec::decode(bytes, &self.codec) {
            Ok(frame) => frame,
            Err(err) => {
                BrokerStats::add(&stats.bad_frames, 1);
                warn!(session = id, remote = %session.remote, error = %err, "malformed frame");
                self.fail(id, ErrorCode::Malformed, format!("malformed frame: {err}"));
                return;
            }
        };
        let route_up = session.is_route();
        match (session.state, frame) {
            (SessionState::AwaitHello { .. }, Frame::Hello(hello)) if !route => {
                self.on_hello(id, hello)
            }
            (SessionState::AwaitHello { .. }, Frame::Welcome(welcome)) if route => {
                self.on_route_welcome(id, welcome)
            }
            (SessionState::AwaitHello { .. }, Frame::Error(error)) if route => {
                warn!(session = id, code = ?error.code, text = %error.text, "peer broker refused the route");
                self.close_session(id);
            }
            (SessionState::Ready, Frame::Route(hello)) => self.on_route_hello(id, hello),
            (SessionState::Ready, Frame::Message(message)) if route_up => {
                let payload = Payload {
                    bytes: &message.payload,
                    frame: &message.payload,
                    at: 0,
                };
                let reply = message.reply.as_deref();
                self.on_route_message(id, message.sid, &message.subject, reply, payload);
            }
            (SessionState::Ready, Frame::Subscribe(subscribe)) if route_up => {
                self.on_route_subscribe(id, subscribe)
            }
            (SessionState::Ready, Frame::Unsubscribe { sid }) if route_up => {
                self.on_route_unsubscribe(id, sid)
            }
            (SessionState::Ready, Frame::Publish(_)) if route => {
                self.fail(
                    id,
                    ErrorCode::Protocol,
                    "a route carries messages, not publishes".to_string(),
                );
            }
            (SessionState::AwaitHello { .. }, other) => {
                self.fail(
                    id,
                    ErrorCode::Protocol,
                    format!("expected hello, got {}", FrameKind::of(&other)),
                );
            }
            (SessionState::Ready, Frame::Publish(publish)) => self.on_publish(
                id,
                &publish.subject,
                publish.reply.as_deref(),
                Payload {
                    bytes: &publish.payload,
                    frame: &publish.payload,
                    at: 0,
                },
            ),
            (SessionState::Ready, Frame::Subscribe(subscribe)) => {
                self.on_subscribe(id, subscribe);
                self.sync_interest();
            }
            (SessionState::Ready, Frame::Unsubscribe { sid }) => {
                session.subscriptions.remove(&sid);
                self.shared.router.write().remove(SubRef { owner: id, sid });
                self.sync_interest();
            }
            (SessionState::Ready, Frame::Ping { nonce }) => {
                self.send(id, codec::encode(&Frame::Pong { nonce }), false);
            }
            (SessionState::Ready, Frame::Pong { .. }) => {}
            (_, Frame::Goodbye(goodbye)) => {
                debug!(session = id, reason = %goodbye.reason, "peer said goodbye");
                self.close_session(id);
            }
            (_, Frame::Error(error)) => {
                warn!(session = id, code = ?error.code, text = %error.text, "peer reported an error");
            }
            (_, other) => {
                self.fail(
                    id,
                    ErrorCode::Protocol,
                    format!("unexpected {} frame", FrameKind::of(&other)),
                );
            }
        }
    }

    fn on_hello(&mut self, id: u64, hello: frame::Hello) {
        let config = &self.shared.config;
        if hello.version != PROTOCOL_VERSION {
            self.fail(
                id,
                ErrorCode::Version,
                format!(
                    "protocol version {} not supported (this server speaks {PROTOCOL_VERSION})",
                    hello.version
                ),
            );
            return;
        }
        if let Some(secret) = &config.auth.secret {
            let given = hello.credentials.as_deref().unwrap_or("");
            if !constant_time_eq(given.as_bytes(), secret.as_bytes()) {
                BrokerStats::add(&self.shared.stats.auth_failures, 1);
                let text = if hello.credentials.is_none() {
                    "credentials required"
                } else {
                    "invalid credentials"
                };
                self.fail(id, ErrorCode::Auth, text.to_string());
                return;
            }
        }
        let offers = self.negotiate(id, &hello.offers);
        let welcome = Frame::Welcome(Welcome {
            version: PROTOCOL_VERSION,
            name: self.shared.config.name.clone(),
            offers,
            max_payload: self.shared.config.limits.max_payload,
        });
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        session.name = hello.name;
        session.state = SessionState::Ready;
        info!(session = id, remote = %session.remote, name = %session.name, "peer connected");
        self.send(id, codec::encode(&welcome), false);
    }

    /// Choose the data paths for a peer from both sides' offers, open the
    /// chosen data links, and return the offers to put in the welcome: this
    /// side of each chosen link (so the peer arrives at the same choice),
    /// or every offer when only the control link is in common.
    fn negotiate(&mut self, id: u64, remote: &[Offer]) -> Vec<Offer> {
        let preference = &self.shared.config.negotiation.preference;
        let negotiated = match negotiate(&self.offers, remote, preference) {
            Ok(negotiated) => negotiated,
            Err(err) => {
                info!(session = id, reason = %err, "no data path in common; the control link carries everything");
                return self.offers.clone();
            }
        };
        let Some(session) = self.sessions.get_mut(&id) else {
            return Vec::new();
        };
        let mut chosen = Vec::new();
        for (choice, reliable) in [
            (Some(&negotiated.reliable), true),
            (negotiated.best_effort.as_ref(), false),
        ] {
            let Some(choice) = choice else { continue };
            if !endpoints::is_data_scheme(&choice.scheme) {
                continue;
            }
            let Some(index) = self
                .endpoints
                .iter()
                .position(|e| e.scheme() == choice.scheme)
            else {
                continue;
            };
            match DataLink::open(index, self.endpoints[index].as_mut(), choice, &self.tuning) {
                Ok(link) => {
                    info!(session = id, link = %link.description, "data path negotiated");
                    self.by_peer.insert((index, link.peer), id);
                    chosen.push(choice.local.clone());
                    if reliable {
                        session.reliable = Some(link);
                    } else {
                        session.best_effort = Some(link);
                    }
                }
                Err(reason) => {
                    warn!(session = id, %reason, "data path unusable; staying on the control link")
                }
            }
        }
        for reason in &negotiated.reasons {
            debug!(session = id, %reason, "negotiation");
        }
        if chosen.is_empty() {
            return self.offers.clone();
        }
        chosen.extend(
            self.offers
                .iter()
                .filter(|o| !endpoints::is_data_scheme(&o.scheme))
                .cloned(),
        );
        chosen
    }

    fn on_subscribe(&mut self, id: u64, subscribe: frame::Subscribe) {
        let limits = &self.shared.config.limits;
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if session.subscriptions.len() >= limits.max_subscriptions_per_peer {
            let text = format!(
                "subscription limit of {} reached; {} refused",
                limits.max_subscriptions_per_peer, subscribe.pattern
            );
            self.report(id, ErrorCode::TooManySubscriptions, text);
            return;
        }
        if let Err(err) = subject::validate_pattern(&subscribe.pattern, &self.shared.subject_limits)
        {
            self.report(
                id,
                ErrorCode::InvalidSubject,
                format!("invalid pattern {:?}: {err}", subscribe.pattern),
            );
            return;
        }
        if session
            .subscriptions
            .insert(subscribe.sid, subscribe.class)
            .is_some()
        {
            self.report(
                id,
                ErrorCode::Protocol,
                format!("subscription id {} already in use", subscribe.sid),
            );
            return;
        }
        let key = SubRef {
            owner: id,
            sid: subscribe.sid,
        };
        let inserted = self.shared.router.write().insert(
            &subscribe.pattern,
            subscribe.queue.as_deref(),
            key,
            None,
        );
        if let Err(err) = inserted {
            session.subscriptions.remove(&subscribe.sid);
            self.report(
                id,
                ErrorCode::InvalidSubject,
                format!("cannot subscribe to {:?}: {err}", subscribe.pattern),
            );
        }
    }

    /// Whether a payload of `len` bytes is within `limits.max_payload`;
    /// if not, the peer is told (the connection stays).
    fn payload_allowed(&mut self, id: u64, len: usize) -> bool {
        let max_payload = self.shared.config.limits.max_payload;
        if len as u64 <= max_payload {
            return true;
        }
        let text = format!("payload of {len} bytes exceeds the limit of {max_payload}");
        self.report(id, ErrorCode::PayloadTooLarge, text);
        false
    }

    fn on_publish(&mut self, id: u64, subject: &str, reply: Option<&str>, payload: Payload<'_>) {
        if !self.payload_allowed(id, payload.bytes.len()) {
            return;
        }
        // Routing validates the subject (the index caches valid ones).
        let routed = self.shared.router.read().route(subject, &mut self.targets);
        self.deliver_routed(id, subject, reply, payload, routed);
    }

    /// Deliver a message whose subscriptions `routed` into `self.targets`,
    /// or tell the peer why its subject or reply subject is invalid.
    fn deliver_routed(
        &mut self,
        id: u64,
        subject: &str,
        reply: Option<&str>,
        payload: Payload<'_>,
        routed: Result<(), subject::SubjectError>,
    ) {
        let shared = &self.shared;
        let valid = routed.and_then(|()| match reply {
            Some(reply) => subject::validate_subject(reply, &shared.subject_limits),
            None => Ok(()),
        });
        if let Err(err) = valid {
            self.report(
                id,
                ErrorCode::InvalidSubject,
                format!("invalid subject {subject:?}: {err}"),
            );
            return;
        }
        self.tally.messages_in += 1;
        if !self.targets.local.is_empty() {
            let message = Message {
                subject: Arc::from(subject),
                reply: reply.map(Arc::from),
                payload: payload.to_bytes(),
            };
            deliver_local(&self.shared, &mut self.targets, &message);
        }
        self.encoded_valid = false;
        // By index: delivering needs `self`, and the list is not touched
        // until the next publish routes into it.
        for index in 0..self.targets.remote.len() {
            let target = self.targets.remote[index];
            self.deliver_remote(target, subject, reply, payload);
        }
    }

    /// Deliver one message to a remote subscription. On the control link
    /// the message is encoded straight into the peer's batch (payloads up
    /// to [`COPY_MAX`] copied in, larger ones shared behind their head);
    /// data links take it frame by frame.
    fn deliver_remote(
        &mut self,
        target: SubRef,
        subject: &str,
        reply: Option<&str>,
        payload: Payload<'_>,
    ) {
        let Some(session) = self.sessions.get_mut(&target.owner) else {
            return;
        };
        self.tally.messages_out += 1;
        if session.route.is_some() {
            self.tally.route_messages_out += 1;
        }
        let on_data_link = session.reliable.is_some() && session.switched;
        // The class matters only where a datagram link exists.
        let best_effort = session.best_effort.is_some()
            && session.subscriptions.get(&target.sid) == Some(&DeliveryClass::BestEffort);
        if !on_data_link && !best_effort && payload.bytes.len() <= COPY_MAX {
            // The message is encoded once per publish and copied into each
            // peer's batch with that peer's subscription id.
            if !self.encoded_valid {
                self.encoded.clear();
                let encoded = codec::routed_into(
                    &mut self.encoded,
                    FrameKind::Message,
                    0,
                    subject,
                    reply,
                    payload.bytes,
                );
                if let Err(err) = encoded {
                    // Limits are enforced before routing; this is not
                    // reachable with a valid configuration.
                    warn!(session = target.owner, error = %err, "message cannot be encoded");
                    return;
                }
                self.encoded_valid = true;
            }
            // A batch never grows its buffer (growing copies, and large
            // buffers come from fresh pages): it is handed on where its
            // room ends, and the next starts with twice the last one's size.
            let need = self.encoded.len();
            let session = if session.batch_messages > 0
                && session.batch.len() + need > session.batch.capacity()
            {
                self.close_batch(target.owner);
                let Some(session) = self.sessions.get_mut(&target.owner) else {
                    return;
                };
                session
            } else {
                session
            };
            if session.batch.capacity() - session.batch.len() < need {
                let room = (session.batch_hint * 2).clamp(RUN_MIN, RUN_MAX);
                session.batch.reserve(room.max(need));
            }
            let at = session.batch.len();
            session.batch.extend_from_slice(&self.encoded);
            codec::set_message_sid(&mut session.batch[at..], target.sid);
            session.batch_messages += 1;
            if session.batch_messages == 1 {
                self.dirty.push(target.owner);
            }
            return;
        }
        let mut head = BytesMut::new();
        let encoded = codec::routed_head_into(
            &mut head,
            FrameKind::Message,
            target.sid,
            0,
            subject,
            reply,
            payload.bytes.len(),
        );
        if let Err(err) = encoded {
            warn!(session = target.owner, error = %err, "message cannot be encoded");
            return;
        }
        let frame = OutFrame {
            head: head.freeze(),
            body: payload.to_bytes(),
        };
        if best_effort {
            let Some(link) = session.best_effort.as_mut() else {
                return;
            };
            let endpoint = self.endpoints[link.endpoint].as_mut();
            let sent = link.send(endpoint, frame);
            BrokerStats::add(&self.shared.stats.credit_waits, link.take_credit_waits());
            match sent {
                Ok(Sent::Accepted) => BrokerStats::add(&self.shared.stats.fabric_frames_out, 1),
                Ok(Sent::Dropped | Sent::Blocked(_)) => {
                    BrokerStats::add(&self.shared.stats.best_effort_drops, 1);
                }
                Err(reason) => {
                    BrokerStats::add(&self.shared.stats.best_effort_drops, 1);
                    debug!(session = target.owner, %reason, "best-effort send failed");
                }
            }
            return;
        }
        self.send(target.owner, frame, true);
    }

    /// Hand every session's batch of deliveries on.
    fn close_batches(&mut self) {
        let dirty = std::mem::take(&mut self.dirty);
        for &id in &dirty {
            self.close_batch(id);
        }
        self.dirty = dirty;
        self.dirty.clear();
    }

    /// Hand a session's batch on as one run: to the endpoint when nothing
    /// waits before it, else behind the queue.
    fn close_batch(&mut self, id: u64) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if session.batch.is_empty() {
            return;
        }
        // A busy session keeps the rest of its buffer, which it takes back
        // once the run is written; a small run takes its buffer along, so
        // a session gone idle keeps little memory.
        let run = if session.batch.len() >= 4 << 10 {
            session.batch.split().freeze()
        } else {
            std::mem::take(&mut session.batch).freeze()
        };
        let messages = std::mem::take(&mut session.batch_messages);
        session.batch_hint = run.len().clamp(RUN_MIN, RUN_MAX);
        self.enqueue(
            id,
            Queued {
                frame: OutFrame::whole(run),
                messages,
                run: true,
            },
        );
    }

    /// Queue a frame for a session, applying the slow-consumer policy when
    /// its queue is over the bound. The session's batch goes first.
    fn send(&mut self, id: u64, frame: OutFrame, is_message: bool) {
        self.close_batch(id);
        self.enqueue(
            id,
            Queued {
                frame,
                messages: usize::from(is_message),
                run: false,
            },
        );
    }

    /// Hand a frame or run to the session's path when nothing waits before
    /// it, else queue it; then apply the slow-consumer policy when the
    /// queue is over its bound.
    fn enqueue(&mut self, id: u64, queued: Queued) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if session.cut_off {
            return;
        }
        let is_message = queued.messages > 0;
        if session.queue.is_empty() {
            match transmit(&mut self.endpoints, &self.shared.stats, session, queued) {
                None => return,
                Some(rest) => {
                    session.queued_bytes += rest.frame.len();
                    session.queue.push_back(rest);
                }
            }
        } else {
            session.queued_bytes += queued.frame.len();
            session.queue.push_back(queued);
        }
        let bound = self.shared.config.limits.max_pending_bytes;
        if session.queued_bytes <= bound || !is_message {
            return;
        }
        match self.shared.config.slow_consumer.policy {
            SlowConsumerPolicy::DropOldest => {
                while session.queued_bytes > bound {
                    let Some(position) = session.queue.iter().position(|q| q.messages > 0) else {
                        break;
                    };
                    if let Some(dropped) = session.queue.remove(position) {
                        session.queued_bytes -= dropped.frame.len();
                        BrokerStats::add(
                            &self.shared.stats.slow_consumer_drops,
                            dropped.messages as u64,
                        );
                    }
                }
            }
            SlowConsumerPolicy::Disconnect => {
                BrokerStats::add(&self.shared.stats.slow_consumer_disconnects, 1);
                warn!(session = id, remote = %session.remote, "slow consumer disconnected");
                self.fail(
                    id,
                    ErrorCode::SlowConsumer,
                    format!("more than {bound} bytes queued"),
                );
            }
            SlowConsumerPolicy::Block => {
                if session.over_since.is_none() {
                    session.over_since = Some(Instant::now());
                }
                self.blocking.insert(id);
                self.set_reads_paused(true);
            }
        }
    }

    /// Send the credits that are due. While publishers are held back under
    /// the block policy, their data links get none: the credit window then
    /// stops them as a paused socket stops TCP publishers.
    fn grant_credits(&mut self, now: Instant) {
        let mut owed = std::mem::take(&mut self.credit_owed);
        owed.retain(|id| {
            let Some(session) = self.sessions.get_mut(id) else {
                return false;
            };
            let held = self.reads_paused && !self.blocking.contains(id);
            let mut still_owed = false;
            for link in [&mut session.reliable, &mut session.best_effort]
                .into_iter()
                .flatten()
            {
                if !held {
                    link.send_credit(self.endpoints[link.endpoint].as_mut(), now, false);
                }
                still_owed |= link.owes_credit();
            }
            still_owed
        });
        self.credit_owed = owed;
    }

    fn set_reads_paused(&mut self, paused: bool) {
        if self.reads_paused == paused {
            return;
        }
        self.reads_paused = paused;
        for (id, session) in &self.sessions {
            // The slow consumers themselves keep being read: they may
            // only be acknowledging or saying goodbye.
            if !self.blocking.contains(id) {
                self.endpoints[session.endpoint].set_read_paused(session.peer, paused);
            }
        }
    }

    /// Hand queued frames to the endpoint until it pushes back.
    fn flush_session(&mut self, id: u64) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        while let Some(queued) = session.queue.pop_front() {
            let len = queued.frame.len();
            match transmit(&mut self.endpoints, &self.shared.stats, session, queued) {
                None => session.queued_bytes -= len,
                Some(rest) => {
                    session.queued_bytes -= len - rest.frame.len();
                    session.queue.push_front(rest);
                    break;
                }
            }
        }
        let bound = self.shared.config.limits.max_pending_bytes;
        let drained = session.queued_bytes <= bound / 2;
        if drained {
            session.over_since = None;
        }
        if session.queue.is_empty() && session.state == SessionState::Closing {
            let (endpoint, peer) = (session.endpoint, session.peer);
            self.endpoints[endpoint].close(peer);
        }
        if drained && self.blocking.remove(&id) && self.blocking.is_empty() {
            self.set_reads_paused(false);
        }
        self.answer_flushes();
    }

    /// Report a non-fatal error to the peer.
    fn report(&mut self, id: u64, code: ErrorCode, text: String) {
        debug!(session = id, ?code, %text, "error reported to peer");
        let frame = error_frame(code, text, false);
        self.send(id, frame, false);
    }

    /// Report a fatal error, then close the session once it is flushed.
    fn fail(&mut self, id: u64, code: ErrorCode, text: String) {
        if let Some(session) = self.sessions.get(&id) {
            info!(session = id, remote = %session.remote, ?code, %text, "closing peer");
        }
        let frame = error_frame(code, text, true);
        if code == ErrorCode::SlowConsumer {
            // A slow consumer's queue would never drain: drop it and say why
            // on the control link, where nothing waits for the peer's
            // credit, then close at once.
            if let Some(session) = self.sessions.get_mut(&id) {
                session.cut_off = true;
                session.queue.clear();
                session.queued_bytes = 0;
                session.batch.clear();
                session.batch_messages = 0;
                let _ = self.endpoints[session.endpoint].send(session.peer, frame);
            }
        } else {
            self.send(id, frame, false);
        }
        self.close_session(id);
    }

    /// Stop reading from the session and close it once its queue is flushed.
    fn close_session(&mut self, id: u64) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        session.state = SessionState::Closing;
        let (endpoint, peer) = (session.endpoint, session.peer);
        self.remove_interest(id);
        if self.sessions.get(&id).is_some_and(|s| s.queue.is_empty()) {
            self.endpoints[endpoint].close(peer);
        }
    }

    fn remove_interest(&mut self, id: u64) {
        self.route_gone(id);
        if let Some(session) = self.sessions.get_mut(&id) {
            if !session.subscriptions.is_empty() {
                session.subscriptions.clear();
                self.shared.router.write().remove_owner(id);
            }
        }
        if self.blocking.remove(&id) && self.blocking.is_empty() {
            self.set_reads_paused(false);
        }
    }

    fn forget_session(&mut self, id: u64, reason: &CloseReason) {
        self.remove_interest(id);
        self.dialed_session_gone(id);
        if let Some(session) = self.sessions.remove(&id) {
            for link in [&session.reliable, &session.best_effort]
                .into_iter()
                .flatten()
            {
                self.by_peer.remove(&(link.endpoint, link.peer));
                self.endpoints[link.endpoint].close(link.peer);
            }
            self.shared
                .stats
                .connections
                .fetch_sub(1, Ordering::Relaxed);
            info!(session = id, remote = %session.remote, name = %session.name, %reason, "peer gone");
        }
        self.answer_flushes();
    }

    fn on_tick(&mut self, now: Instant) {
        let interval = self.shared.config.heartbeat_interval();
        let timeout = self.shared.config.heartbeat_timeout();
        let block_timeout = self.shared.config.block_timeout();
        let mut expired = Vec::new();
        let mut pings = Vec::new();
        let mut slow = Vec::new();
        let mut queued = 0u64;
        for (&id, session) in &self.sessions {
            queued += session.queued_bytes as u64;
            queued += session
                .reliable
                .as_ref()
                .map_or(0, |link| link.backlog_bytes()) as u64;
            match session.state {
                SessionState::AwaitHello { deadline } if now >= deadline => {
                    expired.push((id, ErrorCode::HandshakeTimeout))
                }
                SessionState::Ready if now.duration_since(session.last_heard) >= timeout => {
                    expired.push((id, ErrorCode::Internal));
                }
                SessionState::Ready if now.duration_since(session.last_ping) >= interval => {
                    pings.push(id)
                }
                _ => {}
            }
            if session
                .over_since
                .is_some_and(|since| now.duration_since(since) >= block_timeout)
            {
                slow.push(id);
            }
        }
        self.shared
            .stats
            .queued_bytes
            .store(queued, Ordering::Relaxed);
        self.poll_lossy_links(now);
        self.dial_routes(now);
        for (id, code) in expired {
            let text = match code {
                ErrorCode::HandshakeTimeout => "handshake not completed in time".to_string(),
                _ => format!("no traffic for {timeout:?}: peer presumed dead"),
            };
            self.fail(id, code, text);
            if let Some(session) = self.sessions.get(&id) {
                // A dead peer will not drain its queue: close now.
                let (endpoint, peer) = (session.endpoint, session.peer);
                self.endpoints[endpoint].close(peer);
            }
        }
        for id in slow {
            BrokerStats::add(&self.shared.stats.slow_consumer_disconnects, 1);
            if let Some(session) = self.sessions.get(&id) {
                warn!(session = id, remote = %session.remote, "slow consumer blocked publishers too long; disconnected");
            }
            self.fail(
                id,
                ErrorCode::SlowConsumer,
                format!("could not take messages for {block_timeout:?}"),
            );
        }
        for id in pings {
            if let Some(session) = self.sessions.get_mut(&id) {
                session.last_ping = now;
            }
            self.send(id, codec::encode(&Frame::Ping { nonce: 0 }), false);
        }
    }

    /// Let datagram links give up on gaps whose time has passed, and hand
    /// on what that releases.
    fn poll_lossy_links(&mut self, now: Instant) {
        let mut released = std::mem::take(&mut self.released);
        let ids: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.best_effort.is_some())
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            if let Some(link) = self
                .sessions
                .get_mut(&id)
                .and_then(|s| s.best_effort.as_mut())
            {
                link.poll(now, &mut released);
            }
            for frame in released.drain(..) {
                BrokerStats::add(&self.shared.stats.fabric_frames_in, 1);
                self.on_frame(id, frame);
            }
        }
        self.released = released;
    }

    fn shutdown(&mut self, events: &mut Vec<Event>) {
        info!("shutting down");
        let deadline = Instant::now() + self.shared.config.drain_timeout();
        self.blocking.clear();
        self.set_reads_paused(false);
        // Deliver what in-process publishers queued before the shutdown.
        while self.drain_commands(usize::MAX) {}
        let goodbye = codec::encode(&Frame::Goodbye(Goodbye {
            reason: "server shutting down".to_string(),
        }));
        let ids: Vec<u64> = self.sessions.keys().copied().collect();
        for id in ids {
            self.send(id, goodbye.clone(), false);
            self.close_session(id);
        }
        while !self.sessions.is_empty() && Instant::now() < deadline {
            self.poll_endpoints(events);
            std::thread::sleep(Duration::from_millis(1));
        }
        if !self.sessions.is_empty() {
            warn!(
                peers = self.sessions.len(),
                "drain time over; closing peers with data still queued"
            );
        }
        for done in self.flushes.drain(..) {
            let _ = done.send(());
        }
        self.shared.router.write().close_locals();
        info!("stopped");
    }
}

/// Longest error text sent to a peer, in bytes. Texts echo what the peer
/// sent (escaped, so up to six bytes per byte received); cut, they always
/// fit a control frame.
const MAX_ERROR_TEXT: usize = 1024;

/// An encoded error frame, its text cut to [`MAX_ERROR_TEXT`] bytes.
fn error_frame(code: ErrorCode, mut text: String, fatal: bool) -> OutFrame {
    if text.len() > MAX_ERROR_TEXT {
        let mut cut = MAX_ERROR_TEXT - '…'.len_utf8();
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    codec::encode(&Frame::Error(ErrorFrame { code, text, fatal }))
}

/// Send one frame or run on the session's current path: its reliable data
/// link once the peer uses it, else the control link. Gives back what the
/// path could not take (a run's untaken frames); frames that fail for any
/// other reason than a full path are dropped here: the link is failing and
/// its closing event follows.
fn transmit(
    endpoints: &mut [Box<dyn Endpoint>],
    stats: &BrokerStats,
    session: &mut Session,
    queued: Queued,
) -> Option<Queued> {
    if let Some(link) = session.reliable.as_mut().filter(|_| session.switched) {
        let endpoint = endpoints[link.endpoint].as_mut();
        // Data links carry one frame per message: a run (batched before the
        // peer switched) is taken apart.
        let frames = if queued.run {
            split_run(&queued.frame.head)
        } else {
            vec![queued.frame]
        };
        let mut frames = frames.into_iter();
        while let Some(frame) = frames.next() {
            let sent = link.send(endpoint, frame);
            BrokerStats::add(&stats.credit_waits, link.take_credit_waits());
            match sent {
                Ok(Sent::Accepted) => BrokerStats::add(&stats.fabric_frames_out, 1),
                Ok(Sent::Dropped) => {}
                Ok(Sent::Blocked(frame)) => {
                    let rest: Vec<OutFrame> = std::iter::once(frame).chain(frames).collect();
                    return Some(rejoin(rest, queued.run, queued.messages > 0));
                }
                Err(reason) => {
                    warn!(remote = %session.remote, %reason, "data link send failed");
                }
            }
        }
        return None;
    }
    let endpoint = endpoints[session.endpoint].as_mut();
    let result = if queued.run {
        endpoint.send_run(session.peer, queued.frame.head)
    } else {
        endpoint.send(session.peer, queued.frame)
    };
    match result {
        Ok(()) => None,
        Err(SendError::WouldBlock(frame)) => {
            let messages = if queued.run {
                split_run(&frame.head).len()
            } else {
                queued.messages
            };
            Some(Queued {
                frame,
                messages,
                run: queued.run,
            })
        }
        Err(err) => {
            debug!(remote = %session.remote, error = %err, "send failed");
            None
        }
    }
}

/// The frames of a run, as slices of it (a run holds whole frames back to
/// back; anything after the last whole frame is ignored).
fn split_run(run: &Bytes) -> Vec<OutFrame> {
    let mut frames = Vec::new();
    let mut at = 0;
    while let Some(raw) = run.get(at..at + 4) {
        let total = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]) as usize + 4;
        if at + total > run.len() {
            break;
        }
        frames.push(OutFrame::whole(run.slice(at..at + total)));
        at += total;
    }
    frames
}

/// Frames a data link did not take, back as one queue entry.
fn rejoin(frames: Vec<OutFrame>, run: bool, messages: bool) -> Queued {
    if !run {
        let frame = frames.into_iter().next().unwrap_or_default();
        return Queued {
            frame,
            messages: usize::from(messages),
            run: false,
        };
    }
    let count = frames.len();
    let mut joined = BytesMut::new();
    for frame in frames {
        joined.extend_from_slice(&frame.head);
        joined.extend_from_slice(&frame.body);
    }
    Queued {
        frame: OutFrame::whole(joined.freeze()),
        messages: count,
        run: true,
    }
}

/// Wait for readiness for up to `timeout`. epoll counts in milliseconds, so
/// mio rounds shorter waits up to a whole millisecond; below that, look at
/// the descriptors without waiting and sleep the rest (nanosleep keeps
/// microseconds), so the fabric polling steps keep their length.
pub(crate) fn wait(
    poll: &mut Poll,
    events: &mut mio::Events,
    timeout: Duration,
) -> std::io::Result<()> {
    if timeout.is_zero() || timeout >= Duration::from_millis(1) {
        return poll.poll(events, Some(timeout));
    }
    poll.poll(events, Some(Duration::ZERO))?;
    if events.is_empty() {
        std::thread::sleep(timeout);
    }
    Ok(())
}

/// Idle rounds a loop spins before it sleeps on its fabric wait sets: a
/// wake-up from the descriptor is cheap, and spinning longer only takes
/// cores from the threads that do the work (measured on 2 cores, where 64
/// rounds tripled the round-trip time of 8).
const WAKEABLE_SPINS: u32 = 8;

/// How a loop's endpoints want to be waited on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Polled {
    /// Some endpoint makes progress only when polled.
    pub must_poll: bool,
    /// Every such endpoint also has a descriptor that ends the wait early.
    pub wakeable: bool,
}

impl Polled {
    pub fn of(readiness: impl IntoIterator<Item = Readiness>) -> Polled {
        let mut polled = Polled {
            must_poll: false,
            wakeable: true,
        };
        for readiness in readiness {
            polled.must_poll |= readiness.must_poll();
            polled.wakeable &= readiness != Readiness::MustPoll;
        }
        polled
    }

    /// How long an idle loop may wait. When a descriptor ends the wait as
    /// soon as work arrives: not at all for `WAKEABLE_SPINS` idle rounds (at
    /// most `busy_polls`), then as long as the loop's own timers allow
    /// (`Duration::MAX`). Otherwise: not at all for `busy_polls` idle
    /// rounds, then 50 us for as many rounds again, then `idle_sleep_us`.
    pub fn backoff(self, idle_rounds: u32, polling: &crate::config::Polling) -> Duration {
        if self.wakeable {
            if idle_rounds <= polling.busy_polls.min(WAKEABLE_SPINS) {
                Duration::ZERO
            } else {
                Duration::MAX
            }
        } else if idle_rounds <= polling.busy_polls {
            Duration::ZERO
        } else if idle_rounds <= polling.busy_polls.saturating_mul(2) {
            Duration::from_micros(50.min(polling.idle_sleep_us))
        } else {
            Duration::from_micros(polling.idle_sleep_us)
        }
    }
}

/// Asks every endpoint that must be polled whether the loop may sleep now;
/// false when one has work pending.
pub(crate) fn prepare_wait(endpoints: &mut [Box<dyn Endpoint>]) -> bool {
    endpoints
        .iter_mut()
        .filter(|endpoint| endpoint.readiness().must_poll())
        .all(|endpoint| endpoint.prepare_wait())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_compares_contents_and_lengths() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }
}
