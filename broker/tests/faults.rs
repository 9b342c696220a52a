//! What efabus promises under injected faults, tested with the seeded
//! fault injector (`efabus_transports::fault`) over in-process endpoints.
//!
//! - Broker: frames cut short or corrupted on the way in are refused by
//!   the decoder without a panic; their sender gets an error frame and is
//!   closed; every other peer carries on and sees nothing of them.
//! - Reliable link class (sequenced, not lossy) over a link that reorders,
//!   delays and duplicates: every frame delivered exactly once, in order,
//!   with the reorder buffer within its window.
//! - Best-effort link class (sequenced, lossy) over a link that also drops,
//!   with fragmentation at a 1472-byte frame limit: only whole frames, each
//!   at most once, in increasing order; partial messages freed after the
//!   timeout; losses counted.
//!
//! - Broker: a peer that sends requests (pings) and reads none of the
//!   answers is disconnected once they fill its queue; a peer that reads
//!   nothing and is being closed is closed after the drain time, what was
//!   queued for it counted; one address cannot hold more than 256
//!   connections that never say hello.
//!
//! Time in the link tests is virtual (a base `Instant` plus a step count),
//! so timeouts are exercised without sleeping.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_broker::config::Faults;
use efabus_broker::{
    Broker, Client, ClientOptions, Config, ConnectionState, EndpointCall, Error, RecvError,
};
use efabus_core::budget::MemoryBudget;
use efabus_core::codec::{self, CodecLimits};
use efabus_core::fragment::ReassemblyConfig;
use efabus_core::frame::{ErrorCode, Frame, Publish};
use efabus_core::link::{LinkConfig, LinkReceiver, LinkSender};
use efabus_core::transport::{
    CloseReason, Endpoint, EndpointConfig, Event, OutFrame, PeerId, SendError, Transport,
};
use efabus_transports::fault::{
    FaultConfig, FaultDirection, FaultTransport, FaultyEndpoint, SharedFaultStats,
};
use efabus_transports::mem::MemTransport;
use efabus_transports::registry::Registry;

mod raw_common;

/// Bound on every wait; things normally happen at once.
const WAIT: Duration = Duration::from_secs(10);

static NEXT_NAME: AtomicU64 = AtomicU64::new(0);

fn fresh_name(tag: &str) -> String {
    format!(
        "faults-{tag}-{}-{}",
        std::process::id(),
        NEXT_NAME.fetch_add(1, Ordering::Relaxed)
    )
}

// ------------------------------------------------------------ broker level

/// A peer speaking the wire protocol by hand over a plain mem endpoint.
struct RawPeer {
    ep: Box<dyn Endpoint>,
    peer: PeerId,
    frames: Vec<Frame>,
    undecodable: usize,
    closed: Option<CloseReason>,
}

impl RawPeer {
    fn connect(name: &str) -> RawPeer {
        let mut ep = MemTransport
            .open(&EndpointConfig::default())
            .expect("open mem");
        let peer = ep.connect(name).expect("connect to the broker");
        RawPeer {
            ep,
            peer,
            frames: Vec::new(),
            undecodable: 0,
            closed: None,
        }
    }

    /// Send a frame; the broker may have closed the link already.
    fn send(&mut self, frame: &Frame) {
        match self.ep.send(self.peer, codec::encode(frame)) {
            Ok(()) | Err(SendError::Closed(_)) => {}
            Err(err) => panic!("send to the broker: {err}"),
        }
    }

    fn hello(&mut self, name: &str) {
        self.send(&raw_common::client_hello(name));
    }

    fn publish(&mut self, subject: &str, payload: &'static [u8]) {
        self.send(&Frame::Publish(Publish {
            headers: None,
            subject: subject.to_string(),
            reply: None,
            seq: 0,
            payload: Bytes::from_static(payload),
        }));
    }

    fn pump(&mut self) {
        let mut events = Vec::new();
        self.ep.poll(&mut events).expect("poll");
        for event in events {
            match event {
                Event::Frame { frame, .. } => match codec::decode(frame, &CodecLimits::default()) {
                    Ok(frame) => self.frames.push(frame),
                    Err(_) => self.undecodable += 1,
                },
                Event::Closed { reason, .. } => self.closed = Some(reason),
                _ => {}
            }
        }
    }

    /// Poll until the broker closes the link, or for `quiet` when it does
    /// not; returns whether it closed.
    fn wait_closed(&mut self, quiet: Duration) -> bool {
        let deadline = Instant::now() + quiet;
        while self.closed.is_none() && Instant::now() < deadline {
            self.pump();
            thread::sleep(Duration::from_millis(1));
        }
        self.closed.is_some()
    }

    fn error_codes(&self) -> Vec<(ErrorCode, bool)> {
        self.frames
            .iter()
            .filter_map(|frame| match frame {
                Frame::Error(error) => Some((error.code, error.fatal)),
                _ => None,
            })
            .collect()
    }
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(1));
    }
}

/// `[testing.faults]` from the config file: with every received frame cut
/// short, each remote peer's hello is refused as malformed and the peer is
/// closed, while in-process traffic (which never crosses an endpoint)
/// carries on untouched.
#[test]
fn truncated_frames_get_an_error_and_close_only_their_sender() {
    let name = fresh_name("truncate");
    let text = format!(
        "name = \"faults\"\nlisten = [\"mem/{name}\"]\n\
         [testing.faults]\nseed = 17\ntruncate = 1.0\n"
    );
    let config = Config::from_toml_str(&text, "faults test").expect("valid config");
    let broker = Broker::start(config).expect("broker starts");
    let everything = broker.subscribe(">").expect("subscribe");

    const ATTACKERS: u64 = 5;
    for i in 0..ATTACKERS {
        let mut raw = RawPeer::connect(&name);
        raw.hello(&format!("attacker-{i}"));
        raw.publish("evil.x", b"should never arrive");
        assert!(raw.wait_closed(WAIT), "attacker {i} not closed");
        assert_eq!(
            raw.error_codes(),
            vec![(ErrorCode::Malformed, true)],
            "attacker {i}: one fatal malformed-frame error, then closed"
        );
        assert_eq!(raw.closed, Some(CloseReason::PeerClosed));
        assert_eq!(raw.undecodable, 0, "the broker's own frames are intact");
        assert!(
            !raw.frames.iter().any(|f| matches!(f, Frame::Welcome(_))),
            "no welcome for a malformed hello"
        );
    }
    let stats = broker.stats();
    wait_for("connections to be released", || {
        stats.connections.load(Ordering::Relaxed) == 0
    });
    assert_eq!(stats.bad_frames.load(Ordering::Relaxed), ATTACKERS);
    assert_eq!(stats.connections_total.load(Ordering::Relaxed), ATTACKERS);

    broker.publish("good.1", &b"fine"[..]).expect("publish");
    let message = everything.recv_timeout(WAIT).expect("in-process delivery");
    assert_eq!(
        (&*message.subject, &message.payload[..]),
        ("good.1", &b"fine"[..])
    );
    assert_eq!(everything.try_recv().unwrap_err(), RecvError::Empty);
    broker.shutdown();
}

