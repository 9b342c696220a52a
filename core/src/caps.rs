//! Capability model mirroring libfabric's `fi_info` (placeholder; see issue 2).

use serde::{Deserialize, Serialize};

/// Mirror of `struct fi_info`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FabricInfo {}

/// What one side can open as a data path, sent in the handshake.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {}
