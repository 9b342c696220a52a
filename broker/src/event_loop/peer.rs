//! The broker's view of one peer: a [`Session`] (a client, or a route to
//! another broker, see [`super::route`]), and what a client session asks
//! for: the handshake with its negotiation of data paths, subscriptions.
//! The session decides; the loop sends what it answers and keeps the
//! tables that span sessions (which endpoint address is whose).

use bytes::Bytes;
use crossbeam_channel::Sender;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use efabus_core::caps::Offer;
use efabus_core::codec;
use efabus_core::frame::{self, DeliveryClass, ErrorCode, Frame, Welcome, PROTOCOL_VERSION};
use efabus_core::link::LinkTuning;
use efabus_core::secret::{constant_time_eq, prove, ProofRole};
use efabus_core::subject;
use efabus_core::transport::Endpoint;
use rustc_hash::FxHashMap as HashMap;
use tracing::{debug, info, warn};

use super::route::RouteRole;
use super::{EventLoop, Payload, Restricted, AWAITED_MAX};
use crate::accounts::{inbox_of, Accounts, Login};
use crate::auth_guard::remote_ip;
use crate::broker::{BrokerStats, Shared};
use crate::config::Config;
use crate::endpoints;
use crate::monitoring::SessionCounts;
use crate::session::data_link::Keying;
use crate::session::link_auth::{HandshakeRole, LinkSecret};
use crate::session::outbound::{Batch, Control};
use crate::session::{Connection, Liveness};
use crate::subscriptions::SubRef;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SessionState {
    /// The handshake is under way: waiting for the peer's hello, or, on a
    /// route this broker dialed, for the peer's welcome.
    AwaitHello {
        deadline: Instant,
    },
    Ready,
    /// An error or goodbye was sent; close once it is flushed, or at the
    /// deadline with what is still queued discarded and counted (a peer
    /// that reads nothing would otherwise keep its queue for ever).
    Closing {
        deadline: Instant,
    },
}

/// What a session refuses a peer: the error to send back.
pub(super) struct Refusal {
    pub code: ErrorCode,
    pub text: String,
}

impl Refusal {
    fn new(code: ErrorCode, text: impl Into<String>) -> Refusal {
        Refusal {
            code,
            text: text.into(),
        }
    }
}

/// What kind of peer a session serves, and what only that kind holds.
pub(super) enum Role {
    /// A client: its subscription ids and how each wants its messages
    /// carried. An accepted session is a client until the peer says it is
    /// a broker (see [`super::route`]).
    Client(HashMap<u64, ClientSub>),
    /// A route to another broker.
    Route(Box<RouteRole>),
}

/// A client's subscription as it asked for it: the class routes its
/// messages, the rest is for monitoring.
pub(super) struct ClientSub {
    pub class: DeliveryClass,
    pub pattern: String,
    pub queue: Option<String>,
}

/// How long a queue-group member that left is remembered with its group.
const DEPARTED_KEPT_FOR: Duration = Duration::from_secs(10);
/// Most queue-group members remembered at once (the oldest go first).
pub(super) const DEPARTED_MAX: usize = 4096;

/// Queue-group members of clients that left lately (unsubscribed, reached
/// their delivery limit, or their session ended), with their group. An
/// in-process publisher picks a group's member on its own thread, and its
/// message may wait for the event loop while that member leaves; the loop
/// then gives it to another member (`EventLoop::deliver_to_group`) rather
/// than to nobody, or to a client that no longer wants it.
#[derive(Default)]
pub(super) struct Departed {
    /// Each member's group (pattern, queue) and when it left.
    groups: HashMap<SubRef, (Instant, Arc<str>, Arc<str>)>,
    /// The members in the order they left.
    order: VecDeque<(Instant, SubRef)>,
}

impl Departed {
    /// `member` (subscription `sub`) left at `now`; a subscription in no
    /// queue group is not kept.
    pub fn record(&mut self, member: SubRef, sub: &ClientSub, now: Instant) {
        let Some(queue) = &sub.queue else {
            return;
        };
        self.forget_expired(now);
        if self.order.len() >= DEPARTED_MAX {
            self.forget_oldest();
        }
        self.groups.insert(
            member,
            (
                now,
                Arc::from(sub.pattern.as_str()),
                Arc::from(queue.as_str()),
            ),
        );
        self.order.push_back((now, member));
    }

    /// The group of `member`, if it left lately.
    #[inline]
    pub fn group_of(&self, member: SubRef) -> Option<(&Arc<str>, &Arc<str>)> {
        if self.groups.is_empty() {
            return None;
        }
        self.groups
            .get(&member)
            .map(|(_, pattern, queue)| (pattern, queue))
    }

    /// `member`'s id names a new subscription: it left no more.
    pub fn returned(&mut self, member: SubRef) {
        if !self.groups.is_empty() {
            self.groups.remove(&member);
        }
    }

    /// Forgets the members that left more than [`DEPARTED_KEPT_FOR`]
    /// before `now`.
    pub fn forget_expired(&mut self, now: Instant) {
        self.forget_older_than(now.checked_sub(DEPARTED_KEPT_FOR));
    }

    fn forget_older_than(&mut self, cut: Option<Instant>) {
        let Some(cut) = cut else {
            return;
        };
        while self.order.front().is_some_and(|&(left, _)| left < cut) {
            self.forget_oldest();
        }
    }

