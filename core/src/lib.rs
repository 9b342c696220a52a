//! efabus-core: the sans-IO heart of efabus.
//!
//! Everything here is pure logic, fed with inputs and the current time and
//! drained for outputs: no sockets, no threads, no clocks. That keeps every
//! protocol rule testable deterministically.
//!
//! - [`subject`]: NATS-style subject and pattern syntax, validation, limits.
//! - [`index`]: the subscription index (token trie, literal cache, queue groups).
//! - [`caps`]: the capability model mirroring libfabric's `fi_info`, its
//!   `fi_info -v` printer and parser, hint matching and peer negotiation.
//! - [`frame`] and [`codec`]: the wire frames and their encoding;
//!   [`headers`]: message header blocks in NATS's form.
//! - [`fragment`] and [`reorder`]: link logic for small-MTU and unordered links.
//! - [`link`]: the link layer built on them: what a session sends and
//!   receives over endpoints that reorder, limit message size or lose messages.
//! - [`credit`]: credit-based flow control keeping a link's sender within
//!   the receiver's posted buffers and memory.
//! - [`budget`]: a memory budget shared by all link receivers of a process.
//! - [`transport`]: the `Transport` and `Endpoint` traits every transport implements.

#![warn(missing_docs)]

pub mod budget;
pub mod caps;
pub mod codec;
pub mod credit;
pub mod fragment;
pub mod frame;
pub mod headers;
pub mod index;
pub mod link;
pub mod log_limit;
pub mod reorder;
pub mod secret;
pub mod subject;
pub mod transport;
