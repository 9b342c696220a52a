//! Who may speak on the broker's fabric endpoint.
//!
//! An attacker here is a fabric endpoint of the same provider on the same
//! host that knows everything that travels in clear: the broker's fabric
//! address, a victim client's fabric address and the link id the broker
//! gave the victim's links (all three are in the handshake). It sends
//! well-formed efabus frames (publishes, credits, pieces that take the
//! victim's next sequence numbers or lie far outside its window), writing
//! the victim's address as sender, under a key it had to guess. None of it
//! may be delivered, move the victim's sequence or credit state, or end the
//! victim's session, and the broker counts every message; the same holds
//! on a route's data link, with the dialing broker as victim. A stranger that
//! knows no link id is counted as such and costs the broker nothing it
//! keeps. A client whose hello names another client's fabric address gets
//! no traffic sent there and takes nothing over from it; a client that
//! reconnects from its own address replaces its old session. A session
//! that is closing acknowledges nothing it drops.
//!
//! `tcp;ofi_rxm` on loopback; skipped unless libfabric opens here, a
//! failure instead under `EFABUS_REQUIRE_FABRIC=1`.

use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_broker::{Broker, Client, ClientOptions, Config, Error, Subscription};
use efabus_core::codec;
use efabus_core::frame::{Credit, Fragment, Frame, Publish};
use efabus_core::transport::{Endpoint, EndpointConfig, FabricOptions, LinkKeys};
use efabus_transports::fabric::{addr_from_hex, FabricEndpoint, FabricTransport};
use efabus_transports::registry::Registry;

mod raw_common;
use raw_common::{CutRelay, Raw, WAIT};

/// Held by every test here, so the one that measures memory runs alone.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
const PROVIDER: &str = "tcp;ofi_rxm";

fn fabric_required() -> bool {
    std::env::var("EFABUS_REQUIRE_FABRIC").is_ok_and(|v| v.trim() == "1")
}

fn fabric_table(provider: &str) -> String {
    format!("[fabric]\nprovider = \"{provider}\"\nnode = \"127.0.0.1\"\nmax_frame = 65536\n")
}

fn start_broker() -> Option<Broker> {
    start_broker_with("")
}

/// [`start_broker`] with `extra` tables in its config.
fn start_broker_with(extra: &str) -> Option<Broker> {
    let provider = PROVIDER;
    let text = format!(
        "name = \"trust\"\nlisten = [\"tcp/127.0.0.1:0\", \"efa-rdm\"]\n{extra}\n{}",
        fabric_table(provider)
    );
    let config = Config::from_toml_str(&text, "trust test").expect("valid test config");
    match Broker::start(config) {
        Ok(broker) if broker.endpoint("efa-rdm").is_some() => Some(broker),
        Ok(_) | Err(Error::Endpoint { .. }) if !fabric_required() => {
            eprintln!("skipping: {provider} cannot open here");
            None
        }
        Ok(_) => panic!("EFABUS_REQUIRE_FABRIC=1 but {provider} did not open"),
        Err(err) => panic!("broker does not start: {err}"),
    }
}

fn client_options(broker: &Broker, name: &str) -> ClientOptions {
    ClientOptions {
        name: name.to_string(),
        connect_timeout: WAIT,
        data_paths: vec!["efa-rdm".to_string()],
        fabric: broker.config().fabric.clone(),
        ..ClientOptions::default()
    }
}

fn fabric_client(broker: &Broker, name: &str) -> Client {
    let endpoint = broker.endpoint("tcp").expect("tcp listener");
    let client = Client::connect_with(
        &endpoint,
        client_options(broker, name),
        Registry::with_builtins(),
    )
    .expect("client connects");
    assert!(
        client.link().reliable.starts_with("efa-rdm"),
        "{name}: {:?}",
        client.link()
    );
    client
}

fn stat(broker: &Broker, name: &str) -> u64 {
    broker
        .stats()
        .value(name)
        .unwrap_or_else(|| panic!("no stat {name}"))
}

fn eventually(mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    condition()
}

/// An endpoint of the broker's provider, to attack from.
fn attacker_endpoint() -> FabricEndpoint {
    let transport = FabricTransport::rdm();
    let config = EndpointConfig {
        fabric: Some(FabricOptions {
            provider: PROVIDER.to_string(),
            node: Some("127.0.0.1".to_string()),
            msg_size: Some(65536),
            ..FabricOptions::default()
        }),
        ..EndpointConfig::default()
    };
    transport.open_fabric(&config).expect("attacker endpoint")
}

fn broker_fabric_address(broker: &Broker) -> Vec<u8> {
    let spec = broker.endpoint("efa-rdm").expect("fabric listener");
    let hex = spec.strip_prefix("efa-rdm/").expect("scheme prefix");
    addr_from_hex(hex).expect("hex address")
}

/// A whole frame as the link layer would carry it: one piece numbered
/// `seq`.
fn piece(seq: u64, frame: &Frame) -> Bytes {
    let inner = codec::encode(frame).to_bytes();
    codec::encode(&Frame::Fragment(Fragment {
        msg_id: seq,
        index: 0,
        count: 1,
        total_len: inner.len() as u32,
        data: inner,
    }))
    .to_bytes()
}

