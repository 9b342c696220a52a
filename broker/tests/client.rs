//! The client against an embedded broker, over TCP on loopback and over the
//! in-process `mem` transport: routing both ways, queue groups spanning
//! both sides, request/reply, ordering, large payloads, reconnection,
//! authentication and connect failures.
//!
//! Ordering without sleeps: a client's `flush` is answered by the server
//! after everything the client sent before it, and the answer reaches the
//! client after every message the server queued to it before. So
//! "publisher flushes, then subscriber flushes" means every delivery is in
//! the subscriber's queue.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_broker::{
    Broker, Client, ClientOptions, Config, ConnectionState, Error, Message, RecvError, Responder,
    SlowConsumerPolicy, Subscription,
};
use efabus_core::frame::ErrorCode;
use efabus_transports::registry::Registry;

/// Bound on every wait; things normally happen at once.
const WAIT: Duration = Duration::from_secs(10);

static NEXT_NAME: AtomicU64 = AtomicU64::new(0);

/// The transports each routing test runs over.
#[derive(Debug, Clone, Copy)]
enum Via {
    Tcp,
    Mem,
}

const BOTH: [Via; 2] = [Via::Tcp, Via::Mem];

/// An embedded broker listening on one transport, and its endpoint string.
fn start(via: Via, extra: &str) -> (Broker, String) {
    let listen = match via {
        Via::Tcp => "tcp/127.0.0.1:0".to_string(),
        // mem names are process-wide; tests run in parallel.
        Via::Mem => format!(
            "mem/client-test-{}-{}",
            std::process::id(),
            NEXT_NAME.fetch_add(1, Ordering::Relaxed)
        ),
    };
    let text = format!("name = \"client-test\"\nlisten = [\"{listen}\"]\n{extra}");
    let config = Config::from_toml_str(&text, "client test").expect("valid test config");
    let broker = Broker::start(config).expect("broker starts");
    let scheme = match via {
        Via::Tcp => "tcp",
        Via::Mem => "mem",
    };
    let endpoint = broker.endpoint(scheme).expect("listening endpoint");
    (broker, endpoint)
}

fn options() -> ClientOptions {
    ClientOptions {
        connect_timeout: WAIT,
        ..ClientOptions::default()
    }
}

fn connect(endpoint: &str) -> Client {
    connect_as(endpoint, options())
}

fn connect_as(endpoint: &str, options: ClientOptions) -> Client {
    Client::connect_with(endpoint, options, Registry::with_builtins()).expect("client connects")
}

fn text(message: &Message) -> String {
    format!(
        "{}:{}",
        message.subject,
        String::from_utf8_lossy(&message.payload)
    )
}

fn recv(sub: &Subscription) -> String {
    text(&sub.recv_timeout(WAIT).expect("message within the wait"))
}

fn drain(sub: &Subscription) -> Vec<String> {
    std::iter::from_fn(|| sub.try_recv().ok())
        .map(|m| text(&m))
        .collect()
}

/// Wait (bounded) for a condition that other threads make true.
fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn connect_reports_the_server() {
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let client = connect(&endpoint);
        assert_eq!(
            client.state(),
            ConnectionState::Connected {
                server: "client-test".into()
            },
            "{via:?}"
        );
        assert_eq!(client.reconnects(), 0);
        eventually("the broker to count the connection", || {
            broker.stats().connections.load(Ordering::Relaxed) == 1
        });
        client.shutdown();
        assert_eq!(client.state(), ConnectionState::Closed);
        eventually("the broker to forget the connection", || {
            broker.stats().connections.load(Ordering::Relaxed) == 0
        });
    }
}

#[test]
fn messages_flow_both_ways_between_embedded_and_remote() {
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let client = connect(&endpoint);
        let other = connect(&endpoint);

        let remote = client.subscribe("down.*").unwrap();
        let remote_other = other.subscribe("down.>").unwrap();
        let local = broker.subscribe("up.>").unwrap();
        client.flush(WAIT).unwrap();
        other.flush(WAIT).unwrap();

        // Embedded to remote.
        broker.publish("down.a", Bytes::from_static(b"1")).unwrap();
        assert_eq!(recv(&remote), "down.a:1", "{via:?}");
        assert_eq!(recv(&remote_other), "down.a:1", "{via:?}");

        // Remote to embedded.
        client.publish("up.b.c", Bytes::from_static(b"2")).unwrap();
        assert_eq!(recv(&local), "up.b.c:2", "{via:?}");

        // Remote to remote, through the broker.
        other.publish("down.z", Bytes::from_static(b"3")).unwrap();
        assert_eq!(recv(&remote), "down.z:3", "{via:?}");
        assert_eq!(recv(&remote_other), "down.z:3", "{via:?}");

        // Unmatched subjects reach nobody.
        client
            .publish("down.x.y", Bytes::from_static(b"4"))
            .unwrap();
        client.flush(WAIT).unwrap();
        other.flush(WAIT).unwrap();
        assert_eq!(remote.try_recv(), Err(RecvError::Empty), "{via:?}");
        assert_eq!(drain(&remote_other), ["down.x.y:4"], "{via:?}");
        assert_eq!(local.try_recv(), Err(RecvError::Empty), "{via:?}");
    }
}

#[test]
fn dropping_a_remote_subscription_removes_it_from_the_broker() {
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let client = connect(&endpoint);
        let sub = client.subscribe("gone.>").unwrap();
        let kept = client.subscribe("kept").unwrap();
        client.flush(WAIT).unwrap();
        assert_eq!(broker.subscription_count(), 2, "{via:?}");
        drop(sub);
        client.flush(WAIT).unwrap();
        assert_eq!(broker.subscription_count(), 1, "{via:?}");
        assert!(matches!(
            broker.request("gone.x", Bytes::new(), WAIT),
            Err(Error::NoResponders(_))
        ));
        client.shutdown();
        drop(kept);
        // What stays is the broker's own inbox, subscribed by its request.
        eventually("the closed client's subscriptions to go", || {
            broker.subscription_count() == 1
        });
    }
}

/// The broker keeps the sessions a subject reached while its subscriptions
/// stay the same; every change in between must show in the next message.
#[test]
fn a_stream_on_one_subject_follows_every_subscription_change() {
    let numbers = |sub: &Subscription| {
        std::iter::from_fn(|| sub.try_recv().ok())
            .map(|m| number(&m))
            .collect::<Vec<_>>()
    };
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let publisher = connect(&endpoint);
        let subscriber = connect(&endpoint);
        // After the publisher's flush the broker has routed the message;
        // after the subscriber's, it is in the subscriber's queue.
        let publish = |n: u32| {
            publisher.publish("s.x", numbered(n)).unwrap();
            publisher.flush(WAIT).unwrap();
            subscriber.flush(WAIT).unwrap();
        };
        // A session of its own: what the broker still sent it after it
        // unsubscribed shows in its count (its client would drop it).
        let leaving = Client::connect_with(
            &endpoint,
            ClientOptions {
                name: "leaving".to_string(),
                ..options()
            },
            Registry::with_builtins(),
        )
        .expect("client connects");
        let first = leaving.subscribe("s.x").unwrap();
        leaving.flush(WAIT).unwrap();
        publish(1);
        publish(2);
        let wildcard = subscriber.subscribe("s.*").unwrap();
        subscriber.flush(WAIT).unwrap();
        publish(3);
        leaving.flush(WAIT).unwrap();
        assert_eq!(numbers(&first), [1, 2, 3], "{via:?}");
        drop(first);
        leaving.flush(WAIT).unwrap();
        publish(4);
        let sent_to_leaving = broker
            .connections(&[], WAIT)
            .unwrap()
            .into_iter()
            .find(|report| report.name == "leaving")
            .map(|report| report.counts.messages_out);
        assert_eq!(sent_to_leaving, Some(3), "{via:?}: nothing after it left");
        let embedded = broker.subscribe("s.x").unwrap();
        publish(5);
        assert_eq!(numbers(&embedded), [5], "{via:?}");
        drop(embedded);
        let group = [
            subscriber.queue_subscribe("s.x", "q").unwrap(),
            subscriber.queue_subscribe("s.x", "q").unwrap(),
        ];
        subscriber.flush(WAIT).unwrap();
        for n in 6..26 {
            publish(n);
        }
        assert_eq!(numbers(&wildcard), (3..26).collect::<Vec<_>>(), "{via:?}");
        let per_member: Vec<Vec<u32>> = group.iter().map(numbers).collect();
        assert!(
            per_member.iter().all(|got| !got.is_empty()),
            "{via:?}: the group's member is picked per message: {per_member:?}"
        );
        let mut picked: Vec<u32> = per_member.concat();
        picked.sort_unstable();
        assert_eq!(picked, (6..26).collect::<Vec<_>>(), "{via:?}: each once");
    }
}

