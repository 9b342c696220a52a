//! [`FabricInfo`]: a plain-value mirror of libfabric's `struct fi_info`,
//! grouped as `fi_info --verbose` prints it, and the synthesized infos of
//! the transports that are not libfabric (`tcp`, `mem`).
//!
//! Pointers (`handle`, `domain`) are kept as the numbers `fi_info` prints;
//! addresses as the text it prints (`fi_sockaddr_in://127.0.0.1:0`). Every
//! group has an `extra` list of `key: value` lines this build does not know,
//! so a newer dump loses nothing when it is read and printed again.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::enums::{
    AddrFormat, AvType, BusType, EpType, LinkState, Progress, Protocol, ResourceMgmt, Threading,
};
use super::flags::{Caps, CompOrder, Mode, MrMode, MsgOrder, OpFlags};

/// Lines of a group that this build does not know, as `(key, value)`.
pub type ExtraFields = Vec<(String, String)>;

/// Which `fi_info` text layout an info follows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Layout {
    /// libfabric 1.x: `control_progress` and `data_progress`, `comp_order`
    /// in tx and rx attributes, `total_buffered_recv`, `nic: (nil)` when
    /// there is no NIC. Also what a binary built against 1.x headers sees
    /// through `fi_getinfo`, whatever library runs it.
    #[default]
    V1,
    /// libfabric 2.x: one `progress` field; no `comp_order` and no
    /// `total_buffered_recv`.
    V2,
}

/// A libfabric version as `FI_VERSION(major, minor)` packs it and `fi_info`
/// prints it (`1.17`, `200.0`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct FiVersion {
    /// Major version.
    pub major: u16,
    /// Minor version.
    pub minor: u16,
}

impl FiVersion {
    /// `major.minor`.
    pub const fn new(major: u16, minor: u16) -> Self {
        FiVersion { major, minor }
    }

    /// From the packed C value (`major << 16 | minor`).
    pub const fn from_raw(raw: u32) -> Self {
        FiVersion {
            major: (raw >> 16) as u16,
            minor: (raw & 0xFFFF) as u16,
        }
    }

    /// The packed C value.
    pub const fn raw(&self) -> u32 {
        ((self.major as u32) << 16) | self.minor as u32
    }
}

impl std::fmt::Display for FiVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Mirror of `struct fi_info`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FabricInfo {
    /// The text layout this info was read in, or is to be printed in.
    pub layout: Layout,
    /// Capabilities of the endpoint.
    pub caps: Caps,
    /// Mode bits the provider requires the application to honour.
    pub mode: Mode,
    /// Encoding of `src_addr` and `dest_addr`.
    pub addr_format: AddrFormat,
    /// Length in bytes of the binary source address.
    pub src_addrlen: u64,
    /// Length in bytes of the binary destination address.
    pub dest_addrlen: u64,
    /// The source address as `fi_info` prints it; `None` for `(null)`.
    pub src_addr: Option<String>,
    /// The destination address as `fi_info` prints it; `None` for `(null)`.
    pub dest_addr: Option<String>,
    /// The `handle` pointer; `None` for `(nil)`.
    pub handle: Option<u64>,
    /// Transmit context attributes.
    pub tx_attr: TxAttr,
    /// Receive context attributes.
    pub rx_attr: RxAttr,
    /// Endpoint attributes.
    pub ep_attr: EpAttr,
    /// Domain attributes.
    pub domain_attr: DomainAttr,
    /// Fabric attributes.
    pub fabric_attr: FabricAttr,
    /// The NIC, when the provider reports one (`nic: (nil)` otherwise).
    pub nic: Option<Nic>,
    /// Top-level lines this build does not know.
    pub extra: ExtraFields,
}

/// Mirror of `struct fi_tx_attr`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxAttr {
    /// Transmit capabilities.
    pub caps: Caps,
    /// Mode bits the transmit side requires.
    pub mode: Mode,
    /// Default flags of transmit operations.
    pub op_flags: OpFlags,
    /// Ordering of transmit operations.
    pub msg_order: MsgOrder,
    /// Completion ordering; printed in the 1.x layout only.
    pub comp_order: CompOrder,
    /// Largest message `fi_inject` may send.
    pub inject_size: u64,
    /// Transmit queue depth.
    pub size: u64,
    /// Most iovec entries one send may gather.
    pub iov_limit: u64,
    /// Most remote iovec entries one RMA may target.
    pub rma_iov_limit: u64,
    /// Traffic class.
    pub tclass: u32,
    /// Lines of this group this build does not know.
    pub extra: ExtraFields,
}