/// A subscription id given twice: the second is refused (not fatal) and
/// the first stays as it was, in what is delivered and in what the broker
/// reports of the connection.
#[test]
fn a_subscription_id_given_twice_keeps_the_first() {
    let name = fresh_name("duplicate-sid");
    let config = Config::from_toml_str(&format!("listen = [\"mem/{name}\"]\n"), "duplicate sid")
        .expect("valid config");
    let broker = Broker::start(config).expect("broker starts");
    let mut raw = RawPeer::connect(&name);
    raw.hello("twice");
    for pattern in ["dup.first", "dup.second"] {
        raw.send(&raw_common::subscribe(1, pattern));
    }
    wait_for("the refusal", || {
        raw.pump();
        !raw.error_codes().is_empty()
    });
    assert_eq!(raw.error_codes(), vec![(ErrorCode::Protocol, false)]);
    let reports = broker.connections_with_subscriptions(WAIT).expect("report");
    let subscriptions: Vec<_> = reports
        .iter()
        .flat_map(|report| &report.subscriptions)
        .map(|sub| (sub.sid, sub.pattern.as_str()))
        .collect();
    assert_eq!(subscriptions, vec![(1, "dup.first")]);
    broker.publish("dup.second", &b"no"[..]).expect("publish");
    broker.publish("dup.first", &b"yes"[..]).expect("publish");
    wait_for("the delivery", || {
        raw.pump();
        raw.frames.iter().any(|f| matches!(f, Frame::Message(_)))
    });
    let delivered: Vec<_> = raw
        .frames
        .iter()
        .filter_map(|frame| match frame {
            Frame::Message(message) => Some((message.sid, message.subject.to_string())),
            _ => None,
        })
        .collect();
    assert_eq!(delivered, vec![(1, "dup.first".to_string())]);
    assert!(raw.closed.is_none(), "the connection stays");
    broker.shutdown();
}

/// A listener whose every received frame has bytes flipped, next to a
/// clean one. Whatever the flips do (refused as malformed, a refused
/// version, or by chance still a valid frame), the broker keeps running,
/// refused peers get an error before they are closed, and clients on the
/// clean listener see exactly their own traffic.
#[test]
fn corrupted_frames_never_reach_other_peers() {
    let bad = fresh_name("corrupt");
    let good = fresh_name("clean");
    let faulty = Arc::new(FaultTransport::new(
        Arc::new(MemTransport),
        FaultConfig {
            seed: 5,
            corrupt: 1.0,
            ..FaultConfig::default()
        },
    ));
    let mut registry = Registry::with_builtins();
    registry.register(faulty.clone());
    let text = format!("name = \"faults\"\nlisten = [\"faulty+mem/{bad}\", \"mem/{good}\"]\n");
    let config = Config::from_toml_str(&text, "faults test").expect("valid config");
    let broker = Broker::start_with_registry(config, registry).expect("broker starts");

    let options = ClientOptions {
        connect_timeout: WAIT,
        ..ClientOptions::default()
    };
    let endpoint = format!("mem/{good}");
    let subscriber = Client::connect_with(&endpoint, options.clone(), Registry::with_builtins())
        .expect("subscriber connects");
    let sub = subscriber.subscribe("good.>").expect("subscribe");
    subscriber.flush(WAIT).expect("subscription in place");
    let publisher = Client::connect_with(&endpoint, options, Registry::with_builtins())
        .expect("publisher connects");

    const ATTACKERS: usize = 20;
    let mut refused = 0;
    for i in 0..ATTACKERS {
        let mut raw = RawPeer::connect(&bad);
        raw.hello(&format!("attacker-{i}"));
        for _ in 0..5 {
            raw.publish("evil.x", b"payload of an attacker");
        }
        // Interleave good traffic with the attack.
        publisher
            .publish(&format!("good.{i}"), Bytes::from(format!("m{i}")))
            .expect("publish");
        if raw.wait_closed(Duration::from_millis(200)) {
            let codes = raw.error_codes();
            assert!(
                codes.iter().any(|(_, fatal)| *fatal),
                "attacker {i} closed without a fatal error frame: {:?}",
                raw.frames
            );
            refused += 1;
        }
        assert_eq!(raw.undecodable, 0, "the broker's own frames are intact");
    }
    assert!(refused >= 1, "no corrupted frame was refused");
    let injected = faulty.stats().receive;
    assert!(injected.frames >= ATTACKERS as u64);
    assert_eq!(injected.corrupted, injected.frames, "every frame corrupted");

    publisher.flush(WAIT).expect("publisher flushed");
    subscriber.flush(WAIT).expect("subscriber flushed");
    for i in 0..ATTACKERS {
        let message = sub.recv_timeout(WAIT).expect("good message");
        assert_eq!(&*message.subject, format!("good.{i}"));
        assert_eq!(&message.payload[..], format!("m{i}").as_bytes());
    }
    assert_eq!(sub.try_recv().unwrap_err(), RecvError::Empty);

    // Still serving: a new client on the clean listener works.
    let late = Client::connect_with(
        &endpoint,
        ClientOptions {
            connect_timeout: WAIT,
            ..ClientOptions::default()
        },
        Registry::with_builtins(),
    )
    .expect("late client connects");
    late.publish("good.late", &b"ok"[..]).expect("publish");
    late.flush(WAIT).expect("flushed");
    let message = sub.recv_timeout(WAIT).expect("late message");
    assert_eq!(&*message.subject, "good.late");
    assert!(broker.stats().bad_frames.load(Ordering::Relaxed) >= 1);
    // Clients first, so they say goodbye to a broker that is still there.
    drop((late, publisher, subscriber));
    broker.shutdown();
}

