//! Two `efabus serve` processes joined by `peers`: clients of one reach
//! subscribers and responders on the other.

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
