//! The embedded broker's fast path: a publishing thread reuses its last
//! route while the subscriptions stay the same, and subscription queues hand
//! messages out in batches. These tests check that every change to the
//! subscriptions is seen by the next publish, from any thread and with
//! several brokers in one process, and that batching keeps order, subjects
//! and the bound.

mod embedded_common;

use std::sync::atomic::Ordering;

use bytes::Bytes;
use efabus_broker::Subscription;
use embedded_common::{broker, drain, text, WAIT};

fn payload(n: usize) -> Bytes {
    Bytes::from(n.to_string())
}

#[test]
fn a_new_subscription_is_seen_by_the_next_publish() {
    let broker = broker("");
    let first = broker.subscribe("feed").unwrap();
    broker.publish("feed", payload(0)).unwrap();
    let second = broker.subscribe("feed").unwrap();
    broker.publish("feed", payload(1)).unwrap();
    // A wildcard subscription made on another thread counts too.
    let wide =
        std::thread::scope(|scope| scope.spawn(|| broker.subscribe(">")).join().unwrap()).unwrap();
    broker.publish("feed", payload(2)).unwrap();
    assert_eq!(drain(&first), ["feed:0", "feed:1", "feed:2"]);
    assert_eq!(drain(&second), ["feed:1", "feed:2"]);
    assert_eq!(drain(&wide), ["feed:2"]);
}

#[test]
fn a_dropped_subscription_gets_nothing_more_and_others_everything() {
    let broker = broker("");
    let stays = broker.subscribe("feed").unwrap();
    let leaves = broker.subscribe("feed").unwrap();
    for n in 0..3 {
        broker.publish("feed", payload(n)).unwrap();
    }
    let stats = (leaves.stats().delivered(), leaves.pending());
    assert_eq!(stats, (3, 3));
    drop(leaves);
    for n in 3..6 {
        broker.publish("feed", payload(n)).unwrap();
    }
    assert_eq!(broker.subscription_count(), 1);
    assert_eq!(drain(&stays).len(), 6);
    // Nobody is left: publishing still succeeds and reaches no one.
    drop(stays);
    broker.publish("feed", payload(6)).unwrap();
    assert_eq!(broker.subscription_count(), 0);
    assert_eq!(
        broker
            .stats()
            .slow_consumer_disconnects
            .load(Ordering::Relaxed),
        0,
        "leaving is not being cut off"
    );
}

#[test]
fn queue_group_members_still_take_turns_from_one_thread() {
    let broker = broker("");
    let members: Vec<Subscription> = (0..2)
        .map(|_| broker.queue_subscribe("jobs", "workers").unwrap())
        .collect();
    for n in 0..10 {
        broker.publish("jobs", payload(n)).unwrap();
    }
    let shares: Vec<usize> = members.iter().map(|m| drain(m).len()).collect();
    assert_eq!(shares, [5, 5], "members alternate");
}

#[test]
fn two_brokers_in_one_thread_keep_their_own_subscribers() {
    let left = broker("");
    let right = broker("");
    let on_left = left.subscribe("same.subject").unwrap();
    let on_right = right.subscribe("same.subject").unwrap();
    for n in 0..4 {
        let broker = if n % 2 == 0 { &left } else { &right };
        broker.publish("same.subject", payload(n)).unwrap();
    }
    assert_eq!(drain(&on_left), ["same.subject:0", "same.subject:2"]);
    assert_eq!(drain(&on_right), ["same.subject:1", "same.subject:3"]);
    // A broker started after another was dropped does not inherit routes.
    drop(left);
    let again = broker("");
    let on_again = again.subscribe("same.subject").unwrap();
    again.publish("same.subject", payload(9)).unwrap();
    assert_eq!(drain(&on_again), ["same.subject:9"]);
    assert!(drain(&on_right).is_empty());
}

