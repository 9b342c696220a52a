//! Brokers joined by routes (`peers`): interest travels between them,
//! messages go one hop, each subscriber anywhere gets a message once, queue
//! groups span the cluster, a lost peer is reconnected, and brokers given
//! one seed find the others.
//!
//! Every broker listens on a loopback port chosen at run time; waits are
//! bounded by [`WAIT`].

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_broker::{Broker, Client, ClientOptions, Config, RecvError, Subscription};
use efabus_transports::registry::Registry;

mod raw_common;

const WAIT: Duration = Duration::from_secs(10);
/// How long a subscription is watched for a message that must not come.
const QUIET: Duration = Duration::from_millis(200);

fn start(name: &str, listen: &str, peers: &[String], extra: &str) -> Broker {
    let peers: Vec<String> = peers.iter().map(|p| format!("{p:?}")).collect();
    let text = format!(
        "name = {name:?}\nlisten = [{listen:?}]\npeers = [{}]\n{extra}",
        peers.join(", ")
    );
    let config = Config::from_toml_str(&text, name).expect("valid test config");
    Broker::start(config).expect("broker starts")
}

fn node(name: &str, peers: &[String]) -> Broker {
    start(name, "tcp/127.0.0.1:0", peers, "")
}

fn tcp(broker: &Broker) -> String {
    broker.endpoint("tcp").expect("listens on tcp")
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn routes(broker: &Broker) -> u64 {
    broker.stats().routes.load(Ordering::Relaxed)
}

fn routed_out(broker: &Broker) -> u64 {
    broker.stats().route_messages_out.load(Ordering::Relaxed)
}

fn wait_interest(broker: &Broker, entries: usize) {
    wait_until(&format!("{entries} interest entries"), || {
        broker.route_interest_count() == entries
    });
}

/// Every payload received within [`WAIT`] up to `count`, then checks that
/// nothing more comes.
fn receive(sub: &Subscription, count: usize) -> Vec<String> {
    let mut got = Vec::new();
    while got.len() < count {
        match sub.recv_timeout(WAIT) {
            Ok(message) => got.push(String::from_utf8_lossy(&message.payload).into_owned()),
            Err(err) => panic!("after {got:?}: {err}"),
        }
    }
    assert_eq!(
        sub.recv_timeout(QUIET).map(|m| m.payload),
        Err(RecvError::Timeout),
        "more than {count} messages; got {got:?} first"
    );
    got
}

/// The first connection to `listener` within [`WAIT`].
fn accept_within_wait(listener: &std::net::TcpListener) -> std::net::TcpStream {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).unwrap();
                return stream;
            }
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(Instant::now() < deadline, "nobody connected");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(err) => panic!("accept: {err}"),
        }
    }
}

fn pair() -> (Broker, Broker) {
    let b = node("b", &[]);
    let a = node("a", &[tcp(&b)]);
    wait_until("the route", || routes(&a) == 1 && routes(&b) == 1);
    (a, b)
}

#[test]
fn a_subscriber_on_one_broker_gets_what_another_publishes() {
    let (a, b) = pair();
    let wide = b.subscribe("metrics.>").unwrap();
    let cpu = b.subscribe("metrics.*.cpu").unwrap();
    let client = Client::connect(&tcp(&b)).unwrap();
    let remote = client.subscribe("metrics.gpu0.cpu").unwrap();
    wait_interest(&a, 3);

    a.publish("metrics.gpu0.cpu", &b"1"[..]).unwrap();
    a.publish("metrics.gpu0.mem", &b"2"[..]).unwrap();
    a.publish("logs.gpu0", &b"3"[..]).unwrap();
    // A client of A publishes too.
    let publisher = Client::connect(&tcp(&a)).unwrap();
    publisher
        .publish("metrics.gpu1.cpu", Bytes::from_static(b"4"))
        .unwrap();
    publisher.flush(WAIT).unwrap();

    assert_eq!(receive(&wide, 3), ["1", "2", "4"]);
    assert_eq!(receive(&cpu, 2), ["1", "4"]);
    assert_eq!(receive(&remote, 1), ["1"]);
    // One copy per message over the route, however many patterns matched
    // there; nothing for the subject no one on B wants.
    // (Counters are added up once per loop round: wait for them.)
    wait_until("3 messages routed", || {
        routed_out(&a) == 3 && b.stats().route_messages_in.load(Ordering::Relaxed) == 3
    });
}

