//! How the broker and the client open their endpoints from the
//! configuration, and what they offer for negotiation: which schemes carry
//! data, the config of each endpoint with its typed fabric options (built
//! from the `[fabric]` table), the test-only fault wrapper
//! (`[testing.faults]`, only with the `testing` feature), the offer an
//! endpoint makes, and a negotiated choice as the data link drives it.
//! `efabus caps` uses the same functions, so what it shows is what a live
//! broker does.

use efabus_core::caps::{Choice, FabricInfo, Offer};
use efabus_core::transport::{Endpoint, EndpointConfig, FabricOptions};
use efabus_transports::fabric::layout::HEADER_VERSION;
use efabus_transports::fabric::{
    provider_eager_limit, DGRAM_SCHEME, RDM_SCHEME, SHM_PROVIDER, SHM_SCHEME,
};
use efabus_transports::{nats, tcp};

use crate::config::Config;

/// Schemes whose endpoints carry data for peers negotiated onto them.
pub fn is_data_scheme(scheme: &str) -> bool {
    scheme == RDM_SCHEME || scheme == DGRAM_SCHEME || scheme == SHM_SCHEME
}

/// The scheme of an endpoint string (`scheme/address`, or a scheme
/// alone), unchecked.
pub fn scheme_of(endpoint: &str) -> &str {
    endpoint.split('/').next().unwrap_or(endpoint)
}

/// The offer an endpoint makes: its fi_info (a fabric endpoint's marked
/// with the version of its message header), its address, and a message
/// size no larger than what its buffers hold, so both sides settle on the
/// smaller of their frame limits, and the provider's own eager limit where
/// peers must agree on it. A `shm` endpoint names its host, and offers
/// nothing where the host cannot be told.
pub fn offer_for(endpoint: &dyn Endpoint) -> Option<Offer> {
    let info = endpoint.info()?;
    let mut offer = offer_on(endpoint.scheme(), &info, endpoint.local_addr());
    let capacity = endpoint.max_frame() as u64 + offer.msg_prefix_size;
    offer.max_msg_size = offer.max_msg_size.min(capacity);
    offer.rendezvous_max = endpoint.rendezvous_max() as u64;
    offer.provider_eager_limit =
        provider_eager_limit(&offer.provider).map_or(0, |limit| limit as u64);
    if endpoint.scheme() == SHM_SCHEME {
        offer.host = host_identity()?;
    }
    // A peer refuses an offer past these bounds (and none is sent): one of
    // ours past them (a long $EFABUS_HOST_ID, an application's scheme) is
    // left out, saying why.
    if let Err(reason) = offer.check_sizes() {
        tracing::warn!(scheme = endpoint.scheme(), %reason, "this data path is not offered");
        return None;
    }
    Some(offer)
}

/// The offer of an endpoint of `scheme` opened on `info` at `address`,
/// before [`offer_for`] fits it to the endpoint: a fabric one marked with
/// the version of the message header this build writes.
pub fn offer_on(scheme: &str, info: &FabricInfo, address: Vec<u8>) -> Offer {
    let mut offer = Offer::from_info(scheme, info, address);
    if is_data_scheme(scheme) {
        offer.mark_fabric_header(HEADER_VERSION);
    }
    offer
}

/// The environment variable that sets this host's identity for `shm`
/// (see [`host_identity`]).
pub const HOST_ID_VAR: &str = "EFABUS_HOST_ID";

/// This host as `shm` peers must share it: `EFABUS_HOST_ID` when set (for
/// containers that share a kernel but not `/dev/shm`, give each its own),
/// else its name and the kernel's boot id, so two machines of the same
/// name (or one rebooted) differ, while processes that share the kernel
/// agree. `None` where neither tells.
pub fn host_identity() -> Option<String> {
    if let Some(id) = std::env::var(HOST_ID_VAR)
        .ok()
        .map(|id| id.trim().to_string())
        .filter(|id| !id.is_empty())
    {
        return Some(id);
    }
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .map(|text| text.trim().to_string())
            .filter(|text| !text.is_empty())
    };
    let name = read("/proc/sys/kernel/hostname")?;
    let boot = read("/proc/sys/kernel/random/boot_id")?;
    Some(format!("{name}/{boot}"))
}