    fn forget_oldest(&mut self) {
        if let Some((left, member)) = self.order.pop_front() {
            // Unless it left again since (and is kept from then).
            if self.groups.get(&member).is_some_and(|(at, ..)| *at == left) {
                self.groups.remove(&member);
            }
        }
    }
}

/// Messages the drop-oldest policy discarded for a client's subscriptions
/// and not yet reported to it (see `EventLoop::report_drops`).
pub(super) struct DropReports {
    /// Messages discarded per subscription id since the last report.
    pub pending: HashMap<u64, u64>,
    /// No report goes out before this time: reports are coalesced.
    pub not_before: Instant,
}

impl DropReports {
    /// When the pending reports may go, if there are any.
    pub fn due_at(&self) -> Option<Instant> {
        (!self.pending.is_empty()).then_some(self.not_before)
    }
}

/// One peer of the broker: a client, or a route to another broker.
pub(super) struct Session {
    /// Control link, data links, outbound queue, heartbeats.
    pub conn: Connection,
    pub remote: String,
    pub name: String,
    pub state: SessionState,
    pub role: Role,
    /// Deliveries encoded since the last hand-off, newer than everything
    /// in the outbound queue; handed on at the end of the loop round.
    pub batch: Batch,
    /// Since when the queue has been over its bound under the block policy.
    pub over_since: Option<Instant>,
    /// A route's control frames over the queue's bound with nothing taken
    /// from the queue: since when, and how much the queue had had taken
    /// (see `Outbound::taken`) when last looked at.
    pub route_stalled: (Option<Instant>, u64),
    /// Disconnected as a slow consumer: its queue was dropped, and what is
    /// still routed to it before it is gone is dropped too.
    pub cut_off: bool,
    /// The peer said goodbye: it acknowledges nothing more, so a drain
    /// does not wait for its acknowledgements.
    pub peer_left: bool,
    /// What the drop-oldest policy discarded for a client, to tell it.
    pub drops: DropReports,
    /// Its hello is on the login thread (a password or token hash to
    /// check); what it sends meanwhile is kept in `deferred`.
    pub checking_hello: bool,
    /// Frames that came behind a hello being checked, handled once it is
    /// (at most [`DEFERRED_MAX`]).
    pub deferred: Vec<Bytes>,
    /// A client's subscriptions that end after so many deliveries
    /// (`Frame::UnsubscribeAfter`), by id: some of its subscriptions, or
    /// of those waiting for their inbox (`Restricted::awaits_inbox`).
    pub limited: HashMap<u64, DeliveryLimit>,
    /// The peer's hello carried the route credential (or none is needed):
    /// only then may it say it is a broker and become a route.
    pub may_route: bool,
    /// The hello's secret matched none configured, and was counted
    /// against its address (a later route request is not counted again).
    pub guessed: bool,
    /// The user the client logged in as (`auth.users`), if it did.
    pub user: Option<String>,
    /// The challenge sent to an accepted peer, which its hello proves the
    /// shared secret against.
    pub challenge: Option<[u8; 32]>,
    /// While an accepted peer has not finished its handshake: its address,
    /// counted among those handshaking from there.
    pub handshaking_from: Option<std::net::IpAddr>,
    /// Why the data paths not taken were not, from the last negotiation.
    pub link_reasons: Vec<String>,
    /// This side's id for the data links of the last negotiation, which
    /// the peer's frames there carry.
    pub link_id: Option<u64>,
    /// The hello's `no_echo`: this session's publishes skip its own
    /// subscriptions.
    pub no_echo: bool,
    /// The hello's `no_responders`: a request nothing matches is answered
    /// with a 503 status message.
    pub no_responders: bool,
    /// When the session began, and what it moved since.
    pub since: SystemTime,
    pub counts: SessionCounts,
}

/// Deliveries to a subscription counted against its limit
/// (`Frame::UnsubscribeAfter`).
#[derive(Debug, Clone, Copy)]
pub(super) struct DeliveryLimit {
    /// Delivered since the first limit came.
    pub delivered: u64,
    /// The subscription ends once `delivered` reaches it.
    pub total: u64,
}

/// Frames a peer may send behind a hello that is being checked.
pub(super) const DEFERRED_MAX: usize = 64;

/// What a hello's check decided: admitted, or refused and why.
pub(super) type HelloVerdict = Result<Admission, Refusal>;

/// A hello whose credentials the login thread checks.
pub(super) struct LoginCheck {
    id: u64,
    hello: frame::Hello,
    challenge: Option<[u8; 32]>,
    certificate_name: Option<String>,
}

impl LoginCheck {
    fn run(&self, shared: &Shared) -> HelloVerdict {
        let challenge = self.challenge.as_ref();
        let name = self.certificate_name.as_deref();
        Session::check_hello(
            &self.hello,
            &shared.config,
            &shared.accounts,
            challenge,
            name,
            true,
        )
        // Checked with every hash it needs, it always has a verdict.
        .unwrap_or_else(|| Err(Refusal::new(ErrorCode::Auth, "invalid credentials")))
    }
}

/// A hello the login thread checked, for the loop to continue.
pub(crate) struct CheckedLogin {
    id: u64,
    hello: frame::Hello,
    verdict: HelloVerdict,
}

/// A login refused unchecked: the broker's hash checks for this second
/// are spent (not `Auth`: the client retries with its backoff).
fn busy() -> Refusal {
    Refusal::new(
        ErrorCode::RateLimited,
        "too many logins to check right now; retrying shortly",
    )
}

