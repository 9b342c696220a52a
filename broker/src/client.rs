//! The client: the broker's publish/subscribe API against a remote broker.
//!
//! A background thread runs the connection: it performs the handshake,
//! answers keepalives, delivers incoming messages to subscription queues,
//! and on a lost connection reconnects with backoff, re-sends every
//! subscription, then the publishes buffered meanwhile (within a bound).
//! A thread waiting for a reply, or for a subscription's next message while
//! the loop finds nothing to do, runs the loop's rounds itself meanwhile
//! ([`Driven`]), and the loop thread sleeps meanwhile (up to 100 us at a
//! time), woken by what is asked of the loop or by a driver that leaves
//! without its answer.
//!
//! Application threads hand work to that thread through one outbox: a
//! publish is encoded straight into a shared buffer (small payloads copied
//! in, large ones shared behind their header), and subscriptions and
//! flushes queue between the frames in order. The thread takes what
//! accumulated and hands it to the endpoint as runs of frames, one system
//! call per run; a publisher wakes it only when it sleeps.
//!
//! The connection itself (control link, negotiated data links, frames the
//! path has not taken yet, heartbeats) is the shared session layer's
//! `Connection` (`session/`); this module adds what only a client has.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use crossbeam_channel::Sender;
use efabus_core::budget::MemoryBudget;
use efabus_core::caps::Offer;
use efabus_core::codec::{self, CodecLimits, FrameKind, RoutedFields};
use efabus_core::credit::CREDIT_DELAY;
use efabus_core::frame::{
    self, DeliveryClass, ErrorCode, Frame, Goodbye, Hello, LinkAuth, SecretProof, Welcome,
    PROTOCOL_VERSION,
};
use efabus_core::link::{LinkError, LinkTuning};
use efabus_core::secret::{constant_time_eq, prove, ProofRole};
use efabus_core::subject::{self, SubjectLimits};
use efabus_core::transport::{
    split_run, DirectSend, Endpoint, EndpointConfig, Event, OutFrame, PeerId, Readiness, SendError,
};
use efabus_transports::registry::{EndpointSpec, Registry, RegistryError};
use mio::unix::SourceFd;
use mio::{Interest, Poll, Token, Waker};
use parking_lot::{Condvar, Mutex, MutexGuard};
// Subscription ids are small integers this side assigns.
use rustc_hash::{FxHashMap as HashMap, FxHashSet};
use tracing::{debug, error, info, warn};

use crate::broker::{reply_token, unique_seed, BrokerStats};
use crate::commands::Parker;
use crate::config::SlowConsumerPolicy;
use crate::delivery::{
    Delivery, LocalSink, Message, Responder, Subscription, SubscriptionOwner, YieldWindow,
};
use crate::drive::{DriveHandle, Driven, Rounds, DRIVEN_SLEEP};
use crate::endpoints;
use crate::error::Error;
use crate::round_watch::{LoopStall, RoundWatch, WatchedEndpoint};
use crate::session::data_link::{open_released, Closed, GiveUp, Keying, LinkKind};
use crate::session::link_auth::{HandshakeRole, LinkSecret};
use crate::session::outbound::{self, Control, Queued, SendCounts, RUN_MAX};
use crate::session::{push_reason, Connection, Heartbeat, Liveness};
use crate::wait::{prepare_wait, puts_off_polling, wait, Polled, SpinWindow};

const WAKER: Token = Token(0);
const ENDPOINT: Token = Token(1);
/// The control endpoint's index in the loop's endpoint list; data
/// endpoints follow it.
const CONTROL: usize = 0;
/// Data endpoints use tokens from here on.
const DATA_TOKENS: usize = 2;
/// Payloads up to this size are copied into the outbox with their frame;
/// larger ones are shared behind a head of their own.
const COPY_MAX: usize = 1 << 10;
/// Messages that share one subject string before the next gets a fresh one.
const SUBJECT_SHARES: usize = 64;
/// Room for messages the list of a run keeps between rounds.
const RUN_KEPT_MAX: usize = 4096;
/// Most items (runs, large frames, commands) the outbox holds before
/// application threads wait for room.
const MAX_ITEMS: usize = 65_536;
/// Smallest buffer a run of the outbox starts with: one per client, where
/// the broker keeps one per session and starts smaller.
const RUN_MIN: usize = 4 << 10;

/// Errors reported by the server that a client keeps for
/// [`Client::take_errors`].
pub const SERVER_ERRORS_KEPT: usize = 64;

/// Open one data endpoint (only connecting out: no bind address).
fn open_data_endpoint(
    registry: &Registry,
    text: &str,
    options: &ClientOptions,
) -> Result<Box<dyn Endpoint>, String> {
    let spec = EndpointSpec::parse(text).map_err(|err| err.to_string())?;
    let transport = registry.get(spec.scheme()).map_err(|err| err.to_string())?;
    let config = EndpointConfig {
        bind: spec.address().map(str::to_string),
        max_frame: options.max_frame,
        queue_frames: 65_536,
        queue_bytes: options.max_pending_bytes.min(4 << 20),
        fabric: crate::endpoints::endpoint_options(&options.fabric, spec.scheme()),
        options: Vec::new(),
    };
    transport.open(&config).map_err(|err| err.to_string())
}

/// The longest any wait of a client lasts (a century): a longer one
/// asked for is taken as this.
const LONGEST_WAIT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Settings of a client connection.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Name sent in the handshake.
    pub name: String,
    /// The user to log in as (the server's `auth.users`); `credentials`
    /// is then its password, sent in the hello (use TLS).
    pub user: Option<String>,
    /// Without `user`: the shared secret, which is only proven (the hello
    /// answers the server's challenge with a keyed hash, and the server
    /// proves it back), never sent. With `user`: its password.
    pub credentials: Option<String>,
    /// A user's token (`auth.users` with a `token`), sent in the hello
    /// (use TLS); without `user`.
    pub token: Option<String>,
    /// How long `connect` waits for the first handshake. This and the
    /// other durations here are taken as at most a century (so
    /// `Duration::MAX` means never).
    pub connect_timeout: Duration,
    /// Reconnect after a lost connection (with backoff up to `max_backoff`).
    pub reconnect: bool,
    pub max_backoff: Duration,
    /// Publishes buffered while disconnected or pushed back, in bytes.
    pub max_pending_bytes: usize,
    /// Messages queued per subscription before the policy applies.
    pub subscription_queue: usize,
    /// What a full subscription queue does. Best-effort subscriptions
    /// always drop their oldest: waiting for one under `block` would stop
    /// the client's loop, and with it its reliable traffic, for a class
    /// whose messages may be lost anyway.
    pub slow_consumer: SlowConsumerPolicy,
    /// How long `publish` waits when the outgoing buffer is full, and,
    /// under [`SlowConsumerPolicy::Block`], how long the client's loop
    /// waits for room in a full subscription before it drops the message
    /// (counted; the messages after it are dropped at once until the
    /// reader takes one). The loop reads and answers nothing while it waits, so
    /// keep this below the server's heartbeat timeout (10 s by default),
    /// or the server takes the client for dead.
    pub block_timeout: Duration,
    pub heartbeat_interval: Duration,
    pub heartbeat_timeout: Duration,
    /// Largest frame accepted from the server, and sent to it: a publish
    /// whose frame would be larger is refused (`PayloadTooLarge`), whatever
    /// the server's payload limit.
    pub max_frame: usize,
    /// Subject limits checked before the server's welcome; from then on
    /// the server's own (which it sends in the welcome) apply.
    pub subject_limits: SubjectLimits,
    /// Data endpoints to open (`efa-rdm`, `efa-dgram`) and offer the
    /// server, those `preference` lists (the others are left closed); the
    /// handshake decides, per that list, which carry traffic.
    pub data_paths: Vec<String>,
    /// libfabric settings for the data endpoints.
    pub fabric: crate::config::Fabric,
    /// Data paths in order of preference (as the server's config).
    pub preference: Vec<String>,
    /// TESTING AID, never in production: inject faults into this client's
    /// endpoints (`[testing.faults]` of a config file).
    pub faults: Option<crate::config::Faults>,
    /// Bytes the data links may hold together for reordering and
    /// reassembly (as the server's `limits.max_link_memory`); a link that
    /// would need more drops the connection. At least `max_frame`.
    pub max_link_memory: usize,
    /// TLS towards a `tcp` server: with `ca` set the connection speaks TLS
    /// and verifies the server's certificate against it (for the host
    /// dialed, or `server_name`); `cert` and `key` are presented when the
    /// server asks for a client certificate. `verify_clients` is a
    /// server's setting and does nothing here.
    pub tls: crate::config::Tls,
    /// Whether this client's own subscriptions receive what it publishes
    /// (true by default, as in NATS).
    pub echo: bool,
    /// How long a scheme whose data link carried nothing back is not
    /// offered to this server (60 s by default): the first reconnection
    /// after that offers it again, so a broker restarted with mended
    /// provider settings gets its fabric clients back. Each time the same
    /// scheme goes silent again before a link on it carried something
    /// back, the pause doubles, up to an hour (or this, if longer). Zero
    /// offers it again at every reconnection.
    pub silent_link_retry: Duration,
}

impl ClientOptions {
    /// Refuse what the wire could not carry (the hello holds the name and
    /// the credentials; a subscribe holds a pattern of up to the subject
    /// limit), so a bad value is an error here rather than a failure later.
    /// The options with every duration at most [`LONGEST_WAIT`], so a
    /// deadline computed from one always fits an `Instant`.
    fn with_waits_bounded(mut self) -> ClientOptions {
        for wait in [
            &mut self.connect_timeout,
            &mut self.max_backoff,
            &mut self.block_timeout,
            &mut self.heartbeat_interval,
            &mut self.heartbeat_timeout,
            &mut self.silent_link_retry,
        ] {
            *wait = (*wait).min(LONGEST_WAIT);
        }
        self
    }

    fn check(&self) -> Result<(), Error> {
        use crate::config::{MAX_NAME_LEN, MAX_SECRET_LEN, MAX_SUBJECT_LEN_LIMIT};
        let invalid = |key: &str, message: String| {
            Error::Config(crate::config::ConfigError::Invalid {
                origin: "client options".to_string(),
                line: None,
                key: key.to_string(),
                message,
            })
        };
        if self.name.len() > MAX_NAME_LEN {
            return Err(invalid(
                "name",
                format!("is {} bytes; at most {MAX_NAME_LEN}", self.name.len()),
            ));
        }
        if let Some(secret) = self.credentials.as_deref() {
            if secret.len() > MAX_SECRET_LEN {
                return Err(invalid(
                    "credentials",
                    format!("is {} bytes; at most {MAX_SECRET_LEN}", secret.len()),
                ));
            }
        }
        let one_frame = efabus_core::fragment::ReassemblyConfig::reservation_for(self.max_frame);
        if self.max_link_memory < one_frame {
            return Err(invalid(
                "max_link_memory",
                format!(
                    "is {}; at least {one_frame}, what putting together one frame of max_frame \
                     ({}) takes",
                    self.max_link_memory, self.max_frame
                ),
            ));
        }
        if self.tls.is_set() && self.tls.ca.is_none() {
            return Err(invalid(
                "tls.ca",
                "a client connects with TLS only when it has the authority to verify the \
                 server with"
                    .to_string(),
            ));
        }
        if self.tls.cert.is_some() != self.tls.key.is_some() {
            return Err(invalid(
                "tls.cert",
                "a client certificate needs its key: give tls.cert and tls.key".to_string(),
            ));
        }
        let max_len = self.subject_limits.max_len;
        if max_len == 0 || max_len > MAX_SUBJECT_LEN_LIMIT {
            return Err(invalid(
                "subject_limits.max_len",
                format!("is {max_len}; the allowed range is 1 to {MAX_SUBJECT_LEN_LIMIT}"),
            ));
        }
        Ok(())
    }
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            name: format!("efabus-client-{}", std::process::id()),
            user: None,
            credentials: None,
            token: None,
            connect_timeout: Duration::from_secs(5),
            reconnect: true,
            max_backoff: Duration::from_secs(2),
            max_pending_bytes: 8 << 20,
            subscription_queue: 65_536,
            slow_consumer: SlowConsumerPolicy::DropOldest,
            block_timeout: Duration::from_secs(2),
            heartbeat_interval: Duration::from_secs(2),
            heartbeat_timeout: Duration::from_secs(10),
            max_frame: (64 << 20) + 4096,
            subject_limits: SubjectLimits::default(),
            data_paths: Vec::new(),
            fabric: crate::config::Fabric::default(),
            preference: crate::config::Negotiation::default().preference,
            faults: None,
            max_link_memory: 512 << 20,
            tls: crate::config::Tls::default(),
            echo: true,
            silent_link_retry: Duration::from_secs(60),
        }
    }
}

impl ClientOptions {
    /// Options taken from a config file: the name, the shared secret, the
    /// limits and slow-consumer policy, heartbeats, the preference list,
    /// the `[fabric]` table, `[testing.faults]` (a testing aid), and as data
    /// paths the `efa-rdm`, `efa-dgram` and `shm` entries of `listen`.
    pub fn from_config(config: &crate::Config) -> ClientOptions {
        ClientOptions {
            name: config.name.clone(),
            credentials: config.auth.secret.clone(),
            max_pending_bytes: config.limits.max_pending_bytes,
            subscription_queue: config.limits.subscription_queue,
            slow_consumer: config.slow_consumer.policy,
            block_timeout: config.block_timeout(),
            heartbeat_interval: config.heartbeat_interval(),
            heartbeat_timeout: config.heartbeat_timeout(),
            max_frame: config.max_frame(),
            subject_limits: SubjectLimits {
                max_len: config.limits.max_subject_len,
                max_tokens: config.limits.max_subject_tokens,
            },
            data_paths: config
                .listen
                .iter()
                .filter(|spec| endpoints::is_data_scheme(endpoints::scheme_of(spec)))
                .cloned()
                .collect(),
            fabric: config.fabric.clone(),
            preference: config.negotiation.preference.clone(),
            faults: config.testing.faults.clone(),
            max_link_memory: config.limits.max_link_memory,
            tls: config.tls.clone(),
            ..ClientOptions::default()
        }
    }
}

#[derive(Debug, Default)]
struct LinkCounters {
    fabric_in: AtomicU64,
    control_in: AtomicU64,
    fabric_out: AtomicU64,
    best_effort_lost: AtomicU64,
    bad_link_frames: AtomicU64,
    credit_waits: AtomicU64,
    link_memory_refusals: AtomicU64,
    link_gap_failures: AtomicU64,
    link_send_failures: AtomicU64,
    silent_data_links: AtomicU64,
    unacknowledged_at_close: AtomicU64,
    discarded_at_close: AtomicU64,
    driven_rounds: AtomicU64,
}

/// Which paths carry a client's traffic, as negotiated in the last handshake.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkReport {
    /// The reliable path: a data link's description, or the control link's scheme.
    pub reliable: String,
    /// The best-effort path, when it is a separate datagram link.
    pub best_effort: Option<String>,
    /// Why other candidates were not chosen.
    pub reasons: Vec<String>,
    /// Frames received over fabric data links since the client started.
    pub fabric_frames_in: u64,
    /// Frames received over the control link since the client started.
    pub control_frames_in: u64,
    /// Frames sent over the reliable fabric data link.
    pub fabric_frames_out: u64,
    /// Best-effort messages the datagram links gave up on (gaps,
    /// expiries, and those unsettled when a link closed) since the client
    /// started.
    pub best_effort_lost: u64,
    /// Credit and probe frames from the broker that did not decode on the
    /// datagram link since the client started (ignored, a later credit or
    /// probe carrying what they would have said).
    pub bad_link_frames: u64,
    /// Sends that found the broker's credit window full on the reliable
    /// fabric data link (the frame waited in the client).
    pub credit_waits: u64,
    /// This client's address on the reliable data link's endpoint, as hex.
    pub fabric_address: Option<String>,
    /// The id the broker gave this client's data links: every message to
    /// the broker on them carries it. Not a secret: the keys are.
    pub server_link_id: Option<u64>,
    /// Connections dropped because the reliable data link would have held
    /// more than its memory bound, or with the best-effort link more than
    /// `max_link_memory`.
    pub link_memory_refusals: u64,
    /// Connections dropped because a message from the broker went missing
    /// on the reliable data link: frames waited behind it longer than
    /// `fabric.reliable_gap_timeout_ms`.
    pub link_gap_failures: u64,
    /// Connections dropped because a send on the reliable data link failed
    /// part-way (the broker would have waited for the lost frame).
    pub link_send_failures: u64,
    /// Connections dropped because the reliable data link carried nothing
    /// back within `connect_timeout` of its first frame; its scheme is not
    /// offered to this server for `ClientOptions::silent_link_retry` (the
    /// reason is in `reasons` meanwhile).
    pub silent_data_links: u64,
    /// Frames sent (or numbered and queued) on a reliable data link that
    /// the broker had not acknowledged when the connection was lost: the
    /// broker may have taken them (its credit still to come) or not, and
    /// they are not sent again. Each frame of a run of small ones counts on
    /// its own. A client's own close counts them only when the server had
    /// not confirmed them by the end of `shutdown`'s flush.
    pub unacknowledged_at_close: u64,
    /// Publishes this client still held when it closed (waiting for the
    /// connection, or pushed back by the server), discarded with it:
    /// `shutdown` flushes for at most a second first.
    pub discarded_at_close: u64,
    /// Rounds of the client's event loop run by application threads while
    /// they waited for a reply or a subscription's next message, rather
    /// than by the client's own thread.
    pub driven_rounds: u64,
}