#[test]
fn queue_groups_span_embedded_and_remote_members() {
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let first = connect(&endpoint);
        let second = connect(&endpoint);
        let publisher = connect(&endpoint);
        let members = [
            broker.queue_subscribe("work.>", "pool").unwrap(),
            broker.queue_subscribe("work.>", "pool").unwrap(),
            first.queue_subscribe("work.>", "pool").unwrap(),
            second.queue_subscribe("work.>", "pool").unwrap(),
        ];
        assert_eq!(members[2].queue_group(), Some("pool"));
        let watcher = second.subscribe("work.>").unwrap();
        first.flush(WAIT).unwrap();
        second.flush(WAIT).unwrap();

        let per_side = 40;
        for n in 0..per_side {
            broker
                .publish("work.local", Bytes::from(n.to_string()))
                .unwrap();
            publisher
                .publish("work.remote", Bytes::from(n.to_string()))
                .unwrap();
        }
        broker.flush(WAIT).unwrap();
        publisher.flush(WAIT).unwrap();
        first.flush(WAIT).unwrap();
        second.flush(WAIT).unwrap();

        let mut all = Vec::new();
        for (i, member) in members.iter().enumerate() {
            let got = drain(member);
            assert!(!got.is_empty(), "{via:?}: member {i} got no work");
            all.extend(got);
        }
        assert_eq!(
            all.len(),
            2 * per_side,
            "{via:?}: each message went to one member"
        );
        let distinct: BTreeSet<String> = all.into_iter().collect();
        assert_eq!(distinct.len(), 2 * per_side, "{via:?}: no duplicates");
        assert_eq!(drain(&watcher).len(), 2 * per_side, "{via:?}");
    }
}

/// Answer `count` requests on `sub` by doubling the number in the payload.
fn double_responder(
    sub: Subscription,
    count: usize,
    reply: impl Fn(&str, Bytes) + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for _ in 0..count {
            let request = sub.recv_timeout(WAIT).expect("a request");
            let n: i64 = std::str::from_utf8(&request.payload)
                .unwrap()
                .parse()
                .unwrap();
            reply(
                request.reply.as_deref().expect("a reply subject"),
                Bytes::from((2 * n).to_string()),
            );
        }
    })
}

#[test]
fn request_reply_across_the_link() {
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let broker = Arc::new(broker);
        let requester = connect(&endpoint);
        let responder_client = Arc::new(connect(&endpoint));

        // Remote requester, embedded responder.
        let local_service = broker.subscribe("svc.local").unwrap();
        let responder = {
            let broker = broker.clone();
            double_responder(local_service, 1, move |reply, answer| {
                broker.publish(reply, answer).unwrap()
            })
        };
        let answer = requester
            .request("svc.local", Bytes::from_static(b"21"), WAIT)
            .unwrap();
        assert_eq!(&answer.payload[..], b"42", "{via:?}");
        responder.join().unwrap();

        // Embedded and remote requesters, remote responder.
        let remote_service = responder_client.subscribe("svc.remote").unwrap();
        responder_client.flush(WAIT).unwrap();
        let responder = {
            let client = responder_client.clone();
            double_responder(remote_service, 2, move |reply, answer| {
                client.publish(reply, answer).unwrap()
            })
        };
        let answer = broker
            .request("svc.remote", Bytes::from_static(b"5"), WAIT)
            .unwrap();
        assert_eq!(&answer.payload[..], b"10", "{via:?}");
        let answer = requester
            .request("svc.remote", Bytes::from_static(b"-3"), WAIT)
            .unwrap();
        assert_eq!(&answer.payload[..], b"-6", "{via:?}");
        responder.join().unwrap();

        // Nobody is subscribed: the server says so at once.
        assert!(matches!(
            requester.request("svc.none", Bytes::new(), WAIT),
            Err(Error::NoResponders(subject)) if subject == "svc.none"
        ));
        // A responder that does not answer: the client times out.
        let silent = broker.subscribe("svc.silent").unwrap();
        let short = Duration::from_millis(100);
        assert!(matches!(
            requester.request("svc.silent", Bytes::new(), short),
            Err(Error::Timeout(after)) if after == short
        ));
        drop(silent);
    }
}

fn numbered(n: u32) -> Bytes {
    Bytes::copy_from_slice(&n.to_le_bytes())
}

fn number(message: &Message) -> u32 {
    u32::from_le_bytes(message.payload[..].try_into().expect("4-byte payload"))
}

/// Receive `count` numbered messages and check they come in order.
fn check_order(sub: &Subscription, count: u32, label: &str) {
    for expected in 0..count {
        let message = sub.recv_timeout(WAIT).expect(label);
        assert_eq!(number(&message), expected, "{label}: out of order");
    }
    assert_eq!(sub.stats().dropped(), 0, "{label}");
}

/// What the n-th message of [`a_mixed_stream_arrives_whole_and_in_order`]
/// is: its subject, reply subject and header block.
fn mixed(n: u32) -> (String, Option<String>, Option<Bytes>) {
    let subject = if n / 5 % 3 == 0 { "mix.a" } else { "mix.b" }.to_string();
    let reply = (n % 7 == 3).then(|| format!("inbox.{n}"));
    let headers = (n % 11 == 5).then(|| Bytes::from(format!("NATS/1.0\r\nSeq: {n}\r\n\r\n")));
    (subject, reply, headers)
}

/// Publishes the n-th message of [`mixed`].
fn publish_mixed(publisher: &Client, n: u32) {
    let (subject, reply, headers) = mixed(n);
    let published = match (headers, &reply) {
        (Some(block), _) => {
            publisher.publish_with_headers(&subject, reply.as_deref(), block, numbered(n))
        }
        (None, Some(reply)) => publisher.publish_request(&subject, reply, numbered(n)),
        (None, None) => publisher.publish(&subject, numbered(n)),
    };
    published.expect("published");
}

/// Checks that `message` is the `expected`-th of [`mixed`], whole.
fn check_mixed(message: &Message, expected: u32, label: &str) {
    let (subject, reply, headers) = mixed(expected);
    assert_eq!(number(message), expected, "{label}: out of order");
    assert_eq!(&*message.subject, subject, "{label}: message {expected}");
    assert_eq!(
        message.reply.as_deref(),
        reply.as_deref(),
        "{label}: message {expected}"
    );
    assert_eq!(message.headers, headers, "{label}: message {expected}");
}

/// Plain messages on one subject (no reply subject, no headers) are handed
/// to a subscription together, by a client's loop and by the broker's; a
/// stream that changes subject, carries replies and headers now and then,
/// and feeds two subscriptions of one client by turns must still reach
/// each whole and in order, read one by one or many at once.
#[test]
fn a_mixed_stream_arrives_whole_and_in_order() {
    let count = 6_000;
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let local = broker.subscribe("mix.>").unwrap();
        let publisher = connect(&endpoint);
        let subscriber = connect(&endpoint);
        let all = subscriber.subscribe("mix.>").unwrap();
        // Every third block of five also goes to this one, so the client
        // reads runs for `all` cut by messages for it.
        let only_a = subscriber.subscribe("mix.a").unwrap();
        subscriber.flush(WAIT).unwrap();
        for n in 0..count {
            publish_mixed(&publisher, n);
        }
        publisher.flush(WAIT).unwrap();
        let check = |message: &Message, expected: u32, label: &str| {
            check_mixed(message, expected, &format!("{via:?} {label}"));
        };
        for (sub, label) in [(&all, "mix.>"), (&local, "in-process mix.>")] {
            let mut batch = Vec::new();
            let mut next = 0;
            while next < count {
                batch.clear();
                sub.recv_many(&mut batch, 100, WAIT).expect(label);
                assert!(batch.len() <= 100, "{via:?}: more than asked for");
                for message in &batch {
                    check(message, next, label);
                    next += 1;
                }
            }
        }
        for expected in (0..count).filter(|&n| mixed(n).0 == "mix.a") {
            check(
                &only_a.recv_timeout(WAIT).expect("a message on mix.a"),
                expected,
                "mix.a",
            );
        }
        assert_eq!(
            all.try_recv(),
            Err(RecvError::Empty),
            "{via:?}: nothing more"
        );
        assert_eq!(
            only_a.try_recv(),
            Err(RecvError::Empty),
            "{via:?}: nothing more"
        );
        assert_eq!(
            local.try_recv(),
            Err(RecvError::Empty),
            "{via:?}: nothing more"
        );
    }
}

/// Subscription queues of 4 messages under `block`, with time to wait.
const TINY_BLOCKING_QUEUE: &str = "[limits]\nsubscription_queue = 4\n\
     [slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 20000\n";

/// The same stream into an in-process subscription whose queue holds 4
/// under `block`: the broker's loop holds what finds no room and queues it
/// as the reader makes room, plain runs and the rest alike, each message
/// whole and in order.
#[test]
fn a_mixed_stream_through_a_tiny_blocking_queue_arrives_whole_and_in_order() {
    let count = 3_000;
    let (broker, endpoint) = start(Via::Tcp, TINY_BLOCKING_QUEUE);
    let local = broker.subscribe("mix.>").unwrap();
    let publisher = connect(&endpoint);
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            for expected in 0..count {
                let message = local.recv_timeout(WAIT).expect("a mixed message");
                check_mixed(&message, expected, "a tiny queue");
            }
        });
        for n in 0..count {
            publish_mixed(&publisher, n);
        }
        publisher.flush(WAIT).unwrap();
        reader.join().unwrap();
    });
    assert_eq!(local.stats().dropped(), 0);
}

#[test]
fn each_publisher_is_received_in_order() {
    let count = 10_000;
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let publisher = connect(&endpoint);
        let subscriber = connect(&endpoint);
        let remote_sub = subscriber.subscribe("fifo.remote").unwrap();
        let remote_from_local = subscriber.subscribe("fifo.local").unwrap();
        let local_sub = broker.subscribe("fifo.remote").unwrap();
        subscriber.flush(WAIT).unwrap();

        for n in 0..count {
            publisher.publish("fifo.remote", numbered(n)).unwrap();
            broker.publish("fifo.local", numbered(n)).unwrap();
        }
        check_order(&local_sub, count, &format!("{via:?} remote to embedded"));
        check_order(&remote_sub, count, &format!("{via:?} remote to remote"));
        check_order(
            &remote_from_local,
            count,
            &format!("{via:?} embedded to remote"),
        );
    }
}