/// Across a TCP route, each publisher's messages reach each subscriber on
/// the other broker once and in that publisher's order: two publishers on
/// a (the embedded broker and a client of it), 20,000 messages each, every
/// hundredth of 64 KiB, to an embedded and a client subscriber on b. Both
/// brokers hold publishers back rather than drop (`block`).
#[test]
fn a_route_keeps_each_publishers_order() {
    let lossless = "[slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 20000";
    let b = start("b", "tcp/127.0.0.1:0", &[], lossless);
    let a = start("a", "tcp/127.0.0.1:0", &[tcp(&b)], lossless);
    wait_until("the route", || routes(&a) == 1 && routes(&b) == 1);
    let embedded_sub = b.subscribe("order.>").unwrap();
    let client_b = Client::connect(&tcp(&b)).unwrap();
    let client_sub = client_b.subscribe("order.>").unwrap();
    client_b.flush(WAIT).unwrap();
    // One pattern, one entry.
    wait_interest(&a, 1);

    const EACH: u32 = 20_000;
    let message = |publisher: u8, n: u32| {
        let mut payload = vec![publisher];
        payload.extend_from_slice(&n.to_le_bytes());
        if n % 100 == 0 {
            payload.resize(64 << 10, 7);
        }
        Bytes::from(payload)
    };
    // Its publishes may wait on a busy machine longer than the default.
    let patient = ClientOptions {
        block_timeout: WAIT,
        ..ClientOptions::default()
    };
    let client_a = Client::connect_with(&tcp(&a), patient, Registry::with_builtins()).unwrap();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for n in 0..EACH {
                a.publish("order.embedded", message(0, n)).unwrap();
            }
        });
        for n in 0..EACH {
            client_a.publish("order.client", message(1, n)).unwrap();
        }
        client_a.flush(WAIT).unwrap();
    });
    for (name, sub) in [("embedded", &embedded_sub), ("client", &client_sub)] {
        let mut next = [0u32; 2];
        while next != [EACH; 2] {
            let got = sub
                .recv_timeout(WAIT)
                .unwrap_or_else(|err| panic!("{name} subscriber after {next:?}: {err}"));
            let publisher = usize::from(got.payload[0]);
            let n = u32::from_le_bytes(got.payload[1..5].try_into().unwrap());
            assert_eq!(
                n, next[publisher],
                "{name} subscriber: publisher {publisher}'s messages once and in order"
            );
            assert_eq!(got.payload.len(), message(got.payload[0], n).len());
            next[publisher] += 1;
        }
        assert_eq!(
            sub.recv_timeout(QUIET).map(|m| m.payload.len()),
            Err(RecvError::Timeout),
            "{name} subscriber: nothing more"
        );
    }
}

