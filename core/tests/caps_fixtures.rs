//! The `fi_info -v` printer and parser against real dumps: EFA from a
//! libfabric 2.x host, and libfabric 1.17 providers on loopback.

use efabus_core::caps::{
    parse_fi_info_dump, to_fi_info_text, AvType, BusType, Caps, CompOrder, EpType, FabricInfo,
    Layout, LinkState, Mode, MrMode, MsgOrder, Progress, Protocol, ResourceMgmt, Threading,
};

const EFA: &str = include_str!("fixtures/efa-fi_info-v.txt");
const SOCKETS: &str = include_str!("fixtures/libfabric-1.17-sockets-rdm-lo.txt");
const TCP_RXM: &str = include_str!("fixtures/libfabric-1.17-tcp-rxm-rdm-lo.txt");
const UDP: &str = include_str!("fixtures/libfabric-1.17-udp-dgram-lo.txt");
const UDP_RXD: &str = include_str!("fixtures/libfabric-1.17-udp-rxd-rdm-lo.txt");

const ALL: [(&str, &str, usize); 5] = [
    ("efa", EFA, 2),
    ("sockets", SOCKETS, 5),
    ("tcp;ofi_rxm", TCP_RXM, 20),
    ("udp", UDP, 5),
    ("udp;ofi_rxd", UDP_RXD, 5),
];

fn parse(text: &str) -> Vec<FabricInfo> {
    match parse_fi_info_dump(text) {
        Ok(infos) => infos,
        Err(err) => panic!("fixture does not parse: {err}"),
    }
}

/// The lines of a dump from its first `---`, which is where the printer's
/// output starts (the EFA dump begins with the command that made it).
fn dump_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.iter().position(|l| *l == "---").unwrap_or(0);
    lines[start..].to_vec()
}

#[test]
fn every_fixture_parses_with_the_expected_entries() {
    for (provider, text, count) in ALL {
        let infos = parse(text);
        assert_eq!(infos.len(), count, "{provider}");
        for info in &infos {
            assert_eq!(info.fabric_attr.prov_name, provider);
        }
    }
}

#[test]
fn every_fixture_prints_and_reparses_to_equal_values() {
    for (provider, text, _) in ALL {
        let infos = parse(text);
        let printed = to_fi_info_text(&infos);
        let again = parse(&printed);
        assert_eq!(again, infos, "{provider}");
    }
}

#[test]
fn printed_dumps_match_their_input_line_for_line() {
    for (provider, text, _) in ALL {
        let printed = to_fi_info_text(&parse(text));
        let expected = dump_lines(text);
        let got: Vec<&str> = printed.lines().collect();
        for (i, (want, have)) in expected.iter().zip(&got).enumerate() {
            assert_eq!(have, want, "{provider}: output line {} differs", i + 1);
        }
        assert_eq!(got.len(), expected.len(), "{provider}: line count");
    }
}