/// Sends `frames` from `attacker` to `to`, then polls it a while so they
/// leave.
fn send_all(attacker: &mut FabricEndpoint, to: efabus_core::transport::PeerId, frames: &[Bytes]) {
    for frame in frames {
        send_one(attacker, to, frame);
    }
    for _ in 0..50 {
        attacker.poll(&mut Vec::new()).expect("poll attacker");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Well-formed efabus frames an attacker would send on a victim's link:
/// publishes under the victim's next sequence numbers, a piece far
/// outside any window, a credit opening the window wide, and a publish
/// outside the link's sequence.
fn forgeries() -> Vec<Bytes> {
    [
        // The victim's next sequence numbers, with a publish each.
        piece(
            2,
            &Frame::Publish(Publish {
                headers: None,
                subject: "trust.forged".into(),
                reply: None,
                seq: 0,
                payload: Bytes::from_static(b"forged"),
            }),
        ),
        piece(
            3,
            &Frame::Publish(Publish {
                headers: None,
                subject: "trust.forged".into(),
                reply: None,
                seq: 0,
                payload: Bytes::from_static(b"forged"),
            }),
        ),
        // A piece far outside any window, which would end a link.
        piece(u64::MAX / 2, &Frame::Ping { nonce: 1 }),
        // A credit opening the victim's window wide.
        codec::encode(&Frame::Credit(Credit {
            messages: u32::MAX,
            bytes: u64::MAX,
            ack_seq: u64::MAX / 2,
        }))
        .to_bytes(),
        // And a bare publish, outside the link's sequence.
        codec::encode(&Frame::Publish(Publish {
            headers: None,
            subject: "trust.forged".into(),
            reply: None,
            seq: 0,
            payload: Bytes::from_static(b"forged"),
        }))
        .to_bytes(),
    ]
    .into()
}

/// What the victim publishes on `trust.real` with `publish` (200
/// numbered messages) reaches `sub` whole and in order, and nothing else
/// does.
fn arrives_whole(sub: &Subscription, mut publish: impl FnMut(Bytes)) {
    for n in 1..=200u32 {
        publish(Bytes::from(n.to_string()));
    }
    for n in 1..=200u32 {
        let message = sub.recv_timeout(WAIT).expect("the victim's message");
        assert_eq!(message.subject.as_ref(), "trust.real", "nothing forged");
        assert_eq!(message.payload, Bytes::from(n.to_string()));
    }
    assert!(sub.recv_timeout(Duration::from_millis(200)).is_err());
}

#[test]
fn forged_fabric_messages_are_dropped_and_counted() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(broker) = start_broker() else {
        return;
    };
    let listener = fabric_client(&broker, "listener");
    let sub = listener.subscribe("trust.>").unwrap();
    listener.flush(WAIT).unwrap();
    let victim = fabric_client(&broker, "victim");
    victim.publish("trust.real", &b"0"[..]).unwrap();
    victim.flush(WAIT).unwrap();
    assert_eq!(&sub.recv_timeout(WAIT).unwrap().payload[..], b"0");
    let report = victim.link();
    let victim_address =
        addr_from_hex(report.fabric_address.as_deref().expect("victim address")).unwrap();
    let link_id = report.server_link_id.expect("the broker's link id");

    let mut attacker = attacker_endpoint();
    let broker_address = broker_fabric_address(&broker);
    let forgeries = forgeries();

    // First as a stranger: no link id the broker knows.
    let stranger = LinkKeys {
        send_key: [1; 32],
        receive_key: [2; 32],
        local_id: 77,
        remote_id: 0x5eed,
    };
    let to_broker = attacker
        .insert_peer(&broker_address, &stranger)
        .expect("insert the broker");
    send_all(&mut attacker, to_broker, &forgeries);
    assert!(
        eventually(|| stat(&broker, "fabric_unknown_links") >= forgeries.len() as u64),
        "strangers counted: {:?}",
        broker.stats().snapshot()
    );

    // Then as the victim: its address, the broker's id for its link, a
    // guessed key.
    let guessed = LinkKeys {
        send_key: [0x42; 32],
        receive_key: [0x43; 32],
        local_id: 78,
        remote_id: link_id,
    };
    let to_broker = attacker
        .insert_peer(&broker_address, &guessed)
        .expect("insert the broker again");
    attacker.claim_address(&victim_address);
    send_all(&mut attacker, to_broker, &forgeries);
    assert!(
        eventually(|| stat(&broker, "fabric_forged") >= forgeries.len() as u64),
        "forgeries counted: {:?}",
        broker.stats().snapshot()
    );
    // And messages that are not efabus messages at all.
    attacker.claim_header_version(0xee);
    send_all(&mut attacker, to_broker, &forgeries);
    assert!(
        eventually(|| stat(&broker, "fabric_malformed") >= forgeries.len() as u64),
        "malformed messages counted: {:?}",
        broker.stats().snapshot()
    );

    // Nothing forged was delivered; the victim's session is up, its
    // sequence and window untouched: what it sends now all arrives, in
    // order.
    arrives_whole(&sub, |payload| {
        victim.publish("trust.real", payload).unwrap();
        victim.flush(WAIT).unwrap();
    });
    assert_eq!(
        stat(&broker, "bad_frames"),
        0,
        "{:?}",
        broker.stats().snapshot()
    );
    assert_eq!(stat(&broker, "connections"), 2, "both sessions are up");
    assert_eq!(victim.reconnects(), 0);
}

/// A route's data link is held to the same rule. Frames naming the
/// dialing broker's fabric address and the accepting broker's id for the
/// route's link, under a guessed key, are dropped and counted as forged;
/// the route stays up and what the dialing broker publishes still arrives,
/// all of it, in order.
#[test]
fn forged_frames_on_a_route_s_data_link_are_dropped_and_counted() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(a) = start_broker() else {
        return;
    };
    let seed = a.endpoint("tcp").expect("tcp listener");
    let Some(b) = start_broker_with(&format!("peers = [{seed:?}]")) else {
        return;
    };
    // Each broker records the route when its own side of the handshake
    // ends, so b (which waits for a's welcome) may see it later than a.
    let on_fabric = |broker: &Broker| {
        broker
            .routes()
            .first()
            .is_some_and(|route| route.reliable.starts_with("efa-rdm") && route.link_id.is_some())
    };
    assert!(
        eventually(|| on_fabric(&a) && on_fabric(&b)),
        "the route is not on the fabric at both ends: {:?} {:?}",
        a.routes(),
        b.routes()
    );
    let link_id = a.routes()[0].link_id.expect("a's id for the route's link");
    let b_link_id = b.routes().first().and_then(|route| route.link_id);
    assert!(
        b_link_id.is_some_and(|id| id != link_id),
        "b reports its own id for the link: {:?}",
        b.routes()
    );
    let sub = a.subscribe("trust.>").unwrap();
    assert!(
        eventually(|| b.route_interest_count() == 1),
        "a's interest at b"
    );
    b.publish("trust.real", &b"0"[..]).unwrap();
    assert_eq!(&sub.recv_timeout(WAIT).unwrap().payload[..], b"0");

    let mut attacker = attacker_endpoint();
    let guessed = LinkKeys {
        send_key: [0x42; 32],
        receive_key: [0x43; 32],
        local_id: 78,
        remote_id: link_id,
    };
    let to_a = attacker
        .insert_peer(&broker_fabric_address(&a), &guessed)
        .expect("insert a");
    attacker.claim_address(&broker_fabric_address(&b));
    let forgeries = forgeries();
    send_all(&mut attacker, to_a, &forgeries);
    assert!(
        eventually(|| stat(&a, "fabric_forged") >= forgeries.len() as u64),
        "forgeries counted: {:?}",
        a.stats().snapshot()
    );

    arrives_whole(&sub, |payload| b.publish("trust.real", payload).unwrap());
    assert_eq!(stat(&a, "bad_frames"), 0, "{:?}", a.stats().snapshot());
    // The same route: a link id is drawn afresh for each handshake.
    let routes = a.routes();
    assert!(
        routes.len() == 1
            && routes[0].reliable.starts_with("efa-rdm")
            && routes[0].link_id == Some(link_id),
        "the route is still up on the fabric: {routes:?}"
    );
}

