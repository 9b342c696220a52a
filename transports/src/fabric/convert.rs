//! `fi_getinfo` results ([`InfoAttrs`]) converted to efabus's capability
//! model ([`FabricInfo`]), field by field, as `fi_info -v` would print them.
//!
//! Flag fields keep libfabric's bits, enum fields its C values; strings that
//! were NULL become `(null)` and pointers that were NULL become `(nil)`, as
//! `fi_tostr` prints them. Addresses are rendered in libfabric's
//! `fi_sockaddr_in://…`/`fi_addr_efa://…` forms; formats efabus does not
//! render are taken from `fi_tostr` (see [`InfoAttrs::src_addr_text`]).
//! The layout is always the 1.x one: efabus requests API 1.17, and that is
//! what `fi_getinfo` returns even from a 2.x library.

use std::net::{Ipv4Addr, Ipv6Addr};

use efabus_core::caps::{
    AddrFormat, AvType, BusAttr, BusType, Caps, CompOrder, DeviceAttr, DomainAttr, EpAttr, EpType,
    FabricAttr, FabricInfo, FiVersion, Layout, LinkAttr, LinkState, Mode, MrMode, MsgOrder, Nic,
    OpFlags, PciAttr, Progress, Protocol, ResourceMgmt, RxAttr, Threading, TxAttr,
};

use super::attrs::InfoAttrs;
use super::consts::*;

/// What `fi_tostr` prints for a NULL string.
const NULL_TEXT: &str = "(null)";

fn c_enum(value: u64) -> u32 {
    // Out-of-range values map to a name no enum has, printed as Unknown.
    u32::try_from(value).unwrap_or(u32::MAX)
}

fn text(value: &Option<String>) -> String {
    value.clone().unwrap_or_else(|| NULL_TEXT.to_string())
}

/// Renders an address as libfabric prints it, for the formats efabus meets
/// (IPv4/IPv6 sockaddrs, EFA, strings). `None` for other formats or bytes
/// too short for their format.
pub fn format_addr(addr_format: u64, bytes: &[u8]) -> Option<String> {
    // sockaddr families as Linux numbers them.
    const AF_INET: u16 = 2;
    const AF_INET6: u16 = 10;
    let family = || Some(u16::from_ne_bytes(bytes.get(0..2)?.try_into().ok()?));
    let sin = || -> Option<String> {
        let port = u16::from_be_bytes(bytes.get(2..4)?.try_into().ok()?);
        let ip: [u8; 4] = bytes.get(4..8)?.try_into().ok()?;
        Some(format!("fi_sockaddr_in://{}:{port}", Ipv4Addr::from(ip)))
    };
    let sin6 = || -> Option<String> {
        let port = u16::from_be_bytes(bytes.get(2..4)?.try_into().ok()?);
        let ip: [u8; 16] = bytes.get(8..24)?.try_into().ok()?;
        Some(format!("fi_sockaddr_in6://[{}]:{port}", Ipv6Addr::from(ip)))
    };
    match addr_format {
        FI_SOCKADDR_IN => sin(),
        FI_SOCKADDR_IN6 => sin6(),
        FI_SOCKADDR => match family()? {
            AF_INET => sin(),
            AF_INET6 => sin6(),
            _ => None,
        },
        FI_ADDR_EFA => {
            // struct efa_ep_addr: GID (16 bytes), QPN (u16), pad, QKEY (u32).
            let gid: [u8; 16] = bytes.get(0..16)?.try_into().ok()?;
            let qpn = u16::from_ne_bytes(bytes.get(16..18)?.try_into().ok()?);
            let qkey = u32::from_ne_bytes(bytes.get(20..24)?.try_into().ok()?);
            Some(format!(
                "fi_addr_efa://[{}]:{qpn}:{qkey}",
                Ipv6Addr::from(gid)
            ))
        }
        FI_ADDR_STR => {
            let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
            Some(String::from_utf8_lossy(&bytes[..end]).into_owned())
        }
        _ => None,
    }
}

