//! The broker's event loop: it polls the endpoints, hands each event to
//! the session it belongs to, and does the work that spans sessions:
//! fan-out of published messages to the subscribers' sessions, and routes
//! to other brokers ([`route`]). The per-session state and its
//! handshake live in [`peer`]; what every session shares (data links,
//! outbound queue, heartbeats) in [`crate::session`].
//!
//! Publishes are read in place; the deliveries a loop round produces for
//! one peer are encoded back to back into that peer's batch and handed to
//! its endpoint as one run at the end of the round (payloads over
//! [`COPY_MAX`] travel shared behind their own head). The loop sleeps until
//! an endpoint is ready, a command arrives, or the earliest session
//! deadline.

mod peer;
mod route;

use std::collections::VecDeque;
use std::net::IpAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// Session and peer maps are keyed by small integers the broker assigns:
// a fast non-keyed hash is safe there and cheaper than SipHash.
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use bytes::{Bytes, BytesMut};
use crossbeam_channel::{Receiver, Sender};
use efabus_core::caps::Offer;
use efabus_core::codec::{self, CodecLimits, FrameKind, RoutedFields, PREFIX_LEN};
use efabus_core::credit::CREDIT_DELAY;
use efabus_core::frame::{DeliveryClass, Dropped, ErrorCode, ErrorFrame, Frame, Goodbye};
use efabus_core::link::{LinkError, LinkTuning};
use efabus_core::log_limit::LogLimit;
use efabus_core::subject;
use efabus_core::transport::{
    split_run, split_run_slices, CloseReason, Endpoint, Event, FabricCounts, OutFrame, PeerId,
    Readiness, Refused, RendezvousCounts, SendError, TransportError,
};
use mio::{Poll, Token};
use tracing::{debug, error, info, warn};

use crate::accounts::inbox_of;
use crate::auth_guard::{remote_ip, AuthGuard};
use crate::broker::{
    deliver_local, BrokerStats, Command, HeldLocal, LocalRuns, LoopRequest, MessageParts,
    RouteReport, Shared,
};
use crate::delivery::LocalSink;
use crate::drive::{Driven, Rounds, DRIVEN_SLEEP};
use crate::endpoints;
use crate::published::PublishedRun;
use crate::session::data_link::{released_frames, Ask, Closed, GiveUp, LinkKind, MAX_PROBES};
use crate::session::outbound::{Control, Overflow, Queued, SendCounts};
use crate::session::{error_frame, push_reason, Heartbeat, Liveness};
use crate::subscriptions::{SubRef, Targets};
use crate::wait::{prepare_wait, puts_off_polling, wait, Polled, SpinWindow};

use crate::monitoring::{ConnectionKind, ConnectionReport, SubscriptionReport};
pub(crate) use peer::CheckedLogin;
use peer::{Departed, LoginCheck, Role, Session, SessionState, DEFERRED_MAX, DEPARTED_MAX};
pub(crate) use route::Cluster;

pub(crate) const WAKER: Token = Token(0);
/// Payloads up to this size are copied into a peer's batch of deliveries;
/// larger ones travel as their own part, shared rather than copied.
const COPY_MAX: usize = 1 << 10;
/// The largest frame a peer may send before its hello is accepted: a
/// hello with the longest name and secret and 64 offers with the longest
/// addresses fits (27,918 bytes; see the test in `peer.rs`), and a
/// connection that has not authenticated claims no more memory than this
/// for a frame.
pub(crate) const HANDSHAKE_FRAME_MAX: usize = 32 << 10;
/// How often the queued-bytes gauge is refreshed while anything is queued.
const GAUGE_REFRESH: Duration = Duration::from_millis(100);
/// Longest sleep when no session has a deadline (a broker with no peers).
const IDLE_WAKE: Duration = Duration::from_secs(60);
/// Shortest time between two visits of the timers: deadlines may be met
/// this late (heartbeats, handshakes, gap timeouts, block limits), and a
/// broker with many sessions visits them at most 20 times a second.
const TIMER_SPACING: Duration = Duration::from_millis(50);
/// How often a session whose best-effort frames wait for credit is tried
/// again when nothing else wakes it (a credit lost on the way).
const PACING_RETRY: Duration = Duration::from_millis(50);
/// How soon messages held for full in-process subscriptions are offered
/// again (their readers do not wake the loop when they make room).
const HELD_RETRY: Duration = Duration::from_millis(1);
/// Shortest time between two reports to one client of what the
/// drop-oldest policy discarded for it: drops in between are added up.
const DROP_REPORT_SPACING: Duration = Duration::from_millis(100);

/// Subscriptions a connection report lists at most (the lowest ids);
/// `subscription_count` says how many there are.
const SUBSCRIPTIONS_LISTED: usize = 1024;

pub(crate) struct EventLoop {
    shared: Arc<Shared>,
    /// The events of the round's endpoint polls.
    events: Vec<Event>,
    endpoints: Vec<Box<dyn Endpoint>>,
    polling: Polled,
    /// When each endpoint with a descriptor was last polled and found
    /// nothing (`None` after it found work, and for the others).
    fd_quiet_since: Vec<Option<Instant>>,
    /// The last round found work on an endpoint that must be polled.
    polled_busy: bool,
    sessions: HashMap<u64, Session>,
    by_peer: HashMap<(usize, PeerId), u64>,
    /// Sessions whose user is restricted: their permissions and the reply
    /// subjects delivered to them (empty on a broker without
    /// `auth.users`: one lookup of an empty map a publish).
    restricted: HashMap<u64, Restricted>,
    /// The sessions holding each inbox (`_INBOX.<token>`), and each
    /// session's inboxes: a restricted user may subscribe under its own
    /// inbox only.
    inboxes: HashMap<String, InboxHolders>,
    inboxes_held: HashMap<u64, Vec<String>>,
    /// The sessions with subscriptions waiting for each inbox (see
    /// [`Restricted::awaits_inbox`]).
    inbox_waiters: HashMap<String, Vec<u64>>,
    /// The session each proven fabric address belongs to, by endpoint: one
    /// address, one live session.
    fabric_owners: HashMap<(usize, Vec<u8>), u64>,
    commands: Receiver<Command>,
    /// Runs taken from [`Shared::published`], delivered from
    /// `published_next` (run, message) on: a round delivers a bounded
    /// number of messages.
    published: Vec<PublishedRun>,
    published_next: (usize, usize),
    /// Messages delivered from [`Shared::published`] in total.
    published_total: u64,
    codec: CodecLimits,
    next_session: u64,
    /// Flushes waiting: each is answered once the messages published
    /// before it are delivered (`published_total` has reached its count)
    /// and every session's queue is empty. One whose caller stopped
    /// waiting (`until`) is dropped when the next flush comes.
    flushes: Vec<Flush>,
    /// Messages for in-process subscriptions whose queues are full under
    /// the block policy (see [`HeldLocal`]).
    held_local: HeldLocal,
    /// Subscriptions whose delivery limit the publish being routed reached
    /// (`Session::limited`), ended once it is routed.
    limits_reached: Vec<SubRef>,
    /// Queue-group members of clients that left lately (see [`Departed`]).
    departed: Departed,
    /// Hellos with a password or token hash to check go to the login
    /// thread through this (started at the first).
    login_checks: Option<Sender<Box<LoginCheck>>>,
    /// The frames being handled came behind a hello and were kept while it
    /// was checked (`Session::deferred`).
    replaying_deferred: bool,
    /// Messages for in-process subscriptions, gathered while the loop
    /// handles what it read ([`EventLoop::queue_local_runs`]).
    local_runs: LocalRuns,
    /// Sessions whose queue is over its bound under the block policy: while
    /// any exist, reading from publishers is paused.
    blocking: HashSet<u64>,
    reads_paused: bool,
    targets: Targets,
    /// The subscriptions the last publish's subject reached, kept while
    /// the subscription table stays unchanged: a stream of publishes on
    /// one subject is looked up once. Likewise for messages from routes.
    last_route: LastRoute,
    last_from_route: LastRoute,
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
    /// When a session or the cluster next has something to do by time.
    next_timer: Instant,
    /// When the timers were last served.
    timers_ran: Instant,
    /// Failed authentications per remote address.
    auth_guard: AuthGuard,
    /// Accepted sessions still in their handshake, per peer address.
    handshaking: HashMap<IpAddr, usize>,
    /// Those sessions, all addresses together, and their ids in the
    /// order they were accepted (with ids of sessions past their
    /// handshake since, passed over when they come to the front).
    handshaking_total: usize,
    awaiting_hello: VecDeque<u64>,
    /// The endpoints' refused messages as last put in the stats.
    refused: Refused,
    rendezvous: RendezvousCounts,
    /// The listeners' provider counts as last published.
    fabric: FabricCounts,
    /// Which listeners are marked out of service in the shared state
    /// (read here without its lock on every poll).
    listener_down: Vec<bool>,
    /// Failed polls are logged once a second at most.
    poll_error_log: LogLimit,
    /// Data links closed alone likewise, and datagram links opened again
    /// (each kind its own): a path that fails under a thousand clients at
    /// once, or a peer that has its datagram link reopened every second,
    /// would flood the log (each session's report keeps its own reasons).
    link_closed_log: LogLimit,
    link_reopened_log: LogLimit,
    /// Reliable data links that failed (their sessions end) likewise.
    link_failed_log: LogLimit,
    /// Refused connections likewise.
    refused_log: LogLimit,
    /// Route interest refused likewise.
    route_refusal_log: LogLimit,
    /// Sessions closed for an error, at most ten lines a second: a flood
    /// of peers failing at once (a storm of bad input, a stalled path
    /// under many slow consumers) is counted, not logged line by line.
    closing_log: LogLimit,
}

impl EventLoop {
    /// Session `id` subscribed under `inbox` once more. Only a route holds
    /// an inbox another session holds already (two routes from one broker
    /// both carry its requester's replies); a client subscribing under
    /// another's inbox does not keep it from its owner when that one
    /// connects again.
    pub(super) fn hold_inbox(&mut self, id: u64, inbox: &str) {
        let route = self.sessions.get(&id).is_some_and(|s| s.route().is_some());
        let holders = self.inboxes.entry(inbox.to_string()).or_default();
        if !route && !holders.is_empty() && !holders.holds(id) {
            return;
        }
        if holders.add(id) {
            self.inboxes_held
                .entry(id)
                .or_default()
                .push(inbox.to_string());
        }
    }

    /// One subscription of `id` under `inbox` fewer.
    pub(super) fn release_inbox(&mut self, id: u64, inbox: &str) {
        let Some(holders) = self.inboxes.get_mut(inbox) else {
            return;
        };
        if holders.release(id) {
            let freed = holders.is_empty();
            if freed {
                self.inboxes.remove(inbox);
            }
            if let Some(held) = self.inboxes_held.get_mut(&id) {
                held.retain(|held| held != inbox);
            }
            if freed {
                self.inbox_freed(inbox);
            }
        }
    }

    /// Session `id` waits for `inbox` no more.
    pub(super) fn forget_waiter(&mut self, id: u64, inbox: &str) {
        if let Some(waiters) = self.inbox_waiters.get_mut(inbox) {
            waiters.retain(|&waiter| waiter != id);
            if waiters.is_empty() {
                self.inbox_waiters.remove(inbox);
            }
        }
    }

    /// `inbox` is held by no one now: the subscriptions waiting for it
    /// (see [`Restricted::awaits_inbox`]) are made, the newest
    /// connection's first (it takes the inbox; an older one waiting is
    /// stale too, and is refused).
    fn inbox_freed(&mut self, inbox: &str) {
        let Some(mut waiters) = self.inbox_waiters.remove(inbox) else {
            return;
        };
        waiters.sort_unstable_by(|a, b| b.cmp(a));
        for id in waiters {
            // A closing session takes nothing more.
            let open = self
                .sessions
                .get(&id)
                .is_some_and(|session| !matches!(session.state, SessionState::Closing { .. }));
            let Some(restricted) = self.restricted.get_mut(&id).filter(|_| open) else {
                continue;
            };
            let (waited, kept) = std::mem::take(&mut restricted.awaits_inbox)
                .into_iter()
                .partition(|s| crate::accounts::inbox_of(&s.pattern) == Some(inbox));
            restricted.awaits_inbox = kept;
            for subscribe in waited {
                self.on_subscribe(id, subscribe);
            }
        }
    }

    /// The session whose inbox `inbox` is, if any.
    pub(super) fn inbox_holder(&self, inbox: &str) -> Option<u64> {
        self.inboxes.get(inbox).and_then(InboxHolders::holder)
    }

    /// Session `id` is gone: its inboxes pass to the routes that hold them
    /// too (a second route from the same broker).
    fn release_inboxes_of(&mut self, id: u64) {
        for inbox in self.inboxes_held.remove(&id).unwrap_or_default() {
            if let Some(holders) = self.inboxes.get_mut(&inbox) {
                holders.forget(id);
                if holders.is_empty() {
                    self.inboxes.remove(&inbox);
                    self.inbox_freed(&inbox);
                }
            }
        }
    }
}

/// The sessions holding one inbox, each with how many of its
/// subscriptions lie under it, in the order they came. The first holds
/// the inbox: a restricted user may subscribe under it, or name it as a
/// reply subject, only if that is its session. The others (routes) keep
/// it held once the first is gone, so it never falls free while a route
/// from the broker whose requester it is still subscribes under it.
#[derive(Default)]
pub(super) struct InboxHolders(Vec<(u64, usize)>);

impl InboxHolders {
    fn holder(&self) -> Option<u64> {
        self.0.first().map(|&(id, _)| id)
    }

    fn holds(&self, id: u64) -> bool {
        self.0.iter().any(|&(holder, _)| holder == id)
    }

    /// One more subscription of `id`; whether `id` is new here.
    fn add(&mut self, id: u64) -> bool {
        match self.0.iter_mut().find(|(holder, _)| *holder == id) {
            Some((_, count)) => {
                *count += 1;
                false
            }
            None => {
                self.0.push((id, 1));
                true
            }
        }
    }

    /// One subscription of `id` fewer; whether that was its last.
    fn release(&mut self, id: u64) -> bool {
        let Some(at) = self.0.iter().position(|(holder, _)| *holder == id) else {
            return false;
        };
        self.0[at].1 -= 1;
        if self.0[at].1 > 0 {
            return false;
        }
        self.0.remove(at);
        true
    }

    fn forget(&mut self, id: u64) {
        self.0.retain(|(holder, _)| *holder != id);
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The paths `report` shows for a route's `session` (`control`: its
/// control link's scheme): the reliable data link, or the control link;
/// the datagram link; and this side's id for the reliable data link.
fn set_route_paths(report: &mut RouteReport, session: &Session, control: &str) {
    let links = &session.conn.links;
    report.reliable = links
        .reliable
        .as_ref()
        .map_or_else(|| control.to_string(), |link| link.description.clone());
    report.best_effort = links.best_effort_path();
    report.link_id = links.reliable.as_ref().and(session.link_id);
}

/// Whether endpoint `index` is in service, from the listeners marked
/// down.
fn in_service(down: &[bool]) -> impl Fn(usize) -> bool + '_ {
    move |index| !down.get(index).copied().unwrap_or(false)
}

/// A session whose user's permissions restrict it.
/// Subscriptions one connection may have waiting for inboxes (a client
/// has one inbox, under which it subscribes once).
pub(super) const AWAITED_MAX: usize = 8;

pub(super) struct Restricted {
    pub permissions: Arc<crate::config::Permissions>,
    /// Reply subjects of the messages delivered to it lately.
    pub replies: crate::accounts::Replies,
    /// Subscriptions under an inbox an earlier connection of the same
    /// user holds, made once that connection lets it go (at most
    /// [`AWAITED_MAX`]).
    pub awaits_inbox: Vec<efabus_core::frame::Subscribe>,
}

/// A payload being delivered: its bytes, and the buffer they lie in, so a
/// shared slice is made only where one is needed (large payloads,
/// in-process subscribers) and small ones are copied without touching the
/// buffer's reference count.
#[derive(Clone, Copy)]
struct Payload<'a> {
    /// The payload field as on the wire: with `headers`, the header
    /// block's length and the block come first.
    bytes: &'a [u8],
    frame: &'a Bytes,
    /// Where `bytes` start in `frame`.
    at: usize,
    headers: bool,
}

