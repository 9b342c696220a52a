//! The frames efabus peers exchange, as plain values.
//!
//! Control frames (handshake, subscriptions, errors, keepalive) are rare and
//! carry structured data, so they are serde types encoded with bincode.
//! Data frames (publish, message, fragment, credit) are on the hot path and
//! have a fixed little-endian header so payloads are sliced out of the
//! receive buffer, never copied. See [`crate::codec`] for the byte layout.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::caps::Offer;

/// Version of the wire protocol spoken by this build. A peer whose hello
/// carries another major version is refused with [`ErrorCode::Version`].
pub const PROTOCOL_VERSION: u16 = 17;

/// How a subscription wants its messages carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum DeliveryClass {
    /// Every accepted message delivered once, in publisher order per subject.
    #[default]
    Reliable,
    /// May be dropped (e.g. over EFA DGRAM); only whole messages are delivered.
    BestEffort,
}

/// First frame a connecting side sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Wire protocol version the sender speaks ([`PROTOCOL_VERSION`]).
    pub version: u16,
    /// Human-readable name of the sender (node name or client name).
    pub name: String,
    /// The user the sender authenticates as (`auth.users`); the
    /// credentials are then that user's password.
    pub user: Option<String>,
    /// A user's password or a token, if the server requires one (or,
    /// from older clients, the shared secret itself).
    pub credentials: Option<String>,
    /// Proof that the sender holds the shared secret, answering the
    /// acceptor's [`Challenge`]; the secret itself never travels.
    pub proof: Option<SecretProof>,
    /// Data paths the sender can open, best first as configured.
    pub offers: Vec<Offer>,
    /// This side's part of the keys of the data links; data links open
    /// only when both sides give one.
    pub link_auth: Option<LinkAuth>,
    /// Messages this connection publishes are not delivered to its own
    /// subscriptions (NATS's `echo: false`).
    pub no_echo: bool,
    /// A request (a publish with a reply subject) that no subscription
    /// matches is answered at once on its reply subject with a message
    /// whose headers say status 503 (NATS's `no_responders`).
    pub no_responders: bool,
}

/// One side's part in agreeing the keys of a session's data links: an
/// ephemeral X25519 public key, and the id this side gives the links (what
/// messages to it carry). It travels only on the control link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkAuth {
    /// The sender's X25519 public key for this handshake.
    pub key_share: [u8; 32],
    /// The id the sender gives the session's data links.
    pub link_id: u64,
}

/// The accepting side's answer to a valid [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// Wire protocol version the accepting side speaks.
    pub version: u16,
    /// Human-readable name of the accepting side (its node name).
    pub name: String,
    /// Data paths the accepting side can open.
    pub offers: Vec<Offer>,
    /// Largest payload the server accepts in one publish.
    pub max_payload: u64,
    /// The accepting side's part of the data links' keys (see [`Hello`]).
    pub link_auth: Option<LinkAuth>,
    /// Longest subject, in bytes, the server accepts: a client checks its
    /// subjects against this rather than its own default.
    pub max_subject_len: u32,
    /// Most tokens of a subject the server accepts.
    pub max_subject_tokens: u32,
    /// The accepting side's own proof of the shared secret, for a hello
    /// that proved it: the dialer checks it before going on.
    pub proof: Option<[u8; 32]>,
}

/// The first frame on a new connection, from the accepting side: a fresh
/// random value that a hello proves the shared secret against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Challenge {
    /// The acceptor's random value for this connection.
    pub nonce: [u8; 32],
}

/// A dialer's proof of the shared secret: its own fresh value and the
/// keyed hash over both (see [`crate::secret::prove`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretProof {
    /// The dialer's random value for this handshake.
    pub nonce: [u8; 32],
    /// The dialer's proof over the challenge and `nonce`.
    pub mac: [u8; 32],
}