/// Who a hello's credentials admit.
pub(super) struct Admission {
    /// It presented the route credential (or none is needed).
    pub may_route: bool,
    /// The user it logged in as.
    pub user: Option<String>,
    /// That user's permissions, when they restrict anything.
    pub permissions: Option<Arc<crate::config::Permissions>>,
    /// This side's proof of the shared secret the hello proved, for the
    /// welcome.
    pub proof: Option<[u8; 32]>,
    /// Admitted where nothing is required, with a secret that matched
    /// none configured: a guess, counted against its address.
    pub wrong_secret: bool,
}

/// What this broker brings to a negotiation.
pub(super) struct LocalPaths<'a> {
    pub offers: &'a [Offer],
    pub preference: &'a [String],
    pub tuning: &'a LinkTuning,
}

impl Session {
    pub fn new(control: Control, remote: String, liveness: Liveness, deadline: Instant) -> Session {
        Session {
            conn: Connection::new(control, liveness),
            remote,
            name: String::new(),
            state: SessionState::AwaitHello { deadline },
            role: Role::Client(HashMap::default()),
            batch: Batch::default(),
            over_since: None,
            route_stalled: (None, 0),
            cut_off: false,
            peer_left: false,
            drops: DropReports {
                pending: HashMap::default(),
                not_before: Instant::now(),
            },
            limited: HashMap::default(),
            checking_hello: false,
            deferred: Vec::new(),
            may_route: false,
            guessed: false,
            user: None,
            challenge: None,
            handshaking_from: None,
            link_reasons: Vec::new(),
            link_id: None,
            no_echo: false,
            no_responders: false,
            since: SystemTime::now(),
            counts: SessionCounts::default(),
        }
    }

    /// The route this session is, if it is one.
    pub fn route(&self) -> Option<&RouteRole> {
        match &self.role {
            Role::Route(route) => Some(route),
            Role::Client(_) => None,
        }
    }

    pub fn route_mut(&mut self) -> Option<&mut RouteRole> {
        match &mut self.role {
            Role::Route(route) => Some(route),
            Role::Client(_) => None,
        }
    }

    /// Whether the session is a route that completed its handshake.
    pub fn is_route(&self) -> bool {
        self.route().is_some_and(RouteRole::is_up)
    }

    /// How a client's subscription wants its messages carried.
    pub fn class_of(&self, sid: u64) -> Option<DeliveryClass> {
        match &self.role {
            Role::Client(subscriptions) => subscriptions.get(&sid).map(|sub| sub.class),
            Role::Route(route) => route.announced.get(&sid).copied(),
        }
    }

    /// Gives a handshake still under way (a hello awaited, or a dialed
    /// route's route hello) until `until` at least: it was not read
    /// meanwhile, so its silence is not its own.
    pub fn extend_handshake(&mut self, until: Instant) {
        if let SessionState::AwaitHello { deadline } = &mut self.state {
            *deadline = (*deadline).max(until);
        }
        if let Some(by) = self.route_mut().and_then(|role| role.up_by.as_mut()) {
            *by = (*by).max(until);
        }
    }

    /// The earliest time the session has something to do by time alone:
    /// its handshake deadline (a dialed route's included), heartbeats,
    /// lossy links, the block policy's limit (`block_timeout`), or a
    /// closing session's deadline.
    pub fn poll_timeout(&self, block_timeout: std::time::Duration) -> Option<Instant> {
        let own = match self.state {
            SessionState::AwaitHello { deadline } | SessionState::Closing { deadline } => deadline,
            SessionState::Ready => {
                let conn = self.conn.poll_timeout();
                let up_by = self.route().and_then(|role| role.up_by);
                up_by.map_or(conn, |by| by.min(conn))
            }
        };
        Some(match self.over_since {
            Some(since) => own.min(since + block_timeout),
            None => own,
        })
    }