/// A negotiated choice of a data scheme as the session layer's data link drives it.
///
/// FI_ORDER_SAS orders how messages are matched to receives, not the order
/// their completions are reported (receive comp_order is FI_ORDER_NONE for
/// `tcp;ofi_rxm` and `udp;ofi_rxd`, and libfabric 2.x no longer reports
/// it): `tcp;ofi_rxm` completes a rendezvous-sized message after smaller
/// ones sent later. Frames leave the endpoint in completion order, so data
/// links always carry sequence numbers and reorder; both sides apply the
/// same rule. `efabus caps` shows choices through this function too, so
/// its view is the one a live link reports.
pub fn as_driven(choice: &Choice) -> Choice {
    let mut choice = choice.clone();
    choice.params.sequence_and_reorder = true;
    choice
}

/// How the broker opens an endpoint of `scheme` (bound at `bind`, if any)
/// from its config; `efabus caps` opens them the same way.
pub fn listener_config(config: &Config, scheme: &str, bind: Option<String>) -> EndpointConfig {
    // TCP endpoints take `[tls]`: listeners accept TLS only, routes dial
    // with it. NATS listeners accept TLS only with it too.
    let options = match scheme {
        tcp::SCHEME => config.tls.endpoint_options(),
        nats::SCHEME => {
            let mut options = nats_options(config);
            options.extend(config.tls.endpoint_options());
            if config.tls.handshake_first {
                options.push(("tls_handshake_first".to_string(), "true".to_string()));
            }
            options
        }
        _ => Vec::new(),
    };
    EndpointConfig {
        bind,
        max_frame: config.max_frame(),
        queue_frames: 65_536,
        queue_bytes: config.limits.max_pending_bytes.min(4 << 20),
        // A broker passes large frames on: its subscribers read them from
        // where they landed.
        fabric: endpoint_options(&config.fabric, scheme).map(|fabric| FabricOptions {
            huge_landing: config.fabric.huge_landing,
            ..fabric
        }),
        options,
    }
}

/// What a NATS listener tells its clients and holds them to, from the
/// config (the broker adds its id as `server_id`).
fn nats_options(config: &Config) -> Vec<(String, String)> {
    let auth = &config.auth;
    let auth_required = auth.secret.is_some() || !auth.users.is_empty();
    // A control line holds a subject, a reply subject or queue group, and
    // a few numbers.
    let control_line = (2 * config.limits.max_subject_len + 256)
        .max(efabus_transports::nats::DEFAULT_MAX_CONTROL_LINE);
    [
        ("server_name", config.name.clone()),
        ("version", env!("CARGO_PKG_VERSION").to_string()),
        ("max_payload", config.limits.max_payload.to_string()),
        ("auth_required", auth_required.to_string()),
        ("max_pings_out", config.heartbeat.max_pings_out.to_string()),
        ("max_control_line", control_line.to_string()),
        (
            "max_subscriptions",
            config.limits.max_subscriptions_per_peer.to_string(),
        ),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_string(), value))
    .collect()
}

/// The fabric options from the config for an endpoint of `scheme`: the
/// `[fabric]` table for the libfabric endpoints (`efa-rdm` takes
/// `provider`, `eager_size` as its buffer size, `rendezvous` and `domain`; `efa-dgram`
/// takes `dgram_provider`; both take `node`, `rx_depth`, `multi_recv`, the polling
/// `wait_fd` and the testing aids), `None` for the others. `efabus caps`
/// lists fabric infos with the same options (print them with
/// [`FabricOptions::describe`] or `Display`).
pub fn endpoint_options(fabric: &crate::config::Fabric, scheme: &str) -> Option<FabricOptions> {
    let defaults = FabricOptions::default();
    let options = match scheme {
        RDM_SCHEME => FabricOptions {
            provider: fabric.provider.trim().to_string(),
            msg_size: fabric.eager_size,
            rendezvous: fabric.rendezvous,
            domain: non_empty(&fabric.domain),
            ..defaults
        },
        DGRAM_SCHEME => FabricOptions {
            provider: fabric.dgram_provider.trim().to_string(),
            ..defaults
        },
        SHM_SCHEME => FabricOptions {
            provider: SHM_PROVIDER.to_string(),
            msg_size: fabric.eager_size,
            rendezvous: fabric.rendezvous,
            ..defaults
        },
        _ => return None,
    };
    Some(FabricOptions {
        node: non_empty(&fabric.node),
        // 0 keeps the transport's default.
        rx_depth: match fabric.rx_depth {
            0 => options.rx_depth,
            depth => depth,
        },
        multi_recv: fabric.multi_recv,
        force_prefix: fabric.test_force_prefix,
        force_mr_local: fabric.test_force_mr_local,
        wait_fd: fabric.polling.wait_fd,
        ..options
    })
}

