//! Same-host peers over libfabric's `shm` provider, through the broker.
//!
//! An embedded broker listens on TCP, `shm` and `efa-rdm` (`tcp;ofi_rxm`
//! on loopback). A client on this host that offers both gets `shm`, first
//! in the default preference: its reliable traffic really moves there
//! (counted on both sides), in order, large messages whole by rendezvous,
//! request/reply included. A client that offers only
//! `efa-rdm` stays there, and the two see each other's messages. The
//! broker lands large frames read over `shm` in huge pages. A client, or
//! a broker dialing a route, whose fabric offers state another message
//! header version pairs on neither fabric scheme.
//! (Peers on another host never pair on `shm`: `efabus_core`'s negotiation
//! tests, and `cli/tests/shm_hosts.rs` with a process that names another
//! host.)
//!
//! Skipped with a message where `shm` cannot open, unless
//! `EFABUS_REQUIRE_FABRIC=1` (CI).

use std::time::Duration;

use bytes::Bytes;
use efabus_broker::{Broker, Client, ClientOptions, Config};
use efabus_core::transport::{Endpoint, EndpointConfig, FabricOptions};
use efabus_transports::fabric::FabricTransport;
use efabus_transports::registry::Registry;

mod raw_common;
use raw_common::Raw;

const WAIT: Duration = Duration::from_secs(10);
/// The fabric buffer size: the 1 MiB payloads below go by rendezvous.
const FRAME: usize = 65_536;

fn fabric_required() -> bool {
    std::env::var("EFABUS_REQUIRE_FABRIC").is_ok_and(|v| v.trim() == "1")
}

fn start_broker() -> Option<Broker> {
    let text = format!(
        "name = \"shm-test\"\nlisten = [\"tcp/127.0.0.1:0\", \"shm\", \"efa-rdm\"]\n\
         [limits]\nmax_payload = 2097152\n\
         [fabric]\nprovider = \"tcp;ofi_rxm\"\nnode = \"127.0.0.1\"\nmax_frame = {FRAME}\n"
    );
    let config = Config::from_toml_str(&text, "shm test").expect("valid test config");
    let broker = Broker::start(config).expect("the broker starts");
    if broker.endpoint("shm").is_none() || broker.endpoint("efa-rdm").is_none() {
        assert!(
            !fabric_required(),
            "EFABUS_REQUIRE_FABRIC=1 but shm or tcp;ofi_rxm did not open"
        );
        eprintln!("skipping: shm or tcp;ofi_rxm cannot open here");
        return None;
    }
    Some(broker)
}

fn client(broker: &Broker, name: &str, data_paths: &[&str]) -> Client {
    let options = ClientOptions {
        name: name.to_string(),
        connect_timeout: WAIT,
        data_paths: data_paths.iter().map(|s| s.to_string()).collect(),
        fabric: broker.config().fabric.clone(),
        max_frame: broker.config().max_frame(),
        ..ClientOptions::default()
    };
    let tcp = broker.endpoint("tcp").expect("tcp listener");
    Client::connect_with(&tcp, options, Registry::with_builtins()).expect("client connects")
}

/// Four payloads of 1 MiB, each of its own byte: they go by rendezvous.
fn mebibyte_payloads() -> Vec<Bytes> {
    (0..4u8)
        .map(|seed| Bytes::from(vec![seed; 1 << 20]))
        .collect()
}

/// A raw client's own `shm` and `efa-rdm` endpoints (`tcp;ofi_rxm`), to
/// offer the broker by hand.
fn raw_endpoints() -> (impl Endpoint, impl Endpoint) {
    let open = |transport: FabricTransport, provider: &str| {
        let config = EndpointConfig {
            fabric: Some(FabricOptions {
                provider: provider.to_string(),
                node: Some("127.0.0.1".to_string()),
                msg_size: Some(FRAME),
                ..FabricOptions::default()
            }),
            ..EndpointConfig::default()
        };
        transport.open_fabric(&config).expect("an endpoint")
    };
    (
        open(FabricTransport::shm(), "shm"),
        open(FabricTransport::rdm(), "tcp;ofi_rxm"),
    )
}

fn stat(broker: &Broker, name: &str) -> u64 {
    broker
        .stats()
        .value(name)
        .unwrap_or_else(|| panic!("no stat {name}"))
}

