//! The shared endpoint conformance suite over the fabric endpoints, on this
//! machine's loopback-capable libfabric providers: RDM over `tcp;ofi_rxm`,
//! `udp;ofi_rxd`, `sockets` and `shm` (the `shm` scheme), DGRAM over
//! `udp`. What only the fabric
//! endpoints do is tested in `fabric_behaviour.rs`.
//!
//! Fabric endpoints are connectionless ([`LinkStyle::InsertPeer`]): the
//! connect/accept cases (accept, failed connect, orderly close heard by the
//! other side, drop closing links) do not apply; [`close_locally`] is their
//! close case. Which other cases run, and why some do not:
//! - RDM runs every connectionless case, except two on `sockets`:
//!   [`readiness_fd`], as it is polled (`Readiness::MustPoll`: its wait set
//!   blocks its own progress thread under load, see the endpoint's set-up);
//!   and [`backpressure`], as its progress thread takes messages into the
//!   provider's own unexpected-message buffers whether or not the receiver
//!   polls, so a sender is not reliably held back by an idle receiver (the
//!   case's fill phase may never end). Broker links do not rely on it: their
//!   credit window bounds what a sender has in flight.
//! - `shm` has no wait set (as efa on libfabric 1.17), so it is polled and
//!   [`readiness_fd`] does not apply; it runs every other case.
//! - DGRAM is unreliable ([`EndpointFactory::reliable`] is false): the cases
//!   that count every frame sent under load are left out; those that send
//!   single frames to a polled receiver run.
//!
//! [`EndpointFactory::sized_for`] gives [`large_frames`] buffers that hold
//! its 4 MiB frames (few of them, to keep memory small); other cases use
//! 16 KiB buffers (RDM) or the provider's datagram limit (DGRAM).
//!
//! The fabric endpoint bounds what it has in flight by `tx_depth` (shared
//! by its peers), not by `EndpointConfig::queue_bytes`; the factory sets a
//! `tx_depth` whose bytes stay within the bound [`backpressure`] checks.
//!
//! A provider that cannot open here skips its tests with a message, unless
//! `EFABUS_REQUIRE_FABRIC=1` (CI), which turns the skip into a failure.
//!
//! [`LinkStyle::InsertPeer`]: efabus_transports::conformance::LinkStyle
//! [`close_locally`]: efabus_transports::conformance::close_locally
//! [`readiness_fd`]: efabus_transports::conformance::readiness_fd
//! [`large_frames`]: efabus_transports::conformance::large_frames
//! [`backpressure`]: efabus_transports::conformance::backpressure
//! [`EndpointFactory::reliable`]: efabus_transports::conformance::EndpointFactory::reliable
//! [`EndpointFactory::sized_for`]: efabus_transports::conformance::EndpointFactory::sized_for

use efabus_core::transport::{Endpoint, EndpointConfig, FabricOptions, Transport, TransportError};
use efabus_transports::conformance::{EndpointFactory, LinkStyle};
use efabus_transports::fabric::{EpKind, FabricTransport};

/// Receives kept posted and sends in flight for most cases: 16 sends of
/// [`backpressure`](efabus_transports::conformance::backpressure)'s 8 KiB
/// frames stay within its 128 KiB bound.
const RX_DEPTH: usize = 64;
const TX_DEPTH: usize = 16;
/// RDM buffer size for most cases.
const MSG_SIZE: usize = 16384;

/// Room for what a fabric endpoint puts in a message besides the frame:
/// its header with the longest sender address it carries.
const FRAME_HEADER_ROOM: usize = efabus_transports::fabric::layout::BufferLayout::header_len(
    efabus_transports::fabric::layout::MAX_ADDR_LEN,
);

fn required() -> bool {
    std::env::var("EFABUS_REQUIRE_FABRIC").is_ok_and(|v| v.trim() == "1")
}

/// Fabric endpoints of one kind and provider on 127.0.0.1.
struct FabricFactory {
    kind: EpKind,
    provider: &'static str,
}