/// The address as text: rendered here, or as `fi_tostr` printed it, or
/// `None` (printed `(null)`) when there is no address.
fn addr_text(format: u64, bytes: &Option<Vec<u8>>, printed: &Option<String>) -> Option<String> {
    let bytes = bytes.as_ref()?;
    format_addr(format, bytes).or_else(|| printed.clone())
}

/// Converts one `fi_getinfo` entry.
pub fn to_fabric_info(a: &InfoAttrs) -> FabricInfo {
    let tx = a.tx.clone().unwrap_or_default();
    let rx = a.rx.clone().unwrap_or_default();
    let ep = a.ep.clone().unwrap_or_default();
    let dom = a.domain.clone().unwrap_or_default();
    let fab = a.fabric.clone().unwrap_or_default();
    FabricInfo {
        layout: Layout::V1,
        caps: Caps::from_bits(a.caps),
        mode: Mode::from_bits(a.mode),
        addr_format: AddrFormat::from_c_value(c_enum(a.addr_format)),
        src_addrlen: a.src_addrlen,
        dest_addrlen: a.dest_addrlen,
        src_addr: addr_text(a.addr_format, &a.src_addr, &a.src_addr_text),
        dest_addr: addr_text(a.addr_format, &a.dest_addr, &a.dest_addr_text),
        handle: (a.handle != 0).then_some(a.handle as u64),
        tx_attr: TxAttr {
            caps: Caps::from_bits(tx.caps),
            mode: Mode::from_bits(tx.mode),
            op_flags: OpFlags::from_bits(tx.op_flags),
            msg_order: MsgOrder::from_bits(tx.msg_order),
            comp_order: CompOrder::from_bits(tx.comp_order),
            inject_size: tx.inject_size,
            size: tx.size,
            iov_limit: tx.iov_limit,
            rma_iov_limit: tx.rma_iov_limit,
            tclass: tx.tclass as u32,
            extra: Vec::new(),
        },
        rx_attr: RxAttr {
            caps: Caps::from_bits(rx.caps),
            mode: Mode::from_bits(rx.mode),
            op_flags: OpFlags::from_bits(rx.op_flags),
            msg_order: MsgOrder::from_bits(rx.msg_order),
            comp_order: CompOrder::from_bits(rx.comp_order),
            total_buffered_recv: rx.total_buffered_recv,
            size: rx.size,
            iov_limit: rx.iov_limit,
            extra: Vec::new(),
        },
        ep_attr: EpAttr {
            ep_type: EpType::from_c_value(c_enum(ep.ep_type)),
            protocol: Protocol::from_c_value(c_enum(ep.protocol)),
            protocol_version: ep.protocol_version as u32,
            max_msg_size: ep.max_msg_size,
            msg_prefix_size: ep.msg_prefix_size,
            max_order_raw_size: ep.max_order_raw_size,
            max_order_war_size: ep.max_order_war_size,
            max_order_waw_size: ep.max_order_waw_size,
            mem_tag_format: ep.mem_tag_format,
            tx_ctx_cnt: ep.tx_ctx_cnt,
            rx_ctx_cnt: ep.rx_ctx_cnt,
            auth_key_size: ep.auth_key_size,
            extra: Vec::new(),
        },
        domain_attr: DomainAttr {
            domain: dom.domain as u64,
            name: text(&dom.name),
            threading: Threading::from_c_value(c_enum(dom.threading)),
            control_progress: Progress::from_c_value(c_enum(dom.control_progress)),
            data_progress: Progress::from_c_value(c_enum(dom.data_progress)),
            resource_mgmt: ResourceMgmt::from_c_value(c_enum(dom.resource_mgmt)),
            av_type: AvType::from_c_value(c_enum(dom.av_type)),
            mr_mode: MrMode::from_bits(dom.mr_mode),
            mr_key_size: dom.mr_key_size,
            cq_data_size: dom.cq_data_size,
            cq_cnt: dom.cq_cnt,
            ep_cnt: dom.ep_cnt,
            tx_ctx_cnt: dom.tx_ctx_cnt,
            rx_ctx_cnt: dom.rx_ctx_cnt,
            max_ep_tx_ctx: dom.max_ep_tx_ctx,
            max_ep_rx_ctx: dom.max_ep_rx_ctx,
            max_ep_stx_ctx: dom.max_ep_stx_ctx,
            max_ep_srx_ctx: dom.max_ep_srx_ctx,
            cntr_cnt: dom.cntr_cnt,
            mr_iov_limit: dom.mr_iov_limit,
            caps: Caps::from_bits(dom.caps),
            mode: Mode::from_bits(dom.mode),
            auth_key_size: dom.auth_key_size,
            max_err_data: dom.max_err_data,
            mr_cnt: dom.mr_cnt,
            tclass: dom.tclass as u32,
            extra: Vec::new(),
        },
        fabric_attr: FabricAttr {
            name: text(&fab.name),
            prov_name: text(&fab.prov_name),
            prov_version: FiVersion::from_raw(fab.prov_version),
            api_version: FiVersion::from_raw(fab.api_version),
            extra: Vec::new(),
        },
        nic: a.nic.as_ref().map(|nic| {
            let device = nic.device.clone().unwrap_or_default();
            let bus = nic.bus.clone().unwrap_or_default();
            let link = nic.link.clone().unwrap_or_default();
            let bus_type = BusType::from_c_value(c_enum(bus.bus_type));
            Nic {
                device: DeviceAttr {
                    name: text(&device.name),
                    device_id: text(&device.device_id),
                    device_version: text(&device.device_version),
                    vendor_id: text(&device.vendor_id),
                    driver: text(&device.driver),
                    firmware: text(&device.firmware),
                    extra: Vec::new(),
                },
                bus: BusAttr {
                    pci: (bus_type == BusType::Pci).then(|| PciAttr {
                        domain_id: bus.pci_domain_id as u16,
                        bus_id: bus.pci_bus_id as u8,
                        device_id: bus.pci_device_id as u8,
                        function_id: bus.pci_function_id as u8,
                        extra: Vec::new(),
                    }),
                    bus_type,
                    extra: Vec::new(),
                },
                link: LinkAttr {
                    address: text(&link.address),
                    mtu: link.mtu,
                    speed: link.speed,
                    state: LinkState::from_c_value(c_enum(link.state)),
                    network_type: text(&link.network_type),
                    extra: Vec::new(),
                },
                extra: Vec::new(),
            }
        }),
        extra: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::attrs::*;
    use super::*;

    fn sockaddr_in(ip: [u8; 4], port: u16) -> Vec<u8> {
        let mut b = vec![0u8; 16];
        b[0..2].copy_from_slice(&2u16.to_ne_bytes());
        b[2..4].copy_from_slice(&port.to_be_bytes());
        b[4..8].copy_from_slice(&ip);
        b
    }

    #[test]
    fn addresses_render_as_libfabric_prints_them() {
        let v4 = sockaddr_in([127, 0, 0, 1], 7420);
        assert_eq!(
            format_addr(FI_SOCKADDR_IN, &v4).as_deref(),
            Some("fi_sockaddr_in://127.0.0.1:7420")
        );
        assert_eq!(
            format_addr(FI_SOCKADDR, &v4).as_deref(),
            Some("fi_sockaddr_in://127.0.0.1:7420")
        );
        let mut v6 = vec![0u8; 28];
        v6[0..2].copy_from_slice(&10u16.to_ne_bytes());
        v6[2..4].copy_from_slice(&0u16.to_be_bytes());
        v6[8..24].copy_from_slice(&"fe80::fc:ff:fe00:1".parse::<Ipv6Addr>().unwrap().octets());
        assert_eq!(
            format_addr(FI_SOCKADDR_IN6, &v6).as_deref(),
            Some("fi_sockaddr_in6://[fe80::fc:ff:fe00:1]:0")
        );
        // The EFA fixture's address: GID fe80::816:eff:fe0c:9ba3, QPN 0, QKEY 0.
        let mut efa = vec![0u8; 32];
        efa[..16].copy_from_slice(
            &"fe80::816:eff:fe0c:9ba3"
                .parse::<Ipv6Addr>()
                .unwrap()
                .octets(),
        );
        assert_eq!(
            format_addr(FI_ADDR_EFA, &efa).as_deref(),
            Some("fi_addr_efa://[fe80::816:eff:fe0c:9ba3]:0:0")
        );
        efa[16..18].copy_from_slice(&5u16.to_ne_bytes());
        efa[20..24].copy_from_slice(&77u32.to_ne_bytes());
        assert_eq!(
            format_addr(FI_ADDR_EFA, &efa).as_deref(),
            Some("fi_addr_efa://[fe80::816:eff:fe0c:9ba3]:5:77")
        );
        assert_eq!(
            format_addr(FI_ADDR_STR, b"host:1\0junk").as_deref(),
            Some("host:1")
        );
        // Too short, or a format efabus does not render.
        assert_eq!(format_addr(FI_SOCKADDR_IN, &[2, 0, 1]), None);
        assert_eq!(format_addr(FI_ADDR_EFA, &efa[..10]), None);
        assert_eq!(format_addr(999, &efa), None);
    }

    /// The EFA fixture's DGRAM entry, as fi_getinfo would hand it over.
    fn efa_dgram() -> InfoAttrs {
        let mut gid = vec![0u8; 32];
        gid[..16].copy_from_slice(
            &"fe80::816:eff:fe0c:9ba3"
                .parse::<Ipv6Addr>()
                .unwrap()
                .octets(),
        );
        InfoAttrs {
            caps: FI_MSG | FI_RECV | FI_SEND | (1 << 51) | (1 << 52) | FI_SOURCE,
            mode: FI_MSG_PREFIX,
            addr_format: FI_ADDR_EFA,
            src_addr: Some(gid),
            src_addrlen: 32,
            tx: Some(TxAttrs {
                caps: FI_MSG | FI_SEND,
                mode: FI_MSG_PREFIX,
                size: 4096,
                iov_limit: 2,
                ..TxAttrs::default()
            }),
            rx: Some(RxAttrs {
                caps: FI_MSG | FI_RECV | FI_SOURCE,
                mode: FI_MSG_PREFIX,
                size: 8192,
                iov_limit: 3,
                ..RxAttrs::default()
            }),
            ep: Some(EpAttrs {
                ep_type: FI_EP_DGRAM,
                protocol: 20,
                protocol_version: 1,
                max_msg_size: 8928,
                msg_prefix_size: 40,
                tx_ctx_cnt: 1,
                rx_ctx_cnt: 1,
                ..EpAttrs::default()
            }),
            domain: Some(DomainAttrs {
                name: Some("rdmap70s0-dgrm".into()),
                threading: FI_THREAD_DOMAIN,
                control_progress: 1,
                data_progress: 1,
                resource_mgmt: 1,
                av_type: 0,
                mr_mode: FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY,
                mr_key_size: 4,
                cq_data_size: 4,
                cq_cnt: 512,
                ep_cnt: 256,
                tx_ctx_cnt: 256,
                rx_ctx_cnt: 256,
                max_ep_tx_ctx: 1,
                max_ep_rx_ctx: 1,
                mr_iov_limit: 1,
                caps: (1 << 51) | (1 << 52),
                mr_cnt: 262144,
                ..DomainAttrs::default()
            }),
            fabric: Some(FabricAttrs {
                name: Some("efa".into()),
                prov_name: Some("efa".into()),
                prov_version: 200 << 16,
                api_version: 2 << 16,
            }),
            nic: Some(NicAttrs {
                device: Some(DeviceAttrs {
                    name: Some("rdmap70s0".into()),
                    device_id: Some("0xefa1".into()),
                    device_version: Some("6".into()),
                    vendor_id: Some("0x1d0f".into()),
                    driver: Some("efa".into()),
                    firmware: Some("0.0.0.0".into()),
                }),
                bus: Some(BusAttrs {
                    bus_type: 1,
                    pci_bus_id: 70,
                    ..BusAttrs::default()
                }),
                link: Some(LinkAttrs {
                    address: Some("EFA-fe80::816:eff:fe0c:9ba3".into()),
                    mtu: 8760,
                    speed: 25_000_000_000,
                    state: 2,
                    network_type: Some("Ethernet".into()),
                }),
            }),
            ..InfoAttrs::default()
        }
    }

    #[test]
    fn efa_fixture_values_convert_field_by_field() {
        let info = to_fabric_info(&efa_dgram());
        assert_eq!(info.addr_format, AddrFormat::Efa);
        assert_eq!(
            info.src_addr.as_deref(),
            Some("fi_addr_efa://[fe80::816:eff:fe0c:9ba3]:0:0")
        );
        assert_eq!(info.dest_addr, None);
        assert_eq!(info.handle, None);
        assert!(info.mode.contains(&Mode::MSG_PREFIX));
        assert!(info.caps.contains(&(Caps::MSG | Caps::SOURCE)));
        assert_eq!(info.ep_attr.ep_type, EpType::Dgram);
        assert_eq!(info.ep_attr.protocol, Protocol::Efa);
        assert_eq!(info.ep_attr.max_msg_size, 8928);
        assert_eq!(info.ep_attr.msg_prefix_size, 40);
        assert_eq!(info.tx_attr.inject_size, 0);
        assert_eq!(info.rx_attr.size, 8192);
        assert_eq!(info.domain_attr.threading, Threading::Domain);
        assert_eq!(info.domain_attr.resource_mgmt, ResourceMgmt::Disabled);
        assert_eq!(info.domain_attr.av_type, AvType::Unspec);
        assert_eq!(
            info.domain_attr.mr_mode,
            MrMode::LOCAL | MrMode::VIRT_ADDR | MrMode::ALLOCATED | MrMode::PROV_KEY
        );
        assert_eq!(info.fabric_attr.prov_version, FiVersion::new(200, 0));
        assert_eq!(info.fabric_attr.api_version, FiVersion::new(2, 0));
        let nic = info.nic.as_ref().unwrap();
        assert_eq!(nic.device.vendor_id, "0x1d0f");
        assert_eq!(nic.bus.bus_type, BusType::Pci);
        assert_eq!(nic.bus.pci.as_ref().unwrap().bus_id, 70);
        assert_eq!(nic.link.state, LinkState::Up);
        assert_eq!(nic.link.speed, 25_000_000_000);
        // And it is what the fixture's text says, printed and parsed back.
        let text = efabus_core::caps::to_fi_info_text(std::slice::from_ref(&info));
        let parsed = efabus_core::caps::parse_fi_info_dump(&text).unwrap();
        assert_eq!(parsed, vec![info]);
        assert!(text.contains("msg_prefix_size: 40"), "{text}");
        assert!(
            text.contains(
                "mr_mode: [ FI_MR_LOCAL, FI_MR_VIRT_ADDR, FI_MR_ALLOCATED, FI_MR_PROV_KEY ]"
            ),
            "{text}"
        );
    }

    #[test]
    fn missing_strings_and_nic_print_as_libfabric_does() {
        let info = to_fabric_info(&InfoAttrs::default());
        assert_eq!(info.domain_attr.name, "(null)");
        assert_eq!(info.fabric_attr.prov_name, "(null)");
        assert_eq!(info.src_addr, None);
        assert!(info.nic.is_none());
        let odd = InfoAttrs {
            addr_format: 999,
            src_addr: Some(vec![1, 2, 3]),
            src_addr_text: Some("fi_addr_future://x".into()),
            ..InfoAttrs::default()
        };
        assert_eq!(
            to_fabric_info(&odd).src_addr.as_deref(),
            Some("fi_addr_future://x")
        );
    }
}