/// Messages a remote publisher sent together, on alternating subjects, to
/// two in-process subscriptions (one matching both subjects): each gets
/// its own in order, with each message's own subject, and each delivery
/// is counted once.
#[test]
fn interleaved_subjects_reach_each_in_process_subscription_in_order() {
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let both = broker.subscribe("mix.*").unwrap();
        let only_x = broker.subscribe("mix.x").unwrap();
        let publisher = connect(&endpoint);
        const COUNT: u32 = 2_000;
        for n in 0..COUNT {
            let subject = if n % 2 == 0 { "mix.x" } else { "mix.y" };
            publisher.publish(subject, numbered(n)).unwrap();
        }
        publisher.flush(WAIT).unwrap();
        for n in 0..COUNT {
            let message = both.recv_timeout(WAIT).expect("a message on mix.*");
            let subject = if n % 2 == 0 { "mix.x" } else { "mix.y" };
            assert_eq!(
                (&*message.subject, number(&message)),
                (subject, n),
                "{via:?}"
            );
        }
        for n in (0..COUNT).step_by(2) {
            let message = only_x.recv_timeout(WAIT).expect("a message on mix.x");
            assert_eq!(
                (&*message.subject, number(&message)),
                ("mix.x", n),
                "{via:?}"
            );
        }
        // Counted once each (just after they are queued).
        eventually("every delivery counted", || {
            broker.stats().value("messages_out") >= Some(u64::from(COUNT + COUNT / 2))
        });
        assert_eq!(
            broker.stats().value("messages_out"),
            Some(u64::from(COUNT + COUNT / 2)),
            "{via:?}"
        );
    }
}

/// A client's flush returns once the broker has handled what the client
/// sent before it: its messages to in-process subscriptions are queued.
#[test]
fn a_flush_returns_once_in_process_subscriptions_have_the_messages() {
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let sub = broker.subscribe("flushed").unwrap();
        let publisher = connect(&endpoint);
        for round in 0..20u32 {
            for n in 0..50 {
                publisher
                    .publish("flushed", numbered(round * 50 + n))
                    .unwrap();
            }
            publisher.flush(WAIT).unwrap();
            let got: Vec<u32> = std::iter::from_fn(|| sub.try_recv().ok())
                .map(|m| number(&m))
                .collect();
            assert_eq!(
                got,
                (round * 50..round * 50 + 50).collect::<Vec<_>>(),
                "{via:?}: round {round}"
            );
        }
    }
}

/// In-process publishes to remote subscribers, more than the loop hands
/// on in one round and in runs on alternating subjects: a flush returns
/// once every message published before it is handed on, and each
/// subscription receives its messages in order.
#[test]
fn a_flush_follows_every_in_process_publish_to_remote_subscribers() {
    let count = 10_000u32;
    let subject_of = |n: u32| {
        if (n / 100) % 2 == 0 {
            "runs.a"
        } else {
            "runs.b"
        }
    };
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let subscriber = connect(&endpoint);
        let subs = [
            subscriber.subscribe("runs.a").unwrap(),
            subscriber.subscribe("runs.b").unwrap(),
        ];
        subscriber.flush(WAIT).unwrap();
        let before = stat(&broker, "messages_out");
        for n in 0..count {
            broker.publish(subject_of(n), numbered(n)).unwrap();
        }
        broker.flush(WAIT).unwrap();
        assert_eq!(
            stat(&broker, "messages_out") - before,
            u64::from(count),
            "{via:?}: handed on before the flush returned"
        );
        for (sub, subject) in subs.iter().zip(["runs.a", "runs.b"]) {
            let expected: Vec<u32> = (0..count).filter(|&n| subject_of(n) == subject).collect();
            let got: Vec<u32> = expected
                .iter()
                .map(|_| number(&sub.recv_timeout(WAIT).expect("a published message")))
                .collect();
            assert_eq!(got, expected, "{via:?}: {subject}");
        }
    }
}

/// More in-process publishes to a remote subscriber than the queue to the
/// loop holds (65,536), without a flush: the loop makes room as it
/// delivers, so every one arrives and none fails for lack of room. Both
/// sides hold publishers back rather than drop.
#[test]
fn more_in_process_publishes_than_the_loops_queue_holds_all_arrive() {
    let count = 150_000u32;
    let lossless = "[slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 20000";
    let (broker, endpoint) = start(Via::Tcp, lossless);
    let subscriber = Client::connect_with(
        &endpoint,
        ClientOptions {
            slow_consumer: SlowConsumerPolicy::Block,
            block_timeout: WAIT,
            ..options()
        },
        Registry::with_builtins(),
    )
    .expect("client connects");
    let sub = subscriber.subscribe("many").unwrap();
    subscriber.flush(WAIT).unwrap();
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| check_order(&sub, count, "past the queue's bound"));
        for n in 0..count {
            broker.publish("many", numbered(n)).unwrap();
        }
        reader.join().unwrap();
    });
}

/// A responder that publishes an event and then replies: the requester
/// finds the event queued when its request returns, though the two
/// arrive together and the reply goes to the waiting request at once.
#[test]
fn what_came_before_a_reply_is_queued_when_the_request_returns() {
    for via in BOTH {
        let (_broker, endpoint) = start(via, "");
        let requester = connect(&endpoint);
        let responder = connect(&endpoint);
        let events = requester.subscribe("orders.>").unwrap();
        let requests = responder.subscribe("svc.orders").unwrap();
        requester.flush(WAIT).unwrap();
        responder.flush(WAIT).unwrap();
        let rounds = 50;
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for _ in 0..rounds {
                    let request = requests.recv_timeout(WAIT).expect("a request");
                    let reply = request.reply.expect("a reply subject");
                    responder
                        .publish("orders.created", request.payload.clone())
                        .unwrap();
                    responder.publish(&reply, request.payload).unwrap();
                }
            });
            for n in 0..rounds {
                let reply = requester
                    .request("svc.orders", numbered(n), WAIT)
                    .expect("a reply");
                assert_eq!(number(&reply), n);
                let event = events.try_recv().unwrap_or_else(|err| {
                    panic!("{via:?}: round {n}: the event before the reply: {err:?}")
                });
                assert_eq!(number(&event), n, "{via:?}");
            }
        });
    }
}

#[test]
fn large_payloads_cross_intact() {
    let size = 512 * 1024;
    let payload: Bytes = (0..size)
        .map(|i| (i % 251) as u8)
        .collect::<Vec<u8>>()
        .into();
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let publisher = connect(&endpoint);
        let subscriber = connect(&endpoint);
        let remote = subscriber.subscribe("big.>").unwrap();
        let local = broker.subscribe("big.>").unwrap();
        subscriber.flush(WAIT).unwrap();

        for _ in 0..4 {
            publisher.publish("big.remote", payload.clone()).unwrap();
        }
        broker.publish("big.local", payload.clone()).unwrap();
        for sub in [&remote, &local] {
            let mut subjects = Vec::new();
            for _ in 0..5 {
                let message = sub.recv_timeout(WAIT).expect("large message");
                assert_eq!(message.payload.len(), size, "{via:?}");
                assert!(message.payload == payload, "{via:?}: payload corrupted");
                subjects.push(message.subject.to_string());
            }
            subjects.sort();
            assert_eq!(
                subjects,
                [
                    "big.local",
                    "big.remote",
                    "big.remote",
                    "big.remote",
                    "big.remote"
                ]
            );
        }
    }
}

#[test]
fn client_learns_the_payload_limit_from_the_server() {
    let (_broker, endpoint) = start(Via::Tcp, "[limits]\nmax_payload = 65536\n");
    let client = connect(&endpoint);
    let sub = client.subscribe("p").unwrap();
    client.publish("p", vec![1u8; 65536]).unwrap();
    match client.publish("p", vec![1u8; 65537]) {
        Err(Error::PayloadTooLarge { len, max }) => assert_eq!((len, max), (65537, 65536)),
        other => panic!("expected PayloadTooLarge, got {other:?}"),
    }
    assert_eq!(sub.recv_timeout(WAIT).unwrap().payload.len(), 65536);
    client.flush(WAIT).unwrap();
    assert_eq!(sub.try_recv(), Err(RecvError::Empty));
}

#[test]
fn client_rejects_invalid_subjects_locally() {
    let (_broker, endpoint) = start(Via::Mem, "");
    let client = connect(&endpoint);
    assert!(matches!(
        client.publish("a.*", Bytes::new()),
        Err(Error::Subject { .. })
    ));
    assert!(matches!(
        client.subscribe("a.>.b"),
        Err(Error::Subject { .. })
    ));
    assert!(matches!(
        client.queue_subscribe("a", ""),
        Err(Error::Subscription { .. })
    ));
}