/// Mirror of `struct fi_rx_attr`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RxAttr {
    /// Receive capabilities.
    pub caps: Caps,
    /// Mode bits the receive side requires.
    pub mode: Mode,
    /// Default flags of receive operations.
    pub op_flags: OpFlags,
    /// Ordering of received operations.
    pub msg_order: MsgOrder,
    /// Completion ordering; printed in the 1.x layout only.
    pub comp_order: CompOrder,
    /// Bytes the provider may buffer for unexpected messages; printed in the
    /// 1.x layout only.
    pub total_buffered_recv: u64,
    /// Receive queue depth.
    pub size: u64,
    /// Most iovec entries one receive may scatter into.
    pub iov_limit: u64,
    /// Lines of this group this build does not know.
    pub extra: ExtraFields,
}

/// Mirror of `struct fi_ep_attr`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpAttr {
    /// Endpoint type (`type` in `fi_info`).
    pub ep_type: EpType,
    /// Wire protocol.
    pub protocol: Protocol,
    /// Version of the wire protocol.
    pub protocol_version: u32,
    /// Largest message one operation carries, prefix included.
    pub max_msg_size: u64,
    /// Bytes reserved at the head of every buffer when `FI_MSG_PREFIX` is in
    /// the mode.
    pub msg_prefix_size: u64,
    /// Largest RMA read-after-write kept in order.
    pub max_order_raw_size: u64,
    /// Largest RMA write-after-read kept in order.
    pub max_order_war_size: u64,
    /// Largest RMA write-after-write kept in order.
    pub max_order_waw_size: u64,
    /// Layout of tag bits for tagged messages.
    pub mem_tag_format: u64,
    /// Transmit contexts per endpoint.
    pub tx_ctx_cnt: u64,
    /// Receive contexts per endpoint.
    pub rx_ctx_cnt: u64,
    /// Size of the authorization key.
    pub auth_key_size: u64,
    /// Lines of this group this build does not know.
    pub extra: ExtraFields,
}

/// Mirror of `struct fi_domain_attr`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainAttr {
    /// The `domain` pointer as printed (`0x0` in a `fi_getinfo` result).
    pub domain: u64,
    /// Domain name (the device, e.g. `rdmap70s0-rdm`).
    pub name: String,
    /// Which calls may run concurrently.
    pub threading: Threading,
    /// 1.x `control_progress`. In the 2.x layout it equals `data_progress`.
    pub control_progress: Progress,
    /// 1.x `data_progress`; 2.x `progress`.
    pub data_progress: Progress,
    /// Whether queues are protected against overruns.
    pub resource_mgmt: ResourceMgmt,
    /// Address vector kind.
    pub av_type: AvType,
    /// Registration rules the provider requires.
    pub mr_mode: MrMode,
    /// Size of a memory registration key.
    pub mr_key_size: u64,
    /// Bytes of remote CQ data a message may carry.
    pub cq_data_size: u64,
    /// Completion queues the domain supports.
    pub cq_cnt: u64,
    /// Endpoints the domain supports.
    pub ep_cnt: u64,
    /// Transmit contexts the domain supports.
    pub tx_ctx_cnt: u64,
    /// Receive contexts the domain supports.
    pub rx_ctx_cnt: u64,
    /// Transmit contexts per endpoint.
    pub max_ep_tx_ctx: u64,
    /// Receive contexts per endpoint.
    pub max_ep_rx_ctx: u64,
    /// Shared transmit contexts per endpoint.
    pub max_ep_stx_ctx: u64,
    /// Shared receive contexts per endpoint.
    pub max_ep_srx_ctx: u64,
    /// Counters the domain supports.
    pub cntr_cnt: u64,
    /// Most iovec entries one registration may cover.
    pub mr_iov_limit: u64,
    /// Domain-wide capabilities.
    pub caps: Caps,
    /// Domain-wide mode bits.
    pub mode: Mode,
    /// Size of the authorization key.
    pub auth_key_size: u64,
    /// Largest provider error data.
    pub max_err_data: u64,
    /// Memory registrations the domain supports.
    pub mr_cnt: u64,
    /// Traffic class.
    pub tclass: u32,
    /// Lines of this group this build does not know.
    pub extra: ExtraFields,
}

/// Mirror of `struct fi_fabric_attr`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FabricAttr {
    /// Fabric name (`efa`, a subnet such as `127.0.0.1/32`).
    pub name: String,
    /// Provider name, layered ones joined by `;` (`tcp;ofi_rxm`).
    pub prov_name: String,
    /// Provider version.
    pub prov_version: FiVersion,
    /// libfabric API version the provider implements.
    pub api_version: FiVersion,
    /// Lines of this group this build does not know.
    pub extra: ExtraFields,
}

