//! The embedded broker through its public API: routing, queue groups,
//! request/reply, validation, zero-copy delivery, slow-consumer policies,
//! flush and shutdown.

mod embedded_common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_broker::{Broker, Client, Error, Message, PubSub, RecvError, Subscription};
use efabus_core::index::IndexError;
use efabus_core::subject::{QueueNameError, SubjectError};
use embedded_common::{broker, drain, text, WAIT};

fn payload(s: &'static str) -> Bytes {
    Bytes::from_static(s.as_bytes())
}

#[test]
fn exact_and_wildcard_subscriptions_match_as_documented() {
    let broker = broker("");
    let exact = broker.subscribe("metrics.host1.cpu").unwrap();
    let star = broker.subscribe("metrics.*.cpu").unwrap();
    let tail = broker.subscribe("metrics.>").unwrap();
    let star_tail = broker.subscribe("*.host2.>").unwrap();

    for (subject, body) in [
        ("metrics.host1.cpu", "1"),
        ("metrics.host2.cpu", "2"),
        ("metrics.host2.mem.free", "3"),
        ("metrics", "4"),
        ("other.host1.cpu", "5"),
        ("logs.host2.kernel", "6"),
    ] {
        broker
            .publish(subject, Bytes::copy_from_slice(body.as_bytes()))
            .unwrap();
    }

    assert_eq!(drain(&exact), ["metrics.host1.cpu:1"]);
    assert_eq!(drain(&star), ["metrics.host1.cpu:1", "metrics.host2.cpu:2"]);
    // `>` needs at least one token after `metrics`.
    assert_eq!(
        drain(&tail),
        [
            "metrics.host1.cpu:1",
            "metrics.host2.cpu:2",
            "metrics.host2.mem.free:3"
        ]
    );
    assert_eq!(
        drain(&star_tail),
        [
            "metrics.host2.cpu:2",
            "metrics.host2.mem.free:3",
            "logs.host2.kernel:6"
        ]
    );
}

#[test]
fn subscription_accessors_describe_it() {
    let broker = broker("");
    let plain = broker.subscribe("a.>").unwrap();
    let grouped = broker.queue_subscribe("b.*", "workers").unwrap();
    assert_eq!(plain.pattern(), "a.>");
    assert_eq!(plain.queue_group(), None);
    assert_eq!(grouped.pattern(), "b.*");
    assert_eq!(grouped.queue_group(), Some("workers"));
    assert_ne!(plain.sid(), grouped.sid());
    assert_eq!(broker.subscription_count(), 2);

    broker.publish("a.x", payload("1")).unwrap();
    broker.publish("a.y", payload("2")).unwrap();
    assert_eq!(plain.pending(), 2);
    assert_eq!(plain.stats().delivered(), 2);
    assert_eq!(plain.stats().dropped(), 0);
}

#[test]
fn dropping_a_subscription_stops_delivery() {
    let broker = broker("");
    let kept = broker.subscribe("news.*").unwrap();
    let dropped = broker.subscribe("news.*").unwrap();
    let only = broker.subscribe("sports.*").unwrap();
    broker.publish("news.a", payload("1")).unwrap();
    assert_eq!(dropped.try_recv().map(|m| text(&m)), Ok("news.a:1".into()));
    drop(dropped);
    drop(only);
    assert_eq!(broker.subscription_count(), 1);

    broker.publish("news.b", payload("2")).unwrap();
    assert_eq!(drain(&kept), ["news.a:1", "news.b:2"]);
    // With its only subscriber gone, nothing routes to sports.* any more.
    assert!(matches!(
        broker.request("sports.x", payload("?"), WAIT),
        Err(Error::NoResponders(subject)) if subject == "sports.x"
    ));
}

#[test]
fn queue_group_gives_each_message_to_exactly_one_member() {
    let broker = broker("");
    let members: Vec<Subscription> = (0..3)
        .map(|_| broker.queue_subscribe("jobs.*", "workers").unwrap())
        .collect();
    // A plain subscriber and a second group on the same pattern each get
    // their own copy of every message.
    let watcher = broker.subscribe("jobs.*").unwrap();
    let auditor = broker.queue_subscribe("jobs.*", "audit").unwrap();

    let total = 30;
    for n in 0..total {
        broker
            .publish("jobs.resize", Bytes::from(n.to_string()))
            .unwrap();
    }

    let mut seen = Vec::new();
    for member in &members {
        let got = drain(member);
        assert!(!got.is_empty(), "every member takes a share");
        seen.extend(got);
    }
    assert_eq!(seen.len(), total, "no message went to two members");
    let distinct: BTreeSet<_> = seen.iter().cloned().collect();
    let expected: BTreeSet<_> = (0..total).map(|n| format!("jobs.resize:{n}")).collect();
    assert_eq!(distinct, expected, "every message reached the group");
    assert_eq!(drain(&watcher).len(), total);
    assert_eq!(drain(&auditor).len(), total);
}

