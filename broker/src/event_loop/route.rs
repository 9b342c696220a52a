//! Routes to other brokers, as the event loop runs them: dialing the
//! configured peers (reconnecting with backoff), the route handshake, one
//! route in use per peer broker, announcing this broker's interest, and
//! delivering what arrives over a route.
//!
//! # Handshake
//!
//! The dialing broker sends its [`Hello`] (with the route credential:
//! `cluster.secret`, else `auth.secret`) and at once a [`RouteHello`]
//! carrying its broker id. The accepting broker answers the hello with its
//! welcome as to any client, then the route hello with its own. Each side
//! counts the route up once it has the other's id, and then sends its whole
//! interest as subscribe frames; later changes follow as subscribe and
//! unsubscribe frames, ahead of any message queued after them (so a
//! requester's reply subscription reaches the responder's broker before the
//! request).
//!
//! # Who may open a route
//!
//! Only a peer whose hello carried the route credential
//! ([`crate::Config::route_secret`]): with `cluster.secret` set, a client's
//! secret does not do. A route hello from any other peer is refused with an
//! `Auth` error naming the reason, counted (`route_refusals`, and against
//! the peer's address like a failed hello), logged at a bounded rate, and
//! the session closed: it never sees this broker's interest. With no
//! secret configured at all, any peer may open a route (the open mode).
//!
//! # One route per pair of brokers
//!
//! When two brokers list each other, both dial, and two links come up. Each
//! side keeps the link dialed by the broker with the lower id and closes
//! the other with a goodbye; both sides decide alike, and a message is only
//! ever sent over the one link in use. A broker does not redial an address
//! that led to a broker it already has a route to.

use bytes::Bytes;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::accounts::inbox_of;
use crate::endpoints;
use efabus_core::caps::Offer;
use efabus_core::codec;
use efabus_core::frame::{
    DeliveryClass, ErrorCode, ErrorFrame, Frame, Goodbye, Hello, RouteHello, RouteLimits,
    RoutePeers, SecretProof, Subscribe, Welcome, PROTOCOL_VERSION,
};
use efabus_core::log_limit::LogLimit;
use efabus_core::secret::{constant_time_eq, prove, ProofRole};
use efabus_transports::registry::EndpointSpec;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tracing::{debug, info, warn};

use super::peer::{LocalPaths, Role, Session, SessionState};
use super::{set_route_paths, EventLoop, Payload, HANDSHAKE_FRAME_MAX};
use crate::auth_guard::remote_ip;
use crate::broker::{BrokerStats, RouteReport, Shared};
use crate::interest::InterestChange;
use crate::session::data_link::Keying;
use crate::session::error_frame;
use crate::session::link_auth::{HandshakeRole, LinkSecret};
use crate::session::outbound::Control;
use crate::subscriptions::SubRef;

/// First wait before redialing a peer; doubled per failed attempt.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait between attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// The goodbye that closes the one of two routes between the same brokers
/// that is not kept.
pub(super) const DUPLICATE_ROUTE: &str = "duplicate route";
/// Most brokers learned from peers kept at once: a bound on what gossip
/// can make this broker remember and dial.
const LEARNED_MAX: usize = 4096;
/// Most learned brokers dialed at once whose route is not up yet: each
/// dial holds a session (counted against `limits.max_connections`) until
/// its handshake ends, and gossip can name thousands at once.
const LEARNED_DIALS_MAX: usize = 16;
/// Most addresses sent in one `RoutePeers` frame: with IP addresses (at
/// most 54 bytes as `tcp/[v6]:port`) a frame stays under 16 KiB.
const PEERS_PER_FRAME: usize = 256;
/// Most addresses read from one `RoutePeers` frame.
const PEERS_PER_FRAME_MAX: usize = LEARNED_MAX;
/// Refused routes are logged at most once per this period; the others in
/// between are counted in the next line (and always in `route_refusals`).
const REFUSAL_LOG_SPACING: Duration = Duration::from_secs(10);

/// What makes a session a route.
pub(crate) struct RouteRole {
    /// The peer this broker dialed (index into its dial list), or `None`
    /// when the peer broker dialed in.
    slot: Option<usize>,
    /// The peer broker's id, once the route is up.
    broker_id: Option<u64>,
    /// Ids of the interest entries the peer announced, with the delivery
    /// they want (best effort for plain entries of best-effort
    /// subscribers only).
    pub(super) announced: HashMap<u64, DeliveryClass>,
    /// The inboxes the peer's interest entries lie under, by entry id:
    /// held for the requesters behind the peer.
    inboxes: HashMap<u64, String>,
    /// Closed because another link to the same broker is kept.
    duplicate: bool,
    /// On a route this broker dialed: its half of the data links' keys,
    /// from the hello until the welcome brings the peer's.
    link_secret: Option<LinkSecret>,
    /// Where the peer broker says it is dialed (its route hello), with an
    /// unspecified host replaced by the address the route came from.
    advertised: Option<String>,
    /// Dialed to a seed (a configured peer, on either side): the two
    /// exchange what they know when it comes up.
    seeded: bool,
    /// On a route this broker dialed: the hello was sent (it answers the
    /// peer's challenge), and the challenge and nonce it proved the route
    /// secret with, which the welcome's proof must answer.
    hello_sent: bool,
    proved: Option<([u8; 32], [u8; 32])>,
    /// What the peer broker takes in one message (its route hello).
    pub(super) peer_limits: Option<RouteLimits>,
    /// On a route this broker dialed, from the welcome until it is up:
    /// when the peer's route hello is due. One welcomed that never comes
    /// up would hold its dial slot, and its share of the learned dials,
    /// for ever.
    pub(super) up_by: Option<Instant>,
}

impl RouteRole {
    fn new(slot: Option<usize>) -> RouteRole {
        RouteRole {
            slot,
            broker_id: None,
            announced: HashMap::default(),
            inboxes: HashMap::default(),
            duplicate: false,
            link_secret: None,
            advertised: None,
            seeded: false,
            hello_sent: false,
            proved: None,
            peer_limits: None,
            up_by: None,
        }
    }

    /// Whether this broker dialed the route (for a configured or learned
    /// peer).
    pub fn dialed(&self) -> bool {
        self.slot.is_some()
    }

    /// Whether the route handshake completed and the route is in use.
    pub fn is_up(&self) -> bool {
        self.broker_id.is_some()
    }
}

/// One configured peer.
struct DialSlot {
    /// As configured (`tcp/HOST:PORT`), for logs.
    endpoint: String,
    /// What follows the scheme.
    address: String,
    /// The session dialed for it, while one exists.
    session: Option<u64>,
    next_attempt: Instant,
    backoff: Duration,
    /// Failed attempts in a row.
    failures: u32,
    /// The broker last reached at this address.
    reached: Option<u64>,
    /// The route over this slot's session came up.
    was_up: bool,
    /// The link was closed (here or by the peer) because another one
    /// between the same brokers is in use: it is dialed again only after
    /// the longest backoff.
    superseded: bool,
    /// The address leads back to this broker: never dialed again.
    own: bool,
    /// Learned from a peer's gossip rather than configured: forgotten once
    /// unreachable for `cluster.forget_after_ms` since `last_reached`.
    learned: bool,
    last_reached: Instant,
    /// A learned peer given up; the slot may be reused.
    forgotten: bool,
    /// Due, but left for later: as many learned brokers were being dialed
    /// as may be. Dialed as soon as one of those dials ends.
    deferred: bool,
    /// Why the fabric is not offered to this peer any more: a route's data
    /// link to it carried nothing back (see
    /// [`EventLoop::silent_route_links`]); with the broker reached then.
    /// Another broker answering here (or that one restarted) clears it.
    fabric_silent: Option<(String, Option<u64>)>,
}