#[test]
fn subjects_are_right_when_a_thread_switches_between_them() {
    let broker = broker("");
    let all = broker.subscribe("s.>").unwrap();
    let subjects = ["s.a", "s.b", "s.b", "s.a", "s.c.d", "s.a"];
    for (n, subject) in subjects.iter().enumerate() {
        broker.publish(subject, payload(n)).unwrap();
    }
    broker
        .publish_request("s.a", "reply.here", payload(6))
        .unwrap();
    broker.publish("s.a", payload(7)).unwrap();
    let got: Vec<(String, Option<String>)> = std::iter::from_fn(|| all.try_recv().ok())
        .map(|m| (text(&m), m.reply.as_deref().map(str::to_string)))
        .collect();
    let expected: Vec<(String, Option<String>)> = subjects
        .iter()
        .enumerate()
        .map(|(n, s)| (format!("{s}:{n}"), None))
        .chain([
            ("s.a:6".to_string(), Some("reply.here".to_string())),
            ("s.a:7".to_string(), None),
        ])
        .collect();
    assert_eq!(got, expected);
}

#[test]
fn a_cut_off_subscriber_is_counted_once() {
    let broker =
        broker("[limits]\nsubscription_queue = 2\n[slow_consumer]\npolicy = \"disconnect\"\n");
    let slow = broker.subscribe("tick").unwrap();
    for n in 0..6 {
        broker.publish("tick", payload(n)).unwrap();
    }
    assert_eq!(
        broker
            .stats()
            .slow_consumer_disconnects
            .load(Ordering::Relaxed),
        1
    );
    assert_eq!(slow.stats().dropped(), 1);
    assert_eq!(broker.subscription_count(), 0);
    assert_eq!(drain(&slow), ["tick:0", "tick:1"]);
}

#[test]
fn a_stream_between_threads_arrives_whole_and_in_order_within_the_bound() {
    let broker = broker(
        "[limits]\nsubscription_queue = 64\n[slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 30000\n",
    );
    let sub = broker.subscribe("stream").unwrap();
    let total = 50_000;
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut most_pending = 0;
            for n in 0..total {
                let message = sub.recv_timeout(WAIT).expect("message");
                assert_eq!(message.payload, payload(n));
                assert_eq!(&*message.subject, "stream");
                most_pending = most_pending.max(sub.pending());
            }
            most_pending
        });
        for n in 0..total {
            broker.publish("stream", payload(n)).unwrap();
        }
        let most_pending = reader.join().unwrap();
        assert!(
            most_pending <= 64,
            "at most the bound waits: {most_pending}"
        );
    });
    assert_eq!(sub.stats().delivered(), total as u64);
    assert_eq!(sub.stats().dropped(), 0);
}

#[test]
fn a_subscription_is_read_from_several_threads_exactly_once() {
    let broker = broker("");
    let sub = broker.subscribe("work").unwrap();
    let total = 20_000;
    let mut seen: Vec<usize> = std::thread::scope(|scope| {
        let readers: Vec<_> = (0..3)
            .map(|_| {
                scope.spawn(|| {
                    let mut got = Vec::new();
                    loop {
                        let message = sub.recv_timeout(WAIT).expect("message");
                        // An empty payload tells one reader to stop.
                        if message.payload.is_empty() {
                            break;
                        }
                        let n: usize = std::str::from_utf8(&message.payload)
                            .expect("utf-8")
                            .parse()
                            .expect("number");
                        got.push(n);
                    }
                    // Each reader sees its share in publish order.
                    assert!(got.windows(2).all(|w| w[0] < w[1]), "in order");
                    got
                })
            })
            .collect();
        for n in 0..total {
            broker.publish("work", payload(n)).unwrap();
        }
        for _ in 0..3 {
            broker.publish("work", Bytes::new()).unwrap();
        }
        readers
            .into_iter()
            .flat_map(|reader| reader.join().unwrap())
            .collect()
    });
    seen.sort_unstable();
    assert_eq!(seen, (0..total).collect::<Vec<_>>());
}
