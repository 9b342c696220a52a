//! The embedded [`Broker`] handle: starting a broker (its endpoints and
//! its event loop thread), the state the handle shares with the loop, the
//! counters, and in-process delivery.
//!
//! Threads: in-process publishers look up targets on their own thread through the
//! shared subscription table (see [`crate::publish_cache`]) and deliver to
//! in-process subscribers directly; deliveries to remote peers reach the
//! event loop as runs through a bounded queue (`crate::published`), other
//! requests through a bounded command queue. The event loop thread
//! (`crate::event_loop`) owns every endpoint and session.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::Sender;
use efabus_core::codec::CodecLimits;
use efabus_core::frame::DeliveryClass;
use efabus_core::subject::{self, SubjectLimits};
use efabus_core::transport::{detach, Readiness};
use efabus_transports::registry::{EndpointSpec, Registry, RegistryError};
use efabus_transports::tcp;
use mio::unix::SourceFd;
use mio::{Interest, Poll, Token, Waker};
use parking_lot::{Condvar, Mutex, RwLock};
use tracing::{info, warn};

use crate::accounts::Accounts;
use crate::commands::CommandQueue;
use crate::config::{Config, SlowConsumerPolicy};
use crate::delivery::{
    self, Delivery, LocalSink, Message, Responder, Subscription, SubscriptionOwner,
};
use crate::drive::DriveHandle;
use crate::endpoints::{self, listener_config, with_faults};
use crate::error::{Error, RecvError};
use crate::event_loop::{run_loop, CheckedLogin, Cluster, EventLoop, HANDSHAKE_FRAME_MAX, WAKER};
use crate::monitoring::{ConnectionReport, ListenerReport, MatchReport, RemoteMatch};
use crate::publish_cache;
use crate::published::{PublishedMessage, PublishedQueue};
use crate::reload::LiveLimits;
use crate::round_watch::{LoopStall, RoundWatch, WatchedEndpoint};
use crate::subscriptions::{SubRef, SubscriptionTable, Targets, LOCAL_OWNER};

/// Commands queued for the loop, and messages in-process publishers queued
/// for remote subscribers, before a thread that adds one waits.
const COMMAND_QUEUE: usize = 65_536;

/// Replies a broker's request inbox holds at least (see
/// `Broker::reply_inbox`).
const REPLY_INBOX_MIN: usize = 4096;

/// Payload and header bytes in-process publishes may have waiting for the
/// event loop on their way to remote subscribers, at least (beside the
/// [`COMMAND_QUEUE`] messages).
const PUBLISHED_BYTES_MIN: usize = 64 << 20;

/// What in-process publishes bound for remote subscribers may hold while
/// they wait for the event loop: four times `limits.max_pending_bytes`
/// (what one peer's queue holds), at least [`PUBLISHED_BYTES_MIN`].
fn published_bytes(config: &Config) -> usize {
    config
        .limits
        .max_pending_bytes
        .saturating_mul(4)
        .max(PUBLISHED_BYTES_MIN)
}

/// A secret the broker checks travels in the clear on a TCP listener
/// without TLS: say so at start for each such listener reachable from
/// other hosts (loopback is this host's own).
fn warn_of_cleartext_secrets(config: &Config, listening: &[(String, String)]) {
    // Shared secrets are only proven, but users' passwords and tokens are
    // sent, and nothing protects a session after its handshake.
    let checks_secrets = config.auth.secret.is_some()
        || config.cluster.secret.is_some()
        || !config.auth.users.is_empty();
    if !checks_secrets {
        return;
    }
    for (scheme, address) in listening {
        let loopback = address
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|address| address.ip().is_loopback());
        if loopback {
            continue;
        }
        if scheme == efabus_transports::nats::SCHEME && !config.tls.is_set() {
            // NATS clients send the secret itself, as their token.
            warn!(
                %address,
                "credentials are checked on a NATS listener without TLS: NATS clients send \
                 passwords, tokens and the shared secret in the clear; set [tls] cert and key"
            );
        } else if scheme == tcp::SCHEME && !config.tls.is_set() {
            warn!(
                %address,
                "credentials are checked on a listener without TLS: users' passwords and \
                 tokens cross the network in the clear, and sessions are not protected after \
                 the handshake; set [tls] cert and key"
            );
        }
    }
}

/// What the event loop is asked apart from its commands, answered every
/// round, also while it holds the commands.
pub(crate) enum LoopRequest {
    /// A report of every session, with the subscriptions of the sessions
    /// named; not made once the flag is set (by an asker that stopped
    /// waiting: a stalled loop would otherwise make every report asked
    /// meanwhile, back to back, for nobody).
    Connections(Vec<u64>, Arc<AtomicBool>, Sender<Vec<ConnectionReport>>),
    /// Read the endpoints' TLS files again, all or none; answers how many
    /// have TLS, or why one could not. Taken only if the flag was not set
    /// first (by an asker that stopped waiting), and it is set when taken.
    ReloadTls(Arc<AtomicBool>, Sender<Result<usize, String>>),
    /// Hand reloaded limits to the endpoints that hold clients to them
    /// (NATS listeners): their options for the reloaded configuration.
    /// Answered once they have them.
    Reconfigure(Box<crate::config::Config>, Sender<()>),
}

