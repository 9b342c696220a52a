//! Who may open a route: only a peer whose hello carried the route
//! credential (`cluster.secret`, else `auth.secret`, else anyone: the open
//! mode). A peer refused a route is told why, counted, closed, and never
//! sees the broker's interest.
//!
//! Peers that pose as brokers are raw TCP connections speaking frames;
//! brokers listen on loopback ports chosen at run time; waits are bounded
//! by [`WAIT`].

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_broker::{Broker, Client, ClientOptions, Config, RecvError};
use efabus_core::frame::{
    Challenge, ErrorCode, ErrorFrame, Frame, Goodbye, Hello, RouteHello, Welcome, PROTOCOL_VERSION,
};
use efabus_transports::registry::Registry;

mod raw_common;
use raw_common::{Raw, WAIT};

fn start(name: &str, peers: &[String], extra: &str) -> Broker {
    let peers: Vec<String> = peers.iter().map(|p| format!("{p:?}")).collect();
    let text = format!(
        "name = {name:?}\nlisten = [\"tcp/127.0.0.1:0\"]\npeers = [{}]\n{extra}",
        peers.join(", ")
    );
    let config = Config::from_toml_str(&text, name).expect("valid test config");
    Broker::start(config).expect("broker starts")
}

fn tcp(broker: &Broker) -> String {
    broker.endpoint("tcp").expect("listens on tcp")
}

fn stat(broker: &Broker, name: &str) -> u64 {
    broker
        .stats()
        .value(name)
        .unwrap_or_else(|| panic!("no stat {name}"))
}

