//! Local selection: matching [`Hints`] against offered [`FabricInfo`]s by
//! the rules `fi_getinfo` applies, with a readable reason for every offer
//! that does not fit.
//!
//! The rules, as libfabric's common checks apply them:
//! - `caps` in the hints must all be offered (`hints.caps ⊆ info.caps`);
//! - `mode` bits in an info are requirements: every one (top level, tx, rx,
//!   domain) must be among the mode bits the hints say the application
//!   honours;
//! - `mr_mode` bits in an info are the registration rules the provider
//!   needs; after dropping the bits that cannot matter for the requested
//!   caps (the RMA-target bits when no remote RMA is asked for, as
//!   `fi_getinfo` does, and `FI_MR_HMEM` unless `FI_HMEM` is asked for,
//!   since it only concerns device buffers) they must all be supported by
//!   the hints;
//! - a non-`UNSPEC` endpoint type, protocol or address format must match;
//! - `msg_order` wanted must be offered on both tx and rx;
//! - sizes asked for (`max_msg_size`, `cq_data_size`) must not exceed what
//!   is offered; a name filter (provider, fabric, domain) must match.
//!
//! A dump taken without hints lists every mode bit a provider may use, some
//! of them optional (EFA RDM's `FI_MSG_PREFIX`); `fi_getinfo` called with
//! hints drops those the application does not set. Checking such a dump is
//! therefore stricter than asking the library.

use std::fmt;

use super::enums::{AddrFormat, EpType, Protocol};
use super::flags::{Caps, Mode, MrMode, MsgOrder};
use super::info::FabricInfo;

/// What the application asks for and what it can honour, like the `hints`
/// argument of `fi_getinfo`. `UNSPEC` values, zero sizes, empty sets and
/// `None` filters ask for nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hints {
    /// Capabilities wanted; every one must be offered.
    pub caps: Caps,
    /// Mode bits the application honours.
    pub mode: Mode,
    /// Registration rules the application can follow.
    pub mr_mode: MrMode,
    /// Endpoint type wanted.
    pub ep_type: EpType,
    /// Address format wanted.
    pub addr_format: AddrFormat,
    /// Wire protocol wanted.
    pub protocol: Protocol,
    /// Ordering wanted in both directions.
    pub msg_order: MsgOrder,
    /// Smallest acceptable `max_msg_size`.
    pub max_msg_size: u64,
    /// Smallest acceptable `cq_data_size`.
    pub cq_data_size: u64,
    /// Provider name, matched case-insensitively against the full (layered)
    /// name: `efa`, `tcp;ofi_rxm`.
    pub provider: Option<String>,
    /// Fabric name (`fabric_attr.name`).
    pub fabric: Option<String>,
    /// Domain name (`domain_attr.name`).
    pub domain: Option<String>,
}

impl Hints {
    /// What efabus needs and honours for a data path of this endpoint type:
    /// messages both ways; the `FI_MSG_PREFIX` mode (it reserves the prefix
    /// in every buffer); registration with `FI_MR_LOCAL`, `FI_MR_VIRT_ADDR`,
    /// `FI_MR_ALLOCATED` and `FI_MR_PROV_KEY`. No ordering is required:
    /// efabus sequences and reorders when `FI_ORDER_SAS` is missing.
    pub fn efabus(ep_type: EpType) -> Hints {
        Hints {
            caps: Caps::MSG | Caps::SEND | Caps::RECV,
            mode: Mode::MSG_PREFIX,
            mr_mode: MrMode::LOCAL | MrMode::VIRT_ADDR | MrMode::ALLOCATED | MrMode::PROV_KEY,
            ep_type,
            ..Hints::default()
        }
    }

    /// The same hints restricted to one provider.
    pub fn with_provider(mut self, provider: impl Into<String>) -> Hints {
        self.provider = Some(provider.into());
        self
    }
}

/// Transmit or receive side of an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Transmit.
    Tx,
    /// Receive.
    Rx,
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::Tx => "tx",
            Direction::Rx => "rx",
        })
    }
}

