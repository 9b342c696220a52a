//! efabus: a subject-based message broker for clusters that talk over AWS EFA.
//!
//! This facade re-exports the public API of the workspace crates.

pub use efabus_core as core;
pub use efabus_transports as transports;