    /// Check a peer's hello: its protocol version and credentials. `Ok`
    /// says whether the peer may go on to open a route: whether it
    /// presented the route credential ([`Config::route_secret`]), or none
    /// is configured (the open mode). A hello with `cluster.secret` is
    /// accepted even where `auth.secret` is set: a dialing broker presents
    /// the cluster's secret, not the clients'. Without `may_hash`, `None`
    /// where a user's password or token hash would have to be checked.
    pub fn check_hello(
        hello: &frame::Hello,
        config: &Config,
        accounts: &Accounts,
        challenge: Option<&[u8; 32]>,
        certificate_name: Option<&str>,
        may_hash: bool,
    ) -> Option<HelloVerdict> {
        if hello.version != PROTOCOL_VERSION {
            return Some(Err(Refusal::new(
                ErrorCode::Version,
                format!(
                    "protocol version {} not supported (this server speaks {PROTOCOL_VERSION})",
                    hello.version
                ),
            )));
        }
        let given = hello.credentials.as_deref().unwrap_or("");
        // Without users or a client secret nothing is checked, a name and
        // password included (as nats-server without auth takes them).
        let unchecked = accounts.is_empty() && config.auth.secret.is_none();
        if let Some(name) = hello.user.as_deref().filter(|_| !unchecked) {
            // A user's name and password; users never open routes.
            return Some(match accounts.login_with(Some(name), given, may_hash)? {
                Login::User { name, permissions } => Ok(Admission {
                    may_route: false,
                    user: Some(name),
                    permissions,
                    proof: None,
                    wrong_secret: false,
                }),
                Login::Refused => Err(Refusal::new(ErrorCode::Auth, "invalid user or password")),
                Login::Busy => Err(busy()),
            });
        }
        // A shared secret matches when the hello proves it against this
        // connection's challenge or (from an older client) carries it.
        // Every comparison is made, each in constant time.
        let matches = |secret: &Option<String>| {
            secret.as_deref().map(|secret| {
                let proven = match (&hello.proof, challenge) {
                    (Some(proof), Some(challenge)) => constant_time_eq(
                        &prove(secret, ProofRole::Dialer, challenge, &proof.nonce),
                        &proof.mac,
                    ),
                    _ => false,
                };
                // With a user's name, the credentials are its password
                // (not checked where there are no users), never a secret.
                let carried = hello.credentials.is_some()
                    && hello.user.is_none()
                    && constant_time_eq(given.as_bytes(), secret.as_bytes());
                proven | carried
            })
        };
        let cluster = matches(&config.cluster.secret);
        let client = matches(&config.auth.secret);
        // This side's proof of the secret the hello proved.
        let secret = if cluster == Some(true) {
            config.cluster.secret.as_deref()
        } else {
            config.auth.secret.as_deref()
        };
        let proof = match (&hello.proof, challenge, secret) {
            (Some(proof), Some(challenge), Some(secret)) => {
                Some(prove(secret, ProofRole::Acceptor, challenge, &proof.nonce))
            }
            _ => None,
        };
        // The route credential: the cluster secret, else the client
        // secret, else nothing (open mode).
        let admitted = |may_route| Admission {
            may_route,
            user: None,
            permissions: None,
            proof,
            wrong_secret: false,
        };
        if cluster == Some(true) || client == Some(true) {
            return Some(Ok(admitted(cluster.or(client).unwrap_or(true))));
        }
        // A token, else a verified client certificate's name.
        let login = match (hello.credentials.is_some(), certificate_name) {
            (true, _) => accounts.login_with(None, given, may_hash)?,
            (false, Some(subject)) if hello.proof.is_none() => {
                accounts.login_by_certificate(subject)
            }
            _ => Login::Refused,
        };
        match login {
            Login::User { name, permissions } => {
                return Some(Ok(Admission {
                    may_route: false,
                    user: Some(name),
                    permissions,
                    proof: None,
                    wrong_secret: false,
                }))
            }
            Login::Busy => return Some(Err(busy())),
            Login::Refused => {}
        }
        if client.is_none() && accounts.is_empty() {
            // Only a route needs the cluster secret: a client is admitted
            // without it, but a wrong one presented is a guess (the welcome
            // would tell a right one by its proof).
            // (A user's name and password are not checked here at all.)
            let presented =
                hello.proof.is_some() || (hello.credentials.is_some() && hello.user.is_none());
            let guessed = cluster == Some(false) && presented;
            return Some(Ok(Admission {
                wrong_secret: guessed,
                ..admitted(cluster.unwrap_or(true))
            }));
        }
        let text = if hello.credentials.is_none() && hello.proof.is_none() {
            "credentials required"
        } else {
            "invalid credentials"
        };
        Some(Err(Refusal::new(ErrorCode::Auth, text)))
    }

    /// Choose the data paths from both sides' offers, open the chosen data
    /// links, and return the offers to put in the welcome: this side of
    /// each chosen link (so the peer arrives at the same choice), or every
    /// offer this side's preference admits when only the control link is
    /// in common.
    pub fn negotiate(
        &mut self,
        id: u64,
        endpoints: &mut [Box<dyn Endpoint>],
        local: LocalPaths<'_>,
        remote: &[Offer],
        keying: Option<Keying<'_>>,
    ) -> Vec<Offer> {
        let LocalPaths {
            offers,
            preference,
            tuning,
        } = local;
        self.link_id = keying.as_ref().map(|keying| keying.secret.auth().link_id);
        let links = &mut self.conn.links;
        let negotiation = links.open(endpoints, offers, remote, preference, tuning, keying);
        for reason in &negotiation.reasons {
            debug!(session = id, %reason, "negotiation");
        }
        self.link_reasons = negotiation.reasons;
        for link in [&links.reliable, &links.best_effort].into_iter().flatten() {
            info!(session = id, link = %link.description, "data path negotiated");
        }
        if negotiation.opened.is_empty() && !negotiation.failed {
            // Normal where neither side has a fabric; the reasons are in
            // the route's or client's link report, for which the peer is
            // shown the paths this side would take: one it leaves out of
            // its preference, the peer must not choose (it would open its
            // side and send where nobody reads).
            debug!(
                session = id,
                "no data path in common; the control link carries everything"
            );
            return offers
                .iter()
                .filter(|o| !endpoints::is_data_scheme(&o.scheme) || preference.contains(&o.scheme))
                .cloned()
                .collect();
        }
        let mut chosen = negotiation.opened;
        chosen.extend(
            offers
                .iter()
                .filter(|o| !endpoints::is_data_scheme(&o.scheme))
                .cloned(),
        );
        chosen
    }