/// Brokers whose limits differ (as in the middle of a rolling change):
/// what the receiving broker would refuse (a payload over its
/// `max_payload`, a subject over its `max_subject_len` or
/// `max_subject_tokens`) is kept back by the sender and counted, and the
/// route stays up for everything else. Before, the receiver ended the
/// route at such a message, and its peer redialed into the same end.
#[test]
fn a_message_over_the_peer_brokers_limits_is_kept_back_not_the_route() {
    let b = start(
        "b",
        "tcp/127.0.0.1:0",
        &[],
        "[limits]\nmax_subject_len = 64\nmax_subject_tokens = 4\n",
    );
    let a = start(
        "a",
        "tcp/127.0.0.1:0",
        &[tcp(&b)],
        "[limits]\nmax_payload = 4194304\n",
    );
    wait_until("the route", || routes(&a) == 1 && routes(&b) == 1);
    let sub = b.subscribe(">").unwrap();
    wait_interest(&a, 1);
    let publisher = Client::connect(&tcp(&a)).unwrap();
    let long_subject = format!("x.{}", "y".repeat(70));
    for (subject, payload) in [
        ("big", vec![1u8; 2 << 20]),
        ("small.1", b"1".to_vec()),
        (long_subject.as_str(), b"long".to_vec()),
        ("a.b.c.d.e", b"deep".to_vec()),
        ("small.2", b"2".to_vec()),
    ] {
        publisher.publish(subject, Bytes::from(payload)).unwrap();
    }
    publisher.flush(WAIT).unwrap();
    assert_eq!(receive(&sub, 2), ["1", "2"]);
    assert_eq!(a.stats().route_oversized.load(Ordering::Relaxed), 3);
    assert_eq!((routes(&a), routes(&b)), (1, 1));
    assert_eq!(a.stats().connections_total.load(Ordering::Relaxed), 2);
}

#[test]
fn brokers_listing_each_other_keep_one_route_and_deliver_once() {
    let b = node("b", &[]);
    let a = node("a", &[tcp(&b)]);
    wait_until("a's route", || routes(&a) == 1);
    // Now B lists A as well: two links race, one stays.
    b.add_peer(&tcp(&a)).unwrap();
    wait_until("b's dial", || {
        b.stats().connections_total.load(Ordering::Relaxed) >= 2
    });
    wait_until("one link each way", || {
        let links = |x: &Broker| x.stats().connections.load(Ordering::Relaxed);
        links(&a) == 1 && links(&b) == 1 && routes(&a) == 1 && routes(&b) == 1
    });

    let on_a = a.subscribe("ping").unwrap();
    let on_b = b.subscribe("ping").unwrap();
    wait_interest(&a, 1);
    wait_interest(&b, 1);
    for n in 0..10 {
        a.publish("ping", Bytes::from(format!("a{n}"))).unwrap();
        b.publish("ping", Bytes::from(format!("b{n}"))).unwrap();
    }
    // Each side gets its own ten and the other's ten, once each.
    let mut all: Vec<String> = (0..10).map(|n| format!("a{n}")).collect();
    all.extend((0..10).map(|n| format!("b{n}")));
    all.sort();
    for sub in [&on_a, &on_b] {
        let mut got = receive(sub, 20);
        got.sort();
        assert_eq!(got, all);
    }
    // The losing link is not redialed while the route is up.
    std::thread::sleep(QUIET);
    assert_eq!(routes(&a), 1);
    assert_eq!(routes(&b), 1);
}

#[test]
fn request_and_reply_cross_brokers() {
    let (a, b) = pair();
    let service = b.subscribe("svc.echo").unwrap();
    wait_interest(&a, 1);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for _ in 0..2 {
                let request = service.recv_timeout(WAIT).expect("a request");
                let reply = request.reply.expect("a reply subject");
                let mut answer = b"echo:".to_vec();
                answer.extend_from_slice(&request.payload);
                b.publish(&reply, answer).unwrap();
            }
        });
        let reply = a.request("svc.echo", &b"hi"[..], WAIT).unwrap();
        assert_eq!(&reply.payload[..], b"echo:hi");
        // A client of A asks too.
        let client = Client::connect(&tcp(&a)).unwrap();
        let reply = client
            .request("svc.echo", Bytes::from_static(b"there"), WAIT)
            .unwrap();
        assert_eq!(&reply.payload[..], b"echo:there");
    });
}