fn routes(broker: &Broker) -> u64 {
    broker.stats().routes.load(Ordering::Relaxed)
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A client of `broker` presenting `secret`, subscribed to `pattern`.
fn subscribed_client(
    broker: &Broker,
    secret: &str,
    pattern: &str,
) -> (Client, efabus_broker::Subscription) {
    let client = Client::connect_with(
        &tcp(broker),
        ClientOptions {
            credentials: Some(secret.to_string()),
            connect_timeout: WAIT,
            ..ClientOptions::default()
        },
        Registry::with_builtins(),
    )
    .expect("client connects");
    let sub = client.subscribe(pattern).expect("subscribes");
    client.flush(WAIT).expect("flushes");
    (client, sub)
}

/// A hello with `credentials`, then at once a route hello: what a
/// dialing broker sends.
fn ask_for_a_route(raw: &mut Raw, credentials: Option<&str>) {
    ask_for_a_route_as(raw, credentials, None, false);
}

/// [`ask_for_a_route`], with the address the peer advertises and whether
/// it dialed the receiver as a seed.
fn ask_for_a_route_as(
    raw: &mut Raw,
    credentials: Option<&str>,
    advertise: Option<&str>,
    seeded: bool,
) {
    raw.send(&Frame::Hello(Hello {
        no_echo: false,
        no_responders: false,
        version: PROTOCOL_VERSION,
        name: "posing-as-a-broker".into(),
        credentials: credentials.map(str::to_string),
        user: None,
        proof: None,
        offers: Vec::new(),
        link_auth: None,
    }));
    raw.send(&Frame::Route(RouteHello {
        broker_id: 42,
        advertise: advertise.map(str::to_string),
        seeded,
        limits: raw_common::default_route_limits(),
    }));
}

fn patterns(frames: &[Frame]) -> Vec<String> {
    let mut patterns: Vec<String> = frames
        .iter()
        .filter_map(|frame| match frame {
            Frame::Subscribe(subscribe) => Some(subscribe.pattern.clone()),
            _ => None,
        })
        .collect();
    patterns.sort();
    patterns
}

fn fatal_error(frames: &[Frame]) -> &ErrorFrame {
    frames
        .iter()
        .find_map(|frame| match frame {
            Frame::Error(error) => Some(error),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no error frame in {frames:?}"))
}

/// With `cluster.secret` set, a peer holding only the clients' secret is
/// refused a route with an `Auth` error naming the reason, counted, and
/// closed, and never sees the broker's interest; the cluster's secret
/// opens one (and shows it).
#[test]
fn a_client_secret_does_not_open_a_route_nor_show_the_interest() {
    let broker = start(
        "gate",
        &[],
        "[auth]\nsecret = \"clients\"\n[cluster]\nsecret = \"mesh\"\n",
    );
    let _local = broker.subscribe("plans.secret.>").unwrap();
    let (_client, _sub) = subscribed_client(&broker, "clients", "orders.*");

    let mut intruder = Raw::connect(&broker);
    ask_for_a_route(&mut intruder, Some("clients"));
    let frames = intruder.until_closed();
    assert!(
        matches!(frames.first(), Some(Frame::Welcome(_))),
        "the client secret is a client's: {frames:?}"
    );
    let error = fatal_error(&frames);
    assert_eq!(error.code, ErrorCode::Auth);
    assert!(error.fatal);
    assert!(error.text.contains("cluster.secret"), "{}", error.text);
    assert_eq!(patterns(&frames), Vec::<String>::new(), "no interest shown");
    assert!(
        !frames.iter().any(|f| matches!(f, Frame::Route(_))),
        "no route hello answered: {frames:?}"
    );
    assert_eq!(stat(&broker, "route_refusals"), 1);
    assert_eq!(routes(&broker), 0);
    assert_eq!(broker.route_interest_count(), 0);

    // The same with no credentials at all: the hello itself is refused.
    let mut stranger = Raw::connect(&broker);
    ask_for_a_route(&mut stranger, None);
    let frames = stranger.until_closed();
    assert_eq!(fatal_error(&frames).code, ErrorCode::Auth);
    assert_eq!(patterns(&frames), Vec::<String>::new());

    // The cluster's secret opens the route, and the interest follows.
    let mut peer = Raw::connect(&broker);
    ask_for_a_route(&mut peer, Some("mesh"));
    let frames = peer.frames_for(Duration::from_millis(500));
    assert!(
        frames.iter().any(|f| matches!(f, Frame::Route(_))),
        "{frames:?}"
    );
    assert_eq!(patterns(&frames), ["orders.*", "plans.secret.>"]);
    assert_eq!(routes(&broker), 1);
    assert_eq!(stat(&broker, "route_refusals"), 1);
}

/// Brokers sharing `cluster.secret` route whatever their client secrets;
/// clients of each use their own broker's secret.
#[test]
fn brokers_sharing_the_cluster_secret_route() {
    let b = start(
        "b",
        &[],
        "[auth]\nsecret = \"clients-of-b\"\n[cluster]\nsecret = \"mesh\"\n",
    );
    let a = start(
        "a",
        &[tcp(&b)],
        "[auth]\nsecret = \"clients-of-a\"\n[cluster]\nsecret = \"mesh\"\n",
    );
    wait_until("the route", || routes(&a) == 1 && routes(&b) == 1);
    let (_on_b, sub) = subscribed_client(&b, "clients-of-b", "news.>");
    wait_until("b's interest at a", || a.route_interest_count() == 1);
    let (publisher, _) = subscribed_client(&a, "clients-of-a", "unrelated");
    publisher
        .publish("news.today", Bytes::from_static(b"routed"))
        .unwrap();
    let message = sub
        .recv_timeout(WAIT)
        .expect("the message crosses the route");
    assert_eq!(&message.payload[..], b"routed");
    assert_eq!(stat(&a, "route_refusals") + stat(&b, "route_refusals"), 0);
    assert_eq!(stat(&a, "auth_failures") + stat(&b, "auth_failures"), 0);
}

/// Brokers whose cluster secrets differ never route: the accepting broker
/// refuses (at the route hello when its clients need no secret, at the
/// hello when they do), neither learns the other's interest, and messages
/// stay on their broker.
#[test]
fn brokers_with_different_cluster_secrets_do_not_route() {
    for (accepting, refusals, auth_failures) in [
        ("[cluster]\nsecret = \"mesh-1\"\n", "route_refusals", false),
        (
            "[auth]\nsecret = \"clients\"\n[cluster]\nsecret = \"mesh-1\"\n",
            "auth_failures",
            true,
        ),
    ] {
        let b = start("b", &[], accepting);
        let _interest = b.subscribe("news.>").unwrap();
        let a = start("a", &[tcp(&b)], "[cluster]\nsecret = \"mesh-2\"\n");
        let _interest_a = a.subscribe("weather.>").unwrap();
        wait_until(refusals, || stat(&b, refusals) >= 1);
        // A few redials later, still nothing.
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!((routes(&a), routes(&b)), (0, 0), "{accepting}");
        assert_eq!(a.route_interest_count(), 0, "a learnt nothing of b");
        assert_eq!(b.route_interest_count(), 0, "b learnt nothing of a");
        if auth_failures {
            assert_eq!(stat(&b, "route_refusals"), 0, "refused at the hello");
        }
        let on_b = b.subscribe("weather.>").unwrap();
        a.publish("weather.now", &b"stays on a"[..]).unwrap();
        assert_eq!(
            on_b.recv_timeout(Duration::from_millis(200))
                .map(|m| m.payload),
            Err(RecvError::Timeout)
        );

        // What the dialing broker was told, as a raw peer sees it.
        let mut raw = Raw::connect(&b);
        ask_for_a_route(&mut raw, Some("mesh-2"));
        let error = fatal_error(&raw.until_closed()).clone();
        assert_eq!(error.code, ErrorCode::Auth, "{accepting}");
        if !auth_failures {
            assert!(error.text.contains("cluster.secret"), "{}", error.text);
        }
    }
}

/// With no secret configured (the open mode), any peer may open a route,
/// as before; with only `auth.secret`, any peer that authenticated may.
#[test]
fn without_a_cluster_secret_routes_open_as_before() {
    let open = start("open", &[], "");
    let _sub = open.subscribe("anyone.>").unwrap();
    let mut peer = Raw::connect(&open);
    ask_for_a_route(&mut peer, None);
    let frames = peer.frames_for(Duration::from_millis(500));
    assert!(
        frames.iter().any(|f| matches!(f, Frame::Route(_))),
        "{frames:?}"
    );
    assert_eq!(patterns(&frames), ["anyone.>"]);
    assert_eq!(routes(&open), 1);

    let shared = start("shared", &[], "[auth]\nsecret = \"s3cret\"\n");
    let _sub = shared.subscribe("members.>").unwrap();
    let mut member = Raw::connect(&shared);
    ask_for_a_route(&mut member, Some("s3cret"));
    let frames = member.frames_for(Duration::from_millis(500));
    assert_eq!(patterns(&frames), ["members.>"]);
    assert_eq!(routes(&shared), 1);
    assert_eq!(stat(&shared, "route_refusals"), 0);
}

/// Refused routes count against the peer's address as failed hellos do:
/// after ten, even the right secret is refused from there for a while.
#[test]
fn refused_routes_count_towards_the_address_lockout() {
    let broker = start("guarded", &[], "[cluster]\nsecret = \"mesh\"\n");
    for attempt in 0..10 {
        let mut raw = Raw::connect(&broker);
        ask_for_a_route(&mut raw, Some("guess"));
        let frames = raw.until_closed();
        assert_eq!(
            fatal_error(&frames).code,
            ErrorCode::Auth,
            "attempt {attempt}"
        );
    }
    assert_eq!(stat(&broker, "route_refusals"), 10);
    let mut raw = Raw::connect(&broker);
    ask_for_a_route(&mut raw, Some("mesh"));
    let frames = raw.until_closed();
    assert_eq!(fatal_error(&frames).code, ErrorCode::RateLimited);
    assert_eq!(routes(&broker), 0);
}

/// With only `cluster.secret` set, clients need no secret, but one that
/// presents a wrong secret is guessing the cluster's (the welcome would
/// show a right one): each guess counts against its address, and after
/// ten even a client without one is refused from there for a while.
#[test]
fn guesses_at_the_cluster_secret_count_towards_the_address_lockout() {
    let broker = start("guarded", &[], "[cluster]\nsecret = \"mesh\"\n");
    let hello_as = |user: Option<&str>, credentials: Option<&str>| {
        Frame::Hello(Hello {
            no_echo: false,
            no_responders: false,
            version: PROTOCOL_VERSION,
            name: "guesser".into(),
            credentials: credentials.map(str::to_string),
            user: user.map(str::to_string),
            proof: None,
            offers: Vec::new(),
            link_auth: None,
        })
    };
    let hello = |credentials: Option<&str>| hello_as(None, credentials);
    // A user's name and password are not checked without users: no guess.
    for _ in 0..10 {
        let mut raw = Raw::connect(&broker);
        raw.send(&hello_as(Some("alice"), Some("password")));
        raw.expect("the welcome", |frame| matches!(frame, Frame::Welcome(_)));
    }
    assert_eq!(stat(&broker, "auth_failures"), 0);
    for guess in 0..10 {
        let mut raw = Raw::connect(&broker);
        raw.send(&hello(Some(&format!("guess-{guess}"))));
        raw.expect("the welcome", |frame| matches!(frame, Frame::Welcome(_)));
    }
    assert_eq!(stat(&broker, "auth_failures"), 10);
    let mut raw = Raw::connect(&broker);
    raw.send(&hello(None));
    let frames = raw.until_closed();
    assert_eq!(fatal_error(&frames).code, ErrorCode::RateLimited);

    // Nor is a password beside a user's name taken for the secret: the
    // right one there opens no route (so it could not be guessed so).
    let other = start("guarded-too", &[], "[cluster]\nsecret = \"mesh\"\n");
    let mut raw = Raw::connect(&other);
    raw.send(&hello_as(Some("alice"), Some("mesh")));
    raw.send(&Frame::Route(RouteHello {
        broker_id: 42,
        advertise: None,
        seeded: false,
        limits: raw_common::default_route_limits(),
    }));
    let frames = raw.until_closed();
    assert_eq!(fatal_error(&frames).code, ErrorCode::Auth);
    assert_eq!(routes(&other), 0);
}

/// What a route's peer says about other brokers is checked before it is
/// dialed: host names, malformed and oversized addresses are dropped, and
/// the broker stays up and dials only the usable addresses.
#[test]
fn gossip_from_a_route_is_checked_and_bounded() {
    let broker = start("gossip-target", &[], "");
    let mut raw = Raw::connect(&broker);
    ask_for_a_route(&mut raw, None);
    raw.expect("the route hello back", |f| matches!(f, Frame::Route(_)));
    let long = format!("tcp/{}:7420", "9".repeat(4096));
    let mut addresses: Vec<String> = [
        "tcp/127.0.0.1:1",
        "tcp/node-4.example:7420",
        "tcp/10.0.0.2",
        "tcp/10.0.0.2:0",
        "shm",
        "",
        long.as_str(),
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    // As many as fit a control frame.
    addresses.extend((0..2_000).map(|n| format!("tcp/127.0.{}.{}:2", n / 250, n % 250 + 1)));
    raw.send(&Frame::RoutePeers(efabus_core::frame::RoutePeers {
        addresses,
    }));
    wait_until("the usable addresses dialed", || !broker.peers().is_empty());
    let peers = broker.peers();
    assert!(peers.contains(&"tcp/127.0.0.1:1".to_string()), "{peers:?}");
    assert!(
        peers.iter().all(|p| p.len() < 40 && !p.contains("example")),
        "only IP:PORT addresses are learned"
    );
    assert_eq!(peers.len(), 2_001, "the IP:PORT addresses, each once");
    // Still serving.
    let client = Client::connect(&tcp(&broker)).expect("the broker still accepts clients");
    client.flush(WAIT).expect("and answers them");
}

/// `count` listeners on loopback that take connections and never answer
/// (the kernel completes the handshakes; nothing reads), as brokers that
/// hang would, and their addresses as routes advertise them.
fn silent_brokers(count: usize) -> (Vec<std::net::TcpListener>, Vec<String>) {
    let listeners: Vec<std::net::TcpListener> = (0..count)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a listener"))
        .collect();
    let addresses = listeners
        .iter()
        .map(|listener| format!("tcp/{}", listener.local_addr().expect("its address")))
        .collect();
    (listeners, addresses)
}

/// A route to `broker` from a raw peer that tells it of `addresses`.
fn gossip_to(broker: &Broker, addresses: Vec<String>) -> Raw {
    let mut raw = Raw::connect(broker);
    ask_for_a_route(&mut raw, None);
    raw.expect("the route hello back", |f| matches!(f, Frame::Route(_)));
    raw.send(&Frame::RoutePeers(efabus_core::frame::RoutePeers {
        addresses,
    }));
    raw
}

/// However many addresses routes send, a broker remembers (and dials) at
/// most 4,096 it learned: here 6,000 distinct ones in two frames.
#[test]
fn gossip_beyond_the_bound_of_learned_brokers_is_not_kept() {
    let broker = start("gossip-bound", &[], "");
    let mut raw = Raw::connect(&broker);
    ask_for_a_route(&mut raw, None);
    raw.expect("the route hello back", |f| matches!(f, Frame::Route(_)));
    for frame in 0..2 {
        let addresses = (0..3_000)
            .map(|n| {
                let n = frame * 3_000 + n;
                format!("tcp/127.1.{}.{}:2", n / 250, n % 250 + 1)
            })
            .collect();
        raw.send(&Frame::RoutePeers(efabus_core::frame::RoutePeers {
            addresses,
        }));
    }
    wait_until("the bound reached", || broker.peers().len() >= 4_096);
    // Both frames were read: a second look finds no more.
    raw.send(&Frame::Ping { nonce: 7 });
    raw.expect("the pong", |f| matches!(f, Frame::Pong { nonce: 7 }));
    assert_eq!(broker.peers().len(), 4_096);
    let client = Client::connect(&tcp(&broker)).expect("the broker still accepts clients");
    client.flush(WAIT).expect("and answers them");
}

/// Gossip naming this broker itself by an address it does not advertise
/// (here its listener's own; as well any 127.x address for a listener
/// bound to every address) is not learned: dialed, it would lead back to
/// itself, and such a slot was kept for good, counted among the 4,096.
#[test]
fn gossip_naming_this_broker_is_not_dialed() {
    let broker = start(
        "aliased",
        &[],
        "[cluster]\nadvertise = \"tcp/192.0.2.1:7420\"\n",
    );
    let mut raw = Raw::connect(&broker);
    ask_for_a_route(&mut raw, None);
    raw.expect("the route hello back", |f| matches!(f, Frame::Route(_)));
    let connections = stat(&broker, "connections_total");
    raw.send(&Frame::RoutePeers(efabus_core::frame::RoutePeers {
        addresses: vec![tcp(&broker)],
    }));
    raw.send(&Frame::Ping { nonce: 7 });
    raw.expect("the pong", |f| matches!(f, Frame::Pong { nonce: 7 }));
    // Dials go out on the loop's next timer round (100 ms).
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        stat(&broker, "connections_total"),
        connections,
        "dialed itself"
    );
    assert!(broker.peers().is_empty(), "{:?}", broker.peers());
}

/// Gossip naming many brokers that take connections and never answer:
/// each dial holds a session until its handshake times out, so dialing
/// them all at once filled a low `limits.max_connections` and clients were
/// refused. Learned brokers are dialed a few at a time.
#[test]
fn gossip_of_silent_brokers_leaves_room_for_clients() {
    const SILENT: usize = 200;
    let (_listeners, addresses) = silent_brokers(SILENT);
    let broker = start(
        "silent-gossip",
        &[],
        "[limits]\nmax_connections = 40\nhandshake_timeout_ms = 10000\n",
    );
    let _route = gossip_to(&broker, addresses);
    wait_until("the silent brokers learned", || {
        broker.peers().len() >= SILENT
    });
    wait_until("dials made", || stat(&broker, "connections") > 1);
    // Two more rounds of dial timers (100 ms each) find no room either.
    std::thread::sleep(Duration::from_millis(250));
    let connections = stat(&broker, "connections");
    assert!(
        connections <= 17,
        "{connections} sessions: the route and its dials"
    );
    let client = Client::connect(&tcp(&broker)).expect("a client is still accepted");
    client.flush(WAIT).expect("and answered");
}

/// A broker learned behind hundreds that take connections and never
/// answer still gets its turn: the dials that free up go first to the
/// brokers left waiting, not always to the first learned, which here
/// fail and come due again faster than they can all be dialed.
#[test]
fn a_live_broker_learned_after_many_silent_ones_is_dialed() {
    let (_listeners, mut addresses) = silent_brokers(200);
    let live = start("live", &[], "");
    let broker = start("crowded", &[], "[limits]\nhandshake_timeout_ms = 200\n");
    addresses.push(tcp(&live));
    let _route = gossip_to(&broker, addresses);
    wait_until("the route to the live broker", || routes(&live) == 1);
}

/// A route peer that sends `frame`s without end and reads none of what
/// they are answered with (`answer`, about as large as the frames): a
/// route's control frames are not trimmed by the slow-consumer policy, so
/// the answers stop once they fill the queue's bound, and what the broker
/// holds for it stays there.
fn a_route_that_reads_none_of_its_answers_is_held_to_the_bound(frame: impl Fn(u64) -> Frame) {
    use std::io::Write;
    const BOUND: u64 = 65_536;
    let broker = start(
        "deaf-route",
        &[],
        &format!("[limits]\nmax_pending_bytes = {BOUND}\n"),
    );
    let mut raw = Raw::connect(&broker);
    ask_for_a_route(&mut raw, None);
    raw.expect("the route hello back", |f| matches!(f, Frame::Route(_)));
    // About 32 MB of frames: their answers are far more than the socket
    // buffers on both sides and the bound together.
    let mut burst = Vec::new();
    for n in 0..10_000u64 {
        burst.extend_from_slice(&efabus_core::codec::encode(&frame(n)).to_bytes());
    }
    let bursts = (32 << 20) / burst.len() as u64 + 1;
    let mut stream = raw.stream();
    stream
        .set_write_timeout(Some(WAIT))
        .expect("a write timeout");
    for _ in 0..bursts {
        stream.write_all(&burst).expect("the broker reads on");
    }
    let sent = bursts * burst.len() as u64;
    wait_until("every frame read", || {
        broker.stats().bytes_in.load(Ordering::Relaxed) >= sent
    });
    // The gauge is refreshed a few times a second: watch it a while.
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_millis(500) {
        let queued = broker.stats().queued_bytes.load(Ordering::Relaxed);
        assert!(
            queued <= BOUND + 16_384,
            "{queued} bytes queued for a route that reads nothing"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(routes(&broker), 1, "the route stays up");
}

/// A route peer that keeps pinging (so it is heard) but takes nothing,
/// while this broker's interest changes for it pass the queue's bound:
/// routes are left out of that bound, so the queue grew without end; it
/// is cut off once it has taken nothing for the heartbeat timeout, counted
/// as a slow consumer.
#[test]
fn a_route_that_takes_nothing_while_its_control_frames_pile_up_is_cut_off() {
    use std::io::Write;
    const BOUND: u64 = 65_536;
    let broker = start(
        "deaf-to-interest",
        &[],
        &format!(
            "[limits]\nmax_pending_bytes = {BOUND}\n\
             [heartbeat]\ninterval_ms = 200\ntimeout_ms = 1000\n"
        ),
    );
    let mut raw = Raw::connect(&broker);
    ask_for_a_route(&mut raw, None);
    raw.expect("the route hello back", |f| matches!(f, Frame::Route(_)));
    let mut pinger = raw.stream();
    let pinging = std::thread::spawn(move || {
        let ping = efabus_core::codec::encode(&Frame::Ping { nonce: 7 }).to_bytes();
        // Until the broker closes the connection.
        while pinger.write_all(&ping).is_ok() {
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let churned = Instant::now();
    let mut n = 0u64;
    while routes(&broker) == 1 {
        assert!(churned.elapsed() < WAIT, "the route stays up");
        // Each subscription made and dropped is two interest frames.
        for _ in 0..1000 {
            let pattern = format!("interest.{n}.that.the.route.peer.never.takes");
            drop(broker.subscribe(&pattern).expect("a subscription"));
            n += 1;
        }
    }
    assert!(stat(&broker, "slow_consumer_disconnects") >= 1);
    let queued = broker.stats().queued_bytes.load(Ordering::Relaxed);
    assert!(queued < 64 << 20, "{queued} bytes queued");
    drop(raw);
    pinging.join().expect("the pinger ends");
}

#[test]
fn a_route_that_reads_none_of_its_pongs_is_held_to_the_bound() {
    a_route_that_reads_none_of_its_answers_is_held_to_the_bound(|nonce| Frame::Ping { nonce });
}

/// Messages the broker refuses (here for their subject) are answered with
/// an error report each.
#[test]
fn a_route_that_reads_none_of_its_error_reports_is_held_to_the_bound() {
    a_route_that_reads_none_of_its_answers_is_held_to_the_bound(|_| {
        Frame::Message(efabus_core::frame::Message {
            sid: 2,
            subject: "not..valid".into(),
            reply: None,
            seq: 0,
            headers: None,
            payload: Bytes::from_static(b"x"),
        })
    });
}

/// A peer broker that closes a route this broker dialed as the duplicate
/// of another it keeps (possibly one this broker has already dropped, as
/// after a one-way outage) is dialed again only after the longest backoff
/// (2 s), not at once, which would only be closed again, round after round.
#[test]
fn a_route_closed_as_a_duplicate_is_not_dialed_again_at_once() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
    let address = format!("tcp/{}", listener.local_addr().expect("its address"));
    listener.set_nonblocking(true).expect("non-blocking");
    let broker = start("redialer", &[address], "");
    let mut peer = welcome_a_dial(&listener, "peer-broker");
    peer.send(&Frame::Route(RouteHello {
        broker_id: 42,
        advertise: None,
        seeded: false,
        limits: raw_common::default_route_limits(),
    }));
    wait_until("the route up", || routes(&broker) == 1);
    peer.send(&Frame::Goodbye(Goodbye {
        reason: "duplicate route".into(),
    }));
    drop(peer);
    wait_until("the route down", || routes(&broker) == 0);
    let closed = Instant::now();
    if accept_within(&listener, Duration::from_secs(1)).is_some() {
        panic!(
            "dialed again {:?} after the peer closed it as a duplicate",
            closed.elapsed()
        );
    }
    // Then it is dialed again, in case the peer kept a link that is gone.
    accept_within(&listener, WAIT).expect("dialed again after the backoff");
}

/// A peer that welcomes this broker's dial but never sends its route
/// hello is given the handshake timeout, as one that never welcomes is,
/// and dialed again: held for ever, it kept its dial slot (and a learned
/// one its share of the learned dials, so brokers learned after it were
/// never dialed).
#[test]
fn a_route_welcomed_but_never_brought_up_is_closed_in_time() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
    let address = format!("tcp/{}", listener.local_addr().expect("its address"));
    listener.set_nonblocking(true).expect("non-blocking");
    let broker = start(
        "stalled-dialer",
        &[address],
        "[limits]\nhandshake_timeout_ms = 500\n\
         [heartbeat]\ninterval_ms = 5000\ntimeout_ms = 60000\n",
    );
    let mut peer = welcome_a_dial(&listener, "half-a-broker");
    let welcomed = Instant::now();
    // No route hello back; the heartbeat's pings are answered by nothing,
    // and its timeout is far off.
    let error = peer.expect("the handshake timeout", |f| matches!(f, Frame::Error(_)));
    assert!(format!("{error:?}").contains("handshake"), "{error:?}");
    // Its own deadline wakes the loop: not left for the next heartbeat.
    assert!(
        welcomed.elapsed() < Duration::from_secs(4),
        "closed after {:?}",
        welcomed.elapsed()
    );
    assert_eq!(routes(&broker), 0);
    accept_within(&listener, WAIT).expect("dialed again");
}

/// Takes the broker's dial on `listener` as a peer broker named `name`
/// would, up to the broker's route hello (not answered).
fn welcome_a_dial(listener: &std::net::TcpListener, name: &str) -> Raw {
    let stream = accept_within(listener, WAIT).expect("the broker dials");
    stream.set_nonblocking(false).expect("blocking");
    let mut peer = Raw::accepted(stream);
    // As an accepting broker: a challenge first, which the hello answers.
    peer.send(&Frame::Challenge(Challenge { nonce: [7; 32] }));
    peer.expect("the broker's hello", |f| matches!(f, Frame::Hello(_)));
    peer.send(&Frame::Welcome(Welcome {
        version: PROTOCOL_VERSION,
        name: name.into(),
        offers: Vec::new(),
        max_payload: 1 << 20,
        link_auth: None,
        max_subject_len: 256,
        max_subject_tokens: 16,
        proof: None,
    }));
    peer.expect("the broker's route hello", |f| matches!(f, Frame::Route(_)));
    peer
}

/// The next connection to the non-blocking `listener` within `within`.
fn accept_within(
    listener: &std::net::TcpListener,
    within: Duration,
) -> Option<std::net::TcpStream> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        match listener.accept() {
            Ok((stream, _)) => return Some(stream),
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(err) => panic!("accept: {err}"),
        }
    }
    None
}

/// A broker dialed as a seed tells the newcomer the brokers it has routes
/// to; dialed as a learned peer, it tells nothing (the seed did), so a
/// join costs one list, not one per broker of the cluster.
#[test]
fn only_a_seed_route_gets_the_list_of_brokers() {
    let seed = start("seed", &[], "");
    let other = start("other", &[tcp(&seed)], "");
    wait_until("the route", || routes(&seed) == 1 && routes(&other) == 1);
    let lists = |seeded: bool| -> Vec<Vec<String>> {
        let mut raw = Raw::connect(&seed);
        // An address nothing listens on: `other`, told of it, dials in vain.
        ask_for_a_route_as(&mut raw, None, Some("tcp/127.0.0.1:9"), seeded);
        raw.frames_for(Duration::from_millis(300))
            .into_iter()
            .filter_map(|frame| match frame {
                Frame::RoutePeers(peers) => Some(peers.addresses),
                _ => None,
            })
            .collect()
    };
    assert_eq!(
        lists(true),
        [vec![tcp(&other)]],
        "the seed tells the newcomer"
    );
    assert!(
        lists(false).is_empty(),
        "a learned peer's route gets no list"
    );
}
