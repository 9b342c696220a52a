//! Errors of the broker, the client and subscriptions.

use efabus_core::frame::ErrorCode;
use efabus_core::subject::SubjectError;
use efabus_core::transport::TransportError;
use efabus_transports::registry::RegistryError;
use thiserror::Error;

use crate::config::ConfigError;

/// Errors from [`crate::Broker`] and [`crate::Client`] operations.
#[derive(Debug, Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("invalid subject {subject:?}: {source}")]
    Subject {
        subject: String,
        #[source]
        source: SubjectError,
    },
    #[error("cannot subscribe to {pattern:?}: {source}")]
    Subscription {
        pattern: String,
        #[source]
        source: efabus_core::index::IndexError,
    },
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    PayloadTooLarge { len: usize, max: u64 },
    #[error("invalid message headers: {0}")]
    Headers(#[from] efabus_core::headers::HeadersError),
    #[error("cannot open {endpoint}: {}", .source.cause())]
    Endpoint {
        endpoint: String,
        #[source]
        source: RegistryError,
    },
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("no reply within {0:?}")]
    Timeout(std::time::Duration),
    #[error("no subscriber for {0}")]
    NoResponders(String),
    #[error("the server refused: {code:?}: {text}")]
    Refused { code: ErrorCode, text: String },
    #[error("not connected to {0} (reconnecting)")]
    NotConnected(String),
    /// The first connection failed and the client does not reconnect.
    #[error("cannot connect to {server}: {reason}")]
    Unreachable { server: String, reason: String },
    #[error("too many subscriptions (limit {0})")]
    TooManySubscriptions(usize),
    #[error("publish blocked for longer than {0:?} by a slow consumer")]
    Blocked(std::time::Duration),
    #[error("the broker or client is shut down, or its event loop has ended")]
    Closed,
    #[error("cannot start the broker thread: {0}")]
    Thread(std::io::Error),
}

impl Error {
    /// What waiting `timeout` for the loop's answer came to: the loop
    /// gone (it drops what it would have answered) is `Closed`.
    pub(crate) fn waiting(
        err: crossbeam_channel::RecvTimeoutError,
        timeout: std::time::Duration,
    ) -> Error {
        match err {
            crossbeam_channel::RecvTimeoutError::Timeout => Error::Timeout(timeout),
            crossbeam_channel::RecvTimeoutError::Disconnected => Error::Closed,
        }
    }
}

/// Errors from receiving on a [`crate::Subscription`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum RecvError {
    #[error("no message within the timeout")]
    Timeout,
    #[error("no message waiting")]
    Empty,
    #[error("subscription closed")]
    Closed,
}