impl DialSlot {
    /// A slot that is dialed: not this broker, not given up.
    fn live(&self) -> bool {
        !self.own && !self.forgotten
    }

    fn new(endpoint: &str, now: Instant) -> Option<DialSlot> {
        let spec = EndpointSpec::parse(endpoint).ok()?;
        Some(DialSlot {
            endpoint: endpoint.to_string(),
            address: spec.address()?.to_string(),
            session: None,
            next_attempt: now,
            backoff: BACKOFF_MIN,
            failures: 0,
            reached: None,
            was_up: false,
            superseded: false,
            own: false,
            learned: false,
            last_reached: now,
            forgotten: false,
            deferred: false,
            fabric_silent: None,
        })
    }
}

/// The event loop's view of the cluster.
pub(crate) struct Cluster {
    broker_id: u64,
    /// Where other brokers dial this one, as told to routes.
    advertise: Option<String>,
    /// The addresses its TCP listeners are bound to.
    tcp_listening: Vec<SocketAddr>,
    /// The endpoint routes are dialed from.
    dialer: Option<usize>,
    /// Endpoints below this index are listeners.
    listeners: usize,
    slots: Vec<DialSlot>,
    /// The route session in use per peer broker id.
    by_broker: HashMap<u64, u64>,
    /// Set when interest announcements wait (the subscription table's flag).
    announcements: Arc<AtomicBool>,
    /// Refused routes are logged at most once per `REFUSAL_LOG_SPACING`.
    refusal_log: LogLimit,
    /// Messages kept from a route by its peer's limits, logged likewise.
    oversized_log: LogLimit,
    /// The slot the next pass of [`EventLoop::dial_routes`] looks at first.
    dial_from: usize,
    /// When a route is next told the known brokers, and which one.
    next_gossip: Instant,
    gossip_turn: usize,
    /// The slots changed since `Broker::peers` was last brought up to date.
    peers_changed: bool,
}

impl Cluster {
    pub fn new(shared: &Shared, dialer: Option<usize>) -> Cluster {
        let now = Instant::now();
        let slots = shared
            .config
            .peers
            .iter()
            .filter_map(|peer| DialSlot::new(peer, now))
            .collect();
        let advertise = shared.config.cluster.advertise.clone().or_else(|| {
            shared
                .listening
                .iter()
                .find(|(scheme, _)| scheme == "tcp")
                .map(|(_, address)| format!("tcp/{address}"))
        });
        let tcp_listening = shared
            .listening
            .iter()
            .filter(|(scheme, _)| scheme == "tcp")
            .filter_map(|(_, address)| address.parse().ok())
            .collect();
        Cluster {
            broker_id: shared.broker_id,
            advertise,
            tcp_listening,
            dialer,
            listeners: shared.listening.len(),
            slots,
            by_broker: HashMap::default(),
            announcements: shared.subscriptions.read().interest_flag(),
            refusal_log: LogLimit::new(REFUSAL_LOG_SPACING),
            oversized_log: LogLimit::new(REFUSAL_LOG_SPACING),
            dial_from: 0,
            next_gossip: now,
            gossip_turn: 0,
            peers_changed: true,
        }
    }

    /// When a configured peer without a link is next to be dialed.
    pub fn next_dial(&self) -> Option<Instant> {
        self.dialer?;
        self.slots
            .iter()
            .filter(|slot| slot.live() && slot.session.is_none())
            .map(|slot| slot.next_attempt)
            .min()
    }

    /// Whether endpoint `index` was opened only to dial routes.
    pub fn dials_only(&self, index: usize) -> bool {
        self.dialer == Some(index) && index >= self.listeners
    }
}

fn broker_hex(id: u64) -> String {
    format!("{id:016x}")
}

/// A peer's advertised address as this broker dials it: a valid
/// `tcp/IP:PORT`, with an unspecified host (`0.0.0.0`, `[::]`), or a
/// loopback one from a peer that is not on loopback, replaced by the IP the
/// route came from (`remote`). `None` if unusable: host names are not
/// learned (each dial would look them up again).
fn resolve_advertised(advertised: &str, remote: &str) -> Option<String> {
    crate::config::check_advertised(advertised).ok()?;
    let socket: SocketAddr = advertised.strip_prefix("tcp/")?.parse().ok()?;
    // An accepted route's remote is the socket address it came from; a
    // dialed one's is the endpoint dialed.
    let remote = remote.strip_prefix("tcp/").unwrap_or(remote);
    let seen = remote
        .parse::<SocketAddr>()
        .ok()
        .map(|r| r.ip().to_canonical());
    let ip = socket.ip().to_canonical();
    let replace = ip.is_unspecified() || ip.is_loopback() && seen.is_some_and(|s| !s.is_loopback());
    let ip = if replace { seen? } else { ip };
    // In the one spelling learned addresses are kept in.
    Some(format!("tcp/{}", SocketAddr::new(ip, socket.port())))
}

/// The socket address `address` names (`tcp/IP:PORT`, a route's remote
/// or an advertised address), when it names an IP rather than a host.
fn socket_of(address: &str) -> Option<SocketAddr> {
    address.strip_prefix("tcp/").unwrap_or(address).parse().ok()
}

/// `address`, a `tcp/IP:PORT` literal, in one spelling: an IPv4 address
/// mapped into IPv6 as IPv4, an IPv6 one in its shortest lower-case text
/// (no scope). `None` for anything else.
fn canonical_address(address: &str) -> Option<String> {
    let socket: SocketAddr = address.strip_prefix("tcp/")?.parse().ok()?;
    Some(format!(
        "tcp/{}",
        SocketAddr::new(socket.ip().to_canonical(), socket.port())
    ))
}

/// The IP address of `address` (see [`socket_of`]).
fn ip_of(address: &str) -> Option<std::net::IpAddr> {
    socket_of(address).map(|socket| socket.ip().to_canonical())
}

/// Whether `address` is on the loopback: it means this host, and passed
/// on to a broker elsewhere it would mean that broker's own host.
fn is_loopback(address: &str) -> bool {
    ip_of(address).is_some_and(|ip| ip.is_loopback())
}

/// Whether `address` reaches one of `listening` (this broker's own TCP
/// listeners) over the loopback: the same port on the listener's own
/// loopback address, or on any loopback address for a listener bound to
/// every address. Such an address would only be a route to itself.
fn is_own_loopback_alias(address: &str, listening: &[SocketAddr]) -> bool {
    let Some(socket) = socket_of(address) else {
        return false;
    };
    let ip = socket.ip().to_canonical();
    ip.is_loopback()
        && listening.iter().any(|listener| {
            let bound = listener.ip().to_canonical();
            listener.port() == socket.port() && (bound.is_unspecified() || bound == ip)
        })
}

/// Whether a route's `remote` is known to be on another host: an address
/// not on the loopback. (A peer dialed by host name, `tcp/localhost:7420`
/// say, is not known to be: no name is looked up on the event loop.)
fn is_elsewhere(remote: &str) -> bool {
    ip_of(remote).is_some_and(|ip| !ip.is_loopback())
}

impl EventLoop {
    /// Route to one more broker (from [`crate::Broker::add_peer`]).
    pub(super) fn add_peer(&mut self, endpoint: String) {
        let now = Instant::now();
        if let Some(slot) = DialSlot::new(&endpoint, now) {
            info!(peer = %endpoint, "peer added");
            self.cluster.slots.push(slot);
            self.cluster.peers_changed = true;
            self.dial_routes(now);
        }
    }