/// Counters of a running broker.
#[derive(Debug, Default)]
pub struct BrokerStats {
    pub connections: AtomicU64,
    pub connections_total: AtomicU64,
    pub messages_in: AtomicU64,
    pub messages_out: AtomicU64,
    pub bytes_in: AtomicU64,
    /// Messages the drop-oldest policy discarded (for remote peers and
    /// in-process subscriptions alike). A client is told, per
    /// subscription, what was discarded for it (`Subscription::stats`).
    pub slow_consumer_drops: AtomicU64,
    pub slow_consumer_disconnects: AtomicU64,
    /// Messages queued for a remote peer that were discarded with its
    /// connection: cut off as a slow consumer, lost, or still queued when
    /// the shutdown drain time ran out; also those an in-process publisher
    /// had routed to it that still waited for the event loop when it went.
    pub connection_drops: AtomicU64,
    /// Frames a peer's reliable data link had sent that the peer had not
    /// acknowledged when its session ended, and best-effort frames its
    /// datagram link had sent that no credit confirmed: taken by the peer
    /// before it went (its credit not sent yet) or lost with it; this
    /// side cannot tell which. With `connection_drops` it bounds what a
    /// failed connection or route lost in flight.
    pub unacknowledged_at_close: AtomicU64,
    pub bad_frames: AtomicU64,
    /// Publishes refused for a payload over `limits.max_payload` (a
    /// client connected before the limit was lowered may still send
    /// them; it is answered with an error).
    pub oversized_payloads: AtomicU64,
    /// Publishes and subscriptions a user's permissions refused (each
    /// answered with a `PermissionDenied` error).
    pub permission_denials: AtomicU64,
    /// Publishes refused for an invalid subject or reply subject (each
    /// answered with an `InvalidSubject` error; a NATS client that did
    /// not ask for `pedantic` is not told, as NATS servers accept them).
    pub invalid_publishes: AtomicU64,
    pub auth_failures: AtomicU64,
    pub refused_connections: AtomicU64,
    /// Accepted connections still in their handshake now (a level):
    /// against `limits.max_handshakes`.
    pub handshakes: AtomicU64,
    /// Rounds of the event loop that application threads of an embedded
    /// broker ran while they waited for a message or a reply, rather than
    /// the loop thread.
    pub driven_rounds: AtomicU64,
    /// Bytes queued towards remote peers by the broker, right now.
    pub queued_bytes: AtomicU64,
    /// Frames received and sent over negotiated fabric data links.
    pub fabric_frames_in: AtomicU64,
    pub fabric_frames_out: AtomicU64,
    /// Best-effort messages the datagram link could not take.
    pub best_effort_drops: AtomicU64,
    /// Best-effort messages that went missing on their way to this broker
    /// (over a route's datagram link): counted when a later one, or a
    /// probe saying it was sent, shows the gap and the gap times out, or
    /// when the link closes on the peer's word that it was sent.
    pub best_effort_lost: AtomicU64,
    /// Sends to data links that found the peer's credit window full (the
    /// frame waited, or on a datagram link was dropped and counted in
    /// `best_effort_drops`).
    pub credit_waits: AtomicU64,
    /// Credit and probe frames from peers' datagram links that did not
    /// decode: ignored, a later credit or probe carrying what they would
    /// have said, the link going on.
    pub bad_link_frames: AtomicU64,
    /// Sessions failed because a data link would have held more for
    /// reordering and reassembly than its own bound or, with the other
    /// links, `limits.max_link_memory`.
    pub link_memory_refusals: AtomicU64,
    /// Sessions failed because a message went missing on a reliable data
    /// link: frames waited behind it longer than
    /// `fabric.reliable_gap_timeout_ms` without it arriving.
    pub link_gap_failures: AtomicU64,
    /// Sessions failed because a send on their reliable data link failed
    /// after its frame was numbered (the peer would have waited for it).
    pub link_send_failures: AtomicU64,
    /// Routes to other brokers that are up, right now.
    pub routes: AtomicU64,
    /// Peers that asked to become a route without the route credential
    /// (`cluster.secret`): refused with an `Auth` error and closed.
    pub route_refusals: AtomicU64,
    /// Messages received from and forwarded to other brokers over routes.
    pub route_messages_in: AtomicU64,
    pub route_messages_out: AtomicU64,
    /// Fabric messages the endpoints refused before they reached a
    /// session: naming no live link, failing authentication (forged),
    /// replayed, or not efabus messages at all (malformed).
    pub fabric_unknown_links: AtomicU64,
    pub fabric_forged: AtomicU64,
    pub fabric_replayed: AtomicU64,
    pub fabric_malformed: AtomicU64,
    /// Sessions ended because the peer never answered the nonce sent to
    /// the fabric address it gave.
    pub unproven_addresses: AtomicU64,
    /// Routes this broker dialed that ended because their reliable data
    /// link carried nothing back (their peer is then dialed without the
    /// fabric).
    pub silent_data_links: AtomicU64,
    /// Datagram (best-effort) links of clients and routes closed alone,
    /// the session going on (by either side, for any reason), and opened
    /// again later in their session: a path that keeps failing shows as
    /// both growing.
    pub datagram_links_given_up: AtomicU64,
    pub datagram_links_reopened: AtomicU64,
    /// Interest entries a route announced that this broker refused (over
    /// `limits.max_route_interest`, or a pattern its limits refuse):
    /// their subscribers get nothing published here.
    pub route_interest_refused: AtomicU64,
    /// Queue-group messages a route brought for a group whose members
    /// here had all gone (the peer had not heard yet): lost, not given to
    /// a member elsewhere.
    pub route_group_undelivered: AtomicU64,
    /// Messages kept from a route because the peer broker takes none so
    /// large (its `limits.max_payload`, or subject limits, below this
    /// broker's): its subscribers do not get them.
    pub route_oversized: AtomicU64,
    /// What the listeners' own buffers take (fabric endpoints' send and
    /// receive pools), and of that what is registered (pinned).
    pub fabric_buffer_bytes: AtomicU64,
    pub fabric_registered_bytes: AtomicU64,
    /// Frames the listeners sent and received by rendezvous, the bytes
    /// read (and the frames of those landed in huge pages), the bodies
    /// registered for them, transfers released because their peer closed
    /// first, and peers' frames whose read was given up for the same
    /// reason.
    pub fabric_rendezvous_sent: AtomicU64,
    pub fabric_rendezvous_read: AtomicU64,
    pub fabric_rendezvous_read_bytes: AtomicU64,
    pub fabric_rendezvous_huge_landed: AtomicU64,
    pub fabric_rendezvous_registrations: AtomicU64,
    pub fabric_rendezvous_abandoned: AtomicU64,
    pub fabric_rendezvous_reads_given_up: AtomicU64,
    /// Frames sent by rendezvous from a body registered already (the
    /// registration cache served them), and the rendezvous registrations
    /// held right now with their bytes: bodies offered to peers' reads and,
    /// under FI_MR_LOCAL, the buffers reads in flight land in
    /// (`fabric_rendezvous_registrations` counts the bodies registered
    /// since the start).
    pub fabric_rendezvous_cache_hits: AtomicU64,
    pub fabric_rendezvous_registered: AtomicU64,
    pub fabric_rendezvous_registered_bytes: AtomicU64,
    /// What the listeners' providers did: messages handed to them and
    /// delivered by them (each may carry several frames), completion-queue
    /// reads made (each runs the provider's progress), operations that
    /// failed, receive buffers lent and sends made in place (no copy),
    /// address-vector entries evicted, and sends handed back because the
    /// send slots were full.
    pub fabric_messages_sent: AtomicU64,
    pub fabric_messages_received: AtomicU64,
    pub fabric_completion_reads: AtomicU64,
    pub fabric_completion_errors: AtomicU64,
    pub fabric_lent: AtomicU64,
    pub fabric_shared_sends: AtomicU64,
    pub fabric_av_evictions: AtomicU64,
    pub fabric_queue_full: AtomicU64,
    /// Address-vector entries in use right now and the listeners' room
    /// for them, and sends that failed because the receiver had no buffer
    /// posted after the provider's own retries (`FI_ENORX`).
    pub fabric_addresses: AtomicU64,
    pub fabric_address_capacity: AtomicU64,
    pub fabric_rnr_failures: AtomicU64,
}

impl BrokerStats {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// [`add`](Self::add) for counts a peer's claim sets (a best-effort
    /// sender may claim a sequence jump of nearly 2^64, all of it lost):
    /// the total stops at `u64::MAX` instead of wrapping round to a small
    /// number.
    pub(crate) fn add_saturating(counter: &AtomicU64, n: u64) {
        if n > 0 {
            // The closure always returns Some: the update cannot fail.
            let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |total| {
                Some(total.saturating_add(n))
            });
        }
    }

    /// Whether the value named `name` in [`snapshot`](Self::snapshot) is
    /// a level right now (connections, queued bytes, registrations held)
    /// rather than a running total.
    pub fn is_level(name: &str) -> bool {
        Self::LEVELS.contains(&name)
    }

    /// The names in [`snapshot`](Self::snapshot) that are levels.
    pub const LEVELS: &'static [&'static str] = &[
        "connections",
        "handshakes",
        "queued_bytes",
        "routes",
        "fabric_buffer_bytes",
        "fabric_registered_bytes",
        "fabric_rendezvous_registered",
        "fabric_rendezvous_registered_bytes",
        "fabric_addresses",
        "fabric_address_capacity",
    ];

    /// One counter by its name in [`snapshot`](Self::snapshot); `None`
    /// for a name there is none of.
    pub fn value(&self, name: &str) -> Option<u64> {
        self.snapshot()
            .into_iter()
            .find(|(key, _)| *key == name)
            .map(|(_, value)| value)
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
            ("connection_drops", get(&self.connection_drops)),
            (
                "unacknowledged_at_close",
                get(&self.unacknowledged_at_close),
            ),
            ("bad_frames", get(&self.bad_frames)),
            ("oversized_payloads", get(&self.oversized_payloads)),
            ("permission_denials", get(&self.permission_denials)),
            ("invalid_publishes", get(&self.invalid_publishes)),
            ("auth_failures", get(&self.auth_failures)),
            ("refused_connections", get(&self.refused_connections)),
            ("handshakes", get(&self.handshakes)),
            ("driven_rounds", get(&self.driven_rounds)),
            ("queued_bytes", get(&self.queued_bytes)),
            ("fabric_frames_in", get(&self.fabric_frames_in)),
            ("fabric_frames_out", get(&self.fabric_frames_out)),
            ("best_effort_drops", get(&self.best_effort_drops)),
            ("best_effort_lost", get(&self.best_effort_lost)),
            ("credit_waits", get(&self.credit_waits)),
            ("bad_link_frames", get(&self.bad_link_frames)),
            ("link_memory_refusals", get(&self.link_memory_refusals)),
            ("link_gap_failures", get(&self.link_gap_failures)),
            ("link_send_failures", get(&self.link_send_failures)),
            ("routes", get(&self.routes)),
            ("route_refusals", get(&self.route_refusals)),
            ("route_messages_in", get(&self.route_messages_in)),
            ("route_messages_out", get(&self.route_messages_out)),
            ("fabric_unknown_links", get(&self.fabric_unknown_links)),
            ("fabric_forged", get(&self.fabric_forged)),
            ("fabric_replayed", get(&self.fabric_replayed)),
            ("fabric_malformed", get(&self.fabric_malformed)),
            ("unproven_addresses", get(&self.unproven_addresses)),
            ("silent_data_links", get(&self.silent_data_links)),
            (
                "datagram_links_given_up",
                get(&self.datagram_links_given_up),
            ),
            (
                "datagram_links_reopened",
                get(&self.datagram_links_reopened),
            ),
            ("route_interest_refused", get(&self.route_interest_refused)),
            (
                "route_group_undelivered",
                get(&self.route_group_undelivered),
            ),
            ("route_oversized", get(&self.route_oversized)),
            ("fabric_buffer_bytes", get(&self.fabric_buffer_bytes)),
            (
                "fabric_registered_bytes",
                get(&self.fabric_registered_bytes),
            ),
            ("fabric_rendezvous_sent", get(&self.fabric_rendezvous_sent)),
            ("fabric_rendezvous_read", get(&self.fabric_rendezvous_read)),
            (
                "fabric_rendezvous_read_bytes",
                get(&self.fabric_rendezvous_read_bytes),
            ),
            (
                "fabric_rendezvous_huge_landed",
                get(&self.fabric_rendezvous_huge_landed),
            ),
            (
                "fabric_rendezvous_registrations",
                get(&self.fabric_rendezvous_registrations),
            ),
            (
                "fabric_rendezvous_abandoned",
                get(&self.fabric_rendezvous_abandoned),
            ),
            (
                "fabric_rendezvous_reads_given_up",
                get(&self.fabric_rendezvous_reads_given_up),
            ),
            (
                "fabric_rendezvous_cache_hits",
                get(&self.fabric_rendezvous_cache_hits),
            ),
            (
                "fabric_rendezvous_registered",
                get(&self.fabric_rendezvous_registered),
            ),
            (
                "fabric_rendezvous_registered_bytes",
                get(&self.fabric_rendezvous_registered_bytes),
            ),
            ("fabric_messages_sent", get(&self.fabric_messages_sent)),
            (
                "fabric_messages_received",
                get(&self.fabric_messages_received),
            ),
            (
                "fabric_completion_reads",
                get(&self.fabric_completion_reads),
            ),
            (
                "fabric_completion_errors",
                get(&self.fabric_completion_errors),
            ),
            ("fabric_lent", get(&self.fabric_lent)),
            ("fabric_shared_sends", get(&self.fabric_shared_sends)),
            ("fabric_av_evictions", get(&self.fabric_av_evictions)),
            ("fabric_queue_full", get(&self.fabric_queue_full)),
            ("fabric_addresses", get(&self.fabric_addresses)),
            (
                "fabric_address_capacity",
                get(&self.fabric_address_capacity),
            ),
            ("fabric_rnr_failures", get(&self.fabric_rnr_failures)),
        ]
    }
}