impl FabricFactory {
    /// The factory, or None (after a message) when the provider cannot
    /// open an endpoint here and the fabric is not required.
    fn available(kind: EpKind, provider: &'static str) -> Option<FabricFactory> {
        let factory = FabricFactory { kind, provider };
        match factory.open_bound(factory.config()) {
            Ok(_) => Some(factory),
            Err(TransportError::Unavailable { reason, .. }) => {
                assert!(
                    !required(),
                    "EFABUS_REQUIRE_FABRIC=1 but {provider} ({}) is unavailable: {reason}",
                    kind.fi_name()
                );
                eprintln!(
                    "skipping: {provider} ({}) is unavailable: {reason} \
                     (set EFABUS_REQUIRE_FABRIC=1 to fail instead)",
                    kind.fi_name()
                );
                None
            }
            Err(err) => panic!("{}: cannot open an endpoint: {err}", factory.name()),
        }
    }

    fn transport(&self) -> FabricTransport {
        match self.kind {
            EpKind::Rdm if self.provider == "shm" => FabricTransport::shm(),
            EpKind::Rdm => FabricTransport::rdm(),
            EpKind::Dgram => FabricTransport::dgram(),
        }
    }
}

impl EndpointFactory for FabricFactory {
    fn name(&self) -> String {
        format!("{} via {}", self.transport().scheme(), self.provider)
    }

    fn style(&self) -> LinkStyle {
        LinkStyle::InsertPeer
    }

    fn reliable(&self) -> bool {
        self.kind == EpKind::Rdm
    }

    fn config(&self) -> EndpointConfig {
        EndpointConfig {
            fabric: Some(FabricOptions {
                provider: self.provider.into(),
                rx_depth: RX_DEPTH,
                tx_depth: TX_DEPTH,
                msg_size: (self.kind == EpKind::Rdm).then_some(MSG_SIZE),
                ..FabricOptions::default()
            }),
            ..EndpointConfig::default()
        }
    }

    fn open_bound(&self, config: EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        self.transport().open(&EndpointConfig {
            bind: Some("127.0.0.1".into()),
            ..config
        })
    }

    /// Buffers for frames of `frame` bytes plus the endpoint's own header
    /// (at most [`FRAME_HEADER_ROOM`]), four each way.
    fn sized_for(&self, mut config: EndpointConfig, frame: usize) -> EndpointConfig {
        let options = config.fabric.get_or_insert_with(FabricOptions::default);
        options.msg_size = Some(frame + FRAME_HEADER_ROOM);
        options.rx_depth = 4;
        options.tx_depth = 4;
        config
    }
}

/// One `#[test]` per case for a provider, skipped when it is unavailable.
macro_rules! fabric_cases {
    ($module:ident, $kind:expr, $provider:literal => $($case:ident),+ $(,)?) => {
        mod $module {
            use super::*;
            $(
                #[test]
                fn $case() {
                    if let Some(factory) = FabricFactory::available($kind, $provider) {
                        efabus_transports::conformance::$case(&factory);
                    }
                }
            )+
        }
    };
}

fabric_cases!(rdm_tcp_rxm, EpKind::Rdm, "tcp;ofi_rxm" =>
    exchange_both_ways,
    large_frames,
    too_large_rejected,
    malformed_frame_rejected,
    unknown_peer_rejected,
    many_peers,
    backpressure,
    readiness_fd,
    close_locally,
);

fabric_cases!(rdm_udp_rxd, EpKind::Rdm, "udp;ofi_rxd" =>
    exchange_both_ways,
    large_frames,
    too_large_rejected,
    malformed_frame_rejected,
    unknown_peer_rejected,
    many_peers,
    backpressure,
    readiness_fd,
    close_locally,
);

fabric_cases!(rdm_sockets, EpKind::Rdm, "sockets" =>
    exchange_both_ways,
    large_frames,
    too_large_rejected,
    malformed_frame_rejected,
    unknown_peer_rejected,
    many_peers,
    close_locally,
);

fabric_cases!(rdm_shm, EpKind::Rdm, "shm" =>
    exchange_both_ways,
    large_frames,
    too_large_rejected,
    malformed_frame_rejected,
    unknown_peer_rejected,
    many_peers,
    backpressure,
    close_locally,
);

fabric_cases!(dgram_udp, EpKind::Dgram, "udp" =>
    too_large_rejected,
    malformed_frame_rejected,
    unknown_peer_rejected,
    readiness_fd,
    close_locally,
);