    /// Dial the peers that have no link and whose time has come.
    pub(super) fn dial_routes(&mut self, now: Instant) {
        let Some(endpoint) = self.cluster.dialer else {
            return;
        };
        if self.shared.shutdown.load(Ordering::Relaxed) {
            return;
        }
        let forget_after = self.shared.config.cluster.forget_after();
        let mut learned_dials = self
            .cluster
            .slots
            .iter()
            .filter(|slot| slot.learned && slot.live())
            .filter_map(|slot| slot.session)
            .filter(|id| {
                self.sessions
                    .get(id)
                    .and_then(Session::route)
                    .is_some_and(|route| !route.is_up())
            })
            .count();
        // From the first slot left for later last time: each learned
        // broker gets its turn, whichever others keep failing.
        let count = self.cluster.slots.len();
        let start = self.cluster.dial_from;
        let mut first_deferred = None;
        for step in 0..count {
            let index = (start + step) % count;
            let slot = &mut self.cluster.slots[index];
            if !slot.live() || slot.session.is_some() || now < slot.next_attempt && !slot.deferred {
                continue;
            }
            if slot
                .reached
                .is_some_and(|broker| self.cluster.by_broker.contains_key(&broker))
            {
                // That broker is routed to over the link it dialed.
                slot.next_attempt = now + BACKOFF_MAX;
                slot.last_reached = now;
                continue;
            }
            // One waiting for its turn has not been tried yet.
            if slot.learned
                && !slot.deferred
                && now.saturating_duration_since(slot.last_reached) > forget_after
            {
                info!(peer = %slot.endpoint, "learned peer broker unreachable too long; forgotten");
                slot.forgotten = true;
                self.cluster.peers_changed = true;
                continue;
            }
            if slot.learned {
                if learned_dials >= LEARNED_DIALS_MAX {
                    // Its turn comes as others' dials end (or, at the
                    // latest, at this attempt).
                    slot.deferred = true;
                    slot.next_attempt = now + BACKOFF_MIN;
                    first_deferred.get_or_insert(index);
                    continue;
                }
                learned_dials += 1;
            }
            slot.deferred = false;
            self.dial(index, endpoint, now);
        }
        self.cluster.dial_from = first_deferred.unwrap_or(0);
        if let Some(next) = self.cluster.next_dial() {
            self.schedule(next);
        }
        self.gossip_in_turn(now);
        if std::mem::take(&mut self.cluster.peers_changed) {
            let peers = self
                .cluster
                .slots
                .iter()
                .filter(|slot| slot.live())
                .map(|slot| slot.endpoint.clone());
            let mut shown = self.shared.peers.lock();
            shown.clear();
            shown.extend(peers);
        }
    }

    fn dial(&mut self, index: usize, endpoint: usize, now: Instant) {
        let slot = &self.cluster.slots[index];
        let peer = match self.endpoints[endpoint].connect(&slot.address) {
            Ok(peer) => peer,
            Err(err) => {
                let reason = err.to_string();
                self.dial_failed(index, now, &reason);
                return;
            }
        };
        // Until its welcome, the peer (an address another broker may have
        // told of) may send no frame past a handshake's size, as a peer
        // that connected here may not before its hello.
        let handshake_limit = HANDSHAKE_FRAME_MAX.min(self.shared.config.max_frame());
        self.endpoints[endpoint].set_receive_limit(peer, Some(handshake_limit));
        let id = self.next_session;
        self.next_session += 1;
        let stats = &self.shared.stats;
        BrokerStats::add(&stats.connections, 1);
        BrokerStats::add(&stats.connections_total, 1);
        let deadline = now + self.shared.config.handshake_timeout();
        let control = Control { endpoint, peer };
        let mut session =
            Session::new(control, slot.endpoint.clone(), self.liveness(now), deadline);
        let mut role = RouteRole::new(Some(index));
        role.seeded = !slot.learned;
        // The route's traffic moves to a data link when both brokers have
        // one in common, as a client's does; without keys it stays here.
        role.link_secret = match LinkSecret::new() {
            Ok(secret) => Some(secret),
            Err(err) => {
                warn!(peer = %slot.endpoint, %err, "no data links for this route");
                None
            }
        };
        session.role = Role::Route(Box::new(role));
        debug!(session = id, peer = %slot.endpoint, "dialing peer broker");
        self.by_peer.insert((endpoint, peer), id);
        self.sessions.insert(id, session);
        self.cluster.slots[index].session = Some(id);
        self.schedule(deadline);
        if self.reads_paused {
            self.endpoints[endpoint].set_read_paused(peer, true);
        }
        // The hello waits for the peer's challenge.
    }