#[test]
fn client_reconnects_and_resubscribes_after_a_broker_restart() {
    let (first, endpoint) = start(Via::Tcp, "");
    let address = endpoint.trim_start_matches("tcp/").to_string();
    let client = Client::connect_with(
        &endpoint,
        ClientOptions {
            connect_timeout: WAIT,
            max_backoff: Duration::from_millis(100),
            ..ClientOptions::default()
        },
        Registry::with_builtins(),
    )
    .unwrap();
    let sub = client.subscribe("news.>").unwrap();
    client.flush(WAIT).unwrap();
    first
        .publish("news.a", Bytes::from_static(b"before"))
        .unwrap();
    assert_eq!(recv(&sub), "news.a:before");

    first.shutdown();
    drop(first);
    eventually("the client to notice the lost connection", || {
        !matches!(client.state(), ConnectionState::Connected { .. })
    });
    // Buffered while disconnected; sent after the subscriptions on reconnect.
    client
        .publish("news.b", Bytes::from_static(b"buffered"))
        .unwrap();

    // A new broker on the very same port.
    let config = Config::from_toml_str(
        &format!("name = \"second\"\nlisten = [\"tcp/{address}\"]\n"),
        "restart",
    )
    .unwrap();
    let second = Broker::start(config).expect("restart on the same port");
    eventually("the client to reconnect", || client.reconnects() >= 1);
    assert_eq!(client.reconnects(), 1);
    client.flush(WAIT).unwrap();
    assert_eq!(
        client.state(),
        ConnectionState::Connected {
            server: "second".into()
        }
    );
    assert_eq!(second.subscription_count(), 1, "resubscribed");
    second
        .publish("news.c", Bytes::from_static(b"after"))
        .unwrap();
    assert_eq!(recv(&sub), "news.b:buffered");
    assert_eq!(recv(&sub), "news.c:after");
}

/// A client the server refuses when it reconnects (the broker came back
/// with another secret) stops for good: its subscriptions end, and a new
/// subscribe or a flush fails at once instead of waiting on a stopped loop.
#[test]
fn a_client_refused_on_reconnect_fails_what_is_asked_of_it() {
    let (first, endpoint) = start(Via::Tcp, "[auth]\nsecret = \"old\"\n");
    let address = endpoint.trim_start_matches("tcp/").to_string();
    let client = Client::connect_with(
        &endpoint,
        ClientOptions {
            credentials: Some("old".into()),
            connect_timeout: WAIT,
            max_backoff: Duration::from_millis(100),
            ..ClientOptions::default()
        },
        Registry::with_builtins(),
    )
    .unwrap();
    let sub = client.subscribe("news").unwrap();
    client.flush(WAIT).unwrap();
    first.shutdown();
    drop(first);
    let config = Config::from_toml_str(
        &format!("listen = [\"tcp/{address}\"]\n[auth]\nsecret = \"new\"\n"),
        "rotated secret",
    )
    .unwrap();
    let _second = Broker::start(config).expect("restart on the same port");
    eventually("the refusal", || {
        matches!(client.state(), ConnectionState::Refused { .. })
    });
    assert_eq!(
        sub.recv_timeout(WAIT).map(|m| m.payload),
        Err(RecvError::Closed)
    );
    let started = Instant::now();
    assert!(matches!(client.subscribe("later"), Err(Error::Closed)));
    assert!(matches!(client.flush(WAIT), Err(Error::Closed)));
    assert!(started.elapsed() < WAIT / 2, "{:?}", started.elapsed());
}

#[test]
fn wrong_or_missing_credentials_are_refused() {
    for via in BOTH {
        let (broker, endpoint) = start(via, "[auth]\nsecret = \"open-sesame\"\n");
        let with = |credentials: Option<&str>| {
            Client::connect_with(
                &endpoint,
                ClientOptions {
                    credentials: credentials.map(str::to_string),
                    ..options()
                },
                Registry::with_builtins(),
            )
        };
        for credentials in [Some("wrong"), None] {
            match with(credentials) {
                Err(Error::Refused { code, .. }) => assert_eq!(code, ErrorCode::Auth, "{via:?}"),
                other => panic!("{via:?}: expected Refused, got {other:?}"),
            }
        }
        assert_eq!(broker.stats().auth_failures.load(Ordering::Relaxed), 2);
        let client = with(Some("open-sesame")).expect("right secret connects");
        let sub = client.subscribe("ok").unwrap();
        client.publish("ok", Bytes::from_static(b"in")).unwrap();
        assert_eq!(recv(&sub), "ok:in");
    }
}

#[test]
fn connecting_to_nothing_fails_within_the_connect_timeout() {
    // A port that was free a moment ago and has no listener now.
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = probe.local_addr().unwrap().port();
    drop(probe);
    let connect_timeout = Duration::from_millis(300);
    for endpoint in [
        format!("tcp/127.0.0.1:{port}"),
        format!("mem/nobody-listens-{}", std::process::id()),
    ] {
        let started = Instant::now();
        let result = Client::connect_with(
            &endpoint,
            ClientOptions {
                connect_timeout,
                ..ClientOptions::default()
            },
            Registry::with_builtins(),
        );
        let elapsed = started.elapsed();
        match result {
            Err(Error::NotConnected(server)) => assert_eq!(server, endpoint),
            other => panic!("{endpoint}: expected NotConnected, got {other:?}"),
        }
        assert!(elapsed >= connect_timeout, "{endpoint}: gave up early");
        // Generous: the point is that connect does not hang.
        assert!(
            elapsed < connect_timeout + Duration::from_secs(5),
            "{endpoint}: took {elapsed:?}"
        );
    }
}

#[test]
fn bad_endpoint_strings_are_endpoint_errors() {
    for endpoint in ["", "tcp://127.0.0.1:1", "nosuch/x"] {
        assert!(
            matches!(Client::connect(endpoint), Err(Error::Endpoint { .. })),
            "{endpoint:?}"
        );
    }
}

#[test]
fn operations_after_client_shutdown_fail_closed() {
    let (_broker, endpoint) = start(Via::Mem, "");
    let client = connect(&endpoint);
    let sub = client.subscribe("x").unwrap();
    client.shutdown();
    assert_eq!(sub.recv_timeout(WAIT), Err(RecvError::Closed));
    assert!(matches!(
        client.publish("x", Bytes::new()),
        Err(Error::Closed)
    ));
    assert!(matches!(client.flush(WAIT), Err(Error::Closed)));
}

#[test]
fn broker_shutdown_says_goodbye_to_clients() {
    let (broker, endpoint) = start(Via::Tcp, "");
    let client = Client::connect_with(
        &endpoint,
        ClientOptions {
            reconnect: false,
            ..options()
        },
        Registry::with_builtins(),
    )
    .unwrap();
    let sub = client.subscribe("last").unwrap();
    client.flush(WAIT).unwrap();
    broker
        .publish("last", Bytes::from_static(b"words"))
        .unwrap();
    broker.shutdown();
    // The message queued before the shutdown is delivered first.
    assert_eq!(recv(&sub), "last:words");
    eventually("the client to see the connection closed", || {
        client.state() == ConnectionState::Closed
    });
    let why = client.closed_because().unwrap_or_default();
    assert_eq!(why, "the server said goodbye: server shutting down");
}

#[test]
fn client_disconnect_policy_ends_the_subscription() {
    let (broker, endpoint) = start(Via::Mem, "");
    let client = Client::connect_with(
        &endpoint,
        ClientOptions {
            subscription_queue: 2,
            slow_consumer: efabus_broker::SlowConsumerPolicy::Disconnect,
            ..options()
        },
        Registry::with_builtins(),
    )
    .unwrap();
    let slow = client.subscribe("tick").unwrap();
    client.flush(WAIT).unwrap();
    for n in 0..3u32 {
        broker.publish("tick", numbered(n)).unwrap();
    }
    broker.flush(WAIT).unwrap();
    client.flush(WAIT).unwrap();
    assert_eq!(slow.stats().dropped(), 1);
    assert_eq!(slow.recv_timeout(WAIT).map(|m| number(&m)), Ok(0));
    assert_eq!(slow.recv_timeout(WAIT).map(|m| number(&m)), Ok(1));
    assert_eq!(slow.recv_timeout(WAIT), Err(RecvError::Closed));
    // The broker is told, so it stops sending.
    client.flush(WAIT).unwrap();
    assert_eq!(broker.subscription_count(), 0);
}

#[test]
fn options_the_wire_cannot_carry_are_refused_at_connect() {
    let (_broker, endpoint) = start(Via::Mem, "");
    let refused = |options: ClientOptions, key: &str| match Client::connect_with(
        &endpoint,
        options,
        Registry::with_builtins(),
    ) {
        Err(err @ efabus_broker::Error::Config(_)) => {
            assert!(err.to_string().contains(key), "{err}")
        }
        Err(err) => panic!("{key}: unexpected error {err}"),
        Ok(_) => panic!("{key}: a client with it connected"),
    };
    refused(
        ClientOptions {
            name: "n".repeat(70_000),
            ..options()
        },
        "name",
    );
    let mut subject_limits = options().subject_limits;
    subject_limits.max_len = 200_000;
    refused(
        ClientOptions {
            subject_limits,
            ..options()
        },
        "subject_limits.max_len",
    );
    refused(
        ClientOptions {
            credentials: Some("s".repeat(70_000)),
            ..options()
        },
        "credentials",
    );
}

/// A client whose subscriptions hold `queue` messages each and then wait
/// for the application (its own policy is `block`, so it discards
/// nothing itself): a subscriber the application does not read stops
/// reading its socket, and the broker's queue for it fills.
fn stalling_client(endpoint: &str, queue: usize) -> Client {
    connect_as(
        endpoint,
        ClientOptions {
            subscription_queue: queue,
            slow_consumer: efabus_broker::SlowConsumerPolicy::Block,
            block_timeout: Duration::from_secs(60),
            reconnect: false,
            ..options()
        },
    )
}