#[test]
fn request_gets_the_reply_or_no_responders() {
    let broker = Arc::new(broker(""));
    let service = broker.subscribe("svc.echo").unwrap();
    let responder = {
        let broker = broker.clone();
        std::thread::spawn(move || {
            let request = service.recv_timeout(WAIT).expect("a request");
            let reply = request.reply.clone().expect("a reply subject");
            let mut answer = b"echo:".to_vec();
            answer.extend_from_slice(&request.payload);
            broker.publish(&reply, Bytes::from(answer)).unwrap();
            request
        })
    };
    let reply = broker.request("svc.echo", payload("hi"), WAIT).unwrap();
    assert_eq!(&reply.payload[..], b"echo:hi");
    let request = responder.join().unwrap();
    assert_eq!(&*request.subject, "svc.echo");
    assert!(request.reply.as_deref().unwrap().starts_with("_INBOX."));

    assert!(matches!(
        broker.request("svc.nobody", payload("hi"), WAIT),
        Err(Error::NoResponders(subject)) if subject == "svc.nobody"
    ));
    // A subscriber that never answers: the request times out.
    let _silent = broker.subscribe("svc.silent").unwrap();
    let short = Duration::from_millis(50);
    assert!(matches!(
        broker.request("svc.silent", payload("hi"), short),
        Err(Error::Timeout(after)) if after == short
    ));
}

#[test]
fn concurrent_requests_each_get_their_own_reply_and_late_ones_are_dropped() {
    let broker = Arc::new(broker(""));
    let service = broker.subscribe("svc.echo").unwrap();
    const THREADS: usize = 4;
    const EACH: usize = 50;
    std::thread::scope(|scope| {
        let responder = scope.spawn(|| {
            let mut answered = 0;
            // The first request is answered only after its asker gave up.
            let late = service.recv_timeout(WAIT).expect("a request");
            std::thread::sleep(Duration::from_millis(300));
            let reply = late.reply.clone().expect("a reply subject");
            broker.publish(&reply, late.payload.clone()).unwrap();
            while answered < THREADS * EACH {
                let request = service.recv_timeout(WAIT).expect("a request");
                let reply = request.reply.clone().expect("a reply subject");
                broker.publish(&reply, request.payload.clone()).unwrap();
                answered += 1;
            }
        });
        assert!(matches!(
            broker.request("svc.echo", payload("late"), Duration::from_millis(20)),
            Err(Error::Timeout(_))
        ));
        let askers: Vec<_> = (0..THREADS)
            .map(|thread| {
                let broker = &broker;
                scope.spawn(move || {
                    for n in 0..EACH {
                        let asked = Bytes::from(format!("{thread}:{n}"));
                        let started = Instant::now();
                        let reply = broker.request("svc.echo", asked.clone(), WAIT).unwrap();
                        assert_eq!(reply.payload, asked, "a reply to another request");
                        // A reply handed over by the request reading the
                        // inbox wakes its own at once, not at its deadline.
                        assert!(
                            started.elapsed() < WAIT / 2,
                            "a handed reply was not noticed"
                        );
                    }
                })
            })
            .collect();
        for asker in askers {
            asker.join().unwrap();
        }
        responder.join().unwrap();
    });
}