/// `ClientOptions::faults` (from `[testing.faults]`) wraps the client's
/// connection: with every received frame dropped, the welcome never
/// arrives and the connect fails, while the broker did see the connection.
#[test]
fn client_faults_from_the_config_wrap_its_connection() {
    let (broker, endpoint) = mem_broker("client");

    let client_config = Config::from_toml_str(
        "[testing.faults]\nseed = 3\ndrop = 1.0\n",
        "client faults test",
    )
    .expect("valid config");
    let from_file = ClientOptions::from_config(&client_config);
    assert_eq!(from_file.faults, client_config.testing.faults);
    let options = ClientOptions {
        connect_timeout: Duration::from_millis(300),
        reconnect: false,
        ..from_file
    };
    let failed = Client::connect_with(&endpoint, options.clone(), Registry::with_builtins());
    assert!(failed.is_err(), "connected although every frame is dropped");
    assert!(broker.stats().connections_total.load(Ordering::Relaxed) >= 1);

    let clean = ClientOptions {
        faults: Some(Faults {
            drop: 0.0,
            ..Faults::default()
        }),
        ..options
    };
    let client = Client::connect_with(&endpoint, clean, Registry::with_builtins())
        .expect("connects with faults at rate 0");
    client.flush(WAIT).expect("flushed");
    drop(client);
    broker.shutdown();
}

/// A broker on a fresh `mem` endpoint named after `tag`, and that
/// endpoint.
fn mem_broker(tag: &str) -> (Broker, String) {
    let name = fresh_name(tag);
    let config = Config::from_toml_str(
        &format!("name = \"faults\"\nlisten = [\"mem/{name}\"]\n"),
        "faults test",
    )
    .expect("valid config");
    let broker = Broker::start(config).expect("broker starts");
    (broker, format!("mem/{name}"))
}

/// A broker on a fresh `mem` endpoint and a client of it with `faults`,
/// subscribed to `SUBJECT.>`; then the broker publishes bytes 0 to 99 on
/// `SUBJECT.x`. With the endpoint.
fn client_under_faults(
    subject: &str,
    faults: Faults,
) -> (Broker, Client, efabus_broker::Subscription, String) {
    let (broker, endpoint) = mem_broker(subject);
    let options = ClientOptions {
        faults: Some(faults),
        ..ClientOptions::default()
    };
    let client =
        Client::connect_with(&endpoint, options, Registry::with_builtins()).expect("connects");
    let subscription = client
        .subscribe(&format!("{subject}.>"))
        .expect("subscribe");
    client.flush(WAIT).expect("subscribed");
    assert!(!client.loop_ended());
    for n in 0..100u8 {
        broker
            .publish(&format!("{subject}.x"), vec![n])
            .expect("publish");
    }
    (broker, client, subscription, endpoint)
}

/// A client whose loop is stuck in one round (its connection's poll
/// blocks for 3 s once 20 frames have come, as a provider call stuck on a
/// lock would) says so, naming the server's endpoint and the poll; once
/// the round ends it says nothing and gets the rest.
#[test]
fn a_client_stuck_in_one_round_says_where() {
    let faults = Faults {
        stall_after: 20,
        stall_ms: 3000,
        ..Faults::default()
    };
    let (broker, client, subscription, endpoint) = client_under_faults("stall", faults);
    let mut stall = None;
    wait_for("the client's loop to be seen stuck", || {
        stall = client.stalled_round(Duration::from_millis(500));
        stall.is_some()
    });
    let stall = stall.expect("seen");
    assert_eq!(
        stall.endpoint,
        Some((endpoint.clone(), EndpointCall::Poll)),
        "{stall}"
    );
    assert!(
        stall.to_string().contains(&format!("polling {endpoint}")),
        "{stall}"
    );
    wait_for("the round to end", || {
        client.stalled_round(Duration::from_millis(500)).is_none()
    });
    for n in 0..100u8 {
        let message = subscription.recv_timeout(WAIT).expect("every message");
        assert_eq!(message.payload[..], [n]);
    }
    drop(client);
    broker.shutdown();
}

/// A client whose loop panicked (its connection's poll panics once 20
/// frames have come) says its loop has ended, and is no stall.
#[test]
fn a_client_whose_loop_panicked_says_so() {
    let faults = Faults {
        panic_after: 20,
        ..Faults::default()
    };
    let (broker, client, _subscription, _) = client_under_faults("panic", faults);
    wait_for("the client's loop to end", || client.loop_ended());
    assert_eq!(
        client.stalled_round(Duration::ZERO),
        None,
        "a dead loop is not stuck"
    );
    let published = client.publish("panic.x", vec![0]);
    assert!(matches!(published, Err(Error::Closed)), "{published:?}");
    broker.shutdown();
}

/// A publisher waiting for room in a full outbox is told `Closed` as soon
/// as the loop that would have made the room panics, not at the end of
/// its block timeout. The loop is held in one poll (1.5 s once 10 frames
/// have come) while the publisher fills the outbox, and panics on the
/// frames that came meanwhile.
#[test]
fn a_publisher_waiting_for_room_learns_at_once_that_the_loop_panicked() {
    let (broker, endpoint) = mem_broker("room");
    let block_timeout = Duration::from_secs(30);
    let options = ClientOptions {
        faults: Some(Faults {
            stall_after: 10,
            stall_ms: 1500,
            panic_after: 40,
            ..Faults::default()
        }),
        max_pending_bytes: 4096,
        block_timeout,
        ..ClientOptions::default()
    };
    let client = Arc::new(
        Client::connect_with(&endpoint, options, Registry::with_builtins()).expect("connects"),
    );
    let _subscription = client.subscribe("room.>").expect("subscribe");
    client.flush(WAIT).expect("subscribed");
    let publisher = {
        let client = client.clone();
        thread::spawn(move || loop {
            if let Err(err) = client.publish("elsewhere", vec![0; 256]) {
                return (err, Instant::now());
            }
        })
    };
    // Ten frames (with the client's own) bring the stall; those sent while
    // it lasts, the panic once it ends.
    for n in 0..10u8 {
        broker.publish("room.x", vec![n]).expect("publish");
    }
    wait_for("the client's loop to stall", || {
        client.stalled_round(Duration::from_millis(200)).is_some()
    });
    for n in 10..50u8 {
        broker.publish("room.x", vec![n]).expect("publish");
    }
    wait_for("the client's loop to end", || client.loop_ended());
    let ended = Instant::now();
    let (err, refused_at) = publisher.join().expect("the publisher returns");
    assert!(matches!(err, Error::Closed), "{err:?}");
    assert!(
        refused_at.saturating_duration_since(ended) < block_timeout / 3,
        "the waiting publisher was told {:?} after the loop ended",
        refused_at.saturating_duration_since(ended)
    );
    broker.shutdown();
}