    /// The peer broker's challenge on a route this broker dialed: the
    /// hello (proving the route secret, never sending it) and the route
    /// hello go out.
    pub(super) fn on_route_challenge(&mut self, id: u64, challenge: [u8; 32]) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some(role) = session
            .route_mut()
            .filter(|role| role.dialed() && !role.hello_sent)
        else {
            return;
        };
        role.hello_sent = true;
        let seeded = role.seeded;
        let slot = role.slot;
        let link_auth = role.link_secret.as_ref().map(|s| s.auth().clone());
        let config = &self.shared.config;
        let proof = match config.route_secret() {
            Some(secret) => match crate::session::link_auth::random_bytes() {
                Ok(nonce) => {
                    role.proved = Some((challenge, nonce));
                    let mac = prove(secret, ProofRole::Dialer, &challenge, &nonce);
                    Some(SecretProof { nonce, mac })
                }
                Err(err) => {
                    let text = format!("cannot prove the route secret: {err}");
                    self.fail(id, ErrorCode::Internal, text);
                    return;
                }
            },
            None => None,
        };
        let hello = Frame::Hello(Hello {
            no_echo: false,
            no_responders: false,
            version: PROTOCOL_VERSION,
            name: config.name.clone(),
            credentials: None,
            user: None,
            proof,
            // A datagram link, where both have one, carries what only
            // best-effort subscribers want.
            offers: self.route_offers(slot),
            link_auth,
        });
        let route = Frame::Route(RouteHello {
            broker_id: self.cluster.broker_id,
            advertise: self.cluster.advertise.clone(),
            seeded,
            limits: self.route_limits(),
        });
        self.send(id, codec::encode(&hello), false);
        self.send(id, codec::encode(&route), false);
    }

    fn dial_failed(&mut self, index: usize, now: Instant, reason: &str) {
        let slot = &mut self.cluster.slots[index];
        slot.failures += 1;
        if slot.failures == 1 {
            warn!(peer = %slot.endpoint, %reason, "cannot reach peer broker; retrying");
        } else {
            debug!(peer = %slot.endpoint, %reason, attempts = slot.failures, "peer broker still unreachable");
        }
        slot.next_attempt = now + slot.backoff;
        slot.backoff = (slot.backoff * 2).min(BACKOFF_MAX);
        let next = slot.next_attempt;
        self.schedule(next);
    }

    /// What this broker offers on a route it dialed for `slot`: what its
    /// preference would choose (the peer must not open a path this broker
    /// leaves out), and the control link alone to a peer whose data link
    /// once carried nothing back.
    fn route_offers(&self, slot: Option<usize>) -> Vec<Offer> {
        let silent = slot.is_some_and(|slot| self.cluster.slots[slot].fabric_silent.is_some());
        let preference = &self.shared.config.negotiation.preference;
        self.offers
            .iter()
            .filter(|offer| {
                !endpoints::is_data_scheme(&offer.scheme)
                    || !silent && preference.contains(&offer.scheme)
            })
            .cloned()
            .collect()
    }

    /// Routes this broker dialed whose reliable data link has carried
    /// nothing back for the handshake timeout since it first sent: the
    /// provider may have refused the connection underneath without a word
    /// (`ofi_rxm` does between endpoints set up differently). Each such
    /// route ends with the reason, and its peer is dialed again with the
    /// control link alone. Returns when the next may fall due.
    pub(super) fn silent_route_links(&mut self, now: Instant) -> Option<Instant> {
        let timeout = self.shared.config.handshake_timeout();
        let mut next = None::<Instant>;
        let mut silent = Vec::new();
        for (&id, session) in &self.sessions {
            if matches!(session.state, SessionState::Closing { .. }) || session.cut_off {
                continue;
            }
            let Some(slot) = session.route().and_then(|role| role.slot) else {
                continue;
            };
            let Some(since) = session.conn.links.reliable_silent_since() else {
                continue;
            };
            let due = since + timeout;
            if now >= due {
                let scheme = session
                    .conn
                    .links
                    .reliable
                    .as_ref()
                    .map_or("", |link| link.scheme.as_str());
                silent.push((id, slot, scheme.to_string()));
            } else {
                next = Some(next.map_or(due, |next| next.min(due)));
            }
        }
        for (id, slot, scheme) in silent {
            let reason = format!(
                "{scheme}: the route's data link carried nothing back within {timeout:?} of \
                 its first frame (the provider may have refused the connection: check that \
                 both brokers have the same provider settings)"
            );
            warn!(session = id, %reason, "route data link silent; dialing again without the fabric");
            BrokerStats::add(&self.shared.stats.silent_data_links, 1);
            let reached = self.cluster.slots[slot].reached;
            self.cluster.slots[slot].fabric_silent = Some((reason.clone(), reached));
            // The link is broken: what waits behind it is dropped and
            // counted, and the peer told why on the control link.
            if let Some(session) = self.sessions.get_mut(&id) {
                session.conn.links.failure = Some(reason.clone());
            }
            self.fail(id, ErrorCode::Internal, reason);
            if let Some(session) = self.sessions.get(&id) {
                let control = session.conn.control;
                self.endpoints[control.endpoint].close(control.peer);
            }
        }
        next
    }

    /// A session is gone for good: if it was dialed for a peer, schedule
    /// the next attempt.
    pub(super) fn dialed_session_gone(
        &mut self,
        id: u64,
        reason: &efabus_core::transport::CloseReason,
    ) {
        let now = Instant::now();
        let Some(index) = self
            .cluster
            .slots
            .iter()
            .position(|slot| slot.session == Some(id))
        else {
            return;
        };
        let slot = &mut self.cluster.slots[index];
        slot.session = None;
        if slot.learned {
            // Room for a dial left for later.
            self.schedule(now);
        }
        let slot = &mut self.cluster.slots[index];
        if std::mem::take(&mut slot.superseded) {
            // A redial that then fails before its route is up backs off as
            // any failed dial does.
            slot.was_up = false;
            slot.next_attempt = now + BACKOFF_MAX;
        } else if std::mem::take(&mut slot.was_up) {
            // A route that was up is redialed at once, then with backoff;
            // a learned peer is forgotten only that long after it went.
            slot.backoff = BACKOFF_MIN;
            slot.next_attempt = now;
            slot.last_reached = now;
        } else {
            let reason = format!("link closed before the route came up: {reason}");
            self.dial_failed(index, now, &reason);
        }
        let next = self.cluster.slots[index].next_attempt;
        self.schedule(next);
    }

    /// The peer closed this route as the duplicate of another it keeps
    /// from this broker. Dialed again at once, it would only be closed
    /// again for as long as the peer holds the other, which may be a link
    /// this broker has already dropped (after a one-way outage, until the
    /// peer's heartbeat ends it): so it waits the longest backoff.
    pub(super) fn closed_as_duplicate(&mut self, id: u64) {
        let slot = self
            .sessions
            .get(&id)
            .and_then(|session| session.route())
            .and_then(|role| role.slot);
        if let Some(slot) = slot {
            self.cluster.slots[slot].superseded = true;
        }
    }

    /// A decoded frame on a route's control link; what a route does not
    /// handle comes back for the handling every session shares.
    pub(super) fn on_route_frame(
        &mut self,
        id: u64,
        state: SessionState,
        up: bool,
        frame: Frame,
    ) -> Option<Frame> {
        match (state, frame) {
            (SessionState::AwaitHello { .. }, Frame::Challenge(challenge)) => {
                self.on_route_challenge(id, challenge.nonce)
            }
            (SessionState::AwaitHello { .. }, Frame::Welcome(welcome)) => {
                self.on_route_welcome(id, welcome)
            }
            // Refused at the hello, or (as the open mode lets anyone in)
            // at the route hello.
            (SessionState::AwaitHello { .. }, Frame::Error(error)) => {
                self.route_refused_by_peer(id, &error)
            }
            (SessionState::Ready, Frame::Error(error)) if !up && error.fatal => {
                self.route_refused_by_peer(id, &error)
            }
            (SessionState::Ready, Frame::Route(hello)) => self.on_route_hello(id, hello),
            (SessionState::Ready, Frame::RoutePeers(peers)) if up => {
                self.on_route_peers(id, peers.addresses)
            }
            (SessionState::Ready, Frame::Message(message)) if up => {
                let mut joined = Bytes::new();
                let payload = Payload::of_parts(&message.headers, &message.payload, &mut joined);
                let reply = message.reply.as_deref();
                self.on_route_message(id, message.sid, &message.subject, reply, payload);
            }
            (SessionState::Ready, Frame::Subscribe(subscribe)) if up => {
                self.on_route_subscribe(id, subscribe)
            }
            (SessionState::Ready, Frame::Unsubscribe { sid }) if up => {
                self.on_route_unsubscribe(id, sid)
            }
            (SessionState::Ready, Frame::Publish(_)) => {
                self.fail(
                    id,
                    ErrorCode::Protocol,
                    "a route carries messages, not publishes".to_string(),
                );
            }
            (_, other) => return Some(other),
        }
        None
    }

    /// The peer broker refused the route this broker dialed: say why (at
    /// warn the first time in a row, then at debug: redialing repeats it
    /// every few seconds) and close; the slot redials with backoff.
    fn route_refused_by_peer(&mut self, id: u64, error: &ErrorFrame) {
        let hint = if error.code == ErrorCode::Auth {
            "the route credential (cluster.secret, else auth.secret) must be the same on both brokers"
        } else {
            ""
        };
        let first = self
            .cluster
            .slots
            .iter()
            .find(|slot| slot.session == Some(id))
            .is_none_or(|slot| slot.failures == 0);
        let peer = self
            .sessions
            .get(&id)
            .map(|session| session.remote.clone())
            .unwrap_or_default();
        if first {
            warn!(session = id, %peer, code = ?error.code, text = %error.text, %hint, "peer broker refused the route");
        } else {
            debug!(session = id, %peer, code = ?error.code, text = %error.text, "peer broker refused the route again");
        }
        self.close_session(id);
    }

    /// The welcome to a hello this broker sent as a dialing route.
    pub(super) fn on_route_welcome(&mut self, id: u64, welcome: Welcome) {
        if welcome.version != PROTOCOL_VERSION {
            self.fail(
                id,
                ErrorCode::Version,
                format!(
                    "protocol version {} not supported (this broker speaks {PROTOCOL_VERSION})",
                    welcome.version
                ),
            );
            return;
        }
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        // The welcome must answer this broker's hello, and the peer prove
        // the route secret back: a broker that does not hold it is not the
        // peer meant.
        let (hello_sent, proved) = session
            .route_mut()
            .map_or((false, None), |role| (role.hello_sent, role.proved));
        let secret = self.shared.config.route_secret();
        let proven = match (secret, proved) {
            (Some(secret), Some((challenge, nonce))) => {
                let expected = prove(secret, ProofRole::Acceptor, &challenge, &nonce);
                welcome
                    .proof
                    .is_some_and(|proof| constant_time_eq(&proof, &expected))
            }
            (Some(_), None) => false,
            (None, _) => true,
        };
        if !hello_sent || !proven {
            BrokerStats::add(&self.shared.stats.route_refusals, 1);
            let text = if hello_sent {
                "the peer did not prove it holds the route secret"
            } else {
                "the peer welcomed a hello it never got"
            };
            self.fail(id, ErrorCode::Auth, text.to_string());
            return;
        }
        let slot = self
            .sessions
            .get(&id)
            .and_then(|session| session.route())
            .and_then(|role| role.slot);
        let offers = self.route_offers(slot);
        let silent = slot
            .and_then(|slot| self.cluster.slots[slot].fabric_silent.as_ref())
            .map(|(reason, _)| reason.clone());
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        session.name = super::peer::name_within_limit(welcome.name);
        session.state = SessionState::Ready;
        // Welcomed: its frames may now be as large as any peer's.
        let control = session.conn.control;
        self.endpoints[control.endpoint].set_receive_limit(control.peer, None);
        let up_by = self.now + self.shared.config.handshake_timeout();
        if let Some(role) = session.route_mut() {
            role.up_by = Some(up_by);
        }
        let secret = session.route_mut().and_then(|role| role.link_secret.take());
        let keying = secret
            .as_ref()
            .zip(welcome.link_auth.as_ref())
            .map(|(secret, peer)| Keying {
                secret,
                role: HandshakeRole::Dialer,
                peer,
            });
        let local = LocalPaths {
            offers: &offers,
            preference: &self.shared.config.negotiation.preference,
            tuning: &self.tuning,
        };
        session.negotiate(id, &mut self.endpoints, local, &welcome.offers, keying);
        // First: why the fabric was not offered says more than the
        // negotiation's account of its absence.
        if let Some(silent) = silent {
            session
                .link_reasons
                .insert(0, format!("reliable: {silent}"));
        }
        // The dialing side moves at once; the peer follows when the first
        // frame arrives on the data link.
        session.conn.links.in_use = session.conn.links.reliable.is_some();
        for address in session.conn.links.addresses() {
            self.by_peer.insert(address, id);
        }
        self.session_ready(id);
        if self
            .sessions
            .get(&id)
            .is_some_and(|session| session.conn.links.reliable.is_some())
        {
            // At once, as a client's: the peer asks there for the
            // address's proof, and closes a link unused past the
            // handshake timeout.
            self.send(id, codec::encode(&Frame::Ping { nonce: 0 }), false);
        }
        self.tend_best_effort_link(id, self.now);
    }

    /// The peer's route hello: on a dialed route, the answer; on an
    /// accepted session, the peer broker saying it is one.
    pub(super) fn on_route_hello(&mut self, id: u64, hello: RouteHello) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        match &session.role {
            Role::Route(role) if role.is_up() => {
                self.fail(id, ErrorCode::Protocol, "route hello repeated".into());
                return;
            }
            Role::Route(_) => {}
            Role::Client(_) if !session.may_route => {
                self.refuse_route(id);
                return;
            }
            Role::Client(subscriptions) if !subscriptions.is_empty() => {
                self.fail(
                    id,
                    ErrorCode::Protocol,
                    "a route hello must come before any subscription".into(),
                );
                return;
            }
            Role::Client(_) => {
                session.role = Role::Route(Box::new(RouteRole::new(None)));
                let answer = Frame::Route(RouteHello {
                    broker_id: self.cluster.broker_id,
                    advertise: self.cluster.advertise.clone(),
                    seeded: hello.seeded,
                    limits: self.route_limits(),
                });
                self.send(id, codec::encode(&answer), false);
            }
        }
        if let Some(session) = self.sessions.get_mut(&id) {
            let advertised = hello
                .advertise
                .as_deref()
                .and_then(|address| resolve_advertised(address, &session.remote));
            if let Some(role) = session.route_mut() {
                role.advertised = advertised;
                role.peer_limits = Some(hello.limits);
                // An accepted route is a seed route if its dialer says so.
                if role.slot.is_none() {
                    role.seeded = hello.seeded;
                }
            }
        }
        self.route_established(id, hello.broker_id);
    }

    /// What this broker takes in one message from a route: messages from
    /// routes are held to the starting `limits.max_payload` (the frame
    /// limit of its endpoints is set from it).
    fn route_limits(&self) -> RouteLimits {
        let limits = &self.shared.config.limits;
        RouteLimits {
            max_payload: limits.max_payload,
            max_subject_len: u32::try_from(limits.max_subject_len).unwrap_or(u32::MAX),
            max_subject_tokens: u32::try_from(limits.max_subject_tokens).unwrap_or(u32::MAX),
        }
    }

    /// A message for route `owner` that the peer broker would refuse (over
    /// `limits`, from its route hello): kept back and counted, rather than
    /// sent to end the route.
    pub(super) fn keep_back_from_route(
        &mut self,
        owner: u64,
        limits: &RouteLimits,
        subject: &str,
        payload_len: usize,
    ) {
        BrokerStats::add(&self.shared.stats.route_oversized, 1);
        if let Some(unlogged) = self.cluster.oversized_log.allow(self.now) {
            warn!(
                session = owner,
                %subject,
                payload_len,
                max_payload = limits.max_payload,
                max_subject_len = limits.max_subject_len,
                max_subject_tokens = limits.max_subject_tokens,
                unlogged,
                "message over the peer broker's limits not forwarded"
            );
        }
    }

    /// A peer without the route credential asked to become a route: it is
    /// told why, counted (also against its address, as a failed hello is),
    /// logged at a bounded rate, and closed, before anything of this
    /// broker's interest is sent.
    fn refuse_route(&mut self, id: u64) {
        BrokerStats::add(&self.shared.stats.route_refusals, 1);
        let now = self.now;
        let Some(session) = self.sessions.get(&id) else {
            return;
        };
        if let Some(ip) = remote_ip(&session.remote).filter(|_| !session.guessed) {
            self.auth_guard.failed(ip, now);
        }
        if let Some(unlogged) = self.cluster.refusal_log.allow(now) {
            warn!(
                session = id,
                remote = %session.remote,
                name = %session.name,
                refused_since_last_logged = unlogged,
                "route refused: the peer's hello did not carry cluster.secret"
            );
        }
        // As `fail` does, without its log line per refusal.
        let text = "route refused: opening a route needs the cluster's secret \
                    (cluster.secret) in the hello; a client's credentials do not do";
        self.send(
            id,
            error_frame(ErrorCode::Auth, text.to_string(), true),
            false,
        );
        self.close_session(id);
    }

    fn route_established(&mut self, id: u64, broker: u64) {
        let own = self.cluster.broker_id;
        let Some((slot, remote)) = self.sessions.get(&id).and_then(|session| {
            let role = session.route()?;
            Some((role.slot, session.remote.clone()))
        }) else {
            return;
        };
        if broker == own {
            warn!(peer = %remote, "peer address leads back to this broker; not routing to it");
            if let Some(slot) = slot {
                self.cluster.slots[slot].own = true;
                self.cluster.peers_changed = true;
            }
            self.goodbye(id, "a broker does not route to itself");
            return;
        }
        if let Some(index) = slot {
            let slot = &mut self.cluster.slots[index];
            slot.reached = Some(broker);
            // Another broker at this address, or the same one restarted:
            // this route was dialed without the fabric, so it is dialed
            // again at once, the fabric offered.
            if slot
                .fabric_silent
                .as_ref()
                .is_some_and(|(_, then)| *then != Some(broker))
            {
                slot.fabric_silent = None;
                slot.was_up = true;
                info!(session = id, peer = %remote, broker = %broker_hex(broker), "a new broker where the fabric stayed silent; dialing again with it");
                self.goodbye(id, "dialing again to offer the fabric");
                return;
            }
        }
        if let Some(&other) = self.cluster.by_broker.get(&broker) {
            // Keep the link dialed by the lower id; with the same dialer
            // (one broker listed twice), keep the older link.
            let dialer = |slot: Option<usize>| if slot.is_some() { own } else { broker };
            let other_slot = self
                .sessions
                .get(&other)
                .and_then(|session| session.route())
                .and_then(|role| role.slot);
            if dialer(slot) < dialer(other_slot) {
                info!(session = other, broker = %broker_hex(broker), "two routes to one broker: closing the one dialed by the higher id");
                if let Some(role) = self.sessions.get_mut(&other).and_then(|s| s.route_mut()) {
                    role.duplicate = true;
                }
                self.goodbye(other, DUPLICATE_ROUTE);
            } else {
                info!(session = id, broker = %broker_hex(broker), "two routes to one broker: closing the one dialed by the higher id");
                if let Some(slot) = slot {
                    self.cluster.slots[slot].superseded = true;
                }
                self.goodbye(id, DUPLICATE_ROUTE);
                return;
            }
        }
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some(role) = session.route_mut() else {
            return;
        };
        role.broker_id = Some(broker);
        role.up_by = None;
        let mut report = RouteReport {
            name: session.name.clone(),
            broker_id: broker_hex(broker),
            remote: remote.clone(),
            dialed: slot.is_some(),
            reliable: String::new(),
            best_effort: None,
            link_id: None,
            reasons: session.link_reasons.clone(),
        };
        set_route_paths(
            &mut report,
            session,
            self.endpoints[session.conn.control.endpoint].scheme(),
        );
        let name = report.name.clone();
        // Without a data link, why: a route that fell back to TCP unnoticed
        // is the slow path no one asked for.
        let no_fabric = session
            .conn
            .links
            .reliable
            .is_none()
            .then(|| report.reasons.join("; "));
        if let Some(slot) = slot {
            let slot = &mut self.cluster.slots[slot];
            slot.was_up = true;
            slot.failures = 0;
            slot.backoff = BACKOFF_MIN;
            slot.last_reached = Instant::now();
            if slot.learned {
                // Room for a dial left for later.
                self.schedule(Instant::now());
            }
        }
        let (pending, snapshot) = self.shared.subscriptions.write().route_up();
        let others: Vec<u64> = self.cluster.by_broker.values().copied().collect();
        self.send_interest(&pending, &others);
        self.cluster.by_broker.insert(broker, id);
        BrokerStats::add(&self.shared.stats.routes, 1);
        let path = report.reliable.clone();
        self.shared.routes.lock().insert(id, report);
        info!(
            session = id,
            peer = %remote,
            %name,
            broker = %broker_hex(broker),
            dialed = slot.is_some(),
            %path,
            "route up"
        );
        if let Some(reasons) = no_fabric.filter(|reasons| !reasons.is_empty()) {
            info!(session = id, %reasons, "route on the control link");
        }
        self.send_interest(&snapshot, &[id]);
        self.gossip_route_up(id, broker);
    }

    /// The advertised address of each route in use, with its session.
    fn route_addresses(&self) -> Vec<(u64, String)> {
        self.cluster
            .by_broker
            .values()
            .filter_map(|&route| {
                let advertised = self.sessions.get(&route)?.route()?.advertised.clone()?;
                Some((route, advertised))
            })
            .collect()
    }

    /// A route came up: record the broker reached at its address; on a
    /// seed route, tell it every other broker this one has a route to, and
    /// tell those about it, so each can dial the ones it lacks. (A route to
    /// a learned broker adds nothing the seed did not tell: the periodic
    /// exchange covers what was missed.)
    fn gossip_route_up(&mut self, id: u64, broker: u64) {
        let now = self.now;
        let seeded = self
            .sessions
            .get(&id)
            .and_then(|session| session.route())
            .is_some_and(|role| role.seeded);
        let routes = self.route_addresses();
        let Some(new) = routes
            .iter()
            .find(|(route, _)| *route == id)
            .map(|(_, a)| a.clone())
        else {
            // The peer did not say where it is dialed: tell it the others.
            if seeded {
                self.send_peers(id, routes.into_iter().map(|(_, a)| a).collect());
            }
            return;
        };
        // Reached now: a slot for this address is the same broker.
        for slot in &mut self.cluster.slots {
            // Peers in `peers` keep the spelling they were given.
            if slot.endpoint == new || canonical_address(&slot.endpoint).as_ref() == Some(&new) {
                slot.reached = Some(broker);
                slot.last_reached = now;
            }
        }
        if !seeded {
            return;
        }
        let others: Vec<(u64, String)> = routes.into_iter().filter(|(r, _)| *r != id).collect();
        self.send_peers(id, others.iter().map(|(_, a)| a.clone()).collect());
        for (route, _) in others {
            self.send_peers(route, vec![new.clone()]);
        }
    }

    /// Tell route `id` of `addresses`, in frames of at most
    /// `PEERS_PER_FRAME` addresses (each at most a few hundred bytes, so a
    /// frame stays well under the control frame limit).
    fn send_peers(&mut self, id: u64, mut addresses: Vec<String>) {
        // Loopback addresses only to a broker that may be on this host.
        if self
            .sessions
            .get(&id)
            .is_some_and(|session| is_elsewhere(&session.remote))
        {
            addresses.retain(|address| !is_loopback(address));
        }
        for chunk in addresses.chunks(PEERS_PER_FRAME) {
            let frame = Frame::RoutePeers(RoutePeers {
                addresses: chunk.to_vec(),
            });
            match codec::try_encode(&frame) {
                Ok(encoded) => self.send(id, encoded, false),
                Err(err) => warn!(session = id, %err, "route peers not sent"),
            }
        }
    }

    /// Addresses of brokers a route's peer has routes to: those this
    /// broker neither has a route to nor dials yet are dialed from now on
    /// (learned, so forgotten once unreachable for `forget_after_ms`). A
    /// loopback address is not taken from a broker known to be elsewhere:
    /// it names that broker's host, not this one.
    fn on_route_peers(&mut self, id: u64, addresses: Vec<String>) {
        let now = self.now;
        let elsewhere = self
            .sessions
            .get(&id)
            .is_some_and(|session| is_elsewhere(&session.remote));
        // Compared in one spelling: `[::ffff:a00:2]` and `10.0.0.2` are one
        // broker, not two slots and two routes.
        let spelled = |address: String| canonical_address(&address).unwrap_or(address);
        let routed: HashSet<String> = self
            .route_addresses()
            .into_iter()
            .map(|(_, address)| spelled(address))
            .collect();
        let advertised = self.cluster.advertise.clone().map(spelled);
        // Looked up by address once per frame: a frame of 4,096 addresses
        // checked one by one against 4,096 slots kept the loop busy for
        // tens of milliseconds.
        let mut known: HashMap<String, usize> = HashMap::default();
        let mut reusable = Vec::new();
        let mut learned = 0;
        for (index, slot) in self.cluster.slots.iter().enumerate() {
            if !slot.forgotten {
                known.entry(spelled(slot.endpoint.clone())).or_insert(index);
            } else if slot.session.is_none() {
                reusable.push(index);
            }
            learned += usize::from(slot.learned);
        }
        // Lowest first, as they are taken.
        reusable.reverse();
        let mut added = false;
        for address in addresses.into_iter().take(PEERS_PER_FRAME_MAX) {
            let Some(address) = canonical_address(&address) else {
                continue;
            };
            if crate::config::check_advertised(&address).is_err()
                || elsewhere && is_loopback(&address)
                || is_own_loopback_alias(&address, &self.cluster.tcp_listening)
                || advertised.as_deref() == Some(address.as_str())
                || routed.contains(&address)
            {
                continue;
            }
            // A route vouches for it: a learned peer is kept while some
            // broker still has a route to it.
            if let Some(&index) = known.get(&address) {
                self.cluster.slots[index].last_reached = now;
                continue;
            }
            let Some(mut slot) = DialSlot::new(&address, now) else {
                continue;
            };
            slot.learned = true;
            // Only learned slots are forgotten: taking one keeps the count.
            let index = match reusable.pop() {
                Some(index) => {
                    self.cluster.slots[index] = slot;
                    index
                }
                None if learned < LEARNED_MAX => {
                    learned += 1;
                    self.cluster.slots.push(slot);
                    self.cluster.slots.len() - 1
                }
                None => {
                    debug!(peer = %address, "too many learned peer brokers; not dialing this one");
                    continue;
                }
            };
            known.insert(address.clone(), index);
            info!(peer = %address, "peer broker learned from a route");
            added = true;
        }
        if added {
            self.cluster.peers_changed = true;
            self.dial_routes(now);
        }
    }

    /// Now and then, one route in turn is told every broker this one has
    /// a route to: learned peers stay known while someone reaches them,
    /// and a pair that lost its route longer than `forget_after_ms` (while
    /// both kept others) learns of each other again. One frame per period
    /// per broker, however large the cluster.
    fn gossip_in_turn(&mut self, now: Instant) {
        if now < self.cluster.next_gossip {
            return;
        }
        let period = self.shared.config.cluster.forget_after() / 4;
        self.cluster.next_gossip = now + period.max(Duration::from_millis(10));
        self.schedule(self.cluster.next_gossip);
        let routes = self.route_addresses();
        if routes.is_empty() {
            return;
        }
        self.cluster.gossip_turn = self.cluster.gossip_turn.wrapping_add(1);
        let (to, _) = routes[self.cluster.gossip_turn % routes.len()];
        let others = routes
            .iter()
            .filter(|(route, _)| *route != to)
            .map(|(_, address)| address.clone())
            .collect();
        self.send_peers(to, others);
    }

    /// Say goodbye and close.
    fn goodbye(&mut self, id: u64, reason: &str) {
        let frame = Frame::Goodbye(Goodbye {
            reason: reason.to_string(),
        });
        self.send(id, codec::encode(&frame), false);
        self.close_session(id);
    }

    /// A session is closing: if it was a route in use, forget what its peer
    /// announced and stop counting it.
    pub(super) fn route_gone(&mut self, id: u64) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some(role) = session.route_mut() else {
            return;
        };
        let Some(broker) = role.broker_id.take() else {
            return;
        };
        role.announced.clear();
        {
            let mut table = self.shared.subscriptions.write();
            table.remove_route_owner(id);
            table.route_down();
        }
        if self.cluster.by_broker.get(&broker) == Some(&id) {
            self.cluster.by_broker.remove(&broker);
        }
        self.shared.stats.routes.fetch_sub(1, Ordering::Relaxed);
        self.shared.routes.lock().remove(&id);
        if self.shared.shutdown.load(Ordering::Relaxed) || role.duplicate {
            info!(session = id, peer = %session.remote, broker = %broker_hex(broker), "route closed");
        } else {
            warn!(session = id, peer = %session.remote, name = %session.name, broker = %broker_hex(broker), "route down");
        }
    }

    /// Send the interest announcements made since the last call to every
    /// route in use. Called before messages are forwarded, so that no
    /// message overtakes an announcement made before it was published.
    #[inline]
    pub(super) fn sync_interest(&mut self) {
        let flag = &self.cluster.announcements;
        if flag.load(Ordering::Acquire) && flag.swap(false, Ordering::AcqRel) {
            self.send_announcements();
        }
    }

    #[cold]
    fn send_announcements(&mut self) {
        let changes = self.shared.subscriptions.write().take_interest_changes();
        let routes: Vec<u64> = self.cluster.by_broker.values().copied().collect();
        self.send_interest(&changes, &routes);
    }

    fn send_interest(&mut self, changes: &[InterestChange], routes: &[u64]) {
        if routes.is_empty() {
            return;
        }
        for change in changes {
            let frame = match change {
                InterestChange::Add {
                    sid,
                    pattern,
                    queue,
                    class,
                } => Frame::Subscribe(Subscribe {
                    sid: *sid,
                    pattern: pattern.to_string(),
                    queue: queue.as_deref().map(str::to_string),
                    class: *class,
                }),
                InterestChange::Remove { sid } => Frame::Unsubscribe { sid: *sid },
            };
            let frame = codec::encode(&frame);
            for &id in routes {
                self.send(id, frame.clone(), false);
            }
        }
    }

    /// The peer broker has subscribers on a pattern. An entry refused
    /// (over `limits.max_route_interest`, or a pattern this broker's
    /// limits refuse) is counted and the peer told; its subscribers get
    /// nothing published here until the route is made again.
    pub(super) fn on_route_subscribe(&mut self, id: u64, subscribe: Subscribe) {
        let limit = self.shared.config.limits.max_route_interest;
        let Some(role) = self
            .sessions
            .get_mut(&id)
            .and_then(|session| session.route_mut())
        else {
            return;
        };
        let refusal = if role.announced.len() >= limit
            && !role.announced.contains_key(&subscribe.sid)
        {
            Some((
                ErrorCode::TooManySubscriptions,
                format!(
                    "route interest limit of {limit} reached; {} refused",
                    subscribe.pattern
                ),
            ))
        } else {
            let key = SubRef {
                owner: id,
                sid: subscribe.sid,
            };
            let class = crate::interest::route_class(subscribe.queue.as_deref(), subscribe.class);
            // Replaces whatever the peer announced under this id before.
            let inserted = self.shared.subscriptions.write().insert_route(
                key,
                &subscribe.pattern,
                subscribe.queue.as_deref(),
                class,
            );
            match inserted {
                Ok(()) => {
                    role.announced.insert(subscribe.sid, class);
                    None
                }
                Err(err) => {
                    role.announced.remove(&subscribe.sid);
                    Some((
                        ErrorCode::InvalidSubject,
                        format!("cannot subscribe to {:?}: {err}", subscribe.pattern),
                    ))
                }
            }
        };
        // The inbox the entry under this id lies under now, if any.
        let inbox = inbox_of(&subscribe.pattern)
            .filter(|_| role.announced.contains_key(&subscribe.sid))
            .map(str::to_string);
        let earlier = match &inbox {
            Some(inbox) => role.inboxes.insert(subscribe.sid, inbox.clone()),
            None => role.inboxes.remove(&subscribe.sid),
        };
        if earlier != inbox {
            if let Some(earlier) = earlier {
                self.release_inbox(id, &earlier);
            }
            if let Some(inbox) = &inbox {
                self.hold_inbox(id, inbox);
            }
        }
        if let Some((code, text)) = refusal {
            BrokerStats::add(&self.shared.stats.route_interest_refused, 1);
            // Logged here, and told to the peer (which logs each report),
            // once a second at most: a peer over the limit refuses
            // thousands at once. The stat has them all.
            if let Some(held_back) = self.route_refusal_log.allow(Instant::now()) {
                warn!(session = id, %text, held_back, "route interest refused");
                let text = match held_back {
                    0 => text,
                    more => format!("{text} (and {more} refused before it, not reported)"),
                };
                self.report(id, code, text);
            }
        }
    }

    /// The peer broker has no subscriber left on an entry.
    pub(super) fn on_route_unsubscribe(&mut self, id: u64, sid: u64) {
        if let Some(role) = self
            .sessions
            .get_mut(&id)
            .and_then(|session| session.route_mut())
        {
            if role.announced.remove(&sid).is_some() {
                self.shared
                    .subscriptions
                    .write()
                    .remove_route(SubRef { owner: id, sid });
            }
            if let Some(inbox) = role.inboxes.remove(&sid) {
                self.release_inbox(id, &inbox);
            }
        }
    }

    /// A message forwarded by the peer broker, for the interest this broker
    /// announced as `sid`: to local subscribers only.
    pub(super) fn on_route_message(
        &mut self,
        id: u64,
        sid: u64,
        subject: &str,
        reply: Option<&str>,
        payload: Payload<'_>,
    ) {
        self.tally.route_messages_in += 1;
        // The peer broker accepted the message under its own limit; a
        // limit lowered here since start applies to this broker's clients.
        let max_payload = self.shared.config.limits.max_payload;
        if !self.payload_allowed(id, payload.counted_len(), max_payload) {
            return;
        }
        let matched = self.look_up(subject, Some(sid));
        // The peer sent it to this broker's queue group, whose last member
        // here has gone since: no other broker is given it (one hop).
        if matched.is_ok()
            && crate::interest::LocalInterest::is_group_sid(sid)
            && self.targets.local.is_empty()
            && self.targets.remote.is_empty()
        {
            BrokerStats::add(&self.shared.stats.route_group_undelivered, 1);
        }
        self.deliver_matched(id, subject, reply, payload, matched);
    }
}