fn non_empty(text: &str) -> Option<String> {
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// Testing aid: wrap endpoint number `index` in the fault injector when
/// `[testing.faults]` is configured (never in production; only a build
/// with the `testing` feature has the injector).
#[cfg(feature = "testing")]
pub fn with_faults(
    endpoint: Box<dyn Endpoint>,
    faults: Option<&crate::config::Faults>,
    index: usize,
) -> Box<dyn Endpoint> {
    let Some(faults) = faults.filter(|faults| faults.applies_to(endpoint.scheme())) else {
        return endpoint;
    };
    let config = faults.for_stream(index as u64);
    tracing::warn!(
        scheme = endpoint.scheme(),
        ?config,
        "testing.faults is set: injecting faults"
    );
    Box::new(efabus_transports::fault::FaultyEndpoint::new(
        endpoint, config,
    ))
}

/// Without the `testing` feature there is no fault injector: the endpoint
/// is returned as it is. Validation refuses configs that set
/// `[testing.faults]`, so `faults` is `None` unless a config skipped it,
/// which is logged.
#[cfg(not(feature = "testing"))]
pub fn with_faults(
    endpoint: Box<dyn Endpoint>,
    faults: Option<&crate::config::Faults>,
    index: usize,
) -> Box<dyn Endpoint> {
    if faults.is_some() {
        tracing::error!(
            scheme = endpoint.scheme(),
            index,
            "testing.faults is set but {}; no faults are injected",
            crate::config::NO_FAULT_INJECTION
        );
    }
    endpoint
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An endpoint of any scheme with a fabric's info, offering nothing
    /// else.
    struct Named(String);

    impl Endpoint for Named {
        fn scheme(&self) -> &str {
            &self.0
        }
        fn local_addr(&self) -> Vec<u8> {
            vec![1; 16]
        }
        fn max_frame(&self) -> usize {
            1 << 16
        }
        fn connect(
            &mut self,
            _: &str,
        ) -> Result<efabus_core::transport::PeerId, efabus_core::transport::TransportError>
        {
            Ok(efabus_core::transport::PeerId(1))
        }
        fn send(
            &mut self,
            _: efabus_core::transport::PeerId,
            _: efabus_core::transport::OutFrame,
        ) -> Result<(), efabus_core::transport::SendError> {
            Ok(())
        }
        fn poll(
            &mut self,
            _: &mut Vec<efabus_core::transport::Event>,
        ) -> Result<(), efabus_core::transport::TransportError> {
            Ok(())
        }
        fn close(&mut self, _: efabus_core::transport::PeerId) {}
        fn readiness(&self) -> efabus_core::transport::Readiness {
            efabus_core::transport::Readiness::MustPoll
        }
        fn queued_bytes(&self, _: efabus_core::transport::PeerId) -> usize {
            0
        }
        fn info(&self) -> Option<FabricInfo> {
            Some(FabricInfo::tcp(None))
        }
    }

    /// An offer a peer would refuse (here a scheme past 32 bytes) is left
    /// out rather than sent: encoding the hello or welcome holding it
    /// would fail.
    #[test]
    fn an_offer_past_its_bounds_is_not_made() {
        assert!(offer_for(&Named("custom-path".into())).is_some());
        assert!(offer_for(&Named("x".repeat(33))).is_none());
    }

    #[test]
    fn a_broker_s_fabric_endpoints_land_large_frames_in_huge_pages_and_a_client_s_do_not() {
        let mut config = Config::default();
        for scheme in [RDM_SCHEME, SHM_SCHEME] {
            let broker = listener_config(&config, scheme, None)
                .fabric
                .expect("fabric");
            assert!(broker.huge_landing, "{scheme}");
            // What a client opens its data endpoints with.
            let client = endpoint_options(&config.fabric, scheme).expect("fabric");
            assert!(!client.huge_landing, "{scheme}");
        }
        assert!(listener_config(&config, tcp::SCHEME, None).fabric.is_none());
        config.fabric.huge_landing = false;
        let broker = listener_config(&config, SHM_SCHEME, None).fabric;
        assert!(!broker.expect("fabric").huge_landing, "turned off");
    }
}