#[test]
fn a_hello_naming_another_clients_address_takes_nothing_over() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(broker) = start_broker() else {
        return;
    };
    let victim = fabric_client(&broker, "victim");
    let sub = victim.subscribe("mine.>").unwrap();
    victim.flush(WAIT).unwrap();
    let victim_address =
        addr_from_hex(victim.link().fabric_address.as_deref().expect("address")).unwrap();

    // An impostor whose hello offers an efa-rdm data path at the victim's
    // address, with a key share of its own.
    let attacker = attacker_endpoint();
    let mut offer = efabus_broker::endpoints::offer_for(&attacker).expect("an offer");
    offer.address = victim_address;
    let mut impostor = Raw::connect(&broker);
    let mut key_share = [0u8; 32];
    key_share[0] = 9;
    impostor.send(&Frame::Hello(efabus_core::frame::Hello {
        no_echo: false,
        no_responders: false,
        version: efabus_core::frame::PROTOCOL_VERSION,
        name: "impostor".into(),
        credentials: None,
        user: None,
        proof: None,
        offers: vec![offer],
        link_auth: Some(efabus_core::frame::LinkAuth {
            key_share,
            link_id: 4242,
        }),
    }));
    let welcome = impostor.expect("welcome", |f| matches!(f, Frame::Welcome(_)));
    let Frame::Welcome(welcome) = welcome else {
        unreachable!()
    };
    assert!(
        welcome.offers.iter().any(|o| o.scheme == "efa-rdm"),
        "the broker opened a data link for the named address: {welcome:?}"
    );
    impostor.send(&Frame::Subscribe(efabus_core::frame::Subscribe {
        sid: 1,
        pattern: "mine.>".into(),
        queue: None,
        class: efabus_core::frame::DeliveryClass::Reliable,
    }));
    impostor.send(&Frame::Ping { nonce: 5 });
    impostor.expect("pong", |f| matches!(f, Frame::Pong { nonce: 5 }));

    let publisher = fabric_client(&broker, "publisher");
    let publish = |from: u32, to: u32| {
        for n in from..to {
            publisher
                .publish("mine.data", Bytes::from(n.to_string()))
                .unwrap();
        }
        publisher.flush(WAIT).unwrap();
    };
    publish(0, 100);
    for n in 0..100u32 {
        let message = sub.recv_timeout(WAIT).expect("victim's message");
        assert_eq!(message.payload, Bytes::from(n.to_string()));
    }
    // The impostor never used the data link, so its messages came on its
    // own control link, not to the victim's address.
    let last = Bytes::from("99");
    impostor.expect(
        "the impostor's copy on TCP",
        |f| matches!(f, Frame::Message(m) if m.payload == last),
    );

    // The impostor leaves; its data link closes, the victim's stays.
    drop(impostor);
    assert!(eventually(|| stat(&broker, "connections") == 2));
    publish(100, 200);
    for n in 100..200u32 {
        let message = sub.recv_timeout(WAIT).expect("victim's message after");
        assert_eq!(message.payload, Bytes::from(n.to_string()));
    }
    assert_eq!(victim.reconnects(), 0, "the victim kept its session");
    assert!(victim.link().reliable.starts_with("efa-rdm"));
}