#[cfg(test)]
mod tests {
    use super::{
        canonical_address, is_elsewhere, is_loopback, is_own_loopback_alias, resolve_advertised,
        PEERS_PER_FRAME,
    };
    use efabus_core::codec;
    use efabus_core::frame::{Frame, RoutePeers};

    #[test]
    fn a_frame_of_the_longest_advertised_addresses_encodes() {
        let longest = "tcp/[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535".to_string();
        assert!(crate::config::check_advertised(&longest).is_ok());
        let frame = Frame::RoutePeers(RoutePeers {
            addresses: vec![longest; PEERS_PER_FRAME],
        });
        assert!(codec::try_encode(&frame).is_ok());
    }

    /// Gossip passes a loopback address only between brokers of one host:
    /// routes' remotes (dialed `tcp/` endpoints, accepted socket
    /// addresses) and advertised addresses are told apart the same way.
    #[test]
    fn loopback_addresses_are_told_from_others() {
        for (address, loopback, elsewhere) in [
            ("tcp/127.0.0.1:7420", true, false),
            ("127.0.0.5:5000", true, false),
            ("tcp/[::1]:7420", true, false),
            ("[::ffff:127.0.0.1]:5000", true, false),
            ("tcp/10.0.0.2:7420", false, true),
            ("10.0.0.9:5000", false, true),
            // A host name may be this host: not known to be elsewhere.
            ("tcp/localhost:7420", false, false),
            ("tcp/broker-a:7420", false, false),
            ("", false, false),
        ] {
            assert_eq!(is_loopback(address), loopback, "{address}");
            assert_eq!(is_elsewhere(address), elsewhere, "{address}");
        }
    }

