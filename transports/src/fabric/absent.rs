//! The fabric endpoint type in a build without libfabric: it cannot be
//! made (opening one reports why libfabric is missing), so code written
//! against it, such as tests that skip when the fabric is unavailable,
//! still compiles.

use efabus_core::transport::{
    Endpoint, Event, OutFrame, PeerId, Readiness, SendError, TransportError,
};

/// No value of this type exists in a build without libfabric.
pub struct FabricEndpoint {
    never: Never,
}

enum Never {}

impl FabricEndpoint {
    /// See the libfabric build's `claim_address`.
    #[cfg(feature = "testing")]
    pub fn claim_address(&mut self, _addr: &[u8]) {
        match self.never {}
    }

    /// See the libfabric build's `claim_header_version`.
    #[cfg(feature = "testing")]
    pub fn claim_header_version(&mut self, _version: u8) {
        match self.never {}
    }
}

impl Endpoint for FabricEndpoint {
    fn scheme(&self) -> &str {
        match self.never {}
    }

    fn local_addr(&self) -> Vec<u8> {
        match self.never {}
    }

    fn max_frame(&self) -> usize {
        match self.never {}
    }

    fn connect(&mut self, _addr: &str) -> Result<PeerId, TransportError> {
        match self.never {}
    }

    fn send(&mut self, _peer: PeerId, _frame: OutFrame) -> Result<(), SendError> {
        match self.never {}
    }

    fn poll(&mut self, _events: &mut Vec<Event>) -> Result<(), TransportError> {
        match self.never {}
    }

    fn close(&mut self, _peer: PeerId) {
        match self.never {}
    }

    fn readiness(&self) -> Readiness {
        match self.never {}
    }

    fn queued_bytes(&self, _peer: PeerId) -> usize {
        match self.never {}
    }
}