/// A subscription dropped while its client waits for room in it (the
/// client's `block` policy) ends at once: the waiting message is refused,
/// not held until `block_timeout` (60 s here) runs out, and the client
/// carries on with its other subscriptions.
#[test]
fn dropping_a_full_blocking_subscription_does_not_wait_for_the_timeout() {
    let (broker, endpoint) = start(Via::Tcp, "");
    let subscriber = stalling_client(&endpoint, 4);
    let full = subscriber.subscribe("full.>").unwrap();
    let other = subscriber.subscribe("other").unwrap();
    subscriber.flush(WAIT).unwrap();
    for n in 0..20u32 {
        broker
            .publish("full.data", Bytes::from(n.to_le_bytes().to_vec()))
            .unwrap();
    }
    // The queue holds 4; the client's reader now waits for room.
    let deadline = Instant::now() + WAIT;
    while full.pending() < 4 {
        assert!(Instant::now() < deadline, "the subscription never filled");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(full);
        let _ = done_tx.send(());
    });
    done_rx
        .recv_timeout(WAIT)
        .expect("the drop returns while the client's block_timeout (60 s) is still running");
    broker
        .publish("other", Bytes::from_static(b"after"))
        .unwrap();
    assert_eq!(recv(&other), "other:after");
}

/// `total` numbered messages of 4 KiB on `subject`, from a client of the
/// broker; returns once the broker has routed them all.
fn publish_numbered_4k(endpoint: &str, subject: &str, total: u32) {
    let publisher = connect(endpoint);
    let filler = vec![0u8; 4092];
    for n in 0..total {
        let mut payload = n.to_le_bytes().to_vec();
        payload.extend_from_slice(&filler);
        publisher.publish(subject, Bytes::from(payload)).unwrap();
    }
    publisher.flush(WAIT).unwrap();
}

fn stat(broker: &Broker, name: &str) -> u64 {
    broker
        .stats()
        .value(name)
        .unwrap_or_else(|| panic!("no stat {name}"))
}