impl<'a> Payload<'a> {
    /// The payload field of a decoded message: its body alone, or (with
    /// headers) the header block joined in front of it, in `joined`.
    fn of_parts(headers: &Option<Bytes>, body: &'a Bytes, joined: &'a mut Bytes) -> Self {
        let Some(block) = headers else {
            return Payload {
                bytes: body,
                frame: body,
                at: 0,
                headers: false,
            };
        };
        *joined = codec::join_headers(block, body);
        let joined: &'a Bytes = joined;
        Payload {
            bytes: joined,
            frame: joined,
            at: 0,
            headers: true,
        }
    }

    fn to_bytes(self) -> Bytes {
        self.frame.slice(self.at..self.at + self.bytes.len())
    }

    /// What counts against `max_payload`: headers with the body, as NATS
    /// counts them, not the headers' length prefix.
    fn counted_len(self) -> usize {
        let prefix = if self.headers {
            codec::HEADERS_PREFIX_LEN
        } else {
            0
        };
        self.bytes.len().saturating_sub(prefix)
    }

    /// A header block, if there is one, must be one: subscribers' clients
    /// parse it.
    fn check_headers(self) -> Result<(), efabus_core::headers::HeadersError> {
        if !self.headers {
            return Ok(());
        }
        match codec::split_headers(self.bytes) {
            Some((block, _)) => efabus_core::headers::check_block(block),
            None => Err(efabus_core::headers::HeadersError::Unterminated),
        }
    }

    /// The header block (if any) and the body, shared with the frame.
    fn split(self) -> (Option<Bytes>, Bytes) {
        let field = self.to_bytes();
        if !self.headers {
            return (None, field);
        }
        match codec::split_headers(&field) {
            Some((block, body)) => {
                let body_at = field.len() - body.len();
                let block =
                    field.slice(codec::HEADERS_PREFIX_LEN..codec::HEADERS_PREFIX_LEN + block.len());
                (Some(block), field.slice(body_at..))
            }
            None => (None, field),
        }
    }

    fn fields<'s>(self, subject: &'s str, reply: Option<&'s str>) -> RoutedFields<'s> {
        RoutedFields {
            subject,
            reply,
            headers: self.headers,
        }
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
    best_effort_lost: u64,
    bad_link_frames: u64,
    fabric_frames_in: u64,
    sent: SendCounts,
}

impl EventLoop {
    pub(crate) fn new(
        shared: Arc<Shared>,
        endpoints: Vec<Box<dyn Endpoint>>,
        commands: Receiver<Command>,
        codec: CodecLimits,
        cluster: Cluster,
    ) -> EventLoop {
        let mut endpoints = endpoints;
        for endpoint in &mut endpoints {
            // Frames read together are read in place (`on_frame_in`).
            endpoint.deliver_runs();
        }
        let polling = Polled::of(endpoints.iter().map(|e| e.readiness()));
        let endpoint_count = endpoints.len();
        // An endpoint opened only to dial routes offers nothing.
        let offers = endpoints
            .iter()
            .enumerate()
            .filter(|(index, _)| !cluster.dials_only(*index))
            .filter_map(|(_, endpoint)| endpoints::offer_for(endpoint.as_ref()))
            .collect();
        // Every session's data links draw from one budget.
        let tuning = shared.config.link_tuning();
        let listener_down = vec![false; shared.listening.len()];
        // The broker's own requests reply under its inbox.
        let inboxes = std::iter::once((
            shared.inbox_prefix.clone(),
            InboxHolders(vec![(crate::subscriptions::LOCAL_OWNER, usize::MAX)]),
        ))
        .collect();
        EventLoop {
            shared,
            events: Vec::with_capacity(256),
            endpoints,
            polling,
            fd_quiet_since: vec![None; endpoint_count],
            polled_busy: false,
            sessions: HashMap::default(),
            by_peer: HashMap::default(),
            restricted: HashMap::default(),
            inboxes,
            inboxes_held: HashMap::default(),
            inbox_waiters: HashMap::default(),
            fabric_owners: HashMap::default(),
            commands,
            published: Vec::new(),
            published_next: (0, 0),
            published_total: 0,
            codec,
            next_session: 1,
            flushes: Vec::new(),
            held_local: HeldLocal::default(),
            limits_reached: Vec::new(),
            departed: Departed::default(),
            login_checks: None,
            replaying_deferred: false,
            local_runs: LocalRuns::default(),
            blocking: HashSet::default(),
            reads_paused: false,
            targets: Targets::default(),
            last_route: LastRoute::default(),
            last_from_route: LastRoute::default(),
            offers,
            tuning,
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
            next_timer: Instant::now(),
            timers_ran: Instant::now(),
            auth_guard: AuthGuard::default(),
            handshaking: HashMap::default(),
            handshaking_total: 0,
            awaiting_hello: VecDeque::new(),
            refused: Refused::default(),
            rendezvous: RendezvousCounts::default(),
            fabric: FabricCounts::default(),
            listener_down,
            poll_error_log: LogLimit::new(Duration::from_secs(1)),
            link_closed_log: LogLimit::new(Duration::from_secs(1)),
            link_reopened_log: LogLimit::new(Duration::from_secs(1)),
            link_failed_log: LogLimit::new(Duration::from_secs(1)),
            refused_log: LogLimit::new(Duration::from_secs(1)),
            route_refusal_log: LogLimit::new(Duration::from_secs(1)),
            closing_log: LogLimit::new(Duration::from_millis(100)),
        }
    }

    /// One round: what in-process threads published for remote
    /// subscribers and asked of the loop (sent at once), every endpoint's
    /// events, held-back credits, the timers when due, and the round's
    /// sends handed to the wire. Run by the loop thread, or by an
    /// application thread of an embedded broker while it waits (see
    /// [`Driven`]).
    fn round(&mut self) -> Round {
        self.now = Instant::now();
        // Dated before it is counted: a health check that sees no new
        // round finds this one's start.
        self.shared.round_watch.round_began(self.now);
        self.shared.rounds.fetch_add(1, Ordering::Release);
        // A kept answer the table has moved past is let go: it may hold
        // in-process subscriptions dropped since, and their queues.
        let generation = self.shared.generation.load(Ordering::Acquire);
        self.last_route.forget_if_stale(generation);
        self.last_from_route.forget_if_stale(generation);
        // Commands first, and what they queued sent before the endpoints
        // are polled: a request that an application thread published just
        // before running this round leaves without waiting for every
        // endpoint's poll (2.5 us of a 64 B round trip between meshed
        // services over `tcp;ofi_rxm`).
        let commanded = self.drain_commands(4096);
        if commanded {
            self.flush_endpoints();
        }
        let mut events = std::mem::take(&mut self.events);
        let busy = self.poll_endpoints(&mut events) | commanded;
        self.events = events;
        let now = Instant::now();
        let mut credit_waiting = !self.credit_owed.is_empty() && self.grant_credits(now);
        // Timers of many sessions are served together, at most once
        // per `TIMER_SPACING`: the visit is over every session.
        let mut timers_at = self.next_timer.max(self.timers_ran + TIMER_SPACING);
        if now >= timers_at {
            self.timers_ran = now;
            self.on_timers(now);
            // What the links released is queued (or held, pausing
            // reads) before credit is granted for it.
            self.queue_local_runs();
            // Gaps the timers gave up are acknowledged in this round.
            if !self.credit_owed.is_empty() {
                credit_waiting |= self.grant_credits(now);
            }
            // Frames the links released (a gap filled, a timeout) may
            // have been requests to responders here.
            if self.publish_answers() {
                self.close_batches();
                self.flush_tally();
            }
            self.queue_local_runs();
        }
        // Gathered anywhere else in the round: queued before it ends.
        self.queue_local_runs();
        // Held messages are offered every round, not at the timers'
        // spacing: their readers do not wake the loop, and remote
        // publishers wait meanwhile.
        if !self.held_local.is_empty() {
            self.held_local.retry(&self.shared, now, false);
            if self.held_local.is_empty() {
                self.release_reads();
            } else {
                timers_at = timers_at.min(now + HELD_RETRY);
            }
        }
        // The round's sends leave now, not after the next round's poll
        // of every endpoint before theirs.
        self.flush_endpoints();
        self.shared.round_watch.round_ended();
        Round {
            busy,
            credit_waiting,
            now,
            timers_at,
        }
    }

    /// Hands every endpoint's queued sends to its transport.
    fn flush_endpoints(&mut self) {
        for endpoint in &mut self.endpoints {
            endpoint.flush();
        }
    }

    /// Queue the messages gathered for an in-process subscription
    /// ([`LocalRuns`]). If some found their queue full and are held,
    /// remote publishers wait, as for a remote slow consumer.
    fn queue_local_runs(&mut self) {
        if self.local_runs.is_empty() {
            return;
        }
        self.local_runs
            .queue(&self.shared, &mut self.held_local, self.now);
        if !self.held_local.is_empty() {
            self.set_reads_paused(true);
        }
    }

    /// The session frames from `peer` on endpoint `index` belong to, and
    /// whether that endpoint carries its control link; `last` keeps the
    /// answer for the peer's next frames.
    fn frames_from(
        &self,
        index: usize,
        peer: PeerId,
        last: &mut Option<(PeerId, u64, bool)>,
    ) -> Option<(u64, bool)> {
        if let Some((known, id, control)) = *last {
            if known == peer {
                return Some((id, control));
            }
        }
        let id = *self.by_peer.get(&(index, peer))?;
        let control = self
            .sessions
            .get(&id)
            .is_some_and(|s| s.conn.control.endpoint == index);
        *last = Some((peer, id, control));
        Some((id, control))
    }

    /// Poll every endpoint once and handle its events; true if any. The
    /// deliveries this produces are batched per peer and handed to the
    /// endpoints once the events are handled.
    fn poll_endpoints(&mut self, events: &mut Vec<Event>) -> bool {
        let mut busy = false;
        let mut polled_busy = false;
        self.now = Instant::now();
        for index in 0..self.endpoints.len() {
            let quiet_since = self.fd_quiet_since.get(index).copied().flatten();
            let endpoint = &*self.endpoints[index];
            if puts_off_polling(self.polled_busy, quiet_since, self.now, endpoint) {
                continue;
            }
            events.clear();
            match self.endpoints[index].poll(events) {
                Err(err) => self.endpoint_failed(index, &err),
                Ok(()) if self.listener_down.get(index) == Some(&true) => {
                    self.listener_recovered(index)
                }
                Ok(()) => {}
            }
            let found = !events.is_empty();
            busy |= found;
            if let Readiness::Fd(_) = self.endpoints[index].readiness() {
                if let Some(quiet_since) = self.fd_quiet_since.get_mut(index) {
                    *quiet_since = (!found).then_some(self.now);
                }
            } else {
                polled_busy |= found;
            }
            // Frames come in runs from one peer: its session is looked up
            // once per run (and whether this is its control link).
            let mut last: Option<(PeerId, u64, bool)> = None;
            for event in events.drain(..) {
                match event {
                    Event::Frame { peer, frame } => {
                        let Some((id, control)) = self.frames_from(index, peer, &mut last) else {
                            continue;
                        };
                        if control {
                            self.on_frame(id, frame);
                        } else {
                            self.on_wire(id, index, peer, frame);
                        }
                    }
                    Event::Frames { peer, run } => {
                        let Some((id, control)) = self.frames_from(index, peer, &mut last) else {
                            continue;
                        };
                        if control {
                            // Read in place: no reference to the buffer
                            // per frame.
                            let mut at = 0;
                            for frame in split_run_slices(&run) {
                                self.on_frame_in(id, &run, at..at + frame.len());
                                at += frame.len();
                            }
                        } else {
                            for frame in split_run(&run) {
                                self.on_wire(id, index, peer, frame.head);
                            }
                        }
                    }
                    other => {
                        last = None;
                        self.handle_event(index, other);
                    }
                }
            }
            self.queue_local_runs();
        }
        self.polled_busy = polled_busy;
        self.publish_answers();
        // Before credits are granted: reads may have to pause for what
        // finds its queue full.
        self.queue_local_runs();
        self.close_batches();
        self.flush_tally();
        self.publish_endpoint_counts();
        busy
    }

    /// Publish the replies responders made in this round's deliveries, as
    /// an in-process publisher's would be, so they go out in this round;
    /// true if there were any. Called after each step of a round that
    /// delivers (the endpoints' events, the timers' released frames).
    /// Replies carry no reply subject, so they make no more of their own.
    fn publish_answers(&mut self) -> bool {
        let origin = self.shared.answer_origin;
        if !crate::delivery::answers_waiting(origin) {
            return false;
        }
        let max_payload = self.shared.live.max_payload();
        for answered in crate::delivery::take_answers(origin, max_payload) {
            let subject = &*answered.subject;
            let matched = self
                .shared
                .subscriptions
                .read()
                .lookup(subject, &mut self.targets);
            if matched.is_err() {
                answered.stats.count_unanswered();
                continue;
            }
            let mut joined = Bytes::new();
            let payload = Payload::of_parts(&None, &answered.payload, &mut joined);
            self.deliver_matched(
                crate::subscriptions::LOCAL_OWNER,
                subject,
                None,
                payload,
                matched,
            );
        }
        true
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
        if tally.best_effort_lost > 0 {
            BrokerStats::add_saturating(&stats.best_effort_lost, tally.best_effort_lost);
        }
        if tally.bad_link_frames > 0 {
            BrokerStats::add(&stats.bad_link_frames, tally.bad_link_frames);
        }
        if tally.route_messages_out > 0 {
            BrokerStats::add(&stats.route_messages_out, tally.route_messages_out);
        }
        if tally.fabric_frames_in > 0 {
            BrokerStats::add(&stats.fabric_frames_in, tally.fabric_frames_in);
        }
        if tally.sent.refused_messages > 0 {
            BrokerStats::add(&stats.connection_drops, tally.sent.refused_messages);
        }
        if tally.sent.fabric_frames_out > 0 {
            BrokerStats::add(&stats.fabric_frames_out, tally.sent.fabric_frames_out);
        }
        if tally.sent.credit_waits > 0 {
            BrokerStats::add(&stats.credit_waits, tally.sent.credit_waits);
        }
    }

    /// The endpoints' counts (refused messages, rendezvous), which change
    /// only as they are polled, into the shared stats when they moved.
    fn publish_endpoint_counts(&mut self) {
        self.publish_refused();
        self.publish_rendezvous();
        self.publish_fabric();
    }

    fn publish_fabric(&mut self) {
        let counts = self.endpoints.iter().map(|e| e.fabric_counts()).fold(
            FabricCounts::default(),
            |sum, c| FabricCounts {
                messages_sent: sum.messages_sent + c.messages_sent,
                messages_received: sum.messages_received + c.messages_received,
                completion_reads: sum.completion_reads + c.completion_reads,
                completion_errors: sum.completion_errors + c.completion_errors,
                lent: sum.lent + c.lent,
                shared_sends: sum.shared_sends + c.shared_sends,
                av_evictions: sum.av_evictions + c.av_evictions,
                addresses: sum.addresses + c.addresses,
                address_capacity: sum.address_capacity + c.address_capacity,
                rnr_failures: sum.rnr_failures + c.rnr_failures,
                queue_full: sum.queue_full + c.queue_full,
            },
        );
        if counts == self.fabric {
            return;
        }
        self.fabric = counts;
        let stats = &self.shared.stats;
        store_all(&[
            (&stats.fabric_messages_sent, counts.messages_sent),
            (&stats.fabric_messages_received, counts.messages_received),
            (&stats.fabric_completion_reads, counts.completion_reads),
            (&stats.fabric_completion_errors, counts.completion_errors),
            (&stats.fabric_lent, counts.lent),
            (&stats.fabric_shared_sends, counts.shared_sends),
            (&stats.fabric_av_evictions, counts.av_evictions),
            (&stats.fabric_addresses, counts.addresses),
            (&stats.fabric_address_capacity, counts.address_capacity),
            (&stats.fabric_rnr_failures, counts.rnr_failures),
            (&stats.fabric_queue_full, counts.queue_full),
        ]);
    }