    /// A client's subscription, entered in the subscription table under
    /// this session (`id`).
    pub fn subscribe(
        &mut self,
        id: u64,
        subscribe: frame::Subscribe,
        shared: &Shared,
    ) -> Result<(), Refusal> {
        let Role::Client(subscriptions) = &mut self.role else {
            return Err(Refusal::new(
                ErrorCode::Protocol,
                "a route announces interest, not subscriptions",
            ));
        };
        let limit = shared.live.max_subscriptions_per_peer();
        if subscriptions.len() >= limit {
            return Err(Refusal::new(
                ErrorCode::TooManySubscriptions,
                format!(
                    "subscription limit of {limit} reached; {} refused",
                    subscribe.pattern
                ),
            ));
        }
        if let Err(err) = subject::validate_pattern(&subscribe.pattern, &shared.subject_limits) {
            return Err(Refusal::new(
                ErrorCode::InvalidSubject,
                format!("invalid pattern {:?}: {err}", subscribe.pattern),
            ));
        }
        // Checked before recording: the subscription already under this id
        // stays as it is, in the index and here.
        if subscriptions.contains_key(&subscribe.sid) {
            return Err(Refusal::new(
                ErrorCode::Protocol,
                format!("subscription id {} already in use", subscribe.sid),
            ));
        }
        let sub = ClientSub {
            class: subscribe.class,
            pattern: subscribe.pattern.clone(),
            queue: subscribe.queue.clone(),
        };
        subscriptions.insert(subscribe.sid, sub);
        let key = SubRef {
            owner: id,
            sid: subscribe.sid,
        };
        let inserted = shared.subscriptions.write().insert(
            &subscribe.pattern,
            subscribe.queue.as_deref(),
            key,
            None,
            subscribe.class,
        );
        inserted.map_err(|err| {
            subscriptions.remove(&subscribe.sid);
            Refusal::new(
                ErrorCode::InvalidSubject,
                format!("cannot subscribe to {:?}: {err}", subscribe.pattern),
            )
        })
    }

    /// A client no longer wants subscription `sid`.
    pub fn unsubscribe(&mut self, id: u64, sid: u64, shared: &Shared) {
        if let Role::Client(subscriptions) = &mut self.role {
            subscriptions.remove(&sid);
        }
        // Nobody is left to tell.
        self.drops.pending.remove(&sid);
        self.limited.remove(&sid);
        shared
            .subscriptions
            .write()
            .remove(SubRef { owner: id, sid });
    }
}

impl EventLoop {
    /// A decoded frame on a client session's control link; what a client
    /// session does not handle comes back for the handling every session
    /// shares.
    pub(super) fn on_client_frame(
        &mut self,
        id: u64,
        state: SessionState,
        frame: Frame,
    ) -> Option<Frame> {
        match (state, frame) {
            (SessionState::AwaitHello { .. }, Frame::Hello(hello)) => self.on_hello(id, hello),
            // A broker dialing in says it is one (see `route.rs`).
            (SessionState::Ready, Frame::Route(hello)) => self.on_route_hello(id, hello),
            (SessionState::Ready, Frame::Publish(publish)) => {
                let mut joined = Bytes::new();
                let payload = Payload::of_parts(&publish.headers, &publish.payload, &mut joined);
                self.on_publish(id, &publish.subject, publish.reply.as_deref(), payload)
            }
            (SessionState::Ready, Frame::Subscribe(subscribe)) => self.on_subscribe(id, subscribe),
            (SessionState::Ready, Frame::Unsubscribe { sid }) => self.on_unsubscribe(id, sid),
            (SessionState::Ready, Frame::UnsubscribeAfter { sid, total }) => {
                self.on_unsubscribe_after(id, sid, total)
            }
            (_, other) => return Some(other),
        }
        None
    }

