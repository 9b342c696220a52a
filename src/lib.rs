//! efabus: a subject-based message broker for clusters that talk over AWS EFA.
//!
//! This facade re-exports the public API of the workspace crates: the
//! embedded [`Broker`], the remote [`Client`], their [`Config`], and the
//! lower layers as [`core`], [`transports`] and [`broker`].

pub use efabus_broker as broker;
pub use efabus_core as core;
pub use efabus_transports as transports;

pub use bytes::Bytes;
pub use efabus_broker::{
    Broker, BrokerStats, Client, ClientOptions, Config, ConnectionState, Error, Message, PubSub,
    RecvError, SlowConsumerPolicy, Subscription,
};