/// Every Rust allocation of this process (the broker's included) goes
/// through jemalloc, whose statistics say how much is live.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Bytes the process's Rust code holds allocated right now.
fn allocated() -> u64 {
    // Statistics are a snapshot taken when the epoch advances.
    let _ = tikv_jemalloc_ctl::epoch::advance();
    tikv_jemalloc_ctl::stats::allocated::read().map_or(0, |bytes| bytes as u64)
}

/// Senders a flood makes up.
const FORGED_SENDERS: u32 = 100_000;
/// Forged senders before memory is measured.
const FLOOD_WARMUP: u32 = 5_000;
/// What the broker may still hold after a flood of forged senders: less
/// than 11 bytes a sender, which no per-sender state fits in (100,000
/// sessions took 540 MiB before messages were authenticated).
const FLOOD_KEPT_BYTES: u64 = 1 << 20;

/// Memory is measured for the whole process, so this test runs alone. It
/// counts what Rust code holds (jemalloc's statistics), not the process's
/// resident size: libfabric's own pools (`tcp;ofi_rxm` grows them in
/// chunks while a sender outruns the receiver, forged or not) are not
/// efabus's to bound.
#[test]
fn a_hundred_thousand_forged_senders_cost_nothing_lasting() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(broker) = start_broker() else {
        return;
    };
    let before_client = fabric_client(&broker, "before the flood");
    let sub = before_client.subscribe("flood.>").unwrap();
    before_client.flush(WAIT).unwrap();
    let connections = stat(&broker, "connections");

    let mut attacker = attacker_endpoint();
    let broker_address = broker_fabric_address(&broker);
    let keys = LinkKeys {
        send_key: [3; 32],
        receive_key: [4; 32],
        local_id: 1,
        remote_id: 0xf100d,
    };
    let to_broker = attacker
        .insert_peer(&broker_address, &keys)
        .expect("insert the broker");
    let forged = piece(
        1,
        &Frame::Publish(Publish {
            headers: None,
            subject: "flood.forged".into(),
            reply: None,
            seq: 0,
            payload: Bytes::from_static(b"forged"),
        }),
    );
    let mut address = attacker.local_addr();
    // Sends one forged message per sender in `senders`, then polls the
    // attacker (whose provider may need it to finish sending) until the
    // broker has counted `total` in all.
    // Sends one forged message per sender in `senders`, a thousand at a
    // time, each time polling the attacker (whose provider may need it to
    // finish sending) until the broker has counted them: the attacker never
    // runs far ahead, so the providers' queues stay short.
    let mut flood = |senders: std::ops::Range<u32>, distinct: bool| {
        let base = stat(&broker, "fabric_unknown_links") - u64::from(senders.start);
        for n in senders {
            if distinct {
                address[..4].copy_from_slice(&n.to_le_bytes());
                attacker.claim_address(&address);
            }
            send_one(&mut attacker, to_broker, &forged);
            if (n + 1) % 1_000 != 0 {
                continue;
            }
            let deadline = Instant::now() + WAIT;
            while stat(&broker, "fabric_unknown_links") < base + u64::from(n + 1) {
                attacker.poll(&mut Vec::new()).expect("poll attacker");
                assert!(
                    Instant::now() < deadline,
                    "every forged message counted: {:?}",
                    broker.stats().snapshot()
                );
                std::thread::yield_now();
            }
        }
    };
    // First enough to touch every buffer of both endpoints once (a
    // buffer's first use faults its pages in).
    flood(0..FLOOD_WARMUP, false);
    let before = allocated();
    let end = FLOOD_WARMUP + FORGED_SENDERS;
    flood(FLOOD_WARMUP..end, true);
    let kept = allocated().saturating_sub(before);
    eprintln!("{FORGED_SENDERS} forged senders: {kept} bytes kept of {before} allocated before");
    assert!(
        kept < FLOOD_KEPT_BYTES,
        "{FORGED_SENDERS} forged senders left {kept} bytes allocated"
    );
    assert_eq!(stat(&broker, "connections"), connections, "no session");
    assert!(sub.recv_timeout(Duration::from_millis(200)).is_err());

    // A legitimate client still gets its fabric path, and is heard.
    let after = fabric_client(&broker, "after the flood");
    after.publish("flood.real", &b"real"[..]).unwrap();
    after.flush(WAIT).unwrap();
    let message = sub.recv_timeout(WAIT).expect("the real message");
    assert_eq!(&message.payload[..], b"real");
}

