//! A stream of numbered best-effort messages published while a test
//! watches what arrives: for paths that change under a running stream.

#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_broker::{Broker, Subscription};

/// Messages published together each millisecond: enough that some wait
/// on a path when it changes.
const PER_MILLISECOND: u64 = 16;

/// Longest a stream waits for its next message or its end.
const WAIT: Duration = Duration::from_secs(10);

/// What a stream published and what arrived of it.
#[derive(Debug)]
pub struct Streamed {
    pub published: u64,
    pub received: u64,
}

/// The numbers taken so far: each higher than the one before.
#[derive(Default)]
struct InOrder {
    last: Option<u64>,
    received: u64,
}

impl InOrder {
    /// Takes `message`; true when it is the stream's end.
    fn take(&mut self, message: &efabus_broker::Message) -> bool {
        if &*message.subject == "stream.end" {
            return true;
        }
        let n = u64::from_le_bytes(message.payload[..8].try_into().expect("8 bytes"));
        assert!(
            self.last.is_none_or(|last| last < n),
            "message {n} after {:?}: out of order or twice",
            self.last
        );
        self.last = Some(n);
        self.received += 1;
        false
    }
}

/// A 64-byte payload carrying `n`.
fn numbered(n: u64) -> Bytes {
    let mut payload = n.to_le_bytes().to_vec();
    payload.resize(64, 0xab);
    payload.into()
}

/// Publishes numbered messages on `stream.data` from `broker`, 16 a
/// millisecond on a thread of their own, while `sub` (subscribed to
/// `stream.>`) takes them here, each a higher number than the one before
/// (none twice, none out of order), and `done` is asked after each
/// whether the stream may end (given how many arrived so far). Then the
/// publisher stops, and a message on `stream.end` is published and waited
/// for: everything published before it has arrived or been given up.
/// `deadline` bounds the whole stream.
pub fn stream_until(
    broker: &Broker,
    sub: &Subscription,
    deadline: Instant,
    mut done: impl FnMut(u64) -> bool,
) -> Streamed {
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let publisher = scope.spawn(|| {
            let mut published = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..PER_MILLISECOND {
                    broker
                        .publish("stream.data", numbered(published))
                        .expect("the broker takes the publish");
                    published += 1;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            published
        });
        let mut order = InOrder::default();
        let stopping = loop {
            if Instant::now() >= deadline {
                break Err("the stream's end was not reached in time");
            }
            match sub.recv_timeout(WAIT) {
                Ok(message) => {
                    order.take(&message);
                }
                Err(err) => panic!("no message within {WAIT:?}: {err}"),
            }
            if done(order.received) {
                break Ok(());
            }
        };
        stop.store(true, Ordering::Relaxed);
        let published = publisher.join().expect("the publisher ends");
        if let Err(why) = stopping {
            panic!("{why}: {} of {published} arrived", order.received);
        }
        broker
            .publish("stream.end", Bytes::new())
            .expect("the broker takes the publish");
        loop {
            let message = sub
                .recv_timeout(WAIT)
                .unwrap_or_else(|err| panic!("the stream's end did not arrive: {err}"));
            if order.take(&message) {
                break;
            }
        }
        Streamed {
            published,
            received: order.received,
        }
    })
}