/// One reason an offer does not fit the hints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// The endpoint type differs.
    EpType {
        /// In the hints.
        wanted: EpType,
        /// In the info.
        offered: EpType,
    },
    /// Capabilities wanted and not offered.
    MissingCaps(Caps),
    /// Mode bits the provider requires and the application does not honour.
    ModeNotHonoured(Mode),
    /// Registration rules the provider requires and the application does
    /// not support.
    MrModeNotSupported(MrMode),
    /// The address format differs.
    AddrFormat {
        /// In the hints.
        wanted: AddrFormat,
        /// In the info.
        offered: AddrFormat,
    },
    /// The protocol differs.
    Protocol {
        /// In the hints.
        wanted: Protocol,
        /// In the info.
        offered: Protocol,
    },
    /// Ordering wanted and not offered in one direction.
    MsgOrder {
        /// The side lacking it.
        direction: Direction,
        /// The orderings wanted and not offered.
        missing: MsgOrder,
    },
    /// Messages are limited below the size wanted.
    MaxMsgSize {
        /// In the hints.
        wanted: u64,
        /// In the info.
        offered: u64,
    },
    /// Remote CQ data is smaller than wanted.
    CqDataSize {
        /// In the hints.
        wanted: u64,
        /// In the info.
        offered: u64,
    },
    /// The provider name filter does not match.
    Provider {
        /// In the hints.
        wanted: String,
        /// In the info.
        offered: String,
    },
    /// The fabric name filter does not match.
    Fabric {
        /// In the hints.
        wanted: String,
        /// In the info.
        offered: String,
    },
    /// The domain name filter does not match.
    Domain {
        /// In the hints.
        wanted: String,
        /// In the info.
        offered: String,
    },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::EpType { wanted, offered } => {
                write!(f, "endpoint type {offered} offered, {wanted} wanted")
            }
            Mismatch::MissingCaps(caps) => write!(f, "caps not offered: {caps}"),
            Mismatch::ModeNotHonoured(mode) => {
                write!(
                    f,
                    "mode bits required by the provider and not honoured: {mode}"
                )
            }
            Mismatch::MrModeNotSupported(mr) => {
                write!(
                    f,
                    "mr_mode bits required by the provider and not supported: {mr}"
                )
            }
            Mismatch::AddrFormat { wanted, offered } => {
                write!(f, "address format {offered} offered, {wanted} wanted")
            }
            Mismatch::Protocol { wanted, offered } => {
                write!(f, "protocol {offered} offered, {wanted} wanted")
            }
            Mismatch::MsgOrder { direction, missing } => {
                write!(f, "{direction} msg_order lacks {missing}")
            }
            Mismatch::MaxMsgSize { wanted, offered } => {
                write!(f, "max_msg_size {offered} is below the {wanted} wanted")
            }
            Mismatch::CqDataSize { wanted, offered } => {
                write!(f, "cq_data_size {offered} is below the {wanted} wanted")
            }
            Mismatch::Provider { wanted, offered } => {
                write!(f, "provider {offered:?}, not {wanted:?}")
            }
            Mismatch::Fabric { wanted, offered } => write!(f, "fabric {offered:?}, not {wanted:?}"),
            Mismatch::Domain { wanted, offered } => write!(f, "domain {offered:?}, not {wanted:?}"),
        }
    }
}

/// Why an offer was not selected: every rule it fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// Never empty.
    pub mismatches: Vec<Mismatch>,
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, mismatch) in self.mismatches.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{mismatch}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Rejection {}

/// The outcome of matching hints against a list of offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection<'a> {
    /// Offers that fit, in input order.
    pub accepted: Vec<&'a FabricInfo>,
    /// Offers that do not, in input order, each with its reasons.
    pub rejected: Vec<(&'a FabricInfo, Rejection)>,
}

/// Does this offer fit the hints? `Err` lists every rule it fails.
pub fn check(hints: &Hints, info: &FabricInfo) -> Result<(), Rejection> {
    let mut out = Vec::new();

    let offered_type = &info.ep_attr.ep_type;
    if hints.ep_type != EpType::Unspec
        && *offered_type != EpType::Unspec
        && hints.ep_type != *offered_type
    {
        out.push(Mismatch::EpType {
            wanted: hints.ep_type.clone(),
            offered: offered_type.clone(),
        });
    }

    let missing_caps = hints.caps.difference(&info.caps);
    if !missing_caps.is_empty() {
        out.push(Mismatch::MissingCaps(missing_caps));
    }

    let unhonoured = info.required_mode().difference(&hints.mode);
    if !unhonoured.is_empty() {
        out.push(Mismatch::ModeNotHonoured(unhonoured));
    }

    if hints.addr_format != AddrFormat::Unspec
        && info.addr_format != AddrFormat::Unspec
        && hints.addr_format != info.addr_format
    {
        out.push(Mismatch::AddrFormat {
            wanted: hints.addr_format.clone(),
            offered: info.addr_format.clone(),
        });
    }

    name_filter(
        &hints.provider,
        &info.fabric_attr.prov_name,
        &mut out,
        |w, o| Mismatch::Provider {
            wanted: w,
            offered: o,
        },
    );
    name_filter(&hints.fabric, &info.fabric_attr.name, &mut out, |w, o| {
        Mismatch::Fabric {
            wanted: w,
            offered: o,
        }
    });
    name_filter(&hints.domain, &info.domain_attr.name, &mut out, |w, o| {
        Mismatch::Domain {
            wanted: w,
            offered: o,
        }
    });

    let mut unsupported =
        required_mr_mode(&info.domain_attr.mr_mode, &hints.caps).difference(&hints.mr_mode);
    // The 1.x mode bit FI_LOCAL_MR stands for FI_MR_LOCAL.
    if hints.mode.contains(&Mode::LOCAL_MR) {
        unsupported.remove(&MrMode::LOCAL);
    }
    if !unsupported.is_empty() {
        out.push(Mismatch::MrModeNotSupported(unsupported));
    }

    if hints.cq_data_size > info.domain_attr.cq_data_size {
        out.push(Mismatch::CqDataSize {
            wanted: hints.cq_data_size,
            offered: info.domain_attr.cq_data_size,
        });
    }

    if hints.protocol != Protocol::Unspec && hints.protocol != info.ep_attr.protocol {
        out.push(Mismatch::Protocol {
            wanted: hints.protocol.clone(),
            offered: info.ep_attr.protocol.clone(),
        });
    }

    if hints.max_msg_size > info.ep_attr.max_msg_size {
        out.push(Mismatch::MaxMsgSize {
            wanted: hints.max_msg_size,
            offered: info.ep_attr.max_msg_size,
        });
    }

    for (direction, offered) in [
        (Direction::Tx, &info.tx_attr.msg_order),
        (Direction::Rx, &info.rx_attr.msg_order),
    ] {
        let missing = hints.msg_order.difference(offered);
        if !missing.is_empty() {
            out.push(Mismatch::MsgOrder { direction, missing });
        }
    }

    if out.is_empty() {
        Ok(())
    } else {
        Err(Rejection { mismatches: out })
    }
}