/// Mirror of `struct fid_nic`'s attributes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Nic {
    /// `fi_device_attr`.
    pub device: DeviceAttr,
    /// `fi_bus_attr`.
    pub bus: BusAttr,
    /// `fi_link_attr`.
    pub link: LinkAttr,
    /// Lines of this group this build does not know.
    pub extra: ExtraFields,
}

/// Mirror of `struct fi_device_attr`; every field is text in C too.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceAttr {
    /// Device name (`rdmap70s0`).
    pub name: String,
    /// Device id (`0xefa1`).
    pub device_id: String,
    /// Device version.
    pub device_version: String,
    /// Vendor id (`0x1d0f`).
    pub vendor_id: String,
    /// Kernel driver.
    pub driver: String,
    /// Firmware version.
    pub firmware: String,
    /// Lines of this group this build does not know.
    pub extra: ExtraFields,
}

/// Mirror of `struct fi_bus_attr`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BusAttr {
    /// Bus kind.
    pub bus_type: BusType,
    /// Present for (and printed only for) `FI_BUS_PCI`.
    pub pci: Option<PciAttr>,
    /// Lines of this group this build does not know.
    pub extra: ExtraFields,
}

/// Mirror of `struct fi_pci_attr`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciAttr {
    /// PCI domain.
    pub domain_id: u16,
    /// PCI bus.
    pub bus_id: u8,
    /// PCI device.
    pub device_id: u8,
    /// PCI function.
    pub function_id: u8,
    /// Lines of this group this build does not know.
    pub extra: ExtraFields,
}

/// Mirror of `struct fi_link_attr`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkAttr {
    /// Link-level address, as text.
    pub address: String,
    /// Link MTU in bytes.
    pub mtu: u64,
    /// Link speed in bits per second.
    pub speed: u64,
    /// Up, down or unknown.
    pub state: LinkState,
    /// Network kind (`Ethernet`, `InfiniBand`).
    pub network_type: String,
    /// Lines of this group this build does not know.
    pub extra: ExtraFields,
}

/// Queue depth the synthesized `tcp` and `mem` infos report for tx and rx.
pub const SYNTHETIC_QUEUE_DEPTH: u64 = 4096;

/// Version efabus reports as provider version of its own transports.
const EFABUS_PROV_VERSION: FiVersion = FiVersion::new(0, 1);

/// The libfabric API version whose layout the synthesized infos follow.
const SYNTHETIC_API_VERSION: FiVersion = FiVersion::new(1, 17);

impl FabricInfo {
    /// The info efabus's TCP transport describes itself with: an `FI_EP_MSG`
    /// style stream (reliable, connected, every ordering kept), no message
    /// size limit of its own (the wire's 4-byte length is the only bound),
    /// no prefix, no registration. `src` is the listening address, if any.
    pub fn tcp(src: Option<SocketAddr>) -> FabricInfo {
        let caps = Caps::MSG | Caps::SEND | Caps::RECV | Caps::LOCAL_COMM | Caps::REMOTE_COMM;
        let (addr_format, src_addrlen, src_addr) = match src {
            Some(SocketAddr::V4(v4)) => (
                AddrFormat::SockaddrIn,
                16,
                Some(format!("fi_sockaddr_in://{v4}")),
            ),
            Some(SocketAddr::V6(v6)) => (
                AddrFormat::SockaddrIn6,
                28,
                Some(format!("fi_sockaddr_in6://[{}]:{}", v6.ip(), v6.port())),
            ),
            None => (AddrFormat::SockaddrIn, 0, None),
        };
        FabricInfo {
            caps: caps.clone(),
            addr_format,
            src_addrlen,
            src_addr,
            ..FabricInfo::synthetic(
                caps,
                "tcp",
                "efabus-tcp",
                EpType::Msg,
                Protocol::SockTcp,
                Progress::Manual,
            )
        }
    }

    /// The info efabus's in-process transport describes itself with:
    /// reliable, every ordering kept, no size limit, local only.
    pub fn mem() -> FabricInfo {
        let caps = Caps::MSG | Caps::SEND | Caps::RECV | Caps::LOCAL_COMM;
        FabricInfo::synthetic(
            caps,
            "mem",
            "efabus-mem",
            EpType::Rdm,
            Protocol::Unspec,
            Progress::Auto,
        )
    }