#[test]
fn efa_dump_values() {
    let infos = parse(EFA);
    let rdm = &infos[0];
    assert_eq!(rdm.layout, Layout::V2);
    assert_eq!(rdm.mode, Mode::MSG_PREFIX);
    assert_eq!(rdm.src_addrlen, 32);
    assert_eq!(
        rdm.src_addr.as_deref(),
        Some("fi_addr_efa://[fe80::816:eff:fe0c:9ba3]:0:0")
    );
    assert_eq!(rdm.dest_addr, None);
    assert_eq!(rdm.handle, None);
    assert!(rdm
        .caps
        .contains(&(Caps::MSG | Caps::RMA | Caps::DIRECTED_RECV)));
    assert_eq!(
        rdm.tx_attr.caps.bits(),
        (Caps::MSG
            | Caps::RMA
            | Caps::TAGGED
            | Caps::ATOMIC
            | Caps::READ
            | Caps::WRITE
            | Caps::SEND)
            .bits()
    );
    assert!(rdm.tx_attr.msg_order.is_empty());
    assert_eq!(rdm.tx_attr.inject_size, 4096);
    assert_eq!(rdm.tx_attr.size, 4096);
    assert_eq!(rdm.rx_attr.size, 8192);
    assert_eq!(rdm.ep_attr.ep_type, EpType::Rdm);
    assert_eq!(rdm.ep_attr.protocol, Protocol::Efa);
    assert_eq!(rdm.ep_attr.protocol_version, 4);
    assert_eq!(rdm.ep_attr.max_msg_size, u64::MAX);
    assert_eq!(rdm.ep_attr.msg_prefix_size, 176);
    assert_eq!(rdm.ep_attr.mem_tag_format, 0xaaaa_aaaa_aaaa_aaaa);
    let d = &rdm.domain_attr;
    assert_eq!(d.name, "rdmap70s0-rdm");
    assert_eq!(d.threading, Threading::Safe);
    assert_eq!(d.data_progress, Progress::Auto);
    assert_eq!(d.control_progress, Progress::Auto);
    assert_eq!(d.resource_mgmt, ResourceMgmt::Enabled);
    assert_eq!(d.av_type, AvType::Table);
    assert_eq!(
        d.mr_mode,
        MrMode::LOCAL | MrMode::VIRT_ADDR | MrMode::ALLOCATED | MrMode::PROV_KEY | MrMode::HMEM
    );
    assert_eq!(d.mr_mode.bits(), 0x4 | 0x10 | 0x20 | 0x40 | 0x400);
    assert_eq!(d.cq_data_size, 4);
    assert_eq!(d.mr_cnt, 262_144);
    assert_eq!(rdm.fabric_attr.prov_version.to_string(), "200.0");
    assert_eq!(rdm.fabric_attr.api_version.raw(), 2 << 16);
    let nic = rdm.nic.as_ref().expect("the EFA dump has a NIC");
    assert_eq!(nic.device.vendor_id, "0x1d0f");
    assert_eq!(nic.bus.bus_type, BusType::Pci);
    assert_eq!(nic.bus.pci.as_ref().map(|p| p.bus_id), Some(70));
    assert_eq!(nic.link.state, LinkState::Up);
    assert_eq!(nic.link.mtu, 8760);
    assert_eq!(nic.link.speed, 25_000_000_000);
    for info in &infos {
        assert!(info.extra.is_empty() && info.domain_attr.extra.is_empty());
    }

    let dgram = &infos[1];
    assert_eq!(dgram.ep_attr.ep_type, EpType::Dgram);
    assert_eq!(dgram.ep_attr.max_msg_size, 8928);
    assert_eq!(dgram.ep_attr.msg_prefix_size, 40);
    assert_eq!(dgram.tx_attr.inject_size, 0);
    assert_eq!(dgram.domain_attr.resource_mgmt, ResourceMgmt::Disabled);
    assert_eq!(dgram.domain_attr.threading, Threading::Domain);
}

#[test]
fn libfabric_1_17_values() {
    let udp = parse(UDP);
    let first = &udp[0];
    assert_eq!(first.layout, Layout::V1);
    assert_eq!(first.nic, None);
    assert_eq!(first.ep_attr.ep_type, EpType::Dgram);
    assert_eq!(first.ep_attr.max_msg_size, 1472);
    assert_eq!(first.tx_attr.comp_order, CompOrder::STRICT);
    assert_eq!(first.rx_attr.total_buffered_recv, 0);
    assert!(first.domain_attr.mr_mode.is_empty());
    assert!(first.caps.contains(&Caps::MULTICAST));

    let rxm = parse(TCP_RXM);
    assert_eq!(rxm[0].mode, Mode::BUFFERED_RECV);
    assert_eq!(rxm[0].domain_attr.control_progress, Progress::Auto);
    assert_eq!(rxm[0].domain_attr.data_progress, Progress::Manual);
    assert!(rxm[0].tx_attr.msg_order.contains(&MsgOrder::SAS));
    assert_eq!(rxm[0].tx_attr.comp_order, CompOrder::NONE);

    let sockets = parse(SOCKETS);
    assert!(sockets
        .iter()
        .all(|i| i.rx_attr.comp_order == (CompOrder::STRICT | CompOrder::DATA)));
}

#[test]
fn printing_in_the_other_layout_swaps_the_version_specific_lines() {
    let mut udp = parse(UDP).remove(0);
    udp.layout = Layout::V2;
    let text = udp.to_string();
    assert!(text.contains("\n        progress: FI_PROGRESS_AUTO\n"));
    assert!(!text.contains("control_progress") && !text.contains("comp_order"));
    assert!(!text.contains("total_buffered_recv"));
    let back = parse(&text).remove(0);
    assert_eq!(back.layout, Layout::V2);
    assert_eq!(back.ep_attr, udp.ep_attr);
    assert_eq!(
        back.domain_attr.data_progress,
        udp.domain_attr.data_progress
    );
}