/// Sends one frame, polling between tries, and polls once more.
fn send_one(attacker: &mut FabricEndpoint, to: efabus_core::transport::PeerId, frame: &Bytes) {
    let deadline = Instant::now() + WAIT;
    while attacker
        .send(to, efabus_core::transport::OutFrame::whole(frame.clone()))
        .is_err()
    {
        attacker.poll(&mut Vec::new()).expect("poll attacker");
        assert!(Instant::now() < deadline, "attacker cannot send");
    }
    attacker.poll(&mut Vec::new()).expect("poll attacker");
}

/// A raw control link to `broker` whose hello offers `attacker`'s fabric
/// endpoint (at `claimed`, when given, instead of its own address) with a
/// fresh half of the link keys; once welcomed, the broker is inserted in
/// `attacker` with the agreed keys. Returns the link and the broker's peer
/// id on `attacker`.
fn hello_from(
    broker: &Broker,
    attacker: &mut FabricEndpoint,
    name: &str,
    claimed: Option<&[u8]>,
) -> (Raw, efabus_core::transport::PeerId) {
    use efabus_broker::link_auth::{HandshakeRole, LinkSecret};
    let mut offer = efabus_broker::endpoints::offer_for(attacker).expect("an offer");
    if let Some(address) = claimed {
        offer.address = address.to_vec();
    }
    let secret = LinkSecret::new().expect("a secret");
    let (raw, welcome) = welcomed(broker, name, offer, &secret);
    let keys = secret
        .keys(
            HandshakeRole::Dialer,
            welcome.link_auth.as_ref().expect("the broker's part"),
            "efa-rdm",
        )
        .expect("keys");
    let to_broker = attacker
        .insert_peer(&broker_fabric_address(broker), &keys)
        .expect("insert the broker");
    (raw, to_broker)
}

/// A raw control link to `broker` that said hello as `name`, offering
/// `offer` with `secret`'s half of the link keys, and the welcome.
fn welcomed(
    broker: &Broker,
    name: &str,
    offer: efabus_core::caps::Offer,
    secret: &efabus_broker::link_auth::LinkSecret,
) -> (Raw, efabus_core::frame::Welcome) {
    let mut raw = Raw::connect(broker);
    raw.send(&Frame::Hello(efabus_core::frame::Hello {
        no_echo: false,
        no_responders: false,
        version: efabus_core::frame::PROTOCOL_VERSION,
        name: name.into(),
        credentials: None,
        user: None,
        proof: None,
        offers: vec![offer],
        link_auth: Some(secret.auth().clone()),
    }));
    let Frame::Welcome(welcome) = raw.expect("welcome", |f| matches!(f, Frame::Welcome(_))) else {
        unreachable!()
    };
    (raw, welcome)
}

/// A hello whose data path the broker cannot open (here an address of
/// the wrong size for its endpoint; as well a `shm` address vector full
/// past libfabric's 256 peers) is welcomed with no data path offered, so
/// that the client stays on TCP from the start. (It was offered them all,
/// opened its side, moved its traffic there and lost it until it gave the
/// link up as silent.)
#[test]
fn a_data_path_the_broker_cannot_open_is_not_offered_back() {
    let Some(broker) = start_broker() else {
        return;
    };
    let attacker = attacker_endpoint();
    let mut offer = efabus_broker::endpoints::offer_for(&attacker).expect("an offer");
    offer.address = vec![1, 2, 3];
    let secret = efabus_broker::link_auth::LinkSecret::new().expect("a secret");
    let (_raw, welcome) = welcomed(&broker, "unopenable", offer, &secret);
    let schemes: Vec<&str> = welcome.offers.iter().map(|o| o.scheme.as_str()).collect();
    assert!(
        schemes
            .iter()
            .all(|s| !efabus_broker::endpoints::is_data_scheme(s)),
        "data paths offered back: {schemes:?}"
    );
}