/// Asks with `ask`, which must fail with `Closed` at once.
fn closed_at_once<T: std::fmt::Debug>(ask: impl FnOnce() -> Result<T, Error>) {
    let started = Instant::now();
    let asked = ask();
    assert!(matches!(asked, Err(Error::Closed)), "{asked:?}");
    assert!(started.elapsed() < WAIT / 2, "at once");
}

/// Setups [`until_a_caller_takes_the_panic`] makes at most. Which thread
/// takes the panic is the scheduler's choice: on a loaded machine the
/// loop thread often runs the round the frame comes in.
const TRIES_FOR_THE_CALLER: usize = 40;

/// Sets up with `setup` and requests with `ask` (which must echo its
/// request) until a request's caller itself gets the injected panic, and
/// returns that setup. The panic comes with a reply, in the round its
/// caller runs, unless the loop thread held the loop just then: such a
/// try must have failed the request waiting with `Closed` at once, and
/// another is made, [`TRIES_FOR_THE_CALLER`] at most.
fn until_a_caller_takes_the_panic<S>(
    setup: impl Fn() -> S,
    ask: impl Fn(&S, u8) -> Result<efabus_broker::Message, Error>,
) -> S {
    for _ in 0..TRIES_FOR_THE_CALLER {
        let set = setup();
        let mut met = false;
        for n in 0..100u8 {
            let started = Instant::now();
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ask(&set, n))) {
                Ok(Ok(reply)) => assert_eq!(&reply.payload[..], [n]),
                Ok(asked) => {
                    assert!(matches!(asked, Err(Error::Closed)), "{asked:?}");
                    assert!(started.elapsed() < WAIT / 2, "at once");
                    eprintln!("the loop thread took the panic at request {n}; again");
                    met = true;
                    break;
                }
                Err(_) => return set,
            }
        }
        assert!(met, "no request of 100 met the injected panic");
    }
    panic!("the loop thread took the panic {TRIES_FOR_THE_CALLER} times");
}

/// A round that a request's caller runs on its own thread while it waits
/// (README "Busy polling") and that panics ends the client's loop, as a
/// panic on the loop's thread does: the caller gets the panic, the client
/// says its loop ended and reports no stall, and no round runs on the
/// half-changed loop again.
#[test]
fn a_panic_in_a_round_a_caller_ran_ends_the_client_loop() {
    let (broker, client, _responder) = until_a_caller_takes_the_panic(
        || {
            let (broker, endpoint) = mem_broker("driven");
            let responder = broker
                .respond("ask", |message| Some(message.payload.clone()))
                .expect("responder");
            let options = ClientOptions {
                faults: Some(Faults {
                    panic_after: 30,
                    ..Faults::default()
                }),
                ..ClientOptions::default()
            };
            let client = Client::connect_with(&endpoint, options, Registry::with_builtins())
                .expect("connects");
            (broker, client, responder)
        },
        |(_, client, _), n| client.request("ask", vec![n], WAIT),
    );
    wait_for("the client's loop to end", || client.loop_ended());
    assert_eq!(
        client.stalled_round(Duration::ZERO),
        None,
        "a dead loop is not stuck"
    );
    // Nothing will arrive: what is asked of the client fails at once.
    closed_at_once(|| client.request("ask", vec![0], WAIT));
    assert_eq!(client.state(), ConnectionState::Closed);
    assert!(client
        .closed_because()
        .is_some_and(|why| why.contains("loop ended")));
    broker.shutdown();
}

/// The same for an embedded broker whose application thread runs the
/// broker's loop while its request waits for a remote responder's reply.
#[test]
fn a_panic_in_a_round_a_caller_ran_ends_the_broker_loop() {
    let (broker, _client, _responder) = until_a_caller_takes_the_panic(
        || {
            let name = fresh_name("driven-broker");
            let config = Config::from_toml_str(
                &format!(
                    "name = \"faults\"\nlisten = [\"mem/{name}\"]\n\
                     [testing.faults]\npanic_after = 30\n"
                ),
                "faults test",
            )
            .expect("valid config");
            let broker = Broker::start(config).expect("broker starts");
            let responder = Client::connect(&format!("mem/{name}")).expect("connects");
            let answering = responder
                .respond("ask", |message| Some(message.payload.clone()))
                .expect("responder");
            responder.flush(WAIT).expect("subscribed");
            (broker, responder, answering)
        },
        |(broker, _, _), n| broker.request("ask", vec![n], WAIT),
    );
    wait_for("the broker's loop to end", || broker.loop_ended());
    assert_eq!(
        broker.stalled_round(Duration::ZERO),
        None,
        "a dead loop is not stuck"
    );
    // Nothing will be routed: what is asked of the broker fails at once.
    closed_at_once(|| broker.request("ask", vec![0], WAIT));
    assert!(matches!(broker.subscribe("more"), Err(Error::Closed)));
}

// ------------------------------------------------------------- link level

/// A mem link between two fault injectors: `tx` sends, `rx` receives.
struct FaultyLink {
    tx: FaultyEndpoint,
    rx: FaultyEndpoint,
    to_rx: PeerId,
    rx_stats: SharedFaultStats,
    tx_stats: SharedFaultStats,
    /// Wire frames the sender's endpoint has not taken yet.
    backlog: VecDeque<OutFrame>,
}

impl FaultyLink {
    fn new(send_faults: FaultConfig, receive_faults: FaultConfig) -> FaultyLink {
        let name = fresh_name("link");
        let bound = MemTransport
            .open(&EndpointConfig {
                bind: Some(name.clone()),
                ..EndpointConfig::default()
            })
            .expect("bind mem");
        let client = MemTransport
            .open(&EndpointConfig::default())
            .expect("open mem");
        let mut tx = FaultyEndpoint::new(client, send_faults);
        let rx = FaultyEndpoint::new(bound, receive_faults);
        let to_rx = tx.connect(&name).expect("connect");
        FaultyLink {
            rx_stats: rx.stats_handle(),
            tx_stats: tx.stats_handle(),
            tx,
            rx,
            to_rx,
            backlog: VecDeque::new(),
        }
    }