/// Register interest in a subject pattern.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Subscribe {
    /// Subscription id, chosen by the subscriber, unique per connection.
    pub sid: u64,
    /// Subject pattern to match, with `*` and `>` wildcards.
    pub pattern: String,
    /// Queue group: each message goes to one member of the group.
    pub queue: Option<String>,
    /// How the subscriber wants matching messages carried.
    pub class: DeliveryClass,
}

/// A message sent by a publisher towards the broker (or between brokers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    /// Subject the message is published on (no wildcards).
    pub subject: String,
    /// Subject a responder should answer on, for requests.
    pub reply: Option<String>,
    /// Per-publisher sequence number; 0 when the link does not need one.
    pub seq: u64,
    /// A header block in NATS's form (`NATS/1.0\r\nName: value\r\n\r\n`),
    /// carried as it is; `None` for a message without headers.
    pub headers: Option<Bytes>,
    /// The message body, opaque to efabus.
    pub payload: Bytes,
}

/// A message delivered to a subscriber.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The subscription this delivery is for.
    pub sid: u64,
    /// Subject the message was published on.
    pub subject: String,
    /// Reply subject the publisher gave, if any.
    pub reply: Option<String>,
    /// Per-link sequence number; 0 when the link does not need one.
    pub seq: u64,
    /// The publisher's header block, if it gave one.
    pub headers: Option<Bytes>,
    /// The message body, as published.
    pub payload: Bytes,
}

/// One piece of a frame too large for the link's message size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fragment {
    /// Identifies the fragmented frame within its sender.
    pub msg_id: u64,
    /// Index of this piece, from 0.
    pub index: u32,
    /// Number of pieces in the frame.
    pub count: u32,
    /// Total length of the reassembled frame.
    pub total_len: u32,
    /// This piece's bytes of the encoded frame.
    pub data: Bytes,
}

/// Flow control and acknowledgement, sent by a link's receiving side.
///
/// A credit is cumulative, not additive (see [`crate::credit`]): it says
/// that everything up to `ack_seq` is taken, and that the receiver of this
/// frame may have `messages` wire messages and `bytes` wire bytes in flight
/// beyond it. A newer credit replaces an older one rather than adding to it,
/// so a lost or duplicated credit does no lasting harm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credit {
    /// Wire messages (pieces) the peer may have sent beyond `ack_seq`.
    pub messages: u32,
    /// Wire bytes the peer may have sent beyond `ack_seq`.
    pub bytes: u64,
    /// Every link sequence up to this one has been delivered (or given up)
    /// by the sender of the credit.
    pub ack_seq: u64,
}

/// Error codes carried by [`ErrorFrame`]; stable across versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The frame could not be decoded.
    Malformed,
    /// Wire protocol version not supported.
    Version,
    /// Credentials missing or wrong.
    Auth,
    /// Subject or pattern is not valid.
    InvalidSubject,
    /// Payload larger than the server's limit.
    PayloadTooLarge,
    /// Too many subscriptions for this connection.
    TooManySubscriptions,
    /// The server has reached its connection limit.
    TooManyConnections,
    /// The handshake did not complete in time.
    HandshakeTimeout,
    /// The peer fell too far behind and was disconnected.
    SlowConsumer,
    /// A frame arrived that the protocol does not allow at this point.
    Protocol,
    /// No responder for a request.
    NoResponders,
    /// Anything else; the text says what.
    Internal,
    /// Too many failed attempts from the peer's address; the text says
    /// when to retry (a client retries with its backoff).
    RateLimited,
    /// The user may not publish to that subject or subscribe to that
    /// pattern; the text names both and the permission.
    PermissionDenied,
}

/// Reports a problem to the peer. `fatal` means the sender closes the link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorFrame {
    /// What kind of problem, for programs.
    pub code: ErrorCode,
    /// What went wrong, for people.
    pub text: String,
    /// Whether the sender closes the link after this frame.
    pub fatal: bool,
}

