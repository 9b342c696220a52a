//! What a running broker reports about its peers, for monitoring: one
//! [`ConnectionReport`] per session (clients and routes) with its links,
//! counters and subscriptions, and [`MatchReport`], which subscriptions a
//! subject reaches. The event loop builds connection reports between
//! rounds when asked ([`crate::Broker::connections`]): a pass over its
//! sessions (and their subscriptions, when asked for them) each time.

use std::time::SystemTime;

/// One listening endpoint, as [`crate::Broker::listeners`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerReport {
    pub scheme: String,
    /// The bound address (`HOST:PORT`, or a fabric address in hex).
    pub address: String,
    /// Why the listener is out of service: a fabric endpoint whose poll
    /// failed stays out (its peers moved to what still works); a TCP
    /// listener whose poll fails is back with its next good poll.
    pub failure: Option<String>,
}

impl ListenerReport {
    pub fn is_up(&self) -> bool {
        self.failure.is_none()
    }
}

/// Messages and bytes one session moved, counted by the event loop.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionCounts {
    /// Message frames received from the peer (publishes; on a route, the
    /// messages the peer forwarded).
    pub messages_in: u64,
    /// Bytes of those frames (headers, subjects and payloads).
    pub bytes_in: u64,
    /// Messages delivered to the peer: handed to its queue (those the
    /// slow-consumer policy discards from it later count in `dropped`
    /// too).
    pub messages_out: u64,
    /// Bytes of the message frames delivered (headers, subjects and
    /// payloads).
    pub bytes_out: u64,
    /// Messages for the peer dropped by the slow-consumer policy or lost
    /// with a cut-off queue.
    pub dropped: u64,
}

/// Whether a session serves a client or a route to another broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionKind {
    Client,
    Route,
}

impl ConnectionKind {
    pub fn name(self) -> &'static str {
        match self {
            ConnectionKind::Client => "client",
            ConnectionKind::Route => "route",
        }
    }
}

/// One subscription of a client, as it asked for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionReport {
    /// The id the client gave it.
    pub sid: u64,
    pub pattern: String,
    pub queue: Option<String>,
    /// Whether it takes best-effort delivery.
    pub best_effort: bool,
}

/// One session of the broker, as [`crate::Broker::connections`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionReport {
    /// The session id (also the owner of its subscriptions).
    pub id: u64,
    pub kind: ConnectionKind,
    /// The name the peer gave in its hello.
    pub name: String,
    /// The user a client logged in as (`auth.users`).
    pub user: Option<String>,
    /// The control link's remote address.
    pub remote: String,
    /// When the session was accepted or dialed.
    pub since: SystemTime,
    /// Whether the handshake is done.
    pub ready: bool,
    /// The path carrying reliable traffic: a data link's description
    /// (`efa-rdm via ...`), or the control link's scheme.
    pub reliable: String,
    /// The best-effort datagram link's description, when there is one.
    pub best_effort: Option<String>,
    /// Why the data paths not taken were not (on TCP: why not the fabric).
    pub reasons: Vec<String>,
    pub counts: SessionCounts,
    /// Bytes queued for the peer and not yet taken by its path.
    pub pending_bytes: u64,
    /// How many subscriptions a client has (0 for a route).
    pub subscription_count: usize,
    /// A client's subscriptions, when the report was asked with them: the
    /// 1,024 with the lowest ids at most (`subscription_count` has them
    /// all).
    pub subscriptions: Vec<SubscriptionReport>,
}

/// Whether a path's description (`efa-rdm via tcp;ofi_rxm ...`, or a
/// control link's scheme) names a fabric data link.
pub fn is_fabric_path(description: &str) -> bool {
    description.contains(" via ")
}

impl ConnectionReport {
    /// Whether reliable traffic rides a fabric data link.
    pub fn on_fabric(&self) -> bool {
        is_fabric_path(&self.reliable)
    }

    /// The fabric link kind (`efa-rdm`, `shm`), or the control link's
    /// scheme.
    pub fn link_kind(&self) -> &str {
        self.reliable
            .split_once(" via ")
            .map_or(self.reliable.as_str(), |(kind, _)| kind)
    }

    /// The libfabric provider of the reliable data link, if on one.
    pub fn provider(&self) -> Option<&str> {
        let (_, rest) = self.reliable.split_once(" via ")?;
        rest.split_whitespace().next()
    }
}

/// Which subscriptions a subject reaches, as [`crate::Broker::matching`]
/// reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MatchReport {
    /// In-process subscriptions (the embedded API).
    pub local: usize,
    /// Remote subscriptions (and routes' interest entries); a queue group
    /// shows the one member picked this time.
    pub remote: Vec<RemoteMatch>,
}

/// One remote subscription a subject reaches.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemoteMatch {
    /// The session (see [`crate::Broker::connections`]).
    pub session: u64,
    /// The subscription's id in that session (a route's: its entry's).
    pub sid: u64,
    pub pattern: String,
    pub queue: Option<String>,
}
