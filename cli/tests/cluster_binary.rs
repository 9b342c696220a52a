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