    /// Hand the backlog to the sender's endpoint while it takes frames.
    fn flush(&mut self) {
        while let Some(frame) = self.backlog.pop_front() {
            match self.tx.send(self.to_rx, frame) {
                Ok(()) => {}
                Err(SendError::WouldBlock(frame)) => {
                    self.backlog.push_front(frame);
                    return;
                }
                Err(err) => panic!("send failed: {err}"),
            }
        }
    }

    /// One round: flush, poll both sides; the wire frames received.
    fn round(&mut self) -> Vec<Bytes> {
        self.flush();
        let mut events = Vec::new();
        self.tx.poll(&mut events).expect("poll sender");
        events.clear();
        self.rx.poll(&mut events).expect("poll receiver");
        events
            .into_iter()
            .filter_map(|event| match event {
                Event::Frame { frame, .. } => Some(frame),
                Event::Closed { reason, .. } => panic!("link closed: {reason}"),
                _ => None,
            })
            .collect()
    }

    fn idle(&self) -> bool {
        self.backlog.is_empty() && self.tx.held() == 0 && self.rx.held() == 0
    }
}

/// An encoded publish numbered `id` with a payload of `len` bytes derived
/// from it.
fn numbered_frame(id: u64, len: usize) -> Bytes {
    let payload: Vec<u8> = (0..len)
        .map(|i| (id.wrapping_mul(31).wrapping_add(i as u64 * 7)) as u8)
        .collect();
    codec::encode(&Frame::Publish(Publish {
        headers: None,
        subject: "link.test".into(),
        reply: None,
        seq: id,
        payload: payload.into(),
    }))
    .to_bytes()
}

/// The id of a frame from [`numbered_frame`].
fn frame_id(frame: &Bytes) -> u64 {
    match codec::decode(frame.clone(), &CodecLimits::default()) {
        Ok(Frame::Publish(publish)) => publish.seq,
        other => panic!("not a test frame: {other:?}"),
    }
}

/// Payload sizes that give one to five pieces at a 1472-byte frame limit.
fn size_of(id: u64) -> usize {
    [0, 100, 1400, 1500, 3000, 5000][(id % 6) as usize] + (id as usize % 97)
}

fn link_config(lossy: bool, window: usize) -> LinkConfig {
    LinkConfig {
        frame_limit: 1472,
        sequenced: true,
        lossy,
        gap_timeout: Duration::from_millis(20),
        reliable_gap_timeout: Duration::from_millis(250),
        reorder_window: window,
        skip_distance: window,
        reassembly: ReassemblyConfig {
            timeout: Duration::from_millis(50),
            ..ReassemblyConfig::default()
        },
        memory: MemoryBudget::unlimited(),
    }
}

fn faults(seed: u64, direction: FaultDirection, set: impl FnOnce(&mut FaultConfig)) -> FaultConfig {
    let mut config = FaultConfig {
        seed,
        direction,
        ..FaultConfig::default()
    };
    set(&mut config);
    config
}

/// Reliable class over a link that reorders, delays and duplicates in
/// both directions, without losing anything: every frame comes out once,
/// in order, and the reorder buffer never holds more than its window,
/// because the sender (standing in for the session's credits) keeps within
/// it.
#[test]
fn reliable_class_exactly_once_in_order_under_reorder_and_duplication() {
    const FRAMES: u64 = 3000;
    const WINDOW: usize = 64;
    let shuffle = |c: &mut FaultConfig| {
        c.duplicate = 0.2;
        c.reorder = 0.2;
        c.reorder_span = 3;
        c.delay = 0.2;
        c.max_delay_polls = 5;
    };
    let mut link = FaultyLink::new(
        faults(11, FaultDirection::Send, shuffle),
        faults(12, FaultDirection::Receive, shuffle),
    );
    let config = link_config(false, WINDOW);
    let mut sender = LinkSender::new(&config).expect("sender");
    let mut receiver = LinkReceiver::new(&config);
    let originals: Vec<Bytes> = (0..FRAMES)
        .map(|id| numbered_frame(id, size_of(id)))
        .collect();

    let start = Instant::now();
    let mut next = 0u64;
    let mut delivered = Vec::new();
    let mut max_held = 0;
    let mut pieces = Vec::new();
    for round in 0..100_000u64 {
        if delivered.len() as u64 == FRAMES && link.idle() {
            break;
        }
        let expected = receiver.expected_sequence().expect("sequenced");
        while next < FRAMES && sender.next_sequence() < expected + WINDOW as u64 {
            sender
                .prepare(
                    OutFrame::whole(originals[next as usize].clone()),
                    &mut pieces,
                )
                .expect("prepare");
            link.backlog.extend(pieces.drain(..));
            next += 1;
        }
        let now = start + Duration::from_millis(round);
        for wire in link.round() {
            receiver
                .receive(now, wire, &mut delivered)
                .expect("a reliable link refuses nothing here");
            assert!(receiver.held() <= WINDOW, "reorder buffer over its window");
            max_held = max_held.max(receiver.held());
        }
    }
    assert_eq!(delivered.len() as u64, FRAMES, "not everything delivered");
    for (i, frame) in delivered.iter().enumerate() {
        assert_eq!(frame, &originals[i], "frame {i} out of order or altered");
    }
    let stats = receiver.stats();
    assert_eq!(stats.delivered, FRAMES);
    assert_eq!(stats.lost, 0);
    assert!(stats.duplicates > 0, "duplicates were dropped: {stats:?}");
    assert!(stats.reordered > 0, "frames were reordered: {stats:?}");
    assert!(max_held > 1, "the reorder buffer was used");
    assert_eq!(receiver.buffered_bytes(), 0);
    let (sent, received) = (
        link.tx_stats.snapshot().send,
        link.rx_stats.snapshot().receive,
    );
    assert!(sent.duplicated > 0 && sent.reordered > 0 && sent.delayed > 0);
    assert!(received.duplicated > 0 && received.reordered > 0 && received.delayed > 0);
    assert_eq!(sent.dropped + received.dropped, 0);
}