/// An impostor that does use the data link: it offers the victim's fabric
/// address, agrees real keys, and sends the broker authenticated frames
/// from its own endpoint under the victim's address. The broker asks for
/// proof at that address, where nobody answers: the impostor's traffic is
/// held (it never receives a frame on the fabric), the challenge is asked
/// a few times, one per heartbeat, and then the session ends, counted.
/// The victim loses nothing.
#[test]
fn an_address_never_proven_gets_no_traffic_and_ends_the_session() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(broker) = start_broker_with("[heartbeat]\ninterval_ms = 200\ntimeout_ms = 5000")
    else {
        return;
    };
    let victim = fabric_client(&broker, "victim");
    let sub = victim.subscribe("mine.>").unwrap();
    victim.flush(WAIT).unwrap();
    let victim_address =
        addr_from_hex(victim.link().fabric_address.as_deref().expect("address")).unwrap();

    let mut attacker = attacker_endpoint();
    let (mut impostor, to_broker) =
        hello_from(&broker, &mut attacker, "impostor", Some(&victim_address));
    attacker.claim_address(&victim_address);
    // Sequence 1 on the data link: the first frame, which starts the
    // proof; then a subscription, whose matches would come back.
    let subscribe = Frame::Subscribe(efabus_core::frame::Subscribe {
        sid: 1,
        pattern: "mine.>".into(),
        queue: None,
        class: efabus_core::frame::DeliveryClass::Reliable,
    });
    send_all(
        &mut attacker,
        to_broker,
        &[piece(1, &Frame::Ping { nonce: 0 }), piece(2, &subscribe)],
    );
    let publisher = fabric_client(&broker, "publisher");
    for n in 0..50u32 {
        publisher
            .publish("mine.data", Bytes::from(n.to_string()))
            .unwrap();
    }
    publisher.flush(WAIT).unwrap();
    for n in 0..50u32 {
        let message = sub.recv_timeout(WAIT).expect("the victim's message");
        assert_eq!(message.payload, Bytes::from(n.to_string()));
    }
    // The impostor's session ends for want of proof, counted; it got
    // nothing on the fabric, and its control link says why.
    assert!(
        eventually(|| stat(&broker, "unproven_addresses") == 1),
        "{:?}",
        broker.stats().snapshot()
    );
    let error = impostor.expect("the reason", |f| matches!(f, Frame::Error(_)));
    assert!(format!("{error:?}").contains("fabric address"), "{error:?}");
    let mut events = Vec::new();
    attacker.poll(&mut events).expect("poll attacker");
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, efabus_core::transport::Event::Frame { .. })),
        "nothing reached the impostor's own endpoint"
    );
    assert_eq!(victim.reconnects(), 0);
    // The impostor's session is forgotten once its control link's close
    // is seen, a loop round after the error went.
    assert!(
        eventually(|| stat(&broker, "connections") == 2),
        "victim and publisher only: {:?}",
        broker.stats().snapshot()
    );
}

/// A peer that never proves its fabric address and floods pings on its
/// control link: the broker's answers wait behind the proof, and once they
/// alone pass `limits.max_pending_bytes` the session ends, counted in
/// `unproven_addresses`, long before the heartbeats would have ended it.
#[test]
fn pings_from_an_unproven_address_end_the_session_at_the_queue_bound() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(broker) = start_broker_with(
        "[limits]\nmax_pending_bytes = 4096\n[heartbeat]\ninterval_ms = 30000\ntimeout_ms = 60000",
    ) else {
        return;
    };
    let mut attacker = attacker_endpoint();
    let (mut impostor, to_broker) = hello_from(&broker, &mut attacker, "pinger", None);
    // The first frame on the data link starts the proof, which this peer
    // never answers.
    send_all(
        &mut attacker,
        to_broker,
        &[piece(1, &Frame::Ping { nonce: 0 })],
    );
    // Far more answers than 4 KiB hold.
    for nonce in 1..=2_000u64 {
        impostor.send(&Frame::Ping { nonce });
    }
    assert!(
        eventually(|| stat(&broker, "unproven_addresses") == 1),
        "{:?}",
        broker.stats().snapshot()
    );
    let error = impostor.expect("the reason", |f| matches!(f, Frame::Error(_)));
    assert!(
        format!("{error:?}").contains("queue for an unproven fabric address is full"),
        "{error:?}"
    );
}

/// A peer welcomed onto `efa-rdm` that never sends on its data link (as
/// a client whose own side failed to open, which stays on TCP): once the
/// handshake timeout has passed the broker closes its side, and its
/// connection report names the control link and says why. Traffic goes on
/// over TCP. (The broker kept its side for the session's life, reported
/// as the session's path.)
#[test]
fn a_data_link_the_peer_never_uses_is_closed_in_time() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(broker) = start_broker_with(
        "[limits]\nhandshake_timeout_ms = 2000\n[heartbeat]\ninterval_ms = 30000\ntimeout_ms = 60000",
    ) else {
        return;
    };
    let mut unused = attacker_endpoint();
    let (mut raw, _) = hello_from(&broker, &mut unused, "never-on-the-fabric", None);
    let report = || {
        broker
            .connections(&[], WAIT)
            .unwrap()
            .into_iter()
            .find(|report| report.name == "never-on-the-fabric")
            .expect("the session")
    };
    assert!(report().reliable.starts_with("efa-rdm"), "{:?}", report());
    assert!(
        eventually(|| report().reliable == "tcp"),
        "the data link was kept: {:?}",
        report()
    );
    assert!(
        report()
            .reasons
            .iter()
            .any(|reason| reason.contains("never sent there")),
        "{:?}",
        report()
    );
    raw.send(&raw_common::subscribe(1, "still.>"));
    raw.send(&Frame::Ping { nonce: 7 });
    raw.expect("the pong", |f| matches!(f, Frame::Pong { nonce: 7 }));
    broker
        .publish("still.here", Bytes::from_static(b"x"))
        .unwrap();
    raw.expect("the message over TCP", |f| matches!(f, Frame::Message(_)));
}