/// Work handed to the event loop by other threads (besides the messages
/// they publish for remote subscribers, [`Shared::published`]).
pub(crate) enum Command {
    /// Answer once everything queued before it has been handed to the
    /// endpoints, the first `published` messages of [`Shared::published`]
    /// among them, unless the caller stopped waiting (`until`; `None`:
    /// never) before that.
    Flush {
        done: Sender<()>,
        until: Option<Instant>,
        published: u64,
    },
    /// Route to one more broker (an endpoint string, checked).
    AddPeer(String),
}

pub(crate) struct Shared {
    /// The configuration the broker started with; `live` holds the values
    /// of it a reload changed.
    pub(crate) config: Config,
    /// When the broker started.
    pub(crate) started: std::time::SystemTime,
    pub(crate) live: LiveLimits,
    /// `auth.users`, with the credentials already checked.
    pub(crate) accounts: Accounts,
    pub(crate) subject_limits: SubjectLimits,
    pub(crate) subscriptions: RwLock<SubscriptionTable>,
    /// The subscription table's generation, read without its lock (see [`crate::publish_cache`]).
    pub(crate) generation: Arc<AtomicU64>,
    pub(crate) next_sid: AtomicU64,
    pub(crate) commands: CommandQueue<Command>,
    /// Requests apart from the commands, so that the loop answers them
    /// every round, also while it holds the commands (publishers held
    /// under `block`): reports of every session (for monitoring, when a
    /// slow consumer is what one looks for) and reloads (TLS files,
    /// endpoints' limits).
    pub(crate) loop_requests: Mutex<Vec<LoopRequest>>,
    pub(crate) loop_requests_waiting: AtomicBool,
    /// Hellos the login thread has checked, for the loop to continue
    /// (`logins_checked` says some wait), taken every round as the loop's
    /// requests are.
    pub(crate) checked_logins: Mutex<Vec<CheckedLogin>>,
    pub(crate) logins_checked: AtomicBool,
    /// In-process publishes for remote subscribers, bounded as the
    /// commands are.
    pub(crate) published: PublishedQueue,
    pub(crate) shutdown: AtomicBool,
    /// Rounds the event loop has run: a health check watches it move
    /// rather than queue behind commands (which wait while a publisher is
    /// held up under `block`).
    pub(crate) rounds: AtomicU64,
    /// Where the round under way is, for [`Broker::stalled_round`]; the
    /// loop's endpoints mark their calls in it.
    pub(crate) round_watch: Arc<RoundWatch>,
    pub(crate) stats: BrokerStats,
    pub(crate) inbox_prefix: String,
    pub(crate) listening: Vec<(String, String)>,
    /// `(listen entry, reason)` of each fabric listener that did not open.
    pub(crate) unopened: Vec<(String, String)>,
    /// Marks this broker's responders' replies
    /// ([`delivery::new_answer_origin`]).
    pub(crate) answer_origin: usize,
    /// Why each listener (by its index in `listening`) is out of
    /// service, if it is; set by the event loop.
    pub(crate) listener_failures: Mutex<Vec<Option<String>>>,
    /// This broker process among route peers (random per start).
    pub(crate) broker_id: u64,
    /// Whether an endpoint exists to dial routes from.
    pub(crate) can_dial: bool,
    /// The routes in use, by session id, for [`Broker::routes`].
    pub(crate) routes: Mutex<BTreeMap<u64, RouteReport>>,
    /// The peer brokers dialed, for [`Broker::peers`].
    pub(crate) peers: Mutex<Vec<String>>,
    /// The event loop, for application threads that run it while they
    /// wait (see [`crate::drive::Driven`]).
    pub(crate) event_loop: DriveHandle<EventLoop>,
    /// The subscription id of `Broker::request`'s inbox, once subscribed
    /// (0: none): its reader runs the event loop while it waits.
    pub(crate) inbox_sid: AtomicU64,
}

/// One route in use, as [`Broker::routes`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteReport {
    /// The peer broker's name, from its handshake.
    pub name: String,
    /// The peer broker's id (random per process), as hex.
    pub broker_id: String,
    /// The control link's remote address.
    pub remote: String,
    /// Whether this broker dialed the route (else the peer did).
    pub dialed: bool,
    /// The path carrying the route's traffic: a data link's description
    /// (`efa-rdm via ...`, `shm via ...`), or the control link's scheme.
    pub reliable: String,
    /// The best-effort path, when it is a separate datagram link.
    pub best_effort: Option<String>,
    /// While the route rides a reliable data link: this broker's id for
    /// it, which the peer's frames there carry (as a client's
    /// `server_link_id`).
    pub link_id: Option<u64>,
    /// Why other paths were not chosen (on TCP: why not the fabric).
    pub reasons: Vec<String>,
}

impl Shared {
    /// Puts `request` to the event loop, which answers it in its next
    /// round whatever it holds, and wakes it.
    pub(crate) fn ask_loop(&self, request: LoopRequest) {
        self.loop_requests.lock().push(request);
        self.loop_requests_waiting.store(true, Ordering::Release);
        // As a command wakes it: parked (the loop checks the flag before
        // it parks) or stepping aside for a driver.
        self.commands.wake_if_parked();
        self.event_loop.wake_sleeper();
    }

    /// Wake the loop when a subscription change is to be announced to
    /// route peers (the loop sends announcements before anything else).
    pub(crate) fn announce(&self, table: &SubscriptionTable) {
        if table.interest_changed() {
            self.wake_loop();
        }
    }

    /// Wakes the loop thread, from waiting for events or from sleeping
    /// while a driver has left ([`crate::drive::DriveHandle::wake_sleeper`]).
    fn wake_loop(&self) {
        self.commands.wake();
        self.event_loop.wake_sleeper();
    }

    /// Whether `sid` is `Broker::request`'s inbox, whose reader drives.
    fn is_inbox(&self, sid: u64) -> bool {
        sid == self.inbox_sid.load(Ordering::Relaxed)
    }

    pub(crate) fn send_command(&self, command: Command) -> Result<(), Error> {
        if self.shutdown.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        self.commands.send(command, self.live.block_timeout(), || {
            self.event_loop.wake_sleeper()
        })
    }

    /// Queues a message published in-process for remote subscribers.
    fn send_published(
        &self,
        targets: &Arc<[SubRef]>,
        subject: &Arc<str>,
        message: PublishedMessage,
    ) -> Result<(), Error> {
        if self.shutdown.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        // The loop finds a push behind others when it takes them; a
        // sleeping loop thread is told of each (that check is cheap).
        let wake = |first: bool| {
            if first {
                self.commands.wake_if_parked();
            }
            self.event_loop.wake_sleeper();
        };
        self.published
            .push(targets, subject, message, self.live.block_timeout(), wake)
    }

    /// Whether work waits for the loop thread: commands or publishes.
    fn work_waits(&self) -> bool {
        !self.commands.is_empty() || self.published.outstanding()
    }
}

impl SubscriptionOwner for Shared {
    fn unsubscribe(&self, sid: u64) {
        let mut table = self.subscriptions.write();
        table.remove(SubRef {
            owner: LOCAL_OWNER,
            sid,
        });
        self.announce(&table);
    }