    /// A client's hello: checked, answered with a welcome naming the data
    /// paths chosen, or refused.
    pub(super) fn on_hello(&mut self, id: u64, hello: frame::Hello) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let config = &self.shared.config;
        let address = remote_ip(&session.remote);
        let now = self.now;
        if let Some(text) = address.and_then(|ip| self.auth_guard.lockout(ip, now)) {
            BrokerStats::add(&self.shared.stats.auth_failures, 1);
            self.fail(id, ErrorCode::RateLimited, text);
            return;
        }
        let challenge = session.challenge;
        let control = session.conn.control;
        // Only a certificate the endpoint verified is presented here.
        let certificate_name = self.endpoints[control.endpoint]
            .peer_certificate(control.peer)
            .and_then(|der| crate::accounts::certificate_name(&der));
        let accounts = &self.shared.accounts;
        let (challenge_ref, name) = (challenge.as_ref(), certificate_name.as_deref());
        if let Some(verdict) =
            Session::check_hello(&hello, config, accounts, challenge_ref, name, false)
        {
            return self.on_hello_checked(id, hello, verdict);
        }
        // A user's password or token hash to check: tens of milliseconds
        // each on purpose, on the login thread, not on this loop. What the
        // peer sends meanwhile waits (`Session::deferred`).
        let check = Box::new(LoginCheck {
            id,
            hello,
            challenge,
            certificate_name,
        });
        let sent = match self.login_checks() {
            Some(checks) => checks.send(check).map_err(|unsent| unsent.into_inner()),
            None => Err(check),
        };
        let check = match sent {
            Ok(()) => {
                if let Some(session) = self.sessions.get_mut(&id) {
                    session.checking_hello = true;
                    // Nothing more is read from it until the verdict: a
                    // frame behind the hello above the limit a peer has
                    // before it is accepted waits for that limit to go,
                    // rather than being refused.
                    let control = session.conn.control;
                    self.endpoints[control.endpoint].set_read_paused(control.peer, true);
                }
                return;
            }
            // No login thread: checked here after all.
            Err(check) => check,
        };
        let verdict = check.run(&self.shared);
        self.on_hello_checked(id, check.hello, verdict);
    }

    /// The rest of a hello, once its credentials are checked.
    fn on_hello_checked(&mut self, id: u64, hello: frame::Hello, verdict: HelloVerdict) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let config = &self.shared.config;
        let address = remote_ip(&session.remote);
        let now = self.now;
        let admission = match verdict {
            Ok(admission) => {
                if admission.wrong_secret {
                    BrokerStats::add(&self.shared.stats.auth_failures, 1);
                    if let Some(ip) = address {
                        self.auth_guard.failed(ip, now);
                    }
                }
                admission
            }
            Err(refusal) => {
                if refusal.code == ErrorCode::Auth {
                    BrokerStats::add(&self.shared.stats.auth_failures, 1);
                    if let Some(ip) = address {
                        self.auth_guard.failed(ip, now);
                    }
                }
                self.fail(id, refusal.code, refusal.text);
                return;
            }
        };
        session.may_route = admission.may_route;
        session.guessed = admission.wrong_secret;
        session.user = admission.user;
        session.no_echo = hello.no_echo;
        session.no_responders = hello.no_responders;
        let admission_proof = admission.proof;
        if let Some(permissions) = admission.permissions {
            self.restricted.insert(
                id,
                Restricted {
                    permissions,
                    replies: Default::default(),
                    awaits_inbox: Vec::new(),
                },
            );
        }
        // Keys for the data links, when the peer offers its part.
        let secret = match hello.link_auth.as_ref().map(|_| LinkSecret::new()) {
            Some(Ok(secret)) => Some(secret),
            Some(Err(err)) => {
                warn!(session = id, %err, "no data links for this session");
                None
            }
            None => None,
        };
        let keying = secret
            .as_ref()
            .zip(hello.link_auth.as_ref())
            .map(|(secret, peer)| Keying {
                secret,
                role: HandshakeRole::Acceptor,
                peer,
            });
        let local = LocalPaths {
            offers: &self.offers,
            preference: &config.negotiation.preference,
            tuning: &self.tuning,
        };
        let offers = session.negotiate(id, &mut self.endpoints, local, &hello.offers, keying);
        for address in session.conn.links.addresses() {
            self.by_peer.insert(address, id);
        }
        // Links it never sends on are closed by then.
        let unused_by = session
            .conn
            .links
            .unused_deadline(self.shared.config.handshake_timeout());
        // Authenticated: its frames may now be as large as any peer's.
        let control = session.conn.control;
        self.endpoints[control.endpoint].set_receive_limit(control.peer, None);
        session.name = name_within_limit(hello.name);
        session.state = SessionState::Ready;
        info!(session = id, remote = %session.remote, name = %session.name, "peer connected");
        let welcome = Frame::Welcome(Welcome {
            version: PROTOCOL_VERSION,
            name: config.name.clone(),
            offers,
            max_payload: self.shared.live.max_payload(),
            link_auth: secret.map(|secret| secret.auth().clone()),
            max_subject_len: u32::try_from(config.limits.max_subject_len).unwrap_or(u32::MAX),
            max_subject_tokens: u32::try_from(config.limits.max_subject_tokens).unwrap_or(u32::MAX),
            proof: admission_proof,
        });
        self.send(id, codec::encode(&welcome), false);
        if let Some(at) = unused_by {
            self.schedule(at);
        }
        self.session_ready(id);
        // What the peer sent behind its hello while it was checked.
        let deferred = self
            .sessions
            .get_mut(&id)
            .map(|session| std::mem::take(&mut session.deferred))
            .unwrap_or_default();
        self.replaying_deferred = true;
        for frame in deferred {
            self.on_frame(id, frame);
        }
        self.replaying_deferred = false;
    }

    /// The sender of hellos to check on the login thread, started at the
    /// first; `None` (and the hello checked on the loop) where the
    /// system gives no thread, which is logged (and tried again at the
    /// next such hello).
    fn login_checks(&mut self) -> Option<&Sender<Box<LoginCheck>>> {
        if self.login_checks.is_none() {
            let shared = Arc::clone(&self.shared);
            let (checks, received) = crossbeam_channel::unbounded::<Box<LoginCheck>>();
            let started = std::thread::Builder::new()
                .name("efabus-logins".to_string())
                .spawn(move || {
                    // Ends when the loop, the only sender, is gone.
                    for check in received {
                        let verdict = check.run(&shared);
                        let LoginCheck { id, hello, .. } = *check;
                        shared
                            .checked_logins
                            .lock()
                            .push(CheckedLogin { id, hello, verdict });
                        shared.logins_checked.store(true, Ordering::Release);
                        shared.commands.wake_if_parked();
                        shared.event_loop.wake_sleeper();
                    }
                });
            match started {
                Ok(_) => self.login_checks = Some(checks),
                Err(err) => {
                    warn!(error = %err, "no login thread: password and token hashes are checked on the event loop");
                    return None;
                }
            }
        }
        self.login_checks.as_ref()
    }

    /// Continues the hellos the login thread has checked.
    pub(super) fn finish_login_checks(&mut self) {
        if !self.shared.logins_checked.swap(false, Ordering::AcqRel) {
            return;
        }
        let checked = std::mem::take(&mut *self.shared.checked_logins.lock());
        for CheckedLogin { id, hello, verdict } in checked {
            // Gone meanwhile (its handshake timed out, say): nobody to
            // answer.
            let Some(session) = self.sessions.get_mut(&id) else {
                continue;
            };
            let awaited = matches!(session.state, SessionState::AwaitHello { .. });
            if !std::mem::take(&mut session.checking_hello) || !awaited {
                continue;
            }
            let control = session.conn.control;
            self.on_hello_checked(id, hello, verdict);
            // Read again, unless the broker holds every reader back.
            if !self.reads_paused || self.blocking.contains(&id) {
                self.endpoints[control.endpoint].set_read_paused(control.peer, false);
            }
        }
    }

    pub(super) fn on_subscribe(&mut self, id: u64, subscribe: frame::Subscribe) {
        let inbox = inbox_of(&subscribe.pattern).map(str::to_string);
        let holder = inbox.as_deref().and_then(|inbox| self.inbox_holder(inbox));
        if let Some(restricted) = self.restricted.get(&id) {
            // A subscription under an inbox no other session holds (a
            // requester's own) is allowed beside `allow`, never beside
            // `deny`, and never under the inbox of a request this session
            // was given: that requester may be reconnecting.
            let permissions = &restricted.permissions;
            let answered = inbox
                .as_deref()
                .is_some_and(|inbox| holder.is_none() && restricted.replies.names_inbox(inbox));
            let verdict = match permissions.subscribe_denied(&subscribe.pattern) {
                Some(rule) => Err(rule),
                None if answered => {
                    Err("the inbox is a requester's this connection was sent".to_string())
                }
                None if inbox.is_some() && holder.is_none_or(|holder| holder == id) => Ok(()),
                None if holder.is_some_and(|holder| holder < id && self.same_user(holder, id))
                    && restricted.awaits_inbox.len() < AWAITED_MAX =>
                {
                    // The same user connected again while its earlier
                    // connection lingers (a network path cut: the broker
                    // notices at the heartbeat timeout). The inbox passes
                    // to this one when that one lets it go.
                    debug!(session = id, pattern = %subscribe.pattern, "subscription waits for its inbox");
                    if let (Some(inbox), Some(restricted)) = (inbox, self.restricted.get_mut(&id)) {
                        restricted.awaits_inbox.push(subscribe);
                        let waiters = self.inbox_waiters.entry(inbox).or_default();
                        if !waiters.contains(&id) {
                            waiters.push(id);
                        }
                    }
                    return;
                }
                None if inbox.is_some() => Err("the inbox is another connection's".to_string()),
                None => permissions.may_subscribe(&subscribe.pattern),
            };
            if let Err(rule) = verdict {
                self.deny(id, "subscribe to", &subscribe.pattern, &rule);
                return;
            }
        }
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let member = SubRef {
            owner: id,
            sid: subscribe.sid,
        };
        match session.subscribe(id, subscribe, &self.shared) {
            Err(refusal) => self.report(id, refusal.code, refusal.text),
            Ok(()) => {
                // An id used again names the new subscription from now on.
                self.departed.returned(member);
                if let Some(inbox) = inbox {
                    self.hold_inbox(id, &inbox);
                }
            }
        }
        self.sync_interest();
    }

    /// A user's operation its permissions refuse: answered (the
    /// connection stays), counted and logged at debug level.
    pub(super) fn deny(&mut self, id: u64, operation: &str, subject: &str, rule: &str) {
        BrokerStats::add(&self.shared.stats.permission_denials, 1);
        let user = self
            .sessions
            .get(&id)
            .and_then(|session| session.user.clone())
            .unwrap_or_default();
        debug!(session = id, %user, operation, subject, rule, "permission denied");
        self.report(
            id,
            ErrorCode::PermissionDenied,
            format!("permission denied: {operation} {subject:?} ({rule}, user {user:?})"),
        );
    }

    /// Whether sessions `a` and `b` logged in as one user.
    fn same_user(&self, a: u64, b: u64) -> bool {
        let user = |id| self.sessions.get(&id).and_then(|s| s.user.as_deref());
        user(a).is_some_and(|name| user(b) == Some(name))
    }

    pub(super) fn on_unsubscribe(&mut self, id: u64, sid: u64) {
        if let Some(restricted) = self.restricted.get_mut(&id) {
            let waited = restricted
                .awaits_inbox
                .iter()
                .position(|waiting| waiting.sid == sid)
                .map(|at| restricted.awaits_inbox.remove(at));
            if let Some(inbox) = waited.as_ref().and_then(|s| inbox_of(&s.pattern)) {
                let still = |s: &frame::Subscribe| inbox_of(&s.pattern) == Some(inbox);
                if !restricted.awaits_inbox.iter().any(still) {
                    self.forget_waiter(id, inbox);
                }
            }
        }
        let mut inbox = None;
        if let Some(session) = self.sessions.get_mut(&id) {
            if let Role::Client(subscriptions) = &session.role {
                if let Some(sub) = subscriptions.get(&sid) {
                    inbox = inbox_of(&sub.pattern).map(str::to_string);
                    self.departed
                        .record(SubRef { owner: id, sid }, sub, self.now);
                }
            }
            session.unsubscribe(id, sid, &self.shared);
        }
        if let Some(inbox) = inbox {
            self.release_inbox(id, &inbox);
        }
        self.sync_interest();
    }

    /// A client's subscription `sid` ends once `total` messages are
    /// delivered to it, counted from the first such limit as the broker
    /// routes them (`deliver_remote`), so that a queue group's messages
    /// past them go to other members.
    fn on_unsubscribe_after(&mut self, id: u64, sid: u64, total: u64) {
        // A subscription waiting for its inbox (`awaits_inbox`) is counted
        // from when it is made.
        let awaited = self
            .restricted
            .get(&id)
            .is_some_and(|restricted| restricted.awaits_inbox.iter().any(|s| s.sid == sid));
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let Role::Client(subscriptions) = &session.role else {
            return;
        };
        if !subscriptions.contains_key(&sid) && !awaited {
            return;
        }
        let limit = session.limited.entry(sid).or_insert(DeliveryLimit {
            delivered: 0,
            total,
        });
        limit.total = total;
        if limit.delivered >= total {
            self.on_unsubscribe(id, sid);
        }
    }

    /// Ends the subscriptions whose last delivery the publish just routed
    /// made (most often none).
    #[inline]
    pub(super) fn end_limited_subscriptions(&mut self) {
        while let Some(target) = self.limits_reached.pop() {
            self.on_unsubscribe(target.owner, target.sid);
        }
    }
}

