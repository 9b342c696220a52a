//! Local selection and peer negotiation with real dumps: EFA RDM and DGRAM
//! from an EFA host, libfabric 1.17's udp and tcp;ofi_rxm on loopback.

use std::net::SocketAddr;
use std::sync::OnceLock;

use efabus_core::caps::{
    check, negotiate, parse_fi_info_dump, select, Caps, EpType, FabricInfo, Hints, Mismatch, Mode,
    MrMode, MsgOrder, Negotiated, Offer, MAX_WIRE_FRAME, MIN_FRAME_LIMIT,
};
use proptest::prelude::*;

const EFA: &str = include_str!("fixtures/efa-fi_info-v.txt");
const UDP: &str = include_str!("fixtures/libfabric-1.17-udp-dgram-lo.txt");
const TCP_RXM: &str = include_str!("fixtures/libfabric-1.17-tcp-rxm-rdm-lo.txt");

fn infos(text: &str) -> Vec<FabricInfo> {
    parse_fi_info_dump(text).expect("fixture parses")
}

fn efa_rdm() -> FabricInfo {
    infos(EFA).remove(0)
}

fn efa_dgram() -> FabricInfo {
    infos(EFA).remove(1)
}

fn prefs() -> Vec<String> {
    ["efa-rdm", "efa-dgram", "tcp"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

#[test]
fn the_report_shows_choices_then_skipped_candidates() {
    let n = negotiate(&efa_host(1), &efa_host(2), &["efa-rdm", "efa-dgram", "tcp"]).unwrap();
    let report = n.to_string();
    let lines: Vec<&str> = report.lines().collect();
    assert!(
        lines[0]
            .starts_with(
                "reliable: efa-rdm via efa FI_EP_RDM: frame limit 4294967299, no rendezvous, prefix 176"
            ),
        "{report}"
    );
    assert!(lines[1].starts_with("best-effort: efa-dgram via efa FI_EP_DGRAM: frame limit 8888, prefix 40, sequence and reorder, fragment"), "{report}");
    assert_eq!(lines.len(), 2 + n.reasons.len());
    assert!(lines[2..].iter().all(|l| l.starts_with("  - ")));
}

fn tcp_offer(port: u16) -> Offer {
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    Offer::from_info(
        "tcp",
        &FabricInfo::tcp(Some(addr)),
        addr.to_string().into_bytes(),
    )
}

/// A host with EFA: RDM, DGRAM and TCP; `id` makes its addresses unique.
fn efa_host(id: u8) -> Vec<Offer> {
    vec![
        Offer::from_info("efa-rdm", &efa_rdm(), vec![id; 32]),
        Offer::from_info("efa-dgram", &efa_dgram(), vec![id ^ 0x80; 32]),
        tcp_offer(7000 + u16::from(id)),
    ]
}

fn assert_symmetric(a: &[Offer], b: &[Offer], prefs: &[String]) -> Negotiated {
    let ab = negotiate(a, b, prefs).expect("a link");
    let ba = negotiate(b, a, prefs).expect("a link");
    assert_eq!(ba.reliable, ab.reliable.mirrored());
    assert_eq!(
        ba.best_effort,
        ab.best_effort.as_ref().map(|c| c.mirrored())
    );
    ab
}

#[test]
fn efabus_hints_accept_efa_and_say_why_not_otherwise() {
    let all = infos(EFA);
    let hints = Hints::efabus(EpType::Rdm).with_provider("efa");
    let selection = select(&hints, &all);
    assert_eq!(selection.accepted, [&all[0]]);
    assert_eq!(selection.rejected.len(), 1);
    let (rejected, why) = &selection.rejected[0];
    assert_eq!(rejected.ep_attr.ep_type, EpType::Dgram);
    assert_eq!(
        why.mismatches,
        [Mismatch::EpType {
            wanted: EpType::Rdm,
            offered: EpType::Dgram
        }]
    );
    assert_eq!(
        why.to_string(),
        "endpoint type FI_EP_DGRAM offered, FI_EP_RDM wanted"
    );

    assert!(check(&Hints::efabus(EpType::Dgram), &all[1]).is_ok());
}

#[test]
fn rejections_name_the_missing_bits() {
    let rdm = efa_rdm();

    // Caps wanted and not offered.
    let mut hints = Hints::efabus(EpType::Unspec);
    hints.caps |= Caps::MULTICAST | Caps::COLLECTIVE;
    let why = check(&hints, &rdm).unwrap_err();
    assert_eq!(
        why.to_string(),
        "caps not offered: FI_MULTICAST, FI_COLLECTIVE"
    );

    // The provider requires FI_MSG_PREFIX; an application without it fails.
    let mut hints = Hints::efabus(EpType::Unspec);
    hints.mode = Mode::empty();
    let why = check(&hints, &rdm).unwrap_err();
    assert_eq!(
        why.mismatches,
        [Mismatch::ModeNotHonoured(Mode::MSG_PREFIX)]
    );
    assert!(why.to_string().contains("not honoured: FI_MSG_PREFIX"));

    // Registration: for messages only FI_MR_LOCAL and FI_MR_ALLOCATED are
    // still required of the application; with RMA the target bits too.
    let mut hints = Hints::efabus(EpType::Unspec);
    hints.mr_mode = MrMode::empty();
    let why = check(&hints, &rdm).unwrap_err();
    assert_eq!(
        why.mismatches,
        [Mismatch::MrModeNotSupported(
            MrMode::LOCAL | MrMode::ALLOCATED
        )]
    );
    hints.caps |= Caps::RMA;
    let why = check(&hints, &rdm).unwrap_err();
    assert_eq!(
        why.to_string(),
        "mr_mode bits required by the provider and not supported: FI_MR_LOCAL, \
         FI_MR_VIRT_ADDR, FI_MR_ALLOCATED, FI_MR_PROV_KEY"
    );

    // EFA grants no ordering unless asked: a dump shows none.
    let mut hints = Hints::efabus(EpType::Unspec);
    hints.msg_order = MsgOrder::SAS;
    let why = check(&hints, &rdm).unwrap_err();
    assert_eq!(
        why.to_string(),
        "tx msg_order lacks FI_ORDER_SAS; rx msg_order lacks FI_ORDER_SAS"
    );

    // Size and provider filters.
    let mut hints = Hints::efabus(EpType::Dgram).with_provider("udp");
    hints.max_msg_size = 65_536;
    let why = check(&hints, &efa_dgram()).unwrap_err();
    assert_eq!(
        why.to_string(),
        "provider \"efa\", not \"udp\"; max_msg_size 8928 is below the 65536 wanted"
    );

    // tcp;ofi_rxm in 1.17 asks for FI_BUFFERED_RECV at the top level.
    let rxm = infos(TCP_RXM).remove(0);
    let why = check(&Hints::efabus(EpType::Rdm), &rxm).unwrap_err();
    assert_eq!(
        why.mismatches,
        [Mismatch::ModeNotHonoured(Mode::BUFFERED_RECV)]
    );
    let mut hints = Hints::efabus(EpType::Rdm);
    hints.mode |= Mode::BUFFERED_RECV;
    assert!(check(&hints, &rxm).is_ok());
}

#[test]
fn efa_on_both_sides_gives_rdm_reliable_and_dgram_best_effort() {
    let a = efa_host(1);
    let b = efa_host(2);
    let n = assert_symmetric(&a, &b, &prefs());

    assert_eq!(n.reliable.scheme, "efa-rdm");
    assert_eq!(n.reliable.local.address, vec![1; 32]);
    assert_eq!(n.reliable.remote.address, vec![2; 32]);
    let p = &n.reliable.params;
    assert!(p.reliable);
    assert_eq!(p.ep_type, EpType::Rdm);
    assert_eq!(p.prefix_size, 176);
    // 2^64-1 minus the prefix is more than the wire can express.
    assert_eq!(p.frame_limit, MAX_WIRE_FRAME);
    assert!(!p.fragment);
    // The dump grants no FI_ORDER_SAS, so efabus sequences and reorders.
    assert!(p.sequence_and_reorder);
    assert_eq!((p.send_window, p.recv_window), (4096, 4096));

    let be = n.best_effort.as_ref().expect("a datagram link");
    assert_eq!(be.scheme, "efa-dgram");
    let p = &be.params;
    assert!(!p.reliable);
    assert_eq!(p.ep_type, EpType::Dgram);
    assert_eq!(p.prefix_size, 40);
    assert_eq!(p.frame_limit, 8928 - 40);
    assert!(p.fragment && p.sequence_and_reorder);
    assert!(p.needs_fragmenting(8889) && !p.needs_fragmenting(8888));

    assert!(n
        .reasons
        .contains(&"reliable: efa-dgram: FI_EP_DGRAM is not a reliable endpoint type".into()));
    assert!(n
        .reasons
        .contains(&"reliable: tcp: usable, but efa-rdm comes first in the preference list".into()));
}

#[test]
fn efa_on_one_side_only_falls_back_to_tcp() {
    let a = efa_host(1);
    let b = vec![tcp_offer(7002)];
    let n = assert_symmetric(&a, &b, &prefs());
    assert_eq!(n.reliable.scheme, "tcp");
    assert_eq!(n.reliable.remote.address, b"127.0.0.1:7002".to_vec());
    let p = &n.reliable.params;
    assert!(p.reliable && !p.sequence_and_reorder && !p.fragment);
    assert_eq!(p.prefix_size, 0);
    assert_eq!(n.best_effort, None);
    assert_eq!(
        n.reasons,
        [
            "reliable: efa-rdm: not offered by the peer",
            "reliable: efa-dgram: not offered by the peer",
            "best-effort: efa-dgram: not offered by the peer",
            "best-effort: no datagram link both sides can use; carried on the reliable link (tcp)",
        ]
    );
    let mirrored = negotiate(&b, &a, &prefs()).unwrap();
    assert_eq!(
        mirrored.reasons[0],
        "reliable: efa-rdm: not offered by this side"
    );
}

#[test]
fn udp_datagrams_need_fragmenting_above_1472() {
    let udp = infos(UDP).remove(0);
    let side = |id: u8| {
        vec![
            Offer::from_info("efa-dgram", &udp, vec![id; 16]),
            tcp_offer(7100 + u16::from(id)),
        ]
    };
    let n = assert_symmetric(&side(1), &side(2), &prefs());
    assert_eq!(n.reliable.scheme, "tcp");
    let be = n.best_effort.expect("udp datagrams");
    assert_eq!(be.local.provider, "udp");
    let p = &be.params;
    assert_eq!(p.frame_limit, 1472);
    assert_eq!(p.prefix_size, 0);
    assert!(p.fragment);
    assert!(!p.needs_fragmenting(1472));
    assert!(p.needs_fragmenting(1473));
}

#[test]
fn mismatched_providers_under_one_scheme_are_skipped_with_a_reason() {
    let udp = infos(UDP).remove(0);
    let a = vec![
        Offer::from_info("efa-dgram", &efa_dgram(), vec![1]),
        tcp_offer(1),
    ];
    let b = vec![Offer::from_info("efa-dgram", &udp, vec![2]), tcp_offer(2)];
    let n = assert_symmetric(&a, &b, &prefs());
    assert_eq!(n.best_effort, None);
    assert!(n
        .reasons
        .iter()
        .any(|r| r == "best-effort: efa-dgram: providers differ (efa here, udp at the peer)"));
}

#[test]
fn no_common_link_is_an_error_with_reasons() {
    let a = vec![Offer::from_info("efa-rdm", &efa_rdm(), vec![1])];
    let b = vec![tcp_offer(1)];
    let err = negotiate(&a, &b, &prefs()).unwrap_err();
    assert!(err
        .reasons
        .contains(&"reliable: tcp: not offered by this side".to_string()));
    assert!(err
        .to_string()
        .starts_with("no reliable link both sides can use: "));
}

#[test]
fn schemes_outside_the_preference_list_are_not_used() {
    let a = efa_host(1);
    let b = efa_host(2);
    let n = negotiate(&a, &b, &["tcp"]).unwrap();
    assert_eq!(n.reliable.scheme, "tcp");
    assert_eq!(n.best_effort, None);
    assert!(n
        .reasons
        .contains(&"efa-rdm: not in the preference list".to_string()));
}

#[test]
fn offers_survive_the_handshake_encoding() {
    let config = bincode::config::standard();
    for offer in efa_host(7) {
        let bytes = bincode::serde::encode_to_vec(&offer, config).unwrap();
        let (back, used): (Offer, usize) =
            bincode::serde::decode_from_slice(&bytes, config).unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!(back, offer);
    }
}

/// A varied pool of offers: the fixtures' endpoints, TCP, and variants with
/// other sizes, orderings, providers and versions.
fn offer_pool() -> &'static [Offer] {
    static POOL: OnceLock<Vec<Offer>> = OnceLock::new();
    POOL.get_or_init(build_offer_pool)
}

fn build_offer_pool() -> Vec<Offer> {
    let mut pool = Vec::new();
    for info in infos(EFA)
        .iter()
        .chain(&infos(UDP)[..2])
        .chain(&infos(TCP_RXM)[..2])
    {
        let scheme = if info.ep_attr.ep_type == EpType::Dgram {
            "efa-dgram"
        } else {
            "efa-rdm"
        };
        pool.push(Offer::from_info(scheme, info, vec![1, 2, 3]));
    }
    pool.push(tcp_offer(1));
    pool.push(Offer::from_info("mem", &FabricInfo::mem(), Vec::new()));
    pool
}

fn variant(base: &Offer, tweak: u8, address: u8) -> Offer {
    let mut o = base.clone();
    o.address = vec![address];
    match tweak % 6 {
        0 => {}
        1 => o.max_msg_size = o.max_msg_size.min(4096 + u64::from(address) * 8),
        2 => {
            o.msg_order = if o.msg_order.is_empty() {
                MsgOrder::SAS
            } else {
                MsgOrder::empty()
            }
        }
        3 => o.tx_size = u64::from(address) + 1,
        4 => o.protocol_version = u32::from(tweak % 3),
        _ => o.rx_size = 16,
    }
    o
}

/// Offers of one side with addresses from `base..base + 4`: the two sides'
/// ranges overlap, so some offers appear on both sides, and duplicates
/// within a side are likely.
fn side(base: u8) -> impl Strategy<Value = Vec<Offer>> {
    let n = offer_pool().len();
    prop::collection::vec((0..n, any::<u8>(), base..base + 4), 0..7).prop_map(|picks| {
        let pool = offer_pool();
        picks
            .into_iter()
            .map(|(i, tweak, addr)| variant(&pool[i], tweak, addr))
            .collect()
    })
}

/// A side's offers, and the same offers in a shuffled order.
fn side_and_shuffled(base: u8) -> impl Strategy<Value = (Vec<Offer>, Vec<Offer>)> {
    side(base).prop_flat_map(|offers| (Just(offers.clone()), Just(offers).prop_shuffle()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn the_choice_ignores_offer_order_and_which_side_computes_it(
        (a, a_shuffled) in side_and_shuffled(0),
        (b, b_shuffled) in side_and_shuffled(2),
    ) {
        let prefs: Vec<String> =
            ["efa-rdm", "efa-dgram", "mem", "tcp"].iter().map(|s| s.to_string()).collect();
        let forward = negotiate(&a, &b, &prefs);
        let backward = negotiate(&b, &a, &prefs);
        let shuffled = negotiate(&a_shuffled, &b_shuffled, &prefs);
        prop_assert_eq!(&shuffled, &forward);
        match (&forward, &backward) {
            (Ok(f), Ok(r)) => {
                prop_assert_eq!(&r.reliable, &f.reliable.mirrored());
                prop_assert_eq!(&r.best_effort, &f.best_effort.as_ref().map(|c| c.mirrored()));
                prop_assert!(f.reliable.params.reliable);
                prop_assert!(f.reliable.params.frame_limit >= MIN_FRAME_LIMIT);
                if let Some(be) = &f.best_effort {
                    prop_assert!(be.local.ep_type.is_datagram());
                }
            }
            (Err(_), Err(_)) => {}
            _ => prop_assert!(false, "one side found a link, the other did not"),
        }
    }
}