/// Drive a best-effort link: send every frame (a few per round, without
/// waiting for credits), poll the receiver's timeouts each round, and
/// settle at the end. Returns the frames delivered, the receiver, the
/// highest sequence any valid piece arrived for, and the receiver's
/// buffered bytes just before the timeouts ran out.
fn run_best_effort(
    receive_faults: FaultConfig,
    frames: u64,
    mut on_error: impl FnMut(efabus_core::link::LinkError),
) -> (Vec<Bytes>, LinkReceiver, u64, usize, FaultyLink) {
    let mut link = FaultyLink::new(FaultConfig::default(), receive_faults);
    let config = link_config(true, 256);
    let mut sender = LinkSender::new(&config).expect("sender");
    let mut receiver = LinkReceiver::new(&config);
    let start = Instant::now();
    let mut now = start;
    let mut next = 0u64;
    let mut delivered = Vec::new();
    let mut highest = 0u64;
    let mut pieces = Vec::new();
    for round in 0..100_000u64 {
        if next == frames && link.idle() {
            break;
        }
        for _ in 0..4 {
            if next < frames {
                sender
                    .prepare(
                        OutFrame::whole(numbered_frame(next, size_of(next))),
                        &mut pieces,
                    )
                    .expect("prepare");
                link.backlog.extend(pieces.drain(..));
                next += 1;
            }
        }
        now = start + Duration::from_millis(round);
        for wire in link.round() {
            if let Ok(Frame::Fragment(piece)) = codec::decode(wire.clone(), &CodecLimits::default())
            {
                highest = highest.max(piece.msg_id);
            }
            if let Err(err) = receiver.receive(now, wire, &mut delivered) {
                on_error(err);
            }
        }
        receiver
            .poll(now, &mut delivered)
            .expect("lossy links fail nothing by time");
    }
    let buffered_before = receiver.buffered_bytes();
    // Past every timeout, then at each deadline until nothing is due.
    let mut later = now + Duration::from_secs(3600);
    receiver
        .poll(later, &mut delivered)
        .expect("lossy links fail nothing by time");
    for _ in 0..8 {
        match receiver.next_deadline() {
            Some(deadline) => {
                later = later.max(deadline);
                receiver
                    .poll(later, &mut delivered)
                    .expect("lossy links fail nothing by time");
            }
            None => break,
        }
    }
    assert_eq!(receiver.next_deadline(), None, "receiver did not settle");
    (delivered, receiver, highest, buffered_before, link)
}

/// Best-effort class over a link that drops, duplicates, reorders and
/// delays, fragmenting at 1472 bytes: only whole, unaltered frames, each
/// at most once, in increasing order; what was lost is counted; partial
/// messages are freed once their timeout passes.
#[test]
fn best_effort_class_whole_frames_at_most_once_in_order_losses_counted() {
    const FRAMES: u64 = 2000;
    let chaos = faults(21, FaultDirection::Receive, |c| {
        c.drop = 0.05;
        c.duplicate = 0.1;
        c.reorder = 0.1;
        c.reorder_span = 2;
        c.delay = 0.1;
        c.max_delay_polls = 4;
    });
    let (delivered, receiver, highest, buffered_before, link) =
        run_best_effort(chaos, FRAMES, |err| panic!("refused: {err}"));

    let mut last = None;
    for frame in &delivered {
        let id = frame_id(frame);
        assert_eq!(
            frame,
            &numbered_frame(id, size_of(id)),
            "frame {id} altered"
        );
        assert!(
            last < Some(id),
            "frame {id} after {last:?}: order or duplicate"
        );
        last = Some(id);
    }
    let stats = receiver.stats();
    let injected = link.rx_stats.snapshot().receive;
    assert!(injected.dropped > 0 && injected.duplicated > 0 && injected.reordered > 0);
    assert_eq!(stats.delivered, delivered.len() as u64);
    assert!(stats.lost > 0, "losses counted: {stats:?}");
    assert_eq!(
        stats.delivered + stats.lost,
        highest,
        "every sequence up to the highest seen is delivered or counted lost: {stats:?}"
    );
    assert!(stats.duplicates > 0, "{stats:?}");
    assert!(
        stats.expired_partials > 0,
        "partial messages of lost pieces timed out: {stats:?}"
    );
    assert!(
        buffered_before > 0,
        "partials were held before the timeout ran out"
    );
    assert_eq!(receiver.buffered_bytes(), 0, "freed after the timeout");
    assert_eq!(receiver.partial_messages(), 0);
    assert_eq!(receiver.held(), 0);
}

/// The same link with bytes flipped and frames cut short as well: the
/// receiver refuses what it can tell is malformed, never panics, delivers
/// only frames whose length prefix matches their length, and frees
/// everything after the timeout. (Flipped payload bytes inside a
/// well-formed piece cannot be told apart: the link layer carries no
/// checksum and relies on the transport's.)
#[test]
fn best_effort_class_survives_corrupt_and_truncated_pieces() {
    const FRAMES: u64 = 1500;
    let chaos = faults(31, FaultDirection::Receive, |c| {
        c.drop = 0.02;
        c.duplicate = 0.05;
        c.reorder = 0.05;
        c.corrupt = 0.05;
        c.truncate = 0.05;
    });
    let mut refused = 0u64;
    let (delivered, receiver, _, _, link) = run_best_effort(chaos, FRAMES, |_| refused += 1);
    for frame in &delivered {
        assert!(frame.len() >= 5, "a whole frame has a prefix and a kind");
        let declared = u32::from_le_bytes(frame[..4].try_into().expect("4 bytes")) as usize;
        assert_eq!(declared, frame.len() - 4, "only whole frames are delivered");
    }
    let injected = link.rx_stats.snapshot().receive;
    assert!(injected.corrupted > 0 && injected.truncated > 0);
    assert!(refused > 0, "malformed pieces are refused");
    assert!(receiver.stats().refused >= refused);
    assert!(delivered.len() as u64 <= FRAMES);
    assert_eq!(receiver.buffered_bytes(), 0, "freed after the timeout");
    assert_eq!(receiver.partial_messages(), 0);
}

