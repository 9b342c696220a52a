//! Two `efabus serve` processes joined by `peers`: clients of one reach
//! subscribers and responders on the other, and one killed and started
//! again gets its route back on the fabric.

mod common;

use std::time::{Duration, Instant};

use common::Server;
use efabus::{Bytes, Client, RecvError};

const WAIT: Duration = Duration::from_secs(10);

/// Publish on `probe` through `publisher` until `sub` sees one: the route is
/// up and the subscriber's interest has crossed it.
fn wait_for_route(publisher: &Client, sub: &efabus::Subscription) {
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(Instant::now() < deadline, "the route did not come up");
        publisher
            .publish("probe", Bytes::from_static(b"?"))
            .expect("publish");
        if sub.recv_timeout(Duration::from_millis(50)).is_ok() {
            return;
        }
    }
}

#[test]
fn clients_of_two_peered_brokers_reach_each_other() {
    let b = Server::start("name = \"b\"\n");
    let a = Server::start(&format!("name = \"a\"\npeers = [{:?}]\n", b.endpoint));
    let on_a = Client::connect(&a.endpoint).expect("connect a");
    let on_b = Client::connect(&b.endpoint).expect("connect b");
    let probe = on_b.subscribe("probe").expect("subscribe");
    let data = on_b.subscribe("data.>").expect("subscribe");
    let service = on_b.subscribe("svc.time").expect("subscribe");
    wait_for_route(&on_a, &probe);

    for n in 0..10 {
        on_a.publish(&format!("data.{n}"), Bytes::from(n.to_string()))
            .expect("publish");
    }
    for n in 0..10 {
        let message = data.recv_timeout(WAIT).expect("a message");
        assert_eq!(message.subject.to_string(), format!("data.{n}"));
        assert_eq!(&message.payload[..], n.to_string().as_bytes());
    }
    assert_eq!(
        data.recv_timeout(Duration::from_millis(200))
            .map(|m| m.payload),
        Err(RecvError::Timeout),
        "each message once"
    );

    std::thread::scope(|scope| {
        scope.spawn(|| {
            let request = service.recv_timeout(WAIT).expect("a request");
            let reply = request.reply.expect("a reply subject");
            on_b.publish(&reply, Bytes::from_static(b"noon"))
                .expect("reply");
        });
        let reply = on_a
            .request("svc.time", Bytes::from_static(b"now?"), WAIT)
            .expect("a reply from the other broker");
        assert_eq!(&reply.payload[..], b"noon");
    });
}

/// `EFABUS_CLUSTER_SECRET` sets `cluster.secret`: brokers given the same one
/// route, whatever their clients' secret; a broker given another does not.
#[test]
fn the_cluster_secret_from_the_environment_opens_routes() {
    let clients = "[auth]\nsecret = \"clients\"\n";
    let mesh = [("EFABUS_CLUSTER_SECRET", "mesh")];
    let b = Server::start_with_env("127.0.0.1:0", &format!("name = \"b\"\n{clients}"), &mesh);
    let a = Server::start_with_env(
        "127.0.0.1:0",
        &format!("name = \"a\"\npeers = [{:?}]\n{clients}", b.endpoint),
        &mesh,
    );
    let other = Server::start_with_env(
        "127.0.0.1:0",
        &format!("name = \"c\"\npeers = [{:?}]\n{clients}", b.endpoint),
        &[("EFABUS_CLUSTER_SECRET", "another")],
    );
    let connect = |server: &Server| {
        Client::connect_with(
            &server.endpoint,
            efabus::ClientOptions {
                credentials: Some("clients".into()),
                ..efabus::ClientOptions::default()
            },
            efabus::transports::registry::Registry::with_builtins(),
        )
        .expect("connect")
    };
    let on_a = connect(&a);
    let on_b = connect(&b);
    let on_c = connect(&other);
    let probe = on_b.subscribe("probe").expect("subscribe");
    wait_for_route(&on_a, &probe);

    // The broker with another cluster secret never gets its messages across.
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        on_c.publish("probe", Bytes::from_static(b"c"))
            .expect("publish");
        std::thread::sleep(Duration::from_millis(20));
    }
    on_c.flush(WAIT).expect("flush");
    while let Ok(message) = probe.recv_timeout(Duration::from_millis(200)) {
        assert_ne!(&message.payload[..], b"c", "no route from c");
    }
}