#[test]
fn unknown_flags_enums_and_fields_survive_a_round_trip() {
    let text = EFA
        .replacen(
            "FI_SOURCE, FI_DIRECTED_RECV ]",
            "FI_SOURCE, FI_DIRECTED_RECV, FI_FUTURE_CAP ]",
            1,
        )
        .replacen("type: FI_EP_RDM", "type: FI_EP_FUTURE", 1)
        .replacen(
            "progress: FI_PROGRESS_AUTO",
            "progress: FI_PROGRESS_CONTROL_UNIFIED",
            1,
        )
        .replacen(
            "        mr_cnt: 262144\n",
            "        mr_cnt: 262144\n        max_ep_auth_key: 7\n",
            1,
        );
    let infos = parse(&text);
    let info = &infos[0];
    assert_eq!(info.caps.unknown(), ["FI_FUTURE_CAP"]);
    assert!(info.caps.contains(&Caps::DIRECTED_RECV));
    assert_eq!(info.ep_attr.ep_type, EpType::Other("FI_EP_FUTURE".into()));
    assert_eq!(
        info.domain_attr.data_progress,
        Progress::Other("FI_PROGRESS_CONTROL_UNIFIED".into())
    );
    assert_eq!(
        info.domain_attr.extra,
        [("max_ep_auth_key".to_string(), "7".to_string())]
    );

    let printed = to_fi_info_text(&infos);
    assert!(printed.contains("FI_DIRECTED_RECV, FI_FUTURE_CAP ]"));
    assert!(printed.contains("        type: FI_EP_FUTURE\n"));
    assert!(printed.contains("        max_ep_auth_key: 7\n"));
    assert_eq!(parse(&printed), infos);
}

#[test]
fn text_before_the_first_entry_is_ignored() {
    let noisy = format!("$ fi_info -v\nlibfabric:1234:core: some log line\n{UDP}");
    assert_eq!(parse(&noisy), parse(UDP));
}

/// Replace the first line containing `needle` with `with`, and return the
/// text and that line's 1-based number.
fn replace_line(text: &str, needle: &str, with: &str) -> (String, usize) {
    let mut number = 0;
    let lines: Vec<String> = text
        .lines()
        .enumerate()
        .map(|(i, line)| {
            if number == 0 && line.contains(needle) {
                number = i + 1;
                with.to_string()
            } else {
                line.to_string()
            }
        })
        .collect();
    assert_ne!(number, 0, "{needle} not in fixture");
    (lines.join("\n"), number)
}

#[test]
fn malformed_input_names_the_line_and_what_was_expected() {
    let cases = [
        (
            "inject_size: 4096",
            "        inject_size: lots",
            "unsigned number",
        ),
        ("mr_mode:", "        mr_mode: FI_MR_LOCAL", "flag list"),
        ("mem_tag_format", "        mem_tag_format: 12", "hex"),
        ("prov_version", "        prov_version: 200", "major.minor"),
        ("iov_limit: 4", "       iov_limit: 4", "indented"),
        ("dest_addrlen", "    dest_addrlen 0", "key: value"),
        ("handle:", "    handle: somewhere", "handle"),
        ("bus_id: 70", "                bus_id: 700", "in range"),
        ("tclass: 0x0", "        tclass: 0x100000000", "32-bit"),
        (
            "fi_link_attr:",
            "        fi_link_attr: up",
            "followed by its fields",
        ),
    ];
    for (needle, with, expected) in cases {
        let (text, line) = replace_line(EFA, needle, with);
        let err = parse_fi_info_dump(&text).expect_err(with);
        assert_eq!(err.line, line, "{with}: {err}");
        assert!(err.expected.contains(expected), "{with}: {err}");
        assert!(err
            .to_string()
            .starts_with(&format!("line {line}: expected")));
    }
}

#[test]
fn missing_and_duplicate_fields_are_errors() {
    // A missing field is reported at the end of its group.
    let (text, removed) = replace_line(UDP, "rma_iov_limit", "        tclass: 0x0");
    let err = parse_fi_info_dump(&text).expect_err("duplicate tclass");
    assert!(err.expected.contains("only once"), "{err}");
    assert_eq!(err.line, removed + 1);

    let without: String = UDP
        .lines()
        .filter(|l| !l.contains("rma_iov_limit"))
        .map(|l| format!("{l}\n"))
        .collect();
    let err = parse_fi_info_dump(&without).expect_err("missing rma_iov_limit");
    assert!(
        err.expected.contains("`rma_iov_limit` in `fi_tx_attr`"),
        "{err}"
    );
    // The last line of the first tx group: `tclass`, one above where
    // rma_iov_limit was.
    assert_eq!(err.line, removed);

    let trailing = format!("{UDP}$ \n");
    let err = parse_fi_info_dump(&trailing).expect_err("trailing prompt");
    assert_eq!(err.line, UDP.lines().count() + 1);
}