#[test]
fn responders_answer_across_a_route_and_share_a_queue_group() {
    let (a, b) = pair();
    let on_b = b
        .queue_respond("svc.where", "workers", |_| Some(Bytes::from_static(b"b")))
        .unwrap();
    let on_a = a
        .queue_respond("svc.where", "workers", |_| Some(Bytes::from_static(b"a")))
        .unwrap();
    wait_interest(&a, 1);
    wait_interest(&b, 1);
    // A broker with a member of the group delivers to it (README
    // "Clustering"): each request is answered once, by the nearer member.
    let client = Client::connect(&tcp(&a)).unwrap();
    for _ in 0..10 {
        let reply = client
            .request("svc.where", Bytes::from_static(b"?"), WAIT)
            .unwrap();
        assert_eq!(&reply.payload[..], b"a");
    }
    let reply = b.request("svc.where", &b"?"[..], WAIT).unwrap();
    assert_eq!(&reply.payload[..], b"b");
    assert_eq!(
        (on_a.stats().delivered(), on_b.stats().delivered()),
        (10, 1)
    );
    // Once A's member is gone, requests from A and its client cross the
    // route to B's, answered on B's event loop.
    drop(on_a);
    wait_until("A's member withdrawn", || {
        a.request("svc.where", &b"?"[..], WAIT)
            .is_ok_and(|reply| &reply.payload[..] == b"b")
    });
    let reply = client
        .request("svc.where", Bytes::from_static(b"?"), WAIT)
        .unwrap();
    assert_eq!(&reply.payload[..], b"b");
}

#[test]
fn requests_across_a_route_share_one_inbox() {
    let (a, b) = pair();
    let service = b.subscribe("svc.echo").unwrap();
    wait_interest(&a, 1);
    const REQUESTS: usize = 20;
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for _ in 0..REQUESTS {
                let request = service.recv_timeout(WAIT).expect("a request");
                let reply = request.reply.expect("a reply subject");
                b.publish(&reply, request.payload).unwrap();
            }
        });
        for n in 0..REQUESTS {
            let asked = Bytes::from(n.to_string());
            let reply = a.request("svc.echo", asked.clone(), WAIT).unwrap();
            assert_eq!(reply.payload, asked);
        }
    });
    // What A sent B before this message (interest updates included) has
    // reached B once the message has: B knows A's one inbox for all its
    // requests, still subscribed (an inbox per request would be gone).
    let marker = b.subscribe("marker").unwrap();
    wait_interest(&a, 2);
    a.publish("marker", &b"m"[..]).unwrap();
    marker.recv_timeout(WAIT).expect("the marker");
    assert_eq!(b.route_interest_count(), 1);
}

#[test]
fn unsubscribing_on_one_broker_stops_forwarding_from_another() {
    let (a, b) = pair();
    let sub = b.subscribe("feed").unwrap();
    wait_interest(&a, 1);
    for n in 0..5 {
        a.publish("feed", Bytes::from(n.to_string())).unwrap();
    }
    assert_eq!(receive(&sub, 5).len(), 5);
    wait_until("5 messages routed", || routed_out(&a) == 5);
    drop(sub);
    wait_interest(&a, 0);
    for n in 5..10 {
        a.publish("feed", Bytes::from(n.to_string())).unwrap();
    }
    a.flush(WAIT).unwrap();
    assert_eq!(routed_out(&a), 5, "nothing is forwarded without interest");
    // Two subscribers on one pattern are one entry: it stays until both go.
    let first = b.subscribe("feed").unwrap();
    let second = b.subscribe("feed").unwrap();
    wait_interest(&a, 1);
    drop(first);
    a.publish("feed", &b"still"[..]).unwrap();
    assert_eq!(receive(&second, 1), ["still"]);
    assert_eq!(a.route_interest_count(), 1);
}