#[test]
fn unread_replies_neither_end_nor_hold_up_the_request_inbox() {
    for policy in ["block", "disconnect"] {
        let broker = broker(&format!(
            "[limits]\nsubscription_queue = 2\n\
             [slow_consumer]\npolicy = \"{policy}\"\nblock_timeout_ms = 20000\n"
        ));
        let service = broker.subscribe("svc.chatty").unwrap();
        let (replied, all_replied) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                // Four replies to the first request, all sent while no
                // request waits: three stay unread in the inbox, one more
                // than it holds.
                let request = service.recv_timeout(WAIT).expect("a request");
                let reply = request.reply.clone().expect("a reply subject");
                for _ in 0..4 {
                    let started = Instant::now();
                    broker.publish(&reply, payload("first")).unwrap();
                    assert!(started.elapsed() < WAIT, "{policy}: a reply was held up");
                }
                replied.send(()).unwrap();
                let request = service.recv_timeout(WAIT).expect("a second request");
                let reply = request.reply.clone().expect("a reply subject");
                broker.publish(&reply, payload("second")).unwrap();
            });
            let first = broker.request("svc.chatty", payload("1"), WAIT).unwrap();
            assert_eq!(&first.payload[..], b"first");
            all_replied
                .recv_timeout(2 * WAIT)
                .expect("the first replies");
            let second = broker.request("svc.chatty", payload("2"), WAIT).unwrap();
            assert_eq!(&second.payload[..], b"second", "{policy}");
        });
        let stats = broker.stats();
        assert_eq!(
            stats
                .slow_consumer_disconnects
                .load(std::sync::atomic::Ordering::Relaxed),
            0,
            "{policy}"
        );
    }
}

#[test]
fn publish_request_carries_the_reply_subject() {
    let broker = broker("");
    let sub = broker.subscribe("ask").unwrap();
    broker
        .publish_request("ask", "answers.here", payload("q"))
        .unwrap();
    let message = sub.recv_timeout(WAIT).unwrap();
    assert_eq!(message.reply.as_deref(), Some("answers.here"));
}

fn subject_error(result: Result<impl std::fmt::Debug, Error>) -> SubjectError {
    match result {
        Err(Error::Subject { source, .. }) => source,
        other => panic!("expected a subject error, got {other:?}"),
    }
}

#[test]
fn invalid_subjects_and_patterns_are_typed_errors() {
    let broker = broker("[limits]\nmax_subject_len = 64\nmax_subject_tokens = 3\n");
    assert_eq!(
        subject_error(broker.publish("", payload(""))),
        SubjectError::Empty
    );
    assert_eq!(
        subject_error(broker.publish("a..b", payload(""))),
        SubjectError::EmptyToken { index: 1 }
    );
    assert_eq!(
        subject_error(broker.publish("a.*", payload(""))),
        SubjectError::WildcardInSubject { index: 1 }
    );
    assert_eq!(
        subject_error(broker.publish("a b", payload(""))),
        SubjectError::Whitespace { index: 0, ch: ' ' }
    );
    assert_eq!(
        subject_error(broker.publish("a.b.c.d", payload(""))),
        SubjectError::TooDeep { tokens: 4, max: 3 }
    );
    assert!(matches!(
        subject_error(broker.publish(&"a".repeat(65), payload(""))),
        SubjectError::TooLong { len: 65, max: 64 }
    ));
    // The reply subject is checked too, and named in the error.
    match broker.publish_request("ok", "bad.>", payload("")) {
        Err(Error::Subject { subject, source }) => {
            assert_eq!(subject, "bad.>");
            assert_eq!(source, SubjectError::WildcardInSubject { index: 1 });
        }
        other => panic!("expected a reply subject error, got {other:?}"),
    }

    assert_eq!(
        subject_error(broker.subscribe("a.>.b")),
        SubjectError::FullWildcardNotLast { index: 1 }
    );
    assert_eq!(
        subject_error(broker.subscribe("a.")),
        SubjectError::EmptyToken { index: 1 }
    );
    match broker.queue_subscribe("a.*", "two words") {
        Err(Error::Subscription { pattern, source }) => {
            assert_eq!(pattern, "a.*");
            assert_eq!(
                source,
                IndexError::QueueName(QueueNameError::Whitespace { offset: 3, ch: ' ' })
            );
        }
        other => panic!("expected a queue name error, got {other:?}"),
    }
    // Nothing invalid was registered.
    assert_eq!(broker.subscription_count(), 0);
    match broker.request("a.*", payload(""), WAIT) {
        Err(Error::Subject { subject, .. }) => assert_eq!(subject, "a.*"),
        other => panic!("expected a subject error, got {other:?}"),
    }
}