/// Sent after [`Hello`] by a broker that connects to another broker as a
/// route (and answered with the accepting broker's own `RouteHello`): the
/// link then carries interest (subscribe/unsubscribe) and messages both
/// ways, and is never used to forward onwards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteHello {
    /// Identifies the sending broker process; chosen at random when it
    /// starts, so a restarted broker is a new one.
    pub broker_id: u64,
    /// Where other brokers dial this one for routes (`tcp/HOST:PORT`),
    /// when it says. An unspecified host (`0.0.0.0`, `[::]`) stands for
    /// the address the receiver sees the route come from.
    pub advertise: Option<String>,
    /// The dialing broker dialed the receiver as a seed (a configured
    /// peer): the two tell each other every broker they know, and each
    /// tells its routes about the other. Routes dialed to learned brokers
    /// leave this to the periodic exchange, so a join costs one list.
    pub seeded: bool,
    /// The largest messages the sender takes from routes. The other
    /// broker forwards nothing beyond them (it counts what it keeps
    /// back): a route between brokers with different limits is not ended
    /// by a message only one of them accepts.
    pub limits: RouteLimits,
}

/// What a broker takes in one message from a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteLimits {
    /// Payload bytes (a header block not counted).
    pub max_payload: u64,
    /// Bytes of a subject, and of a reply subject.
    pub max_subject_len: u32,
    /// Tokens of a subject, and of a reply subject.
    pub max_subject_tokens: u32,
}

impl RouteLimits {
    /// Whether a message on `subject` with `reply` and `payload_len`
    /// payload bytes is within these limits.
    pub fn admit(&self, subject: &str, reply: Option<&str>, payload_len: usize) -> bool {
        let fits = |name: &str| {
            name.len() <= self.max_subject_len as usize
                && name.bytes().filter(|&b| b == b'.').count() < self.max_subject_tokens as usize
        };
        payload_len as u64 <= self.max_payload && fits(subject) && reply.is_none_or(fits)
    }
}

/// Sent over a route: the brokers the sender has routes to, by the
/// addresses they advertise. The receiver dials those it has no route to,
/// so a cluster forms its full mesh from any one seed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutePeers {
    /// Each known broker's advertised route address (`tcp/HOST:PORT`).
    pub addresses: Vec<String>,
}

/// Why a side is leaving.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Goodbye {
    /// Why, for logs (e.g. shutting down).
    pub reason: String,
}

/// How many messages the broker discarded for one subscription since its
/// last report (sent by the broker to a client under the `drop-oldest`
/// slow-consumer policy, coalesced and at a bounded rate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dropped {
    /// The subscription the messages were for.
    pub sid: u64,
    /// Messages discarded since the previous report for this subscription
    /// on this connection (a report adds to the ones before it).
    pub count: u64,
}

/// Cuts `text` to at most `max` bytes, at a character boundary: the texts
/// frames carry are bounded, and a cut must leave them valid UTF-8.
pub fn cut_at_char(text: &mut String, max: usize) {
    if text.len() > max {
        let cut = (0..=max)
            .rev()
            .find(|&at| text.is_char_boundary(at))
            .unwrap_or(0);
        text.truncate(cut);
    }
}

/// Bytes at most of the reason a [`Frame::BestEffortClosed`] carries.
pub const MAX_CLOSE_REASON: usize = 512;