    fn publish_refused(&mut self) {
        let refused =
            self.endpoints
                .iter()
                .map(|e| e.refused())
                .fold(Refused::default(), |sum, r| Refused {
                    unknown_link: sum.unknown_link + r.unknown_link,
                    forged: sum.forged + r.forged,
                    replayed: sum.replayed + r.replayed,
                    malformed: sum.malformed + r.malformed,
                });
        if refused == self.refused {
            return;
        }
        self.refused = refused;
        let stats = &self.shared.stats;
        store_all(&[
            (&stats.fabric_unknown_links, refused.unknown_link),
            (&stats.fabric_forged, refused.forged),
            (&stats.fabric_replayed, refused.replayed),
            (&stats.fabric_malformed, refused.malformed),
        ]);
    }

    fn publish_rendezvous(&mut self) {
        let counts = self.endpoints.iter().map(|e| e.rendezvous_counts()).fold(
            RendezvousCounts::default(),
            |sum, c| RendezvousCounts {
                sent: sum.sent + c.sent,
                registrations: sum.registrations + c.registrations,
                read: sum.read + c.read,
                read_bytes: sum.read_bytes + c.read_bytes,
                huge_landed: sum.huge_landed + c.huge_landed,
                abandoned: sum.abandoned + c.abandoned,
                reads_given_up: sum.reads_given_up + c.reads_given_up,
                cache_hits: sum.cache_hits + c.cache_hits,
                registered: sum.registered + c.registered,
                registered_bytes: sum.registered_bytes + c.registered_bytes,
            },
        );
        if counts == self.rendezvous {
            return;
        }
        self.rendezvous = counts;
        let stats = &self.shared.stats;
        store_all(&[
            (&stats.fabric_rendezvous_sent, counts.sent),
            (&stats.fabric_rendezvous_read, counts.read),
            (&stats.fabric_rendezvous_read_bytes, counts.read_bytes),
            (&stats.fabric_rendezvous_huge_landed, counts.huge_landed),
            (&stats.fabric_rendezvous_registrations, counts.registrations),
            (&stats.fabric_rendezvous_abandoned, counts.abandoned),
            (
                &stats.fabric_rendezvous_reads_given_up,
                counts.reads_given_up,
            ),
            (&stats.fabric_rendezvous_cache_hits, counts.cache_hits),
            (&stats.fabric_rendezvous_registered, counts.registered),
            (
                &stats.fabric_rendezvous_registered_bytes,
                counts.registered_bytes,
            ),
        ]);
    }

    /// Cuts off a peer that takes too little: counted as a slow consumer,
    /// logged with `why`, and told `text` before it is closed.
    fn disconnect_slow(&mut self, id: u64, why: &str, text: String) {
        BrokerStats::add(&self.shared.stats.slow_consumer_disconnects, 1);
        if let Some(session) = self.sessions.get(&id) {
            warn!(session = id, remote = %session.remote, "{why}");
        }
        self.fail(id, ErrorCode::SlowConsumer, text);
    }

    /// Has every endpoint read its TLS files again, or none: those that
    /// did are put back when one fails. How many have TLS, or why not.
    fn reload_tls(&mut self) -> Result<usize, String> {
        let mut reloaded = Vec::new();
        for index in 0..self.endpoints.len() {
            match self.endpoints[index].reload_tls() {
                Ok(true) => reloaded.push(index),
                Ok(false) => {}
                Err(err) => {
                    for &done in &reloaded {
                        self.endpoints[done].revert_tls();
                    }
                    return Err(format!("{}: {err}", self.endpoints[index].scheme()));
                }
            }
        }
        Ok(reloaded.len())
    }

    /// Answers the requests put apart from the commands (`LoopRequest`),
    /// whatever the loop holds.
    fn answer_loop_requests(&mut self) {
        if !self
            .shared
            .loop_requests_waiting
            .swap(false, Ordering::AcqRel)
        {
            return;
        }
        let asked = std::mem::take(&mut *self.shared.loop_requests.lock());
        for request in asked {
            // The asker may have given up waiting.
            match request {
                LoopRequest::Connections(subscriptions_of, abandoned, answer) => {
                    if !abandoned.load(Ordering::Acquire) {
                        let _ = answer.send(self.connection_reports(&subscriptions_of));
                    }
                }
                LoopRequest::ReloadTls(taken, answer) => {
                    if !taken.swap(true, Ordering::AcqRel) {
                        let _ = answer.send(self.reload_tls());
                    }
                }
                LoopRequest::Reconfigure(config, done) => {
                    for endpoint in &mut self.endpoints {
                        let scheme = endpoint.scheme().to_string();
                        let reloaded = endpoints::listener_config(&config, &scheme, None);
                        if let Err(err) = endpoint.reconfigure(&reloaded) {
                            warn!(%scheme, error = %err, "reloaded limits not applied");
                        }
                    }
                    let _ = done.send(());
                }
            }
        }
    }

    /// Whether the loop reads no commands for now: while publishers are
    /// held under the block policy, in-process publishers wait too.
    fn holds_commands(&self) -> bool {
        !self.blocking.is_empty()
    }

    fn drain_commands(&mut self, max: usize) -> bool {
        // Interest goes to route peers ahead of any message queued after it.
        self.sync_interest();
        self.answer_loop_requests();
        self.finish_login_checks();
        if self.holds_commands() {
            return false;
        }
        let delivered = self.deliver_published(max);
        let mut handled = 0;
        while handled < max {
            let Ok(command) = self.commands.try_recv() else {
                break;
            };
            handled += 1;
            match command {
                Command::Flush {
                    done,
                    until,
                    published,
                } => {
                    // Flushes whose callers stopped waiting are forgotten:
                    // with queues that never all drain, they would pile up.
                    let now = Instant::now();
                    self.flushes
                        .retain(|flush| flush.until.is_none_or(|until| until > now));
                    self.flushes.push(Flush {
                        done,
                        until,
                        published,
                    });
                }
                Command::AddPeer(endpoint) => self.add_peer(endpoint),
            }
        }
        self.close_batches();
        self.flush_tally();
        self.answer_flushes();
        handled > 0 || delivered > 0
    }

    /// Delivers up to `max` messages that in-process threads published for
    /// remote subscribers, in publish order; returns how many.
    fn deliver_published(&mut self, max: usize) -> usize {
        self.departed.forget_expired(self.now);
        let mut runs = std::mem::take(&mut self.published);
        let (mut run_at, mut message_at) = self.published_next;
        let (mut delivered, mut delivered_bytes) = (0, 0);
        let mut joined = Bytes::new();
        while delivered < max {
            let Some(run) = runs.get(run_at) else {
                runs.clear();
                self.shared.published.take(&mut runs);
                (run_at, message_at) = (0, 0);
                if runs.is_empty() {
                    break;
                }
                // Announcements made before these publishes go first.
                self.sync_interest();
                continue;
            };
            let end = run
                .messages
                .len()
                .min(message_at.saturating_add(max - delivered));
            for message in &run.messages[message_at..end] {
                let payload = Payload::of_parts(&message.headers, &message.payload, &mut joined);
                delivered_bytes += message.size();
                self.encoded_valid = false;
                for &target in run.targets.iter() {
                    let reply = message.reply.as_deref();
                    match self.departed.group_of(target) {
                        Some((pattern, queue)) => {
                            let (pattern, queue) = (Arc::clone(pattern), Arc::clone(queue));
                            self.deliver_to_group(&pattern, &queue, &run.subject, reply, payload);
                        }
                        None => self.deliver_remote(target, &run.subject, reply, payload),
                    }
                }
                self.end_limited_subscriptions();
            }
            delivered += end - message_at;
            message_at = end;
            if message_at == run.messages.len() {
                (run_at, message_at) = (run_at + 1, 0);
            }
        }
        self.published = runs;
        self.published_next = (run_at, message_at);
        if delivered > 0 {
            self.published_total += delivered as u64;
            self.shared.published.delivered(delivered, delivered_bytes);
        }
        delivered
    }

    /// Every session as monitoring sees it, by id; subscriptions listed
    /// only for the sessions asked.
    fn connection_reports(&self, subscriptions_of: &[u64]) -> Vec<ConnectionReport> {
        let listed: rustc_hash::FxHashSet<u64> = subscriptions_of.iter().copied().collect();
        let mut reports: Vec<ConnectionReport> = self
            .sessions
            .iter()
            .map(|(&id, session)| {
                let links = &session.conn.links;
                let control = self.endpoints[session.conn.control.endpoint].scheme();
                let subscriptions: Vec<SubscriptionReport> = match &session.role {
                    Role::Client(subs) if listed.contains(&id) => {
                        // The first by id, strings copied for those only: a
                        // connection may hold 100,000.
                        let mut listed: Vec<_> = subs.iter().collect();
                        // The lowest ids picked in linear time, only those
                        // sorted: a whole sort of each connection's set on
                        // the event loop, per request, stalled deliveries.
                        if listed.len() > SUBSCRIPTIONS_LISTED {
                            listed
                                .select_nth_unstable_by_key(SUBSCRIPTIONS_LISTED, |(&sid, _)| sid);
                            listed.truncate(SUBSCRIPTIONS_LISTED);
                        }
                        listed.sort_unstable_by_key(|(&sid, _)| sid);
                        listed
                            .into_iter()
                            .take(SUBSCRIPTIONS_LISTED)
                            .map(|(&sid, sub)| SubscriptionReport {
                                sid,
                                pattern: sub.pattern.clone(),
                                queue: sub.queue.clone(),
                                best_effort: sub.class == DeliveryClass::BestEffort,
                            })
                            .collect()
                    }
                    _ => Vec::new(),
                };
                let subscription_count = match &session.role {
                    Role::Client(subs) => subs.len(),
                    Role::Route(_) => 0,
                };
                ConnectionReport {
                    id,
                    kind: if session.route().is_some() {
                        ConnectionKind::Route
                    } else {
                        ConnectionKind::Client
                    },
                    name: session.name.clone(),
                    user: session.user.clone(),
                    remote: session.remote.clone(),
                    since: session.since,
                    ready: session.state == SessionState::Ready,
                    reliable: links
                        .reliable
                        .as_ref()
                        .map_or_else(|| control.to_string(), |link| link.description.clone()),
                    best_effort: links.best_effort_path(),
                    reasons: session.link_reasons.clone(),
                    counts: session.counts,
                    pending_bytes: session.conn.out.bytes() as u64,
                    subscription_count,
                    subscriptions,
                }
            })
            .collect();
        reports.sort_by_key(|report| report.id);
        reports
    }

    fn answer_flushes(&mut self) {
        if self.flushes.is_empty() {
            return;
        }
        // A flush answered sees the statistics of what it waited for.
        self.flush_tally();
        if self.sessions.values().all(|s| s.conn.out.is_empty()) {
            let delivered = self.published_total;
            self.flushes.retain(|flush| {
                let answered = flush.published <= delivered;
                if answered {
                    let _ = flush.done.send(());
                }
                !answered
            });
        }
    }

    fn handle_event(&mut self, endpoint: usize, event: Event) {
        match event {
            Event::Accepted { peer, remote } => self.on_accepted(endpoint, peer, remote),
            Event::Frame { peer, frame } => {
                if let Some(&id) = self.by_peer.get(&(endpoint, peer)) {
                    self.on_wire(id, endpoint, peer, frame);
                }
            }
            Event::Frames { peer, run } => {
                if let Some(&id) = self.by_peer.get(&(endpoint, peer)) {
                    for frame in split_run(&run) {
                        self.on_wire(id, endpoint, peer, frame.head);
                    }
                }
            }
            Event::Writable { peer } => {
                if let Some(&id) = self.by_peer.get(&(endpoint, peer)) {
                    self.flush_session(id);
                }
            }
            Event::ReadHeld { peer } => {
                // The peer's side of the link is up, its frame waiting
                // for the address's proof: ask for it now.
                if let Some(&id) = self.by_peer.get(&(endpoint, peer)) {
                    self.challenge_if_due(id);
                }
            }
            Event::Closed { peer, reason } => {
                let Some(id) = self.by_peer.remove(&(endpoint, peer)) else {
                    return;
                };
                let data_link = self
                    .sessions
                    .get(&id)
                    .is_some_and(|s| s.conn.control.endpoint != endpoint);
                if data_link {
                    // The data path failed under a live control link: end
                    // the session so the peer reconnects and renegotiates.
                    // With the reliable link gone, what is queued for it
                    // never drains: marked failed, the queue is counted
                    // and the error goes on the control link at once (a
                    // peer on `shm` or EFA sees no connection end).
                    let text = format!("data link lost: {reason}");
                    if let Some(session) = self.sessions.get_mut(&id) {
                        let links = &mut session.conn.links;
                        let reliable = links
                            .reliable
                            .as_ref()
                            .is_some_and(|link| link.endpoint == endpoint && link.peer == peer);
                        if reliable {
                            links.failure.get_or_insert_with(|| text.clone());
                        }
                    }
                    self.fail(id, ErrorCode::Internal, text);
                } else {
                    self.forget_session(id, &reason);
                }
            }
        }
    }