    /// Gossip may name this broker by a loopback alias (any 127.x address
    /// reaches a listener bound to every address): not learned.
    #[test]
    fn loopback_aliases_of_this_broker_are_told_apart() {
        let everywhere = ["0.0.0.0:7420".parse().expect("an address")];
        let loopback = ["127.0.0.1:7420".parse().expect("an address")];
        for (address, listening, own) in [
            ("tcp/127.3.4.5:7420", &everywhere, true),
            ("tcp/127.0.0.1:7420", &everywhere, true),
            ("tcp/127.0.0.1:7420", &loopback, true),
            ("tcp/127.3.4.5:7420", &loopback, false),
            ("tcp/127.0.0.1:7421", &everywhere, false),
            ("tcp/10.0.0.2:7420", &everywhere, false),
            ("tcp/localhost:7420", &everywhere, false),
        ] {
            assert_eq!(is_own_loopback_alias(address, listening), own, "{address}");
        }
    }

    /// Spellings of one address are one: a route gossiping 4,096 of them
    /// would otherwise take every learned slot and dial one broker again
    /// and again.
    #[test]
    fn gossiped_addresses_are_compared_in_one_spelling() {
        for alias in [
            "tcp/10.0.0.2:7420",
            "tcp/[::ffff:a00:2]:7420",
            "tcp/[0::ffff:0a00:0002]:7420",
            "tcp/[::FFFF:A00:2]:7420",
            "tcp/[0:0:0:0:0:ffff:10.0.0.2]:7420",
        ] {
            assert_eq!(
                canonical_address(alias).as_deref(),
                Some("tcp/10.0.0.2:7420"),
                "{alias}"
            );
        }
        assert_eq!(
            canonical_address("tcp/[2001:DB8:0:0::1]:7420").as_deref(),
            Some("tcp/[2001:db8::1]:7420")
        );
        for other in ["tcp/node-1:7420", "10.0.0.2:7420", "tcp/10.0.0.2"] {
            assert_eq!(canonical_address(other), None, "{other}");
        }
    }