#[test]
fn payload_over_the_limit_is_rejected() {
    let broker = broker("[limits]\nmax_payload = 1024\n");
    let sub = broker.subscribe("big").unwrap();
    broker.publish("big", vec![7u8; 1024]).unwrap();
    match broker.publish("big", vec![7u8; 1025]) {
        Err(Error::PayloadTooLarge { len, max }) => assert_eq!((len, max), (1025, 1024)),
        other => panic!("expected PayloadTooLarge, got {other:?}"),
    }
    assert_eq!(sub.recv_timeout(WAIT).unwrap().payload.len(), 1024);
    assert_eq!(sub.try_recv(), Err(RecvError::Empty));
}

#[test]
fn in_process_subscribers_get_the_published_buffer_itself() {
    let broker = broker("");
    let first = broker.subscribe("zc.>").unwrap();
    let second = broker.subscribe("zc.data").unwrap();
    let data = Bytes::from(vec![42u8; 64 * 1024]);
    broker.publish("zc.data", data.clone()).unwrap();
    for sub in [&first, &second] {
        let message = sub.recv_timeout(WAIT).unwrap();
        assert_eq!(message.payload.as_ptr(), data.as_ptr(), "not copied");
        assert_eq!(message.payload.len(), data.len());
    }
}

#[test]
fn drop_oldest_keeps_the_newest_and_counts_drops() {
    let broker =
        broker("[limits]\nsubscription_queue = 4\n[slow_consumer]\npolicy = \"drop-oldest\"\n");
    let sub = broker.subscribe("tick").unwrap();
    for n in 0..10 {
        broker.publish("tick", Bytes::from(n.to_string())).unwrap();
    }
    assert_eq!(sub.stats().dropped(), 6);
    assert_eq!(
        drain(&sub),
        ["tick:6", "tick:7", "tick:8", "tick:9"],
        "the newest messages are kept, in order"
    );
    assert_eq!(
        broker
            .stats()
            .slow_consumer_drops
            .load(std::sync::atomic::Ordering::Relaxed),
        6
    );
}

#[test]
fn disconnect_policy_ends_the_subscription() {
    let broker =
        broker("[limits]\nsubscription_queue = 2\n[slow_consumer]\npolicy = \"disconnect\"\n");
    let slow = broker.subscribe("tick").unwrap();
    let fine = broker.subscribe("tick").unwrap();
    for n in 0..3 {
        broker.publish("tick", Bytes::from(n.to_string())).unwrap();
        // The other subscriber keeps up and is not affected.
        assert_eq!(fine.try_recv().map(|m| text(&m)), Ok(format!("tick:{n}")));
    }
    assert_eq!(slow.stats().dropped(), 1);
    broker.publish("tick", payload("3")).unwrap();
    assert_eq!(fine.try_recv().map(|m| text(&m)), Ok("tick:3".into()));
    // What was queued before the cut stays readable, then the end shows.
    assert_eq!(
        slow.recv_timeout(WAIT).map(|m| text(&m)),
        Ok("tick:0".into())
    );
    assert_eq!(
        slow.recv_timeout(WAIT).map(|m| text(&m)),
        Ok("tick:1".into())
    );
    assert_eq!(slow.recv_timeout(WAIT), Err(RecvError::Closed));
}

#[test]
fn block_policy_waits_then_drops_after_the_timeout() {
    let block_timeout = Duration::from_millis(100);
    let broker = broker(&format!(
        "[limits]\nsubscription_queue = 1\n[slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = {}\n",
        block_timeout.as_millis()
    ));
    let sub = broker.subscribe("tick").unwrap();
    broker.publish("tick", payload("0")).unwrap();
    let started = Instant::now();
    // Nobody reads: the publisher waits the block timeout, then the message
    // is dropped and counted; publish itself does not fail.
    broker.publish("tick", payload("1")).unwrap();
    assert!(started.elapsed() >= block_timeout, "the publisher waited");
    assert_eq!(sub.stats().dropped(), 1);
    assert_eq!(drain(&sub), ["tick:0"]);
}

#[test]
fn block_policy_delivers_when_the_reader_makes_room() {
    let broker = broker(
        "[limits]\nsubscription_queue = 1\n[slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 30000\n",
    );
    let sub = broker.subscribe("tick").unwrap();
    broker.publish("tick", payload("0")).unwrap();
    let reader = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        let got: Vec<String> = (0..3)
            .map(|_| text(&sub.recv_timeout(WAIT).expect("message")))
            .collect();
        (got, sub.stats().dropped())
    });
    // Each publish waits for the reader to take the one queued message.
    broker.publish("tick", payload("1")).unwrap();
    broker.publish("tick", payload("2")).unwrap();
    let (got, dropped) = reader.join().unwrap();
    assert_eq!(got, ["tick:0", "tick:1", "tick:2"]);
    assert_eq!(dropped, 0);
}