/// A stream arriving over a route follows the receiving broker's
/// subscriptions as they change under one interest entry, which the
/// sending broker is not told about: a second subscriber on the same
/// pattern gets every message routed after it subscribed, and once the
/// first has gone the second still gets everything.
#[test]
fn a_stream_from_a_route_follows_subscriptions_that_change_under_one_entry() {
    let (a, b) = pair();
    let first = b.subscribe("feed").unwrap();
    wait_interest(&a, 1);
    let publish = |range: std::ops::Range<usize>| {
        for n in range {
            a.publish("feed", Bytes::from(n.to_string())).unwrap();
        }
        a.flush(WAIT).unwrap();
    };
    let numbers =
        |range: std::ops::Range<usize>| -> Vec<String> { range.map(|n| n.to_string()).collect() };
    publish(0..500);
    assert_eq!(receive(&first, 500), numbers(0..500));
    let second = b.subscribe("feed").unwrap();
    publish(500..1000);
    assert_eq!(receive(&first, 500), numbers(500..1000));
    assert_eq!(receive(&second, 500), numbers(500..1000));
    drop(first);
    publish(1000..1500);
    assert_eq!(receive(&second, 500), numbers(1000..1500));
    assert_eq!(a.route_interest_count(), 1);
    assert_eq!(b.stats().value("slow_consumer_drops"), Some(0));
}

/// A broker dialing a peer takes no frame past a handshake's size (32
/// KiB) before the peer's welcome: an address that answers with a huge
/// frame gets `PayloadTooLarge` and is closed at once, having cost the
/// dialer no more than that (before, the dialer read on, up to the frame
/// limit, until its handshake timeout).
#[test]
fn a_dialed_peer_sends_no_large_frame_before_its_welcome() {
    use efabus_core::codec::{self, CodecLimits};
    use efabus_core::frame::{Challenge, ErrorCode, Frame};
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = format!("tcp/{}", listener.local_addr().unwrap());
    let patient = "[limits]\nhandshake_timeout_ms = 60000\n";
    let _a = start("a", "tcp/127.0.0.1:0", &[address], patient);
    let mut stream = accept_within_wait(&listener);
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let challenge = Frame::Challenge(Challenge { nonce: [3; 32] });
    stream
        .write_all(&codec::encode(&challenge).to_bytes())
        .unwrap();
    // A frame declaring 1 MiB, 40 KiB of it sent.
    let mut huge = ((1u32 << 20) + 1).to_le_bytes().to_vec();
    huge.push(codec::FrameKind::Publish as u8);
    huge.resize(huge.len() + (40 << 10), 0);
    stream.write_all(&huge).unwrap();
    let refused = loop {
        let mut len = [0u8; 4];
        if stream.read_exact(&mut len).is_err() {
            break None;
        }
        let mut body = vec![0; u32::from_le_bytes(len) as usize];
        stream.read_exact(&mut body).unwrap();
        let frame = [len.to_vec(), body].concat();
        if let Ok(Frame::Error(error)) = codec::decode(Bytes::from(frame), &CodecLimits::default())
        {
            break Some(error);
        }
    };
    let refused = refused.expect("an error frame before the close");
    assert_eq!(refused.code, ErrorCode::PayloadTooLarge, "{refused:?}");
}

/// Messages a route brings for a queue group take turns among its
/// members there: the member is picked per message, never kept for the
/// subject, and a message the route brings for a plain subscriber there
/// takes no turn (it did: with one plain subscriber beside the group,
/// every message of the group went to the same member).
#[test]
fn a_queue_group_fed_over_a_route_shares_its_messages() {
    let (a, b) = pair();
    let plain = b.subscribe("jobs").unwrap();
    let members = [
        b.queue_subscribe("jobs", "g").unwrap(),
        b.queue_subscribe("jobs", "g").unwrap(),
    ];
    wait_interest(&a, 2);
    for n in 0..200 {
        a.publish("jobs", Bytes::from(n.to_string())).unwrap();
    }
    a.flush(WAIT).unwrap();
    wait_until("200 messages taken", || {
        members.iter().map(|m| m.stats().delivered()).sum::<u64>() == 200
    });
    let each: Vec<u64> = members.iter().map(|m| m.stats().delivered()).collect();
    assert_eq!(each, [100, 100], "the members take turns");
    assert_eq!(receive(&plain, 200).len(), 200);
}