#[test]
fn a_same_host_client_moves_to_shm() {
    let Some(broker) = start_broker() else {
        return;
    };
    let local = client(&broker, "local", &["shm", "efa-rdm"]);
    let link = local.link();
    assert!(link.reliable.starts_with("shm via shm"), "{link:?}");
    let remote = client(&broker, "remote", &["efa-rdm"]);
    let link = remote.link();
    assert!(link.reliable.starts_with("efa-rdm via "), "{link:?}");

    let at_local = local.subscribe("shm.>").unwrap();
    let at_remote = remote.subscribe("shm.>").unwrap();
    local.flush(WAIT).unwrap();
    remote.flush(WAIT).unwrap();
    let fabric_in = stat(&broker, "fabric_frames_in");

    // Small messages from each side, then large ones (by rendezvous).
    for n in 0..500u32 {
        local
            .publish("shm.small", n.to_le_bytes().to_vec())
            .unwrap();
    }
    let large = mebibyte_payloads();
    for payload in &large {
        remote.publish("shm.large", payload.clone()).unwrap();
    }
    local.flush(WAIT).unwrap();
    remote.flush(WAIT).unwrap();
    // Each publisher's messages in its order; the two interleave.
    for sub in [&at_local, &at_remote] {
        let (mut small, mut big) = (0u32, 0usize);
        while small < 500 || big < large.len() {
            let message = sub.recv_timeout(WAIT).expect("every message");
            if &*message.subject == "shm.small" {
                assert_eq!(message.payload[..], small.to_le_bytes(), "in order");
                small += 1;
            } else {
                assert_eq!(message.payload, large[big], "whole, in order");
                big += 1;
            }
        }
    }
    assert!(
        local.link().fabric_frames_in > 0 && local.link().fabric_frames_out > 0,
        "the local client's traffic went over shm: {:?}",
        local.link()
    );
    assert!(
        stat(&broker, "fabric_frames_in") > fabric_in + 500 / 64,
        "{:?}",
        broker.stats().snapshot()
    );

    // Request and reply across the two paths.
    let service = remote.subscribe("svc.echo").unwrap();
    remote.flush(WAIT).unwrap();
    let responder = std::thread::spawn(move || {
        let request = service.recv_timeout(WAIT).expect("a request");
        let reply = request.reply.expect("a reply subject");
        remote.publish(&reply, request.payload).unwrap();
        remote.flush(WAIT).unwrap();
    });
    let answer = local
        .request("svc.echo", &b"over shm"[..], WAIT)
        .expect("an answer");
    assert_eq!(&answer.payload[..], b"over shm");
    responder.join().unwrap();
}

/// A broker's large frames over `shm` land in huge pages (its subscribers
/// read them from there), where the system gives huge pages; counted in
/// `fabric_rendezvous_huge_landed`.
#[test]
fn a_broker_lands_large_shm_frames_in_huge_pages() {
    let Some(broker) = start_broker() else {
        return;
    };
    let publisher = client(&broker, "publisher", &["shm"]);
    let subscriber = client(&broker, "subscriber", &["shm"]);
    assert!(publisher.link().reliable.starts_with("shm via shm"));
    let sub = subscriber.subscribe("huge.>").unwrap();
    subscriber.flush(WAIT).unwrap();
    let before = stat(&broker, "fabric_rendezvous_huge_landed");
    let large = mebibyte_payloads();
    for payload in &large {
        publisher.publish("huge.frames", payload.clone()).unwrap();
    }
    publisher.flush(WAIT).unwrap();
    for payload in &large {
        let message = sub.recv_timeout(WAIT).expect("every message");
        assert_eq!(&message.payload, payload, "whole, in order");
    }
    let expected = if efabus_transports::fabric::huge_page_size().is_some() {
        large.len() as u64
    } else {
        0
    };
    // Published at the end of the broker's round, which may come after
    // the subscriber has the last frame.
    let deadline = std::time::Instant::now() + WAIT;
    let mut landed = stat(&broker, "fabric_rendezvous_huge_landed") - before;
    while landed < expected && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
        landed = stat(&broker, "fabric_rendezvous_huge_landed") - before;
    }
    assert_eq!(landed, expected);
}

/// A client whose `shm` link the broker cannot open (here a name with no
/// region behind it; as well `shm` full past libfabric's 256 peers) is
/// offered the next path both have, `efa-rdm`, rather than none: the
/// welcome carries the broker's `efa-rdm` side alone, so the client
/// arrives at the same choice.
#[test]
fn a_client_whose_shm_link_cannot_open_is_offered_efa_rdm() {
    use efabus_broker::endpoints::offer_for;
    use efabus_core::frame::{Frame, Hello, PROTOCOL_VERSION};

    let Some(broker) = start_broker() else {
        return;
    };
    let (shm, rdm) = raw_endpoints();
    let mut shm_offer = offer_for(&shm).expect("an shm offer");
    // No process has this number: no region of that name exists.
    shm_offer.address = b"fi_shm://4000000000:0:0\0".to_vec();
    let rdm_offer = offer_for(&rdm).expect("an efa-rdm offer");
    let secret = efabus_broker::link_auth::LinkSecret::new().expect("a secret");
    let mut raw = Raw::connect(&broker);
    raw.send(&Frame::Hello(Hello {
        no_echo: false,
        no_responders: false,
        version: PROTOCOL_VERSION,
        name: "shm-refused".into(),
        credentials: None,
        user: None,
        proof: None,
        offers: vec![shm_offer, rdm_offer],
        link_auth: Some(secret.auth().clone()),
    }));
    let Frame::Welcome(welcome) = raw.expect("welcome", |f| matches!(f, Frame::Welcome(_))) else {
        unreachable!()
    };
    let schemes: Vec<&str> = welcome.offers.iter().map(|o| o.scheme.as_str()).collect();
    assert!(schemes.contains(&"efa-rdm"), "{schemes:?}");
    assert!(!schemes.contains(&"shm"), "{schemes:?}");
    let broker_rdm = welcome
        .offers
        .iter()
        .find(|o| o.scheme == "efa-rdm")
        .expect("the broker's efa-rdm side");
    let ours = efabus_core::caps::negotiate(
        &[offer_for(&rdm).expect("an efa-rdm offer")],
        std::slice::from_ref(broker_rdm),
        &["shm", "efa-rdm"],
    )
    .expect("a path in common");
    assert_eq!(ours.reliable.scheme, "efa-rdm");
}