#[test]
fn flush_succeeds_and_fails_after_shutdown() {
    let broker = broker("");
    broker.flush(WAIT).unwrap();
    broker.shutdown();
    assert!(broker.is_shut_down());
    assert!(matches!(broker.flush(WAIT), Err(Error::Closed)));
}

#[test]
fn shutdown_ends_subscriptions_after_what_is_queued() {
    let broker = broker("");
    let sub = broker.subscribe("s.>").unwrap();
    let other = broker.subscribe("s.one").unwrap();
    for subject in ["s.one", "s.two", "s.three"] {
        broker.publish(subject, payload("x")).unwrap();
    }
    broker.shutdown();
    let mut sub = sub;
    // Iteration yields what was queued, then ends.
    let seen: Vec<String> = sub.by_ref().map(|m| text(&m)).collect();
    assert_eq!(seen, ["s.one:x", "s.two:x", "s.three:x"]);
    assert_eq!(sub.recv_timeout(WAIT), Err(RecvError::Closed));
    assert_eq!(sub.try_recv(), Err(RecvError::Closed));
    assert_eq!(
        other.recv_timeout(WAIT).map(|m| text(&m)),
        Ok("s.one:x".into())
    );
    assert_eq!(other.recv(), Err(RecvError::Closed));

    assert!(matches!(
        broker.publish("s.one", payload("x")),
        Err(Error::Closed)
    ));
    assert!(matches!(broker.subscribe("s.>"), Err(Error::Closed)));
    // A second shutdown is harmless.
    broker.shutdown();
}

#[test]
fn dropping_the_broker_ends_subscriptions() {
    let broker = broker("");
    let sub = broker.subscribe("x").unwrap();
    drop(broker);
    assert_eq!(sub.recv_timeout(WAIT), Err(RecvError::Closed));
}

#[test]
fn subscription_is_an_iterator() {
    let broker = broker("");
    let mut sub = broker.subscribe("seq").unwrap();
    for n in 0..5 {
        broker.publish("seq", Bytes::from(n.to_string())).unwrap();
    }
    let first: Vec<String> = sub.by_ref().take(3).map(|m| text(&m)).collect();
    assert_eq!(first, ["seq:0", "seq:1", "seq:2"]);
    // Iterator adaptors compose; the subscription stays usable after.
    let lens: usize = sub.by_ref().take(2).map(|m| m.payload.len()).sum();
    assert_eq!(lens, 2);
    assert_eq!(sub.try_recv(), Err(RecvError::Empty));
}