/// Whether `ready` comes true within [`WAIT`]; if not, the test fails
/// where the fabric is required (saying what is `missing`, with the
/// `report`) and is skipped elsewhere.
fn fabric_ready(ready: impl FnMut() -> bool, missing: &str, report: impl Fn() -> String) -> bool {
    if common::eventually(WAIT, ready) {
        return true;
    }
    assert!(!common::fabric_required(), "{missing}: {}", report());
    eprintln!("skipping: {missing}");
    false
}

/// The routes `/routez` of the broker monitored at `monitor` reports, as
/// (remote, reliable link) pairs.
fn routes(monitor: &str) -> Vec<(String, String)> {
    let routez = common::monitor_json(monitor, "/routez");
    let Some(routes) = routez["routes"].as_array() else {
        return Vec::new();
    };
    let text = |value: &serde_json::Value| value.as_str().unwrap_or_default().to_string();
    routes
        .iter()
        .map(|route| (text(&route["remote"]), text(&route["link"]["reliable"])))
        .collect()
}

/// A broker that hangs (SIGSTOP) while a peer streams to it over a fabric
/// route and is then killed (SIGKILL, as a crash), then started again at
/// its address: what the survivor routed to it meanwhile is counted there
/// as lost (queued, or sent and not acknowledged), the route comes back on
/// the fabric, and from then on each message arrives once and in order,
/// none of those from before (no duplicates, no loops).
#[test]
fn a_killed_broker_comes_back_on_the_fabric() {
    let fabric = "monitor = \"127.0.0.1:0\"\n\
                  [fabric]\nprovider = \"tcp;ofi_rxm\"\nnode = \"127.0.0.1\"\n";
    let listen = ["tcp/127.0.0.1:0", "efa-rdm"];
    let mut b = Server::start_listening(&listen, &format!("name = \"b\"\n{fabric}"), &[]);
    let a = Server::start_listening(
        &listen,
        &format!("name = \"a\"\npeers = [{:?}]\n{fabric}", b.endpoint),
        &[],
    );
    let a_monitor = a.monitor.clone().expect("a serves monitoring");
    let on_fabric = |routes: &[(String, String)]| {
        routes.len() == 1 && routes[0].1.starts_with("efa-rdm via tcp;ofi_rxm")
    };
    let route_up = fabric_ready(
        || on_fabric(&routes(&a_monitor)),
        "the route is not on tcp;ofi_rxm",
        || format!("{:?}", routes(&a_monitor)),
    );
    if !route_up {
        return;
    }
    let publisher = Client::connect(&a.endpoint).expect("connect a");
    let sub_before = Client::connect(&b.endpoint).expect("connect b");
    let probe = sub_before.subscribe("probe").expect("subscribe");
    let before = sub_before.subscribe("kill.>").expect("subscribe");
    wait_for_route(&publisher, &probe);
    // A probe sent after the one that came may still be on its way.
    while probe.recv_timeout(Duration::from_millis(200)).is_ok() {}
    let total = |name: &str| common::varz_total(&a_monitor, name);
    let routed_at_start = total("route_messages_out");

    // A stream that b delivers whole, so that b holds none of it when it
    // dies (what a crashed broker had taken and not passed on is lost
    // with it, and no survivor can count it).
    let number = |n: u64| Bytes::from(n.to_le_bytes().to_vec());
    for n in 0..1_000u64 {
        publisher.publish("kill.data", number(n)).expect("publish");
    }
    for n in 0..1_000u64 {
        let message = before.recv_timeout(WAIT).expect("the stream arrives");
        assert_eq!(message.payload, number(n), "once and in order");
    }
    // a's counts reach its monitor at the end of its loop rounds: every
    // message of the stream counted before the baselines are taken.
    assert!(
        common::eventually(WAIT, || total("route_messages_out")
            == routed_at_start + 1_000),
        "a counted {} routed messages of the 1,000",
        total("route_messages_out") - routed_at_start
    );
    let dropped = || total("connection_drops") + total("slow_consumer_drops");
    let (routed_before, dropped_before, unacknowledged_before) = (
        total("route_messages_out"),
        dropped(),
        total("unacknowledged_at_close"),
    );
    b.stop();
    // What a routes to b from now on is lost: a counts it as it learns
    // that b has gone.
    for n in 1_000..2_000u64 {
        publisher.publish("kill.data", number(n)).expect("publish");
    }
    publisher.flush(WAIT).expect("flush");
    let routed = || total("route_messages_out") - routed_before;
    assert!(
        common::eventually(WAIT, || routed() == 1_000),
        "a routed {} of the 1,000 published while b hung",
        routed()
    );
    b.kill();
    assert!(
        common::eventually(WAIT, || routes(&a_monitor).is_empty()),
        "a still reports a route to the killed b: {:?}",
        routes(&a_monitor)
    );
    let counts = || {
        (
            routed(),
            dropped() - dropped_before,
            total("unacknowledged_at_close") - unacknowledged_before,
        )
    };
    let counted = |(lost, dropped, unacknowledged): (u64, u64, u64)| {
        dropped <= lost && lost <= dropped + unacknowledged
    };
    common::eventually(WAIT, || counted(counts()));
    let (lost, dropped, unacknowledged) = counts();
    eprintln!(
        "a routed {lost} messages to b while it hung: {dropped} dropped, \
         {unacknowledged} unacknowledged"
    );
    assert!(
        counted((lost, dropped, unacknowledged)),
        "{lost} messages routed to the hung b, {dropped} counted as dropped and \
         {unacknowledged} as unacknowledged"
    );
    if let Ok(message) = before.recv_timeout(Duration::from_millis(200)) {
        let n = u64::from_le_bytes(message.payload[..].try_into().unwrap_or([0xff; 8]));
        panic!("message {n} came from a broker stopped before it was published");
    }
    drop(sub_before);

    let b_again = Server::start_listening(
        &[&format!("tcp/{}", b.address), "efa-rdm"],
        &format!("name = \"b\"\n{fabric}"),
        &[],
    );
    assert!(
        common::eventually(WAIT, || on_fabric(&routes(&a_monitor))),
        "the route did not come back on the fabric: {:?}",
        routes(&a_monitor)
    );
    let sub_after = Client::connect(&b_again.endpoint).expect("connect b again");
    let probe = sub_after.subscribe("probe").expect("subscribe");
    let after = sub_after.subscribe("kill.>").expect("subscribe");
    wait_for_route(&publisher, &probe);
    for n in 10_000..10_100u64 {
        publisher.publish("kill.data", number(n)).expect("publish");
    }
    for n in 10_000..10_100u64 {
        let message = after
            .recv_timeout(WAIT)
            .expect("a message after the restart");
        assert_eq!(message.payload, number(n), "each once, in order");
    }
    assert_eq!(
        after
            .recv_timeout(Duration::from_millis(300))
            .map(|m| m.payload),
        Err(RecvError::Timeout),
        "nothing more: no old message, no duplicate"
    );
}

