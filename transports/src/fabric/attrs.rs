//! `fi_info` as plain owned Rust values: what the shim's flat view holds,
//! copied out so it outlives the C list. Numbers are libfabric's raw values
//! (bit sets and enum values as in its headers).

/// Transmit attributes (`struct fi_tx_attr`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TxAttrs {
    pub caps: u64,
    pub mode: u64,
    pub op_flags: u64,
    pub msg_order: u64,
    pub comp_order: u64,
    pub inject_size: u64,
    pub size: u64,
    pub iov_limit: u64,
    pub rma_iov_limit: u64,
    pub tclass: u64,
}

/// Receive attributes (`struct fi_rx_attr`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RxAttrs {
    pub caps: u64,
    pub mode: u64,
    pub op_flags: u64,
    pub msg_order: u64,
    pub comp_order: u64,
    pub total_buffered_recv: u64,
    pub size: u64,
    pub iov_limit: u64,
}

/// Endpoint attributes (`struct fi_ep_attr`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EpAttrs {
    pub ep_type: u64,
    pub protocol: u64,
    pub protocol_version: u64,
    pub max_msg_size: u64,
    pub msg_prefix_size: u64,
    pub max_order_raw_size: u64,
    pub max_order_war_size: u64,
    pub max_order_waw_size: u64,
    pub mem_tag_format: u64,
    pub tx_ctx_cnt: u64,
    pub rx_ctx_cnt: u64,
    pub auth_key_size: u64,
}

/// Domain attributes (`struct fi_domain_attr`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DomainAttrs {
    /// The `domain` pointer's value (0 in infos from fi_getinfo).
    pub domain: usize,
    pub name: Option<String>,
    pub threading: u64,
    pub control_progress: u64,
    pub data_progress: u64,
    pub resource_mgmt: u64,
    pub av_type: u64,
    pub mr_mode: u64,
    pub mr_key_size: u64,
    pub cq_data_size: u64,
    pub cq_cnt: u64,
    pub ep_cnt: u64,
    pub tx_ctx_cnt: u64,
    pub rx_ctx_cnt: u64,
    pub max_ep_tx_ctx: u64,
    pub max_ep_rx_ctx: u64,
    pub max_ep_stx_ctx: u64,
    pub max_ep_srx_ctx: u64,
    pub cntr_cnt: u64,
    pub mr_iov_limit: u64,
    pub caps: u64,
    pub mode: u64,
    pub auth_key_size: u64,
    pub max_err_data: u64,
    pub mr_cnt: u64,
    pub tclass: u64,
}

/// Fabric attributes (`struct fi_fabric_attr`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FabricAttrs {
    pub name: Option<String>,
    pub prov_name: Option<String>,
    /// `FI_VERSION(major, minor)` packed as libfabric packs it.
    pub prov_version: u32,
    pub api_version: u32,
}

/// Device attributes of a NIC (`struct fi_device_attr`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceAttrs {
    pub name: Option<String>,
    pub device_id: Option<String>,
    pub device_version: Option<String>,
    pub vendor_id: Option<String>,
    pub driver: Option<String>,
    pub firmware: Option<String>,
}

/// Bus attributes of a NIC (`struct fi_bus_attr`, PCI only).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BusAttrs {
    pub bus_type: u64,
    pub pci_domain_id: u64,
    pub pci_bus_id: u64,
    pub pci_device_id: u64,
    pub pci_function_id: u64,
}

/// Link attributes of a NIC (`struct fi_link_attr`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkAttrs {
    pub address: Option<String>,
    pub mtu: u64,
    pub speed: u64,
    pub state: u64,
    pub network_type: Option<String>,
}

/// The NIC behind an info (`struct fid_nic`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NicAttrs {
    pub device: Option<DeviceAttrs>,
    pub bus: Option<BusAttrs>,
    pub link: Option<LinkAttrs>,
}

/// One `fi_info` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InfoAttrs {
    pub caps: u64,
    pub mode: u64,
    pub addr_format: u64,
    pub src_addr: Option<Vec<u8>>,
    pub dest_addr: Option<Vec<u8>>,
    /// The addresses as `fi_tostr` printed them, kept only for formats
    /// [`super::convert::format_addr`] does not render.
    pub src_addr_text: Option<String>,
    pub dest_addr_text: Option<String>,
    /// Lengths as reported, even where the address pointer was NULL.
    pub src_addrlen: u64,
    pub dest_addrlen: u64,
    /// The `handle` pointer's value (0 in infos from fi_getinfo).
    pub handle: usize,
    pub tx: Option<TxAttrs>,
    pub rx: Option<RxAttrs>,
    pub ep: Option<EpAttrs>,
    pub domain: Option<DomainAttrs>,
    pub fabric: Option<FabricAttrs>,
    pub nic: Option<NicAttrs>,
}

impl InfoAttrs {
    /// The provider name, or "" when the info has no fabric attributes.
    pub fn provider(&self) -> &str {
        self.fabric
            .as_ref()
            .and_then(|f| f.prov_name.as_deref())
            .unwrap_or("")
    }
}