#[test]
fn each_publisher_thread_keeps_its_order() {
    let broker = Arc::new(broker(""));
    let sub = broker.subscribe("fifo.*").unwrap();
    let per_thread = 2_000u32;
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let broker = broker.clone();
            std::thread::spawn(move || {
                let subject = format!("fifo.{t}");
                for n in 0..per_thread {
                    broker
                        .publish(&subject, Bytes::copy_from_slice(&n.to_le_bytes()))
                        .unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    let mut next = [0u32; 4];
    for _ in 0..4 * per_thread {
        let message = sub.recv_timeout(WAIT).unwrap();
        let t: usize = message.subject["fifo.".len()..].parse().unwrap();
        let n = u32::from_le_bytes(message.payload[..].try_into().unwrap());
        assert_eq!(n, next[t], "publisher {t} out of order");
        next[t] += 1;
    }
    assert_eq!(next, [per_thread; 4]);
}

/// Code written once against [`PubSub`] runs on the embedded broker.
fn ping_pong(bus: &dyn PubSub) -> Result<Message, Error> {
    let sub = bus.subscribe("generic.>")?;
    bus.publish("generic.hello", Bytes::from_static(b"world"))?;
    bus.flush(WAIT)?;
    sub.recv_timeout(WAIT).map_err(|_| Error::Timeout(WAIT))
}

#[test]
fn the_pubsub_trait_drives_the_broker() {
    let broker = broker("");
    let message = ping_pong(&broker).unwrap();
    assert_eq!(text(&message), "generic.hello:world");
}

/// Fails to compile unless `T` may be shared between threads.
fn assert_send_sync<T: Send + Sync>() {}
/// Fails to compile unless `T` may be moved to another thread.
fn assert_send<T: Send>() {}

#[test]
fn handles_are_thread_safe() {
    assert_send_sync::<Broker>();
    assert_send_sync::<Client>();
    assert_send_sync::<Arc<dyn PubSub>>();
    assert_send::<Subscription>();
    assert_send_sync::<Message>();
    assert_send_sync::<Error>();
}

/// A broker listening on loopback TCP, for a client of it.
fn tcp_broker() -> (Broker, String) {
    let text = "name = \"embedded-test\"\nlisten = [\"tcp/127.0.0.1:0\"]\n";
    let config = efabus_broker::Config::from_toml_str(text, "embedded test").unwrap();
    let broker = Broker::start(config).unwrap();
    let endpoint = broker.endpoint("tcp").expect("a tcp listener");
    (broker, endpoint)
}

#[test]
fn a_responder_answers_in_process_requests_and_client_requests() {
    let (broker, endpoint) = tcp_broker();
    let responder = broker
        .respond("svc.upper", |request| {
            Some(Bytes::from(request.payload.to_ascii_uppercase()))
        })
        .unwrap();
    // In process: answered on the requesting thread.
    let reply = broker.request("svc.upper", payload("hi"), WAIT).unwrap();
    assert_eq!(&reply.payload[..], b"HI");
    // From a client: answered on the event loop.
    let client = Client::connect(&endpoint).unwrap();
    let reply = client.request("svc.upper", payload("there"), WAIT).unwrap();
    assert_eq!(&reply.payload[..], b"THERE");
    assert_eq!(responder.stats().delivered(), 2);
    assert_eq!(responder.stats().dropped(), 0);
}

#[test]
fn a_responder_sees_plain_messages_and_answers_only_requests() {
    let broker = broker("");
    let seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = seen.clone();
    let _responder = broker
        .respond("svc.>", move |_| {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(payload("answer"))
        })
        .unwrap();
    // A reply subject the responder's own pattern matches: the reply reaches
    // it too, and makes no further reply (it has no reply subject).
    let watcher = broker.subscribe("svc.replies").unwrap();
    broker.publish("svc.plain", payload("x")).unwrap();
    broker
        .publish_request("svc.ask", "svc.replies", payload("y"))
        .unwrap();
    let reply = watcher.recv_timeout(WAIT).unwrap();
    assert_eq!(text(&reply), "svc.replies:answer");
    assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 3);
    assert!(watcher.recv_timeout(Duration::from_millis(100)).is_err());
}

#[test]
fn a_handler_that_panics_loses_its_reply_and_the_broker_goes_on() {
    let (broker, endpoint) = tcp_broker();
    let responder = broker
        .respond("svc.fragile", |request| {
            assert!(&request.payload[..] != b"boom", "the handler fails");
            Some(request.payload.clone())
        })
        .unwrap();
    let client = Client::connect(&endpoint).unwrap();
    // On the event loop and on a publishing thread.
    let lost = client.request("svc.fragile", payload("boom"), Duration::from_millis(300));
    assert!(matches!(lost, Err(Error::Timeout(_))), "{lost:?}");
    let lost = broker.request("svc.fragile", payload("boom"), Duration::from_millis(300));
    assert!(matches!(lost, Err(Error::Timeout(_))), "{lost:?}");
    assert_eq!(responder.stats().dropped(), 2);
    let reply = client.request("svc.fragile", payload("ok"), WAIT).unwrap();
    assert_eq!(&reply.payload[..], b"ok");
    let reply = broker.request("svc.fragile", payload("ok"), WAIT).unwrap();
    assert_eq!(&reply.payload[..], b"ok");
}

#[test]
fn a_dropped_responder_answers_nothing_more() {
    let broker = broker("");
    let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = calls.clone();
    let responder = broker
        .respond("svc.once", move |request| {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(request.payload.clone())
        })
        .unwrap();
    // The publishing thread's cached route to it is warm.
    broker.request("svc.once", payload("a"), WAIT).unwrap();
    drop(responder);
    let after = broker.request("svc.once", payload("b"), Duration::from_millis(200));
    assert!(
        matches!(after, Err(Error::NoResponders(_)) | Err(Error::Timeout(_))),
        "{after:?}"
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 1);
}

#[test]
fn replies_go_out_through_the_broker_whose_responder_made_them() {
    let a = broker("");
    let b = Arc::new(broker(""));
    let on_b = b.subscribe("notes").unwrap();
    // Two handlers that publish through another broker: whichever runs
    // second does so while the first one's reply waits to be published
    // through `a`.
    let handler = |name: &'static str| {
        let b = b.clone();
        move |_: &Message| {
            b.publish("notes", payload(name)).unwrap();
            Some(payload(name))
        }
    };
    let _first = a.respond("svc.x", handler("first")).unwrap();
    let _second = a.respond("svc.x", handler("second")).unwrap();
    let replies = a.subscribe("replies").unwrap();
    a.publish_request("svc.x", "replies", payload("?")).unwrap();
    let mut got: Vec<String> = (0..2)
        .map(|_| text(&replies.recv_timeout(WAIT).unwrap()))
        .collect();
    got.sort();
    assert_eq!(got, ["replies:first", "replies:second"]);
    let mut notes = drain(&on_b);
    notes.sort();
    assert_eq!(notes, ["notes:first", "notes:second"]);
}

#[test]
fn a_reply_over_the_payload_limit_is_dropped_and_counted() {
    let text = "name = \"embedded-test\"\nlisten = [\"tcp/127.0.0.1:0\"]\n\
                [limits]\nmax_payload = 100\n";
    let config = efabus_broker::Config::from_toml_str(text, "embedded test").unwrap();
    let broker = Broker::start(config).unwrap();
    let responder = broker
        .respond("svc.big", |_| Some(Bytes::from(vec![0u8; 200])))
        .unwrap();
    let client = Client::connect(&broker.endpoint("tcp").unwrap()).unwrap();
    let short = Duration::from_millis(300);
    // On a publishing thread and on the event loop.
    let lost = broker.request("svc.big", payload("?"), short);
    assert!(matches!(lost, Err(Error::Timeout(_))), "{lost:?}");
    let lost = client.request("svc.big", payload("?"), short);
    assert!(matches!(lost, Err(Error::Timeout(_))), "{lost:?}");
    assert_eq!(responder.stats().dropped(), 2);
}

/// A responder's handler that owns a subscription is dropped with the
/// responder, not where the last reference to its sink goes: a
/// publisher's cache still held the sink, and dropping the handler while
/// refreshing that cache under the subscription table's lock made the
/// captured subscription's unsubscribe wait for that lock for ever.
#[test]
fn a_handler_owning_a_subscription_is_dropped_without_a_deadlock() {
    let broker = Arc::new(broker(""));
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn({
        let broker = Arc::clone(&broker);
        move || {
            let owned = broker.subscribe("events").expect("subscribes");
            let responder = broker
                .respond("svc", move |_| {
                    let _ = owned.pending();
                    None
                })
                .expect("responds");
            // This thread's cache now holds the responder's sink.
            broker.publish("svc", &b"one"[..]).expect("publish");
            drop(responder);
            // The cache is refreshed: the sink's last reference goes.
            broker.publish("svc", &b"two"[..]).expect("publish");
            broker.publish("other", &b"three"[..]).expect("publish");
            let _ = done.send(());
        }
    });
    if finished.recv_timeout(WAIT).is_err() {
        // A thread stuck holding the table's lock would hold up the
        // broker's shutdown too.
        std::mem::forget(broker);
        panic!("publishing after dropping the responder hung");
    }
    assert_eq!(broker.subscription_count(), 0, "both gone");
}

/// Requests made at once share their handle's inbox, which holds more
/// replies than a lowered `limits.subscription_queue`: replies still
/// waited for are not dropped for the room.
#[test]
fn concurrent_requests_get_their_replies_with_a_small_subscription_queue() {
    let broker = Arc::new(broker("[limits]\nsubscription_queue = 2\n"));
    let _echo = broker
        .respond("svc.echo", |request| Some(request.payload.clone()))
        .expect("responds");
    std::thread::scope(|scope| {
        for thread in 0..16u32 {
            let broker = &broker;
            scope.spawn(move || {
                for n in 0..200u32 {
                    let payload = Bytes::from(format!("{thread}-{n}"));
                    let reply = broker
                        .request("svc.echo", payload.clone(), WAIT)
                        .expect("a reply");
                    assert_eq!(reply.payload, payload);
                }
            });
        }
    });
}
