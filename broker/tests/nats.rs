//! NATS clients against the broker's NATS listener, with the `async-nats`
//! crate (the NATS project's Rust client): publish and subscribe with
//! wildcards, queue groups shared with native clients, request/reply both
//! ways with its muxed inbox, headers end to end, auto-unsubscribe,
//! drain, reconnection after a broker restart, users and permissions, a
//! route between two brokers, the slow-consumer policy, malformed
//! protocol lines, TLS and mutual TLS, and server pings left unanswered.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::{ConnectOptions, HeaderMap};
use bytes::Bytes;
use efabus_broker::config::Tls;
use efabus_broker::{Broker, Client, ClientOptions, Config, Subscription};
use efabus_core::headers::Headers;
use efabus_transports::conformance::pki::{self, Pki};
use efabus_transports::registry::Registry;

mod raw_common;
use futures_util::StreamExt;

/// Bound on every wait; things normally happen at once.
const WAIT: Duration = Duration::from_secs(10);

fn start(extra: &str, nats: &str) -> Broker {
    let text =
        format!("name = \"nats-test\"\nlisten = [\"tcp/127.0.0.1:0\", \"nats/{nats}\"]\n{extra}");
    let config = Config::from_toml_str(&text, "nats test").expect("valid test config");
    Broker::start(config).expect("broker starts")
}

/// The `nats://` URL of a broker's NATS listener.
fn url(broker: &Broker) -> String {
    let endpoint = broker.endpoint("nats").expect("a nats listener");
    format!("nats://{}", endpoint.trim_start_matches("nats/"))
}

fn native(broker: &Broker) -> Client {
    let endpoint = broker.endpoint("tcp").expect("a tcp listener");
    let options = ClientOptions {
        connect_timeout: WAIT,
        ..ClientOptions::default()
    };
    Client::connect_with(&endpoint, options, Registry::with_builtins()).expect("connects")
}

async fn nats(broker: &Broker) -> async_nats::Client {
    ConnectOptions::new()
        .name("nats-test")
        .connect(url(broker))
        .await
        .expect("NATS client connects")
}

async fn next(sub: &mut async_nats::Subscriber) -> async_nats::Message {
    tokio::time::timeout(WAIT, sub.next())
        .await
        .expect("a message within the wait")
        .expect("the subscription is open")
}

/// A round trip through the broker, answered (with no responders) only
/// after the broker handled everything this client sent before, and
/// received after every message the broker sent it before. (async-nats's
/// `flush` only writes the client's buffer out.)
async fn sync(client: &async_nats::Client) {
    let err = client
        .request("sync.nobody.listens", Bytes::new())
        .await
        .expect_err("no responders");
    assert_eq!(err.kind(), async_nats::RequestErrorKind::NoResponders);
}

fn text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload).into_owned()
}

