//! The broker's view of one peer: a [`Session`] (a client, or a route to
//! another broker, see [`super::route`]) and the handling of what a client
//! session sends: the handshake with its negotiation of data paths,
//! subscriptions and publishes.

use std::time::Instant;

use efabus_core::caps::Offer;
use efabus_core::codec;
use efabus_core::frame::{self, DeliveryClass, ErrorCode, Frame, Welcome, PROTOCOL_VERSION};
use efabus_core::subject;
use rustc_hash::FxHashMap as HashMap;
use tracing::{debug, info};

use super::route::RouteRole;
use super::EventLoop;
use crate::broker::{constant_time_eq, BrokerStats};
use crate::endpoints;
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
    /// An error or goodbye was sent; close once it is flushed.
    Closing,
}

/// One peer of the broker: a client, or a route to another broker.
pub(super) struct Session {
    /// Control link, data links, outbound queue, heartbeats.
    pub conn: Connection,
    pub remote: String,
    pub name: String,
    pub state: SessionState,
    /// A client's subscription ids and how each wants its messages carried.
    pub subscriptions: HashMap<u64, DeliveryClass>,
    /// Deliveries encoded since the last hand-off, newer than everything
    /// in the outbound queue; handed on at the end of the loop round.
    pub batch: Batch,
    /// Since when the queue has been over its bound under the block policy.
    pub over_since: Option<Instant>,
    /// Disconnected as a slow consumer: its queue was dropped, and what is
    /// still routed to it before it is gone is dropped too.
    pub cut_off: bool,
    /// Set when the session is a route to another broker.
    pub route: Option<Box<RouteRole>>,
}

impl Session {
    pub fn new(control: Control, remote: String, liveness: Liveness, deadline: Instant) -> Session {
        Session {
            conn: Connection::new(control, liveness),
            remote,
            name: String::new(),
            state: SessionState::AwaitHello { deadline },
            subscriptions: HashMap::default(),
            batch: Batch::default(),
            over_since: None,
            cut_off: false,
            route: None,
        }
    }

    /// Whether the session is a route that completed its handshake.
    pub fn is_route(&self) -> bool {
        self.route.as_ref().is_some_and(|route| route.is_up())
    }

    /// The earliest time the session has something to do by time alone:
    /// its handshake deadline, heartbeats, lossy links, or the block
    /// policy's limit (`block_timeout`).
    pub fn poll_timeout(&self, block_timeout: std::time::Duration) -> Instant {
        let own = match self.state {
            SessionState::AwaitHello { deadline } => deadline,
            _ => self.conn.poll_timeout(),
        };
        match self.over_since {
            Some(since) => own.min(since + block_timeout),
            None => own,
        }
    }
}

impl EventLoop {
    pub(super) fn on_hello(&mut self, id: u64, hello: frame::Hello) {
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
        let Some(session) = self.sessions.get_mut(&id) else {
            return Vec::new();
        };
        let links = &mut session.conn.links;
        let negotiation = links.open(
            &mut self.endpoints,
            &self.offers,
            remote,
            &self.shared.config.negotiation.preference,
            &self.tuning,
        );
        for reason in &negotiation.reasons {
            debug!(session = id, %reason, "negotiation");
        }
        for (endpoint, peer) in links.addresses() {
            self.by_peer.insert((endpoint, peer), id);
        }
        for link in [&links.reliable, &links.best_effort].into_iter().flatten() {
            info!(session = id, link = %link.description, "data path negotiated");
        }
        if negotiation.opened.is_empty() {
            info!(
                session = id,
                "no data path in common; the control link carries everything"
            );
            return self.offers.clone();
        }
        let mut chosen = negotiation.opened;
        chosen.extend(
            self.offers
                .iter()
                .filter(|o| !endpoints::is_data_scheme(&o.scheme))
                .cloned(),
        );
        chosen
    }

    pub(super) fn on_subscribe(&mut self, id: u64, subscribe: frame::Subscribe) {
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
        let inserted = self.shared.subscriptions.write().insert(
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

    /// A client no longer wants subscription `sid`.
    pub(super) fn on_unsubscribe(&mut self, id: u64, sid: u64) {
        if let Some(session) = self.sessions.get_mut(&id) {
            session.subscriptions.remove(&sid);
        }
        self.shared
            .subscriptions
            .write()
            .remove(SubRef { owner: id, sid });
        self.sync_interest();
    }
}