/// Connection state, readable by application threads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionState {
    Connecting,
    Connected {
        server: String,
    },
    /// Refused by the server (wrong credentials, version); not retried.
    Refused {
        code: ErrorCode,
        text: String,
    },
    /// The first connection failed (refused, unreachable) and the client
    /// does not reconnect.
    Unreachable {
        reason: String,
    },
    Closed,
}

/// Work for the loop that is not a publish.
enum Command {
    Subscribe {
        sid: u64,
    },
    Unsubscribe {
        sid: u64,
    },
    /// Answered once the server's pong comes, or with `NotConnected`
    /// when the connection is lost first.
    Flush(Sender<Result<(), Error>>),
}

/// One entry of the outbox, in the order application threads made them.
enum Item {
    /// Whole frames back to back, and how many.
    Run(Bytes, usize),
    /// One frame whose payload is shared, not copied.
    Frame(OutFrame),
    Command(Command),
}

/// What application threads hand to the loop (see the module docs).
struct Outbox {
    /// Frames encoded back to back since the last item.
    open: BytesMut,
    /// Frames in `open`.
    open_frames: usize,
    /// Most bytes of frames a run holds: what the path the loop sends on
    /// takes as one piece ([`DataLinks::run_limit`]), kept by the loop, so
    /// that a run goes without being read again.
    ///
    /// [`DataLinks::run_limit`]: crate::session::data_link::DataLinks::run_limit
    run_limit: usize,
    items: VecDeque<Item>,
    /// Frame bytes in `open` and `items`, bounded by `max_pending_bytes`.
    bytes: usize,
    /// The subject last validated by a publisher: a stream of publishes on
    /// one subject validates it once.
    valid_subject: String,
    /// Size of the last closed run: the room the next one starts with.
    run_hint: usize,
    /// The loop sleeps with nothing queued or pending: the next publish may
    /// go to the wire on the publisher's own thread.
    loop_idle: bool,
    /// Where such a publish goes: the connection's direct sender while the
    /// control link carries the traffic and has one.
    direct: Option<Arc<dyn DirectSend>>,
    /// The client is closing: no publish is taken any more, so what the
    /// close counts is all there is.
    closing: Closing,
}

/// How far a client's close has come, as its publishers see it.
#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Closing {
    #[default]
    Open,
    /// `shutdown` began; the server confirmed every publish taken before.
    Flushed,
    /// `shutdown` began and its flush was not confirmed, or the loop ended
    /// without it.
    Unconfirmed,
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox {
            open: BytesMut::new(),
            open_frames: 0,
            // No path yet: no limit of its own.
            run_limit: usize::MAX,
            items: VecDeque::new(),
            bytes: 0,
            valid_subject: String::new(),
            run_hint: 0,
            loop_idle: false,
            direct: None,
            closing: Closing::Open,
        }
    }
}

impl Outbox {
    fn is_empty(&self) -> bool {
        self.open.is_empty() && self.items.is_empty()
    }

    /// `Publish` frames it holds.
    fn publishes(&self) -> u64 {
        let items = self.items.iter().map(|item| match item {
            Item::Run(run, _) => outbound::publishes_in(run, true),
            Item::Frame(frame) => outbound::publishes_in(&frame.head, false),
            Item::Command(_) => 0,
        });
        items.sum::<u64>() + outbound::publishes_in(&self.open, true)
    }

    /// Room for `need` more bytes in the open run: a run never grows its
    /// buffer (growing copies, and large buffers come from fresh pages)
    /// nor passes `run_limit`; it ends where its room does, and the next
    /// starts with twice the last one's size, within the limit.
    fn make_room(&mut self, need: usize) {
        let len = self.open.len() + need;
        if !self.open.is_empty() && (len > self.open.capacity() || len > self.run_limit) {
            self.close_run();
        }
        if self.open.capacity() < need {
            let room = (self.run_hint * 2).clamp(RUN_MIN, RUN_MAX);
            self.open.reserve(room.min(self.run_limit).max(need));
        }
    }

    /// Turn the open frames into an item, so what follows queues behind
    /// them.
    fn close_run(&mut self) {
        if !self.open.is_empty() {
            let run = std::mem::take(&mut self.open).freeze();
            self.run_hint = run.len();
            let frames = std::mem::take(&mut self.open_frames);
            self.items.push_back(Item::Run(run, frames));
        }
    }
}

struct ClientSub {
    pattern: String,
    queue: Option<String>,
    class: DeliveryClass,
    /// Shared, so a delivery that may wait for its reader (under `block`)
    /// is made without holding the table.
    sink: Arc<LocalSink>,
}

struct ClientShared {
    server: String,
    /// Marks this client's responders' replies
    /// ([`crate::delivery::new_answer_origin`]).
    answer_origin: usize,
    options: ClientOptions,
    outbox: Mutex<Outbox>,
    /// Publishers wait here for room in the outbox.
    room: Condvar,
    parker: Parker,
    shutdown: AtomicBool,
    subscriptions: Mutex<HashMap<u64, ClientSub>>,
    next_sid: AtomicU64,
    state: Mutex<ConnectionState>,
    state_changed: Condvar,
    max_payload: AtomicU64,
    /// The server's subject limits from its welcome (the options' until
    /// then): what publishes and subscriptions are checked against.
    max_subject_len: AtomicUsize,
    max_subject_tokens: AtomicUsize,
    reconnects: AtomicU64,
    /// Why the connection was lost for good (no reconnection).
    closed_because: Mutex<Option<String>>,
    /// Errors the server reported without closing (a refused publish or
    /// subscription), the latest [`SERVER_ERRORS_KEPT`].
    server_errors: Mutex<VecDeque<(ErrorCode, String)>>,
    inbox_prefix: String,
    /// The subscription id of the shared reply inbox, once subscribed.
    inbox_sid: Mutex<Option<u64>>,
    /// The same id for the loop, read per message without a lock (0: none).
    inbox_sid_seen: AtomicU64,
    /// Requests waiting for a reply, by the token in their reply subject.
    replies: Mutex<HashMap<u64, Sender<Message>>>,
    /// How long a request yields before it sleeps waiting for its reply,
    /// adapted to the last round trip.
    reply_window: Mutex<YieldWindow>,
    /// The negotiated paths (changes once per handshake).
    link: Mutex<LinkReport>,
    /// Where the loop's round under way is ([`Client::stalled_round`]),
    /// and its endpoints' names: the server's, then the data schemes.
    round_watch: Arc<RoundWatch>,
    endpoint_names: Vec<String>,
    /// Traffic counters, updated per frame without a lock.
    counters: LinkCounters,
    /// The session, for threads that drive it while they wait.
    session: DriveHandle<ClientLoop>,
}

impl ClientShared {
    /// Queue a command behind everything published so far, waiting up to
    /// the block timeout while [`MAX_ITEMS`] items wait already.
    fn send_command(&self, command: Command) -> Result<(), Error> {
        if self.shutdown.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        let mut outbox = self.outbox.lock();
        // An unsubscribe (at most one per subscription made) goes in
        // whatever the outbox holds: dropping a subscription must neither
        // wait nor, refused, leave the server sending what nobody reads.
        let bounded = !matches!(command, Command::Unsubscribe { .. });
        if bounded && outbox.items.len() >= MAX_ITEMS {
            self.wait_for_room(&mut outbox, |outbox| outbox.items.len() >= MAX_ITEMS)?;
        }
        let was_empty = outbox.is_empty();
        outbox.close_run();
        outbox.items.push_back(Item::Command(command));
        drop(outbox);
        self.wake_loop(was_empty);
        Ok(())
    }

    /// Hand `message` to subscription `sid`; true if that cut it off (a
    /// slow consumer under `disconnect`, or its reader gone) and removed it
    /// here, so the server is to stop sending (unless an unsubscribe made
    /// meanwhile removed it). `table` is the subscription table if held,
    /// taken once for a batch. Under `block` a sink may wait for its
    /// reader, who may need the table meanwhile (to subscribe, make a
    /// first request, or drop another subscription), so it is not held
    /// across such a delivery.
    fn deliver_to<'a>(
        &'a self,
        table: &mut Option<MutexGuard<'a, HashMap<u64, ClientSub>>>,
        sid: u64,
        message: Message,
    ) -> bool {
        self.to_sink(table, sid, |sink| sink.deliver(message) == Delivery::Closed)
    }

    /// Runs `deliver` with the sink of subscription `sid` (nothing when it
    /// is gone, as [`deliver_to`](Self::deliver_to) says of the table);
    /// when it says the queue is closed, the subscription is removed here
    /// and the answer is whether this removed it.
    fn to_sink<'a>(
        &'a self,
        table: &mut Option<MutexGuard<'a, HashMap<u64, ClientSub>>>,
        sid: u64,
        deliver: impl FnOnce(&LocalSink) -> bool,
    ) -> bool {
        let closed = if self.options.slow_consumer == SlowConsumerPolicy::Block {
            *table = None;
            let sink = self
                .subscriptions
                .lock()
                .get(&sid)
                .map(|sub| sub.sink.clone());
            let Some(sink) = sink else {
                return false;
            };
            deliver(&sink)
        } else {
            let subscriptions = table.get_or_insert_with(|| self.subscriptions.lock());
            let Some(sub) = subscriptions.get(&sid) else {
                return false;
            };
            if sub.sink.is_answering() {
                // A handler may subscribe or drop a handle, which takes
                // the table.
                let sink = sub.sink.clone();
                *table = None;
                deliver(&sink)
            } else {
                deliver(&sub.sink)
            }
        };
        closed
            && table
                .get_or_insert_with(|| self.subscriptions.lock())
                .remove(&sid)
                .is_some()
    }

    /// Nothing more will arrive: subscriptions end after what they hold,
    /// and requests still waiting fail now instead of at their timeout.
    fn end_streams(&self) {
        self.subscriptions.lock().clear();
        self.replies.lock().clear();
    }

    /// Answers the flushes still waiting in the outbox with `error` (and
    /// takes them out).
    fn answer_queued_flushes(&self, error: impl Fn() -> Error) {
        let mut outbox = self.outbox.lock();
        outbox.items.retain(|item| match item {
            Item::Command(Command::Flush(done)) => {
                let _ = done.send(Err(error()));
                false
            }
            _ => true,
        });
    }

    /// Nothing will move on this client again (refused for good, or its
    /// loop ended): what is asked of it from now on fails at once
    /// (`Closed`) rather than waiting on a loop that has stopped. Commands
    /// waiting get no answer (a flush then says `Closed`), publishers
    /// waiting for room wake to find the client shut, requests waiting
    /// fail and subscriptions end after what they hold. False if it was
    /// shut down already.
    fn end_for_good(&self) -> bool {
        if self.shutdown.swap(true, Ordering::SeqCst) {
            return false;
        }
        self.outbox
            .lock()
            .items
            .retain(|item| !matches!(item, Item::Command(_)));
        self.room.notify_all();
        self.end_streams();
        true
    }

    /// The subject limits in force: the server's once welcomed.
    fn subject_limits(&self) -> SubjectLimits {
        SubjectLimits {
            max_len: self.max_subject_len.load(Ordering::Relaxed),
            max_tokens: self.max_subject_tokens.load(Ordering::Relaxed),
        }
    }

    /// Encode a publish into the outbox, waiting up to the block timeout
    /// for room.
    fn enqueue_publish(
        &self,
        subject: &str,
        reply: Option<&str>,
        headers: Option<Bytes>,
        payload: Bytes,
    ) -> Result<(), Error> {
        if self.shutdown.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        let mut outbox = self.outbox.lock();
        if outbox.closing != Closing::Open {
            return Err(Error::Closed);
        }
        // Read under the outbox's lock, which a welcome's new limits take
        // to clear the subject checked last.
        let limits = &self.subject_limits();
        let check = |s: &str| {
            subject::validate_subject(s, limits).map_err(|source| Error::Subject {
                subject: s.to_string(),
                source,
            })
        };
        if outbox.valid_subject != subject {
            check(subject)?;
            outbox.valid_subject.clear();
            outbox.valid_subject.push_str(subject);
        }
        if let Some(reply) = reply {
            check(reply)?;
        }
        let max = self.max_payload.load(Ordering::Relaxed);
        // Headers count with the body, as NATS counts them; the frame
        // carries them joined in front of it.
        let len = payload.len() + headers.as_ref().map_or(0, Bytes::len);
        let fields = RoutedFields {
            subject,
            reply,
            headers: headers.is_some(),
        };
        let payload = match &headers {
            Some(block) => codec::join_headers(block, &payload),
            None => payload,
        };
        if len as u64 > max {
            return Err(Error::PayloadTooLarge { len, max });
        }
        // The server's limit may pass what this client's own frames carry:
        // such a frame would be refused by its connection.
        let frame_len = codec::FRAME_OVERHEAD
            + codec::PUBLISH_HEADER_LEN
            + subject.len()
            + reply.map_or(0, str::len)
            + payload.len();
        if frame_len > self.options.max_frame {
            let max = self.options.max_frame.saturating_sub(frame_len - len);
            return Err(Error::PayloadTooLarge {
                len,
                max: max as u64,
            });
        }
        let bound = self.options.max_pending_bytes;
        if outbox.bytes >= bound || outbox.items.len() >= MAX_ITEMS {
            self.wait_for_room(&mut outbox, |outbox| {
                outbox.bytes >= bound || outbox.items.len() >= MAX_ITEMS
            })?;
            // The close may have begun while this waited: what it counts
            // is all there is.
            if outbox.closing != Closing::Open {
                return Err(Error::Closed);
            }
        }
        let was_empty = outbox.is_empty();
        let encoded = if payload.len() <= COPY_MAX {
            outbox.make_room(frame_len);
            let before = outbox.open.len();
            let result =
                codec::routed_into(&mut outbox.open, FrameKind::Publish, 0, fields, &payload);
            result.map(|()| {
                outbox.open_frames += 1;
                outbox.open.len() - before
            })
        } else {
            let mut head = BytesMut::new();
            let result =
                codec::routed_head_into(&mut head, FrameKind::Publish, 0, 0, fields, payload.len());
            result.map(|()| {
                let frame = OutFrame {
                    head: head.freeze(),
                    body: payload,
                };
                let len = frame.len();
                outbox.close_run();
                outbox.items.push_back(Item::Frame(frame));
                len
            })
        };
        // Subjects and payloads are checked against limits narrower than
        // the wire fields above; this only fails with absurd limits.
        let len = encoded.map_err(|err| {
            Error::Transport(efabus_core::transport::TransportError::Other(
                err.to_string(),
            ))
        })?;
        outbox.bytes += len;
        if was_empty && outbox.loop_idle {
            // The loop sleeps with nothing queued: send on this thread
            // rather than wake it (once per sleep; a stream of publishes
            // wakes it for the next one and then leaves the sending to it).
            outbox.loop_idle = false;
            if let Some(direct) = outbox.direct.clone() {
                outbox.close_run();
                if let Some(item) = outbox.items.pop_front() {
                    let result = match &item {
                        Item::Run(run, _) => direct.send_run(run.clone()),
                        Item::Frame(frame) => direct.send(frame.clone()),
                        Item::Command(_) => Err(SendError::Closed(PeerId(0))),
                    };
                    if result.is_ok() {
                        outbox.bytes -= len;
                        return Ok(());
                    }
                    // Refused (full, or the link is going): the loop
                    // takes it as any other publish.
                    outbox.items.push_front(item);
                }
            }
        }
        drop(outbox);
        self.wake_loop(was_empty);
        Ok(())
    }

    /// Tells the loop thread of what was just queued for it: from waiting
    /// for events if the outbox was empty (a stream wakes it once), and
    /// from sleeping while a driver holds the loop whatever it held (that
    /// check is cheap; see [`DriveHandle::wake_sleeper`]).
    fn wake_loop(&self, was_empty: bool) {
        if was_empty {
            self.parker.wake_if_parked();
        }
        self.session.wake_sleeper();
    }

    /// Wait (up to the block timeout) while the outbox is `full`.
    fn wait_for_room(
        &self,
        outbox: &mut MutexGuard<'_, Outbox>,
        full: impl Fn(&Outbox) -> bool,
    ) -> Result<(), Error> {
        let timeout = self.options.block_timeout;
        let deadline = Instant::now() + timeout;
        self.parker.wake();
        crate::drive::before_blocking(|| self.session.wake_sleeper());
        while full(outbox) {
            if self.shutdown.load(Ordering::Relaxed) {
                return Err(Error::Closed);
            }
            if self.room.wait_until(outbox, deadline).timed_out() && full(outbox) {
                return Err(Error::Blocked(timeout));
            }
        }
        Ok(())
    }

    fn set_state(&self, state: ConnectionState) {
        *self.state.lock() = state;
        self.state_changed.notify_all();
    }

    /// Run the session on this thread while it waits (see [`Driven`]);
    /// false when no round ran (the caller yields instead).
    fn drive(&self, reader: bool, until: Instant, ready: &dyn Fn() -> bool) -> bool {
        let rounds = self.session.drive(reader, until, ready, &self.shutdown);
        self.counters
            .driven_rounds
            .fetch_add(rounds, Ordering::Relaxed);
        rounds > 0
    }
}