/// A client that lost its connection while the broker still holds its
/// session (the broker would notice only at the heartbeat timeout, 30 s
/// here) reconnects from the same fabric endpoint. Once its new session
/// proves the address, the old session ends at once: one address, one
/// live session. The client then gets each message once, in order, on
/// the fabric.
#[test]
fn a_reconnecting_client_takes_over_its_own_address() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(broker) = start_broker_with("[heartbeat]\ninterval_ms = 1000\ntimeout_ms = 30000")
    else {
        return;
    };
    let relay = CutRelay::start(&broker);
    let client = Client::connect_with(
        &relay.endpoint(),
        client_options(&broker, "returning"),
        Registry::with_builtins(),
    )
    .expect("client connects");
    let sub = client.subscribe("take.>").unwrap();
    client.flush(WAIT).unwrap();
    let address = client.link().fabric_address.expect("a fabric address");
    let publisher = fabric_client(&broker, "publisher");
    let publish = |range: std::ops::Range<u32>| {
        for n in range {
            publisher
                .publish("take.data", Bytes::from(n.to_string()))
                .unwrap();
        }
        publisher.flush(WAIT).unwrap();
    };
    publish(0..50);
    for n in 0..50u32 {
        let message = sub.recv_timeout(WAIT).expect("a message before the cut");
        assert_eq!(message.payload, Bytes::from(n.to_string()));
    }
    assert_eq!(stat(&broker, "connections"), 2);

    relay.cut_clients();
    assert!(
        eventually(|| client.reconnects() == 1),
        "the client reconnects"
    );
    assert_eq!(
        client.link().fabric_address.as_deref(),
        Some(address.as_str()),
        "the same fabric endpoint"
    );
    assert!(client.link().reliable.starts_with("efa-rdm"));
    // The old session ends on the takeover, long before its heartbeat
    // timeout.
    client.flush(WAIT).unwrap();
    assert!(
        eventually(|| stat(&broker, "connections") == 2),
        "the old session is still up: {:?}",
        broker.stats().snapshot()
    );
    publish(50..100);
    for n in 50..100u32 {
        let message = sub.recv_timeout(WAIT).expect("a message after the cut");
        assert_eq!(message.payload, Bytes::from(n.to_string()));
    }
    assert!(
        sub.recv_timeout(Duration::from_millis(300)).is_err(),
        "a message came twice"
    );
    assert_eq!(stat(&broker, "unproven_addresses"), 0);
}

/// A client that publishes at full speed from its first moment fills its
/// data link's credit window before the broker's challenge reaches it. Its
/// answer must still get through (it goes on the control link, ahead of
/// the publishes): the broker grants the link no credit before the proof,
/// and would otherwise end the session as unproven while the publisher
/// waits for credit.
#[test]
fn a_publisher_at_full_speed_from_the_start_proves_its_address() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(broker) = start_broker() else {
        return;
    };
    let subscriber = fabric_client(&broker, "subscriber");
    let sub = subscriber.subscribe("burst").unwrap();
    subscriber.flush(WAIT).unwrap();
    let publisher = fabric_client(&broker, "publisher");
    const COUNT: u32 = 20_000;
    for n in 0..COUNT {
        publisher
            .publish("burst", n.to_le_bytes().to_vec())
            .expect("the publisher gets credit");
    }
    publisher.flush(WAIT).unwrap();
    for n in 0..COUNT {
        let message = sub.recv_timeout(WAIT).expect("every message");
        assert_eq!(message.payload[..], n.to_le_bytes());
    }
    assert_eq!(stat(&broker, "unproven_addresses"), 0);
    assert_eq!(publisher.reconnects(), 0);
}

/// What `peer` receives from the broker within `quiet` after the last
/// message: each message decoded, and each piece opened to the frame it
/// carries (runs and undecodable messages are skipped).
fn frames_from_broker(peer: &mut FabricEndpoint, quiet: Duration) -> Vec<Frame> {
    let mut frames = Vec::new();
    let mut until = Instant::now() + quiet;
    let limits = codec::CodecLimits::default();
    while Instant::now() < until {
        let mut events = Vec::new();
        peer.poll(&mut events).expect("poll the peer");
        if events.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
        for event in events {
            let efabus_core::transport::Event::Frame { frame: bytes, .. } = event else {
                continue;
            };
            until = Instant::now() + quiet;
            match codec::decode(bytes, &limits) {
                Ok(Frame::Fragment(piece)) if piece.count == 1 => {
                    if let Ok(frame) = codec::decode(piece.data, &limits) {
                        frames.push(frame);
                    }
                }
                Ok(frame) => frames.push(frame),
                Err(_) => {}
            }
        }
    }
    frames
}

/// The highest sequence the broker's credits in `frames` acknowledge.
fn acknowledged(frames: &[Frame]) -> Option<u64> {
    frames
        .iter()
        .filter_map(|frame| match frame {
            Frame::Credit(credit) => Some(credit.ack_seq),
            _ => None,
        })
        .max()
}