    fn synthetic(
        caps: Caps,
        fabric: &str,
        provider: &str,
        ep_type: EpType,
        protocol: Protocol,
        progress: Progress,
    ) -> FabricInfo {
        // Every basic ordering: the byte stream or the in-process queue
        // delivers frames exactly in send order.
        let order = MsgOrder::from_bits(0x1FF);
        let tx_caps = caps.difference(&Caps::RECV);
        let rx_caps = caps.difference(&Caps::SEND);
        FabricInfo {
            layout: Layout::V1,
            caps: caps.clone(),
            tx_attr: TxAttr {
                caps: tx_caps.difference(&(Caps::LOCAL_COMM | Caps::REMOTE_COMM)),
                msg_order: order.clone(),
                comp_order: CompOrder::STRICT,
                size: SYNTHETIC_QUEUE_DEPTH,
                iov_limit: 2,
                ..TxAttr::default()
            },
            rx_attr: RxAttr {
                caps: rx_caps.difference(&(Caps::LOCAL_COMM | Caps::REMOTE_COMM)),
                msg_order: order,
                comp_order: CompOrder::STRICT,
                size: SYNTHETIC_QUEUE_DEPTH,
                iov_limit: 1,
                ..RxAttr::default()
            },
            ep_attr: EpAttr {
                ep_type,
                protocol,
                protocol_version: u32::from(crate::frame::PROTOCOL_VERSION),
                max_msg_size: u64::MAX,
                tx_ctx_cnt: 1,
                rx_ctx_cnt: 1,
                ..EpAttr::default()
            },
            domain_attr: DomainAttr {
                name: fabric.to_string(),
                threading: Threading::Domain,
                control_progress: progress.clone(),
                data_progress: progress,
                resource_mgmt: ResourceMgmt::Enabled,
                av_type: AvType::Unspec,
                cq_cnt: 1,
                ep_cnt: 1,
                tx_ctx_cnt: 1,
                rx_ctx_cnt: 1,
                max_ep_tx_ctx: 1,
                max_ep_rx_ctx: 1,
                caps: caps.intersection(&(Caps::LOCAL_COMM | Caps::REMOTE_COMM)),
                ..DomainAttr::default()
            },
            fabric_attr: FabricAttr {
                name: fabric.to_string(),
                prov_name: provider.to_string(),
                prov_version: EFABUS_PROV_VERSION,
                api_version: SYNTHETIC_API_VERSION,
                extra: Vec::new(),
            },
            ..FabricInfo::default()
        }
    }

    /// Ordering kept in both directions: the intersection of the tx and rx
    /// `msg_order`.
    pub fn msg_order(&self) -> MsgOrder {
        self.tx_attr.msg_order.intersection(&self.rx_attr.msg_order)
    }

    /// Every mode bit the provider asks for: top level, tx, rx and domain.
    pub fn required_mode(&self) -> Mode {
        self.mode
            .union(&self.tx_attr.mode)
            .union(&self.rx_attr.mode)
            .union(&self.domain_attr.mode)
    }

    /// A one-line summary: provider, endpoint type, domain, protocol and the
    /// limits negotiation looks at.
    pub fn summary(&self) -> String {
        format!(
            "{} {} domain={} protocol={} v{} max_msg_size={} prefix={} inject={} msg_order=[{}] tx={} rx={}",
            self.fabric_attr.prov_name,
            self.ep_attr.ep_type,
            self.domain_attr.name,
            self.ep_attr.protocol,
            self.ep_attr.protocol_version,
            self.ep_attr.max_msg_size,
            self.ep_attr.msg_prefix_size,
            self.tx_attr.inject_size,
            self.msg_order(),
            self.tx_attr.size,
            self.rx_attr.size,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_packing() {
        let v = FiVersion::from_raw((1 << 16) | 17);
        assert_eq!(v, FiVersion::new(1, 17));
        assert_eq!(v.raw(), (1 << 16) | 17);
        assert_eq!(FiVersion::new(200, 0).to_string(), "200.0");
    }

    #[test]
    fn synthesized_infos_are_reliable_and_ordered() {
        let addr: SocketAddr = "127.0.0.1:7420".parse().unwrap();
        let tcp = FabricInfo::tcp(Some(addr));
        assert_eq!(tcp.ep_attr.ep_type, EpType::Msg);
        assert!(tcp.msg_order().contains(&MsgOrder::SAS));
        assert_eq!(
            tcp.src_addr.as_deref(),
            Some("fi_sockaddr_in://127.0.0.1:7420")
        );
        assert!(tcp.required_mode().is_empty());
        let mem = FabricInfo::mem();
        assert!(mem.ep_attr.ep_type.is_reliable());
        assert_eq!(mem.ep_attr.max_msg_size, u64::MAX);
        assert!(mem.domain_attr.mr_mode.is_empty());
    }
}
