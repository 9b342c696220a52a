//! efabus-broker: the event loop, sessions, fan-out, flow control, the
//! embedded API and the client. The `efabus` command is the `efabus-cli`
//! package, built on this crate's public API.
//!
//! # Embedded use
//!
//! ```no_run
//! use std::time::Duration;
//! use efabus_broker::{Broker, Config};
//!
//! let broker = Broker::start(Config::embedded_default())?;
//! let metrics = broker.subscribe("metrics.>")?;
//! broker.publish("metrics.gpu0", &b"42"[..])?;
//! let message = metrics.recv_timeout(Duration::from_secs(1))?;
//! assert_eq!(&message.payload[..], b"42");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`Client`] offers the same operations against a remote broker; the
//! [`PubSub`] trait lets code be written once for both.
//!
//! # Threads
//!
//! [`Broker`] and [`Client`] are `Send + Sync`: publish and subscribe from
//! any thread. Each runs one background thread for its endpoints. A
//! [`Subscription`] is `Send` and is read by one thread at a time.
//!
//! # Layout
//!
//! The [`Broker`] handle (`broker.rs`) starts an event loop
//! (`event_loop/`) that owns every endpoint and session. Every kind of
//! session (the [`Client`]'s, the broker's view of a client, a route to
//! another broker) is built on one session layer (`session/`): the data
//! links negotiated beside the control link, the outbound queue with its
//! slow-consumer policy, and heartbeats. `docs/ARCHITECTURE.md` draws the
//! data flow.

pub mod accounts;
mod auth_guard;
mod broker;
pub mod client;
mod commands;
pub mod config;
mod delivery;
mod drive;
pub mod endpoints;
pub mod error;
mod event_loop;
mod interest;
pub mod monitoring;
mod publish_cache;
mod published;
pub mod reload;
mod round_watch;
mod session;
mod subscriptions;
mod wait;

use std::time::Duration;

use bytes::Bytes;

pub use broker::{Broker, BrokerStats, RouteReport};
pub use client::{Client, ClientOptions, ConnectionState};
pub use config::{Config, ConfigError, SlowConsumerPolicy};
pub use delivery::{Message, Responder, Subscription, SubscriptionStats};
pub use error::{Error, RecvError};
pub use monitoring::{
    ConnectionKind, ConnectionReport, ListenerReport, MatchReport, RemoteMatch, SessionCounts,
    SubscriptionReport,
};
pub use reload::Reloaded;
pub use round_watch::{EndpointCall, LoopStall};
/// How a session's data links agree their keys (for peers written apart
/// from [`Client`]).
pub use session::link_auth;

/// The operations shared by the embedded [`Broker`] and the remote [`Client`].
pub trait PubSub: Send + Sync {
    /// Publish `payload` on a literal subject.
    fn publish(&self, subject: &str, payload: Bytes) -> Result<(), Error>;
    /// Publish with a reply subject.
    fn publish_request(&self, subject: &str, reply: &str, payload: Bytes) -> Result<(), Error>;
    /// Subscribe to a pattern; dropping the subscription unsubscribes.
    fn subscribe(&self, pattern: &str) -> Result<Subscription, Error>;
    /// Subscribe as one member of a queue group.
    fn queue_subscribe(&self, pattern: &str, group: &str) -> Result<Subscription, Error>;
    /// Send a request and wait for the first reply.
    fn request(&self, subject: &str, payload: Bytes, timeout: Duration) -> Result<Message, Error>;
    /// Wait until what was published so far has been processed.
    fn flush(&self, timeout: Duration) -> Result<(), Error>;
}

macro_rules! impl_pubsub {
    ($ty:ty) => {
        impl PubSub for $ty {
            fn publish(&self, subject: &str, payload: Bytes) -> Result<(), Error> {
                <$ty>::publish(self, subject, payload)
            }
            fn publish_request(
                &self,
                subject: &str,
                reply: &str,
                payload: Bytes,
            ) -> Result<(), Error> {
                <$ty>::publish_request(self, subject, reply, payload)
            }
            fn subscribe(&self, pattern: &str) -> Result<Subscription, Error> {
                <$ty>::subscribe(self, pattern)
            }
            fn queue_subscribe(&self, pattern: &str, group: &str) -> Result<Subscription, Error> {
                <$ty>::queue_subscribe(self, pattern, group)
            }
            fn request(
                &self,
                subject: &str,
                payload: Bytes,
                timeout: Duration,
            ) -> Result<Message, Error> {
                <$ty>::request(self, subject, payload, timeout)
            }
            fn flush(&self, timeout: Duration) -> Result<(), Error> {
                <$ty>::flush(self, timeout)
            }
        }
    };
}

impl_pubsub!(Broker);
impl_pubsub!(Client);