    #[test]
    fn advertised_addresses_resolve_against_where_the_route_came_from() {
        let resolve = resolve_advertised;
        assert_eq!(
            resolve("tcp/[::FFFF:a00:2]:7420", "10.0.0.9:5000").as_deref(),
            Some("tcp/10.0.0.2:7420"),
            "in the spelling learned addresses are kept in"
        );
        assert_eq!(
            resolve("tcp/10.0.0.2:7420", "10.0.0.9:5000").as_deref(),
            Some("tcp/10.0.0.2:7420"),
            "a specific address is kept"
        );
        assert_eq!(
            resolve("tcp/0.0.0.0:7420", "10.0.0.9:5000").as_deref(),
            Some("tcp/10.0.0.9:7420"),
            "an unspecified host is the one the accepted route came from"
        );
        assert_eq!(
            resolve("tcp/[::]:7420", "tcp/10.0.0.3:7420").as_deref(),
            Some("tcp/10.0.0.3:7420"),
            "or the one dialed"
        );
        assert_eq!(
            resolve("tcp/127.0.0.1:7420", "10.0.0.9:5000").as_deref(),
            Some("tcp/10.0.0.9:7420"),
            "loopback from a peer elsewhere is where it came from"
        );
        assert_eq!(
            resolve("tcp/127.0.0.1:7420", "127.0.0.1:5000").as_deref(),
            Some("tcp/127.0.0.1:7420"),
            "and kept from a peer on loopback"
        );
        let long = format!("tcp/{}:7420", "9".repeat(300));
        for unusable in [
            "shm",
            "tcp/",
            "efa-rdm/x",
            "",
            "tcp/0.0.0.0:1 junk",
            "tcp/10.0.0.2",
            "tcp/10.0.0.2:0",
            "tcp/node-4:7420",
            long.as_str(),
        ] {
            assert_eq!(resolve(unusable, "10.0.0.9:5000"), None, "{unusable:?}");
        }
    }
}