/// One piece whose sequence number was corrupted into a huge value would,
/// followed, make a lossy, sequenced receiver skip ahead to it: every later
/// genuine frame would count as a duplicate and `lost` the whole skipped
/// range. A lone far piece is refused instead: the genuine frames all
/// arrive and at most the corrupted one is lost.
#[test]
fn best_effort_link_survives_one_corrupted_sequence_number() {
    let config = link_config(true, 256);
    let mut sender = LinkSender::new(&config).expect("sender");
    let mut receiver = LinkReceiver::new(&config);
    let now = Instant::now();
    let mut delivered = Vec::new();
    let mut pieces = Vec::new();
    for id in 0..50u64 {
        sender
            .prepare(OutFrame::whole(numbered_frame(id, 10)), &mut pieces)
            .expect("prepare");
    }
    assert_eq!(pieces.len(), 50, "one piece per frame");
    for (i, piece) in pieces.drain(..).enumerate() {
        let mut wire = piece.to_bytes();
        if i == 10 {
            let Ok(Frame::Fragment(mut bad)) = codec::decode(wire, &CodecLimits::default()) else {
                panic!("a fragment");
            };
            bad.msg_id = 1 << 40;
            wire = codec::encode(&Frame::Fragment(bad)).to_bytes();
        }
        let _ = receiver.receive(now, wire, &mut delivered);
    }
    receiver
        .poll(now + Duration::from_secs(3600), &mut delivered)
        .expect("lossy links fail nothing by time");
    let genuine = delivered
        .iter()
        .filter(|frame| frame_id(frame) != 10)
        .count();
    assert!(
        genuine >= 49,
        "only {genuine} of 49 genuine frames delivered"
    );
    assert!(receiver.stats().lost <= 1, "{:?}", receiver.stats());
}

/// A peer that pings without end and reads none of the pongs: the answers,
/// which no slow-consumer policy trims, are held to the queue's bound, and
/// past it the peer is disconnected and counted.
#[test]
fn a_peer_that_reads_none_of_its_answers_is_disconnected() {
    use std::io::Write;
    let text = "listen = [\"tcp/127.0.0.1:0\"]\n[limits]\nmax_pending_bytes = 65536\n";
    let config = Config::from_toml_str(text, "faults test").expect("valid config");
    let broker = Broker::start(config).expect("broker starts");
    let mut raw = raw_common::Raw::connect(&broker);
    raw.hello_as_client("deaf");
    // About 40 MB of pings: their pongs are more than the socket buffers
    // on both sides and the queue's bound together.
    let mut burst = Vec::new();
    for nonce in 0..10_000u64 {
        burst.extend_from_slice(&codec::encode(&Frame::Ping { nonce }).to_bytes());
    }
    let mut stream = raw.stream();
    let writer = thread::spawn(move || {
        for _ in 0..300 {
            // The broker closes the connection once it gives up.
            if stream.write_all(&burst).is_err() {
                return;
            }
        }
    });
    let stats = broker.stats();
    wait_for("the deaf peer disconnected", || {
        stats.slow_consumer_disconnects.load(Ordering::Relaxed) == 1
    });
    wait_for("its session closed", || {
        stats.connections.load(Ordering::Relaxed) == 0
    });
    writer.join().expect("the writer ends");
}

/// A peer that reads nothing, then sends a frame that ends its session:
/// the messages queued for it cannot drain, so the session is closed after
/// the drain time with them counted, not kept for ever.
#[test]
fn a_closing_peer_that_reads_nothing_is_closed_after_the_drain_time() {
    use std::io::Write;
    let text = "listen = [\"tcp/127.0.0.1:0\"]\n[shutdown]\ndrain_timeout_ms = 200\n";
    let config = Config::from_toml_str(text, "faults test").expect("valid config");
    let broker = Broker::start(config).expect("broker starts");
    let stats = broker.stats();
    let mut raw = raw_common::Raw::connect(&broker);
    raw.hello_as_client("reads-nothing");
    raw.send(&raw_common::subscribe(1, "x"));
    wait_for("the subscription", || broker.subscription_count() == 1);
    // 32 MiB: more than the socket buffers take, so some stays queued.
    let payload = Bytes::from(vec![0x5a; 64 << 10]);
    for _ in 0..512 {
        broker.publish("x", payload.clone()).expect("published");
    }
    wait_for("messages queued for the peer", || {
        stats.queued_bytes.load(Ordering::Relaxed) > 0
    });
    // A whole frame of an unknown kind: the session ends with an error,
    // queued behind the messages.
    let mut unknown = codec::encode(&Frame::Ping { nonce: 1 }).to_bytes().to_vec();
    unknown[codec::FRAME_OVERHEAD - 1] = 0xee;
    raw.stream().write_all(&unknown).expect("frame sent");
    wait_for("the session closed", || {
        stats.connections.load(Ordering::Relaxed) == 0
    });
    assert!(stats.connection_drops.load(Ordering::Relaxed) > 0);
}

/// Connections that never say hello hold a slot each for the handshake
/// time: one address may hold 256 such at once, not every slot. Once they
/// go, the address connects again.
#[test]
fn one_address_holds_at_most_256_connections_in_their_handshake() {
    let text = "listen = [\"tcp/127.0.0.1:0\"]\n";
    let config = Config::from_toml_str(text, "faults test").expect("valid config");
    let broker = Broker::start(config).expect("broker starts");
    let silent: Vec<raw_common::Raw> = (0..256)
        .map(|_| raw_common::Raw::connect(&broker))
        .collect();
    wait_for("256 connections accepted", || {
        broker.stats().connections.load(Ordering::Relaxed) == 256
    });
    let mut one_more = raw_common::Raw::connect(&broker);
    let error = one_more.expect_error("a refusal");
    assert_eq!(error.code, ErrorCode::TooManyConnections, "{error:?}");
    assert!(error.text.contains("handshake"), "{error:?}");
    drop(silent);
    wait_for("the silent connections gone", || {
        broker.stats().connections.load(Ordering::Relaxed) == 0
    });
    let mut again = raw_common::Raw::connect(&broker);
    again.hello_as_client("back");
}

/// Connections that never say hello, all addresses together, hold at
/// most `limits.max_handshakes` slots, and at most half of
/// `max_connections`: past it, the one waiting longest for its hello is
/// closed to make room, and a peer that says hello at once gets in
/// (before, about 40 addresses of 256 silent connections each filled
/// every slot for the handshake time).
#[test]
fn silent_connections_past_the_handshake_bound_make_room_oldest_first() {
    for bound in ["max_handshakes = 4", "max_connections = 8"] {
        silent_connections_make_room(bound);
    }
}