/// Every frame of the efabus wire protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Opens the handshake (connecting side).
    Hello(Hello),
    /// Accepts the handshake (accepting side).
    Welcome(Welcome),
    /// Registers a subscription.
    Subscribe(Subscribe),
    /// Ends a subscription.
    Unsubscribe {
        /// The id the subscription was registered with.
        sid: u64,
    },
    /// A message from a publisher.
    Publish(Publish),
    /// A message delivered to a subscription.
    Message(Message),
    /// One piece of a larger frame.
    Fragment(Fragment),
    /// Whole frames back to back, which a data link sequences,
    /// authenticates and acknowledges as one: small messages cost the link
    /// once per run instead of once each. A run holds none of the link's
    /// own frames (runs, fragments, credits); [`crate::codec::open_run`]
    /// takes one apart.
    Run(Bytes),
    /// Flow control and acknowledgement.
    Credit(Credit),
    /// A datagram link's ping, outside the link's sequence: the receiver
    /// answers it as a `Ping` (a `Pong` of the same nonce), and learns
    /// that every sequence up to `sent_through` was sent, so that those
    /// still missing a gap timeout later are settled as any gap is
    /// (counted lost) though nothing later comes. Carrying no sequence, a probe
    /// that is lost leaves no gap to be counted as a lost message.
    Probe {
        /// Chosen by the sender, echoed in the `Pong`.
        nonce: u64,
        /// The highest sequence the sender had sent on the link.
        sent_through: u64,
    },
    /// Keepalive probe; the peer answers with a `Pong` of the same nonce.
    Ping {
        /// Chosen by the sender, echoed in the `Pong`.
        nonce: u64,
    },
    /// Answer to a `Ping`.
    Pong {
        /// The nonce of the `Ping` answered.
        nonce: u64,
    },
    /// Reports a problem to the peer.
    Error(ErrorFrame),
    /// Announces an orderly close.
    Goodbye(Goodbye),
    /// Says that a link between two brokers is a route, after its hello.
    Route(RouteHello),
    /// The brokers a route's peer knows (cluster discovery).
    RoutePeers(RoutePeers),
    /// Messages the broker discarded for a subscription.
    Dropped(Dropped),
    /// The accepting side's first frame: what a shared secret is proven
    /// against.
    Challenge(Challenge),
    /// Ends a subscription once the broker has delivered `total` messages
    /// to it, counted from the first such frame for it (NATS's `UNSUB sid
    /// max`; a NATS queue subscription is counted from its `SUB`, with
    /// `u64::MAX` at first): a queue group's later messages go to its
    /// other members, not to one that will drop them. A later frame
    /// changes the total; one already reached ends the subscription.
    UnsubscribeAfter {
        /// The id the subscription was registered with.
        sid: u64,
        /// Deliveries in all, from the first such frame.
        total: u64,
    },
    /// The sender gave its side of the session's datagram (best-effort)
    /// link up, the session going on: the receiver closes its own side,
    /// and best effort goes on the reliable path both ways.
    BestEffortClosed {
        /// The sender has delivered, or counted as lost, every frame the
        /// receiver numbered on the link up to this sequence: the receiver
        /// counts those above it it sent unconfirmed.
        settled_through: u64,
        /// The sender's frames on the link up to this sequence went: the
        /// receiver counts those it lacks of them as lost (the sender,
        /// which cannot know which arrived, counts none of them).
        sent_through: u64,
        /// The link's epoch (see [`Frame::BestEffortReopen`]): a notice
        /// that comes after the link was opened again closes nothing.
        epoch: u32,
        /// Why, for the receiver's reports: at most [`MAX_CLOSE_REASON`]
        /// bytes (see [`Frame::best_effort_closed`]).
        reason: String,
    },
    /// The side that dialed opens the session's datagram link again, some
    /// time after it was given up: the receiver opens its side too, where
    /// it still has the endpoint, and the link proves itself as at the
    /// handshake; a receiver that does not is silent, and the dialer gives
    /// the link up again when no credit comes.
    BestEffortReopen {
        /// Whose keys and link ids the link takes: 1 for the first
        /// reopening, each later one higher (the handshake's link is 0).
        epoch: u32,
    },
}

impl Frame {
    /// A [`Frame::BestEffortClosed`] saying `reason`, cut (at a character)
    /// to [`MAX_CLOSE_REASON`] bytes.
    pub fn best_effort_closed(
        settled_through: u64,
        sent_through: u64,
        epoch: u32,
        mut reason: String,
    ) -> Frame {
        cut_at_char(&mut reason, MAX_CLOSE_REASON);
        Frame::BestEffortClosed {
            settled_through,
            sent_through,
            epoch,
            reason,
        }
    }
}