/// The last member of a queue group on a broker leaves (here at its
/// delivery limit) while messages an in-process publisher picked it for
/// still wait for the event loop: they go over the route to the group's
/// member on the other broker, none lost.
#[test]
fn a_leaving_member_s_picks_go_over_the_route_when_none_is_left_here() {
    const SENT: usize = 20_000;
    const LIMIT: usize = 6;
    let (a, b) = pair();
    let remote_member = b.queue_subscribe("work", "g").unwrap();
    wait_interest(&a, 1);
    let mut raw = raw_common::Raw::connect(&a);
    raw.hello_as_client("limited");
    raw.queue_subscribe_limited(1, "work", "g", LIMIT as u64);

    for n in 0..SENT {
        a.publish("work", Bytes::from(n.to_string())).unwrap();
    }
    a.flush(WAIT).unwrap();
    let limited = raw.messages_before_pong(2).len();
    assert_eq!(limited, LIMIT, "the member here took its maximum");
    assert_eq!(receive(&remote_member, SENT - LIMIT).len(), SENT - LIMIT);
    assert_eq!(a.stats().value("connection_drops"), Some(0));
}

/// A route's interest beyond `limits.max_route_interest` is refused and
/// counted, not dropped without a word; what fits keeps working, and a
/// client's own limit (`max_subscriptions_per_peer`) does not apply to a
/// route, which carries the patterns of all the peer's subscribers.
#[test]
fn route_interest_over_its_limit_is_refused_and_counted() {
    let b = start(
        "b",
        "tcp/127.0.0.1:0",
        &[],
        "[limits]\nmax_route_interest = 3\nmax_subscriptions_per_peer = 1\n",
    );
    let a = node("a", &[tcp(&b)]);
    wait_until("the route", || routes(&a) == 1 && routes(&b) == 1);
    let subs: Vec<_> = (0..5)
        .map(|n| a.subscribe(&format!("limited.{n}")).unwrap())
        .collect();
    let refused = || b.stats().route_interest_refused.load(Ordering::Relaxed);
    wait_until("two entries refused", || refused() == 2);
    assert_eq!(b.route_interest_count(), 3);
    for (n, sub) in subs.iter().enumerate().take(3) {
        b.publish(&format!("limited.{n}"), Bytes::from(n.to_string()))
            .unwrap();
        assert_eq!(receive(sub, 1), [n.to_string()]);
    }
    assert_eq!(routes(&a), 1, "the route stays up");
}

#[test]
fn a_restarted_peer_is_reconnected_and_interest_restored() {
    let b = node("b", &[]);
    let address = tcp(&b);
    let a = node("a", std::slice::from_ref(&address));
    wait_until("the route", || routes(&a) == 1);
    let on_a = a.subscribe("to.a").unwrap();
    wait_interest(&b, 1);
    drop(b);
    wait_until("the route to drop", || routes(&a) == 0);
    assert_eq!(a.route_interest_count(), 0);

    // B comes back on the same address, as a new broker process.
    let listen = format!("tcp/{}", address.trim_start_matches("tcp/"));
    let b = start("b", &listen, &[], "");
    wait_until("the route again", || routes(&a) == 1 && routes(&b) == 1);
    let on_b = b.subscribe("to.b").unwrap();
    wait_interest(&a, 1);
    // A's interest was sent to the new B when the route came up.
    wait_interest(&b, 1);
    a.publish("to.b", &b"from a"[..]).unwrap();
    b.publish("to.a", &b"from b"[..]).unwrap();
    assert_eq!(receive(&on_b, 1), ["from a"]);
    assert_eq!(receive(&on_a, 1), ["from b"]);
}

/// Three brokers, each dialing the ones started before it.
fn mesh() -> (Broker, Broker, Broker) {
    let a = node("a", &[]);
    let b = node("b", &[tcp(&a)]);
    let c = node("c", &[tcp(&a), tcp(&b)]);
    wait_until("the full mesh", || {
        routes(&a) == 2 && routes(&b) == 2 && routes(&c) == 2
    });
    (a, b, c)
}