    /// The reader of `Broker::request`'s inbox runs the event loop while
    /// the loop thread finds nothing to do. Other in-process readers do
    /// not: in services meshed over routes, where each process has several
    /// readers and a message for one may come in a round another runs,
    /// their driving measured no better, and more often worse, than the
    /// loop thread's hand-over (BENCHMARKS.md, "Table at fe1ec98").
    fn drive(&self, sid: u64, until: Instant, ready: &dyn Fn() -> bool) -> bool {
        if !self.is_inbox(sid) {
            return false;
        }
        let rounds = self.event_loop.drive(true, until, ready, &self.shutdown);
        BrokerStats::add(&self.stats.driven_rounds, rounds);
        rounds > 0
    }

    fn would_drive(&self, sid: u64) -> bool {
        self.is_inbox(sid) && self.event_loop.reader_would_drive()
    }
}

/// An embedded broker. Cheap to share: all methods take `&self`, and the
/// handle is `Send + Sync`. Dropping it shuts the broker down.
pub struct Broker {
    pub(crate) shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Where replies to [`Broker::request`] arrive, from the first request.
    replies: Mutex<Option<Arc<ReplyInbox>>>,
}

/// One wildcard inbox (`<inbox prefix>.*`) for all of a broker handle's
/// requests, as a client has: a request's reply subject is the inbox and a
/// token, so requests change no subscription (an inbox per request would
/// send every route an interest update as it starts and another as it
/// ends). One waiting request at a time reads the inbox and hands each
/// reply to the request its token names; a lone request reads its own.
struct ReplyInbox {
    subscription: Subscription,
    state: Mutex<InboxState>,
    /// Signalled when a reply is handed over or the reader steps down.
    handed: Condvar,
}

#[derive(Default)]
struct InboxState {
    /// Requests waiting, by token, each with its reply once it came.
    waiting: rustc_hash::FxHashMap<u64, Option<Message>>,
    /// Whether a request is reading the subscription.
    reading: bool,
}

impl ReplyInbox {
    /// Wait until `deadline` (`None`: for ever) for the reply to `token`,
    /// reading the inbox whenever no other request does.
    fn wait_for(
        &self,
        token: u64,
        prefix: &str,
        deadline: Option<Instant>,
    ) -> Result<Message, RecvError> {
        let mut state = self.state.lock();
        loop {
            if let Some(reply) = state.waiting.get_mut(&token).and_then(Option::take) {
                return Ok(reply);
            }
            let now = Instant::now();
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Err(RecvError::Timeout);
            }
            if state.reading {
                match deadline {
                    Some(deadline) => {
                        self.handed.wait_until(&mut state, deadline);
                    }
                    None => self.handed.wait(&mut state),
                }
                continue;
            }
            state.reading = true;
            drop(state);
            let freed_on_unwind = FreedOnUnwind {
                inbox: self,
                unwinding_before: std::thread::panicking(),
            };
            let read = match deadline {
                Some(deadline) => self
                    .subscription
                    .recv_timeout(deadline.saturating_duration_since(now)),
                None => self.subscription.recv(),
            };
            drop(freed_on_unwind);
            state = self.state.lock();
            state.reading = false;
            // The waiters wake once this lock is released, with the reply
            // handed over and the inbox free to read.
            self.handed.notify_all();
            match read {
                Ok(reply) => {
                    let slot = reply_token(&reply.subject, prefix)
                        .and_then(|token| state.waiting.get_mut(&token));
                    // A reply to a request that has given up, or a second
                    // reply to one, is dropped.
                    if let Some(slot) = slot.filter(|slot| slot.is_none()) {
                        *slot = Some(reply);
                    }
                }
                Err(RecvError::Closed) => return Err(RecvError::Closed),
                Err(_) => {}
            }
        }
    }
}

/// Frees a [`ReplyInbox`] for its other waiters if its reader's read
/// unwinds (a loop round the reader ran panicked); they would otherwise
/// wait for it to their deadlines.
struct FreedOnUnwind<'a> {
    inbox: &'a ReplyInbox,
    /// The thread was unwinding already (a request from a `Drop`): only a
    /// panic of the read's own is one.
    unwinding_before: bool,
}

impl Drop for FreedOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.unwinding_before {
            self.inbox.state.lock().reading = false;
            self.inbox.handed.notify_all();
        }
    }
}