/// Split offers into those that fit the hints and those that do not.
pub fn select<'a>(hints: &Hints, infos: &'a [FabricInfo]) -> Selection<'a> {
    let mut selection = Selection {
        accepted: Vec::new(),
        rejected: Vec::new(),
    };
    for info in infos {
        match check(hints, info) {
            Ok(()) => selection.accepted.push(info),
            Err(rejection) => selection.rejected.push((info, rejection)),
        }
    }
    selection
}

fn name_filter(
    wanted: &Option<String>,
    offered: &str,
    out: &mut Vec<Mismatch>,
    make: impl FnOnce(String, String) -> Mismatch,
) {
    if let Some(wanted) = wanted {
        if !wanted.eq_ignore_ascii_case(offered) {
            out.push(make(wanted.clone(), offered.to_string()));
        }
    }
}

/// Can peers target this endpoint's memory with RMA or atomics, given the
/// caps? With RMA/atomics asked for and no direction named, every
/// direction is implied.
fn rma_target_allowed(caps: &Caps) -> bool {
    if (caps.clone() & (Caps::RMA | Caps::ATOMIC)).is_empty() {
        return false;
    }
    let remote = Caps::REMOTE_READ | Caps::REMOTE_WRITE;
    let any_direction = Caps::READ | Caps::WRITE | remote.clone();
    !(caps.clone() & remote).is_empty() || (caps.clone() & any_direction).is_empty()
}

/// The registration bits a provider's `mr_mode` still requires once the
/// requested caps are known (see the module docs).
pub fn required_mr_mode(offered: &MrMode, wanted_caps: &Caps) -> MrMode {
    let mut required = offered.difference(&(MrMode::BASIC | MrMode::SCALABLE));
    if !rma_target_allowed(wanted_caps) {
        if (offered.clone() & (MrMode::LOCAL | MrMode::HMEM)).is_empty() {
            return MrMode::empty();
        }
        required.remove(&(MrMode::RAW | MrMode::VIRT_ADDR | MrMode::PROV_KEY | MrMode::RMA_EVENT));
    }
    if !wanted_caps.contains(&Caps::HMEM) {
        required.remove(&MrMode::HMEM);
    }
    required
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rma_target_rules() {
        assert!(!rma_target_allowed(&(Caps::MSG | Caps::SEND)));
        assert!(rma_target_allowed(&Caps::RMA));
        assert!(rma_target_allowed(&(Caps::RMA | Caps::REMOTE_WRITE)));
        assert!(!rma_target_allowed(&(Caps::RMA | Caps::READ)));
    }

    #[test]
    fn mr_mode_reduction() {
        let efa = MrMode::LOCAL | MrMode::VIRT_ADDR | MrMode::ALLOCATED | MrMode::PROV_KEY;
        let msg_only = Caps::MSG | Caps::SEND | Caps::RECV;
        assert_eq!(
            required_mr_mode(&(efa.clone() | MrMode::HMEM), &msg_only),
            MrMode::LOCAL | MrMode::ALLOCATED
        );
        assert_eq!(required_mr_mode(&efa, &(msg_only | Caps::RMA)), efa);
        // Without FI_MR_LOCAL nothing remains for a message-only user.
        assert!(required_mr_mode(&(MrMode::ALLOCATED | MrMode::PROV_KEY), &Caps::MSG).is_empty());
    }

    #[test]
    fn mismatches_read_well() {
        let text = Rejection {
            mismatches: vec![
                Mismatch::MissingCaps(Caps::RMA | Caps::ATOMIC),
                Mismatch::MsgOrder {
                    direction: Direction::Tx,
                    missing: MsgOrder::SAS,
                },
            ],
        }
        .to_string();
        assert_eq!(
            text,
            "caps not offered: FI_RMA, FI_ATOMIC; tx msg_order lacks FI_ORDER_SAS"
        );
    }
}