/// Under `drop-oldest`, the broker tells a remote subscriber, per
/// subscription, how many messages it discarded for it: once the
/// subscriber reads again, what it received and what its stats count as
/// dropped add up to what was published to it.
#[test]
fn a_stalled_remote_subscriber_learns_what_the_broker_dropped_for_it() {
    const TOTAL: u32 = 4000;
    // The stalled client answers no pings: keep it alive.
    let (broker, endpoint) = start(
        Via::Tcp,
        "[limits]\nmax_pending_bytes = 262144\n[slow_consumer]\npolicy = \"drop-oldest\"\n\
         [heartbeat]\ninterval_ms = 1000\ntimeout_ms = 60000\n",
    );
    let subscriber = stalling_client(&endpoint, 16);
    // Two subscriptions get every message: the broker's runs of
    // deliveries interleave them, and each is told its own drops.
    let subs = [
        subscriber.subscribe("slow.data").unwrap(),
        subscriber.subscribe("slow.>").unwrap(),
    ];
    let idle = subscriber.subscribe("elsewhere").unwrap();
    subscriber.flush(WAIT).unwrap();

    publish_numbered_4k(&endpoint, "slow.data", TOTAL);
    let discarded = stat(&broker, "slow_consumer_drops");
    assert!(
        discarded > 0,
        "16 MB into a stalled reader: the broker drops"
    );

    // The application reads again.
    let mut received = [0u64; 2];
    let mut last = [None::<u32>; 2];
    let deadline = Instant::now() + 3 * WAIT;
    let settled = |received: &[u64; 2]| {
        (0..2).all(|i| received[i] + subs[i].stats().dropped() == u64::from(TOTAL))
    };
    while !settled(&received) {
        let mut took = false;
        for (i, sub) in subs.iter().enumerate() {
            while let Ok(message) = sub.try_recv() {
                let n = u32::from_le_bytes(message.payload[..4].try_into().unwrap());
                assert!(last[i] < Some(n), "sub {i}: {n} after {:?}", last[i]);
                last[i] = Some(n);
                received[i] += 1;
                took = true;
            }
        }
        assert!(
            Instant::now() < deadline,
            "received {received:?}, dropped {:?} of {TOTAL} each",
            subs.iter().map(|s| s.stats().dropped()).collect::<Vec<_>>()
        );
        if !took {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // Nothing more arrives, and nothing is counted twice.
    std::thread::sleep(Duration::from_millis(300));
    for (i, sub) in subs.iter().enumerate() {
        assert_eq!(sub.try_recv().map(|m| m.payload), Err(RecvError::Empty));
        let stats = sub.stats();
        assert_eq!(stats.delivered(), received[i], "sub {i}");
        assert_eq!(received[i] + stats.dropped(), u64::from(TOTAL), "sub {i}");
        assert!(stats.dropped() > 0, "sub {i}: the broker dropped for it");
        assert_eq!(
            stats.dropped(),
            stats.dropped_by_broker(),
            "sub {i}: its own queue discarded nothing"
        );
        assert_eq!(last[i], Some(TOTAL - 1), "sub {i}: the newest is kept");
    }
    assert_eq!(idle.stats().dropped(), 0);
    assert_eq!(
        subs[0].stats().dropped() + subs[1].stats().dropped(),
        stat(&broker, "slow_consumer_drops"),
        "every drop the broker counted was reported to its subscription"
    );
    assert_eq!(stat(&broker, "connection_drops"), 0);
}

/// What the broker had queued for a subscriber it cuts off is counted
/// (`connection_drops`): the subscriber cannot be told any more.
#[test]
fn what_a_cut_off_subscriber_had_queued_is_counted() {
    let (broker, endpoint) = start(
        Via::Tcp,
        "[limits]\nmax_pending_bytes = 262144\n[slow_consumer]\npolicy = \"disconnect\"\n\
         [heartbeat]\ninterval_ms = 1000\ntimeout_ms = 60000\n",
    );
    let subscriber = stalling_client(&endpoint, 16);
    let sub = subscriber.subscribe("slow.data").unwrap();
    subscriber.flush(WAIT).unwrap();
    publish_numbered_4k(&endpoint, "slow.data", 4000);
    eventually("the cut-off", || {
        stat(&broker, "slow_consumer_disconnects") == 1
    });
    assert!(stat(&broker, "connection_drops") > 0);
    assert_eq!(stat(&broker, "slow_consumer_drops"), 0);
    // Read what reached the client, so its loop is not left waiting for
    // room when everything is dropped.
    while sub.recv_timeout(Duration::from_millis(300)).is_ok() {}
}

/// A broker started with `drop-oldest` and reloaded to `disconnect` with
/// a lower pending bound cuts a stalled subscriber off rather than
/// dropping for it: the event loop applies the reloaded policy and bound.
#[test]
fn a_reloaded_policy_and_pending_bound_apply_to_a_running_broker() {
    let (broker, endpoint) = start(
        Via::Tcp,
        "[slow_consumer]\npolicy = \"drop-oldest\"\n\
         [heartbeat]\ninterval_ms = 1000\ntimeout_ms = 60000\n",
    );
    let mut config = broker.running_config();
    config.limits.max_pending_bytes = 262_144;
    config.slow_consumer.policy = efabus_broker::SlowConsumerPolicy::Disconnect;
    let reloaded = broker.reload(&config).expect("reload");
    assert_eq!(
        reloaded.applied,
        ["limits.max_pending_bytes", "slow_consumer.policy"]
    );
    let subscriber = stalling_client(&endpoint, 16);
    let sub = subscriber.subscribe("slow.data").unwrap();
    subscriber.flush(WAIT).unwrap();
    publish_numbered_4k(&endpoint, "slow.data", 4000);
    eventually("the cut-off", || {
        stat(&broker, "slow_consumer_disconnects") == 1
    });
    assert_eq!(stat(&broker, "slow_consumer_drops"), 0);
    while sub.recv_timeout(Duration::from_millis(300)).is_ok() {}
}

/// A reload the event loop cannot take (here: the broker is stopping)
/// fails and changes nothing: the running limits stay.
#[test]
fn a_reload_the_loop_cannot_take_changes_nothing() {
    let (broker, _endpoint) = start(Via::Tcp, "");
    let before = broker.running_config();
    let mut config = before.clone();
    config.limits.max_pending_bytes = 262_144;
    config.slow_consumer.policy = efabus_broker::SlowConsumerPolicy::Disconnect;
    broker.shutdown();
    let err = broker
        .reload(&config)
        .expect_err("a stopping broker takes no reload");
    let after = broker.running_config();
    assert_eq!(
        after.limits.max_pending_bytes,
        before.limits.max_pending_bytes
    );
    assert_eq!(after.slow_consumer.policy, before.slow_consumer.policy);
    assert!(err.to_string().contains("the running limits stay"), "{err}");
}

/// Subjects are checked against the server's limits from its welcome,
/// not the client's defaults (512 bytes, 32 tokens).
#[test]
fn subject_limits_come_from_the_server() {
    for via in BOTH {
        let (_broker, endpoint) = start(
            via,
            "[limits]\nmax_subject_len = 2000\nmax_subject_tokens = 8\n",
        );
        let client = connect(&endpoint);
        let long = format!("long.{}", "s".repeat(600));
        let sub = client
            .subscribe(&long)
            .expect("a 606-byte pattern is within 2000");
        client.flush(WAIT).unwrap();
        client
            .publish(&long, Bytes::from_static(b"x"))
            .expect("a 606-byte subject is within 2000");
        let message = sub.recv_timeout(WAIT).expect("delivered");
        assert_eq!(message.subject.len(), long.len(), "{via:?}");

        let too_long = format!("long.{}", "s".repeat(2000));
        assert!(
            matches!(
                client.publish(&too_long, Bytes::new()),
                Err(Error::Subject { .. })
            ),
            "{via:?}: over the server's 2000"
        );
        let too_deep = "a.b.c.d.e.f.g.h.i";
        assert!(
            matches!(
                client.publish(too_deep, Bytes::new()),
                Err(Error::Subject { .. })
            ),
            "{via:?}: nine tokens, over the server's 8"
        );
        assert!(matches!(
            client.subscribe(too_deep),
            Err(Error::Subject { .. })
        ));
    }
}

/// A client that does not reconnect gives up on its first attempt, and
/// says why: refused at once, or a server that never answers the
/// handshake after the connect timeout.
#[test]
fn a_client_without_reconnection_says_why_it_could_not_connect() {
    // Why a client giving up after `connect_timeout` could not connect.
    let failure = |address: std::net::SocketAddr, connect_timeout| {
        let options = ClientOptions {
            connect_timeout,
            reconnect: false,
            ..ClientOptions::default()
        };
        match Client::connect_with(
            &format!("tcp/{address}"),
            options,
            Registry::with_builtins(),
        ) {
            Err(Error::Unreachable { reason, .. }) => reason,
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("{address} is no broker"),
        }
    };
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = silent.local_addr().unwrap();
    let accepted = std::thread::spawn(move || silent.accept().map(|(stream, _)| stream));
    let started = Instant::now();
    let reason = failure(address, Duration::from_millis(300));
    assert!(reason.contains("no welcome"), "{reason}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    drop(accepted.join());

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = closed.local_addr().unwrap();
    drop(closed);
    let started = Instant::now();
    // Refused: at once, not after the connect timeout.
    let reason = failure(address, WAIT);
    assert!(reason.to_lowercase().contains("refused"), "{reason}");
    assert!(started.elapsed() < WAIT / 4, "{:?}", started.elapsed());
}

#[test]
fn headers_travel_with_their_message_between_clients_and_embedded_subscribers() {
    use efabus_core::headers::Headers;
    for via in BOTH {
        let (broker, endpoint) = start(via, "");
        let publisher = connect(&endpoint);
        let subscriber = connect(&endpoint);
        let remote = subscriber.subscribe("h.>").expect("subscribes");
        let local = broker.subscribe("h.>").expect("subscribes");
        subscriber.flush(WAIT).expect("subscription registered");
        let mut headers = Headers::new();
        headers.insert("Trace-Id", "t-1");
        let block = headers.to_block();
        publisher
            .publish_with_headers("h.one", Some("r.1"), block.clone(), "body")
            .expect("publishes");
        publisher.publish("h.two", "plain").expect("publishes");
        // Order holds per publisher: the broker's own publish goes after.
        publisher.flush(WAIT).expect("flushed");
        broker
            .publish_with_headers("h.three", None, block.clone(), Bytes::new())
            .expect("publishes");
        let mut seen = Vec::new();
        for sub in [&remote, &local] {
            for _ in 0..3 {
                let message = sub.recv_timeout(WAIT).expect("message within the wait");
                seen.push((
                    message.subject.to_string(),
                    message.reply.as_deref().map(str::to_string),
                    message.headers.clone(),
                    message.payload.clone(),
                ));
            }
        }
        let expected = [
            ("h.one", Some("r.1"), Some(&block), "body"),
            ("h.two", None, None, "plain"),
            ("h.three", None, Some(&block), ""),
        ];
        for (got, want) in seen.chunks(3).flat_map(|c| c.iter().zip(expected.iter())) {
            assert_eq!(got.0, want.0, "{via:?}");
            assert_eq!(got.1.as_deref(), want.1, "{via:?}");
            assert_eq!(got.2.as_ref(), want.2, "{via:?} headers of {}", want.0);
            assert_eq!(&got.3[..], want.3.as_bytes(), "{via:?}");
        }
        let parsed = Headers::parse(seen[0].2.as_ref().expect("headers")).expect("parses");
        assert_eq!(parsed.get("Trace-Id"), Some("t-1"));
        // Bytes that are not a header block are refused before sending.
        for not_headers in [&b""[..], b"HTTP/1.1 200\r\n\r\n", b"NATS/1.0\r\n"] {
            let refused = publisher.publish_with_headers("h.bad", None, not_headers, "x");
            assert!(matches!(refused, Err(Error::Headers(_))), "{refused:?}");
            let refused = broker.publish_with_headers("h.bad", None, not_headers, "x");
            assert!(matches!(refused, Err(Error::Headers(_))), "{refused:?}");
        }
    }
}

#[test]
fn a_request_nobody_answers_fails_at_once_and_echo_can_be_turned_off() {
    for via in BOTH {
        let (_broker, endpoint) = start(via, "");
        let client = connect(&endpoint);
        // Well within the wait: the server answers for the missing responder.
        let started = Instant::now();
        match client.request("nobody.home", "x", WAIT) {
            Err(Error::NoResponders(subject)) => assert_eq!(subject, "nobody.home"),
            other => panic!("{via:?}: expected no responders, got {other:?}"),
        }
        assert!(started.elapsed() < WAIT, "{via:?}: answered, not timed out");

        let quiet = Client::connect_with(
            &endpoint,
            ClientOptions {
                echo: false,
                ..options()
            },
            Registry::with_builtins(),
        )
        .expect("connects");
        let own = quiet.subscribe("echo.>").expect("subscribes");
        let other = client.subscribe("echo.>").expect("subscribes");
        client.flush(WAIT).expect("flushed");
        quiet.flush(WAIT).expect("flushed");
        quiet.publish("echo.one", "from quiet").expect("publishes");
        // Order holds per publisher: the other one goes after.
        quiet.flush(WAIT).expect("flushed");
        client
            .publish("echo.two", "from client")
            .expect("publishes");
        client.flush(WAIT).expect("flushed");
        assert_eq!(recv(&other), "echo.one:from quiet", "{via:?}");
        assert_eq!(recv(&other), "echo.two:from client", "{via:?}");
        assert_eq!(recv(&own), "echo.two:from client", "{via:?}: not its own");
        quiet.flush(WAIT).expect("flushed");
        assert_eq!(
            own.try_recv().map(|m| text(&m)),
            Err(RecvError::Empty),
            "{via:?}"
        );
    }
}

/// The health check (`Broker::responsive`) answers at the loop's next
/// round while the broker runs, and says `Closed` once it has stopped.
#[test]
fn the_broker_answers_its_health_check_until_it_stops() {
    let (broker, endpoint) = start(Via::Tcp, "");
    let client = connect(&endpoint);
    let _sub = client.subscribe("busy").unwrap();
    client.flush(WAIT).unwrap();
    broker.responsive(WAIT).expect("the loop answers");
    broker.shutdown();
    assert!(matches!(broker.responsive(WAIT), Err(Error::Closed)));
}

/// `Duration::MAX` for every wait of a client means "never": no deadline
/// overflows.
#[test]
fn a_client_whose_waits_are_endless_works() {
    let (broker, endpoint) = start(Via::Tcp, "");
    let client = Client::connect_with(
        &endpoint,
        ClientOptions {
            connect_timeout: Duration::MAX,
            max_backoff: Duration::MAX,
            block_timeout: Duration::MAX,
            heartbeat_interval: Duration::MAX,
            heartbeat_timeout: Duration::MAX,
            silent_link_retry: Duration::MAX,
            ..ClientOptions::default()
        },
        Registry::with_builtins(),
    )
    .expect("connects");
    let sub = client.subscribe("endless").unwrap();
    client.flush(WAIT).unwrap();
    broker.publish("endless", Bytes::from_static(b"x")).unwrap();
    assert_eq!(recv(&sub), "endless:x");
    client.publish("endless", Bytes::from_static(b"y")).unwrap();
    assert_eq!(recv(&sub), "endless:y");
    let _ = client.request("nobody.home", Bytes::new(), Duration::from_millis(50));
    drop(client);
}

/// Under the client's `block` policy the loop waits for a reader whose
/// queue is full, without holding the subscription table: that reader may
/// subscribe meanwhile (here at once, not after the block timeout), then
/// read on, and nothing is lost.
#[test]
fn a_blocked_delivery_leaves_the_reader_free_to_subscribe() {
    let (broker, endpoint) = start(Via::Tcp, "");
    let client = stalling_client(&endpoint, 1);
    let full = client.subscribe("full").unwrap();
    client.flush(WAIT).unwrap();
    for n in 0..3 {
        broker.publish("full", Bytes::from(n.to_string())).unwrap();
    }
    // The first fills the queue; the loop then waits with the second.
    eventually("the queue full", || full.pending() == 1);
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let other = client.subscribe("other").unwrap();
    assert!(
        started.elapsed() < WAIT / 2,
        "subscribe waited {:?} for the blocked delivery",
        started.elapsed()
    );
    assert_eq!(
        (0..3).map(|_| recv(&full)).collect::<Vec<_>>(),
        ["full:0", "full:1", "full:2"]
    );
    client.flush(WAIT).unwrap();
    broker.publish("other", Bytes::from_static(b"x")).unwrap();
    assert_eq!(recv(&other), "other:x");
}

/// An in-process subscription whose queue is full under the block policy
/// holds up remote publishers, as a remote slow consumer does, but not the
/// broker's loop: it runs (the health check answers) while the reader
/// takes nothing, and once it reads, every message arrives, in order.
#[test]
fn a_full_in_process_subscription_holds_up_publishers_not_the_loop() {
    let (broker, endpoint) = start(Via::Tcp, TINY_BLOCKING_QUEUE);
    let sub = broker.subscribe("held").unwrap();
    let publisher = connect(&endpoint);
    for n in 0..20 {
        publisher.publish("held", numbered(n)).unwrap();
    }
    eventually("a message past the full queue", || {
        broker.stats().value("messages_in") >= Some(5)
    });
    broker
        .responsive(Duration::from_secs(1))
        .expect("the loop runs while the reader takes nothing");
    check_order(&sub, 20, "held");
    assert_eq!(sub.stats().dropped(), 0);
    publisher.flush(WAIT).unwrap();
}

/// While publishers are held back (here: for a full in-process
/// subscription whose reader is slow, under the block policy), the broker
/// reads none of its clients, so their answers to its pings wait unread.
/// That silence is the broker's own doing: no client is taken for dead
/// for it, however long the hold lasts beyond the heartbeat timeout, and
/// no handshake times out for it.
#[test]
fn clients_held_back_are_not_taken_for_dead() {
    let (broker, endpoint) = start(
        Via::Tcp,
        "[limits]\nsubscription_queue = 4\nhandshake_timeout_ms = 300\n\
         [slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 20000\n\
         [heartbeat]\ninterval_ms = 50\ntimeout_ms = 300\n",
    );
    let sub = broker.subscribe("held").unwrap();
    let bystander = connect(&endpoint);
    bystander.flush(WAIT).unwrap();
    let publisher = connect(&endpoint);
    const COUNT: u32 = 100;
    for n in 0..COUNT {
        publisher.publish("held", numbered(n)).unwrap();
    }
    // 10 ms a message: the hold lasts about a second, three heartbeat
    // timeouts and three handshake timeouts. A client connecting in it
    // has its hello read once the hold ends.
    let mut late = None;
    for expected in 0..COUNT {
        let message = sub.recv_timeout(WAIT).expect("a held message");
        assert_eq!(number(&message), expected);
        if expected == 10 {
            let endpoint = endpoint.clone();
            late = Some(std::thread::spawn(move || connect(&endpoint)));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let late = late.expect("started").join().expect("connected");
    publisher.flush(WAIT).unwrap();
    bystander.flush(WAIT).unwrap();
    late.flush(WAIT).unwrap();
    assert_eq!(
        (
            publisher.reconnects(),
            bystander.reconnects(),
            late.reconnects()
        ),
        (0, 0, 0)
    );
    assert_eq!(broker.stats().value("connections_total"), Some(3));
}

/// A remote and an in-process publisher into one full in-process
/// subscription under the block policy, its reader slow for longer than
/// the block timeout: every message arrives, the remote one's in order
/// (the loop holds them while in-process publishers wait behind them).
#[test]
fn a_full_subscription_shared_by_remote_and_in_process_publishers_loses_nothing() {
    let (broker, endpoint) = start(
        Via::Tcp,
        "[limits]\nsubscription_queue = 4\n\
         [slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 1000\n",
    );
    let broker = Arc::new(broker);
    let sub = broker.subscribe("shared").unwrap();
    const LOCAL: u32 = 400;
    const REMOTE: u32 = 20;
    let local = std::thread::spawn({
        let broker = Arc::clone(&broker);
        move || {
            for n in 0..LOCAL {
                broker
                    .publish("shared", numbered(n))
                    .expect("in-process publish");
            }
        }
    });
    let publisher = connect(&endpoint);
    for n in 0..REMOTE {
        publisher
            .publish("shared", numbered(1_000_000 + n))
            .unwrap();
    }
    // A slow reader: 5 ms a message, 2 s in all, past the block timeout.
    let mut remote = Vec::new();
    let mut local_seen = 0;
    while local_seen + (remote.len() as u32) < LOCAL + REMOTE {
        let message = sub.recv_timeout(WAIT).expect("a message");
        match number(&message) {
            n if n >= 1_000_000 => remote.push(n - 1_000_000),
            _ => local_seen += 1,
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    local.join().unwrap();
    assert_eq!(remote, (0..REMOTE).collect::<Vec<_>>());
    assert_eq!(sub.stats().dropped(), 0);
}

/// Held for an in-process subscription longer than the block timeout, a
/// remote publisher's message is dropped and counted, as a waiting
/// in-process publisher's is, and the publishers are read again.
#[test]
fn a_message_held_past_the_block_timeout_is_dropped_and_counted() {
    let (broker, endpoint) = start(
        Via::Tcp,
        "[limits]\nsubscription_queue = 1\n\
         [slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 100\n",
    );
    let sub = broker.subscribe("held").unwrap();
    let publisher = connect(&endpoint);
    for n in 0..3 {
        publisher.publish("held", numbered(n)).unwrap();
    }
    // Nobody reads for longer than the block timeout.
    eventually("the held messages dropped", || {
        broker.stats().value("slow_consumer_drops") == Some(2)
    });
    assert_eq!(sub.stats().dropped(), 2);
    assert_eq!(number(&sub.recv_timeout(WAIT).unwrap()), 0);
    // The publisher is read again.
    publisher.publish("held", numbered(3)).unwrap();
    assert_eq!(number(&sub.recv_timeout(WAIT).unwrap()), 3);
}

/// The health check and the session reports answer while the loop holds
/// in-process publishers up for a slow consumer under `block` (it reads no
/// commands then).
#[test]
fn the_health_check_answers_while_publishers_are_held_up() {
    let (broker, endpoint) = start(
        Via::Tcp,
        "[limits]\nmax_pending_bytes = 65536\n\
         [slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 60000\n\
         [shutdown]\ndrain_timeout_ms = 300\n",
    );
    let stalled = stalling_client(&endpoint, 1);
    let sub = stalled.subscribe("held").unwrap();
    stalled.flush(WAIT).unwrap();
    let broker = Arc::new(broker);
    let publisher = std::thread::spawn({
        let broker = Arc::clone(&broker);
        move || {
            let payload = Bytes::from(vec![1u8; 4096]);
            // Stops once held up for good (the broker's shutdown below).
            for _ in 0..100_000 {
                if broker.publish("held", payload.clone()).is_err() {
                    break;
                }
            }
        }
    });
    eventually("the publisher held up", || {
        broker.stats().queued_bytes.load(Ordering::Relaxed) >= 65536
    });
    std::thread::sleep(Duration::from_millis(100));
    assert!(!publisher.is_finished(), "the publisher is held up");
    broker
        .responsive(WAIT)
        .expect("the loop runs while publishers wait");
    // The loop holds its commands meanwhile; the session reports
    // monitoring asks for still come (the slow consumer is what one looks
    // for then).
    let reports = broker
        .connections(&[], Duration::from_secs(2))
        .expect("reports while publishers are held");
    assert!(
        reports.iter().any(|report| report.pending_bytes >= 65536),
        "{reports:?}"
    );
    broker.shutdown();
    // The reader goes first: its client's loop waits for room in it.
    drop(sub);
    drop(stalled);
    publisher.join().unwrap();
}

#[test]
fn a_client_responder_answers_on_its_loop_and_survives_a_panicking_handler() {
    let (broker, endpoint) = start(Via::Tcp, "");
    let service = connect(&endpoint);
    let responder = service
        .respond("svc.len", |request| {
            assert!(!request.payload.is_empty(), "the handler fails");
            Some(Bytes::from(request.payload.len().to_string()))
        })
        .unwrap();
    service.flush(WAIT).unwrap();
    let asker = connect(&endpoint);
    let reply = asker
        .request("svc.len", Bytes::from_static(b"four"), WAIT)
        .unwrap();
    assert_eq!(&reply.payload[..], b"4");
    let reply = broker
        .request("svc.len", Bytes::from(vec![1u8; 5000]), WAIT)
        .unwrap();
    assert_eq!(&reply.payload[..], b"5000");
    // The handler panics: that reply is lost and counted, the client's
    // loop goes on answering.
    let lost = asker.request("svc.len", Bytes::new(), Duration::from_millis(300));
    assert!(matches!(lost, Err(Error::Timeout(_))), "{lost:?}");
    let reply = asker
        .request("svc.len", Bytes::from_static(b"again"), WAIT)
        .unwrap();
    assert_eq!(&reply.payload[..], b"5");
    assert_eq!(responder.stats().delivered(), 4);
    assert_eq!(responder.stats().dropped(), 1);
    // Dropped, it answers no more.
    drop(responder);
    service.flush(WAIT).unwrap();
    let after = asker.request(
        "svc.len",
        Bytes::from_static(b"x"),
        Duration::from_millis(300),
    );
    assert!(
        matches!(after, Err(Error::NoResponders(_)) | Err(Error::Timeout(_))),
        "{after:?}"
    );
}

#[test]
fn client_queue_responders_share_requests_and_count_oversized_replies() {
    let (_broker, endpoint) = start(Via::Tcp, "[limits]\nmax_payload = 1024");
    let members: Vec<(Arc<Client>, Responder)> = (0..2)
        .map(|_| {
            let client = Arc::new(
                Client::connect_with(
                    &endpoint,
                    ClientOptions {
                        // Deliveries under this policy are made with the
                        // subscription table at hand: a handler that takes it
                        // must not find it held.
                        slow_consumer: SlowConsumerPolicy::DropOldest,
                        ..options()
                    },
                    Registry::with_builtins(),
                )
                .unwrap(),
            );
            let inside = Arc::downgrade(&client);
            let responder = client
                .queue_respond("svc.q", "workers", move |request| {
                    if let Some(client) = inside.upgrade() {
                        drop(client.subscribe("svc.other").unwrap());
                    }
                    let len = if &request.payload[..] == b"big" {
                        2000
                    } else {
                        2
                    };
                    Some(Bytes::from(vec![b'k'; len]))
                })
                .unwrap();
            client.flush(WAIT).unwrap();
            (client, responder)
        })
        .collect();
    let asker = connect(&endpoint);
    for _ in 0..20 {
        let reply = asker
            .request("svc.q", Bytes::from_static(b"?"), WAIT)
            .unwrap();
        assert_eq!(&reply.payload[..], b"kk");
    }
    let lost = asker.request(
        "svc.q",
        Bytes::from_static(b"big"),
        Duration::from_millis(300),
    );
    assert!(matches!(lost, Err(Error::Timeout(_))), "{lost:?}");
    let delivered: u64 = members.iter().map(|(_, r)| r.stats().delivered()).sum();
    let dropped: u64 = members.iter().map(|(_, r)| r.stats().dropped()).sum();
    assert_eq!((delivered, dropped), (21, 1));
}

/// A client that does not reconnect and loses its connection while its
/// outbox is full (the broker holds its publishes for a subscriber that
/// reads nothing, under `block`) answers what waits at once: a flush
/// queued behind the publishes fails with `NotConnected`, as one whose
/// ping was sent does, and a publisher waiting for room with `Closed`,
/// not after their timeouts (10 s here).
#[test]
fn a_lost_connection_without_reconnect_ends_waiting_flushes_and_publishers() {
    let (broker, endpoint) = start(
        Via::Tcp,
        "[limits]\nmax_pending_bytes = 65536\nsubscription_queue = 4\n\
         [slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 60000\n\
         [shutdown]\ndrain_timeout_ms = 300\n",
    );
    let unread = broker.subscribe("held").unwrap();
    let waits = Duration::from_secs(10);
    let client = Arc::new(connect_as(
        &endpoint,
        ClientOptions {
            reconnect: false,
            max_pending_bytes: 65536,
            block_timeout: waits,
            ..options()
        },
    ));
    let publisher = std::thread::spawn({
        let client = Arc::clone(&client);
        move || {
            let payload = Bytes::from(vec![1u8; 4096]);
            loop {
                if let Err(err) = client.publish("held", payload.clone()) {
                    return (err, Instant::now());
                }
            }
        }
    });
    // The broker stops reading the connection, the client's path and then
    // its outbox fill, and the publisher waits for room.
    std::thread::sleep(Duration::from_millis(500));
    assert!(!publisher.is_finished(), "the publisher waits for room");
    let flusher = std::thread::spawn({
        let client = Arc::clone(&client);
        move || (client.flush(waits), Instant::now())
    });
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !flusher.is_finished(),
        "the flush waits behind the publishes"
    );
    let lost = Instant::now();
    broker.shutdown();
    let (flushed, flushed_at) = flusher.join().unwrap();
    let (refused, refused_at) = publisher.join().unwrap();
    assert!(
        matches!(flushed, Err(Error::NotConnected(_))),
        "{flushed:?}"
    );
    assert!(matches!(refused, Error::Closed), "{refused:?}");
    for (what, at) in [("flush", flushed_at), ("publisher", refused_at)] {
        let after = at.saturating_duration_since(lost);
        assert!(
            after < Duration::from_secs(3),
            "the {what} waited {after:?}"
        );
    }
    drop(unread);
}

/// A publish larger than the client's own frames carry is refused with the
/// room there is, even where the server's payload limit would take it
/// (before, it was accepted and then dropped by the connection unseen).
#[test]
fn a_publish_over_the_client_s_frame_limit_is_refused() {
    let (_broker, endpoint) = start(Via::Tcp, "");
    let client = connect_as(
        &endpoint,
        ClientOptions {
            max_frame: 64 << 10,
            ..options()
        },
    );
    let sub = client.subscribe("big").unwrap();
    client.flush(WAIT).unwrap();
    match client.publish("big", vec![7u8; 100 << 10]) {
        Err(Error::PayloadTooLarge { len, max }) => {
            assert_eq!(len, 100 << 10);
            assert!(max < 64 << 10 && max > 60 << 10, "{max}");
        }
        other => panic!("{other:?}"),
    }
    client.publish("big", vec![7u8; 60 << 10]).unwrap();
    let message = sub.recv_timeout(WAIT).unwrap();
    assert_eq!(message.payload.len(), 60 << 10);
}

/// Under `block`, a run of messages for a subscription whose reader
/// stopped waits the block timeout once, not once per message: the rest
/// are dropped (counted) at once, until the reader takes one again.
#[test]
fn a_stalled_blocking_subscription_waits_the_timeout_once_per_stall() {
    let (_broker, endpoint) = start(Via::Tcp, "");
    let timeout = Duration::from_millis(300);
    let subscriber = connect_as(
        &endpoint,
        ClientOptions {
            subscription_queue: 4,
            slow_consumer: SlowConsumerPolicy::Block,
            block_timeout: timeout,
            ..options()
        },
    );
    let stalled = subscriber.subscribe("stall").unwrap();
    subscriber.flush(WAIT).unwrap();
    let publisher = connect(&endpoint);
    let started = Instant::now();
    for i in 0..50u32 {
        publisher
            .publish("stall", i.to_be_bytes().to_vec())
            .unwrap();
    }
    publisher.flush(WAIT).unwrap();
    eventually("46 messages dropped", || stalled.stats().dropped() == 46);
    // One wait, not 46 (13.8 s).
    assert!(started.elapsed() < 10 * timeout, "{:?}", started.elapsed());
    // The reader takes one: the stall is over, and a message that finds
    // the queue full again waits for room as before (the reader comes back
    // within the timeout), not dropped.
    let first = stalled.recv_timeout(WAIT).unwrap();
    assert_eq!(&first.payload[..], 0u32.to_be_bytes());
    for text in [&b"fits"[..], b"waits"] {
        publisher.publish("stall", text.to_vec()).unwrap();
    }
    publisher.flush(WAIT).unwrap();
    std::thread::sleep(timeout / 3);
    let mut taken = Vec::new();
    while let Ok(message) = stalled.recv_timeout(Duration::from_millis(500)) {
        taken.push(message.payload);
    }
    assert_eq!(taken.len(), 5, "three held, then both: {taken:?}");
    assert_eq!(&taken[3..], [&b"fits"[..], b"waits"]);
    assert_eq!(stalled.stats().dropped(), 46);
}

/// A client dropped before its subscription, while its loop waits for
/// room in that subscription (`block`, a reader that stopped), ends within
/// its final flush's second rather than after the block timeout (60 s
/// here).
#[test]
fn a_client_dropped_while_its_loop_waits_for_a_stalled_reader_ends_at_once() {
    let (_broker, endpoint) = start(Via::Tcp, "");
    let subscriber = stalling_client(&endpoint, 4);
    let stalled = subscriber.subscribe("stall").unwrap();
    subscriber.flush(WAIT).unwrap();
    let publisher = connect(&endpoint);
    for i in 0..10u32 {
        publisher
            .publish("stall", i.to_be_bytes().to_vec())
            .unwrap();
    }
    publisher.flush(WAIT).unwrap();
    eventually("the queue full", || stalled.stats().delivered() == 4);
    std::thread::sleep(Duration::from_millis(100));
    let dropping = Instant::now();
    drop(subscriber);
    assert!(
        dropping.elapsed() < Duration::from_secs(5),
        "{:?}",
        dropping.elapsed()
    );
    // What it held is still read; then the subscription ends.
    let held: Vec<Message> = stalled.collect();
    assert_eq!(held.len(), 4);
}

/// A connection's report lists its first 1,024 subscriptions by id, in
/// order, whatever how many it holds (picked without sorting them all).
#[test]
fn a_report_lists_the_first_subscriptions_by_id() {
    let (broker, endpoint) = start(Via::Tcp, "");
    let client = connect(&endpoint);
    let subs: Vec<Subscription> = (0..1100)
        .map(|i| client.subscribe(&format!("listed.{i}")).unwrap())
        .collect();
    client.flush(WAIT).unwrap();
    let reports = broker
        .connections_with_subscriptions(WAIT)
        .expect("a report");
    let report = reports
        .iter()
        .find(|report| report.subscription_count == 1100)
        .expect("the client's report");
    let patterns: Vec<&str> = report
        .subscriptions
        .iter()
        .map(|sub| sub.pattern.as_str())
        .collect();
    let expected: Vec<String> = (0..1024).map(|i| format!("listed.{i}")).collect();
    assert_eq!(patterns, expected);
    // Only the connections asked for have theirs copied.
    let other = connect(&endpoint);
    let _other_sub = other.subscribe("other.one").unwrap();
    other.flush(WAIT).unwrap();
    let reports = broker.connections(&[], WAIT).expect("a report");
    let other_id = reports
        .iter()
        .find(|report| report.subscription_count == 1)
        .expect("the other client's report")
        .id;
    let reports = broker.connections(&[other_id], WAIT).expect("a report");
    let listed: Vec<(u64, usize)> = reports
        .iter()
        .map(|report| (report.id, report.subscriptions.len()))
        .filter(|&(_, listed)| listed > 0)
        .collect();
    assert_eq!(listed, [(other_id, 1)]);
    drop(subs);
}

/// A best-effort subscription nobody reads drops its oldest whatever the
/// client's policy: under `block` it would stop the client's loop, and
/// with it the client's reliable traffic, for messages that may be lost.
#[test]
fn a_stalled_best_effort_subscription_holds_up_no_reliable_traffic() {
    let (broker, endpoint) = start(Via::Tcp, "");
    let client = stalling_client(&endpoint, 1);
    let unread = client.subscribe_best_effort("be").unwrap();
    let reliable = client.subscribe("rel").unwrap();
    client.flush(WAIT).unwrap();
    for n in 0..10u8 {
        broker.publish("be", vec![n]).unwrap();
    }
    broker.publish("rel", &b"through"[..]).unwrap();
    let message = reliable.recv_timeout(WAIT).expect("the reliable message");
    assert_eq!(&message.payload[..], b"through");
    eventually("the best-effort drops counted", || {
        unread.stats().dropped() > 0
    });
}