/// The token of a reply subject `<prefix>.<token>`: which request of a
/// `Broker` or `Client` a reply answers.
pub(crate) fn reply_token(subject: &str, prefix: &str) -> Option<u64> {
    subject
        .strip_prefix(prefix)?
        .strip_prefix('.')?
        .parse()
        .ok()
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
        let mut unavailable = Vec::new();
        let broker_id = unique_seed();
        for text in &config.listen {
            let spec = EndpointSpec::parse(text).map_err(|err| Error::Endpoint {
                endpoint: text.clone(),
                source: err.into(),
            })?;
            let bind = Some(spec.address().unwrap_or_default().to_string());
            let mut endpoint_config = listener_config(&config, spec.scheme(), bind);
            if spec.scheme() == efabus_transports::nats::SCHEME {
                let id = format!("{broker_id:016X}");
                endpoint_config.options.push(("server_id".to_string(), id));
            }
            let endpoint = match registry.open(&spec, &endpoint_config) {
                Ok(endpoint) => endpoint,
                // A fabric this host lacks (no EFA device, no provider) or
                // cannot open leaves its peers on TCP, as negotiation would.
                Err(source @ RegistryError::Transport { .. })
                    if endpoints::is_data_scheme(spec.scheme()) =>
                {
                    unavailable.push((text.clone(), source));
                    continue;
                }
                Err(source) => {
                    return Err(Error::Endpoint {
                        endpoint: text.clone(),
                        source,
                    })
                }
            };
            let mut endpoint =
                with_faults(endpoint, config.testing.faults.as_ref(), endpoints.len());
            // A peer claims little memory until its hello is accepted.
            endpoint.set_accepted_receive_limit(Some(HANDSHAKE_FRAME_MAX.min(config.max_frame())));
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
        warn_of_cleartext_secrets(&config, &listening);
        // A fabric this host lacks leaves its peers on the other
        // listeners; with none, there is nothing to fall back to.
        if endpoints.is_empty() && !unavailable.is_empty() {
            let (endpoint, source) = unavailable.swap_remove(0);
            return Err(Error::Endpoint { endpoint, source });
        }
        let mut unopened = Vec::with_capacity(unavailable.len());
        for (endpoint, err) in unavailable {
            let reason = err.cause().to_string();
            warn!(%endpoint, %reason, "fabric unavailable; peers use the other listeners");
            unopened.push((endpoint, reason));
        }
        // Routes are dialed from a TCP listener, or from an endpoint that
        // only connects out when there is none.
        let mut dialer = endpoints.iter().position(|e| e.scheme() == tcp::SCHEME);
        if dialer.is_none() && !config.peers.is_empty() {
            let spec = EndpointSpec::parse(tcp::SCHEME).map_err(|err| Error::Endpoint {
                endpoint: tcp::SCHEME.into(),
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
        let round_watch = Arc::new(RoundWatch::new());
        let endpoints: Vec<Box<dyn efabus_core::transport::Endpoint>> = endpoints
            .into_iter()
            .enumerate()
            .map(|(index, endpoint)| {
                WatchedEndpoint::wrap(endpoint, Arc::clone(&round_watch), index)
            })
            .collect();
        let (commands, command_rx) = CommandQueue::new(waker, COMMAND_QUEUE);
        let published = PublishedQueue::new(COMMAND_QUEUE, published_bytes(&config));
        let subject_limits = SubjectLimits {
            max_len: config.limits.max_subject_len,
            max_tokens: config.limits.max_subject_tokens,
        };
        let table = SubscriptionTable::new(subject_limits);
        let stats = BrokerStats::default();
        for buffers in endpoints.iter().map(|endpoint| endpoint.buffers()) {
            BrokerStats::add(&stats.fabric_buffer_bytes, buffers.held as u64);
            BrokerStats::add(&stats.fabric_registered_bytes, buffers.registered as u64);
        }
        let shared = Arc::new(Shared {
            started: std::time::SystemTime::now(),
            live: LiveLimits::new(&config),
            accounts: Accounts::new(&config.auth.users),
            subject_limits,
            config,
            generation: table.generation(),
            subscriptions: RwLock::new(table),
            next_sid: AtomicU64::new(1),
            commands,
            loop_requests: Mutex::new(Vec::new()),
            loop_requests_waiting: AtomicBool::new(false),
            checked_logins: Mutex::new(Vec::new()),
            logins_checked: AtomicBool::new(false),
            published,
            shutdown: AtomicBool::new(false),
            rounds: AtomicU64::new(0),
            round_watch,
            stats,
            inbox_prefix: format!("_INBOX.{:016x}", unique_seed()),
            listener_failures: Mutex::new(vec![None; listening.len()]),
            listening,
            unopened,
            answer_origin: delivery::new_answer_origin(),
            broker_id,
            can_dial: dialer.is_some(),
            routes: Mutex::new(BTreeMap::new()),
            peers: Mutex::new(Vec::new()),
            event_loop: DriveHandle::new(),
            inbox_sid: AtomicU64::new(0),
        });
        let cluster = Cluster::new(&shared, dialer);
        let commands = command_rx.clone();
        let wake = {
            let shared = shared.clone();
            move || shared.commands.wake_if_parked()
        };
        let round_watch = shared.round_watch.clone();
        let event_loop = shared.event_loop.install(
            EventLoop::new(shared.clone(), endpoints, command_rx, codec_limits, cluster),
            wake,
            move || round_watch.ended_by_panic(),
        );
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("efabus-broker".into())
                .spawn(move || run_loop(&event_loop, &shared, poll, &commands))
                .map_err(Error::Thread)?
        };
        Ok(Broker {
            shared,
            thread: Mutex::new(Some(thread)),
            replies: Mutex::new(None),
        })
    }

    /// `(scheme, address)` of each listening endpoint, with actual ports.
    pub fn listening(&self) -> &[(String, String)] {
        &self.shared.listening
    }

    /// `(listen entry, reason)` of each fabric listener of the config that
    /// could not open at start (no such device or provider here, say): the
    /// broker serves on its other listeners, and peers negotiate what is
    /// left.
    pub fn unopened(&self) -> &[(String, String)] {
        &self.shared.unopened
    }

    /// Every listener with its state: up, or out of service and why.
    pub fn listeners(&self) -> Vec<ListenerReport> {
        let failures = self.shared.listener_failures.lock();
        self.shared
            .listening
            .iter()
            .zip(failures.iter())
            .map(|((scheme, address), failure)| ListenerReport {
                scheme: scheme.clone(),
                address: address.clone(),
                failure: failure.clone(),
            })
            .collect()
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

    /// When the broker started.
    pub fn started(&self) -> std::time::SystemTime {
        self.shared.started
    }

    pub fn stats(&self) -> &BrokerStats {
        &self.shared.stats
    }

    /// Number of subscriptions, local and remote.
    pub fn subscription_count(&self) -> usize {
        self.shared.subscriptions.read().len()
    }

    /// This broker process's id among route peers (random per start).
    pub fn broker_id(&self) -> u64 {
        self.shared.broker_id
    }

    /// Number of interest entries (distinct pattern and queue group pairs)
    /// that route peers announced to this broker, over all routes.
    pub fn route_interest_count(&self) -> usize {
        self.shared.subscriptions.read().route_interest_len()
    }

    /// The routes in use, with the path each is carried on.
    pub fn routes(&self) -> Vec<RouteReport> {
        self.shared.routes.lock().values().cloned().collect()
    }

    /// The peer brokers this broker dials: those in `peers`, those added
    /// with [`Broker::add_peer`], and those learned from its routes until
    /// they are forgotten (`cluster.forget_after_ms`).
    pub fn peers(&self) -> Vec<String> {
        self.shared.peers.lock().clone()
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
        self.publish_inner(subject, None, None, payload.into())
            .map(|_| ())
    }

    /// Publish with a reply subject.
    pub fn publish_request(
        &self,
        subject: &str,
        reply: &str,
        payload: impl Into<Bytes>,
    ) -> Result<(), Error> {
        self.publish_inner(subject, Some(reply), None, payload.into())
            .map(|_| ())
    }

    /// Publish with a header block (see [`efabus_core::headers`]) and, for a
    /// request, a reply subject. The block counts towards
    /// `limits.max_payload` with the payload, as NATS counts it; bytes that
    /// are not a block are refused with [`Error::Headers`].
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
            .map(|_| ())
    }

    fn publish_inner(
        &self,
        subject: &str,
        reply: Option<&str>,
        headers: Option<Bytes>,
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
        let max_payload = shared.live.max_payload();
        let len = payload.len() + headers.as_ref().map_or(0, Bytes::len);
        if len as u64 > max_payload {
            return Err(Error::PayloadTooLarge {
                len,
                max: max_payload,
            });
        }
        let reached =
            publish_cache::publish(shared, subject, reply.map(Arc::from), headers, payload);
        if delivery::answers_waiting(shared.answer_origin) {
            publish_answers(shared);
        }
        reached
    }

    /// Subscribe to a pattern (`*` one token, `>` the rest).
    pub fn subscribe(&self, pattern: &str) -> Result<Subscription, Error> {
        let capacity = self.shared.live.subscription_queue();
        self.subscribe_inner(pattern, None, self.shared.live.policy(), capacity)
    }

    /// Subscribe as a member of a queue group: each message matching the
    /// pattern goes to one member of the group.
    pub fn queue_subscribe(&self, pattern: &str, group: &str) -> Result<Subscription, Error> {
        let capacity = self.shared.live.subscription_queue();
        self.subscribe_inner(pattern, Some(group), self.shared.live.policy(), capacity)
    }

    /// Answer requests on `pattern` with `handler`: each message that
    /// matches is handed to it, and what it returns for a request (a
    /// message with a reply subject) is published to the reply subject.
    ///
    /// The handler runs on the thread that delivers the message: the
    /// broker's event loop (or an application thread running its rounds
    /// while it waits) for messages from clients and routes, or the
    /// publishing thread for in-process ones. So a request costs no
    /// hand-over to a thread of the application, which is what makes a
    /// round trip between services short (README "Embedded API"); in
    /// exchange the handler holds up everything else that thread does
    /// while it runs. It must be quick and must not wait: no
    /// [`Broker::request`] or [`Broker::flush`] inside it, and it returns
    /// its reply rather than publishing it. Work that takes longer belongs
    /// to a [`Subscription`] read by a thread of the application. A reply
    /// over `limits.max_payload` is dropped and counted in the
    /// [`Responder`]'s stats.
    pub fn respond<F>(&self, pattern: &str, handler: F) -> Result<Responder, Error>
    where
        F: Fn(&Message) -> Option<Bytes> + Send + Sync + 'static,
    {
        self.respond_inner(pattern, None, Arc::new(handler))
    }

    /// [`Broker::respond`] as a member of a queue group: each request reaches
    /// one member of the group in the whole cluster.
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
        answer: delivery::Answer,
    ) -> Result<Responder, Error> {
        let (sink, reader, stats) = LocalSink::answering(&answer, self.shared.answer_origin);
        let sid = self.register(pattern, queue, sink)?;
        let owner: Arc<dyn SubscriptionOwner> = self.shared.clone();
        Ok(Responder::new(
            sid,
            pattern.to_string(),
            queue.map(str::to_string),
            reader,
            stats,
            owner,
            answer,
        ))
    }

    fn subscribe_inner(
        &self,
        pattern: &str,
        queue: Option<&str>,
        policy: SlowConsumerPolicy,
        capacity: usize,
    ) -> Result<Subscription, Error> {
        let shared = &self.shared;
        let (sink, rx, stats) = LocalSink::new(capacity, policy, shared.live.block_timeout());
        let sid = self.register(pattern, queue, sink)?;
        let owner: Arc<dyn SubscriptionOwner> = shared.clone();
        Ok(Subscription::new(
            sid,
            pattern.to_string(),
            queue.map(str::to_string),
            rx,
            stats,
            owner,
            shared.config.fabric.polling.spin(),
        ))
    }

    /// Puts `sink` in the subscription table under a new id, announced to
    /// route peers.
    fn register(&self, pattern: &str, queue: Option<&str>, sink: LocalSink) -> Result<u64, Error> {
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
        let mut table = shared.subscriptions.write();
        // Asked again under the table's lock, which the shutdown takes to
        // close every in-process subscription: one put in after that would
        // never be closed.
        if shared.shutdown.load(Ordering::SeqCst) {
            return Err(Error::Closed);
        }
        table
            .insert(
                pattern,
                queue,
                SubRef {
                    owner: LOCAL_OWNER,
                    sid,
                },
                Some(Arc::new(sink.in_queue_group(queue.is_some()))),
                DeliveryClass::Reliable,
            )
            .map_err(|source| Error::Subscription {
                pattern: pattern.to_string(),
                source,
            })?;
        drop(table);
        shared.announce(&shared.subscriptions.read());
        Ok(sid)
    }

    /// Send a request and wait for the first reply.
    pub fn request(
        &self,
        subject: &str,
        payload: impl Into<Bytes>,
        timeout: Duration,
    ) -> Result<Message, Error> {
        let inbox = self.reply_inbox()?;
        let prefix = &self.shared.inbox_prefix;
        let token = self.shared.next_sid.fetch_add(1, Ordering::Relaxed);
        inbox.state.lock().waiting.insert(token, None);
        let reply_to = format!("{prefix}.{token}");
        // The request leaves in this thread's drive for the reply.
        let published = crate::drive::before_driving(|| {
            self.publish_inner(subject, Some(&reply_to), None, payload.into())
        });
        let result = match published {
            Ok(0) => Err(Error::NoResponders(subject.to_string())),
            Ok(_) => inbox
                .wait_for(token, prefix, Instant::now().checked_add(timeout))
                .map_err(|err| match err {
                    RecvError::Closed => Error::Closed,
                    _ => Error::Timeout(timeout),
                }),
            Err(err) => Err(err),
        };
        inbox.state.lock().waiting.remove(&token);
        // The reply came without this thread driving (an in-process
        // responder answered at once, another request read the inbox):
        // what the publish queued is the loop thread's.
        if self.shared.work_waits() {
            self.shared.event_loop.wake_sleeper();
        }
        result
    }

    /// The inbox of this handle's requests, subscribed at the first.
    /// Between requests nobody reads it, so replies nobody waits for (late
    /// ones, second ones) gather there until the next request drops them:
    /// whatever the configured slow-consumer policy, the oldest of them go
    /// when it is full, so they neither hold up their publishers (`block`)
    /// nor end the inbox (`disconnect`). It holds at least
    /// [`REPLY_INBOX_MIN`] whatever `limits.subscription_queue` says: all
    /// of a handle's requests share it, and a queue lowered to hold
    /// subscribers' publishers back would drop replies still waited for.
    fn reply_inbox(&self) -> Result<Arc<ReplyInbox>, Error> {
        let mut replies = self.replies.lock();
        if let Some(inbox) = &*replies {
            return Ok(inbox.clone());
        }
        let capacity = self.shared.live.subscription_queue().max(REPLY_INBOX_MIN);
        let subscription = self.subscribe_inner(
            &format!("{}.*", self.shared.inbox_prefix),
            None,
            SlowConsumerPolicy::DropOldest,
            capacity,
        )?;
        self.shared
            .inbox_sid
            .store(subscription.sid(), Ordering::Relaxed);
        let inbox = Arc::new(ReplyInbox {
            subscription,
            state: Mutex::new(InboxState::default()),
            handed: Condvar::new(),
        });
        *replies = Some(inbox.clone());
        Ok(inbox)
    }

    /// Wait until every message published so far has been handed to
    /// subscriber queues or to the transports (of every session: one whose
    /// queue stays full, a slow consumer under `drop-oldest`, holds it up
    /// until `timeout`).
    pub fn flush(&self, timeout: Duration) -> Result<(), Error> {
        let (done, rx) = crossbeam_channel::bounded(1);
        let until = Instant::now().checked_add(timeout);
        let published = self.shared.published.pushed();
        self.shared.send_command(Command::Flush {
            done,
            until,
            published,
        })?;
        rx.recv_timeout(timeout)
            .map_err(|err| Error::waiting(err, timeout))
    }

    /// Whether the event loop is running: it runs a round within
    /// `timeout`, whatever is queued (a health check, unlike
    /// [`Broker::flush`]).
    pub fn responsive(&self, timeout: Duration) -> Result<(), Error> {
        let rounds = &self.shared.rounds;
        let before = rounds.load(Ordering::Acquire);
        let deadline = Instant::now().checked_add(timeout);
        self.shared.wake_loop();
        while rounds.load(Ordering::Acquire) == before {
            if self.shared.shutdown.load(Ordering::Relaxed) {
                return Err(Error::Closed);
            }
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                return Err(Error::Timeout(timeout));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// The event loop's round under way when it has run for `at_least`:
    /// how long, and the endpoint call it is in (which listener, polled,
    /// sent on, ...). A round takes microseconds; one that lasts seconds
    /// is stuck in a call that does not return (README "shm"), and the
    /// loop serves nothing meanwhile. Read without waiting for the loop,
    /// unlike [`Broker::responsive`].
    pub fn stalled_round(&self, at_least: Duration) -> Option<LoopStall> {
        let listening = &self.shared.listening;
        self.shared
            .round_watch
            .stalled(at_least, Instant::now(), |index| {
                match listening.get(index) {
                    Some((scheme, address)) => format!("{scheme}/{address}"),
                    // The one endpoint that is not a listener.
                    None => "tcp (for peers)".to_string(),
                }
            })
    }

    /// Whether the event loop has panicked (the panic's message is on
    /// standard error), on its thread or in a round an application thread
    /// ran while it waited, whose caller then got the panic. Such a broker
    /// serves nothing: requests waiting fail, in-process subscriptions end
    /// after what they hold, and what is asked of it from then on is
    /// [`Error::Closed`] ([`Broker::is_shut_down`] says true).
    pub fn loop_ended(&self) -> bool {
        self.shared.round_watch.panicked()
    }

    /// Every session of the broker (clients and routes) with its links and
    /// counters, and the subscriptions of the clients whose ids
    /// `subscriptions_of` names, as the event loop sees them between two
    /// rounds (the loop spends a pass over its sessions on it, and copies
    /// only the subscriptions asked for); fails when the loop does not
    /// answer within `timeout`.
    pub fn connections(
        &self,
        subscriptions_of: &[u64],
        timeout: Duration,
    ) -> Result<Vec<ConnectionReport>, Error> {
        let shared = &self.shared;
        if shared.shutdown.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        let abandoned = Arc::new(AtomicBool::new(false));
        shared.ask_loop(LoopRequest::Connections(
            subscriptions_of.to_vec(),
            Arc::clone(&abandoned),
            tx,
        ));
        let answer = rx.recv_timeout(timeout);
        if answer.is_err() {
            abandoned.store(true, Ordering::Release);
        }
        answer.map_err(|err| Error::waiting(err, timeout))
    }

    /// [`connections`](Self::connections) with the subscriptions of every
    /// client (its first 1,024 by id each): two passes, the second copying
    /// them all, where monitoring asks for a page's alone.
    pub fn connections_with_subscriptions(
        &self,
        timeout: Duration,
    ) -> Result<Vec<ConnectionReport>, Error> {
        let ids: Vec<u64> = self
            .connections(&[], timeout)?
            .iter()
            .map(|report| report.id)
            .collect();
        self.connections(&ids, timeout)
    }

    /// Which subscriptions a message published on `subject` would reach
    /// now; fails for a subject that is not valid.
    pub fn matching(&self, subject: &str) -> Result<MatchReport, Error> {
        let mut targets = crate::subscriptions::Targets::default();
        let table = self.shared.subscriptions.read();
        table
            .lookup_peek(subject, &mut targets)
            .map_err(|source| Error::Subject {
                subject: subject.to_string(),
                source,
            })?;
        let remote = targets
            .remote
            .iter()
            .map(|&target| {
                let (pattern, queue) = table.describe(target).unwrap_or_default();
                RemoteMatch {
                    session: target.owner,
                    sid: target.sid,
                    pattern,
                    queue,
                }
            })
            .collect();
        Ok(MatchReport {
            local: targets.local.len(),
            remote,
        })
    }

    /// Stop accepting, flush what is queued (within the configured drain
    /// time), say goodbye to every peer and stop the loop.
    pub fn shutdown(&self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.wake_loop();
        if let Some(thread) = self.thread.lock().take() {
            if thread.join().is_err() {
                warn!("broker event loop panicked");
            }
        }
        self.shared.subscriptions.write().close_locals();
    }

    /// Whether shutdown has begun, or the event loop has ended
    /// ([`Broker::loop_ended`]).
    pub fn is_shut_down(&self) -> bool {
        // Acquire: a loop that ended recorded its panic before the mark.
        self.shared.shutdown.load(Ordering::Acquire)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// In-process subscriptions a message goes to: (sid, queue).
pub(crate) type LocalTargets = [(u64, Arc<LocalSink>)];

/// Deliver a message published in-process to its targets: to its `local`
/// subscriptions (the payload moves to the last one) and, through the event
/// loop, to the `remote` peers (shared with the loop, not copied). Returns
/// how many subscriptions matched.
#[inline(always)]
pub(crate) fn deliver_in_process(
    shared: &Shared,
    subject: &Arc<str>,
    local: &LocalTargets,
    remote: Option<&Arc<[SubRef]>>,
    reply: Option<Arc<str>>,
    headers: Option<Bytes>,
    payload: Bytes,
) -> Result<usize, Error> {
    let stats = &shared.stats;
    if let ([(sid, sink)], None) = (local, remote) {
        // The common case: one in-process subscription.
        BrokerStats::add(&stats.messages_in, 1);
        match sink.deliver_kept(subject, reply, headers, payload) {
            Delivery::Queued => BrokerStats::add(&stats.messages_out, 1),
            outcome => settle_one(shared, *sid, sink, outcome),
        }
        return Ok(1);
    }
    deliver_in_process_all(shared, subject, local, remote, reply, headers, payload)
}

/// Publish the replies responders made on this publishing thread (replies
/// carry no reply subject, so they make no more of their own).
#[cold]
#[inline(never)]
fn publish_answers(shared: &Shared) {
    let max_payload = shared.live.max_payload();
    for answered in delivery::take_answers(shared.answer_origin, max_payload) {
        let published =
            publish_cache::publish(shared, &answered.subject, None, None, answered.payload);
        if published.is_err() {
            answered.stats.count_unanswered();
        }
    }
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

/// [`deliver_in_process`] for any number of targets.
#[inline(never)]
fn deliver_in_process_all(
    shared: &Shared,
    subject: &Arc<str>,
    local: &LocalTargets,
    remote: Option<&Arc<[SubRef]>>,
    mut reply: Option<Arc<str>>,
    mut headers: Option<Bytes>,
    mut payload: Bytes,
) -> Result<usize, Error> {
    let stats = &shared.stats;
    // Remote targets first: handing them over may wait for room and fail,
    // and a publish that fails has then reached no one (a caller that
    // tries again delivers it once).
    if let Some(remote) = remote {
        let message = if local.is_empty() {
            // Nothing else needs the parts: no new references.
            PublishedMessage {
                reply: reply.take(),
                headers: headers.take(),
                payload: std::mem::take(&mut payload),
            }
        } else {
            PublishedMessage {
                reply: reply.clone(),
                headers: headers.clone(),
                payload: payload.clone(),
            }
        };
        shared.send_published(remote, subject, message)?;
    }
    BrokerStats::add(&stats.messages_in, 1);
    let mut closed = Vec::new();
    if let Some(((last_sid, last), others)) = local.split_last() {
        for (sid, sink) in others {
            let outcome =
                sink.deliver_kept(subject, reply.clone(), headers.clone(), payload.clone());
            count_delivery(stats, *sid, sink, outcome, &mut closed);
        }
        let outcome = last.deliver_kept(subject, reply, headers, std::mem::take(&mut payload));
        count_delivery(stats, *last_sid, last, outcome, &mut closed);
    }
    if !closed.is_empty() {
        remove_closed(shared, closed);
    }
    Ok(local.len() + remote.map_or(0, |remote| remote.len()))
}

/// A message as the event loop read it, its subject not yet copied: a
/// queue copies it only if it keeps it.
pub(crate) struct MessageParts<'a> {
    pub subject: &'a str,
    /// The subject as a shared string, once a queue or a held message
    /// needed one: the others take the same.
    pub shared_subject: std::cell::OnceCell<Arc<str>>,
    pub reply: Option<Arc<str>>,
    pub headers: Option<Bytes>,
    pub payload: Bytes,
}

impl MessageParts<'_> {
    fn to_message(&self) -> Message {
        Message {
            subject: self
                .shared_subject
                .get_or_init(|| Arc::from(self.subject))
                .clone(),
            reply: self.reply.clone(),
            headers: self.headers.clone(),
            payload: self.payload.clone(),
        }
    }
}

/// Hand a message to the in-process subscriptions among `targets`. A
/// message for one subscription (a stream) is gathered in `runs`
/// ([`LocalRuns`]); one for several, or for a responder (whose handler
/// runs now, and may publish), is queued at once, behind what was
/// gathered.
pub(crate) fn deliver_local(
    shared: &Shared,
    targets: &mut Targets,
    message: MessageParts<'_>,
    runs: &mut LocalRuns,
    held: &mut HeldLocal,
    now: Instant,
) {
    if let [(sid, sink)] = targets.local.as_slice() {
        if !sink.is_answering() {
            runs.gather(shared, held, now, *sid, sink, message);
            targets.local.clear();
            return;
        }
    }
    runs.queue(shared, held, now);
    let mut closed = Vec::new();
    for (sid, sink) in targets.local.drain(..) {
        offer_local(shared, held, now, sid, &sink, &message, &mut closed);
    }
    if !closed.is_empty() {
        remove_closed(shared, closed);
    }
}

/// Offers `message` to in-process subscription `sid` without waiting, as
/// the event loop does: held when its queue is full under `block`, or when
/// a message is held for it already (so it stays behind that one), else
/// queued or dropped and counted, a closed queue noted in `closed`.
fn offer_local(
    shared: &Shared,
    held: &mut HeldLocal,
    now: Instant,
    sid: u64,
    sink: &Arc<LocalSink>,
    message: &MessageParts<'_>,
    closed: &mut Vec<(u64, bool)>,
) {
    let outcome = if sink.is_held() {
        Delivery::Full
    } else {
        sink.try_deliver(
            message.subject,
            &message.shared_subject,
            message.reply.clone(),
            message.headers.clone(),
            message.payload.clone(),
        )
    };
    match outcome {
        Delivery::Full => held.hold(sid, Arc::clone(sink), message.to_message(), now),
        outcome => count_delivery(&shared.stats, sid, sink, outcome, closed),
    }
}

/// Messages the event loop read in a row for one in-process subscription
/// (and for no other), queued together: one hold of the queue's lock for
/// the run instead of one per message (two when plain messages are
/// followed by others). Any other delivery queues the run first, and so
/// does the loop once it has handled what it read and before it answers a
/// ping, so messages become visible in the order they were read, as one
/// by one.
#[derive(Default)]
pub(crate) struct LocalRuns {
    /// The subscription the gathered messages are for.
    target: Option<(u64, Arc<LocalSink>)>,
    messages: Vec<Message>,
    /// Or, while every message gathered is plain (no reply subject, no
    /// headers) and on `last_subject`, their payloads alone: no subject
    /// reference per message, nor a subject check in the queue. A message
    /// of another kind or subject queues them, and the run goes on in
    /// `messages` (so alternating subjects cost one more lock hold, not
    /// one per change). Never both at once.
    plain: Vec<Bytes>,
    /// The subject of the last message gathered, shared by the next ones
    /// on it. It stays the loop's own: queues keep copies, so its count is
    /// not touched by their readers.
    last_subject: Option<Arc<str>>,
}

/// Room for messages a run's list keeps between runs.
const RUN_KEPT_MAX: usize = 4096;

impl LocalRuns {
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty() && self.plain.is_empty()
    }

    fn gather(
        &mut self,
        shared: &Shared,
        held: &mut HeldLocal,
        now: Instant,
        sid: u64,
        sink: &Arc<LocalSink>,
        message: MessageParts<'_>,
    ) {
        let same = matches!(&self.target, Some((at, to)) if *at == sid && Arc::ptr_eq(to, sink));
        if !same {
            self.queue(shared, held, now);
            self.target = Some((sid, Arc::clone(sink)));
        }
        let same_subject = self
            .last_subject
            .as_ref()
            .is_some_and(|last| **last == *message.subject);
        let plain = message.reply.is_none() && message.headers.is_none();
        if plain && self.messages.is_empty() && (same_subject || self.plain.is_empty()) {
            if !same_subject {
                self.last_subject = Some(Arc::from(message.subject));
            }
            self.plain.push(message.payload);
            return;
        }
        if !self.plain.is_empty() {
            // What came before this message goes first.
            self.queue_for(shared, held, now, sid, sink);
        }
        let subject = match &self.last_subject {
            Some(last) if same_subject => last.clone(),
            _ => {
                let fresh: Arc<str> = Arc::from(message.subject);
                self.last_subject = Some(fresh.clone());
                fresh
            }
        };
        self.messages.push(Message {
            subject,
            reply: message.reply,
            headers: message.headers,
            payload: message.payload,
        });
    }

    /// Queue what was gathered, in order; what finds the queue full under
    /// `block` is held, as [`HeldLocal`] says, and is counted when it is
    /// queued or dropped.
    pub fn queue(&mut self, shared: &Shared, held: &mut HeldLocal, now: Instant) {
        if let Some((sid, sink)) = self.target.take() {
            self.queue_for(shared, held, now, sid, &sink);
        }
    }

    /// [`queue`](Self::queue) for `sink`, the gathered messages' target.
    fn queue_for(
        &mut self,
        shared: &Shared,
        held: &mut HeldLocal,
        now: Instant,
        sid: u64,
        sink: &Arc<LocalSink>,
    ) {
        debug_assert!(self.plain.is_empty() || self.messages.is_empty());
        // Behind a message held for it, a message is held too.
        let room = !sink.is_held();
        let mut queued = 0;
        // (`last_subject` is set whenever payloads are gathered.)
        if let (false, Some(subject)) = (self.plain.is_empty(), &self.last_subject) {
            let mut rest = self.plain.drain(..);
            if room {
                queued += sink.queue_plain_while_room_copied(subject, &mut rest);
            }
            // What finds no room goes on as whole messages.
            self.messages.extend(rest.map(|payload| Message {
                subject: subject.clone(),
                reply: None,
                headers: None,
                payload,
            }));
        }
        let mut rest = self.messages.drain(..);
        if room && rest.len() > 0 {
            queued += sink.queue_while_room(&mut rest, true);
        }
        if queued > 0 {
            BrokerStats::add(&shared.stats.messages_out, queued as u64);
        }
        let mut closed = Vec::new();
        for message in rest.by_ref() {
            // A message held gets a subject of its own: the loop's stays
            // the loop's.
            let parts = MessageParts {
                subject: &message.subject,
                shared_subject: std::cell::OnceCell::new(),
                reply: message.reply,
                headers: message.headers,
                payload: message.payload,
            };
            offer_local(shared, held, now, sid, sink, &parts, &mut closed);
            // The rest would go to a closed queue too: lost as that one.
            if !closed.is_empty() {
                if sink.is_grouped() {
                    BrokerStats::add(&shared.stats.connection_drops, rest.len() as u64);
                }
                break;
            }
        }
        drop(rest);
        if self.messages.capacity() > RUN_KEPT_MAX {
            self.messages = Vec::new();
        }
        if self.plain.capacity() > RUN_KEPT_MAX {
            self.plain = Vec::new();
        }
        if !closed.is_empty() {
            remove_closed(shared, closed);
        }
    }
}

/// Messages for in-process subscriptions that the event loop could not
/// queue, their queues full under the block policy. The loop does not wait
/// for room as an application thread does (it would stop the whole
/// broker): it holds them, in order per subscription, reads nothing more
/// from remote publishers meanwhile, and tries again; one held for the
/// block timeout is dropped and counted, as a waiting publisher's would be.
#[derive(Default)]
pub(crate) struct HeldLocal {
    messages: VecDeque<HeldMessage>,
}

struct HeldMessage {
    sid: u64,
    sink: Arc<LocalSink>,
    message: Message,
    since: Instant,
}

impl HeldLocal {
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    fn hold(&mut self, sid: u64, sink: Arc<LocalSink>, mut message: Message, since: Instant) {
        // A slice would keep the buffer it was read into (a fabric receive
        // buffer among them) for as long as the reader takes.
        detach(&mut message.payload);
        if let Some(headers) = message.headers.as_mut() {
            detach(headers);
        }
        sink.hold_one();
        self.messages.push_back(HeldMessage {
            sid,
            sink,
            message,
            since,
        });
    }

    /// Offer the held messages again, oldest first; those held longer than
    /// their subscription's block timeout are dropped (all those without
    /// room, `at_end` of a shutdown).
    pub fn retry(&mut self, shared: &Shared, now: Instant, at_end: bool) {
        let mut closed = Vec::new();
        // Subscriptions still full: their later messages wait too.
        let mut full = Vec::new();
        for held in std::mem::take(&mut self.messages) {
            let outcome = if full.contains(&held.sid) {
                Delivery::Full
            } else {
                held.sink.offer_held(held.message.clone())
            };
            let waited = now.saturating_duration_since(held.since);
            match outcome {
                Delivery::Full if at_end || waited >= held.sink.block_timeout() => {
                    held.sink.drop_held();
                    let dropped = Delivery::Dropped;
                    count_delivery(&shared.stats, held.sid, &held.sink, dropped, &mut closed);
                }
                Delivery::Full => {
                    full.push(held.sid);
                    self.messages.push_back(held);
                    continue;
                }
                outcome => {
                    count_delivery(&shared.stats, held.sid, &held.sink, outcome, &mut closed)
                }
            }
            held.sink.unhold_one();
        }
        if !closed.is_empty() {
            remove_closed(shared, closed);
        }
    }
}

/// Count one delivery's outcome; a closed subscription is noted in `closed`
/// with whether this delivery's policy cut it off.
pub(crate) fn count_delivery(
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
        Delivery::Closed => {
            // Picked for a member closing that moment: the group's others
            // never see it (but for the message that cut it off, counted
            // in its `dropped`).
            if sink.is_grouped() && !sink.take_cutting_delivery() {
                BrokerStats::add(&stats.connection_drops, 1);
            }
            closed.push((sid, sink.is_cut_off()));
        }
        // Held by the caller, counted when it is queued or dropped.
        Delivery::Full => {}
    }
}

/// Remove closed subscriptions from the router. Each one cut off by the
/// disconnect policy is counted once, by whoever removes it (a subscription
/// that was dropped, or a broker shutting down, is not a disconnect).
#[cold]
fn remove_closed(shared: &Shared, closed: Vec<(u64, bool)>) {
    let mut table = shared.subscriptions.write();
    for (sid, cut_off) in closed {
        let removed = table.remove(SubRef {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A message picked for a queue group's member as it closes never
    /// reaches the group's others: it is counted as lost with a
    /// connection; one for a plain subscription closing is not lost.
    #[test]
    fn a_message_for_a_closing_queue_member_is_counted() {
        let message = || Message {
            subject: Arc::from("jobs"),
            reply: None,
            headers: None,
            payload: Bytes::from_static(b"job"),
        };
        let stats = BrokerStats::default();
        for grouped in [true, false] {
            let (sink, _reader, _) =
                LocalSink::new(4, SlowConsumerPolicy::DropOldest, Duration::ZERO);
            let sink = sink.in_queue_group(grouped);
            sink.close();
            let outcome = sink.deliver(message());
            assert_eq!(outcome, Delivery::Closed);
            let mut closed = Vec::new();
            count_delivery(&stats, 7, &sink, outcome, &mut closed);
            assert_eq!(closed.len(), 1);
        }
        assert_eq!(stats.connection_drops.load(Ordering::Relaxed), 1);

        // The message that cuts a member off under `disconnect` is counted
        // in its `dropped`, not again; one picked for it after is lost.
        let stats = BrokerStats::default();
        let (sink, _reader, sub_stats) =
            LocalSink::new(1, SlowConsumerPolicy::Disconnect, Duration::ZERO);
        let sink = sink.in_queue_group(true);
        let mut closed = Vec::new();
        let outcomes: Vec<Delivery> = (0..3).map(|_| sink.deliver(message())).collect();
        assert_eq!(
            outcomes,
            [Delivery::Queued, Delivery::Closed, Delivery::Closed]
        );
        for outcome in outcomes {
            count_delivery(&stats, 7, &sink, outcome, &mut closed);
        }
        assert_eq!(sub_stats.dropped(), 1);
        assert_eq!(stats.connection_drops.load(Ordering::Relaxed), 1);
    }

    /// Asking which subscriptions a subject reaches (monitoring's
    /// `/subsz?test=`) moves no queue group's rotation: between two
    /// messages it would have sent both to the same member.
    #[test]
    fn a_match_report_leaves_queue_groups_taking_turns() {
        let broker = Broker::start(Config::default()).expect("an embedded broker");
        let members = [
            broker.queue_subscribe("jobs", "workers").unwrap(),
            broker.queue_subscribe("jobs", "workers").unwrap(),
        ];
        broker.publish("jobs", Bytes::from_static(b"1")).unwrap();
        assert_eq!(broker.matching("jobs").unwrap().local, 1);
        broker.publish("jobs", Bytes::from_static(b"2")).unwrap();
        for member in &members {
            let message = member.recv_timeout(Duration::from_secs(10));
            assert!(message.is_ok(), "{message:?}");
        }
    }

    /// In-process queue members and queue responders are marked as group
    /// members (their messages picked as they close are counted); plain
    /// subscriptions are not.
    #[test]
    fn queue_members_are_marked_grouped() {
        let broker = Broker::start(Config::default()).expect("an embedded broker");
        let _plain = broker.subscribe("jobs.a").unwrap();
        let _member = broker.queue_subscribe("jobs.b", "workers").unwrap();
        let _responder = broker.queue_respond("jobs.c", "workers", |_| None).unwrap();
        let table = broker.shared.subscriptions.read();
        let mut targets = crate::subscriptions::Targets::default();
        for (subject, grouped) in [("jobs.a", false), ("jobs.b", true), ("jobs.c", true)] {
            table.lookup(subject, &mut targets).unwrap();
            assert_eq!(targets.local.len(), 1, "{subject}");
            assert_eq!(targets.local[0].1.is_grouped(), grouped, "{subject}");
        }
    }

    /// Two peers each claiming a loss of nearly 2^64 leave the total at
    /// its top, not wrapped round to a small number.
    #[test]
    fn peer_claimed_counts_saturate() {
        let lost = AtomicU64::new(0);
        BrokerStats::add_saturating(&lost, u64::MAX - 1);
        BrokerStats::add_saturating(&lost, u64::MAX - 1);
        assert_eq!(lost.load(Ordering::Relaxed), u64::MAX);
        let counted = AtomicU64::new(5);
        BrokerStats::add_saturating(&counted, 7);
        assert_eq!(counted.load(Ordering::Relaxed), 12);
    }
}