    fn on_accepted(&mut self, endpoint: usize, peer: PeerId, remote: String) {
        let now = Instant::now();
        let max_connections = self.shared.live.max_connections();
        let address = remote_ip(&remote);
        let handshaking = address.map_or(0, |ip| self.handshaking.get(&ip).copied().unwrap_or(0));
        let mut refuse = if self.shared.shutdown.load(Ordering::Relaxed) {
            Some((ErrorCode::Internal, "server is shutting down".to_string()))
        } else if self.sessions.len() >= max_connections {
            Some((
                ErrorCode::TooManyConnections,
                format!("connection limit of {max_connections} reached"),
            ))
        } else if handshaking >= self.shared.config.limits.max_handshakes_per_address {
            // One address cannot fill the connection slots with peers
            // that never say hello (each holds one for the handshake
            // timeout).
            Some((
                ErrorCode::TooManyConnections,
                format!("{handshaking} connections from this address are still in their handshake"),
            ))
        } else {
            address
                .and_then(|ip| self.auth_guard.lockout(ip, now))
                .map(|text| (ErrorCode::RateLimited, text))
        };
        let allowed = self.handshakes_allowed();
        if refuse.is_none() && address.is_some() && self.handshaking_total >= allowed {
            // Room is made by closing the silent peer waiting longest, but
            // not while publishers are held back: nobody's hello is read
            // then.
            if self.reads_paused || !self.close_longest_handshake(allowed) {
                refuse = Some((
                    ErrorCode::TooManyConnections,
                    format!("{allowed} connections are in their handshake"),
                ));
            }
        }
        if let Some((code, text)) = refuse {
            BrokerStats::add(&self.shared.stats.refused_connections, 1);
            // Anyone can open connections: the warning is rate-limited.
            if let Some(held_back) = self.refused_log.allow(Instant::now()) {
                warn!(%remote, %text, held_back, "connection refused");
            }
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
        let stats = &self.shared.stats;
        BrokerStats::add(&stats.connections, 1);
        BrokerStats::add(&stats.connections_total, 1);
        debug!(session = id, %remote, "accepted");
        self.by_peer.insert((endpoint, peer), id);
        let deadline = now + self.shared.config.handshake_timeout();
        let mut session = Session::new(
            Control { endpoint, peer },
            remote,
            self.liveness(now),
            deadline,
        );
        if let Some(ip) = address {
            *self.handshaking.entry(ip).or_default() += 1;
            self.handshaking_total += 1;
            self.publish_handshakes();
            self.awaiting_hello.push_back(id);
            session.handshaking_from = Some(ip);
        }
        // The first frame: what the peer proves a shared secret against.
        // Without randomness there is no challenge, and a proof cannot
        // check (the peer may still give a password or token).
        let challenge = crate::session::link_auth::random_bytes().ok();
        session.challenge = challenge;
        self.sessions.insert(id, session);
        if let Some(nonce) = challenge {
            let frame = Frame::Challenge(efabus_core::frame::Challenge { nonce });
            self.send(id, codec::encode(&frame), false);
        }
        self.schedule(deadline);
        if self.reads_paused {
            self.endpoints[endpoint].set_read_paused(peer, true);
        }
    }

    /// A message from one of a session's links: frames from the control
    /// link go straight to the session; data links pass through the link
    /// layer first.
    fn on_wire(&mut self, id: u64, endpoint: usize, peer: PeerId, bytes: Bytes) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if endpoint == session.conn.control.endpoint {
            self.on_frame(id, bytes);
            return;
        }
        let Some(kind) = session.conn.links.kind_of(endpoint, peer) else {
            return;
        };
        let closing = matches!(session.state, SessionState::Closing { .. });
        let mut released = std::mem::take(&mut self.released);
        let result = session
            .conn
            .links
            .receive(kind, self.now, bytes, &mut released);
        // Moving to the reliable link, this side first asks the peer to
        // have read what went on the control link.
        let control = session.conn.control;
        session
            .conn
            .links
            .send_barrier(&mut self.endpoints, control);
        let challenged = session.conn.links.challenge_due(kind);
        if challenged {
            // The peer has its side of this link up: ask it to show that
            // it receives at the address it gave.
            session
                .conn
                .links
                .send_challenges(&mut self.endpoints, Ask::First(kind));
        }
        // A gap this left is given up (best effort) or fails the link
        // (reliable) by time.
        let link = match kind {
            LinkKind::Reliable => session.conn.links.reliable.as_ref(),
            LinkKind::BestEffort => {
                // Saturating: a peer can claim any jump in its sequence.
                let lost = session.conn.links.take_best_effort_lost();
                self.tally.best_effort_lost = self.tally.best_effort_lost.saturating_add(lost);
                self.tally.bad_link_frames += session.conn.links.take_bad_link_frames();
                session.conn.links.best_effort.as_ref()
            }
        };
        if let Some(deadline) = link.and_then(|link| link.next_deadline()) {
            self.schedule(deadline);
        }
        self.credit_owed.insert(id);
        self.on_released(id, &mut released);
        self.released = released;
        // A credit may have made a datagram link opened again usable.
        self.begin_best_effort_switch(id);
        if self
            .sessions
            .get(&id)
            .is_some_and(|s| !s.conn.out.is_empty() || s.conn.links.best_effort_waiting())
        {
            // The message may have been a credit opening the window.
            self.flush_session(id);
        } else if closing {
            // Or the credit acknowledging the last of what it drains.
            self.close_if_drained(id);
        }
        if let Err(err) = result {
            if kind == LinkKind::Reliable {
                self.reliable_link_failed(id, &err);
            } else {
                debug!(session = id, error = %err, "best-effort link refused a message");
            }
        }
        if challenged {
            self.end_if_data_link_failed(id);
        }
    }

    /// Asks the peer of session `id` to prove the address of its reliable
    /// data link, where a frame it offers by rendezvous waits for that, if
    /// it was not asked yet.
    fn challenge_if_due(&mut self, id: u64) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if session.conn.links.challenge_due(LinkKind::Reliable) {
            session
                .conn
                .links
                .send_challenges(&mut self.endpoints, Ask::First(LinkKind::Reliable));
            self.end_if_data_link_failed(id);
        }
    }

    /// Ends the session whose reliable data link failed a send that
    /// nothing queued will come back to (a challenge's ping).
    fn end_if_data_link_failed(&mut self, id: u64) {
        if self
            .sessions
            .get(&id)
            .is_some_and(|session| session.conn.links.failure.is_some())
        {
            self.data_link_send_failed(id);
        }
    }

    /// The reliable data link refused what arrived, or a message on it went
    /// missing: nothing after it could be delivered in order, so the
    /// session ends (the peer reconnects). Counted once per session.
    fn reliable_link_failed(&mut self, id: u64, err: &LinkError) {
        if self
            .sessions
            .get(&id)
            .is_none_or(|session| matches!(session.state, SessionState::Closing { .. }))
        {
            return;
        }
        let stats = &self.shared.stats;
        let code = match err {
            LinkError::GapTimeout { .. } | LinkError::PartialTimeout { .. } => {
                BrokerStats::add(&stats.link_gap_failures, 1);
                ErrorCode::Internal
            }
            // The peer sent beyond the credit window it was granted.
            LinkError::MemoryBound { .. } => {
                BrokerStats::add(&stats.link_memory_refusals, 1);
                ErrorCode::Protocol
            }
            LinkError::SharedMemoryBound { .. } => {
                BrokerStats::add(&stats.link_memory_refusals, 1);
                ErrorCode::Internal
            }
            _ => {
                BrokerStats::add(&stats.bad_frames, 1);
                ErrorCode::Malformed
            }
        };
        if let Some(session) = self.sessions.get(&id) {
            if let Some(held_back) = self.link_failed_log.allow(self.now) {
                warn!(session = id, remote = %session.remote, error = %err, held_back, "reliable data link failed");
            }
        }
        self.fail(id, code, format!("data link: {err}"));
    }

    /// The frames of the messages a session's data link released, each
    /// read in place.
    fn on_released(&mut self, id: u64, released: &mut Vec<Bytes>) {
        for message in released.drain(..) {
            for frame in released_frames(&message) {
                self.tally.fabric_frames_in += 1;
                self.on_frame_in(id, &message, frame);
            }
        }
    }

    fn on_frame(&mut self, id: u64, frame: Bytes) {
        let whole = 0..frame.len();
        self.on_frame_in(id, &frame, whole);
    }