/// A route's datagram link towards a broker that hangs (SIGSTOP) is given
/// up by the broker streaming on it, which leaves what it sent there
/// unconfirmed to the hung one to count; that one never reads the notice
/// (it is killed), so the survivor counts those frames when the route
/// ends, in `unacknowledged_at_close`: every best-effort message routed to
/// the hung broker is counted, as dropped, unacknowledged or queued.
/// Before, the frames left to the peer were counted by nobody.
#[test]
fn best_effort_left_to_a_hung_broker_is_counted_when_its_route_ends() {
    let config = |name: &str, peers: &str| {
        format!(
            "name = {name:?}\npeers = [{peers}]\nmonitor = \"127.0.0.1:0\"\n\
             [heartbeat]\ninterval_ms = 100\ntimeout_ms = 5000\n\
             [fabric]\nprovider = \"tcp;ofi_rxm\"\ndgram_provider = \"udp\"\n\
             node = \"127.0.0.1\"\n"
        )
    };
    let listen = ["tcp/127.0.0.1:0", "efa-rdm", "efa-dgram"];
    let mut b = Server::start_listening(&listen, &config("b", ""), &[]);
    let a = Server::start_listening(&listen, &config("a", &format!("{:?}", b.endpoint)), &[]);
    let a_monitor = a.monitor.clone().expect("a serves monitoring");
    let datagram_route = || {
        let routez = common::monitor_json(&a_monitor, "/routez");
        routez["routes"][0]["link"]["best_effort"]
            .as_str()
            .is_some_and(|link| link.starts_with("efa-dgram via udp"))
    };
    let route_up = fabric_ready(
        datagram_route,
        "the route has no datagram link over udp",
        || common::monitor_json(&a_monitor, "/routez").to_string(),
    );
    if !route_up {
        return;
    }
    let publisher = Client::connect(&a.endpoint).expect("connect a");
    let on_b = Client::connect(&b.endpoint).expect("connect b");
    let probe = on_b.subscribe("probe").expect("subscribe");
    let best_effort = on_b.subscribe_best_effort("be.>").expect("subscribe");
    wait_for_route(&publisher, &probe);
    // The datagram link in use and credited: what b takes comes through.
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(
            Instant::now() < deadline,
            "nothing came on the datagram link"
        );
        for _ in 0..20 {
            publisher
                .publish("be.data", Bytes::from_static(b"before"))
                .expect("publish");
        }
        if best_effort.recv_timeout(Duration::from_millis(50)).is_ok() {
            break;
        }
    }
    while best_effort.recv_timeout(Duration::from_millis(200)).is_ok() {}
    let total = |name: &str| common::varz_total(&a_monitor, name);
    // What a drops (no credit, or queued when the route ends) and what it
    // sent that b never acknowledged (b may have taken it or not).
    let dropped =
        || total("best_effort_drops") + total("connection_drops") + total("slow_consumer_drops");
    let (routed_before, dropped_before, unacknowledged_before, given_up_before) = (
        total("route_messages_out"),
        dropped(),
        total("unacknowledged_at_close"),
        total("datagram_links_given_up"),
    );

    b.stop();
    // Paced, so that most of it goes out on the datagram link (the
    // window's worth a credit allows) rather than being dropped at once
    // for want of credit, and the link is given up (three probes of
    // 400 ms unanswered, half the heartbeat timeout passed) while the
    // route still stands.
    for _ in 0..100 {
        for _ in 0..10 {
            publisher
                .publish("be.data", Bytes::from_static(b"hung"))
                .expect("publish");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    publisher.flush(WAIT).expect("flush");
    let routed = || total("route_messages_out") - routed_before;
    assert!(
        common::eventually(WAIT, || routed() == 1_000),
        "a routed {} of the 1,000 published while b hung",
        routed()
    );
    // b is silent past the heartbeat timeout: a ends the route.
    assert!(
        common::eventually(WAIT, || common::monitor_json(&a_monitor, "/routez")
            ["routes"]
            .as_array()
            .is_some_and(Vec::is_empty)),
        "a still reports a route to the hung b"
    );
    // Given up before the route ended (a session's end counts its open
    // datagram link's frames itself).
    assert!(
        total("datagram_links_given_up") > given_up_before,
        "the datagram link was not given up before the route ended"
    );
    b.kill();
    let counts = || {
        (
            dropped() - dropped_before,
            total("unacknowledged_at_close") - unacknowledged_before,
        )
    };
    let routed = routed();
    let counted = |(dropped, unacknowledged): (u64, u64)| dropped + unacknowledged >= routed;
    common::eventually(WAIT, || counted(counts()));
    let (dropped, unacknowledged) = counts();
    eprintln!(
        "a routed {routed} best-effort messages to the hung b: {dropped} dropped, \
         {unacknowledged} unacknowledged"
    );
    // At most lost: besides the messages, the reliable link's own frames
    // in flight count (its pings, 10 a second until the route ended 5 s
    // later: the heartbeat settings above; the notice), well under what
    // the datagram link carried (its window).
    assert!(
        counted((dropped, unacknowledged)) && dropped + unacknowledged <= routed + 200,
        "{routed} best-effort messages routed to the hung b, {dropped} counted as dropped and \
         {unacknowledged} as unacknowledged"
    );
}
