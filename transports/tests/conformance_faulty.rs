//! The endpoint conformance suite over the fault injector with every rate
//! at zero: wrapped around mem, it must be indistinguishable from mem.

use efabus_core::transport::{Endpoint, EndpointConfig, TransportError};
use efabus_transports::conformance::{EndpointFactory, LinkStyle, MemFactory};
use efabus_transports::fault::{FaultConfig, FaultDirection, FaultyEndpoint};

struct FaultyMemFactory;

fn quiet() -> FaultConfig {
    FaultConfig {
        seed: 1,
        direction: FaultDirection::Both,
        ..FaultConfig::default()
    }
}

impl EndpointFactory for FaultyMemFactory {
    fn name(&self) -> String {
        "faulty+mem (no faults)".into()
    }
    fn style(&self) -> LinkStyle {
        LinkStyle::ConnectAccept
    }
    fn open_bound(&self, config: EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        Ok(Box::new(FaultyEndpoint::new(
            MemFactory.open_bound(config)?,
            quiet(),
        )))
    }
    fn open_client(&self, config: EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        Ok(Box::new(FaultyEndpoint::new(
            MemFactory.open_client(config)?,
            quiet(),
        )))
    }
    fn unreachable_addr(&self) -> String {
        MemFactory.unreachable_addr()
    }
}

efabus_transports::connected_conformance_tests!(FaultyMemFactory);