/// A peer's name as the broker keeps it: at most
/// [`crate::config::MAX_NAME_LEN`] bytes (cut at a character). efabus
/// clients send no longer one, but a hand-made hello or a NATS `CONNECT`
/// may, and every report copies the names of all sessions.
pub(super) fn name_within_limit(mut name: String) -> String {
    efabus_core::frame::cut_at_char(&mut name, crate::config::MAX_NAME_LEN);
    name
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{MAX_NAME_LEN, MAX_SECRET_LEN};

    #[test]
    fn a_peer_s_name_is_kept_within_the_limit() {
        assert_eq!(name_within_limit("svc-1".into()), "svc-1");
        assert_eq!(name_within_limit("n".repeat(30_000)).len(), MAX_NAME_LEN);
        // Cut at a character: 'é' is two bytes.
        let name = name_within_limit(format!("{}é", "n".repeat(MAX_NAME_LEN - 1)));
        assert_eq!(name.len(), MAX_NAME_LEN - 1);
    }
    use crate::event_loop::HANDSHAKE_FRAME_MAX;
    use efabus_core::caps::FabricInfo;

    /// The largest hello a peer may send (longest name and secret, 64
    /// offers with the longest addresses) fits the limit a peer has before
    /// its hello is accepted.
    #[test]
    fn the_largest_hello_fits_the_handshake_limit() {
        let mut offer = Offer::from_info("efa-rdm", &FabricInfo::tcp(None), vec![0xab; 255]);
        offer.provider = "p".repeat(64);
        let hello = Frame::Hello(frame::Hello {
            no_echo: false,
            no_responders: false,
            version: PROTOCOL_VERSION,
            name: "n".repeat(MAX_NAME_LEN),
            credentials: Some("s".repeat(MAX_SECRET_LEN)),
            user: None,
            proof: None,
            offers: vec![offer; 64],
            link_auth: Some(frame::LinkAuth {
                key_share: [0xff; 32],
                link_id: u64::MAX,
            }),
        });
        let len = codec::encode(&hello).len();
        assert!(len <= HANDSHAKE_FRAME_MAX, "a hello of {len} bytes");
    }
    /// Only queue members are kept, for their time and within their
    /// number; an id subscribed again is no longer taken for the one that
    /// left, and one that left again keeps its later time.
    #[test]
    fn departed_queue_members_are_kept_within_bounds() {
        let sub = |queue: Option<&str>| ClientSub {
            class: DeliveryClass::Reliable,
            pattern: "jobs.>".to_string(),
            queue: queue.map(str::to_string),
        };
        let member = |sid| SubRef { owner: 7, sid };
        let start = Instant::now();
        let mut departed = Departed::default();
        departed.record(member(1), &sub(None), start);
        assert!(
            departed.group_of(member(1)).is_none(),
            "a plain subscription"
        );
        departed.record(member(2), &sub(Some("workers")), start);
        let (pattern, queue) = departed.group_of(member(2)).expect("a queue member");
        assert_eq!((&**pattern, &**queue), ("jobs.>", "workers"));
        departed.returned(member(2));
        assert!(departed.group_of(member(2)).is_none(), "subscribed again");

        // One that left, came back and left again is kept from then.
        departed.record(member(3), &sub(Some("workers")), start);
        departed.returned(member(3));
        let later = start + DEPARTED_KEPT_FOR / 2;
        departed.record(member(3), &sub(Some("workers")), later);
        departed.record(
            member(4),
            &sub(Some("workers")),
            start + DEPARTED_KEPT_FOR + Duration::from_millis(1),
        );
        assert!(
            departed.group_of(member(3)).is_some(),
            "its later departure is kept"
        );
        departed.record(
            member(5),
            &sub(Some("workers")),
            later + DEPARTED_KEPT_FOR + Duration::from_millis(1),
        );
        assert!(departed.group_of(member(3)).is_none(), "forgotten in time");

        let now = later + DEPARTED_KEPT_FOR + Duration::from_millis(2);
        for sid in 100..100 + DEPARTED_MAX as u64 {
            departed.record(member(sid), &sub(Some("workers")), now);
        }
        assert_eq!(departed.groups.len(), DEPARTED_MAX);
        assert!(
            departed.group_of(member(5)).is_none(),
            "the oldest gave way"
        );
        assert!(departed.group_of(member(100)).is_some());
    }
}