fn recv_native(sub: &Subscription) -> efabus_broker::Message {
    sub.recv_timeout(WAIT).expect("a message within the wait")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_and_native_clients_share_subjects_wildcards_and_queue_groups() {
    let broker = start("", "127.0.0.1:0");
    let client = nats(&broker).await;
    let mut star = client.subscribe("orders.*").await.expect("subscribes");
    let mut tail = client.subscribe("orders.>").await.expect("subscribes");
    let native = native(&broker);
    let native_sub = native.subscribe("orders.>").expect("subscribes");
    let embedded = broker.subscribe("orders.*").expect("subscribes");
    sync(&client).await;
    native.flush(WAIT).expect("flushed");

    client
        .publish("orders.new", Bytes::from_static(b"from nats"))
        .await
        .expect("publishes");
    client
        .publish("orders.eu.new", Bytes::from_static(b"deep"))
        .await
        .expect("publishes");
    // Order holds per publisher: the native one goes after.
    sync(&client).await;
    native
        .publish("orders.old", "from native")
        .expect("publishes");
    native.flush(WAIT).expect("flushed");

    let star_got: Vec<String> = [next(&mut star).await, next(&mut star).await]
        .iter()
        .map(|m| format!("{}:{}", m.subject, text(&m.payload)))
        .collect();
    assert_eq!(star_got, ["orders.new:from nats", "orders.old:from native"]);
    let mut tail_got = Vec::new();
    for _ in 0..3 {
        let m = next(&mut tail).await;
        tail_got.push(format!("{}:{}", m.subject, text(&m.payload)));
    }
    assert_eq!(
        tail_got,
        [
            "orders.new:from nats",
            "orders.eu.new:deep",
            "orders.old:from native"
        ]
    );
    let native_got: Vec<String> = (0..2)
        .map(|_| text(&recv_native(&native_sub).payload))
        .collect();
    assert_eq!(native_got, ["from nats", "deep"]);
    assert_eq!(text(&recv_native(&embedded).payload), "from nats");

    // One queue group across a NATS member and a native one: each
    // message reaches exactly one of them.
    let mut nats_member = client
        .queue_subscribe("jobs", "workers".to_string())
        .await
        .expect("subscribes");
    let native_member = native
        .queue_subscribe("jobs", "workers")
        .expect("subscribes");
    sync(&client).await;
    native.flush(WAIT).expect("flushed");
    const JOBS: usize = 200;
    for n in 0..JOBS {
        native.publish("jobs", n.to_string()).expect("publishes");
    }
    native.flush(WAIT).expect("flushed");
    client.flush().await.expect("flushed");
    let mut seen = Vec::new();
    while let Ok(message) = native_member.try_recv() {
        seen.push(text(&message.payload));
    }
    let from_native = seen.len();
    while seen.len() < JOBS {
        seen.push(text(&next(&mut nats_member).await.payload));
    }
    seen.sort_by_key(|n| n.parse::<usize>().expect("a number"));
    let expected: Vec<String> = (0..JOBS).map(|n| n.to_string()).collect();
    assert_eq!(seen, expected, "each job once");
    assert!(
        from_native > 0 && from_native < JOBS,
        "both members took jobs ({from_native} native)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_echo_skips_its_own_subscriptions_and_queue_members() {
    let broker = start("", "127.0.0.1:0");
    let quiet = ConnectOptions::new()
        .no_echo()
        .connect(url(&broker))
        .await
        .expect("connects");
    let mut own = quiet.subscribe("e.plain").await.expect("subscribes");
    let mut own_member = quiet
        .queue_subscribe("e.jobs", "workers".to_string())
        .await
        .expect("subscribes");
    let native = native(&broker);
    let other = native.subscribe("e.plain").expect("subscribes");
    let other_member = native
        .queue_subscribe("e.jobs", "workers")
        .expect("subscribes");
    native.flush(WAIT).expect("flushed");
    sync(&quiet).await;
    for n in 0..50u8 {
        quiet
            .publish("e.jobs", Bytes::from(vec![n]))
            .await
            .expect("publishes");
    }
    quiet
        .publish("e.plain", Bytes::from_static(b"mine"))
        .await
        .expect("publishes");
    sync(&quiet).await;
    // Every job reaches the other member; none is lost to the publisher's.
    for n in 0..50u8 {
        assert_eq!(recv_native(&other_member).payload[..], [n]);
    }
    assert_eq!(text(&recv_native(&other).payload), "mine");
    // A message from elsewhere still reaches the quiet client.
    native.publish("e.plain", "theirs").expect("publishes");
    native.flush(WAIT).expect("flushed");
    assert_eq!(text(&next(&mut own).await.payload), "theirs");
    let nothing = tokio::time::timeout(Duration::from_millis(200), own_member.next()).await;
    assert!(nothing.is_err(), "its own member got {nothing:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_reply_works_both_ways_and_no_responders_answers_at_once() {
    let broker = start("", "127.0.0.1:0");
    let client = nats(&broker).await;
    let native = native(&broker);

    // A NATS responder answers a native request.
    let mut service = client.subscribe("svc.upper").await.expect("subscribes");
    sync(&client).await;
    let responder = client.clone();
    let serving = tokio::spawn(async move {
        let request = next(&mut service).await;
        let reply = request.reply.expect("a reply subject");
        let answer = text(&request.payload).to_uppercase();
        responder
            .publish(reply, answer.into())
            .await
            .expect("answers");
        responder.flush().await.expect("flushed");
    });
    let answer = tokio::task::spawn_blocking(move || {
        let answer = native
            .request("svc.upper", "hello", WAIT)
            .expect("answered");
        (native, answer)
    })
    .await
    .expect("joins");
    let (native, answer) = answer;
    assert_eq!(text(&answer.payload), "HELLO");
    serving.await.expect("served");

    // A native responder answers a NATS request (its muxed inbox).
    let native_service = native.subscribe("svc.double").expect("subscribes");
    native.flush(WAIT).expect("flushed");
    let answering = std::thread::spawn(move || {
        for _ in 0..3 {
            let request = recv_native(&native_service);
            let n: u32 = text(&request.payload).parse().expect("a number");
            let reply = request.reply.expect("a reply subject");
            native
                .publish(&reply, (2 * n).to_string())
                .expect("answers");
        }
        native.flush(WAIT).expect("flushed");
    });
    for n in [1u32, 20, 300] {
        let answer = client
            .request("svc.double", n.to_string().into())
            .await
            .expect("answered");
        assert_eq!(text(&answer.payload), (2 * n).to_string());
    }
    answering.join().expect("joins");

    // Nothing subscribed: NATS's no-responders status, not a timeout.
    let started = Instant::now();
    let err = client
        .request("svc.nobody", Bytes::new())
        .await
        .expect_err("no responders");
    assert_eq!(
        err.kind(),
        async_nats::RequestErrorKind::NoResponders,
        "{err}"
    );
    assert!(started.elapsed() < WAIT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_cross_between_nats_and_native_clients() {
    let broker = start("", "127.0.0.1:0");
    let client = nats(&broker).await;
    let native = native(&broker);
    let native_sub = native.subscribe("h.>").expect("subscribes");
    native.flush(WAIT).expect("flushed");
    let mut nats_sub = client.subscribe("h.>").await.expect("subscribes");
    sync(&client).await;

    let mut headers = HeaderMap::new();
    headers.insert("Trace-Id", "abc-123");
    headers.append("Tag", "one");
    headers.append("Tag", "two");
    client
        .publish_with_headers("h.nats", headers, Bytes::from_static(b"body"))
        .await
        .expect("publishes");
    client.flush().await.expect("flushed");
    let got = recv_native(&native_sub);
    assert_eq!(&got.payload[..], b"body");
    let parsed = Headers::parse(got.headers.as_ref().expect("headers")).expect("parses");
    assert_eq!(parsed.get("Trace-Id"), Some("abc-123"));
    assert_eq!(parsed.get_all("Tag").collect::<Vec<_>>(), ["one", "two"]);
    let echoed = next(&mut nats_sub).await;
    let echoed_headers = echoed.headers.expect("headers");
    assert_eq!(
        echoed_headers.get("Trace-Id").map(|v| v.as_str()),
        Some("abc-123")
    );

    let mut native_headers = Headers::new();
    native_headers.insert("From", "native");
    native
        .publish_with_headers("h.native", None, native_headers.to_block(), "x")
        .expect("publishes");
    native.flush(WAIT).expect("flushed");
    let got = next(&mut nats_sub).await;
    assert_eq!(&got.payload[..], b"x");
    let got_headers = got.headers.expect("headers");
    assert_eq!(got_headers.get("From").map(|v| v.as_str()), Some("native"));
    // Native's own subscription sees its headers too.
    assert!(recv_native(&native_sub).headers.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_unsubscribe_and_drain_end_subscriptions_when_nats_says() {
    let broker = start("", "127.0.0.1:0");
    let client = nats(&broker).await;
    let mut limited = client.subscribe("count").await.expect("subscribes");
    limited
        .unsubscribe_after(3)
        .await
        .expect("auto-unsubscribe");
    sync(&client).await;
    for n in 0..10u8 {
        client
            .publish("count", Bytes::from(vec![n]))
            .await
            .expect("publishes");
    }
    client.flush().await.expect("flushed");
    let mut got = Vec::new();
    while let Ok(Some(message)) = tokio::time::timeout(WAIT, limited.next()).await {
        got.push(message.payload[0]);
    }
    assert_eq!(got, [0, 1, 2], "three, then the subscription ended");
    // The broker forgot it: nothing is routed to it any more (the
    // client's request inbox is all it holds).
    let deadline = Instant::now() + WAIT;
    while broker.subscription_count() != 1 {
        assert!(Instant::now() < deadline, "the broker still holds it");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Drain: what was published before is still delivered, then the end.
    let mut drained = client.subscribe("drain.me").await.expect("subscribes");
    sync(&client).await;
    for n in 0..5u8 {
        client
            .publish("drain.me", Bytes::from(vec![n]))
            .await
            .expect("publishes");
    }
    sync(&client).await;
    drained.drain().await.expect("drains");
    let mut got = Vec::new();
    while let Ok(Some(message)) = tokio::time::timeout(WAIT, drained.next()).await {
        got.push(message.payload[0]);
    }
    assert_eq!(got, [0, 1, 2, 3, 4]);
    client.drain().await.expect("the client drains");
}

/// A queue group member that auto-unsubscribes is counted as the broker
/// routes: the group's messages past its maximum go to the other
/// members, none to one that would drop them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_member_s_maximum_passes_the_rest_to_the_group() {
    let broker = start("", "127.0.0.1:0");
    let client = nats(&broker).await;
    let mut limited = client
        .queue_subscribe("work", "group".into())
        .await
        .expect("subscribes");
    limited
        .unsubscribe_after(2)
        .await
        .expect("auto-unsubscribe");
    let mut other = client
        .queue_subscribe("work", "group".into())
        .await
        .expect("subscribes");
    sync(&client).await;
    const SENT: usize = 40;
    for n in 0..SENT {
        client
            .publish("work", Bytes::from(n.to_string()))
            .await
            .expect("publishes");
    }
    client.flush().await.expect("flushed");
    let mut got_limited = 0;
    while let Ok(Some(_)) = tokio::time::timeout(WAIT, limited.next()).await {
        got_limited += 1;
    }
    let mut got_other = 0;
    while got_limited + got_other < SENT {
        let message = tokio::time::timeout(WAIT, other.next()).await;
        assert!(
            matches!(message, Ok(Some(_))),
            "{got_limited} + {got_other} of {SENT} delivered"
        );
        got_other += 1;
    }
    assert_eq!(got_limited, 2, "the limited member took its maximum");
}

/// A queue member that leaves while an in-process publisher's messages
/// picked for it still wait for the event loop passes them on: here a
/// member reaching its delivery limit amid 50,000 messages published
/// in-process. The limited member gets exactly its 6, the group's other
/// member all the rest (before, those picked for the limited member after
/// its limit went to it all the same, for its client to drop).
#[test]
fn a_queue_member_that_leaves_passes_on_what_was_picked_for_it() {
    const SENT: usize = 50_000;
    const LIMIT: usize = 6;
    let broker = start("", "127.0.0.1:0");
    let mut raw = raw_common::Raw::connect(&broker);
    raw.hello_as_client("limited");
    raw.queue_subscribe_limited(1, "work", "g", LIMIT as u64);
    let other = native(&broker);
    let rest = other.queue_subscribe("work", "g").expect("subscribes");
    other.flush(WAIT).expect("flushed");
    let counter = std::thread::spawn(move || {
        let mut got = std::collections::HashSet::new();
        while got.len() < SENT - LIMIT {
            let Ok(message) = rest.recv_timeout(WAIT) else {
                break;
            };
            let n = u64::from_le_bytes(message.payload[..].try_into().expect("a number"));
            assert!(got.insert(n), "message {n} came twice");
        }
        // Nothing more comes.
        assert!(rest.recv_timeout(Duration::from_millis(200)).is_err());
        got
    });

    for n in 0..SENT {
        broker
            .publish("work", (n as u64).to_le_bytes().to_vec())
            .expect("published");
    }
    broker.flush(WAIT).expect("delivered");
    let limited = raw.messages_before_pong(2);
    assert_eq!(limited.len(), LIMIT, "the limited member took its maximum");
    let mut all = counter.join().expect("counted");
    for message in limited {
        let n = u64::from_le_bytes(message.payload[..].try_into().expect("a number"));
        assert!(all.insert(n), "message {n} reached both members");
    }
    assert_eq!(all.len(), SENT, "each message reached the group once");
    assert_eq!(broker.stats().value("connection_drops"), Some(0));
}

/// The limit the listener gives the broker counts deliveries from the
/// first limit (a NATS queue member's, from its SUB): a total of 6 set
/// after 4 deliveries lets 2 more through, whatever was on its way to
/// the listener meanwhile, and the group's other member gets the rest
/// (published by a client: the broker picks the member as it routes).
#[test]
fn a_delivery_limit_counts_from_the_first_limit() {
    use efabus_core::frame::Frame;
    let broker = start("", "127.0.0.1:0");
    let mut raw = raw_common::Raw::connect(&broker);
    raw.hello_as_client("limited");
    raw.queue_subscribe_limited(1, "work", "g", u64::MAX);
    // What a publisher that has flushed sent is queued ahead of the pong.
    let messages = |raw: &mut raw_common::Raw, nonce: u64| raw.messages_before_pong(nonce).len();
    let publisher = native(&broker);
    for _ in 0..4 {
        publisher.publish("work", &b"alone"[..]).expect("publish");
    }
    publisher.flush(WAIT).expect("flushed");
    assert_eq!(messages(&mut raw, 10), 4, "the only member");
    let other = native(&broker);
    let rest = other.queue_subscribe("work", "g").expect("subscribes");
    other.flush(WAIT).expect("flushed");
    raw.send(&Frame::UnsubscribeAfter { sid: 1, total: 6 });
    raw.send(&Frame::Ping { nonce: 2 });
    raw.expect("the pong", |f| matches!(f, Frame::Pong { nonce: 2 }));
    for _ in 0..20 {
        publisher.publish("work", &b"shared"[..]).expect("publish");
    }
    publisher.flush(WAIT).expect("flushed");
    assert_eq!(messages(&mut raw, 11), 2, "up to 6 in all");
    for _ in 0..18 {
        rest.recv_timeout(WAIT)
            .expect("the rest at the other member");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_client_reconnects_and_resubscribes_after_a_broker_restart() {
    let broker = start("", "127.0.0.1:0");
    let address = url(&broker);
    let port = address.rsplit(':').next().expect("a port").to_string();
    let client = ConnectOptions::new()
        .reconnect_delay_callback(|_| Duration::from_millis(50))
        .connect(address.as_str())
        .await
        .expect("connects");
    let mut sub = client.subscribe("after.restart").await.expect("subscribes");
    sync(&client).await;
    drop(broker);
    // The same port again, as a restarted service would.
    let broker = start("", &format!("127.0.0.1:{port}"));
    let native = native(&broker);
    let deadline = Instant::now() + WAIT;
    // Until the client is back and has subscribed again.
    loop {
        native.publish("after.restart", "hello").expect("publishes");
        native.flush(WAIT).expect("flushed");
        if let Ok(Some(message)) =
            tokio::time::timeout(Duration::from_millis(200), sub.next()).await
        {
            assert_eq!(text(&message.payload), "hello");
            break;
        }
        assert!(Instant::now() < deadline, "no message after the restart");
    }
    client
        .publish("after.restart", Bytes::from_static(b"own"))
        .await
        .expect("publishes");
    client.flush().await.expect("flushed");
    loop {
        let message = next(&mut sub).await;
        if text(&message.payload) == "own" {
            break;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_log_in_and_are_held_to_their_permissions() {
    let hash = efabus_broker::accounts::hash_secret("pw").expect("hashes");
    let extra = format!(
        "[[auth.users]]\nname = \"orders\"\npassword = {hash:?}\n\
         [auth.users.permissions.publish]\nallow = [\"orders.>\"]\ndeny = [\"orders.secret\"]\n\
         [auth.users.permissions.subscribe]\nallow = [\"orders.>\"]\ndeny = [\"orders.secret\"]\n"
    );
    let broker = start(&extra, "127.0.0.1:0");

    let refused = ConnectOptions::new()
        .user_and_password("orders".into(), "wrong".into())
        .connect(url(&broker))
        .await;
    let err = refused.expect_err("a wrong password is refused");
    assert!(
        format!("{err:?}").to_lowercase().contains("authorization"),
        "{err:?}"
    );

    let (errors_tx, mut errors) = tokio::sync::mpsc::unbounded_channel();
    let client = ConnectOptions::new()
        .user_and_password("orders".into(), "pw".into())
        .event_callback(move |event| {
            let errors_tx = errors_tx.clone();
            async move {
                if let async_nats::Event::ServerError(err) = event {
                    let _ = errors_tx.send(err.to_string());
                }
            }
        })
        .connect(url(&broker))
        .await
        .expect("the right password logs in");
    // A pattern that could match the denied subject is itself denied.
    let mut allowed = client.subscribe("orders.new").await.expect("subscribes");
    client.flush().await.expect("flushed");
    client
        .publish("orders.secret", Bytes::from_static(b"no"))
        .await
        .expect("sent");
    client
        .publish("orders.new", Bytes::from_static(b"yes"))
        .await
        .expect("sent");
    client.flush().await.expect("flushed");
    assert_eq!(text(&next(&mut allowed).await.payload), "yes");
    let error = tokio::time::timeout(WAIT, errors.recv())
        .await
        .expect("an error within the wait")
        .expect("an error");
    assert!(
        error
            .to_lowercase()
            .contains("permissions violation for publish to \"orders.secret\""),
        "{error}"
    );
    let _denied = client.subscribe("orders.secret").await.expect("sent");
    client.flush().await.expect("flushed");
    let error = tokio::time::timeout(WAIT, errors.recv())
        .await
        .expect("an error within the wait")
        .expect("an error");
    assert!(
        error
            .to_lowercase()
            .contains("permissions violation for subscription to \"orders.secret\""),
        "{error}"
    );
    assert_eq!(broker.stats().permission_denials.load(Ordering::Relaxed), 2);
}

/// Refused SUBs are forgotten by the listener too, however many share a
/// pattern: they take none of the client's room for subscriptions.
#[test]
fn refused_subscriptions_take_no_room() {
    let hash = efabus_broker::accounts::hash_secret("pw").expect("hashes");
    let extra = format!(
        "[limits]\nmax_subscriptions_per_peer = 2\n\
         [[auth.users]]\nname = \"u\"\npassword = {hash:?}\n\
         [auth.users.permissions.subscribe]\ndeny = [\"secret\"]\n"
    );
    let broker = start(&extra, "127.0.0.1:0");
    let (mut reader, mut stream) = raw(&broker);
    let mut input = String::from("CONNECT {\"user\":\"u\",\"pass\":\"pw\"}\r\n");
    for sid in 1..=3 {
        input.push_str(&format!("SUB secret {sid}\r\n"));
    }
    input.push_str("SUB a 4\r\nSUB b 5\r\nPING\r\n");
    stream.write_all(input.as_bytes()).expect("writes");
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("an answer");
        let line = line.trim_end().to_string();
        if line == "PONG" {
            break;
        }
        lines.push(line);
    }
    let denied = "-ERR 'Permissions Violation for Subscription to \"secret\"'";
    assert_eq!(lines, [denied, denied, denied], "`a` and `b` are taken");
    assert_eq!(broker.subscription_count(), 2);
}

/// A broker without users or a secret checks nothing: a client that
/// sends a user and password anyway (`nats://u:p@host`) gets in, as with
/// nats-server, and is not counted as a failed login.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_auth_a_user_and_password_are_not_checked() {
    let broker = start("", "127.0.0.1:0");
    let client = ConnectOptions::new()
        .user_and_password("anyone".into(), "anything".into())
        .connect(url(&broker))
        .await
        .expect("gets in");
    let mut sub = client.subscribe("open").await.expect("subscribes");
    client
        .publish("open", Bytes::from_static(b"in"))
        .await
        .expect("publishes");
    assert_eq!(text(&next(&mut sub).await.payload), "in");
    assert_eq!(broker.stats().auth_failures.load(Ordering::Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_secret_is_a_nats_token() {
    let broker = start("[auth]\nsecret = \"s3cret\"\n", "127.0.0.1:0");
    let refused = ConnectOptions::new().connect(url(&broker)).await;
    assert!(refused.is_err(), "no token, no entry");
    let client = ConnectOptions::with_token("s3cret".into())
        .connect(url(&broker))
        .await
        .expect("the token logs in");
    let mut sub = client.subscribe("t").await.expect("subscribes");
    client
        .publish("t", Bytes::from_static(b"in"))
        .await
        .expect("publishes");
    assert_eq!(text(&next(&mut sub).await.payload), "in");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_carries_nats_clients_traffic_between_brokers() {
    let b = start("", "127.0.0.1:0");
    let b_tcp = b.endpoint("tcp").expect("tcp");
    let a = start(&format!("peers = [{b_tcp:?}]\n"), "127.0.0.1:0");
    let on_a = nats(&a).await;
    let on_b = nats(&b).await;
    let mut sub = on_b.subscribe("across.>").await.expect("subscribes");
    sync(&on_b).await;
    let deadline = Instant::now() + WAIT;
    while a.route_interest_count() == 0 {
        assert!(
            Instant::now() < deadline,
            "the route never learned the interest"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut headers = HeaderMap::new();
    headers.insert("Hop", "a");
    on_a.publish_with_headers("across.one", headers, Bytes::from_static(b"1"))
        .await
        .expect("publishes");
    on_a.flush().await.expect("flushed");
    let got = next(&mut sub).await;
    assert_eq!(
        (got.subject.as_str(), &got.payload[..]),
        ("across.one", &b"1"[..])
    );
    let hop = got.headers.expect("headers crossed the route");
    assert_eq!(hop.get("Hop").map(|v| v.as_str()), Some("a"));
    // Request/reply across the route.
    let responder = on_b.clone();
    let mut service = on_b.subscribe("across.svc").await.expect("subscribes");
    sync(&on_b).await;
    tokio::spawn(async move {
        let request = next(&mut service).await;
        if let Some(reply) = request.reply {
            let _ = responder.publish(reply, Bytes::from_static(b"pong")).await;
            let _ = responder.flush().await;
        }
    });
    while a.route_interest_count() < 2 {
        assert!(
            Instant::now() < deadline,
            "the route never learned the service"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let answer = on_a
        .request("across.svc", Bytes::from_static(b"ping"))
        .await
        .expect("answered across the route");
    assert_eq!(&answer.payload[..], b"pong");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_echo_a_queue_group_is_served_across_the_route() {
    let b = start("", "127.0.0.1:0");
    let b_tcp = b.endpoint("tcp").expect("tcp");
    let a = start(&format!("peers = [{b_tcp:?}]\n"), "127.0.0.1:0");
    // The group's only member on a is the publisher's own; b has another.
    let quiet = ConnectOptions::new()
        .no_echo()
        .connect(url(&a))
        .await
        .expect("connects");
    let _own = quiet
        .queue_subscribe("r.jobs", "workers".to_string())
        .await
        .expect("subscribes");
    sync(&quiet).await;
    let on_b = native(&b);
    let member = on_b
        .queue_subscribe("r.jobs", "workers")
        .expect("subscribes");
    on_b.flush(WAIT).expect("flushed");
    let deadline = Instant::now() + WAIT;
    while a.route_interest_count() == 0 {
        assert!(
            Instant::now() < deadline,
            "the route never learned the group"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for n in 0..20u8 {
        quiet
            .publish("r.jobs", Bytes::from(vec![n]))
            .await
            .expect("publishes");
    }
    sync(&quiet).await;
    for n in 0..20u8 {
        assert_eq!(recv_native(&member).payload[..], [n], "every job crosses");
    }
}

/// A raw connection that speaks the protocol by hand, to send what no
/// client library would.
fn raw(broker: &Broker) -> (BufReader<TcpStream>, TcpStream) {
    let (reader, stream, _) = raw_with_info(broker);
    (reader, stream)
}

/// [`raw`], with the `INFO` line the connection began with.
fn raw_with_info(broker: &Broker) -> (BufReader<TcpStream>, TcpStream, serde_json::Value) {
    let address = url(broker);
    let stream = TcpStream::connect(address.trim_start_matches("nats://")).expect("connects");
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut line = String::new();
    reader.read_line(&mut line).expect("INFO");
    let info = line
        .strip_prefix("INFO ")
        .and_then(|json| serde_json::from_str(json.trim_end()).ok())
        .unwrap_or_else(|| panic!("an INFO line, not {line:?}"));
    (reader, stream, info)
}

fn tls_section(pki: &Pki, verify_clients: bool) -> String {
    format!(
        "[tls]\ncert = {:?}\nkey = {:?}\nca = {:?}\nverify_clients = {verify_clients}\n",
        pki.server_cert, pki.server_key, pki.ca
    )
}

/// A native client over TLS, with the test client certificate.
fn native_tls(broker: &Broker, pki: &Pki) -> Client {
    let endpoint = broker.endpoint("tcp").expect("a tcp listener");
    let options = ClientOptions {
        connect_timeout: WAIT,
        tls: Tls {
            ca: Some(pki.ca.clone()),
            cert: Some(pki.client_cert.clone()),
            key: Some(pki.client_key.clone()),
            ..Tls::default()
        },
        ..ClientOptions::default()
    };
    Client::connect_with(&endpoint, options, Registry::with_builtins()).expect("connects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_clients_speak_tls_and_nothing_crosses_in_the_clear() {
    let pki = pki::shared();
    let broker = start(&tls_section(pki, false), "127.0.0.1:0");

    // INFO asks for TLS; what a client then sends in the clear is not
    // taken: no PONG, the connection ends.
    let (mut reader, mut stream, info) = raw_with_info(&broker);
    assert_eq!(info["tls_required"], true, "{info}");
    assert_eq!(info.get("tls_verify"), None, "{info}");
    stream
        .write_all(b"CONNECT {}\r\nSUB a 1\r\nPING\r\n")
        .expect("writes");
    let mut rest = Vec::new();
    let end = reader.read_to_end(&mut rest);
    assert!(end.is_ok(), "closed: {end:?}");
    assert!(!text(&rest).contains("PONG"), "{}", text(&rest));
    assert_eq!(broker.subscription_count(), 0);

    // Without the authority the server's certificate is not trusted.
    let stranger = ConnectOptions::new()
        .require_tls(true)
        .connect(url(&broker))
        .await;
    assert!(stranger.is_err(), "an unverified server is refused");

    let client = ConnectOptions::new()
        .add_root_certificates(pki.ca.clone().into())
        .require_tls(true)
        .connect(url(&broker))
        .await
        .expect("connects over TLS");
    let mut from_native = client.subscribe("tls.to.nats").await.expect("subscribes");
    sync(&client).await;
    let native = native_tls(&broker, pki);
    let from_nats = native.subscribe("tls.to.native").expect("subscribes");
    native.flush(WAIT).expect("flushed");
    client
        .publish("tls.to.native", Bytes::from_static(b"over tls"))
        .await
        .expect("publishes");
    sync(&client).await;
    assert_eq!(text(&recv_native(&from_nats).payload), "over tls");
    native.publish("tls.to.nats", "back").expect("publishes");
    native.flush(WAIT).expect("flushed");
    assert_eq!(text(&next(&mut from_native).await.payload), "back");
    // Large messages cross the TLS session whole, both ways, many at a
    // time: the listener's writes meet a full socket.
    let big = Bytes::from(vec![0x5a; 200_000]);
    client
        .publish("tls.to.native", big.clone())
        .await
        .expect("publishes");
    sync(&client).await;
    assert_eq!(recv_native(&from_nats).payload, big);
    for n in 0..20u8 {
        let mut payload = vec![n; 200_000];
        payload[0] = b'#';
        native.publish("tls.to.nats", payload).expect("publishes");
    }
    native.flush(WAIT).expect("flushed");
    for n in 0..20u8 {
        let message = next(&mut from_native).await;
        assert_eq!(message.payload.len(), 200_000);
        assert_eq!((message.payload[0], message.payload[199_999]), (b'#', n));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_first_clients_are_served_when_the_listener_expects_them() {
    let pki = pki::shared();
    let extra = format!("{}handshake_first = true\n", tls_section(pki, false));
    let broker = start(&extra, "127.0.0.1:0");
    let client = ConnectOptions::new()
        .add_root_certificates(pki.ca.clone().into())
        .tls_first()
        .connect(url(&broker))
        .await
        .expect("a TLS-first client connects");
    let mut sub = client.subscribe("first").await.expect("subscribes");
    client
        .publish("first", Bytes::from_static(b"tls first"))
        .await
        .expect("publishes");
    assert_eq!(text(&next(&mut sub).await.payload), "tls first");
    // Nothing is sent in the clear: a client waiting for INFO reads
    // nothing.
    let address = url(&broker);
    let mut stream = TcpStream::connect(address.trim_start_matches("nats://")).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let mut byte = [0u8; 1];
    let read = stream.read(&mut byte);
    assert!(
        read.as_ref()
            .is_err_and(|err| err.kind() == std::io::ErrorKind::WouldBlock),
        "{read:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_logs_a_nats_client_in_by_its_certificate() {
    let pki = pki::shared();
    let extra = format!(
        "{}[[auth.users]]\nname = \"by-certificate\"\ncertificate = \"client\"\n\
         [auth.users.permissions.publish]\nallow = [\"cert.>\", \"sync.>\"]\n",
        tls_section(pki, true)
    );
    let broker = start(&extra, "127.0.0.1:0");
    let (_reader, _stream, info) = raw_with_info(&broker);
    assert_eq!(info["tls_verify"], true, "{info}");
    assert_eq!(info["auth_required"], true, "{info}");

    let without = ConnectOptions::new()
        .add_root_certificates(pki.ca.clone().into())
        .require_tls(true)
        .connect(url(&broker))
        .await;
    assert!(without.is_err(), "no client certificate, no entry");

    let client = ConnectOptions::new()
        .name("with-certificate")
        .add_root_certificates(pki.ca.clone().into())
        .add_client_certificate(
            pki.client_cert.clone().into(),
            pki.client_key.clone().into(),
        )
        .require_tls(true)
        .connect(url(&broker))
        .await
        .expect("the certificate logs in");
    let mut sub = client.subscribe("cert.>").await.expect("subscribes");
    client
        .publish("cert.ok", Bytes::from_static(b"allowed"))
        .await
        .expect("publishes");
    client
        .publish("other.subject", Bytes::from_static(b"denied"))
        .await
        .expect("sent");
    sync(&client).await;
    assert_eq!(text(&next(&mut sub).await.payload), "allowed");
    assert_eq!(broker.stats().permission_denials.load(Ordering::Relaxed), 1);
    let report = broker.connections(&[], WAIT).expect("a report");
    let session = report
        .iter()
        .find(|session| session.name == "with-certificate")
        .expect("listed");
    assert_eq!(session.user.as_deref(), Some("by-certificate"));
}

/// Lines a raw connection reads until its `PONG`.
fn until_pong(reader: &mut BufReader<TcpStream>) -> Vec<String> {
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("a line");
        let line = line.trim_end().to_string();
        if line == "PONG" {
            return lines;
        }
        lines.push(line);
    }
}

#[test]
fn a_reload_changes_the_subscription_limit_of_nats_clients() {
    let text = "name = \"nats-test\"\nlisten = [\"tcp/127.0.0.1:0\", \"nats/127.0.0.1:0\"]\n\
                [limits]\nmax_subscriptions_per_peer = 2\n";
    let config = Config::from_toml_str(text, "nats test").expect("valid test config");
    let broker = Broker::start(config.clone()).expect("broker starts");
    let (mut reader, mut stream) = raw(&broker);
    stream
        .write_all(b"CONNECT {}\r\nSUB a 1\r\nSUB b 2\r\nSUB c 3\r\nPING\r\n")
        .expect("writes");
    assert_eq!(
        until_pong(&mut reader),
        ["-ERR 'Maximum Subscriptions Exceeded'"]
    );
    let mut raised = config.clone();
    raised.limits.max_subscriptions_per_peer = 4;
    broker.reload(&raised).expect("reloads");
    // The connected client may now hold four; a new one too.
    stream
        .write_all(b"SUB c 3\r\nSUB d 4\r\nSUB e 5\r\nPING\r\n")
        .expect("writes");
    assert_eq!(
        until_pong(&mut reader),
        ["-ERR 'Maximum Subscriptions Exceeded'"]
    );
    let (mut new_reader, mut new_stream) = raw(&broker);
    new_stream
        .write_all(b"CONNECT {}\r\nSUB a 1\r\nSUB b 2\r\nSUB c 3\r\nSUB d 4\r\nPING\r\n")
        .expect("writes");
    assert!(until_pong(&mut new_reader).is_empty());
    assert_eq!(broker.subscription_count(), 8);
}

#[test]
fn a_client_that_leaves_pings_unanswered_is_stale_after_max_pings_out() {
    let broker = start(
        "[heartbeat]\ninterval_ms = 100\ntimeout_ms = 20000\nmax_pings_out = 3\n",
        "127.0.0.1:0",
    );
    let (mut reader, mut stream) = raw(&broker);
    stream.write_all(b"CONNECT {}\r\n").expect("writes");
    let mut pings = 0;
    let last = loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("a line");
        match line.trim_end() {
            "PING" => pings += 1,
            other => break other.to_string(),
        }
    };
    assert_eq!(last, "-ERR 'Stale Connection'");
    assert_eq!(pings, 3);
}

#[test]
fn malformed_lines_get_an_error_and_a_close() {
    let broker = start("", "127.0.0.1:0");
    for (input, error) in [
        (&b"FOO bar\r\n"[..], "-ERR 'Unknown Protocol Operation'"),
        (b"CONNECT {\r\n", "-ERR 'Parser Error'"),
        (
            b"CONNECT {}\r\nPUB a.b notanumber\r\n",
            "-ERR 'Parser Error'",
        ),
        (
            b"CONNECT {}\r\nPUB a.b 99999999\r\n",
            "-ERR 'Maximum Payload Violation'",
        ),
    ] {
        let (mut reader, mut stream) = raw(&broker);
        stream.write_all(input).expect("writes");
        let mut line = String::new();
        reader.read_line(&mut line).expect("an answer");
        assert_eq!(line.trim_end(), error, "{}", text(input));
        let mut rest = Vec::new();
        let end = reader.read_to_end(&mut rest);
        assert!(end.is_ok(), "closed: {end:?}");
    }
    // A publish to an invalid subject is dropped and counted; NATS
    // clients close on an `-ERR` (but for permissions), and NATS servers
    // accept such publishes unless the client is pedantic: only a pedantic
    // client is told, and the connection stays.
    for (connect, refusal) in [
        ("{\"verbose\":true}", "+OK"),
        (
            "{\"verbose\":true,\"pedantic\":true}",
            "-ERR 'Invalid Publish Subject'",
        ),
    ] {
        let (mut reader, mut stream) = raw(&broker);
        let input = format!("CONNECT {connect}\r\nPUB a..b 1\r\nx\r\nPUB a.b 1\r\ny\r\nPING\r\n");
        stream.write_all(input.as_bytes()).expect("writes");
        let mut lines = Vec::new();
        for _ in 0..4 {
            let mut line = String::new();
            reader.read_line(&mut line).expect("an answer");
            lines.push(line.trim_end().to_string());
        }
        // Verbose: the refused publish gets its error instead of +OK, as
        // NATS answers.
        assert_eq!(lines, ["+OK", refusal, "+OK", "PONG"], "{connect}");
    }
    assert_eq!(broker.stats().messages_in.load(Ordering::Relaxed), 2);
    assert_eq!(broker.stats().invalid_publishes.load(Ordering::Relaxed), 2);
}

#[test]
fn a_nats_subscriber_that_stops_reading_meets_the_slow_consumer_policy() {
    let broker = start(
        "[limits]\nmax_pending_bytes = 262144\n[slow_consumer]\npolicy = \"disconnect\"\n",
        "127.0.0.1:0",
    );
    let (_reader, mut stream) = raw(&broker);
    stream
        .write_all(b"CONNECT {}\r\nSUB slow 1\r\nPING\r\n")
        .expect("writes");
    let deadline = Instant::now() + WAIT;
    while broker.subscription_count() == 0 {
        assert!(Instant::now() < deadline, "never subscribed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let publisher = native(&broker);
    let payload = Bytes::from(vec![7u8; 4096]);
    // Far more than the socket buffers and the pending bound hold.
    for _ in 0..20_000 {
        if publisher.publish("slow", payload.clone()).is_err() {
            break;
        }
        if broker
            .stats()
            .slow_consumer_disconnects
            .load(Ordering::Relaxed)
            > 0
        {
            break;
        }
    }
    let _ = publisher.flush(WAIT);
    while broker
        .stats()
        .slow_consumer_disconnects
        .load(Ordering::Relaxed)
        == 0
    {
        assert!(
            Instant::now() < deadline,
            "the stalled subscriber was never cut off"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Its connection is closed after what was queued for it and the error
    // saying why: reading runs to the end.
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut tail = Vec::new();
    stream.read_to_end(&mut tail).expect("reads to the end");
    assert!(
        text(&tail).trim_end().ends_with("-ERR 'Slow Consumer'"),
        "ends with {:?}",
        text(&tail[tail.len().saturating_sub(80)..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sessions_show_in_the_connection_report() {
    let broker = start("", "127.0.0.1:0");
    let client = ConnectOptions::new()
        .name("reporting")
        .connect(url(&broker))
        .await
        .expect("connects");
    let _sub = client.subscribe("seen.>").await.expect("subscribes");
    sync(&client).await;
    let report = broker
        .connections_with_subscriptions(WAIT)
        .expect("a report");
    let session = report
        .iter()
        .find(|c| c.name == "reporting")
        .expect("the NATS client is listed");
    assert_eq!(session.reliable, "nats");
    // Its subscription, and the inbox its requests use.
    assert_eq!(session.subscription_count, 2);
    let patterns: Vec<&str> = session
        .subscriptions
        .iter()
        .map(|sub| sub.pattern.as_str())
        .collect();
    assert!(patterns.contains(&"seen.>"), "{patterns:?}");
    assert!(
        patterns.iter().any(|p| p.starts_with("_INBOX.")),
        "{patterns:?}"
    );
}
