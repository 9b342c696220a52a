//! The handshake: hello and welcome frames from arbitrary bytes (or from a
//! real hello with bytes overwritten), and negotiation over the offers they
//! carry. Nothing panics; a negotiation both sides compute agrees, and the
//! links it chooses can be driven.

#![no_main]

use std::sync::OnceLock;

use bytes::Bytes;
use efabus_core::caps::{
    negotiate, parse_fi_info_dump, EpType, FabricInfo, Offer, MIN_FRAME_LIMIT,
};
use efabus_core::codec::{self, CodecLimits};
use efabus_core::frame::{Frame, Hello, LinkAuth, Welcome, PROTOCOL_VERSION};
use efabus_core::link::{LinkConfig, LinkSender, LinkTuning};
use libfuzzer_sys::fuzz_target;

const EFA: &str = include_str!("../../core/tests/fixtures/efa-fi_info-v.txt");
const TCP_RXM: &str = include_str!("../../core/tests/fixtures/libfabric-1.17-tcp-rxm-rdm-lo.txt");
const UDP: &str = include_str!("../../core/tests/fixtures/libfabric-1.17-udp-dgram-lo.txt");

fn offers(dump: &str) -> Vec<Offer> {
    let mut offers: Vec<Offer> = parse_fi_info_dump(dump)
        .expect("fixture parses")
        .iter()
        .map(|info| {
            let scheme = if info.ep_attr.ep_type == EpType::Dgram {
                "efa-dgram"
            } else {
                "efa-rdm"
            };
            Offer::from_info(scheme, info, vec![0xab; 32])
        })
        .collect();
    offers.push(Offer::from_info(
        "tcp",
        &FabricInfo::tcp(None),
        b"127.0.0.1:7420".to_vec(),
    ));
    offers
}

struct Setup {
    local: Vec<Offer>,
    hello: Vec<u8>,
    welcome: Vec<u8>,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        // A few of each kind keeps executions fast.
        let mut remote: Vec<Offer> = offers(TCP_RXM).into_iter().take(3).collect();
        remote.extend(offers(UDP).into_iter().take(2));
        let hello = codec::encode(&Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            name: "peer".into(),
            credentials: Some("secret".into()),
            user: None,
            proof: None,
            offers: remote.clone(),
            link_auth: Some(LinkAuth {
                key_share: [9; 32],
                link_id: 7,
            }),
            no_echo: false,
            no_responders: false,
        }))
        .to_bytes()
        .to_vec();
        let welcome = codec::encode(&Frame::Welcome(Welcome {
            version: PROTOCOL_VERSION,
            name: "broker".into(),
            offers: offers(EFA),
            max_payload: 1 << 20,
            link_auth: None,
            max_subject_len: 512,
            max_subject_tokens: 32,
            proof: None,
        }))
        .to_bytes()
        .to_vec();
        Setup {
            local: offers(EFA),
            hello,
            welcome,
        }
    })
}

/// A real frame with bytes overwritten as `edits` says (3 bytes per edit:
/// position, value), cut or extended to a length from the input, and its
/// prefix set to match, so the mutants get past the length check.
fn mutate(base: &[u8], edits: &[u8]) -> Vec<u8> {
    let mut frame = base.to_vec();
    let mut edits = edits.chunks_exact(3);
    if let Some(first) = edits.next() {
        let len = u16::from_le_bytes([first[0], first[1]]) as usize;
        if first[2] & 1 == 1 && len >= 5 {
            frame.resize(len.min(base.len() * 2), first[2]);
        }
    }
    for edit in edits {
        let at = u16::from_le_bytes([edit[0], edit[1]]) as usize;
        if let Some(byte) = frame.get_mut(at.max(4)) {
            *byte = edit[2];
        }
    }
    if frame.len() >= 4 {
        let declared = (frame.len() - 4) as u32;
        frame[..4].copy_from_slice(&declared.to_le_bytes());
    }
    frame
}

fn check(local: &[Offer], remote: &[Offer]) {
    let prefs = ["efa-rdm", "efa-dgram", "tcp"];
    let forward = negotiate(local, remote, &prefs);
    let backward = negotiate(remote, local, &prefs);
    match (&forward, &backward) {
        (Ok(f), Ok(b)) => {
            assert_eq!(b.reliable, f.reliable.mirrored());
            assert_eq!(b.best_effort, f.best_effort.as_ref().map(|c| c.mirrored()));
            assert!(f.reliable.params.reliable);
            assert!(f.reliable.params.frame_limit >= MIN_FRAME_LIMIT);
            let _ = f.to_string();
            for choice in std::iter::once(&f.reliable).chain(&f.best_effort) {
                let config =
                    LinkConfig::from_params(&choice.params, 1 << 20, &LinkTuning::default());
                LinkSender::new(&config).expect("a negotiated link can be driven");
            }
        }
        (Err(_), Err(_)) => {}
        _ => panic!("one side found a link and the other did not: {forward:?} / {backward:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let setup = setup();
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let bytes = match mode % 3 {
        0 => rest.to_vec(),
        1 => mutate(&setup.hello, rest),
        _ => mutate(&setup.welcome, rest),
    };
    let remote = match codec::decode(Bytes::from(bytes), &CodecLimits::default()) {
        Ok(Frame::Hello(hello)) => hello.offers,
        Ok(Frame::Welcome(welcome)) => welcome.offers,
        _ => return,
    };
    check(&setup.local, &remote);
    check(&remote, &remote);
});