impl SubscriptionOwner for ClientShared {
    fn unsubscribe(&self, sid: u64) {
        if self.subscriptions.lock().remove(&sid).is_some() {
            // After shutdown there is no server to tell.
            let _ = self.send_command(Command::Unsubscribe { sid });
        }
    }

    fn drive(&self, _sid: u64, until: Instant, ready: &dyn Fn() -> bool) -> bool {
        ClientShared::drive(self, true, until, ready)
    }

    fn would_drive(&self, _sid: u64) -> bool {
        self.session.reader_would_drive()
    }
}

/// A connection to a remote broker, with the same operations as the
/// embedded [`crate::Broker`]. `Send + Sync`; share it by reference or `Arc`.
pub struct Client {
    shared: Arc<ClientShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.shared.server)
            .field("state", &*self.shared.state.lock())
            .finish()
    }
}

/// How much longer than the connect timeout `connect` waits for the
/// client loop to say why the handshake failed.
const VERDICT_GRACE: Duration = Duration::from_secs(1);

impl Client {
    /// Connect to a broker at an endpoint string such as `tcp/10.0.0.7:7420`.
    pub fn connect(endpoint: &str) -> Result<Client, Error> {
        Client::connect_with(
            endpoint,
            ClientOptions::default(),
            Registry::with_builtins(),
        )
    }

    /// Connect with explicit options and transports.
    pub fn connect_with(
        endpoint: &str,
        options: ClientOptions,
        registry: Registry,
    ) -> Result<Client, Error> {
        options.check()?;
        let options = options.with_waits_bounded();
        let spec = EndpointSpec::parse(endpoint).map_err(|err| Error::Endpoint {
            endpoint: endpoint.to_string(),
            source: err.into(),
        })?;
        let address = spec.address().unwrap_or_default().to_string();
        let tls = if spec.scheme() == efabus_transports::tcp::SCHEME {
            options.tls.endpoint_options()
        } else {
            Vec::new()
        };
        let endpoint_config = EndpointConfig {
            bind: None,
            max_frame: options.max_frame,
            queue_frames: 65_536,
            queue_bytes: options.max_pending_bytes.min(4 << 20),
            fabric: None,
            options: tls,
        };
        // The endpoint only connects out: open it without the spec's address,
        // which names the server, not a place to bind.
        let endpoint_box = registry
            .get(spec.scheme())
            .and_then(|transport| {
                transport
                    .open(&endpoint_config)
                    .map_err(|source| RegistryError::Transport {
                        spec: spec.to_string(),
                        source,
                    })
            })
            .map_err(|source| Error::Endpoint {
                endpoint: endpoint.to_string(),
                source,
            })?;
        let endpoint_box = crate::endpoints::with_faults(endpoint_box, options.faults.as_ref(), 0);
        let poll = Poll::new().map_err(Error::Thread)?;
        let waker = Waker::new(poll.registry(), WAKER).map_err(Error::Thread)?;
        if let Some(fd) = endpoint_box.readiness().fd() {
            poll.registry()
                .register(&mut SourceFd(&fd), ENDPOINT, Interest::READABLE)
                .map_err(Error::Thread)?;
        }
        let mut data = Vec::new();
        let mut unavailable = Vec::new();
        for text in &options.data_paths {
            // A path the preference leaves out would never carry traffic
            // (and must not be offered: the server would open its side).
            let scheme = endpoints::scheme_of(text);
            if !options
                .preference
                .iter()
                .any(|preferred| preferred == scheme)
            {
                unavailable.push(format!("{scheme}: not in the preference list; not opened"));
                continue;
            }
            match open_data_endpoint(&registry, text, &options) {
                Ok(endpoint) => {
                    let index = 1 + data.len();
                    let endpoint =
                        crate::endpoints::with_faults(endpoint, options.faults.as_ref(), index);
                    if let Some(fd) = endpoint.readiness().fd() {
                        poll.registry()
                            .register(
                                &mut SourceFd(&fd),
                                Token(DATA_TOKENS + data.len()),
                                Interest::READABLE,
                            )
                            .map_err(Error::Thread)?;
                    }
                    data.push(endpoint);
                }
                Err(reason) => {
                    warn!(endpoint = %text, %reason, "data path unavailable; the control link will carry its traffic");
                    unavailable.push(format!("{text}: {reason}"));
                }
            }
        }
        // And those the preference names but no data path opens are not
        // offered either: say how to offer them.
        let unlisted: Vec<&str> = options
            .preference
            .iter()
            .map(String::as_str)
            .filter(|&scheme| {
                crate::endpoints::is_data_scheme(scheme)
                    && !options
                        .data_paths
                        .iter()
                        .any(|text| endpoints::scheme_of(text) == scheme)
            })
            .collect();
        if !unlisted.is_empty() {
            unavailable.push(format!(
                "{}: preferred but not among this client's data paths (`listen` in its \
                 config, `ClientOptions::data_paths`); not opened",
                unlisted.join(", ")
            ));
        }
        let connect_timeout = options.connect_timeout;
        let subject_limits = options.subject_limits;
        let shared = Arc::new(ClientShared {
            answer_origin: crate::delivery::new_answer_origin(),
            server: endpoint.to_string(),
            inbox_prefix: format!("_INBOX.{:016x}", unique_seed()),
            inbox_sid: Mutex::new(None),
            inbox_sid_seen: AtomicU64::new(0),
            replies: Mutex::new(HashMap::default()),
            reply_window: Mutex::new(YieldWindow::new(options.fabric.polling.spin())),
            options,
            outbox: Mutex::new(Outbox::default()),
            room: Condvar::new(),
            parker: Parker::new(waker),
            shutdown: AtomicBool::new(false),
            subscriptions: Mutex::new(HashMap::default()),
            next_sid: AtomicU64::new(1),
            state: Mutex::new(ConnectionState::Connecting),
            state_changed: Condvar::new(),
            max_payload: AtomicU64::new(u64::MAX),
            max_subject_len: AtomicUsize::new(subject_limits.max_len),
            max_subject_tokens: AtomicUsize::new(subject_limits.max_tokens),
            reconnects: AtomicU64::new(0),
            closed_because: Mutex::new(None),
            server_errors: Mutex::new(VecDeque::new()),
            link: Mutex::new(LinkReport::default()),
            round_watch: Arc::new(RoundWatch::new()),
            endpoint_names: std::iter::once(endpoint.to_string())
                .chain(data.iter().map(|data| data.scheme().to_string()))
                .collect(),
            counters: LinkCounters::default(),
            session: DriveHandle::new(),
        });
        shared.link.lock().reasons = unavailable;
        let wake = {
            let shared = shared.clone();
            move || shared.parker.wake_if_parked()
        };
        let round_watch = shared.round_watch.clone();
        let session = shared.session.install(
            ClientLoop::new(shared.clone(), endpoint_box, data, address),
            wake,
            move || round_watch.ended_by_panic(),
        );
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("efabus-client".into())
                .spawn(move || run_loop(&session, &shared, poll))
                .map_err(Error::Thread)?
        };
        let client = Client {
            shared,
            thread: Mutex::new(Some(thread)),
        };
        if let Err(err) = client.wait_connected(connect_timeout) {
            // Never connected: skip the flush `Drop` would otherwise wait on.
            client.shared.shutdown.store(true, Ordering::SeqCst);
            return Err(err);
        }
        Ok(client)
    }

    fn wait_connected(&self, timeout: Duration) -> Result<(), Error> {
        // The loop's handshake deadline is the same timeout: a moment more
        // lets its verdict, with the reason, arrive first.
        let deadline = Instant::now() + timeout + VERDICT_GRACE;
        let mut state = self.shared.state.lock();
        loop {
            match &*state {
                ConnectionState::Connected { .. } => return Ok(()),
                ConnectionState::Refused { code, text } => {
                    return Err(Error::Refused {
                        code: *code,
                        text: text.clone(),
                    })
                }
                ConnectionState::Unreachable { reason } => {
                    return Err(Error::Unreachable {
                        server: self.shared.server.clone(),
                        reason: reason.clone(),
                    })
                }
                ConnectionState::Closed => return Err(Error::Closed),
                ConnectionState::Connecting => {}
            }
            if self
                .shared
                .state_changed
                .wait_until(&mut state, deadline)
                .timed_out()
            {
                return Err(Error::NotConnected(self.shared.server.clone()));
            }
        }
    }

    /// The current connection state.
    pub fn state(&self) -> ConnectionState {
        self.shared.state.lock().clone()
    }

    /// Why a client that does not reconnect lost its connection, or whose
    /// loop ended, once it has (`ConnectionState::Closed` after being
    /// connected).
    pub fn closed_because(&self) -> Option<String> {
        self.shared.closed_because.lock().clone()
    }

    /// The errors the server reported without closing the connection
    /// since the last call (a publish or subscription it refused: a
    /// payload over its limit, an invalid subject, a permission denied),
    /// oldest first; after a [`flush`](Self::flush), those about what was
    /// sent before it. At most the latest [`SERVER_ERRORS_KEPT`] are kept.
    pub fn take_errors(&self) -> Vec<(ErrorCode, String)> {
        self.shared.server_errors.lock().drain(..).collect()
    }

    /// The paths negotiated for this connection and the traffic on them.
    pub fn link(&self) -> LinkReport {
        let counters = &self.shared.counters;
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        LinkReport {
            fabric_frames_in: get(&counters.fabric_in),
            control_frames_in: get(&counters.control_in),
            fabric_frames_out: get(&counters.fabric_out),
            best_effort_lost: get(&counters.best_effort_lost),
            bad_link_frames: get(&counters.bad_link_frames),
            credit_waits: get(&counters.credit_waits),
            link_memory_refusals: get(&counters.link_memory_refusals),
            link_gap_failures: get(&counters.link_gap_failures),
            link_send_failures: get(&counters.link_send_failures),
            silent_data_links: get(&counters.silent_data_links),
            unacknowledged_at_close: get(&counters.unacknowledged_at_close),
            discarded_at_close: get(&counters.discarded_at_close),
            driven_rounds: get(&counters.driven_rounds),
            ..self.shared.link.lock().clone()
        }
    }

    /// How many times the connection was re-established.
    pub fn reconnects(&self) -> u64 {
        self.shared.reconnects.load(Ordering::Relaxed)
    }

    /// The largest payload the server accepts, from its welcome
    /// (`u64::MAX` before the first welcome).
    pub fn max_payload(&self) -> u64 {
        self.shared.max_payload.load(Ordering::Relaxed)
    }

    pub fn publish(&self, subject: &str, payload: impl Into<Bytes>) -> Result<(), Error> {
        self.publish_inner(subject, None, None, payload.into())
    }

    pub fn publish_request(
        &self,
        subject: &str,
        reply: &str,
        payload: impl Into<Bytes>,
    ) -> Result<(), Error> {
        self.publish_inner(subject, Some(reply), None, payload.into())
    }

    /// Publish with a header block (see [`efabus_core::headers`]) and, for a
    /// request, a reply subject. Subscribers on any session, NATS clients
    /// among them, receive the block as it is; it counts towards the
    /// server's `max_payload` with the payload. Bytes that are not a block
    /// (`NATS/1.0` first, an empty line last) are refused with
    /// [`Error::Headers`].
    pub fn publish_with_headers(
        &self,
        subject: &str,
        reply: Option<&str>,
        headers: impl Into<Bytes>,
        payload: impl Into<Bytes>,
    ) -> Result<(), Error> {
        let headers = headers.into();
        efabus_core::headers::check_block(&headers)?;
        self.publish_inner(subject, reply, Some(headers), payload.into())
    }

    fn publish_inner(
        &self,
        subject: &str,
        reply: Option<&str>,
        headers: Option<Bytes>,
        payload: Bytes,
    ) -> Result<(), Error> {
        self.shared
            .enqueue_publish(subject, reply, headers, payload)
    }

    pub fn subscribe(&self, pattern: &str) -> Result<Subscription, Error> {
        self.subscribe_inner(pattern, None, DeliveryClass::Reliable)
    }

    pub fn queue_subscribe(&self, pattern: &str, group: &str) -> Result<Subscription, Error> {
        self.subscribe_inner(pattern, Some(group), DeliveryClass::Reliable)
    }

    /// Subscribe in the best-effort class: messages travel over the
    /// negotiated datagram link (EFA DGRAM) where there is one, and may be
    /// lost (never corrupted or duplicated); without one they use the
    /// reliable path. Losses are counted in [`Client::link`].
    pub fn subscribe_best_effort(&self, pattern: &str) -> Result<Subscription, Error> {
        self.subscribe_inner(pattern, None, DeliveryClass::BestEffort)
    }

    /// Answer requests on `pattern` with `handler` on this client's loop
    /// thread (or a thread driving it), as [`crate::Broker::respond`] does
    /// on a broker's: no hand-over to a thread of the application. The
    /// handler must be quick and must not wait (no [`Client::request`] or
    /// [`Client::flush`] inside it); it returns its reply rather than
    /// publishing it (a publish from it waits up to the block timeout when
    /// the outbox is full: the loop that would empty it is running the
    /// handler). A reply over the server's payload limit is dropped and
    /// counted.
    pub fn respond<F>(&self, pattern: &str, handler: F) -> Result<Responder, Error>
    where
        F: Fn(&Message) -> Option<Bytes> + Send + Sync + 'static,
    {
        self.respond_inner(pattern, None, Arc::new(handler))
    }

    /// [`Client::respond`] as a member of a queue group.
    pub fn queue_respond<F>(
        &self,
        pattern: &str,
        group: &str,
        handler: F,
    ) -> Result<Responder, Error>
    where
        F: Fn(&Message) -> Option<Bytes> + Send + Sync + 'static,
    {
        self.respond_inner(pattern, Some(group), Arc::new(handler))
    }

    fn respond_inner(
        &self,
        pattern: &str,
        queue: Option<&str>,
        answer: crate::delivery::Answer,
    ) -> Result<Responder, Error> {
        let shared = &self.shared;
        let (sink, reader, stats) = LocalSink::answering(&answer, shared.answer_origin);
        let sid = self.add_subscription(pattern, queue, DeliveryClass::Reliable, sink)?;
        let owner: Arc<dyn SubscriptionOwner> = shared.clone();
        let responder = Responder::new(
            sid,
            pattern.to_string(),
            queue.map(str::to_string),
            reader,
            stats,
            owner,
            answer,
        );
        shared.send_command(Command::Subscribe { sid })?;
        Ok(responder)
    }

    fn subscribe_inner(
        &self,
        pattern: &str,
        queue: Option<&str>,
        class: DeliveryClass,
    ) -> Result<Subscription, Error> {
        let shared = &self.shared;
        let policy = match class {
            DeliveryClass::BestEffort => SlowConsumerPolicy::DropOldest,
            DeliveryClass::Reliable => shared.options.slow_consumer,
        };
        let (sink, rx, stats) = LocalSink::new(
            shared.options.subscription_queue,
            policy,
            shared.options.block_timeout,
        );
        let sid = self.add_subscription(pattern, queue, class, sink)?;
        let owner: Arc<dyn SubscriptionOwner> = shared.clone();
        let subscription = Subscription::new(
            sid,
            pattern.to_string(),
            queue.map(str::to_string),
            rx,
            stats,
            owner,
            shared.options.fabric.polling.spin(),
        );
        shared.send_command(Command::Subscribe { sid })?;
        Ok(subscription)
    }

    /// Checks the pattern and group and puts `sink` in the table under a
    /// new id; the caller makes the handle (whose drop removes it) before
    /// telling the loop to subscribe.
    fn add_subscription(
        &self,
        pattern: &str,
        queue: Option<&str>,
        class: DeliveryClass,
        sink: LocalSink,
    ) -> Result<u64, Error> {
        let shared = &self.shared;
        let limits = shared.subject_limits();
        subject::validate_pattern(pattern, &limits).map_err(|source| Error::Subject {
            subject: pattern.to_string(),
            source,
        })?;
        if let Some(group) = queue {
            subject::validate_queue_name(group, &limits).map_err(|source| Error::Subscription {
                pattern: pattern.to_string(),
                source: source.into(),
            })?;
        }
        let sid = shared.next_sid.fetch_add(1, Ordering::Relaxed);
        shared.subscriptions.lock().insert(
            sid,
            ClientSub {
                pattern: pattern.to_string(),
                queue: queue.map(str::to_string),
                class,
                sink: Arc::new(sink),
            },
        );
        Ok(sid)
    }

    /// Send a request and wait for the first reply.
    pub fn request(
        &self,
        subject: &str,
        payload: impl Into<Bytes>,
        timeout: Duration,
    ) -> Result<Message, Error> {
        // One wildcard inbox per client serves every request: a reply to
        // `<inbox>.<token>` is handed to the request waiting on that token.
        self.ensure_inbox()?;
        let token = self.shared.next_sid.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.shared.replies.lock().insert(token, tx);
        let reply_to = format!("{}.{token}", self.shared.inbox_prefix);
        // Sent by this thread's drive right after: the loop thread, asleep
        // for an earlier drive, is left asleep.
        let sent = crate::drive::before_driving(|| {
            self.publish_inner(subject, Some(&reply_to), None, payload.into())
        });
        let result = sent.and_then(|()| self.await_reply(&rx, timeout));
        // The server's answer when no subscription matched the request.
        let result = result.and_then(|reply| match &reply.headers {
            Some(block) if reply.payload.is_empty() && is_no_responders(block) => {
                Err(Error::NoResponders(subject.to_string()))
            }
            _ => Ok(reply),
        });
        self.shared.replies.lock().remove(&token);
        result
    }

    /// Wait for a request's reply: yielding the core for up to the window
    /// the last round trips suggest (a reply that comes meanwhile costs no
    /// wake-up), then sleeping.
    fn await_reply(
        &self,
        replies: &crossbeam_channel::Receiver<Message>,
        timeout: Duration,
    ) -> Result<Message, Error> {
        let started = Instant::now();
        let window = self.shared.reply_window.lock().get();
        let reply = loop {
            match replies.try_recv() {
                Ok(reply) => break Ok(reply),
                Err(crossbeam_channel::TryRecvError::Disconnected) => break Err(Error::Closed),
                Err(crossbeam_channel::TryRecvError::Empty) => {}
            }
            let waited = started.elapsed();
            if waited >= window.min(timeout) {
                break replies
                    .recv_timeout(timeout.saturating_sub(waited))
                    .map_err(|err| Error::waiting(err, timeout));
            }
            let until = started + window.min(timeout);
            if !self.shared.drive(false, until, &|| !replies.is_empty()) {
                std::thread::yield_now();
            }
        };
        if reply.is_ok() {
            self.shared.reply_window.lock().waited(started.elapsed());
        }
        reply
    }

    /// Subscribe the shared reply inbox once.
    fn ensure_inbox(&self) -> Result<(), Error> {
        let mut inbox = self.shared.inbox_sid.lock();
        if inbox.is_some() {
            return Ok(());
        }
        let pattern = format!("{}.*", self.shared.inbox_prefix);
        let sid = self.shared.next_sid.fetch_add(1, Ordering::Relaxed);
        // Replies are dispatched before reaching a sink; this one only
        // keeps the subscription listed for resubscription.
        let (sink, _unread, _) = LocalSink::new(1, SlowConsumerPolicy::DropOldest, Duration::ZERO);
        let sink = Arc::new(sink);
        self.shared.subscriptions.lock().insert(
            sid,
            ClientSub {
                pattern,
                queue: None,
                class: DeliveryClass::Reliable,
                sink,
            },
        );
        if let Err(err) = self.shared.send_command(Command::Subscribe { sid }) {
            // Not subscribed: nothing to list for resubscription either.
            self.shared.subscriptions.lock().remove(&sid);
            return Err(err);
        }
        *inbox = Some(sid);
        self.shared.inbox_sid_seen.store(sid, Ordering::Release);
        Ok(())
    }

    /// Wait until the server has processed everything sent before. Fails
    /// with `NotConnected` when the connection is lost before the server
    /// said so (what was sent before may then be lost, counted in
    /// `link().unacknowledged_at_close`).
    pub fn flush(&self, timeout: Duration) -> Result<(), Error> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.shared.send_command(Command::Flush(tx))?;
        rx.recv_timeout(timeout)
            .map_err(|err| Error::waiting(err, timeout))?
    }

    /// The client loop's round under way when it has run for `at_least`:
    /// how long, and the endpoint call it is in (the server's endpoint, or
    /// a data link's scheme). A round takes microseconds; one that lasts
    /// is stuck in a call that does not return, as when the broker was
    /// stopped or killed inside libfabric's `shm` (README "shm"): nothing
    /// then moves on this client. Read without waiting for the loop.
    pub fn stalled_round(&self, at_least: Duration) -> Option<LoopStall> {
        let names = &self.shared.endpoint_names;
        self.shared
            .round_watch
            .stalled(at_least, Instant::now(), |index| {
                names
                    .get(index)
                    .cloned()
                    .unwrap_or_else(|| format!("endpoint {index}"))
            })
    }

    /// Whether the client's loop has panicked (the panic's message is on
    /// standard error), on its thread or in a round an application thread
    /// ran while it waited, whose caller then got the panic. Nothing then
    /// moves on this client: its state is `Closed` (with the reason in
    /// [`Client::closed_because`]), requests waiting fail, subscriptions
    /// end after what they hold, and what is asked of it from then on is
    /// [`Error::Closed`].
    pub fn loop_ended(&self) -> bool {
        self.shared.round_watch.panicked()
    }

    /// Take no more publishes, flush (waiting at most a second for the
    /// server), say goodbye and close the connection. What the server had
    /// not taken by then is discarded and counted
    /// (`link().discarded_at_close`, `link().unacknowledged_at_close`).
    pub fn shutdown(&self) {
        if !self.shared.shutdown.load(Ordering::Relaxed) {
            self.shared.outbox.lock().closing = Closing::Unconfirmed;
            if self.flush(Duration::from_secs(1)).is_ok() {
                self.shared.outbox.lock().closing = Closing::Flushed;
            }
        }
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.parker.wake();
        self.shared.session.wake_sleeper();
        // Publishers waiting for room see the shutdown.
        self.shared.room.notify_all();
        // So does the loop, waiting for room in a subscription whose
        // reader stopped (`block`): the subscriptions end with the client,
        // after what they hold.
        for sub in self.shared.subscriptions.lock().values() {
            sub.sink.close();
        }
        if let Some(thread) = self.thread.lock().take() {
            if thread.join().is_err() {
                warn!("client thread panicked");
            }
        }
        self.shared.end_streams();
        self.shared.set_state(ConnectionState::Closed);
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Rounds for ClientLoop {
    /// Only a connected session is driven: connecting (name lookups,
    /// handshakes, giving up when refused) stays with the loop thread.
    fn driven_round(&mut self) -> Option<bool> {
        matches!(self.link, LinkState::Up { .. }).then(|| self.round().worked)
    }
}

/// A `Message` frame read in place ([`ClientLoop::read_message`]).
struct ReadMessage {
    sid: u64,
    /// `None`: the subject of the message read before it.
    subject: Option<Arc<str>>,
    reply: Option<Arc<str>>,
    headers: Option<Bytes>,
    payload: Bytes,
}

/// Messages read in a row for subscription `sid`, queued together: plain
/// ones (no reply subject, no headers) on one subject as their payloads
/// alone, so that a stream costs no subject reference per message; the
/// others whole. At most one of the two lists holds messages.
#[derive(Default)]
struct Run {
    sid: u64,
    plain_subject: Option<Arc<str>>,
    plain: Vec<Bytes>,
    messages: Vec<Message>,
}

impl Run {
    /// Queues what the run holds, as [`ClientShared::deliver_to`] would
    /// one by one but with one look-up of the subscription and one hold of
    /// its queue's lock while there is room; the run is left empty. A
    /// subscription it cut off is noted in `cut_off`.
    fn hand_over<'a>(
        &mut self,
        shared: &'a ClientShared,
        table: &mut Option<MutexGuard<'a, HashMap<u64, ClientSub>>>,
        cut_off: &mut Vec<u64>,
    ) {
        let (plain, messages) = (&mut self.plain, &mut self.messages);
        let closed = match self.plain_subject.take() {
            Some(subject) if !plain.is_empty() => shared.to_sink(table, self.sid, |sink| {
                sink.deliver_plain_run(&subject, plain)
            }),
            _ if !messages.is_empty() => {
                shared.to_sink(table, self.sid, |sink| sink.deliver_run(messages))
            }
            _ => false,
        };
        // Nothing to deliver to: dropped, as messages to a closed queue.
        plain.clear();
        messages.clear();
        if closed {
            cut_off.push(self.sid);
        }
    }
}