/// A client whose fabric offers state another message header version (a
/// different efabus release), or none (a release from before offers
/// stated it), shares no fabric path with the broker: its session is on
/// TCP from its first frame, with the reason, instead of opening data
/// links that would carry nothing. So is a route another broker dials.
#[test]
fn a_peer_of_another_fabric_header_version_stays_on_tcp() {
    use efabus_broker::endpoints::offer_for;
    use efabus_core::frame::{Frame, Hello, RouteHello, PROTOCOL_VERSION};
    use efabus_transports::fabric::layout::HEADER_VERSION;

    let Some(broker) = start_broker() else {
        return;
    };
    let (shm, rdm) = raw_endpoints();
    // Offers of this endpoint pair as stating `header` (None: no version
    // at all).
    let offers_stating = |header: Option<u8>| {
        let mut offers = vec![
            offer_for(&shm).expect("an shm offer"),
            offer_for(&rdm).expect("an efa-rdm offer"),
        ];
        for offer in &mut offers {
            assert_eq!(offer.fabric_header(), HEADER_VERSION, "{offer}");
            match header {
                Some(version) => offer.mark_fabric_header(version),
                None => offer.protocol_version = offer.provider_version(),
            }
        }
        offers
    };
    let hello = |name: &str, header: Option<u8>| {
        let secret = efabus_broker::link_auth::LinkSecret::new().expect("a secret");
        Frame::Hello(Hello {
            no_echo: false,
            no_responders: false,
            version: PROTOCOL_VERSION,
            name: name.into(),
            credentials: None,
            user: None,
            proof: None,
            offers: offers_stating(header),
            link_auth: Some(secret.auth().clone()),
        })
    };
    // The session of a raw client whose offers state `header`, as the
    // broker reports it.
    let session_with = |name: &str, header: Option<u8>| {
        let mut raw = Raw::connect(&broker);
        raw.send(&hello(name, header));
        raw.expect("welcome", |f| matches!(f, Frame::Welcome(_)));
        let report = broker
            .connections(&[], WAIT)
            .expect("the broker reports its connections")
            .into_iter()
            .find(|report| report.name == name)
            .unwrap_or_else(|| panic!("no session named {name}"));
        (raw, report)
    };
    // This release's offers pair; another version's, or none, do not.
    let (_same, report) = session_with("same-release", Some(HEADER_VERSION));
    assert!(report.reliable.starts_with("shm"), "{report:?}");
    for (name, header, stated) in [
        (
            "newer",
            Some(HEADER_VERSION + 1),
            format!("version {}", HEADER_VERSION + 1),
        ),
        (
            "older",
            Some(HEADER_VERSION - 1),
            format!("version {}", HEADER_VERSION - 1),
        ),
        ("unstated", None, "none stated".to_string()),
    ] {
        let (_raw, report) = session_with(name, header);
        assert_eq!(report.reliable, "tcp", "{report:?}");
        for scheme in ["shm", "efa-rdm"] {
            let expected = format!(
                "{scheme}: efabus fabric message headers differ (version {HEADER_VERSION} here, \
                 {stated}"
            );
            assert!(
                report.reasons.iter().any(|r| r.contains(&expected)),
                "{scheme} {expected:?}: {:?}",
                report.reasons
            );
        }
    }
    // A broker dialing a route with another version's offers: the same.
    let mut raw = Raw::connect(&broker);
    raw.send(&hello("other-broker", Some(HEADER_VERSION + 1)));
    raw.send(&Frame::Route(RouteHello {
        broker_id: 42,
        advertise: None,
        seeded: false,
        limits: raw_common::default_route_limits(),
    }));
    raw.expect("the route hello back", |f| matches!(f, Frame::Route(_)));
    let route = broker
        .routes()
        .into_iter()
        .find(|route| route.name == "other-broker")
        .expect("the route");
    assert_eq!(route.reliable, "tcp", "{route:?}");
    assert!(
        route
            .reasons
            .iter()
            .any(|r| r.contains("efa-rdm: efabus fabric message headers differ")),
        "{:?}",
        route.reasons
    );
}