/// Index of the `fi_info:` line of the first entry and of the `---` that
/// ends it.
fn first_entry(lines: &[&str]) -> (usize, usize) {
    let start = lines
        .iter()
        .position(|l| *l == "fi_info:")
        .expect("an entry");
    let end = start
        + lines[start..]
            .iter()
            .position(|l| *l == "---")
            .expect("a second entry");
    (start, end)
}

#[test]
fn an_entry_cut_short_is_reported_as_such() {
    // Both layouts: EFA is a 2.x dump, udp a 1.x one.
    for (name, text) in [("efa", EFA), ("udp", UDP)] {
        let lines: Vec<&str> = text.lines().collect();
        let (start, end) = first_entry(&lines);
        // Keep the first `kept` lines: from `fi_info:` alone up to all but
        // the entry's last line. Once at the end of the input, once with
        // the next entry following.
        for kept in start + 1..end {
            let head = lines[..kept].join("\n");
            let rest = lines[end..].join("\n");
            for (how, dump) in [
                ("at end", head.clone()),
                ("then more", format!("{head}\n{rest}")),
            ] {
                let err =
                    parse_fi_info_dump(&dump).expect_err(&format!("{name}: {kept} lines {how}"));
                assert!(
                    err.expected.contains("the entry ended before it"),
                    "{name}: {kept} lines {how}: {err}"
                );
                assert!(err.line <= kept, "{name}: {kept} lines {how}: {err}");
            }
        }
    }

    // The message names the first field missing.
    let lines: Vec<&str> = UDP.lines().collect();
    let rx = lines
        .iter()
        .position(|l| l.trim() == "fi_rx_attr:")
        .expect("rx group");
    let err = parse_fi_info_dump(&lines[..rx].join("\n")).expect_err("no rx group");
    assert_eq!(err.line, rx, "{err}");
    assert_eq!(
        err.expected,
        "`fi_rx_attr` in `fi_info`, but the entry ended before it"
    );
    let err = parse_fi_info_dump(&lines[..rx + 2].join("\n")).expect_err("rx cut after caps");
    assert_eq!(err.line, rx + 2, "{err}");
    assert_eq!(
        err.expected,
        "`mode` in `fi_rx_attr`, but the entry ended before it"
    );

    // A field left out in the middle is still reported as missing, not as
    // a cut.
    let without: String = UDP
        .lines()
        .filter(|l| !l.contains("dest_addrlen"))
        .map(|l| format!("{l}\n"))
        .collect();
    let err = parse_fi_info_dump(&without).expect_err("no dest_addrlen");
    assert_eq!(err.expected, "`dest_addrlen` in `fi_info`");
}

/// A flag list far longer than libfabric has flags is refused on its line
/// (each name is checked against those before it).
#[test]
fn a_flag_list_past_any_real_one_is_refused() {
    let names: Vec<String> = (0..300).map(|n| format!("FI_X{n}")).collect();
    let dump = format!("fi_info:\n    caps: [ {} ]\n", names.join(", "));
    let err = parse_fi_info_dump(&dump).expect_err("300 flags");
    assert_eq!(err.line, 2, "{err}");
    assert_eq!(err.expected, "at most 256 flags in `caps`, not 300");
}

#[test]
fn an_unterminated_list_is_reported_on_its_line() {
    let err = parse_fi_info_dump("fi_info:\n    caps: [ FI_MSG\n").expect_err("open list");
    assert_eq!(err.line, 2, "{err}");
    assert_eq!(
        err.expected,
        "`]` closing the `caps` list, which is unterminated"
    );

    // In a whole dump, at any depth.
    for (needle, with, key) in [
        (
            "    caps: [ FI_MSG, FI_RMA",
            "    caps: [ FI_MSG, FI_RMA",
            "caps",
        ),
        (
            "        mr_mode: [",
            "        mr_mode: [ FI_MR_LOCAL, FI_MR_ALLOCATED",
            "mr_mode",
        ),
        (
            "comp_order",
            "        comp_order: [ FI_ORDER_STRICT",
            "comp_order",
        ),
    ] {
        let dump = if needle == "comp_order" { UDP } else { EFA };
        let (text, line) = replace_line(dump, needle, with);
        let err = parse_fi_info_dump(&text).expect_err(with);
        assert_eq!(err.line, line, "{with}: {err}");
        assert_eq!(
            err.expected,
            format!("`]` closing the `{key}` list, which is unterminated"),
            "{with}"
        );
    }
}