/// What one loop round found.
struct Round {
    /// Events came in or the outbox had frames.
    worked: bool,
    /// Credits are owed but held back (`CREDIT_DELAY`).
    credit_waiting: bool,
}

/// Ends the client for good when its loop thread ends before a shutdown
/// (a panic there or in a round a waiting thread ran), and says so in its
/// state.
struct EndsWaitsOnExit<'a>(&'a ClientShared);

impl Drop for EndsWaitsOnExit<'_> {
    fn drop(&mut self) {
        let shared = self.0;
        // Said before anything fails with `Closed`: a caller that sees
        // that finds the reason.
        if !shared.shutdown.load(Ordering::SeqCst) {
            *shared.closed_because.lock() = Some(LOOP_ENDED.to_string());
            shared.set_state(ConnectionState::Closed);
            shared.end_for_good();
        }
    }
}

/// Why a client whose loop ended is closed.
const LOOP_ENDED: &str = "the client's loop ended: it panicked (its message is on standard error)";

/// The client's loop thread: rounds of the session until shutdown, polling
/// on for the spin window after work and waiting otherwise; stepping aside
/// while a thread that waits for a reply or a message runs the session
/// ([`Driven`]).
fn run_loop(session: &Driven<ClientLoop>, shared: &ClientShared, mut poll: Poll) {
    // Dropped last: the panic is recorded (`_unwinding`) before the
    // client is marked shut down.
    let _ending = EndsWaitsOnExit(shared);
    let _unwinding = shared.round_watch.ended_on_unwind();
    let mut mio_events = mio::Events::with_capacity(64);
    let polled = match session.lock() {
        Some(session) => Polled::of(
            session
                .endpoints
                .iter()
                .map(|endpoint| endpoint.readiness()),
        ),
        None => return,
    };
    let mut idle = 0u32;
    let mut spin_window = SpinWindow::new(Instant::now());
    while !shared.shutdown.load(Ordering::Relaxed) {
        if session.is_driven() {
            // A waiting application thread drives the session. Asleep
            // rather than yielding: on few cores a yielding thread takes
            // turns from the driver and from the peer it exchanges with.
            session.sleep_while_driven(DRIVEN_SLEEP);
            continue;
        }
        if session.take_driven_work() {
            spin_window.worked(Instant::now(), shared.options.fabric.polling.spin());
            idle = 0;
        }
        let Some(mut guard) = session.lock() else {
            error!("a round run by an application thread panicked: the client's loop has ended");
            return;
        };
        let state = &mut *guard;
        if matches!(*shared.state.lock(), ConnectionState::Refused { .. }) {
            shared.end_for_good();
            break;
        }
        let round = state.round();
        session.loop_worked(round.worked);
        // Measured from the end of the work, as the broker's loop does.
        let after = Instant::now();
        let spin = shared.options.fabric.polling.spin();
        if round.worked {
            idle = 0;
            spin_window.worked(after, spin);
        } else if !spin_window.spinning(after) {
            // The idle rounds of `backoff` start after the spin.
            idle = idle.saturating_add(1);
        }
        // After a busy round the loop polls on for its `SpinWindow`,
        // then waits: work that came in meanwhile has made a descriptor
        // ready (or the outbox non-empty, which `park` checks), so the
        // wait returns at once.
        if spin_window.spinning(after) {
            drop(guard);
            // Another thread may have the core while this one has
            // nothing to do; after work, the next round comes at once.
            if !round.worked {
                std::thread::yield_now();
            }
            continue;
        }
        // Sleep until a descriptor is ready, the outbox has work, or the
        // next deadline (at least a millisecond: see `wait`; endpoints may
        // cap it below).
        let mut timeout = state
            .poll_timeout()
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        if round.credit_waiting {
            timeout = timeout.min(CREDIT_DELAY);
        }
        if polled.must_poll {
            timeout = timeout.min(polled.backoff(idle, &shared.options.fabric.polling));
        }
        if !timeout.is_zero() {
            // It runs the providers' progress too: watched as the round.
            shared.round_watch.round_began(Instant::now());
            let prepared = prepare_wait(&mut state.endpoints, timeout);
            shared.round_watch.round_ended();
            match prepared {
                Some(allowed) => timeout = allowed,
                None => continue,
            }
        }
        let nothing_pending = state.conn.out.is_empty();
        let finished = session.drives_finished();
        drop(guard);
        let parked = shared.parker.park(|| {
            let mut outbox = shared.outbox.lock();
            // What this thread saw holds only if no driver came since;
            // asked under the outbox lock, so a driver that takes the
            // outbox's items after this clears the flag set here.
            let unchanged = session.may_sleep(finished);
            let idle = outbox.is_empty();
            outbox.loop_idle = idle && nothing_pending && unchanged;
            // With frames pending, the outbox waits for the path to
            // take them (a `Writable` event or a reconnection).
            (idle || !nothing_pending) && unchanged
        });
        if !parked {
            continue;
        }
        if let Err(err) = wait(&mut poll, &mut mio_events, timeout) {
            if err.kind() != std::io::ErrorKind::Interrupted {
                warn!(error = %err, "client poll failed");
            }
        }
        shared.parker.unpark();
        // Awake again: publishers go through the outbox.
        shared.outbox.lock().loop_idle = false;
        if polled.yields(idle, &shared.options.fabric.polling) {
            std::thread::yield_now();
        }
    }
    // Closed here, on the loop thread, with drivers kept out.
    if let Some(mut state) = session.take() {
        state.close();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LinkState {
    Down { retry_at: Instant },
    AwaitWelcome { peer: PeerId, deadline: Instant },
    Up { peer: PeerId },
}

/// Longest pause before a scheme whose data link went silent is offered
/// again, unless `silent_link_retry` is longer.
const SILENT_RETRY_MAX: Duration = Duration::from_secs(3600);

/// The pause after `pause` for a scheme that went silent again: twice as
/// long, up to [`SILENT_RETRY_MAX`], or `retry` if that is longer (a
/// configured pause is never shortened).
fn next_silent_pause(pause: Duration, retry: Duration) -> Duration {
    pause.saturating_mul(2).min(SILENT_RETRY_MAX.max(retry))
}

/// A data scheme this client offers the server no more, and why.
struct Withdrawn {
    scheme: String,
    reason: String,
    /// When the next connection may offer it again (never for an endpoint
    /// that failed: it cannot carry anything).
    until: Option<Instant>,
}

/// The client's session: the connection to the server (shared session
/// layer) and what only a client has: the outbox, reconnection, replies.
struct ClientLoop {
    shared: Arc<ClientShared>,
    /// The events of the round's endpoint polls.
    events: Vec<Event>,
    /// The control endpoint (at [`CONTROL`]), then the data endpoints.
    endpoints: Vec<Box<dyn Endpoint>>,
    /// When the control endpoint, if it has a descriptor, was last polled
    /// and found nothing (`None` after it found work).
    control_quiet_since: Option<Instant>,
    /// The last round found work on a data endpoint.
    data_busy: bool,
    address: String,
    codec: CodecLimits,
    link: LinkState,
    backoff: Duration,
    /// The current connection's control link, data links, frames not yet
    /// accepted by the path (pushed back or disconnected) and heartbeats.
    conn: Connection,
    /// Items taken from the outbox, being handed on.
    taken: VecDeque<Item>,
    /// The subject of the last message read, shared by the next ones on
    /// the same subject.
    last_subject: Option<Arc<str>>,
    /// Messages handed on whole that shared `last_subject` so far.
    subject_shares: usize,
    /// Subscriptions sent to the server on the current connection.
    subscribed: FxHashSet<u64>,
    /// The time of this loop round, read once per round rather than per frame.
    now: Instant,
    /// Subscriptions cut off as slow consumers while delivering a batch.
    cut_off: Vec<u64>,
    /// Messages read in a row for one subscription, queued together
    /// (empty between rounds).
    run: Run,
    flushes: Vec<(u64, Sender<Result<(), Error>>)>,
    next_nonce: u64,
    ever_connected: bool,
    /// Why the connection was last lost, for a client that gives up.
    last_failure: Option<String>,
    /// The reason of the server's goodbye on this connection, if it said
    /// one: why the connection ends when the server closes it.
    goodbye: Option<String>,
    /// Every endpoint's offer, data endpoints first: the hello makes
    /// them in this order, but those withdrawn.
    all_offers: Vec<Offer>,
    /// At most one entry per scheme.
    withdrawn: Vec<Withdrawn>,
    /// The pause before each scheme that went silent is offered again:
    /// it doubles with every silence, and is forgotten once a link on the
    /// scheme carries something back.
    silent_pauses: HashMap<String, Duration>,
    /// This side's part of the current handshake's link keys.
    link_secret: Option<LinkSecret>,
    /// The hello of this connection is sent (it waits for the server's
    /// challenge).
    hello_sent: bool,
    /// The challenge and nonce the hello proved the shared secret with,
    /// which the welcome's proof must answer.
    proved: Option<([u8; 32], [u8; 32])>,
    tuning: LinkTuning,
    released: Vec<Bytes>,
    /// Scratch space for splitting the runs in `released`.
    released_scratch: Vec<Bytes>,
    /// Frames from the control link gathered for `deliver_messages`.
    control_frames: Vec<Bytes>,
    /// Why data endpoints could not open: the start of every handshake's
    /// reasons.
    unavailable: Vec<String>,
}

impl ClientLoop {
    fn new(
        shared: Arc<ClientShared>,
        endpoint: Box<dyn Endpoint>,
        data: Vec<Box<dyn Endpoint>>,
        address: String,
    ) -> ClientLoop {
        let unavailable = shared.link.lock().reasons.clone();
        let mut endpoints: Vec<Box<dyn Endpoint>> = std::iter::once(endpoint)
            .chain(data)
            .enumerate()
            .map(|(index, endpoint)| {
                WatchedEndpoint::wrap(endpoint, Arc::clone(&shared.round_watch), index)
            })
            .collect();
        // What the control link reads comes as runs, split in `on_events`:
        // one event per read rather than one per frame.
        endpoints[CONTROL].deliver_runs();
        // Data endpoints first: the control link is the last resort.
        let all_offers = endpoints[CONTROL + 1..]
            .iter()
            .chain(&endpoints[..=CONTROL])
            .filter_map(|endpoint| endpoints::offer_for(endpoint.as_ref()))
            .collect();
        let now = Instant::now();
        let codec = CodecLimits {
            max_frame: shared.options.max_frame,
            max_subject_len: shared.options.subject_limits.max_len,
        };
        let liveness = Liveness::new(
            now,
            shared.options.heartbeat_interval,
            shared.options.heartbeat_timeout,
            true,
        );
        // The data links (one pair at a time) draw from one budget.
        // No frame is reassembled beyond the client's frame limit.
        let defaults = LinkTuning::default();
        let tuning = LinkTuning {
            reliable_gap_timeout: shared.options.fabric.reliable_gap_timeout(),
            memory: MemoryBudget::new(shared.options.max_link_memory),
            reassembly: efabus_core::fragment::ReassemblyConfig::for_frames_up_to(
                shared.options.max_frame,
            ),
            ..defaults
        };
        ClientLoop {
            shared,
            events: Vec::with_capacity(256),
            control_quiet_since: None,
            data_busy: false,
            endpoints,
            address,
            codec,
            link: LinkState::Down { retry_at: now },
            backoff: Duration::from_millis(50),
            conn: Connection::new(
                Control {
                    endpoint: CONTROL,
                    peer: PeerId(0),
                },
                liveness,
            ),
            taken: VecDeque::new(),
            last_subject: None,
            subject_shares: 0,
            subscribed: FxHashSet::default(),
            now,
            cut_off: Vec::new(),
            run: Run::default(),
            flushes: Vec::new(),
            next_nonce: 1,
            ever_connected: false,
            last_failure: None,
            goodbye: None,
            link_secret: None,
            hello_sent: false,
            proved: None,
            all_offers,
            withdrawn: Vec::new(),
            silent_pauses: HashMap::default(),
            tuning,
            released: Vec::new(),
            released_scratch: Vec::new(),
            control_frames: Vec::new(),
            unavailable,
        }
    }

    /// When the loop next has something to do by time alone.
    fn poll_timeout(&self) -> Instant {
        match self.link {
            LinkState::Down { retry_at } => retry_at,
            LinkState::AwaitWelcome { deadline, .. } => deadline,
            LinkState::Up { .. } => {
                let timeout = self.shared.options.connect_timeout;
                let best_effort = self.conn.links.best_effort_due(self.now, timeout);
                let reopen = self.conn.links.reopen_due(timeout);
                [self.silent_deadline(), best_effort, reopen]
                    .into_iter()
                    .flatten()
                    .fold(self.conn.poll_timeout(), Instant::min)
            }
        }
    }

    /// One round: timers, every endpoint's events, the links' timers, the
    /// outbox, credits, and the round's sends handed to the wire. Run by
    /// the loop thread, or by an application thread that waits for a reply
    /// while it holds the loop (see [`Driven`]).
    fn round(&mut self) -> Round {
        let now = Instant::now();
        self.now = now;
        self.shared.round_watch.round_began(now);
        self.on_timers(now);
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        let control = &mut self.endpoints[CONTROL];
        let mut busy = false;
        if !puts_off_polling(self.data_busy, self.control_quiet_since, now, &**control) {
            if let Err(err) = control.poll(&mut events) {
                warn!(error = %err, "client endpoint poll failed");
            }
            busy = !events.is_empty();
            if let Readiness::Fd(_) = control.readiness() {
                self.control_quiet_since = (!busy).then_some(now);
            }
        }
        self.on_events(&mut events);
        let mut data_busy = false;
        for index in CONTROL + 1..self.endpoints.len() {
            if let Err(err) = self.endpoints[index].poll(&mut events) {
                self.data_endpoint_failed(index, &err, now);
            }
            data_busy |= !events.is_empty();
            for event in events.drain(..) {
                self.on_data_event(index, event);
            }
        }
        self.data_busy = data_busy;
        busy |= data_busy;
        self.events = events;
        // After what the endpoints delivered: a gap it filled is no
        // failure, however late, and an answer that came is no silence.
        self.poll_links(now);
        self.check_silent_link(now);
        self.tend_best_effort_link(now);
        self.reopen_best_effort_link(now);
        // Replies of responders to what came in (from the endpoints or
        // released by the links) go out in this round.
        if crate::delivery::answers_waiting(self.shared.answer_origin) {
            self.publish_answers();
            busy = true;
        }
        let drained = self.drain_outbox();
        self.check_send_failure();
        let credit_waiting = self.grant_credits(now);
        // The round's sends leave now, not after the next round's poll
        // of the control link.
        for endpoint in &mut self.endpoints {
            endpoint.flush();
        }
        self.shared.round_watch.round_ended();
        Round {
            worked: busy | drained,
            credit_waiting,
        }
    }

    /// Send the replies this client's responders made in this round's
    /// deliveries, on the loop's own path (a publisher waiting for room in
    /// the outbox would wait for this very thread).
    #[cold]
    #[inline(never)]
    fn publish_answers(&mut self) {
        let max_payload = self.shared.max_payload.load(Ordering::Relaxed);
        for answered in crate::delivery::take_answers(self.shared.answer_origin, max_payload) {
            let fields = RoutedFields {
                subject: &answered.subject,
                reply: None,
                headers: false,
            };
            let mut head = BytesMut::new();
            let len = answered.payload.len();
            match codec::routed_head_into(&mut head, FrameKind::Publish, 0, 0, fields, len) {
                Ok(()) => self.send(OutFrame {
                    head: head.freeze(),
                    body: answered.payload,
                }),
                Err(_) => answered.stats.count_unanswered(),
            }
        }
    }

    fn close(&mut self) {
        // Watched as a round: it polls and closes the endpoints.
        let watch = Arc::clone(&self.shared.round_watch);
        watch.round_began(Instant::now());
        self.shared.outbox.lock().direct = None;
        while self.drain_outbox() {}
        if let LinkState::Up { peer } = self.link {
            let goodbye = codec::encode(&Frame::Goodbye(Goodbye {
                reason: "client closing".to_string(),
            }));
            let _ = self.transmit(goodbye);
            let deadline = Instant::now() + Duration::from_millis(200);
            let mut events = Vec::new();
            while Instant::now() < deadline && !self.conn.links.drained(&self.endpoints) {
                for endpoint in &mut self.endpoints[CONTROL + 1..] {
                    let _ = endpoint.poll(&mut events);
                }
                events.clear();
                std::thread::sleep(Duration::from_millis(1));
            }
            if self.shared.outbox.lock().closing == Closing::Flushed {
                // The server processed all of it, its credit for the last
                // frames still to come: nothing to count.
                self.close_links();
            } else {
                // The server held the path back to the end: what the link
                // numbered may be in no one's hands but the provider's.
                self.close_data_links();
            }
            let control = &mut self.endpoints[CONTROL];
            control.close(peer);
            // Let the endpoint hand the goodbye to the wire.
            let deadline = Instant::now() + Duration::from_millis(200);
            let mut events = Vec::new();
            while Instant::now() < deadline && control.queued_bytes(peer) > 0 {
                let _ = control.poll(&mut events);
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // What the path never took goes with the client: said, not lost
        // without a word. Publishers are refused from here on, however the
        // loop came to end.
        let held = {
            let mut outbox = self.shared.outbox.lock();
            if outbox.closing == Closing::Open {
                outbox.closing = Closing::Unconfirmed;
            }
            self.conn.out.publishes() + outbox.publishes()
        };
        if held > 0 {
            warn!(
                publishes = held,
                "closing with publishes the server never took"
            );
            self.shared
                .counters
                .discarded_at_close
                .fetch_add(held, Ordering::Relaxed);
        }
        // Closing a fabric endpoint runs its provider's progress too.
        drop(std::mem::take(&mut self.endpoints));
        watch.round_ended();
    }

    fn on_timers(&mut self, now: Instant) {
        match self.link {
            LinkState::Down { retry_at } if now >= retry_at => self.start_connect(now),
            LinkState::AwaitWelcome { peer, deadline } if now >= deadline => {
                warn!(server = %self.shared.server, "handshake timed out");
                self.endpoints[CONTROL].close(peer);
                // Waiting for the challenge, a cleartext client and a TLS
                // listener each wait for the other.
                let tls_hint = if !self.hello_sent && !self.shared.options.tls.is_set() {
                    "; a TLS listener waits for the client to start TLS: connect with the \
                     authority that verifies it (tls.ca, --tls-ca)"
                } else {
                    ""
                };
                self.last_failure = Some(format!(
                    "no welcome within {:?} (the server did not answer the handshake{tls_hint})",
                    self.shared.options.connect_timeout
                ));
                self.link_lost(now);
            }
            LinkState::Up { peer } => match self.conn.liveness.poll(now) {
                Heartbeat::Dead => {
                    warn!(server = %self.shared.server, "server silent; reconnecting");
                    self.endpoints[CONTROL].close(peer);
                    self.last_failure = Some("the server went silent".to_string());
                    self.link_lost(now);
                }
                Heartbeat::Ping => {
                    let _ = self.transmit(codec::encode(&Frame::Ping { nonce: 0 }));
                }
                Heartbeat::Wait => {}
            },
            _ => {}
        }
    }

    fn start_connect(&mut self, now: Instant) {
        self.restore_schemes(now);
        let control = &mut self.endpoints[CONTROL];
        match control.connect(&self.address) {
            Ok(peer) => {
                // A fresh secret per handshake: keys never outlive a session.
                let wants_links = self.offers().any(|o| endpoints::is_data_scheme(&o.scheme));
                self.link_secret = match wants_links.then(LinkSecret::new) {
                    Some(Ok(secret)) => Some(secret),
                    Some(Err(err)) => {
                        warn!(%err, "no data links for this connection");
                        None
                    }
                    None => None,
                };
                self.hello_sent = false;
                self.proved = None;
                self.conn.control.peer = peer;
                // A shared secret is proven against the server's challenge,
                // its first frame; a hello with nothing to prove goes at
                // once.
                if !self.proves_secret() {
                    self.send_hello(peer, [0; 32]);
                }
                self.link = LinkState::AwaitWelcome {
                    peer,
                    deadline: now + self.shared.options.connect_timeout,
                };
            }
            Err(err) => {
                debug!(server = %self.shared.server, error = %err, "connect failed");
                self.last_failure = Some(err.to_string());
                self.link_lost(now);
            }
        }
    }

    /// When the reliable data link, silent since its first frame, is given
    /// up (see [`Self::check_silent_link`]).
    fn silent_deadline(&self) -> Option<Instant> {
        let since = self.conn.links.reliable_silent_since()?;
        Some(since + self.shared.options.connect_timeout)
    }

    /// Whether the reliable data link carried nothing back for the connect
    /// timeout after its first frame: the provider underneath may have
    /// refused the connection (ofi_rxm refuses endpoints set up
    /// differently) and said nothing. Its scheme is then offered to this
    /// server no more for a pause (`silent_link_retry`), and the
    /// connection starts again without it; what went out on the link is
    /// lost with it, as with any connection lost.
    fn check_silent_link(&mut self, now: Instant) {
        let LinkState::Up { peer: control } = self.link else {
            return;
        };
        if !self.silent_pauses.is_empty() && self.conn.links.reliable_heard() {
            if let Some(link) = &self.conn.links.reliable {
                self.silent_pauses.remove(&link.scheme);
            }
        }
        if self.silent_deadline().is_none_or(|deadline| now < deadline) {
            return;
        }
        let Some(scheme) = self.conn.links.reliable.as_ref().map(|l| l.scheme.clone()) else {
            return;
        };
        let waited = self.shared.options.connect_timeout;
        let then = if self.shared.options.reconnect {
            "reconnecting without it"
        } else {
            "the connection ends (the client does not reconnect)"
        };
        error!(%scheme, ?waited, "the reliable data link carried nothing back; {then}");
        let reason = format!(
            "{scheme}: its data link carried nothing back within {waited:?} of its first \
             frame (the provider may have refused the connection: check that both sides \
             have the same provider settings)"
        );
        self.last_failure = Some(reason.clone());
        let retry = self.shared.options.silent_link_retry;
        let pause = self.silent_pauses.entry(scheme.clone()).or_insert(retry);
        // A pause past what a clock can hold is never over.
        let until = now.checked_add(*pause);
        *pause = next_silent_pause(*pause, retry);
        self.withdraw_scheme(&scheme, reason, until);
        self.shared
            .counters
            .silent_data_links
            .fetch_add(1, Ordering::Relaxed);
        self.endpoints[CONTROL].close(control);
        self.link_lost(now);
    }

    /// The best-effort link's ping, sent again until the broker's first
    /// credit comes back there, and the link given up alone when none came
    /// within the connect timeout (see [`DataLinks::tend_best_effort`]).
    ///
    /// [`DataLinks::tend_best_effort`]: crate::session::data_link::DataLinks::tend_best_effort
    fn tend_best_effort_link(&mut self, now: Instant) {
        if !matches!(self.link, LinkState::Up { .. }) {
            return;
        }
        if self.conn.links.carry_once_credited() {
            // Opened again and credited: the report names it from now on.
            self.shared.link.lock().best_effort = self.conn.links.best_effort_path();
        }
        let timeout = self.shared.options.connect_timeout;
        let heartbeat = self.shared.options.heartbeat_interval;
        let Some(closed) =
            self.conn
                .links
                .tend_best_effort(&mut self.endpoints, now, heartbeat, timeout)
        else {
            return;
        };
        let description = &closed.description;
        warn!(link = %description, waited = ?timeout, "no credit came back on the best-effort link; best effort comes over the reliable path");
        let reason = format!(
            "best-effort: {description}: no credit came back there within {timeout:?} of its \
             first ping; carried on the reliable path"
        );
        // The broker closes its side too, rather than send there on.
        let epoch = self.conn.links.best_effort_epoch();
        let notice = Frame::best_effort_closed(
            closed.settled_through,
            closed.sent_through,
            epoch,
            reason.clone(),
        );
        self.send(codec::encode(&notice));
        self.best_effort_link_gone(&closed, reason);
    }

    /// The broker gave the best-effort link of `epoch` up, saying `why`
    /// and how far it sent there (`told`): this side is closed too (what
    /// it lacks of that counted as lost), and best effort comes over the
    /// reliable path. A notice for an earlier epoch's link closes nothing.
    fn best_effort_closed_by_broker(&mut self, told: GiveUp, epoch: u32, why: &str) {
        if epoch != self.conn.links.best_effort_epoch() {
            return;
        }
        let Some(closed) = self
            .conn
            .links
            .give_up_best_effort(&mut self.endpoints, told)
        else {
            return;
        };
        let description = &closed.description;
        info!(link = %description, %why, "the broker closed the best-effort link; best effort comes over the reliable path");
        let reason = format!(
            "best-effort: {description}: the broker closed it ({why}); carried on the reliable \
             path"
        );
        self.best_effort_link_gone(&closed, reason);
    }

    /// The best-effort link closed: what was found missing there counted,
    /// and the report says why.
    fn best_effort_link_gone(&mut self, closed: &Closed, reason: String) {
        BrokerStats::add_saturating(&self.shared.counters.best_effort_lost, closed.lost);
        let mut report = self.shared.link.lock();
        report.best_effort = None;
        push_reason(&mut report.reasons, reason);
    }

    /// The best-effort link given up a while ago ([`DataLinks::reopen_due`],
    /// after the connect timeout, longer after each try that failed):
    /// opened again, the broker asked to open its side; it then
    /// proves itself, or is given up again, as after the handshake.
    ///
    /// [`DataLinks::reopen_due`]: crate::session::data_link::DataLinks::reopen_due
    fn reopen_best_effort_link(&mut self, now: Instant) {
        if !matches!(self.link, LinkState::Up { .. }) {
            return;
        }
        let due = self
            .conn
            .links
            .reopen_due(self.shared.options.connect_timeout);
        if due.is_none_or(|at| now < at) {
            return;
        }
        let epoch = match self
            .conn
            .links
            .reopen_best_effort(&mut self.endpoints, |_| true, now)
        {
            Ok(epoch) => epoch,
            Err(why) => {
                debug!(%why, "best-effort link not opened again");
                return;
            }
        };
        self.send(codec::encode(&Frame::BestEffortReopen { epoch }));
        let description = self
            .conn
            .links
            .best_effort
            .as_ref()
            .map(|link| link.description.clone());
        let Some(description) = description else {
            return;
        };
        info!(link = %description, epoch, "best-effort link opened again");
        // The report names it once the broker's first credit came.
        push_reason(
            &mut self.shared.link.lock().reasons,
            format!("best-effort: {description}: opened again (epoch {epoch})"),
        );
    }

    /// Offers `scheme` to this server no more (until `until`, if given),
    /// for `reason` (shown in the link report meanwhile).
    fn withdraw_scheme(&mut self, scheme: &str, reason: String, until: Option<Instant>) {
        self.withdrawn
            .retain(|withdrawn| withdrawn.scheme != scheme);
        self.withdrawn.push(Withdrawn {
            scheme: scheme.to_string(),
            reason,
            until,
        });
    }

    /// Offers again the schemes whose pause is over, before a connection
    /// starts.
    fn restore_schemes(&mut self, now: Instant) {
        self.withdrawn.retain(|withdrawn| {
            let over = withdrawn.until.is_some_and(|until| until <= now);
            if over {
                info!(scheme = %withdrawn.scheme, "offering the scheme again after its pause");
            }
            !over
        });
    }

    /// What this connection offers the server: every endpoint's offer but
    /// those withdrawn.
    fn offers(&self) -> impl Iterator<Item = &Offer> {
        self.all_offers
            .iter()
            .filter(|offer| self.withdrawn.iter().all(|w| w.scheme != offer.scheme))
    }

    /// A data endpoint's poll failed: it is offered no more, and a
    /// connection with a data link on it starts again without it (a link
    /// that cannot be polled would lose what it carries without a word).
    fn data_endpoint_failed(
        &mut self,
        index: usize,
        err: &efabus_core::transport::TransportError,
        now: Instant,
    ) {
        let scheme = self.endpoints[index].scheme().to_string();
        // Reported once; a scheme only paused is withdrawn for good now.
        if self
            .withdrawn
            .iter()
            .any(|w| w.scheme == scheme && w.until.is_none())
        {
            return;
        }
        error!(%scheme, error = %err, "data endpoint failed; reconnecting without it");
        let reason = format!("{scheme}: the endpoint failed: {err}");
        self.withdraw_scheme(&scheme, reason, None);
        if self
            .conn
            .links
            .addresses()
            .any(|(endpoint, _)| endpoint == index)
        {
            let control = self.conn.control.peer;
            self.endpoints[CONTROL].close(control);
            self.link_lost(now);
        }
    }

    /// Close the data links, counting what the broker had not
    /// acknowledged on them.
    fn close_data_links(&mut self) {
        self.shared
            .counters
            .unacknowledged_at_close
            .fetch_add(self.conn.links.unacknowledged_frames(), Ordering::Relaxed);
        self.close_links();
    }

    /// Closes the data links, counting the best-effort messages lost with
    /// them.
    fn close_links(&mut self) {
        let lost = self.conn.links.close(&mut self.endpoints);
        BrokerStats::add_saturating(&self.shared.counters.best_effort_lost, lost);
    }

    fn link_lost(&mut self, now: Instant) {
        // Their pings went with the connection: no pong will answer them.
        for (_, done) in self.flushes.drain(..) {
            let _ = done.send(Err(Error::NotConnected(self.shared.server.clone())));
        }
        self.goodbye = None;
        self.shared.outbox.lock().direct = None;
        self.close_data_links();
        let failure = self.last_failure.take();
        if !self.shared.options.reconnect {
            // Down for good: a close the endpoint reports later is not a
            // new loss (nor a new reason).
            self.link = LinkState::Down {
                retry_at: now + self.shared.options.max_backoff,
            };
            // Without reconnection a first attempt that failed is the
            // answer: waiting out the connect timeout would only hide it.
            // A server's refusal stays what the client reports.
            if matches!(*self.shared.state.lock(), ConnectionState::Refused { .. }) {
                self.shared.end_for_good();
                return;
            }
            let state = match failure {
                Some(reason) if !self.ever_connected => ConnectionState::Unreachable { reason },
                failure if self.ever_connected => {
                    *self.shared.closed_because.lock() =
                        Some(failure.unwrap_or_else(|| "connection lost".to_string()));
                    ConnectionState::Closed
                }
                _ => ConnectionState::Unreachable {
                    reason: "the connection closed before the handshake".to_string(),
                },
            };
            self.shared.set_state(state);
            // Flushes still queued behind publishes fail as the sent ones
            // did; waiting publishers wake to a closed client.
            self.shared
                .answer_queued_flushes(|| Error::NotConnected(self.shared.server.clone()));
            self.shared.end_for_good();
            return;
        }
        if !matches!(*self.shared.state.lock(), ConnectionState::Refused { .. }) {
            self.shared.set_state(ConnectionState::Connecting);
        }
        self.link = LinkState::Down {
            retry_at: now + self.backoff,
        };
        self.backoff = (self.backoff * 2).min(self.shared.options.max_backoff);
    }

    /// Handle what the control endpoint reported. Messages, the bulk of
    /// the traffic, are read in place and handed to their subscriptions
    /// under one lock per run of them; a subject like the last one is
    /// neither checked nor copied, and the payload keeps the frame's buffer
    /// without touching its reference count.
    fn on_events(&mut self, events: &mut Vec<Event>) {
        let mut frames = std::mem::take(&mut self.control_frames);
        for event in events.drain(..) {
            match event {
                Event::Frame { peer, frame } => self.take_control_frame(peer, frame, &mut frames),
                Event::Frames { peer, run } if self.is_up(peer) => {
                    let before = frames.len();
                    frames.extend(split_run(&run).map(|frame| frame.head));
                    let control_in = &self.shared.counters.control_in;
                    let read = (frames.len() - before) as u64;
                    control_in.store(control_in.load(Ordering::Relaxed) + read, Ordering::Relaxed);
                }
                // A run that brings the welcome goes on as the link is up.
                Event::Frames { peer, run } => {
                    for frame in split_run(&run) {
                        self.take_control_frame(peer, frame.head, &mut frames);
                    }
                }
                other => {
                    // What came before it is handled first.
                    self.deliver_messages(&mut frames, Self::on_control_frame);
                    self.on_event(other);
                }
            }
        }
        self.deliver_messages(&mut frames, Self::on_control_frame);
        self.control_frames = frames;
    }

    /// A frame the control endpoint read: gathered in `frames` while the
    /// link to its peer is up, else handled at once, after what was
    /// gathered.
    #[inline]
    fn take_control_frame(&mut self, peer: PeerId, frame: Bytes, frames: &mut Vec<Bytes>) {
        if self.is_up(peer) {
            // Only the thread holding the session writes the counter: no
            // atomic add.
            let control_in = &self.shared.counters.control_in;
            control_in.store(control_in.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            frames.push(frame);
        } else {
            self.deliver_messages(frames, Self::on_control_frame);
            self.on_event(Event::Frame { peer, frame });
        }
    }

    /// Whether the control link to `peer` is up.
    fn is_up(&self, peer: PeerId) -> bool {
        matches!(self.link, LinkState::Up { peer: up } if up == peer)
    }

    /// A frame on the control link that is not a message.
    fn on_control_frame(&mut self, frame: Bytes) {
        if let LinkState::Up { peer } = self.link {
            self.on_event(Event::Frame { peer, frame });
        }
    }

    /// A frame a data link released that is not a message.
    fn on_data_frame(&mut self, frame: Bytes) {
        let LinkState::Up { peer: control } = self.link else {
            return;
        };
        match codec::decode(frame, &self.codec) {
            Ok(frame) => self.on_frame(control, frame),
            Err(err) => warn!(error = %err, "malformed frame on the data link"),
        }
    }

    /// Hands the messages among `frames` (emptied) to their subscriptions,
    /// taking the subscriptions' lock once for a run of them, and any other
    /// frame, in order, to `other`. The same path serves the control link
    /// and the data links.
    fn deliver_messages(&mut self, frames: &mut Vec<Bytes>, other: fn(&mut Self, Bytes)) {
        if frames.is_empty() {
            return;
        }
        self.conn.liveness.heard(self.now);
        let shared = self.shared.clone();
        let mut subscriptions = None;
        let mut cut_off = std::mem::take(&mut self.cut_off);
        let mut run = std::mem::take(&mut self.run);
        for frame in frames.drain(..) {
            let read = match self.read_message(frame) {
                Ok(read) => read,
                Err(frame) => {
                    run.hand_over(&shared, &mut subscriptions, &mut cut_off);
                    subscriptions = None;
                    other(self, frame);
                    continue;
                }
            };
            let inbox = shared.inbox_sid_seen.load(Ordering::Acquire);
            if inbox != 0 && read.sid == inbox {
                // What came before the reply is queued before its
                // requester wakes.
                run.hand_over(&shared, &mut subscriptions, &mut cut_off);
                let subject = self.message_subject(read.subject);
                self.dispatch_reply(subject, read.reply, read.headers, read.payload);
                continue;
            }
            if read.sid != run.sid {
                run.hand_over(&shared, &mut subscriptions, &mut cut_off);
                run.sid = read.sid;
            }
            let plain = read.reply.is_none() && read.headers.is_none();
            if plain && read.subject.is_none() && !run.plain.is_empty() {
                // The plain run goes on: its subject is the last one.
                run.plain.push(read.payload);
            } else if plain {
                run.hand_over(&shared, &mut subscriptions, &mut cut_off);
                run.plain_subject = match read.subject {
                    Some(subject) => Some(subject),
                    None => self.last_subject.clone(),
                };
                run.plain.push(read.payload);
            } else {
                if !run.plain.is_empty() {
                    run.hand_over(&shared, &mut subscriptions, &mut cut_off);
                }
                let subject = self.message_subject(read.subject);
                run.messages.push(Message {
                    subject,
                    reply: read.reply,
                    headers: read.headers,
                    payload: read.payload,
                });
            }
        }
        run.hand_over(&shared, &mut subscriptions, &mut cut_off);
        // A burst's lists are not kept for good.
        if run.plain.capacity() > RUN_KEPT_MAX {
            run.plain = Vec::new();
        }
        if run.messages.capacity() > RUN_KEPT_MAX {
            run.messages = Vec::new();
        }
        self.run = run;
        drop(subscriptions);
        for sid in cut_off.drain(..) {
            self.send(codec::encode(&Frame::Unsubscribe { sid }));
        }
        self.cut_off = cut_off;
    }

    /// A `Message` frame as what its subscription gets: the subscription
    /// id, the subject (`None`: the last one again, [`Self::last_subject`]),
    /// the reply subject, the header block, and the payload (the frame
    /// itself, trimmed: no copy and no new reference). Any other frame, or
    /// a malformed one, comes back (the general path reports malformed
    /// frames).
    fn read_message(&mut self, frame: Bytes) -> Result<ReadMessage, Bytes> {
        let known = self.last_subject.take();
        let known_str = known.as_deref().unwrap_or("");
        let view = match codec::peek_routed_known(&frame, &self.codec, known_str) {
            Ok(Some(view)) if view.kind == FrameKind::Message => view,
            _ => {
                self.last_subject = known;
                return Err(frame);
            }
        };
        let repeated = known.is_some() && std::ptr::eq(known_str, view.subject);
        let subject = (!repeated).then(|| Arc::<str>::from(view.subject));
        let reply = view.reply.map(Arc::from);
        let (sid, mut at, mut len) = (view.sid, view.payload_at, view.payload.len());
        let headers = match view.headers_and_body() {
            (Some(block), body) => {
                let block_at = at + codec::HEADERS_PREFIX_LEN;
                at += len - body.len();
                len = body.len();
                Some(frame.slice(block_at..block_at + block.len()))
            }
            (None, _) => None,
        };
        self.last_subject = match &subject {
            None => known,
            Some(fresh) => {
                self.subject_shares = 0;
                Some(fresh.clone())
            }
        };
        let mut payload = frame;
        payload.advance(at);
        payload.truncate(len);
        Ok(ReadMessage {
            sid,
            subject,
            reply,
            headers,
            payload,
        })
    }

    /// The subject string of a message [`Self::read_message`] read, for a
    /// message handed on by itself. A stream of such messages on one
    /// subject shares the subject's string, a fresh one every
    /// `SUBJECT_SHARES` messages: the reading thread releases the copies it
    /// is done with while this one hands out more, and a count touched by
    /// both for every message would move between their cores every time.
    fn message_subject(&mut self, subject: Option<Arc<str>>) -> Arc<str> {
        if let Some(subject) = subject {
            return subject;
        }
        debug_assert!(self.last_subject.is_some(), "a repeated subject was read");
        self.subject_shares += 1;
        match &self.last_subject {
            Some(last) if self.subject_shares < SUBJECT_SHARES => last.clone(),
            last => {
                let fresh: Arc<str> = Arc::from(last.as_deref().unwrap_or(""));
                self.subject_shares = 0;
                self.last_subject = Some(fresh.clone());
                fresh
            }
        }
    }

    fn on_event(&mut self, event: Event) {
        let current = match self.link {
            LinkState::AwaitWelcome { peer, .. } | LinkState::Up { peer } => Some(peer),
            LinkState::Down { .. } => None,
        };
        match event {
            // `on_events` splits the control link's runs; any other is
            // taken frame by frame alike.
            Event::Frames { peer, run } => {
                for frame in split_run(&run) {
                    self.on_event(Event::Frame {
                        peer,
                        frame: frame.head,
                    });
                }
            }
            Event::Frame { peer, frame } if Some(peer) == current => {
                self.conn.liveness.heard(self.now);
                match codec::decode(frame, &self.codec) {
                    Ok(frame) => self.on_frame(peer, frame),
                    Err(err) => {
                        warn!(server = %self.shared.server, error = %err, "malformed frame from server; reconnecting");
                        self.endpoints[CONTROL].close(peer);
                        self.last_failure = Some(format!("malformed frame from the server: {err}"));
                        self.link_lost(Instant::now());
                    }
                }
            }
            Event::Writable { peer } if Some(peer) == current => self.flush_pending(),
            Event::Closed { peer, reason } if Some(peer) == current => {
                info!(server = %self.shared.server, %reason, "connection lost");
                self.last_failure = Some(match self.goodbye.take() {
                    Some(said) => format!("the server said goodbye: {said}"),
                    None => reason.to_string(),
                });
                self.link_lost(Instant::now());
            }
            _ => {}
        }
    }

    /// The hello, answering the server's `challenge`: a user's password or
    /// a token travels in it; a shared secret is only proven.
    fn send_hello(&mut self, peer: PeerId, challenge: [u8; 32]) {
        let options = &self.shared.options;
        let (credentials, proof) = match (&options.user, &options.token, &options.credentials) {
            (Some(_), _, password) => (password.clone(), None),
            (None, Some(token), _) => (Some(token.clone()), None),
            (None, None, Some(secret)) => match crate::session::link_auth::random_bytes() {
                Ok(nonce) => {
                    self.proved = Some((challenge, nonce));
                    let mac = prove(secret, ProofRole::Dialer, &challenge, &nonce);
                    (None, Some(SecretProof { nonce, mac }))
                }
                Err(err) => {
                    // No hello rather than one that proves nothing: the
                    // handshake times out with the reason.
                    warn!(%err, "cannot prove the shared secret");
                    self.last_failure = Some(format!("cannot prove the shared secret: {err}"));
                    return;
                }
            },
            (None, None, None) => (None, None),
        };
        let hello = Frame::Hello(Hello {
            no_echo: !options.echo,
            // A request nothing answers fails at once (see `request`).
            no_responders: true,
            version: PROTOCOL_VERSION,
            name: options.name.clone(),
            credentials,
            user: options.user.clone(),
            proof,
            offers: self.offers().cloned().collect(),
            link_auth: self.link_secret.as_ref().map(|s| s.auth().clone()),
        });
        let _ = self.endpoints[CONTROL].send(peer, codec::encode(&hello));
        self.hello_sent = true;
    }

    /// Whether this side proves a shared secret (rather than logging in
    /// as a user, with a token, or with nothing).
    fn proves_secret(&self) -> bool {
        let options = &self.shared.options;
        options.user.is_none() && options.token.is_none() && options.credentials.is_some()
    }

    /// Whether the welcome answers this side's hello: sent after it and,
    /// when the hello proved the shared secret, proving it back.
    fn welcome_proven(&self, welcome: &Welcome) -> bool {
        if !self.hello_sent {
            return false;
        }
        if !self.proves_secret() {
            return true;
        }
        let (Some((challenge, nonce)), Some(secret)) =
            (self.proved, self.shared.options.credentials.as_deref())
        else {
            return false;
        };
        let expected = prove(secret, ProofRole::Acceptor, &challenge, &nonce);
        welcome
            .proof
            .is_some_and(|proof| constant_time_eq(&proof, &expected))
    }

    fn on_frame(&mut self, peer: PeerId, frame: Frame) {
        match frame {
            Frame::Challenge(challenge) => {
                if matches!(self.link, LinkState::AwaitWelcome { .. }) && !self.hello_sent {
                    self.send_hello(peer, challenge.nonce);
                }
            }
            Frame::Welcome(welcome) => {
                if !matches!(self.link, LinkState::AwaitWelcome { .. }) {
                    return;
                }
                if !self.welcome_proven(&welcome) {
                    let text = "the server did not prove it holds the shared secret (or \
                                welcomed a hello it never got): it may not be the broker \
                                meant (check --server and the secret)";
                    warn!(server = %self.shared.server, "{text}");
                    self.shared.set_state(ConnectionState::Refused {
                        code: ErrorCode::Auth,
                        text: text.to_string(),
                    });
                    self.endpoints[CONTROL].close(peer);
                    return;
                }
                self.shared
                    .max_payload
                    .store(welcome.max_payload, Ordering::Relaxed);
                // Within what the wire carries, and at least one of each.
                let subject_len = (welcome.max_subject_len as usize)
                    .clamp(1, crate::config::MAX_SUBJECT_LEN_LIMIT);
                let subject_tokens = (welcome.max_subject_tokens as usize).max(1);
                {
                    // Under the outbox's lock: a subject checked against
                    // the old limits is checked again.
                    let mut outbox = self.shared.outbox.lock();
                    self.shared
                        .max_subject_len
                        .store(subject_len, Ordering::Relaxed);
                    self.shared
                        .max_subject_tokens
                        .store(subject_tokens, Ordering::Relaxed);
                    outbox.valid_subject.clear();
                }
                self.codec.max_subject_len = subject_len;
                self.link = LinkState::Up { peer };
                self.backoff = Duration::from_millis(50);
                if self.ever_connected {
                    self.shared.reconnects.fetch_add(1, Ordering::Relaxed);
                }
                self.ever_connected = true;
                info!(server = %self.shared.server, name = %welcome.name, "connected");
                self.open_data_links(&welcome.offers, welcome.link_auth.as_ref());
                // Publishers may write to the control link themselves while
                // it carries the traffic.
                let direct = match self.conn.links.reliable {
                    None => self.endpoints[CONTROL].direct_sender(peer),
                    Some(_) => None,
                };
                self.shared.outbox.lock().direct = direct;
                if let Some(link) = &self.conn.links.reliable {
                    // The first frame on the data link tells the server to
                    // move its side of the traffic there too.
                    info!(link = %link.description, "reliable traffic moves to the data link");
                    let _ = self.transmit(codec::encode(&Frame::Ping { nonce: 0 }));
                }
                self.resubscribe();
                self.flush_pending();
                self.shared.set_state(ConnectionState::Connected {
                    server: welcome.name,
                });
            }
            Frame::Message(message) => self.on_message(
                message.sid,
                Subject {
                    text: &message.subject,
                    shared: None,
                },
                message.reply.as_deref(),
                message.headers,
                message.payload,
            ),
            Frame::Ping { nonce } => self.answer_ping(nonce),
            Frame::Pong { nonce } => {
                self.flushes.retain(|(waiting, done)| {
                    if *waiting <= nonce {
                        let _ = done.send(Ok(()));
                        false
                    } else {
                        true
                    }
                });
            }
            Frame::Error(error) => {
                if error.fatal && matches!(error.code, ErrorCode::Auth | ErrorCode::Version) {
                    warn!(code = ?error.code, text = %error.text, "server refused the connection");
                    self.shared.set_state(ConnectionState::Refused {
                        code: error.code,
                        text: error.text,
                    });
                } else {
                    warn!(code = ?error.code, text = %error.text, "server reported an error");
                    if !error.fatal {
                        let mut errors = self.shared.server_errors.lock();
                        if errors.len() >= SERVER_ERRORS_KEPT {
                            errors.pop_front();
                        }
                        errors.push_back((error.code, error.text));
                    }
                }
            }
            Frame::Goodbye(goodbye) => {
                info!(reason = %goodbye.reason, "server said goodbye");
                self.goodbye = Some(goodbye.reason);
            }
            Frame::Dropped(dropped) => {
                // Counted with the subscription's own drops; a report for
                // a subscription gone meanwhile (or the reply inbox) is
                // nobody's.
                if let Some(sub) = self.shared.subscriptions.lock().get(&dropped.sid) {
                    sub.sink.count_dropped_by_broker(dropped.count);
                }
            }
            Frame::BestEffortClosed {
                settled_through,
                sent_through,
                epoch,
                reason,
            } => {
                let told = GiveUp::Told {
                    settled_through,
                    sent_through,
                };
                self.best_effort_closed_by_broker(told, epoch, &reason)
            }
            other => debug!(frame = ?other, "ignoring unexpected frame"),
        }
    }

    /// A message from the server: a reply goes to the request waiting for
    /// it, anything else to its subscription's queue.
    fn on_message(
        &mut self,
        sid: u64,
        subject: Subject<'_>,
        reply: Option<&str>,
        headers: Option<Bytes>,
        payload: Bytes,
    ) {
        let inbox = self.shared.inbox_sid_seen.load(Ordering::Acquire);
        if inbox != 0 && sid == inbox {
            let subject = Arc::from(subject.text);
            self.dispatch_reply(subject, reply.map(Arc::from), headers, payload);
            return;
        }
        // The subject as a shared string: the last one again while messages
        // keep arriving on it, so a delivery does not allocate.
        let subject = match (subject.shared, &self.last_subject) {
            (Some(shared), _) => shared.clone(),
            (None, Some(last)) if **last == *subject.text => last.clone(),
            (None, _) => {
                let fresh: Arc<str> = Arc::from(subject.text);
                self.last_subject = Some(fresh.clone());
                fresh
            }
        };
        let message = Message {
            subject,
            reply: reply.map(Arc::from),
            headers,
            payload,
        };
        if self.shared.deliver_to(&mut None, sid, message) {
            self.send(codec::encode(&Frame::Unsubscribe { sid }));
        }
    }

    /// Hand a reply to the request waiting for its token; a reply nobody
    /// waits for (the request timed out) is dropped.
    fn dispatch_reply(
        &mut self,
        subject: Arc<str>,
        reply: Option<Arc<str>>,
        headers: Option<Bytes>,
        payload: Bytes,
    ) {
        let token = reply_token(&subject, &self.shared.inbox_prefix);
        let waiting = token.and_then(|token| self.shared.replies.lock().remove(&token));
        if let Some(waiting) = waiting {
            let _ = waiting.send(Message {
                subject,
                reply,
                headers,
                payload,
            });
        }
    }

    /// Re-send every live subscription after (re)connecting; they go before
    /// any buffered publish so replies and messages find them.
    fn resubscribe(&mut self) {
        self.subscribed.clear();
        let frames: Vec<OutFrame> = self
            .shared
            .subscriptions
            .lock()
            .iter()
            .map(|(&sid, sub)| {
                self.subscribed.insert(sid);
                subscribe_frame(sid, sub)
            })
            .collect();
        // Once the path refuses one, the rest wait too, in order, ahead
        // of the publishes buffered meanwhile.
        let mut waiting = Vec::new();
        for frame in frames {
            if !waiting.is_empty() {
                waiting.push(Queued::frame(frame, false));
            } else if let Some(rest) = self.transmit(frame) {
                waiting.push(rest);
            }
        }
        self.conn.out.resubscribed(waiting);
    }

    /// Take what application threads queued in the outbox and hand it on
    /// in order; true if there was anything. Nothing is taken while frames
    /// refused by the path wait.
    fn drain_outbox(&mut self) -> bool {
        // While the path pushes back (or is down), the outbox keeps what
        // publishers add, and they wait once it is full.
        if !self.conn.out.is_empty() {
            return false;
        }
        let bound = self.shared.options.max_pending_bytes;
        let was_full = {
            let mut outbox = self.shared.outbox.lock();
            if outbox.is_empty() {
                return false;
            }
            outbox.close_run();
            let was_full = outbox.bytes >= bound || outbox.items.len() >= MAX_ITEMS;
            std::mem::swap(&mut self.taken, &mut outbox.items);
            outbox.bytes = 0;
            outbox.run_limit = self.conn.links.run_limit();
            // The items taken are on their way: a publish must not pass
            // them on the publisher's own thread (a driver's round may run
            // while the loop thread sleeps with the flag set).
            outbox.loop_idle = false;
            was_full
        };
        if was_full {
            self.shared.room.notify_all();
        }
        while let Some(item) = self.taken.pop_front() {
            match item {
                Item::Run(run, frames) => self.send_out(Queued::counted_run(run, 0, frames)),
                Item::Frame(frame) => self.send_out(Queued::frame(frame, false)),
                Item::Command(command) => self.on_command(command),
            }
        }
        true
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Subscribe { sid } => {
                // While disconnected, the subscription is sent on reconnect
                // (and not again when its command is taken after that).
                if let LinkState::Up { .. } = self.link {
                    if self.subscribed.contains(&sid) {
                        return;
                    }
                    let frame = self
                        .shared
                        .subscriptions
                        .lock()
                        .get(&sid)
                        .map(|sub| subscribe_frame(sid, sub));
                    if let Some(frame) = frame {
                        self.subscribed.insert(sid);
                        self.send(frame);
                    }
                }
            }
            Command::Unsubscribe { sid } => {
                self.subscribed.remove(&sid);
                if let LinkState::Up { .. } = self.link {
                    self.send(codec::encode(&Frame::Unsubscribe { sid }));
                }
            }
            Command::Flush(done) => {
                let nonce = self.next_nonce;
                self.next_nonce += 1;
                self.send(codec::encode(&Frame::Ping { nonce }));
                self.flushes.push((nonce, done));
            }
        }
    }

    fn send(&mut self, frame: OutFrame) {
        self.send_out(Queued::frame(frame, false));
    }

    /// Answer a ping on the control link, ahead of anything queued. The
    /// server's ping on a new data link asks for proof that this side
    /// receives at its fabric address, and the server grants that link no
    /// credit until the answer comes: behind frames waiting for credit it
    /// would never come. Only the nonce matters, whichever way it returns.
    fn answer_ping(&mut self, nonce: u64) {
        let pong = codec::encode(&Frame::Pong { nonce });
        let LinkState::Up { peer } = self.link else {
            return self.send(pong);
        };
        if let Err(SendError::WouldBlock(pong)) = self.endpoints[CONTROL].send(peer, pong) {
            self.send(pong);
        }
    }

    /// Send a frame, or a run of frames, behind whatever is pending.
    fn send_out(&mut self, queued: Queued) {
        if !matches!(self.link, LinkState::Up { .. }) {
            self.conn.out.push(queued);
            return;
        }
        let mut counts = SendCounts::default();
        self.conn.send(&mut self.endpoints, &mut counts, queued);
        self.count_sent(counts);
    }

    fn flush_pending(&mut self) {
        if !matches!(self.link, LinkState::Up { .. }) {
            return;
        }
        let mut counts = SendCounts::default();
        self.conn.flush(&mut self.endpoints, &mut counts);
        self.count_sent(counts);
    }

    /// Send one frame now on the current connection's path, ahead of
    /// anything pending; what the path did not take comes back.
    fn transmit(&mut self, frame: OutFrame) -> Option<Queued> {
        let mut counts = SendCounts::default();
        let queued = Queued::frame(frame, false);
        let conn = &mut self.conn;
        let rest = outbound::transmit(
            &mut self.endpoints,
            conn.control,
            &mut conn.links,
            &mut counts,
            queued,
        );
        self.count_sent(counts);
        rest
    }

    /// Add what sends counted to the link report's counters (only this
    /// thread writes them).
    fn count_sent(&self, counts: SendCounts) {
        let counters = &self.shared.counters;
        if counts.fabric_frames_out > 0 {
            counters
                .fabric_out
                .fetch_add(counts.fabric_frames_out, Ordering::Relaxed);
        }
        if counts.credit_waits > 0 {
            counters
                .credit_waits
                .fetch_add(counts.credit_waits, Ordering::Relaxed);
        }
    }

    /// Open the data links both sides agree on, from the server's offers.
    /// The client moves its traffic to the reliable data link at once; the
    /// server follows when the first frame arrives there.
    fn open_data_links(&mut self, remote: &[Offer], remote_auth: Option<&LinkAuth>) {
        self.close_links();
        let offers: Vec<Offer> = self.offers().cloned().collect();
        let keying = self
            .link_secret
            .as_ref()
            .zip(remote_auth)
            .map(|(secret, peer)| Keying {
                secret,
                role: HandshakeRole::Dialer,
                peer,
            });
        let negotiation = self.conn.links.open(
            &mut self.endpoints,
            &offers,
            remote,
            &self.shared.options.preference,
            &self.tuning,
            keying,
        );
        self.conn.links.in_use = self.conn.links.reliable.is_some();
        let mut report = self.shared.link.lock();
        // The reasons describe this handshake, not every one since start.
        report.reasons.clone_from(&self.unavailable);
        report
            .reasons
            .extend(self.withdrawn.iter().map(|w| w.reason.clone()));
        report.reasons.extend(negotiation.reasons);
        report.reliable = match &self.conn.links.reliable {
            Some(link) => link.description.clone(),
            None => self.endpoints[CONTROL].scheme().to_string(),
        };
        report.best_effort = self
            .conn
            .links
            .best_effort
            .as_ref()
            .map(|link| link.description.clone());
        report.fabric_address = self.conn.links.reliable.as_ref().map(|link| {
            efabus_transports::fabric::addr_to_hex(&self.endpoints[link.endpoint].local_addr())
        });
        report.server_link_id = remote_auth
            .filter(|_| self.conn.links.reliable.is_some())
            .map(|auth| auth.link_id);
    }

    /// An event from a data endpoint.
    fn on_data_event(&mut self, index: usize, event: Event) {
        let LinkState::Up { peer: control } = self.link else {
            return;
        };
        match event {
            Event::Frames { peer, run } => {
                for frame in split_run(&run) {
                    self.on_data_event(
                        index,
                        Event::Frame {
                            peer,
                            frame: frame.head,
                        },
                    );
                }
            }
            Event::Frame { peer, frame } => {
                let Some(kind) = self.conn.links.kind_of(index, peer) else {
                    return;
                };
                let now = self.now;
                let mut released = std::mem::take(&mut self.released);
                let result = self.conn.links.receive(kind, now, frame, &mut released);
                // Each message's payload is a slice of its frame, held by
                // its reader.
                open_released(&mut released, &mut self.released_scratch);
                if kind == LinkKind::BestEffort {
                    let counters = &self.shared.counters;
                    BrokerStats::add_saturating(
                        &counters.best_effort_lost,
                        self.conn.links.take_best_effort_lost(),
                    );
                    let bad = self.conn.links.take_bad_link_frames();
                    if bad > 0 {
                        BrokerStats::add(&counters.bad_link_frames, bad);
                    }
                }
                if !released.is_empty() {
                    let received = released.len() as u64;
                    self.shared
                        .counters
                        .fabric_in
                        .fetch_add(received, Ordering::Relaxed);
                }
                self.deliver_messages(&mut released, Self::on_data_frame);
                self.released = released;
                if !self.conn.out.is_empty() {
                    // The message may have been a credit opening the window.
                    self.flush_pending();
                }
                if let Err(err) = result {
                    if kind == LinkKind::Reliable {
                        self.reliable_link_failed(control, &err, now);
                    } else {
                        debug!(error = %err, "best-effort link refused a message");
                    }
                }
            }
            Event::Writable { .. } => self.flush_pending(),
            Event::Closed { peer, reason } => {
                if self.conn.links.kind_of(index, peer).is_some() {
                    warn!(%reason, "data link closed; reconnecting");
                    self.endpoints[CONTROL].close(control);
                    self.link_lost(Instant::now());
                }
            }
            // A client proves its own address; it holds no peer's reads.
            Event::Accepted { .. } | Event::ReadHeld { .. } => {}
        }
    }

    /// Tell the broker how far this side has taken its data links; true
    /// while a credit is still owed (it waits for `CREDIT_DELAY`).
    fn grant_credits(&mut self, now: Instant) -> bool {
        self.conn.links.grant_credits(&mut self.endpoints, now)
    }

    /// The reliable data link refused what arrived, or a message on it
    /// went missing: nothing after it could be delivered in order, so the
    /// connection is dropped and made again.
    fn reliable_link_failed(&mut self, control: PeerId, err: &LinkError, now: Instant) {
        let counters = &self.shared.counters;
        match err {
            LinkError::GapTimeout { .. } | LinkError::PartialTimeout { .. } => {
                counters.link_gap_failures.fetch_add(1, Ordering::Relaxed);
            }
            LinkError::MemoryBound { .. } | LinkError::SharedMemoryBound { .. } => {
                counters
                    .link_memory_refusals
                    .fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        warn!(server = %self.shared.server, error = %err, "reliable data link failed; reconnecting");
        self.endpoints[CONTROL].close(control);
        self.link_lost(now);
    }

    /// A send on the reliable data link failed part-way this round: the
    /// broker would wait for the lost frame, so the connection is made
    /// again. What was waiting to be sent is sent after reconnecting.
    fn check_send_failure(&mut self) {
        let (Some(reason), LinkState::Up { peer }) = (&self.conn.links.failure, self.link) else {
            return;
        };
        self.shared
            .counters
            .link_send_failures
            .fetch_add(1, Ordering::Relaxed);
        warn!(server = %self.shared.server, %reason, "reliable data link send failed; reconnecting");
        self.endpoints[CONTROL].close(peer);
        self.link_lost(Instant::now());
    }

    /// Release what the best-effort link's timeouts allow; drop the
    /// connection when a gap on the reliable link did not fill in time.
    fn poll_links(&mut self, now: Instant) {
        let LinkState::Up { peer } = self.link else {
            return;
        };
        if self
            .conn
            .links
            .next_deadline()
            .is_none_or(|deadline| deadline > now)
        {
            return;
        }
        let mut released = std::mem::take(&mut self.released);
        let result = self.conn.links.poll(now, &self.endpoints, &mut released);
        open_released(&mut released, &mut self.released_scratch);
        let counters = &self.shared.counters;
        BrokerStats::add_saturating(
            &counters.best_effort_lost,
            self.conn.links.take_best_effort_lost(),
        );
        // Frames held behind a gap the timeout gave up on arrived over the
        // fabric too.
        counters
            .fabric_in
            .fetch_add(released.len() as u64, Ordering::Relaxed);
        for bytes in released.drain(..) {
            if let Ok(frame) = codec::decode(bytes, &self.codec) {
                self.on_frame(peer, frame);
            }
        }
        self.released = released;
        // (A frame handed on above may have ended the connection already.)
        if let (Err(err), LinkState::Up { peer }) = (result, self.link) {
            self.reliable_link_failed(peer, &err, now);
        }
    }
}

/// The subject of a received message, and the shared string holding the
/// same text when the loop has one already.
struct Subject<'a> {
    text: &'a str,
    shared: Option<&'a Arc<str>>,
}

fn subscribe_frame(sid: u64, sub: &ClientSub) -> OutFrame {
    codec::encode(&Frame::Subscribe(frame::Subscribe {
        sid,
        pattern: sub.pattern.clone(),
        queue: sub.queue.clone(),
        class: sub.class,
    }))
}

/// Whether a header block is the status a server answers a request with
/// when nothing is subscribed to its subject.
fn is_no_responders(block: &[u8]) -> bool {
    efabus_core::headers::Headers::parse(block).is_ok_and(|h| h.status() == Some(503))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Broker, Config};

    const WAIT: Duration = Duration::from_secs(10);

    fn tcp_broker() -> (Broker, String) {
        let config = Config::from_toml_str(
            "name = \"client-unit\"\nlisten = [\"tcp/127.0.0.1:0\"]\n",
            "client unit test",
        )
        .expect("valid config");
        let broker = Broker::start(config).expect("broker starts");
        let endpoint = broker.endpoint("tcp").expect("tcp listener");
        (broker, endpoint)
    }

    fn connect(endpoint: &str) -> Client {
        let options = ClientOptions {
            connect_timeout: WAIT,
            ..ClientOptions::default()
        };
        Client::connect_with(endpoint, options, Registry::with_builtins()).expect("connects")
    }

    /// Dropping a subscription while the outbox is at its item bound
    /// neither waits for room nor loses the unsubscribe: the server stops
    /// sending what nobody would read.
    #[test]
    fn an_unsubscribe_goes_in_when_the_outbox_is_full() {
        let (broker, endpoint) = tcp_broker();
        let client = connect(&endpoint);
        let sub = client.subscribe("gone").unwrap();
        client.flush(WAIT).unwrap();
        let patterns = || -> Vec<String> {
            let reports = broker
                .connections_with_subscriptions(WAIT)
                .expect("a report");
            reports
                .iter()
                .flat_map(|report| report.subscriptions.iter())
                .map(|sub| sub.pattern.clone())
                .collect()
        };
        assert_eq!(patterns(), ["gone"]);
        let filler = || Item::Command(Command::Unsubscribe { sid: u64::MAX });
        {
            // The loop runs no round meanwhile, so nothing is taken.
            let driven = client.shared.session.driven_loop().expect("the loop");
            let _held = driven.lock().expect("the loop runs");
            client
                .shared
                .outbox
                .lock()
                .items
                .extend((0..MAX_ITEMS).map(|_| filler()));
            let dropping = Instant::now();
            drop(sub);
            assert!(
                dropping.elapsed() < Duration::from_secs(1),
                "{:?}",
                dropping.elapsed()
            );
            let mut outbox = client.shared.outbox.lock();
            assert_eq!(outbox.items.len(), MAX_ITEMS + 1);
            // The filler goes; the unsubscribe, last, stays.
            outbox.items.retain(|item| {
                !matches!(item, Item::Command(Command::Unsubscribe { sid: u64::MAX }))
            });
            assert_eq!(outbox.items.len(), 1);
        }
        client.flush(WAIT).unwrap();
        assert!(patterns().is_empty(), "{:?}", patterns());
    }

    #[test]
    fn publish_runs_end_at_their_paths_piece_and_count_their_frames() {
        let mut outbox = Outbox::default();
        assert_eq!(outbox.run_limit, usize::MAX, "no limit before a path");
        // A data link that takes 100 bytes of frames in one piece.
        outbox.run_limit = 100;
        for _ in 0..5 {
            outbox.make_room(30);
            outbox.open.extend_from_slice(&[0; 30]);
            outbox.open_frames += 1;
            assert!(outbox.open.capacity() <= 100, "no room beyond the piece");
        }
        outbox.close_run();
        let runs: Vec<(usize, usize)> = outbox
            .items
            .iter()
            .map(|item| match item {
                Item::Run(run, frames) => (run.len(), *frames),
                _ => panic!("only runs were made"),
            })
            .collect();
        assert_eq!(runs, vec![(90, 3), (60, 2)]);
        // A frame larger than the piece still goes, alone: the open run
        // ends before it.
        outbox.make_room(30);
        outbox.open.extend_from_slice(&[0; 30]);
        outbox.open_frames += 1;
        outbox.make_room(150);
        assert!(outbox.open.is_empty() && outbox.open.capacity() >= 150);
        assert!(matches!(outbox.items.back(), Some(Item::Run(run, 1)) if run.len() == 30));
    }

    /// Wait until the client's loop sleeps with nothing queued, so the next
    /// publish goes out on the publishing thread.
    fn until_loop_idle(client: &Client) {
        let deadline = Instant::now() + WAIT;
        while !client.shared.outbox.lock().loop_idle {
            assert!(Instant::now() < deadline, "the client loop never went idle");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_silent_scheme_pauses_twice_as_long_each_time_up_to_an_hour() {
        let minute = Duration::from_secs(60);
        assert_eq!(next_silent_pause(minute, minute), 2 * minute);
        let mut pause = minute;
        for _ in 0..10 {
            pause = next_silent_pause(pause, minute);
        }
        assert_eq!(pause, SILENT_RETRY_MAX);
        let day = Duration::from_secs(86_400);
        assert_eq!(next_silent_pause(day, day), day, "a longer pause is kept");
        assert_eq!(
            next_silent_pause(Duration::ZERO, Duration::ZERO),
            Duration::ZERO
        );
        assert_eq!(
            next_silent_pause(Duration::MAX, Duration::MAX),
            Duration::MAX
        );
    }

    #[test]
    fn a_subscription_is_in_place_before_the_next_publish() {
        // Subscribing queues a command for the loop; a publish right after
        // (on the publishing thread or through the loop) must reach the
        // server behind it, or the client would miss its own message.
        let (_broker, endpoint) = tcp_broker();
        let client = connect(&endpoint);
        for i in 0..30 {
            if i % 2 == 0 {
                until_loop_idle(&client);
            }
            let subject = format!("own.{i}");
            let sub = client.subscribe(&subject).unwrap();
            client
                .publish(&subject, Bytes::from(vec![i as u8]))
                .unwrap();
            let message = sub.recv_timeout(WAIT).expect("own message");
            assert_eq!(&message.payload[..], &[i as u8]);
        }
    }

    #[test]
    fn publishes_keep_their_order_across_direct_and_loop_sends() {
        // Small (copied) and large (shared) payloads, sent while the loop
        // sleeps (on this thread) and while it is busy (through it).
        let (_broker, endpoint) = tcp_broker();
        let subscriber = connect(&endpoint);
        let sub = subscriber.subscribe("mixed").unwrap();
        subscriber.flush(WAIT).unwrap();
        let publisher = connect(&endpoint);
        let count = 200u32;
        for n in 0..count {
            if n % 10 == 0 {
                until_loop_idle(&publisher);
                assert!(publisher.shared.outbox.lock().direct.is_some());
            }
            let len = if n % 3 == 0 { 4 * COPY_MAX } else { 8 };
            let mut payload = vec![0u8; len];
            payload[..4].copy_from_slice(&n.to_le_bytes());
            publisher.publish("mixed", payload).unwrap();
        }
        for n in 0..count {
            let message = sub.recv_timeout(WAIT).expect("every message");
            let got = u32::from_le_bytes(message.payload[..4].try_into().unwrap());
            assert_eq!(got, n, "out of order");
            let len = if n % 3 == 0 { 4 * COPY_MAX } else { 8 };
            assert_eq!(message.payload.len(), len);
        }
    }

    #[test]
    fn a_request_sent_while_the_loop_sleeps_gets_its_reply() {
        let (broker, endpoint) = tcp_broker();
        let requests = broker.subscribe("svc.echo").unwrap();
        let responder = std::thread::spawn(move || {
            for request in requests.take(5) {
                if let Some(reply) = &request.reply {
                    let _ = broker.publish(reply, request.payload.clone());
                }
            }
            broker
        });
        let client = connect(&endpoint);
        for i in 0..5u8 {
            until_loop_idle(&client);
            let reply = client.request("svc.echo", vec![i], WAIT).unwrap();
            assert_eq!(&reply.payload[..], &[i]);
        }
        drop(responder.join().unwrap());
    }

    #[test]
    fn threads_that_wait_drive_the_loop() {
        // A client's request caller, and a subscription's reader (a
        // client's, an embedded broker's) while the loop thread finds
        // nothing to do, run the loop's rounds themselves: what they wait
        // for comes with no hand-over from the loop thread.
        let (broker, endpoint) = tcp_broker();
        let requester = connect(&endpoint);
        let responder = connect(&endpoint);
        let requests = responder.subscribe("svc.echo").unwrap();
        responder.flush(WAIT).unwrap();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while let Ok(request) = requests.recv_timeout(WAIT) {
                    // A request without reply subject ends the echo.
                    let Some(reply) = &request.reply else { break };
                    responder.publish(reply, request.payload).unwrap();
                }
            });
            for i in 0..200u32 {
                let payload = Bytes::from(i.to_le_bytes().to_vec());
                let reply = requester.request("svc.echo", payload.clone(), WAIT);
                assert_eq!(reply.unwrap().payload, payload);
                // An embedded broker's request waits on its inbox, whose
                // reader runs the broker's loop.
                let reply = broker.request("svc.echo", payload.clone(), WAIT);
                assert_eq!(reply.unwrap().payload, payload);
            }
            requester.publish("svc.echo", Bytes::new()).unwrap();
        });
        assert!(requester.link().driven_rounds > 0, "the requester drove");
        assert!(responder.link().driven_rounds > 0, "the reader drove");
        let driven = broker.stats().driven_rounds.load(Ordering::Relaxed);
        assert!(driven > 0, "the broker's inbox reader drove");
    }

    #[test]
    fn publishes_keep_their_order_while_other_threads_drive_the_session() {
        // One thread publishes a numbered stream, pausing now and then so
        // that the loop sleeps (and the next publish may go out on the
        // publisher's own thread); meanwhile another thread of the same
        // client drives its session with requests and a third queues
        // subscription commands between the publishes. Every message must
        // arrive once, in order.
        let (broker, endpoint) = tcp_broker();
        let echo = broker.subscribe("svc.echo").unwrap();
        let stream = broker.subscribe("order").unwrap();
        let client = connect(&endpoint);
        const COUNT: u32 = 20_000;
        let done = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while let Ok(request) = echo.recv_timeout(WAIT) {
                    let Some(reply) = &request.reply else { break };
                    let _ = broker.publish(reply, request.payload);
                }
            });
            let requester = scope.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    client.request("svc.echo", vec![1], WAIT).unwrap();
                }
            });
            scope.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    drop(client.subscribe("churn").unwrap());
                    std::thread::sleep(Duration::from_micros(50));
                }
            });
            let publisher = scope.spawn(|| {
                for n in 0..COUNT {
                    client
                        .publish("order", Bytes::from(n.to_le_bytes().to_vec()))
                        .unwrap();
                    if n % 64 == 0 {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
            });
            for expected in 0..COUNT {
                let message = stream.recv_timeout(WAIT).expect("every message");
                let n = u32::from_le_bytes(message.payload[..4].try_into().unwrap());
                assert_eq!(n, expected, "out of order");
            }
            publisher.join().unwrap();
            done.store(true, Ordering::Relaxed);
            requester.join().unwrap();
            // Ends the echo.
            broker.publish("svc.echo", Bytes::new()).unwrap();
        });
        assert!(client.link().driven_rounds > 0, "the requests drove");
    }
}