#[test]
fn a_full_mesh_delivers_each_publish_once_to_every_subscriber() {
    let (a, b, c) = mesh();
    let subs = [
        a.subscribe("news.>").unwrap(),
        b.subscribe("news.>").unwrap(),
        c.subscribe("news.>").unwrap(),
        c.subscribe("news.*").unwrap(),
    ];
    // A sees B's entry and C's two; B sees A's and C's two; C sees A's and B's.
    wait_interest(&a, 3);
    wait_interest(&b, 3);
    wait_interest(&c, 2);
    a.publish("news.a", &b"a"[..]).unwrap();
    b.publish("news.b", &b"b"[..]).unwrap();
    c.publish("news.c", &b"c"[..]).unwrap();
    for sub in &subs {
        let mut got = receive(sub, 3);
        got.sort();
        assert_eq!(got, ["a", "b", "c"], "{}", sub.pattern());
    }
    // Each message crossed each route once, and never a second hop.
    wait_until("6 messages routed", || {
        routed_out(&a) + routed_out(&b) + routed_out(&c) == 6
    });
    std::thread::sleep(QUIET);
    assert_eq!(routed_out(&a) + routed_out(&b) + routed_out(&c), 6);
}

#[test]
fn a_queue_group_spanning_brokers_gets_each_message_once() {
    let (a, b, c) = mesh();
    let members = [
        a.queue_subscribe("work.*", "workers").unwrap(),
        b.queue_subscribe("work.*", "workers").unwrap(),
        b.queue_subscribe("work.*", "workers").unwrap(),
    ];
    wait_interest(&a, 1);
    wait_interest(&b, 1);
    wait_interest(&c, 2);
    let mut sent = BTreeSet::new();
    for n in 0..30 {
        for (name, broker) in [("a", &a), ("b", &b), ("c", &c)] {
            let payload = format!("{name}{n}");
            broker.publish("work.item", payload.clone()).unwrap();
            sent.insert(payload);
        }
    }
    let mut got = Vec::new();
    let deadline = Instant::now() + WAIT;
    while got.len() < sent.len() && Instant::now() < deadline {
        for member in &members {
            while let Ok(message) = member.try_recv() {
                got.push(String::from_utf8_lossy(&message.payload).into_owned());
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(QUIET);
    for member in &members {
        while let Ok(message) = member.try_recv() {
            got.push(String::from_utf8_lossy(&message.payload).into_owned());
        }
    }
    assert_eq!(got.len(), sent.len(), "each message exactly once: {got:?}");
    let distinct: BTreeSet<String> = got.into_iter().collect();
    assert_eq!(distinct, sent);
    // A broker with members serves its own publishers; C, with none,
    // spreads its messages over the routes.
    let on_a = members[0].stats().delivered();
    let on_b = members[1].stats().delivered() + members[2].stats().delivered();
    assert!(on_a > 30 && on_b > 30, "a {on_a}, b {on_b}");
}

#[test]
fn routes_present_the_cluster_credentials() {
    let secret = "[auth]\nsecret = \"s3cret\"\n";
    let b = start("b", "tcp/127.0.0.1:0", &[], secret);
    let a = start("a", "tcp/127.0.0.1:0", &[tcp(&b)], secret);
    wait_until("the route", || routes(&a) == 1 && routes(&b) == 1);
    let stranger = start(
        "c",
        "tcp/127.0.0.1:0",
        &[tcp(&b)],
        "[auth]\nsecret = \"wrong\"\n",
    );
    wait_until("the refusal", || {
        b.stats().auth_failures.load(Ordering::Relaxed) >= 1
    });
    assert_eq!(routes(&stranger), 0);
    assert_eq!(routes(&b), 1);
}

#[test]
fn a_peer_must_be_a_tcp_endpoint_and_a_broker_needs_one_to_dial_from() {
    let b = node("b", &[]);
    assert!(b.add_peer("mem/x").is_err());
    let text = "name = \"m\"\nlisten = [\"mem/cluster-test\"]\n";
    let mem_only = Broker::start(Config::from_toml_str(text, "m").unwrap()).unwrap();
    let err = mem_only.add_peer(&tcp(&b)).unwrap_err().to_string();
    assert!(err.contains("tcp"), "{err}");
    // With peers configured, a broker without a tcp listener dials anyway.
    let text = format!(
        "name = \"d\"\nlisten = [\"mem/cluster-dialer\"]\npeers = [{:?}]\n",
        tcp(&b)
    );
    let dialer = Broker::start(Config::from_toml_str(&text, "d").unwrap()).unwrap();
    wait_until("the route", || routes(&dialer) == 1 && routes(&b) == 1);
    let sub = dialer.subscribe("x").unwrap();
    wait_interest(&b, 1);
    b.publish("x", &b"over the dialer"[..]).unwrap();
    assert_eq!(receive(&sub, 1), ["over the dialer"]);
}

/// Brokers given only the first as seed learn of each other from it and
/// form the full mesh over TCP, each message reaching every subscriber
/// once; one that leaves is forgotten after `cluster.forget_after_ms`, and
/// meshed again when it comes back.
#[test]
fn brokers_given_one_seed_form_the_full_mesh_and_forget_one_that_leaves() {
    let forget = "[cluster]\nforget_after_ms = 300\n";
    let a = start("a", "tcp/127.0.0.1:0", &[], forget);
    let seed = [tcp(&a)];
    let b = start("b", "tcp/127.0.0.1:0", &seed, forget);
    let c = start("c", "tcp/127.0.0.1:0", &seed, forget);
    let meshed = |brokers: &[&Broker]| {
        for broker in brokers {
            wait_until("the full mesh", || {
                routes(broker) == brokers.len() as u64 - 1
            });
        }
    };
    meshed(&[&a, &b, &c]);
    assert!(c.peers().contains(&tcp(&b)), "c learned b: {:?}", c.peers());
    each_message_once_everywhere(&[&a, &b, &c]);

    let b_address = tcp(&b);
    drop(b);
    wait_until("b's routes down", || routes(&a) == 1 && routes(&c) == 1);
    wait_until("b forgotten", || !c.peers().contains(&b_address));
    let b = start("b", "tcp/127.0.0.1:0", &seed, forget);
    meshed(&[&a, &b, &c]);
    each_message_once_everywhere(&[&a, &b, &c]);
}

/// Brokers of one host seeded by host name (`tcp/localhost:PORT`) learn
/// each other's loopback addresses from the seed all the same: a peer
/// dialed by name is not known to be on another host.
#[test]
fn brokers_seeded_by_host_name_mesh_on_one_host() {
    let a = node("a", &[]);
    let port = tcp(&a).rsplit(':').next().expect("a port").to_string();
    let seed = [format!("tcp/localhost:{port}")];
    let b = node("b", &seed);
    let c = node("c", &seed);
    for broker in [&a, &b, &c] {
        wait_until("the full mesh", || routes(broker) == 2);
    }
    each_message_once_everywhere(&[&a, &b, &c]);
}

/// A subscriber on each broker; each broker publishes ten messages: every
/// subscriber gets all of them once.
fn each_message_once_everywhere(brokers: &[&Broker]) {
    let subs: Vec<Subscription> = brokers
        .iter()
        .map(|broker| broker.subscribe("seeded.>").unwrap())
        .collect();
    for broker in brokers {
        wait_interest(broker, brokers.len() - 1);
    }
    for (index, broker) in brokers.iter().enumerate() {
        for n in 0..10 {
            broker
                .publish("seeded.data", Bytes::from(format!("{index}-{n}")))
                .unwrap();
        }
    }
    let expected: BTreeSet<String> = (0..brokers.len())
        .flat_map(|index| (0..10).map(move |n| format!("{index}-{n}")))
        .collect();
    for sub in &subs {
        let got: BTreeSet<String> = receive(sub, expected.len()).into_iter().collect();
        assert_eq!(got, expected);
    }
}