/// [`silent_connections_past_the_handshake_bound_make_room_oldest_first`]
/// under `[limits]` `bound`, which allows four.
fn silent_connections_make_room(bound: &str) {
    let text = format!(
        "listen = [\"tcp/127.0.0.1:0\"]\n[limits]\n{bound}\nhandshake_timeout_ms = 60000\n"
    );
    let config = Config::from_toml_str(&text, "faults test").expect("valid config");
    let broker = Broker::start(config).expect("broker starts");
    let connections = || broker.stats().connections.load(Ordering::Relaxed);
    let mut silent: Vec<raw_common::Raw> = Vec::new();
    for n in 1..=4 {
        silent.push(raw_common::Raw::connect(&broker));
        wait_for("the connection accepted", || connections() == n);
    }
    let handshakes = || broker.stats().handshakes.load(Ordering::Relaxed);
    assert_eq!(handshakes(), 4, "{bound}");
    let mut greeted = raw_common::Raw::connect(&broker);
    greeted.hello_as_client("says-hello");
    // The first silent one went; the others wait on.
    let error = silent[0].expect_error("its close");
    assert_eq!(error.code, ErrorCode::HandshakeTimeout, "{error:?}");
    assert!(error.text.contains("max_handshakes"), "{error:?}");
    assert!(silent[0].until_closed().is_empty());
    wait_for("four connections", || connections() == 4);
    for raw in &mut silent[1..] {
        assert!(raw.frames_for(Duration::from_millis(50)).is_empty());
    }
    let refused = broker.stats().refused_connections.load(Ordering::Relaxed);
    assert_eq!(refused, 1, "{bound}");
    assert_eq!(handshakes(), 3, "{bound}");
}

/// A broker under the block policy with a 64 KiB bound (the rest of its
/// `[limits]` in `limits`, of its `[slow_consumer]` section and any
/// section after it in `rest`), a
/// remote consumer `name` subscribed to `held` that reads nothing, and an
/// in-process publisher of about 16 MB to it: past the socket buffers and
/// the bound, so the publisher is held up until the consumer is gone.
fn a_consumer_holding_up_a_publisher(
    name: &str,
    limits: &str,
    rest: &str,
) -> (Arc<Broker>, raw_common::Raw, thread::JoinHandle<()>) {
    let text = format!(
        "listen = [\"tcp/127.0.0.1:0\"]\n[limits]\nmax_pending_bytes = 65536\n{limits}\
         [slow_consumer]\npolicy = \"block\"\n{rest}"
    );
    let config = Config::from_toml_str(&text, "faults test").expect("valid config");
    let broker = Arc::new(Broker::start(config).expect("broker starts"));
    let mut raw = raw_common::Raw::connect(&broker);
    raw.hello_as_client(name);
    raw.send(&raw_common::subscribe(1, "held"));
    wait_for("the subscription", || broker.subscription_count() == 1);
    let publisher = thread::spawn({
        let broker = Arc::clone(&broker);
        move || {
            let payload = Bytes::from(vec![0u8; 1024]);
            for _ in 0..16_000 {
                broker.publish("held", payload.clone()).expect("publish");
            }
        }
    });
    (broker, raw, publisher)
}

/// While publishers are held back, no hello is read: a newcomer past the
/// handshake bound is refused then, rather than the silent connection
/// waiting longest closed for it (its hello may be waiting unread).
#[test]
fn past_the_handshake_bound_during_a_hold_the_newcomer_is_refused() {
    let (broker, raw, publisher) = a_consumer_holding_up_a_publisher(
        "holds",
        "max_handshakes = 2\nhandshake_timeout_ms = 60000\n",
        "block_timeout_ms = 30000\n",
    );
    let stats = broker.stats();
    wait_for("the consumer over its bound", || {
        stats.queued_bytes.load(Ordering::Relaxed) > 65_536
    });
    let mut silent: Vec<raw_common::Raw> =
        (0..2).map(|_| raw_common::Raw::connect(&broker)).collect();
    wait_for("both in their handshake", || {
        stats.handshakes.load(Ordering::Relaxed) == 2
    });
    let mut newcomer = raw_common::Raw::connect(&broker);
    let error = newcomer.expect_error("a refusal");
    assert_eq!(error.code, ErrorCode::TooManyConnections, "{error:?}");
    assert!(error.text.contains("in their handshake"), "{error:?}");
    for raw in &mut silent {
        let frames = raw.frames_for(Duration::from_millis(50));
        assert!(frames.is_empty(), "{frames:?}");
    }
    assert_eq!(stats.handshakes.load(Ordering::Relaxed), 2);
    drop(raw);
    publisher.join().expect("the publisher goes on");
}

/// A consumer that says goodbye while over its bound under the block
/// policy, and then reads nothing, is closed at the block timeout (long
/// before its drain time) with what it still had queued counted as lost,
/// but it is no slow consumer: it was leaving.
#[test]
fn a_blocking_consumer_that_leaves_is_closed_at_the_block_timeout_not_cut_off() {
    let (broker, mut raw, publisher) = a_consumer_holding_up_a_publisher(
        "leaves",
        "",
        "block_timeout_ms = 2000\n[shutdown]\ndrain_timeout_ms = 60000\n",
    );
    let stats = broker.stats();
    wait_for("the consumer over its bound", || {
        stats.queued_bytes.load(Ordering::Relaxed) > 65_536
    });
    raw.send(&Frame::Goodbye(efabus_core::frame::Goodbye {
        reason: "leaving".into(),
    }));
    // Within `wait_for`'s 10 s: at the block timeout, not the drain time.
    wait_for("the leaving consumer closed", || {
        stats.connections.load(Ordering::Relaxed) == 0
    });
    publisher.join().expect("the publisher goes on");
    assert_eq!(stats.slow_consumer_disconnects.load(Ordering::Relaxed), 0);
    assert!(
        stats.connection_drops.load(Ordering::Relaxed) > 0,
        "what it had queued is counted"
    );
    drop(raw);
}

/// Under the block policy a remote consumer that takes nothing for the
/// block timeout is disconnected and counted, and the publishers it held
/// up go on.
#[test]
fn a_consumer_that_takes_nothing_for_the_block_timeout_is_cut_off() {
    let (broker, raw, publisher) =
        a_consumer_holding_up_a_publisher("takes-nothing", "", "block_timeout_ms = 300\n");
    let stats = broker.stats();
    wait_for("the consumer cut off", || {
        stats.slow_consumer_disconnects.load(Ordering::Relaxed) == 1
    });
    publisher.join().expect("the publisher goes on");
    drop(raw);
}