    /// The frame `message[range]`: a whole frame, or one of a run's.
    fn on_frame_in(&mut self, id: u64, message: &Bytes, range: Range<usize>) {
        let bytes = &message[range.clone()];
        // A frame kept behind a hello being checked was counted when it
        // came.
        if !self.replaying_deferred {
            self.tally.bytes_in += bytes.len() as u64;
        }
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        session.conn.liveness.heard(self.now);
        if matches!(session.state, SessionState::Closing { .. }) {
            // Nothing more is read, but the answers the data link's move
            // waits for, the barrier's and the address proof's (what waits
            // behind them is the closing session's to drain), and a
            // goodbye (the peer, closing too, acknowledges nothing more).
            match bytes.get(PREFIX_LEN).copied() {
                Some(kind) if kind == FrameKind::Pong as u8 => {
                    if let Ok(Frame::Pong { nonce }) =
                        codec::decode(message.slice(range), &self.codec)
                    {
                        self.on_pong(id, nonce);
                    }
                }
                Some(kind) if kind == FrameKind::Goodbye as u8 => {
                    self.peer_left(id);
                    self.close_if_drained(id);
                }
                _ => {}
            }
            return;
        }
        if session.checking_hello {
            // Behind a hello being checked: handled once it is.
            if session.deferred.len() >= DEFERRED_MAX {
                // Its check's verdict, when it comes, is for nobody.
                session.checking_hello = false;
                let text = format!("more than {DEFERRED_MAX} frames behind a hello being checked");
                self.fail(id, ErrorCode::Protocol, text);
            } else {
                session.deferred.push(message.slice(range));
            }
            return;
        }
        let kind = bytes.get(PREFIX_LEN).copied();
        if kind == Some(FrameKind::Publish as u8) || kind == Some(FrameKind::Message as u8) {
            session.counts.messages_in += 1;
            session.counts.bytes_in += bytes.len() as u64;
        }
        let route = session.route().is_some();
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
            match codec::peek_routed_known(bytes, &self.codec, &known) {
                Ok(Some(view)) if Some(view.kind) == in_place => {
                    let changed = !std::ptr::eq(view.subject, known.as_str());
                    if changed {
                        // Remember this subject, in the spare buffer.
                        self.spare_subject.clear();
                        self.spare_subject.push_str(view.subject);
                    }
                    let payload = Payload {
                        bytes: view.payload,
                        frame: message,
                        at: range.start + view.payload_at,
                        headers: view.headers,
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
        let frame = match codec::decode(message.slice(range), &self.codec) {
            Ok(frame) => frame,
            Err(err) => {
                BrokerStats::add(&stats.bad_frames, 1);
                warn!(session = id, remote = %session.remote, error = %err, "malformed frame");
                self.fail(id, ErrorCode::Malformed, format!("malformed frame: {err}"));
                return;
            }
        };
        // The session's kind handles its own frames first; what is left
        // is handled alike for every session.
        let state = session.state;
        let rest = match session.route() {
            Some(route) => {
                let up = route.is_up();
                self.on_route_frame(id, state, up, frame)
            }
            None => self.on_client_frame(id, state, frame),
        };
        let Some(frame) = rest else {
            return;
        };
        match (state, frame) {
            (SessionState::AwaitHello { .. }, other) => {
                self.fail(
                    id,
                    ErrorCode::Protocol,
                    format!("expected hello, got {}", FrameKind::of(&other)),
                );
            }
            (SessionState::Ready, Frame::Ping { nonce }) => self.answer_ping(id, nonce),
            (SessionState::Ready, Frame::Pong { nonce }) => self.on_pong(id, nonce),
            (
                SessionState::Ready,
                Frame::BestEffortClosed {
                    settled_through,
                    sent_through,
                    epoch,
                    reason,
                },
            ) => {
                let told = (settled_through, sent_through);
                self.best_effort_closed_by_peer(id, told, epoch, &reason)
            }
            (SessionState::Ready, Frame::BestEffortReopen { epoch }) => {
                self.best_effort_reopened_by_peer(id, epoch)
            }
            // A closing session opens nothing again.
            (SessionState::Closing { .. }, Frame::BestEffortReopen { .. }) => {}
            (_, Frame::Goodbye(goodbye)) => {
                debug!(session = id, reason = %goodbye.reason, "peer said goodbye");
                if goodbye.reason == route::DUPLICATE_ROUTE {
                    self.closed_as_duplicate(id);
                }
                self.peer_left(id);
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

    /// Whether a payload of `len` bytes is within `max_payload`; if not,
    /// the peer is told (the connection stays) and it is counted.
    fn payload_allowed(&mut self, id: u64, len: usize, max_payload: u64) -> bool {
        if len as u64 <= max_payload {
            return true;
        }
        BrokerStats::add(&self.shared.stats.oversized_payloads, 1);
        let text = format!("payload of {len} bytes exceeds the limit of {max_payload}");
        self.report(id, ErrorCode::PayloadTooLarge, text);
        false
    }

    fn on_publish(&mut self, id: u64, subject: &str, reply: Option<&str>, payload: Payload<'_>) {
        if let Some(restricted) = self.restricted.get(&id) {
            // An answer to a request delivered to this session is allowed
            // beside `allow`, never beside `deny`.
            let permissions = &restricted.permissions;
            let verdict = match permissions.publish_denied(subject) {
                Some(rule) => Err(rule),
                None if restricted.replies.contains(subject) => Ok(()),
                None => permissions.may_publish(subject),
            };
            if let Err(rule) = verdict {
                self.deny(id, "publish to", subject, &rule);
                return;
            }
            // A reply subject lets whoever answers publish to it: only
            // this session's own inbox, or what it may receive anyway and
            // is not another connection's inbox (an answer there would
            // reach that requester as if it had asked).
            if let Some(reply) = reply {
                let allowed = match inbox_of(reply).and_then(|inbox| self.inbox_holder(inbox)) {
                    Some(holder) => holder == id,
                    None => permissions.may_subscribe(reply).is_ok(),
                };
                if !allowed {
                    let rule = "a reply subject must be this connection's inbox or a subject \
                                it may subscribe to, not another connection's inbox";
                    self.deny(id, "publish with reply subject", reply, rule);
                    return;
                }
            }
        }
        let max_payload = self.shared.live.max_payload();
        if !self.payload_allowed(id, payload.counted_len(), max_payload) {
            return;
        }
        if let Err(err) = payload.check_headers() {
            self.report(id, ErrorCode::Malformed, format!("headers: {err}"));
            return;
        }
        // The lookup validates the subject (the index caches valid ones).
        let no_echo = self.sessions.get(&id).is_some_and(|s| s.no_echo);
        let matched = if no_echo {
            self.shared
                .subscriptions
                .read()
                .lookup_excluding(subject, id, &mut self.targets)
        } else {
            self.look_up(subject, None)
        };
        self.deliver_matched(id, subject, reply, payload, matched);
    }

    /// Looks `subject` up into `self.targets` for a client's publish
    /// (`route_sid` `None`) or for a message a route brought for the
    /// interest this broker announced as `route_sid`, from the answer kept
    /// for the last such subject while it holds.
    fn look_up(
        &mut self,
        subject: &str,
        route_sid: Option<u64>,
    ) -> Result<(), subject::SubjectError> {
        let kept = match route_sid {
            None => &mut self.last_route,
            Some(_) => &mut self.last_from_route,
        };
        let now_at = self.shared.generation.load(Ordering::Acquire);
        if kept.serves(subject, route_sid, now_at) {
            kept.fill(&mut self.targets);
            return Ok(());
        }
        let table = self.shared.subscriptions.read();
        // Read under the lock: it names the state looked up.
        let looked_up_at = self.shared.generation.load(Ordering::Acquire);
        let stable = match route_sid {
            None => table.lookup_stable(subject, &mut self.targets),
            Some(sid) => table.lookup_from_route(subject, sid, &mut self.targets),
        };
        drop(table);
        stable.map(|stable| kept.keep(subject, route_sid, looked_up_at, stable, &self.targets))
    }

    /// Deliver a message to the in-process subscriptions among
    /// `self.targets`.
    fn deliver_to_locals(&mut self, subject: &str, reply: Option<&str>, payload: Payload<'_>) {
        if self.targets.local.is_empty() {
            return;
        }
        let (headers, body) = payload.split();
        let message = MessageParts {
            subject,
            shared_subject: std::cell::OnceCell::new(),
            reply: reply.map(Arc::from),
            headers,
            payload: body,
        };
        deliver_local(
            &self.shared,
            &mut self.targets,
            message,
            &mut self.local_runs,
            &mut self.held_local,
            self.now,
        );
        if !self.held_local.is_empty() {
            // Publishers wait, as for a remote slow consumer.
            self.set_reads_paused(true);
        }
    }

    /// Deliver a message whose subscriptions were looked up into `self.targets`,
    /// or tell the peer why its subject or reply subject is invalid.
    fn deliver_matched(
        &mut self,
        id: u64,
        subject: &str,
        reply: Option<&str>,
        payload: Payload<'_>,
        matched: Result<(), subject::SubjectError>,
    ) {
        let shared = &self.shared;
        let valid = matched.and_then(|()| match reply {
            Some(reply) => subject::validate_subject(reply, &shared.subject_limits),
            None => Ok(()),
        });
        if let Err(err) = valid {
            BrokerStats::add(&self.shared.stats.invalid_publishes, 1);
            self.report(
                id,
                ErrorCode::InvalidSubject,
                format!("invalid subject {subject:?}: {err}"),
            );
            return;
        }
        self.tally.messages_in += 1;
        let no_responders = self.sessions.get(&id).is_some_and(|s| s.no_responders);
        if let (true, Some(reply)) = (no_responders, reply) {
            if self.targets.local.is_empty() && self.targets.remote.is_empty() {
                self.answer_no_responders(id, reply);
                return;
            }
        }
        self.deliver_to_locals(subject, reply, payload);
        self.encoded_valid = false;
        // By index: delivering needs `self`, and the list is not touched
        // until the next publish routes into it.
        for index in 0..self.targets.remote.len() {
            let target = self.targets.remote[index];
            self.deliver_remote(target, subject, reply, payload);
        }
        self.end_limited_subscriptions();
    }

    /// A message an in-process publisher picked a queue-group member for
    /// on its own thread, that member having left before this loop took
    /// the message: to the group's next member here instead (an
    /// in-process one gets it through this loop, so possibly after
    /// messages its publisher gave it directly later), or with none here
    /// over the route the group's next message would take; lost with the
    /// member, counted in `connection_drops`, when there is neither.
    fn deliver_to_group(
        &mut self,
        pattern: &str,
        queue: &str,
        subject: &str,
        reply: Option<&str>,
        payload: Payload<'_>,
    ) {
        let picked = self.shared.subscriptions.read().lookup_group(
            subject,
            pattern,
            queue,
            &mut self.targets,
        );
        if picked.is_err() || (self.targets.local.is_empty() && self.targets.remote.is_empty()) {
            BrokerStats::add(&self.shared.stats.connection_drops, 1);
            return;
        }
        self.deliver_to_locals(subject, reply, payload);
        for index in 0..self.targets.remote.len() {
            let target = self.targets.remote[index];
            self.deliver_remote(target, subject, reply, payload);
        }
    }

    /// A request that nothing matched, from a session that asked for it:
    /// a message with status 503 in its headers and no body goes to that
    /// session's own subscriptions on the reply subject (its inbox), and
    /// to no one else, whatever its echo setting.
    fn answer_no_responders(&mut self, id: u64, reply: &str) {
        let field = codec::join_headers(efabus_core::headers::NO_RESPONDERS, &[]);
        let matched = self
            .shared
            .subscriptions
            .read()
            .lookup(reply, &mut self.targets);
        if matched.is_err() {
            return;
        }
        self.targets.local.clear();
        self.targets.remote.retain(|target| target.owner == id);
        let payload = Payload {
            bytes: &field,
            frame: &field,
            at: 0,
            headers: true,
        };
        self.encoded_valid = false;
        for index in 0..self.targets.remote.len() {
            let target = self.targets.remote[index];
            self.deliver_remote(target, reply, None, payload);
        }
        self.encoded_valid = false;
        self.end_limited_subscriptions();
    }

    /// Deliver one message to a remote subscription. A reliable message
    /// is encoded straight into the peer's batch (payloads up to
    /// [`COPY_MAX`] copied in, larger ones shared behind their head), which
    /// a reliable data link carries as runs; a best-effort one goes alone
    /// on the datagram link.
    fn deliver_remote(
        &mut self,
        target: SubRef,
        subject: &str,
        reply: Option<&str>,
        payload: Payload<'_>,
    ) {
        // Requests to a restricted session may be answered (replies go to
        // inboxes only).
        if let (Some(reply), false) = (reply, self.restricted.is_empty()) {
            if inbox_of(reply).is_some() {
                if let Some(restricted) = self.restricted.get_mut(&target.owner) {
                    restricted.replies.remember(reply);
                }
            }
        }
        let Some(session) = self.sessions.get_mut(&target.owner) else {
            // Routed to a peer gone since (an in-process publisher's
            // message, its targets picked on its thread, that waited for
            // this loop): lost with that connection.
            BrokerStats::add(&self.shared.stats.connection_drops, 1);
            return;
        };
        let over_peer_limits = session
            .route()
            .and_then(|role| role.peer_limits)
            .filter(|limits| !limits.admit(subject, reply, payload.counted_len()));
        if let Some(limits) = over_peer_limits {
            self.keep_back_from_route(target.owner, &limits, subject, payload.counted_len());
            return;
        }
        // Most sessions have no limits: no lookup per delivery for them.
        if !session.limited.is_empty() {
            if let Some(limit) = session.limited.get_mut(&target.sid) {
                limit.delivered += 1;
                if limit.delivered >= limit.total {
                    session.limited.remove(&target.sid);
                    self.limits_reached.push(target);
                }
            }
        }
        self.tally.messages_out += 1;
        if session.route().is_some() {
            self.tally.route_messages_out += 1;
        }
        // A session cut off counts what is routed to it as dropped
        // (`enqueue`), not as delivered.
        if !session.cut_off {
            session.counts.messages_out += 1;
            session.counts.bytes_out += codec::routed_frame_len(
                FrameKind::Message,
                subject.len(),
                reply.map_or(0, str::len),
                payload.bytes.len(),
            ) as u64;
        }
        let links = &mut session.conn.links;
        // The class matters only where a datagram link exists.
        let best_effort = links.takes_best_effort()
            && session.class_of(target.sid) == Some(DeliveryClass::BestEffort);
        if !best_effort && payload.bytes.len() <= COPY_MAX {
            // The message is encoded once per publish and copied into each
            // peer's batch with that peer's subscription id.
            if !self.encoded_valid {
                self.encoded.clear();
                let encoded = codec::routed_into(
                    &mut self.encoded,
                    FrameKind::Message,
                    0,
                    payload.fields(subject, reply),
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
            let limit = session.conn.links.run_limit();
            let session = if session.batch.has_room(self.encoded.len(), limit) {
                session
            } else {
                self.close_batch(target.owner);
                let Some(session) = self.sessions.get_mut(&target.owner) else {
                    return;
                };
                session
            };
            if session.batch.push(&self.encoded, target.sid, limit) {
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
            payload.fields(subject, reply),
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
            let links = &mut session.conn.links;
            if !links.queue_best_effort(frame) {
                return;
            }
            self.tally.sent.fabric_frames_out += 1;
            self.tally.sent.credit_waits += links.pace_best_effort(&mut self.endpoints);
            let dropped = links.take_best_effort_drops();
            if dropped > 0 {
                BrokerStats::add(&self.shared.stats.best_effort_drops, dropped);
            }
            if links.best_effort_waiting() {
                // Credit normally comes back at once; if it was lost, the
                // timers try again.
                self.schedule(self.now + PACING_RETRY);
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
        let Some(queued) = self
            .sessions
            .get_mut(&id)
            .and_then(|session| session.batch.take())
        else {
            return;
        };
        self.enqueue(id, queued);
    }

    /// Queue a frame for a session, applying the slow-consumer policy when
    /// its queue is over the bound. The session's batch goes first.
    fn send(&mut self, id: u64, frame: OutFrame, is_message: bool) {
        self.close_batch(id);
        self.enqueue(id, Queued::frame(frame, is_message));
    }

    /// Answer a ping. On a route whose traffic is on a data link, the
    /// answer goes on the control link at once: the peer may be asking
    /// this broker to prove its data-link address, and grants that link
    /// credit only once it has, so the answer must not wait behind frames
    /// held for credit. Elsewhere it goes behind what was sent before.
    fn answer_ping(&mut self, id: u64, nonce: u64) {
        // The answer says that what was sent before the ping was handled:
        // delivered to in-process subscriptions too.
        self.queue_local_runs();
        let mut pong = codec::encode(&Frame::Pong { nonce });
        if let Some(session) = self.sessions.get(&id) {
            if session.route().is_some() && session.conn.links.in_use {
                let control = session.conn.control;
                match self.endpoints[control.endpoint].send(control.peer, pong) {
                    Err(SendError::WouldBlock(frame)) => pong = frame,
                    // Sent, or the link failed (which its poll reports).
                    _ => return,
                }
            }
            if self.route_reads_no_answers(session) {
                return;
            }
        }
        self.send(id, pong, false);
    }

    /// Whether `session` is a route whose control frames queued have
    /// passed the queue's bound. A route's control frames are not held to
    /// it (the interest announced to it may rightly pass it), so answers
    /// to what the peer sends (pongs, error reports) stop being queued
    /// then: a peer that sends and reads nothing must not grow its queue
    /// without end.
    fn route_reads_no_answers(&self, session: &Session) -> bool {
        session.route().is_some()
            && session.conn.out.control_bytes() > self.shared.live.max_pending_bytes()
    }

    /// Hand a frame or run to the session's path when nothing waits before
    /// it, else queue it; then apply the slow-consumer policy when the
    /// queue is over its bound.
    fn enqueue(&mut self, id: u64, queued: Queued) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if session.cut_off {
            if queued.messages > 0 {
                BrokerStats::add(&self.shared.stats.connection_drops, queued.messages as u64);
                session.counts.dropped += queued.messages as u64;
            }
            return;
        }
        let is_message = queued.messages > 0;
        let refused = self.tally.sent.refused_messages;
        let left_queued = session
            .conn
            .send(&mut self.endpoints, &mut self.tally.sent, queued);
        session.counts.dropped += self.tally.sent.refused_messages - refused;
        if session.conn.links.failure.is_some() {
            self.data_link_send_failed(id);
            return;
        }
        if left_queued || session.conn.links.has_backlog() {
            // The queued-bytes gauge is kept current while anything waits.
            self.next_timer = self.next_timer.min(self.now + GAUGE_REFRESH);
        }
        if left_queued
            && session.conn.links.held()
            && session.conn.out.bytes() > self.shared.live.max_pending_bytes()
            && session.conn.out.control_bytes() > self.shared.live.max_pending_bytes()
        {
            // Held for a proof that has not come, the queue is over its
            // bound with frames the slow-consumer policy does not trim
            // (answers to the peer's own pings): the peer is not receiving
            // where it said, or not reading its control link. Messages
            // over the bound are the policy's to handle: a burst published
            // before the proof comes back waits for it (block) or gives
            // way (drop-oldest) as any other.
            let text = if session.conn.links.only_barrier_holds() {
                // It is not reading what was sent: a slow consumer.
                BrokerStats::add(&self.shared.stats.slow_consumer_disconnects, 1);
                "the queue is full while the peer has not read its control link"
            } else {
                BrokerStats::add(&self.shared.stats.unproven_addresses, 1);
                "the queue for an unproven fabric address is full"
            };
            self.fail(id, ErrorCode::Protocol, text.to_string());
            return;
        }
        if left_queued
            && !is_message
            && session.route().is_none()
            && session.conn.out.control_bytes() > self.shared.live.max_pending_bytes()
        {
            // Answers to a client's own requests (pongs, errors), which no
            // policy trims, fill the queue: it sends but does not read. (A
            // route's control frames include the interest announced to it,
            // which may rightly pass the bound.)
            self.disconnect_slow(
                id,
                "peer reads none of the answers to its requests; disconnected",
                "the answers to your requests fill your queue: read them".to_string(),
            );
            return;
        }
        if !left_queued || !is_message {
            return;
        }
        let live = &self.shared.live;
        let bound = live.max_pending_bytes();
        // A client is told what is discarded for each of its subscriptions
        // (a route's peer broker counts nothing per subscription).
        // Only for subscriptions it still has: an id it dropped, whose
        // messages were still queued, is not kept for a report.
        let subscribed = match &session.role {
            Role::Client(subscriptions) => Some(subscriptions),
            Role::Route(_) => None,
        };
        let pending = &mut session.drops.pending;
        let overflow = session.conn.out.enforce(live.policy(), bound, |discarded| {
            if let Some(subscribed) = subscribed {
                discarded.for_each_sid(|sid| {
                    if subscribed.contains_key(&sid) {
                        *pending.entry(sid).or_default() += 1;
                    }
                });
            }
        });
        match overflow {
            Overflow::Within => {}
            Overflow::DroppedOldest(dropped) => {
                BrokerStats::add(&self.shared.stats.slow_consumer_drops, dropped);
                session.counts.dropped += dropped;
                if let Some(at) = session.drops.due_at() {
                    // Reported once the queue has room again (see
                    // `report_drops`); the timers look no later than this.
                    let at = at.max(self.now);
                    self.schedule(at);
                }
            }
            Overflow::Disconnect => self.disconnect_slow(
                id,
                "slow consumer disconnected",
                format!("more than {bound} bytes queued"),
            ),
            Overflow::Block => {
                if session.over_since.is_none() {
                    let now = Instant::now();
                    session.over_since = Some(now);
                    self.next_timer = self.next_timer.min(now + live.block_timeout());
                }
                if self.blocking.insert(id) && self.reads_paused {
                    // Paused already (for others): a slow consumer itself
                    // keeps being read.
                    let control = session.conn.control;
                    self.endpoints[control.endpoint].set_read_paused(control.peer, false);
                }
                self.set_reads_paused(true);
            }
        }
    }

    /// Send the credits that are due. While publishers are held back under
    /// the block policy, their data links get none: the credit window then
    /// stops them as a paused socket stops TCP publishers. A closing
    /// session gets none either: a credit acknowledges what arrived, and
    /// it drops what arrives, which its peer must count as not delivered.
    /// True when a credit that is not held back is still owed (it waits
    /// for [`CREDIT_DELAY`] to pass).
    fn grant_credits(&mut self, now: Instant) -> bool {
        let mut owed = std::mem::take(&mut self.credit_owed);
        let mut waiting = false;
        owed.retain(|id| {
            let Some(session) = self.sessions.get_mut(id) else {
                return false;
            };
            if matches!(session.state, SessionState::Closing { .. }) {
                return false;
            }
            let held = self.reads_paused && !self.blocking.contains(id);
            if held {
                return session.conn.links.owe_credit();
            }
            let still_owed = session.conn.links.grant_credits(&mut self.endpoints, now);
            waiting |= still_owed;
            still_owed
        });
        self.credit_owed = owed;
        waiting
    }

    /// Read publishers again once nothing holds them up: no slow consumer
    /// blocking, no message held for an in-process subscription.
    fn release_reads(&mut self) {
        if self.blocking.is_empty() && self.held_local.is_empty() {
            self.set_reads_paused(false);
        }
    }

    /// Session `id` is no longer a slow consumer holding publishers up.
    /// While others still do, it is a publisher held up like the rest.
    fn leave_blocking(&mut self, id: u64) {
        if !self.blocking.remove(&id) {
            return;
        }
        self.release_reads();
        if self.reads_paused {
            if let Some(session) = self.sessions.get(&id) {
                let control = session.conn.control;
                self.endpoints[control.endpoint].set_read_paused(control.peer, true);
            }
        }
    }

    fn set_reads_paused(&mut self, paused: bool) {
        if self.reads_paused == paused {
            return;
        }
        self.reads_paused = paused;
        let handshake = self.now + self.shared.config.handshake_timeout();
        for (id, session) in &mut self.sessions {
            // The slow consumers themselves keep being read: they may
            // only be acknowledging or saying goodbye. A hello being
            // checked keeps its peer unread until its verdict.
            if !self.blocking.contains(id) && (paused || !session.checking_hello) {
                let control = session.conn.control;
                self.endpoints[control.endpoint].set_read_paused(control.peer, paused);
                // A handshake left unread gets its whole time once read.
                if !paused {
                    session.extend_handshake(handshake);
                }
            }
        }
    }

    /// Hand queued frames to the endpoint until it pushes back.
    fn flush_session(&mut self, id: u64) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let before = session.conn.out.bytes();
        let control = session.conn.control;
        session
            .conn
            .links
            .send_barrier(&mut self.endpoints, control);
        let refused = self.tally.sent.refused_messages;
        let empty = session
            .conn
            .flush(&mut self.endpoints, &mut self.tally.sent);
        session.counts.dropped += self.tally.sent.refused_messages - refused;
        let dropped = session.conn.links.take_best_effort_drops();
        if dropped > 0 {
            BrokerStats::add(&self.shared.stats.best_effort_drops, dropped);
        }
        if session.conn.links.failure.is_some() {
            self.data_link_send_failed(id);
            return;
        }
        let bound = self.shared.live.max_pending_bytes();
        let drained = session.conn.out.bytes() <= bound / 2;
        if drained {
            session.over_since = None;
        } else if session.over_since.is_some() && session.conn.out.bytes() < before {
            // It takes messages, if slowly: the block timeout counts from
            // its last progress, not from when it first fell behind.
            session.over_since = Some(Instant::now());
        }
        let report = drained && session.drops.due_at().is_some();
        if empty && matches!(session.state, SessionState::Closing { .. }) {
            self.close_if_drained(id);
        }
        if drained {
            self.leave_blocking(id);
        }
        if report {
            self.report_drops(id, Instant::now());
        }
        self.answer_flushes();
    }

    /// Tell a client what the drop-oldest policy discarded for its
    /// subscriptions since the last report: one `Dropped` frame per
    /// subscription, at most every [`DROP_REPORT_SPACING`] per session
    /// (drops in between are added up), and only while the session's queue
    /// is at most half its bound. A report is not a message, so the policy
    /// never discards it; and as it is only sent into a queue with room,
    /// reports do not pile up behind a reader that takes nothing (they
    /// wait, added up, until it takes again: [`Self::flush_session`] calls
    /// here once the queue drains).
    fn report_drops(&mut self, id: u64, now: Instant) {
        let bound = self.shared.live.max_pending_bytes();
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some(at) = session.drops.due_at() else {
            return;
        };
        if session.state != SessionState::Ready || session.cut_off {
            return;
        }
        if now < at {
            self.schedule(at);
            return;
        }
        if session.conn.out.bytes() > bound / 2 {
            return;
        }
        session.drops.not_before = now + DROP_REPORT_SPACING;
        let pending = std::mem::take(&mut session.drops.pending);
        for (sid, count) in pending {
            let report = Frame::Dropped(Dropped { sid, count });
            self.send(id, codec::encode(&report), false);
        }
    }

    /// Report a non-fatal error to the peer.
    fn report(&mut self, id: u64, code: ErrorCode, text: String) {
        if self
            .sessions
            .get(&id)
            .is_some_and(|session| self.route_reads_no_answers(session))
        {
            debug!(session = id, ?code, %text, "error report to a route not reading them dropped");
            return;
        }
        debug!(session = id, ?code, %text, "error reported to peer");
        let frame = error_frame(code, text, false);
        self.send(id, frame, false);
    }

    /// A send on the session's reliable data link failed part-way: the
    /// peer would wait for the lost frame, and nothing may follow it. The
    /// session ends at once (what it had queued is lost, as across any lost
    /// connection); the peer reconnects.
    fn data_link_send_failed(&mut self, id: u64) {
        let Some(session) = self.sessions.get(&id) else {
            return;
        };
        if matches!(session.state, SessionState::Closing { .. }) {
            return;
        }
        let reason = session.conn.links.failure.clone().unwrap_or_default();
        BrokerStats::add(&self.shared.stats.link_send_failures, 1);
        if let Some(held_back) = self.link_failed_log.allow(self.now) {
            warn!(session = id, remote = %session.remote, %reason, held_back, "reliable data link send failed");
        }
        self.fail(
            id,
            ErrorCode::Internal,
            format!("data link send failed: {reason}"),
        );
    }

    /// Report a fatal error, then close the session once it is flushed.
    fn fail(&mut self, id: u64, code: ErrorCode, text: String) {
        let Some(session) = self.sessions.get(&id) else {
            return;
        };
        if let Some(held_back) = self.closing_log.allow(self.now) {
            info!(session = id, remote = %session.remote, ?code, %text, held_back, "closing peer");
        }
        let frame = error_frame(code, text, true);
        // A queue behind a failed data link never drains, nor does one
        // held for a data link whose address was never proven (one held
        // for the barrier alone goes once the peer has read its control
        // link, which a closing session still hears).
        let links = &session.conn.links;
        let path_broken = links.failure.is_some() || links.held() && !links.only_barrier_holds();
        if code == ErrorCode::SlowConsumer || path_broken {
            // A slow consumer's queue would never drain either: drop it and
            // say why on the control link, where nothing waits for the
            // peer's credit, then close at once.
            if let Some(session) = self.sessions.get_mut(&id) {
                session.cut_off = true;
                session.over_since = None;
                let discarded = session.conn.out.messages() + session.batch.messages();
                BrokerStats::add(&self.shared.stats.connection_drops, discarded);
                session.counts.dropped += discarded;
                session.conn.out.clear();
                session.batch.clear();
                let control = session.conn.control;
                let _ = self.endpoints[control.endpoint].send(control.peer, frame);
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
        session.state = SessionState::Closing {
            deadline: self.now + self.shared.config.drain_timeout(),
        };
        self.end_handshake(id);
        self.remove_interest(id);
        self.close_if_drained(id);
    }

    /// Closes a closing session's control link once nothing is queued for
    /// it and the peer has acknowledged what its reliable data link
    /// carried (the goodbye or error among it, often): the peer ends its
    /// side when the control link closes, and frames still on their way
    /// on the fabric would be lost. Not for a session cut off or whose
    /// data link failed, which acknowledges nothing more.
    fn close_if_drained(&mut self, id: u64) {
        let Some(session) = self
            .sessions
            .get(&id)
            .filter(|s| matches!(s.state, SessionState::Closing { .. }) && s.conn.out.is_empty())
        else {
            return;
        };
        let links = &session.conn.links;
        if session.cut_off
            || session.peer_left
            || links.failure.is_some()
            || links.unacknowledged_frames() == 0
        {
            let control = session.conn.control;
            self.endpoints[control.endpoint].close(control.peer);
        }
    }

    /// The peer of session `id` said goodbye: it acknowledges nothing
    /// more, so its session's drain does not wait for that.
    fn peer_left(&mut self, id: u64) {
        if let Some(session) = self.sessions.get_mut(&id) {
            session.peer_left = true;
        }
    }

    fn remove_interest(&mut self, id: u64) {
        self.route_gone(id);
        if let Some(session) = self.sessions.get_mut(&id) {
            if let Role::Client(subscriptions) = &mut session.role {
                if !subscriptions.is_empty() {
                    // No more are kept than the bound.
                    let grouped = subscriptions.iter().filter(|(_, sub)| sub.queue.is_some());
                    for (&sid, sub) in grouped.take(DEPARTED_MAX) {
                        self.departed
                            .record(SubRef { owner: id, sid }, sub, self.now);
                    }
                    subscriptions.clear();
                    self.shared.subscriptions.write().remove_owner(id);
                }
            }
        }
        self.leave_blocking(id);
    }

    /// An endpoint's poll failed. A fabric endpoint is taken out of
    /// service: it is offered to no new peer, and the sessions with a data
    /// link on it end, so their peers reconnect onto what still works (a
    /// data link that can no longer be polled would lose what it carries
    /// without a word). Other endpoints report the error, at most once a
    /// second.
    fn endpoint_failed(&mut self, index: usize, err: &TransportError) {
        let scheme = self.endpoints[index].scheme().to_string();
        if self.listener_down.get(index) == Some(&false) {
            self.mark_listener(index, Some(err.to_string()));
        }
        if !endpoints::is_data_scheme(&scheme) {
            if let Some(held_back) = self.poll_error_log.allow(self.now) {
                warn!(%scheme, error = %err, held_back, "endpoint poll failed");
            }
            return;
        }
        if self.offers.iter().any(|offer| offer.scheme == scheme) {
            error!(%scheme, error = %err, "fabric endpoint failed; new peers stay off it");
            self.offers.retain(|offer| offer.scheme != scheme);
        }
        let affected: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.conn.links.addresses().any(|(e, _)| e == index))
            .map(|(&id, _)| id)
            .collect();
        for id in affected {
            let reason = format!("the broker's {scheme} endpoint failed: {err}");
            if let Some(session) = self.sessions.get_mut(&id) {
                let links = &mut session.conn.links;
                // Its reliable link carries nothing more: what is queued
                // for it is dropped (counted), not waited for.
                if links.reliable.as_ref().is_some_and(|l| l.endpoint == index) {
                    links.failure.get_or_insert_with(|| reason.clone());
                }
            }
            self.fail(id, ErrorCode::Internal, reason);
        }
    }

    /// Records whether listener `index` (if it is one) is out of service.
    fn mark_listener(&mut self, index: usize, failure: Option<String>) {
        let Some(down) = self.listener_down.get_mut(index) else {
            return;
        };
        *down = failure.is_some();
        if let Some(slot) = self.shared.listener_failures.lock().get_mut(index) {
            *slot = failure;
        }
    }

    /// A listener whose poll had failed polled again. A fabric endpoint
    /// stays out of service (its sessions ended and new peers are not
    /// offered it); another is up again.
    fn listener_recovered(&mut self, index: usize) {
        if !endpoints::is_data_scheme(self.endpoints[index].scheme()) {
            if let Some(held_back) = self.poll_error_log.allow(self.now) {
                let scheme = self.endpoints[index].scheme();
                info!(%scheme, held_back, "endpoint polls again");
            }
            self.mark_listener(index, None);
        }
    }

    /// The best-effort link of a route this broker dialed, until the
    /// peer's first credit: its ping sent again, or the link given up alone
    /// after the handshake timeout (see [`DataLinks::tend_best_effort`]).
    ///
    /// [`DataLinks::tend_best_effort`]: crate::session::data_link::DataLinks::tend_best_effort
    pub(super) fn tend_best_effort_link(&mut self, id: u64, now: Instant) {
        let heartbeat = self.shared.config.heartbeat_interval();
        let give_up_after = self.shared.config.handshake_timeout();
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let links = &mut session.conn.links;
        let Some(closed) =
            links.tend_best_effort(&mut self.endpoints, now, heartbeat, give_up_after)
        else {
            if let Some(at) = links.best_effort_due(now, give_up_after) {
                self.schedule(at);
            }
            return;
        };
        let reason = format!(
            "best-effort: {}: no credit came back there within {give_up_after:?} of its first \
             ping; carried on the reliable link",
            closed.description
        );
        self.data_link_closed_alone(id, closed, reason);
    }

    /// Session `id`'s datagram link, its frames unconfirmed for a while:
    /// pinged for a credit, or given up once pings went unanswered (see
    /// [`DataLinks::probe_best_effort`]).
    ///
    /// [`DataLinks::probe_best_effort`]: crate::session::data_link::DataLinks::probe_best_effort
    fn probe_best_effort_link(&mut self, id: u64, now: Instant) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        // A peer whose loop is held up answers late: half its heartbeat
        // timeout is given it.
        let give_up_after = self.shared.config.heartbeat_timeout() / 2;
        let links = &mut session.conn.links;
        let Some(closed) = links.probe_best_effort(&mut self.endpoints, now, give_up_after) else {
            if let Some(at) = links.best_effort_probe_at() {
                self.schedule(at);
            }
            return;
        };
        let reason = format!(
            "best-effort: {}: {MAX_PROBES} pings there went unanswered; what it sent \
             there is the peer's to count as lost, the rest carried on the reliable link",
            closed.description
        );
        self.data_link_closed_alone(id, closed, reason);
    }

    /// The data links session `id`'s peer was welcomed onto and never sent
    /// on within the handshake timeout: closed (see
    /// [`DataLinks::unused_deadline`]), each with the reason.
    ///
    /// [`DataLinks::unused_deadline`]: crate::session::data_link::DataLinks::unused_deadline
    fn close_unused_links(&mut self, id: u64) {
        let timeout = self.shared.config.handshake_timeout();
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        for closed in session.conn.links.close_unused(&mut self.endpoints) {
            let instead = match closed.kind {
                LinkKind::Reliable => "the control link",
                LinkKind::BestEffort => "the reliable path",
            };
            let reason = format!(
                "{}: the peer never sent there within {timeout:?} of its opening; carried on \
                 {instead}",
                closed.description
            );
            self.data_link_closed_alone(id, closed, reason);
        }
    }

    /// Session `id` closed one of its data links alone, for `reason`: what
    /// was lost with it counted, the reason logged and reported. A
    /// datagram link's peer is told, so that it closes its side too (it
    /// would go on sending there, to an address this side forgot).
    fn data_link_closed_alone(&mut self, id: u64, closed: Closed, reason: String) {
        if closed.kind == LinkKind::BestEffort {
            let epoch = self
                .sessions
                .get(&id)
                .map_or(0, |session| session.conn.links.best_effort_epoch());
            let notice = Frame::best_effort_closed(
                closed.settled_through,
                closed.sent_through,
                epoch,
                reason.clone(),
            );
            self.send(id, codec::encode(&notice), false);
            if let Some(nonce) = closed.notice_ping {
                // Its pong shows the peer read the notice (`GivenUp`).
                self.send(id, codec::encode(&Frame::Ping { nonce }), false);
            }
        }
        self.forget_closed_link(id, closed, reason);
    }

    /// The peer of session `id` closed its side of the datagram link of
    /// `epoch`, saying `why` and that it settled what this side sent there
    /// up to one sequence and sent up to another (`told`): this side's is
    /// closed too (what it sent beyond the first counted as dropped, what
    /// it lacks of the peer's up to the second as lost), and best effort
    /// goes on the reliable link. A notice for an earlier epoch's link
    /// closes nothing.
    fn best_effort_closed_by_peer(&mut self, id: u64, told: (u64, u64), epoch: u32, why: &str) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let (settled_through, sent_through) = told;
        // A client sends no best effort: a claim to have sent some would
        // only inflate the losses counted here.
        let sent_through = if session.is_route() { sent_through } else { 0 };
        let links = &mut session.conn.links;
        // Closed here already, this side telling the peer: both sides gave
        // it up at once (this side may have opened another since).
        let late = links.late_notice(epoch, settled_through);
        if late > 0 {
            BrokerStats::add(&self.shared.stats.best_effort_drops, late);
        }
        if epoch != links.best_effort_epoch() {
            return;
        }
        let told = GiveUp::Told {
            settled_through,
            sent_through,
        };
        let Some(closed) = links.give_up_best_effort(&mut self.endpoints, told) else {
            return;
        };
        let reason = format!(
            "best-effort: {}: the peer closed it ({why}); carried on the reliable link",
            closed.description
        );
        self.forget_closed_link(id, closed, reason);
    }

    /// A route this broker dialed, its datagram link given up a while ago
    /// ([`DataLinks::reopen_due`]): the link opens again and the peer is
    /// asked to open its side; the link then proves itself, or is given up
    /// again, as after the handshake.
    ///
    /// [`DataLinks::reopen_due`]: crate::session::data_link::DataLinks::reopen_due
    fn reopen_best_effort_link(&mut self, id: u64, now: Instant) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let in_service = in_service(&self.listener_down);
        let reopened = session
            .conn
            .links
            .reopen_best_effort(&mut self.endpoints, in_service, now);
        if let Ok(epoch) = reopened {
            let ask = Frame::BestEffortReopen { epoch };
            self.send(id, codec::encode(&ask), false);
        }
        self.after_reopening(id, reopened);
    }

    /// Session `id`'s datagram link opened again in the epoch `reopened`
    /// names (reported), or not, for the reason it gives (logged); its
    /// timers are due again either way.
    fn after_reopening(&mut self, id: u64, reopened: Result<u32, String>) {
        match reopened {
            Ok(epoch) => self.data_link_reopened(id, epoch),
            Err(why) => debug!(session = id, %why, "datagram link not opened again"),
        }
        self.schedule_best_effort_timers(id);
    }

    /// Wakes the loop for what session `id`'s datagram link has due by
    /// time once changed outside the timer scan: a link opened again (its
    /// first ping, or its close if the peer never sends there), a switch
    /// begun (its pong's deadline), a link given up (its reopening).
    fn schedule_best_effort_timers(&mut self, id: u64) {
        let Some(session) = self.sessions.get(&id) else {
            return;
        };
        let links = &session.conn.links;
        let handshake_timeout = self.shared.config.handshake_timeout();
        let due = [
            links.best_effort_due(self.now, handshake_timeout),
            links.switch_deadline(self.shared.config.heartbeat_timeout()),
            links.reopen_due(handshake_timeout),
            links.unused_deadline(handshake_timeout),
        ]
        .into_iter()
        .flatten()
        .min();
        if let Some(at) = due {
            self.schedule(at);
        }
    }

    /// The peer of session `id` opened its datagram link again, in
    /// `epoch`: this side's opens too, and asks the peer's address for its
    /// proof. Refused (see [`DataLinks::admit_reopen`]) it stays as it is:
    /// the peer, credited nothing, gives its side up again.
    ///
    /// [`DataLinks::admit_reopen`]: crate::session::data_link::DataLinks::admit_reopen
    fn best_effort_reopened_by_peer(&mut self, id: u64, epoch: u32) {
        let now = self.now;
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if let Err(why) = session.conn.links.admit_reopen(Some(epoch), now) {
            debug!(session = id, %why, "peer's datagram link not opened again");
            return;
        }
        // A side still open here is the peer's old one, given up.
        if let Some(closed) = session
            .conn
            .links
            .give_up_best_effort(&mut self.endpoints, GiveUp::Alone)
        {
            let reason = format!(
                "best-effort: {}: the peer opened it again",
                closed.description
            );
            self.forget_closed_link(id, closed, reason);
        }
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let in_service = in_service(&self.listener_down);
        let reopened = session
            .conn
            .links
            .open_again(&mut self.endpoints, in_service, epoch, now)
            .map(|()| epoch);
        self.after_reopening(id, reopened);
    }

    /// Session `id`'s datagram link opened again: its address is the
    /// session's, and its reports say so.
    fn data_link_reopened(&mut self, id: u64, epoch: u32) {
        let Some(link) = self
            .sessions
            .get(&id)
            .and_then(|session| session.conn.links.best_effort.as_ref())
        else {
            return;
        };
        self.by_peer.insert((link.endpoint, link.peer), id);
        BrokerStats::add(&self.shared.stats.datagram_links_reopened, 1);
        let reason = format!(
            "best-effort: {}: opened again (epoch {epoch})",
            link.description
        );
        if let Some(held_back) = self.link_reopened_log.allow(self.now) {
            info!(session = id, %reason, held_back, "datagram link opened again");
        }
        self.report_links_changed(id, reason);
    }

    /// Session `id`'s datagram link, opened again, has become usable:
    /// a `Ping` goes the reliable way behind all that best effort sent
    /// there meanwhile (this round's batch too), and best effort waits on
    /// the link for its `Pong` (see [`Switch`]).
    ///
    /// [`Switch`]: crate::session::data_link::Switch
    fn begin_best_effort_switch(&mut self, id: u64) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some(nonce) = session.conn.links.switch_due(self.now) else {
            return;
        };
        // Its reports name the link as the best-effort path from now on.
        if let Some(report) = self.shared.routes.lock().get_mut(&id) {
            let control = self.endpoints[session.conn.control.endpoint].scheme();
            set_route_paths(report, session, control);
        }
        self.send(id, codec::encode(&Frame::Ping { nonce }), false);
        self.schedule_best_effort_timers(id);
    }

    /// Session `id`'s datagram link, opened again, whose switch's `Pong`
    /// did not come within `timeout`: given up, what waited on it going
    /// the reliable way behind the ping; it opens again later.
    fn give_up_unswitched_link(&mut self, id: u64, timeout: Duration) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some(closed) = session
            .conn
            .links
            .give_up_best_effort(&mut self.endpoints, GiveUp::Telling)
        else {
            return;
        };
        let reason = format!(
            "best-effort: {}: the peer did not answer the ping before the move onto it \
             within {timeout:?}; carried on the reliable link",
            closed.description
        );
        self.data_link_closed_alone(id, closed, reason);
    }

    /// What [`Self::data_link_closed_alone`] does on this side.
    fn forget_closed_link(&mut self, id: u64, closed: Closed, reason: String) {
        // What waited on it for its proof or credit goes the reliable way.
        for frame in closed.waiting {
            self.send(id, frame, true);
        }
        // Its closing, reported later, is not the session's loss.
        self.by_peer.remove(&closed.address);
        if closed.kind == LinkKind::BestEffort {
            BrokerStats::add(&self.shared.stats.datagram_links_given_up, 1);
        }
        self.tally.best_effort_lost = self.tally.best_effort_lost.saturating_add(closed.lost);
        BrokerStats::add(&self.shared.stats.best_effort_drops, closed.unsent);
        if let Some(held_back) = self.link_closed_log.allow(self.now) {
            warn!(session = id, %reason, held_back, "data link closed alone");
        }
        self.report_links_changed(id, reason);
        self.schedule_best_effort_timers(id);
    }

    /// Session `id` gave a data link up or opened one again: `reason`
    /// goes into its connection report, and its route's shows the links
    /// it has now.
    fn report_links_changed(&mut self, id: u64, reason: String) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if let Some(report) = self.shared.routes.lock().get_mut(&id) {
            let control = self.endpoints[session.conn.control.endpoint].scheme();
            set_route_paths(report, session, control);
            push_reason(&mut report.reasons, reason.clone());
        }
        push_reason(&mut session.link_reasons, reason);
    }

    /// A `Pong` that may answer a data link's challenge: the peer receives
    /// at that address, which is now this session's alone. An older
    /// session that held the same address (the same client, reconnected)
    /// ends. Or the barrier's ping, a datagram link's probe or switch, or
    /// the ping behind a `best-effort closed` notice. A closing session
    /// hears these too: what waits behind them is its to drain.
    fn on_pong(&mut self, id: u64, nonce: u64) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        session.conn.links.on_probe_pong(nonce, self.now);
        session.conn.links.on_notice_pong(nonce);
        if session.conn.links.on_switch_pong(nonce) {
            // What waited on the datagram link for the switch goes now.
            self.flush_session(id);
            return;
        }
        let barrier_passed = session.conn.links.on_barrier_pong(nonce);
        let proven = session.conn.links.on_pong(nonce, &mut self.endpoints);
        if proven.is_empty() && !barrier_passed {
            return;
        }
        self.begin_best_effort_switch(id);
        debug!(
            session = id,
            links = proven.len(),
            "data link address proven"
        );
        for key in proven {
            match self.fabric_owners.insert(key, id) {
                Some(older) if older != id && self.sessions.contains_key(&older) => {
                    info!(
                        session = older,
                        newer = id,
                        "a newer session took over this fabric address"
                    );
                    self.fail(
                        older,
                        ErrorCode::Protocol,
                        "a newer session of this peer took over its fabric address".to_string(),
                    );
                }
                _ => {}
            }
        }
        // Frames queued meanwhile, and credits, may go over the data link now.
        self.credit_owed.insert(id);
        self.flush_session(id);
    }

    fn forget_session(&mut self, id: u64, reason: &CloseReason) {
        self.end_handshake(id);
        self.remove_interest(id);
        self.dialed_session_gone(id, reason);
        if let Some(restricted) = self.restricted.remove(&id) {
            for subscribe in &restricted.awaits_inbox {
                if let Some(inbox) = crate::accounts::inbox_of(&subscribe.pattern) {
                    self.forget_waiter(id, inbox);
                }
            }
        }
        self.release_inboxes_of(id);
        if let Some(mut session) = self.sessions.remove(&id) {
            self.count_discarded(&session);
            for address in session.conn.links.addresses() {
                self.by_peer.remove(&address);
            }
            for (endpoint, address) in session.conn.links.proven_addresses() {
                let key = (endpoint, address.to_vec());
                if self.fabric_owners.get(&key) == Some(&id) {
                    self.fabric_owners.remove(&key);
                }
            }
            let lost = session.conn.links.close(&mut self.endpoints);
            BrokerStats::add_saturating(&self.shared.stats.best_effort_lost, lost);
            self.shared
                .stats
                .connections
                .fetch_sub(1, Ordering::Relaxed);
            // A dial that never became a route is the peer broker still
            // being down: its first failure and its recovery are logged
            // (`dial_failed`, "route up"), not every attempt.
            let dial_attempt = session.state != SessionState::Ready
                && session.route().is_some_and(|route| route.dialed());
            if dial_attempt {
                debug!(session = id, remote = %session.remote, %reason, "dial attempt ended");
            } else {
                info!(session = id, remote = %session.remote, name = %session.name, %reason, "peer gone");
            }
        }
        self.answer_flushes();
    }

    /// Count the messages still queued for a session that is going away:
    /// they are discarded with it.
    fn count_discarded(&self, session: &Session) {
        let discarded = session.conn.out.messages() + session.batch.messages();
        if discarded > 0 {
            BrokerStats::add(&self.shared.stats.connection_drops, discarded);
        }
        let unsent = session.conn.links.best_effort_unsent_frames();
        if unsent > 0 {
            BrokerStats::add(&self.shared.stats.best_effort_drops, unsent);
        }
        let links = &session.conn.links;
        let unacknowledged = links.unacknowledged_frames()
            + links.best_effort_unconfirmed_frames()
            + links.unread_notice_frames();
        if unacknowledged > 0 {
            BrokerStats::add(&self.shared.stats.unacknowledged_at_close, unacknowledged);
        }
    }

    /// Heartbeat settings for a new session: the broker pings each
    /// interval whatever it hears.
    fn liveness(&self, now: Instant) -> Liveness {
        let config = &self.shared.config;
        Liveness::new(
            now,
            config.heartbeat_interval(),
            config.heartbeat_timeout(),
            false,
        )
    }

    /// A session finished its handshake: its timers change from the
    /// handshake deadline to its heartbeats.
    fn session_ready(&mut self, id: u64) {
        self.end_handshake(id);
        let block_timeout = self.shared.live.block_timeout();
        let deadline = self
            .sessions
            .get(&id)
            .and_then(|session| session.poll_timeout(block_timeout));
        if let Some(deadline) = deadline {
            self.schedule(deadline);
        }
    }

    /// Connections in their handshake at most, all addresses together:
    /// `limits.max_handshakes`, and never more than half the connection
    /// slots (`max_connections` may be lowered by a reload), so silent
    /// connections cannot fill them all.
    fn handshakes_allowed(&self) -> usize {
        let half = self.shared.live.max_connections() / 2;
        self.shared.config.limits.max_handshakes.min(half).max(1)
    }

    /// [`Self::handshakes_allowed`] reached: the session accepted longest
    /// ago that still waits for its hello is closed, so a peer that says
    /// hello at once gets in. One whose hello is being checked has said
    /// it, and is left alone. False when none could be closed.
    fn close_longest_handshake(&mut self, allowed: usize) -> bool {
        while let Some(id) = self.awaiting_hello.pop_front() {
            let Some(session) = self.sessions.get(&id) else {
                continue;
            };
            if session.handshaking_from.is_none() || session.checking_hello {
                continue;
            }
            BrokerStats::add(&self.shared.stats.refused_connections, 1);
            if let Some(held_back) = self.refused_log.allow(self.now) {
                warn!(remote = %session.remote, held_back, "connection in its handshake closed to make room");
            }
            let text = format!(
                "{allowed} connections are in their handshake (limits.max_handshakes); this \
                 one, waiting longest for its hello, makes room"
            );
            self.fail(id, ErrorCode::HandshakeTimeout, text);
            return true;
        }
        false
    }

    /// The connections in their handshake now, in the statistics.
    fn publish_handshakes(&self) {
        let handshakes = &self.shared.stats.handshakes;
        handshakes.store(self.handshaking_total as u64, Ordering::Relaxed);
    }

    /// Session `id` is no longer in its handshake: its address counts it
    /// no more.
    fn end_handshake(&mut self, id: u64) {
        let Some(ip) = self
            .sessions
            .get_mut(&id)
            .and_then(|session| session.handshaking_from.take())
        else {
            return;
        };
        self.handshaking_total -= 1;
        self.publish_handshakes();
        // Ids past their handshake behind one still in it wait in the
        // queue; many (a hold keeps handshakes alive) are swept out.
        if self.awaiting_hello.len() > 2 * self.handshaking_total + 64 {
            let sessions = &self.sessions;
            self.awaiting_hello.retain(|id| {
                sessions
                    .get(id)
                    .is_some_and(|session| session.handshaking_from.is_some())
            });
        }
        if let Some(count) = self.handshaking.get_mut(&ip) {
            *count -= 1;
            if *count == 0 {
                self.handshaking.remove(&ip);
            }
        }
    }

    /// Wake up by `deadline` at the latest.
    #[inline]
    fn schedule(&mut self, deadline: Instant) {
        if deadline < self.next_timer {
            self.next_timer = deadline;
        }
    }

    /// Do what is due by time: handshakes not completed, heartbeats,
    /// slow consumers blocking too long, gaps on data links, routes to
    /// dial; then find the next deadline.
    fn on_timers(&mut self, now: Instant) {
        // What was due is served now; what is left is scheduled anew below.
        self.next_timer = now + IDLE_WAKE;
        let timeout = self.shared.config.heartbeat_timeout();
        let handshake_timeout = self.shared.config.handshake_timeout();
        let block_timeout = self.shared.live.block_timeout();
        let mut expired = Vec::new();
        let mut overdue = Vec::new();
        let mut stalled_routes = Vec::new();
        let mut pings = Vec::new();
        let mut slow = Vec::new();
        let mut links_due = Vec::new();
        let mut reports = Vec::new();
        let mut pacing = Vec::new();
        let mut unheard = Vec::new();
        let mut unused = Vec::new();
        let mut unconfirmed = Vec::new();
        let mut reopening = Vec::new();
        let mut unswitched = Vec::new();
        let bound = self.shared.live.max_pending_bytes();
        let mut queued = 0u64;
        // The next deadline, of the sessions with nothing due now (the
        // others are seen to below and then rescheduled).
        let mut next = now + IDLE_WAKE;
        for (&id, session) in &mut self.sessions {
            queued += (session.conn.out.bytes() + session.conn.links.backlog_bytes()) as u64;
            // Not read while publishers are held back (nor given credit):
            // its silence is this broker's doing, its handshake's too.
            if self.reads_paused && !self.blocking.contains(&id) {
                session.conn.liveness.excuse(now);
                session.extend_handshake(now + handshake_timeout);
            }
            let mut due = true;
            let route_late = session
                .route()
                .and_then(|role| role.up_by)
                .is_some_and(|by| now >= by);
            match session.state {
                SessionState::AwaitHello { deadline } if now >= deadline => {
                    expired.push((id, ErrorCode::HandshakeTimeout))
                }
                SessionState::Ready if route_late => {
                    expired.push((id, ErrorCode::HandshakeTimeout))
                }
                SessionState::Ready => match session.conn.liveness.poll(now) {
                    Heartbeat::Dead => expired.push((id, ErrorCode::Internal)),
                    Heartbeat::Ping => pings.push(id),
                    Heartbeat::Wait => due = false,
                },
                SessionState::Closing { deadline } if now >= deadline => overdue.push(id),
                _ => due = false,
            }
            if session
                .over_since
                .is_some_and(|since| now.duration_since(since) >= block_timeout)
            {
                // A session closing for another reason (its peer said
                // goodbye, say) is closed now, as at its drain deadline,
                // not cut off as a slow consumer.
                match session.state {
                    SessionState::Closing { deadline } if now < deadline => overdue.push(id),
                    SessionState::Closing { .. } => {}
                    _ => slow.push(id),
                }
                due = true;
            }
            // Routes are left out of the bound on control frames (an
            // interest snapshot may rightly pass it), so a route peer that
            // takes nothing would grow its queue without end (pings,
            // interest changes, gossip): one that takes nothing for the
            // heartbeat timeout while they pass the bound is cut off.
            if session.route().is_some() && matches!(session.state, SessionState::Ready) {
                let taken = session.conn.out.taken();
                let (since, seen) = &mut session.route_stalled;
                if taken != *seen || session.conn.out.control_bytes() <= bound {
                    (*since, *seen) = (None, taken);
                } else {
                    let since = *since.get_or_insert(now);
                    if now.duration_since(since) >= timeout {
                        stalled_routes.push(id);
                        due = true;
                    } else {
                        next = next.min(since + timeout);
                    }
                }
            }
            if !matches!(session.state, SessionState::Closing { .. })
                && session
                    .conn
                    .links
                    .next_deadline()
                    .is_some_and(|deadline| deadline <= now)
            {
                links_due.push(id);
                due = true;
            }
            if !due {
                if let Some(deadline) = session.poll_timeout(block_timeout) {
                    next = next.min(deadline);
                }
            }
            // A dialed route's datagram link not credited yet.
            match session.conn.links.best_effort_due(now, handshake_timeout) {
                Some(at) if at > now => next = next.min(at),
                Some(_) => unheard.push(id),
                None => {}
            }
            // A dialed route's datagram link given up, to open again
            // while the route lasts.
            let ready = session.state == SessionState::Ready;
            match session.conn.links.reopen_due(handshake_timeout) {
                Some(at) if at > now => next = next.min(at),
                Some(_) if ready => reopening.push(id),
                _ => {}
            }
            // A datagram link opened again whose switch went unanswered.
            match session.conn.links.switch_deadline(timeout) {
                Some(at) if at > now => next = next.min(at),
                Some(_) => unswitched.push(id),
                None => {}
            }
            // Links of an accepted peer that it has not sent on.
            match session.conn.links.unused_deadline(handshake_timeout) {
                Some(at) if at > now => next = next.min(at),
                Some(_) => unused.push(id),
                None => {}
            }
            // A datagram link whose frames the peer has not confirmed;
            // not while the answers to its pings are not read.
            match session.conn.links.best_effort_probe_at() {
                _ if self.reads_paused && !self.blocking.contains(&id) => {}
                Some(at) if at > now => next = next.min(at),
                Some(_) => unconfirmed.push(id),
                None => {}
            }
            // Best-effort frames waiting for a credit that may have been
            // lost: the link resets a window stalled that long.
            if session.conn.links.best_effort_waiting() {
                pacing.push(id);
                next = next.min(now + PACING_RETRY);
            }
            // Drop reports due go out if the queue has room; otherwise
            // draining it sends them (`flush_session`), not the timers.
            match session.drops.due_at() {
                Some(at) if at > now => next = next.min(at),
                Some(_) if session.conn.out.bytes() <= bound / 2 => reports.push(id),
                _ => {}
            }
        }
        self.shared
            .stats
            .queued_bytes
            .store(queued, Ordering::Relaxed);
        self.poll_links(now, &links_due);
        self.dial_routes(now);
        for &(id, code) in &expired {
            let text = match code {
                ErrorCode::HandshakeTimeout => "handshake not completed in time".to_string(),
                _ => format!("no traffic for {timeout:?}: peer presumed dead"),
            };
            self.fail(id, code, text);
            if let Some(session) = self.sessions.get(&id) {
                // A dead peer will not drain its queue: close now.
                let control = session.conn.control;
                self.endpoints[control.endpoint].close(control.peer);
            }
        }
        for &id in &stalled_routes {
            self.disconnect_slow(
                id,
                "route took nothing while its control frames passed the queue's bound; closed",
                format!(
                    "you took nothing for {timeout:?} while the frames for you passed the bound"
                ),
            );
        }
        for &id in &overdue {
            // Its queue did not drain within the drain time: the peer is
            // not reading. Closing counts what was still queued.
            if let Some(session) = self.sessions.get(&id) {
                debug!(session = id, remote = %session.remote, "closing peer did not drain its queue; closed");
                let control = session.conn.control;
                self.endpoints[control.endpoint].close(control.peer);
            }
        }
        for &id in &slow {
            self.disconnect_slow(
                id,
                "slow consumer blocked publishers too long; disconnected",
                format!("could not take messages for {block_timeout:?}"),
            );
        }
        for &id in &pings {
            self.send(id, codec::encode(&Frame::Ping { nonce: 0 }), false);
            // A challenge lost on a datagram link is asked again, a few
            // times; a peer that never answers does not receive at the
            // address it gave, and its held traffic would wait for ever.
            let Some(session) = self.sessions.get_mut(&id) else {
                continue;
            };
            let unanswered = session
                .conn
                .links
                .send_challenges(&mut self.endpoints, Ask::Again);
            if let Some(closed) = unanswered.best_effort_given_up {
                BrokerStats::add(&self.shared.stats.unproven_addresses, 1);
                let reason = format!(
                    "best-effort: {}: no answer from the peer there; carried on the reliable link",
                    closed.description
                );
                self.data_link_closed_alone(id, closed, reason);
            }
            if unanswered.session_ends {
                BrokerStats::add(&self.shared.stats.unproven_addresses, 1);
                self.fail(
                    id,
                    ErrorCode::Protocol,
                    "no answer from the fabric address this peer gave".to_string(),
                );
            }
            self.end_if_data_link_failed(id);
        }
        for &id in &reports {
            self.report_drops(id, now);
        }
        for &id in &pacing {
            self.flush_session(id);
        }
        for &id in &unheard {
            self.tend_best_effort_link(id, now);
        }
        for &id in &unused {
            self.close_unused_links(id);
        }
        for &id in &unconfirmed {
            self.probe_best_effort_link(id, now);
        }
        for &id in &reopening {
            self.reopen_best_effort_link(id, now);
        }
        for &id in &unswitched {
            self.give_up_unswitched_link(id, timeout);
        }
        // The sessions seen to above, as they stand now.
        for id in expired
            .iter()
            .map(|(id, _)| id)
            .chain(&slow)
            .chain(&links_due)
            .chain(&pings)
        {
            if let Some(deadline) = self
                .sessions
                .get(id)
                .and_then(|session| session.poll_timeout(block_timeout))
            {
                next = next.min(deadline);
            }
        }
        if let Some(silent) = self.silent_route_links(now) {
            next = next.min(silent);
        }
        if let Some(dial) = self.cluster.next_dial() {
            next = next.min(dial);
        }
        // While anything is queued, the queued-bytes gauge is refreshed at
        // least every `GAUGE_REFRESH` (sends above may have scheduled
        // sooner already).
        if queued > 0 {
            next = next.min(now + GAUGE_REFRESH);
        }
        self.schedule(next);
        self.flush_tally();
    }

    /// Let datagram links give up on gaps whose time has passed, and hand
    /// on what that releases; end the sessions whose reliable link has a
    /// gap that did not fill in time.
    fn poll_links(&mut self, now: Instant, ids: &[u64]) {
        let mut released = std::mem::take(&mut self.released);
        for &id in ids {
            let mut result = Ok(());
            if let Some(session) = self.sessions.get_mut(&id) {
                result = session.conn.links.poll(now, &self.endpoints, &mut released);
                let lost = session.conn.links.take_best_effort_lost();
                self.tally.best_effort_lost = self.tally.best_effort_lost.saturating_add(lost);
                // A gap given up by time moves the link on: the peer, its
                // credits stopped at the gap, waits for word of it.
                if session.conn.links.owe_credit() {
                    self.credit_owed.insert(id);
                }
            }
            self.on_released(id, &mut released);
            if let Err(err) = result {
                self.reliable_link_failed(id, &err);
            }
        }
        self.released = released;
    }

    fn shutdown(&mut self) {
        let mut events = std::mem::take(&mut self.events);
        info!("shutting down");
        // The drain's passes are rounds to the stall watch (`RoundWatch`).
        let watch = Arc::clone(&self.shared.round_watch);
        watch.round_began(Instant::now());
        let deadline = Instant::now() + self.shared.config.drain_timeout();
        // Deliver what in-process publishers queued before the shutdown,
        // and what they queued until the queue closed, past the bounds of
        // consumers that would hold the loop's commands back.
        self.shared.published.close();
        loop {
            self.blocking.clear();
            if !self.drain_commands(usize::MAX) {
                break;
            }
        }
        // Delivering past those bounds paused reads again.
        self.set_reads_paused(false);
        let goodbye = codec::encode(&Frame::Goodbye(Goodbye {
            reason: "server shutting down".to_string(),
        }));
        let ids: Vec<u64> = self.sessions.keys().copied().collect();
        for id in ids {
            self.send(id, goodbye.clone(), false);
            self.close_session(id);
        }
        // Messages held for full in-process subscriptions get the drain
        // time too (their readers read until the end); then those still
        // without room are dropped and counted.
        while (!self.sessions.is_empty() || !self.held_local.is_empty())
            && Instant::now() < deadline
        {
            watch.round_ended();
            std::thread::sleep(Duration::from_millis(1));
            watch.round_began(Instant::now());
            self.poll_endpoints(&mut events);
            self.held_local.retry(&self.shared, Instant::now(), false);
        }
        self.held_local.retry(&self.shared, Instant::now(), true);
        let drained = self.sessions.is_empty();
        if !drained {
            warn!(
                peers = self.sessions.len(),
                "drain time over; closing peers with data still queued"
            );
            for session in self.sessions.values() {
                self.count_discarded(session);
            }
        }
        // A flush waiting now succeeds only if nothing was left behind;
        // otherwise it is dropped unanswered and says `Closed`.
        for Flush { done, .. } in self.flushes.drain(..) {
            if drained {
                let _ = done.send(());
            }
        }
        self.shared.subscriptions.write().close_locals();
        // Closing a fabric endpoint runs its provider's progress too.
        drop(std::mem::take(&mut self.endpoints));
        watch.round_ended();
        info!("stopped");
    }
}

impl Rounds for EventLoop {
    fn driven_round(&mut self) -> Option<bool> {
        Some(self.round().busy)
    }
}

/// What one round found.
struct Round {
    /// Events came in or commands were waiting.
    busy: bool,
    /// Credits are owed but held back (`CREDIT_DELAY`).
    credit_waiting: bool,
    /// When the round's work ended.
    now: Instant,
    /// When the timers are due next.
    timers_at: Instant,
}

/// Ends what waits on an embedded broker when its loop thread ends before
/// a shutdown (a panic there or in a round a waiting thread ran): nothing
/// will be routed, so in-process subscriptions end after what they hold,
/// requests waiting fail, and what is asked of the broker from then on is
/// `Closed`.
struct EndsWaitsOnExit<'a>(&'a Shared);

impl Drop for EndsWaitsOnExit<'_> {
    fn drop(&mut self) {
        self.0.published.close();
        if !self.0.shutdown.swap(true, Ordering::SeqCst) {
            self.0.subscriptions.write().close_locals();
        }
    }
}

/// The broker's loop thread: rounds until shutdown, polling on for the
/// spin window after work and waiting otherwise; stepping aside while an
/// application thread of an embedded broker that waits for a reply or a
/// message runs the loop ([`Driven`]). Ends with the shutdown's drain.
pub(crate) fn run_loop(
    event_loop: &Driven<EventLoop>,
    shared: &Shared,
    mut poll: Poll,
    commands: &Receiver<Command>,
) {
    // Dropped last: the panic is recorded (`_unwinding`) before the
    // broker is marked shut down.
    let _ending = EndsWaitsOnExit(shared);
    let _unwinding = shared.round_watch.ended_on_unwind();
    let mut mio_events = mio::Events::with_capacity(256);
    let polling = match event_loop.lock() {
        Some(state) => state.polling,
        None => return,
    };
    let mut idle_spins = 0u32;
    let mut spin_window = SpinWindow::new(Instant::now());
    let config = &shared.config.fabric.polling;
    while !shared.shutdown.load(Ordering::Relaxed) {
        if event_loop.is_driven() {
            // A waiting application thread runs the loop.
            event_loop.sleep_while_driven(DRIVEN_SLEEP);
            continue;
        }
        if event_loop.take_driven_work() {
            spin_window.worked(Instant::now(), config.spin());
            idle_spins = 0;
        }
        let Some(mut guard) = event_loop.lock() else {
            error!("a round run by an application thread panicked: the event loop has ended");
            return;
        };
        let state = &mut *guard;
        let round = state.round();
        event_loop.loop_worked(round.busy);
        let now = round.now;
        let spin = config.spin();
        if round.busy {
            idle_spins = 0;
            spin_window.worked(now, spin);
            continue;
        }
        if !spin_window.spinning(now) {
            // The idle rounds of `backoff` start after the spin.
            idle_spins = idle_spins.saturating_add(1);
        }
        if spin_window.spinning(now) {
            drop(guard);
            std::thread::yield_now();
            continue;
        }
        // Sleep until an fd is ready, a command arrives or the next
        // session deadline; endpoints cap the sleep (those that must be
        // polled, and any with work no descriptor announces). A deadline
        // may be met up to a millisecond late: a shorter wait for it would
        // be a blind sleep (see `wait`), deaf to the descriptors.
        let mut timeout = round
            .timers_at
            .saturating_duration_since(now)
            .max(Duration::from_millis(1));
        if round.credit_waiting {
            timeout = timeout.min(CREDIT_DELAY);
        }
        if polling.must_poll {
            timeout = timeout.min(polling.backoff(idle_spins, config));
        }
        if !timeout.is_zero() {
            // It runs the providers' progress too: watched as the round.
            shared.round_watch.round_began(now);
            let prepared = prepare_wait(&mut state.endpoints, timeout);
            shared.round_watch.round_ended();
            match prepared {
                Some(allowed) => timeout = allowed,
                None => continue,
            }
        }
        let finished = event_loop.drives_finished();
        // Commands the loop does not read now must not keep it awake.
        let holds_commands = state.holds_commands();
        drop(guard);
        // What this thread saw holds only if no driver came since.
        if !shared.commands.park(commands, holds_commands, || {
            (holds_commands || !shared.published.outstanding())
                && !shared.loop_requests_waiting.load(Ordering::Acquire)
                && !shared.logins_checked.load(Ordering::Acquire)
                && event_loop.may_sleep(finished)
        }) {
            continue;
        }
        if let Err(err) = wait(&mut poll, &mut mio_events, timeout) {
            if err.kind() != std::io::ErrorKind::Interrupted {
                warn!(error = %err, "poll failed");
            }
        }
        shared.commands.unpark();
        if polling.yields(idle_spins, config) {
            std::thread::yield_now();
        }
    }
    // Shut down here, on the loop thread, with drivers kept out.
    if let Some(mut state) = event_loop.take() {
        state.shutdown();
    }
}

/// Stores each value in its counter.
fn store_all(values: &[(&AtomicU64, u64)]) {
    for (counter, value) in values {
        counter.store(*value, Ordering::Relaxed);
    }
}

/// A flush waiting for the loop ([`EventLoop::answer_flushes`]).
struct Flush {
    done: Sender<()>,
    until: Option<Instant>,
    /// [`Shared::published`]'s count of messages pushed when the flush
    /// came: those are delivered before it is answered.
    published: u64,
}

/// The subscriptions a subject reached at one generation of the
/// subscription table, for clients' publishes or for messages a route
/// brought for one interest id (`route_sid`). Kept only for an answer
/// that holds for every message on the subject: no queue group picks a
/// member.
#[derive(Default)]
struct LastRoute {
    subject: String,
    route_sid: Option<u64>,
    /// 0 when nothing is kept (generations start at 1).
    generation: u64,
    local: Vec<(u64, Arc<LocalSink>)>,
    remote: Vec<SubRef>,
}

impl LastRoute {
    fn serves(&self, subject: &str, route_sid: Option<u64>, generation: u64) -> bool {
        self.generation == generation && self.route_sid == route_sid && self.subject == subject
    }

    /// Lets go of an answer the table has moved past: it may hold
    /// in-process subscriptions dropped since, and their queues.
    fn forget_if_stale(&mut self, generation: u64) {
        if self.generation != generation {
            self.generation = 0;
            self.local.clear();
        }
    }

    /// Puts the kept answer into `targets`.
    fn fill(&self, targets: &mut Targets) {
        targets.clear();
        targets.local.extend(self.local.iter().cloned());
        targets.remote.extend_from_slice(&self.remote);
    }

    fn keep(
        &mut self,
        subject: &str,
        route_sid: Option<u64>,
        generation: u64,
        stable: bool,
        targets: &Targets,
    ) {
        self.generation = 0;
        self.local.clear();
        if stable {
            self.subject.clear();
            self.subject.push_str(subject);
            self.route_sid = route_sid;
            self.local.extend(targets.local.iter().cloned());
            self.remote.clear();
            self.remote.extend_from_slice(&targets.remote);
            self.generation = generation;
        }
    }
}