/// A session that failed (here: an unexpected frame) closes once its queue
/// has drained, reading nothing more meanwhile. What its peer sends on the
/// data link in that time is dropped, so it must not be acknowledged
/// either: the peer counts what was never acknowledged as possibly lost,
/// and takes what was as delivered.
#[test]
fn a_closing_session_acknowledges_nothing_it_drops() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(broker) = start_broker_with(
        "[limits]\nmax_pending_bytes = 268435456\n[shutdown]\ndrain_timeout_ms = 30000\n\
         [heartbeat]\ninterval_ms = 30000\ntimeout_ms = 60000",
    ) else {
        return;
    };
    let mut peer = attacker_endpoint();
    let (mut raw, to_broker) = hello_from(&broker, &mut peer, "closing", None);
    // The first data message starts the address proof, answered here.
    let send = |peer: &mut FabricEndpoint, piece: Bytes| {
        peer.send(to_broker, efabus_core::transport::OutFrame::whole(piece))
            .expect("an idle endpoint takes a frame");
    };
    send(&mut peer, piece(1, &raw_common::subscribe(1, "flood.>")));
    let nonce = frames_from_broker(&mut peer, Duration::from_millis(300))
        .into_iter()
        .find_map(|frame| match frame {
            Frame::Ping { nonce } => Some(nonce),
            _ => None,
        })
        .expect("the broker's challenge");
    raw.send(&Frame::Pong { nonce });
    // And the ping sent on the control link with it, which shows that
    // this peer has read what went there before.
    let Frame::Ping { nonce } = raw.expect(
        "the control link's ping",
        |frame| matches!(frame, Frame::Ping { nonce } if *nonce != 0),
    ) else {
        unreachable!()
    };
    raw.send(&Frame::Pong { nonce });
    // Proven: the subscription is acknowledged.
    let deadline = Instant::now() + WAIT;
    while acknowledged(&frames_from_broker(&mut peer, Duration::from_millis(50))) != Some(1) {
        assert!(
            Instant::now() < deadline,
            "the subscription was never acknowledged"
        );
    }
    // This peer grants no credit: most of 64 MB stays queued for it.
    for _ in 0..4_000 {
        broker
            .publish("flood.data", Bytes::from(vec![0u8; 16 * 1024]))
            .unwrap();
    }
    assert!(
        eventually(|| stat(&broker, "queued_bytes") > 16 << 20),
        "{:?}",
        broker.stats().snapshot()
    );
    // What the window let through is taken, unacknowledged.
    frames_from_broker(&mut peer, Duration::from_millis(100));
    // A frame no client sends fails the session, which then drains its
    // queue for up to 30 s; the publish behind it is not read.
    let challenge = Frame::Challenge(efabus_core::frame::Challenge { nonce: [0; 32] });
    let publish = Frame::Publish(Publish {
        subject: "flood.late".into(),
        reply: None,
        seq: 0,
        headers: None,
        payload: Bytes::from_static(b"late"),
    });
    send(&mut peer, piece(2, &challenge));
    send(&mut peer, piece(3, &publish));
    let credits = acknowledged(&frames_from_broker(&mut peer, Duration::from_millis(300)));
    let session = broker
        .connections(&[], WAIT)
        .unwrap()
        .into_iter()
        .find(|session| session.name == "closing")
        .expect("the session, draining");
    assert!(!session.ready, "the session did not fail: {session:?}");
    assert!(
        credits.is_none_or(|through| through < 2),
        "the closing session acknowledged through {credits:?}"
    );
}

/// An impostor that names a victim's fabric address and offers a frame by
/// rendezvous "from" it: the broker would read the body at the victim's
/// address, with the offset and key the impostor gave (a read `shm` makes
/// straight from the victim's memory, checking no key). Reads wait for
/// the address's proof, which never comes: none is made, and the session
/// ends unproven.
#[test]
fn no_read_goes_to_an_address_not_proven() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(broker) = start_broker_with("[heartbeat]\ninterval_ms = 200\ntimeout_ms = 5000")
    else {
        return;
    };
    let victim = fabric_client(&broker, "victim");
    victim.flush(WAIT).unwrap();
    let victim_address =
        addr_from_hex(victim.link().fabric_address.as_deref().expect("address")).unwrap();
    let mut attacker = attacker_endpoint();
    let (_impostor, to_broker) =
        hello_from(&broker, &mut attacker, "impostor", Some(&victim_address));
    attacker.set_peer_rendezvous(to_broker, attacker.rendezvous_max());
    attacker.claim_address(&victim_address);
    // Above the eager size: it goes by rendezvous.
    let large = Frame::Publish(Publish {
        subject: "loot".into(),
        reply: None,
        seq: 0,
        headers: None,
        payload: Bytes::from(vec![7u8; 100_000]),
    });
    assert!(attacker.max_frame() < 100_000 && attacker.rendezvous_max() > 100_000);
    send_all(&mut attacker, to_broker, &[piece(1, &large)]);
    assert!(
        eventually(|| stat(&broker, "unproven_addresses") == 1),
        "{:?}",
        broker.stats().snapshot()
    );
    assert_eq!(stat(&broker, "fabric_rendezvous_read"), 0);
    assert_eq!(stat(&broker, "fabric_completion_errors"), 0);
    assert_eq!(victim.reconnects(), 0);
}
