//! A reliable fabric data link that loses a message, end to end: the
//! broker's `[testing.faults]` injector drops frames on its `efa-rdm`
//! endpoint (libfabric's `tcp;ofi_rxm` over loopback), those it receives
//! from a publishing client or those it sends to a subscribing one, so
//! frames wait behind a sequence that never comes.
//!
//! The link must fail within the reliable gap timeout (250 ms), not stall
//! until the heartbeat gives the session up 10 s later, or sooner when what
//! waits behind the gap reaches the broker's memory bound; the side that
//! saw it counts it, and the client reconnects and carries on.
//!
//! The injector wraps every endpoint of the broker, the TCP one included,
//! at the same low rate: a dropped handshake frame only delays a
//! connection, which the waits allow for. One test fails the fabric
//! endpoint as a whole instead (its polls err).
//!
//! The provider is skipped with a message where it cannot open, unless
//! `EFABUS_REQUIRE_FABRIC=1` (CI), as in `fabric_paths`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use efabus_broker::{
    Broker, Client, ClientOptions, Config, ConnectionState, Error, RecvError, Subscription,
};
use efabus_transports::registry::Registry;

const PROVIDER: &str = "tcp;ofi_rxm";
/// Bound on the whole test; everything normally happens well within it.
const WAIT: Duration = Duration::from_secs(30);

/// Whether a provider that cannot open must fail the test (CI).
fn fabric_required() -> bool {
    std::env::var("EFABUS_REQUIRE_FABRIC").is_ok_and(|v| v.trim() == "1")
}

/// A broker on TCP and `efa-rdm` whose endpoints drop frames as `faults`
/// (the `[testing.faults]` table) says, with `limits` as its `[limits]`
/// table; `None` when the provider cannot open here and the fabric is not
/// required.
fn start_broker(faults: &str, limits: &str) -> Option<Broker> {
    start_broker_at("127.0.0.1:0", faults, &format!("[limits]\n{limits}"))
}

/// [`start_broker`], listening on TCP at `address`, with `tables` (TOML
/// tables such as `[limits]`) added to its configuration.
fn start_broker_at(address: &str, faults: &str, tables: &str) -> Option<Broker> {
    let text = format!(
        "name = \"link-failures\"\nlisten = [\"tcp/{address}\", \"efa-rdm\"]\n\
         [fabric]\nprovider = \"{PROVIDER}\"\nnode = \"127.0.0.1\"\nmax_frame = 65536\n\
         [testing.faults]\n{faults}\n{tables}\n"
    );
    let config = Config::from_toml_str(&text, "link failure test").expect("valid test config");
    match Broker::start(config) {
        Ok(broker) => listens_on(&broker, "efa-rdm", PROVIDER).then_some(broker),
        Err(err @ Error::Endpoint { .. }) if !fabric_required() => {
            eprintln!(
                "skipping: provider {PROVIDER} cannot open here: {err} \
                 (set EFABUS_REQUIRE_FABRIC=1 to fail instead)"
            );
            None
        }
        Err(err) => panic!("broker with provider {PROVIDER} does not start: {err}"),
    }
}

/// Whether `broker` listens on `scheme` (over `provider`); if not, the
/// test is skipped with a message, unless the fabric is required.
fn listens_on(broker: &Broker, scheme: &str, provider: &str) -> bool {
    if broker.endpoint(scheme).is_some() {
        return true;
    }
    assert!(
        !fabric_required(),
        "EFABUS_REQUIRE_FABRIC=1 but provider {provider} did not open"
    );
    eprintln!("skipping: provider {provider} cannot open here");
    false
}

/// A client on the broker's fabric, checked to use it.
fn fabric_client(broker: &Broker, name: &str) -> Client {
    let options = ClientOptions {
        name: name.into(),
        connect_timeout: Duration::from_secs(5),
        data_paths: vec!["efa-rdm".to_string()],
        fabric: broker.config().fabric.clone(),
        ..ClientOptions::default()
    };
    let endpoint = broker.endpoint("tcp").expect("the broker listens on TCP");
    let client = Client::connect_with(&endpoint, options, Registry::with_builtins())
        .unwrap_or_else(|err| panic!("{name} connects: {err}"));
    let link = client.link();
    assert!(
        link.reliable.starts_with("efa-rdm via ") && link.reliable.contains(PROVIDER),
        "the reliable path should be efa-rdm via {PROVIDER}: {link:?}"
    );
    client
}

fn stat(broker: &Broker, name: &str) -> u64 {
    broker
        .stats()
        .value(name)
        .unwrap_or_else(|| panic!("no stat {name}"))
}

/// Publish numbered messages of `len` bytes through `publish` from
/// another thread, ten every 5 ms, until `stop`; every publish must be
/// accepted (losses are the link's to detect, not the publisher's).
/// Returns how many.
fn spawn_publisher(
    len: usize,
    publish: impl Fn(Vec<u8>) + Send + 'static,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<u64> {
    thread::spawn(move || {
        let mut seq = 0u64;
        while !stop.load(Ordering::Relaxed) {
            for _ in 0..10 {
                let mut payload = vec![0u8; len.max(8)];
                payload[..8].copy_from_slice(&seq.to_le_bytes());
                publish(payload);
                seq += 1;
            }
            thread::sleep(Duration::from_millis(5));
        }
        seq
    })
}

/// Publish 100 numbered messages on `subject`; they are the next 100
/// `subscription` receives, in order.
fn hundred_in_order(publisher: &Client, subscription: &Subscription, subject: &str) {
    for n in 0..100u32 {
        publisher
            .publish(subject, n.to_le_bytes().to_vec())
            .expect("publish");
    }
    publisher.flush(WAIT).expect("flush");
    for n in 0..100u32 {
        let message = subscription
            .recv_timeout(WAIT)
            .unwrap_or_else(|err| panic!("message {n} on {subject}: {err}"));
        assert_eq!(&message.subject[..], subject);
        assert_eq!(message.payload[..], n.to_le_bytes());
    }
}

fn seq_of(payload: &[u8]) -> u64 {
    u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"))
}

/// What a subscriber saw: each message's number and arrival, and when the
/// link failure was first counted.
struct Seen {
    received: Vec<(u64, Instant)>,
    failed_at: Option<Instant>,
    after_failure: usize,
}

/// Receive until `failures()` counts a failure, `reconnects()` one
/// reconnection, and `enough` messages arrived after the failure (or
/// [`WAIT`] passed); messages must come in increasing order.
fn watch(
    recv: impl Fn() -> Result<efabus_broker::Message, RecvError>,
    failures: impl Fn() -> u64,
    reconnects: impl Fn() -> u64,
    enough: usize,
) -> Seen {
    let start = Instant::now();
    let mut seen = Seen {
        received: Vec::new(),
        failed_at: None,
        after_failure: 0,
    };
    while start.elapsed() < WAIT {
        match recv() {
            Ok(message) => {
                let seq = seq_of(&message.payload);
                if let Some(&(last, _)) = seen.received.last() {
                    assert!(seq > last, "message {seq} after {last}: out of order");
                }
                seen.received.push((seq, Instant::now()));
                if seen.failed_at.is_some() {
                    seen.after_failure += 1;
                }
            }
            Err(RecvError::Timeout) => {}
            Err(err) => panic!("subscription ended: {err}"),
        }
        if seen.failed_at.is_none() && failures() > 0 {
            seen.failed_at = Some(Instant::now());
        }
        if seen.failed_at.is_some() && reconnects() > 0 && seen.after_failure >= enough {
            break;
        }
    }
    seen
}

/// Check that the link failed promptly after the first lost message, and
/// that traffic resumed soon after.
fn check_prompt_failure(seen: &Seen, published: u64) {
    let failed_at = seen.failed_at.expect("a gap failed the reliable link");
    let received = &seen.received;
    let gap = received
        .windows(2)
        .position(|pair| pair[1].0 != pair[0].0 + 1)
        .expect("messages were lost at the gap");
    let (last_before, before_at) = received[gap];
    let (first_after, resumed_at) = received[gap + 1];
    let stalled = failed_at.saturating_duration_since(before_at);
    let resumed = resumed_at.saturating_duration_since(before_at);
    eprintln!(
        "published {published}, received {}; messages {}..{first_after} lost; link failed \
         {stalled:?} after the last message before the gap, traffic resumed after {resumed:?}",
        received.len(),
        last_before + 1,
    );
    // The gap timeout is 250 ms; the heartbeat would have taken 10 s.
    assert!(
        stalled < Duration::from_secs(1),
        "the link failed {stalled:?} after the gap"
    );
    assert!(
        resumed < Duration::from_secs(5),
        "traffic resumed only after {resumed:?}"
    );
    assert!(
        seen.after_failure >= 200,
        "only {} messages after the failure",
        seen.after_failure
    );
}

/// A message from a client dropped on the reliable data link fails the
/// link within the gap timeout instead of stalling it until the heartbeat:
/// the broker ends the session well before the 10 s heartbeat timeout and
/// counts the gap (not as a malformed frame), the client reconnects, and
/// messages flow again, still in publish order.
#[test]
fn a_message_lost_towards_the_broker_fails_the_session_promptly() {
    let Some(broker) = start_broker("seed = 7\ndrop = 0.002", "") else {
        return;
    };
    let sub = broker.subscribe("gap.test").expect("subscribe");
    let client = Arc::new(fabric_client(&broker, "gap-publisher"));
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = {
        let client = client.clone();
        spawn_publisher(
            64,
            move |payload| client.publish("gap.test", payload).expect("publish"),
            stop.clone(),
        )
    };
    let seen = watch(
        || sub.recv_timeout(Duration::from_millis(2)),
        || stat(&broker, "link_gap_failures"),
        || client.reconnects(),
        200,
    );
    stop.store(true, Ordering::Relaxed);
    let published = publisher.join().expect("publisher thread");

    check_prompt_failure(&seen, published);
    assert!(client.reconnects() >= 1, "the client reconnected");
    assert!(stat(&broker, "connections_total") >= 2);
    assert_eq!(
        stat(&broker, "bad_frames"),
        0,
        "a gap is not a malformed frame"
    );
    let link = client.link();
    assert_eq!(link.link_gap_failures, 0, "the broker saw the gap");
    assert!(
        link.unacknowledged_at_close >= 1,
        "the dropped message at least was never acknowledged: {link:?}"
    );
    drop(client);
    broker.shutdown();
}

/// The other way: a message the broker sends a subscribing client is
/// dropped; the client's reliable link fails within the gap timeout, the
/// client counts it, reconnects, subscribes again and receives again.
#[test]
fn a_message_lost_towards_a_client_fails_its_connection_promptly() {
    let Some(broker) = start_broker("seed = 11\ndirection = \"send\"\ndrop = 0.002", "") else {
        return;
    };
    let client = fabric_client(&broker, "gap-subscriber");
    let sub = client.subscribe("gap.test").expect("subscribe");
    client.flush(WAIT).expect("subscribed");
    let broker = Arc::new(broker);
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = {
        let broker = broker.clone();
        spawn_publisher(
            64,
            move |payload| broker.publish("gap.test", payload).expect("publish"),
            stop.clone(),
        )
    };
    let seen = watch(
        || sub.recv_timeout(Duration::from_millis(2)),
        || client.link().link_gap_failures,
        || client.reconnects(),
        200,
    );
    stop.store(true, Ordering::Relaxed);
    let published = publisher.join().expect("publisher thread");

    check_prompt_failure(&seen, published);
    assert!(client.reconnects() >= 1, "the client reconnected");
    assert_eq!(
        stat(&broker, "link_gap_failures"),
        0,
        "the client saw the gap"
    );
    drop(client);
    broker.shutdown();
}

/// When the broker's reliable data link to a client closes under a queue
/// for it, the session ends at once, what was queued counted in
/// `connection_drops` (and what was in flight in
/// `unacknowledged_at_close`), and the client is told on the control link: not
/// after the drain time (30 s here), with the error waiting behind the
/// queue for the link that is gone. Over `shm`, which has no connection
/// whose end the client would see, the control link is how it learns.
#[test]
fn a_data_link_closed_under_a_queue_ends_the_session_at_once() {
    // Closed as a frame from the client arrives (its credits for the
    // stream), not by a send of the broker's failing.
    let text = "name = \"cut\"\nlisten = [\"tcp/127.0.0.1:0\", \"shm\"]\n\
                [shutdown]\ndrain_timeout_ms = 30000\n\
                [testing.faults]\nseed = 5\ndisconnect = 0.05\nscheme = \"shm\"\n";
    let config = Config::from_toml_str(text, "link failure test").expect("valid test config");
    let broker = Broker::start(config).expect("the broker starts");
    if !listens_on(&broker, "shm", "shm") {
        return;
    }
    let options = ClientOptions {
        name: "cut-off".into(),
        connect_timeout: Duration::from_secs(5),
        data_paths: vec!["shm".to_string()],
        ..ClientOptions::default()
    };
    let endpoint = broker.endpoint("tcp").expect("the broker listens on TCP");
    let client = Client::connect_with(&endpoint, options, Registry::with_builtins())
        .expect("the client connects");
    assert!(
        client.link().reliable.starts_with("shm via shm"),
        "{:?}",
        client.link()
    );
    let sub = client.subscribe("cut.test").expect("subscribe");
    client.flush(WAIT).expect("subscribed");
    // More than the link's credit window (32 MiB), published faster than
    // the link takes them, so some wait in the queue when it closes.
    let started = Instant::now();
    let payload = vec![0u8; 16 << 10];
    for _ in 0..4_000 {
        broker
            .publish("cut.test", payload.clone())
            .expect("publish");
    }
    while client.reconnects() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the client was not told: {:?}; broker {:?}",
            client.link(),
            broker.stats().snapshot()
        );
        let _ = sub.recv_timeout(Duration::from_millis(1));
    }
    // What was queued is counted as dropped, what the link had taken
    // and the client not acknowledged as unacknowledged: on a loaded
    // machine the client may have emptied the queue by then.
    assert!(
        stat(&broker, "connection_drops") + stat(&broker, "unacknowledged_at_close") > 0,
        "what the link left was counted: {:?}",
        broker.stats().snapshot()
    );
}

/// Frames held behind a lost message count against the broker's memory
/// for all data links (`limits.max_link_memory`, here 256 KiB): a
/// publisher of 16 KiB messages reaches it long before the gap timeout, and
/// the session fails on the memory bound, counted in
/// `link_memory_refusals`; the client reconnects and carries on.
#[test]
fn frames_held_behind_a_lost_message_stay_within_the_shared_memory_bound() {
    let Some(broker) = start_broker(
        "seed = 7\ndrop = 0.002",
        "max_payload = 65536\nmax_link_memory = 262144",
    ) else {
        return;
    };
    let sub = broker.subscribe("gap.test").expect("subscribe");
    let client = Arc::new(fabric_client(&broker, "memory-publisher"));
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = {
        let client = client.clone();
        spawn_publisher(
            16 << 10,
            move |payload| client.publish("gap.test", payload).expect("publish"),
            stop.clone(),
        )
    };
    let seen = watch(
        || sub.recv_timeout(Duration::from_millis(2)),
        || stat(&broker, "link_memory_refusals"),
        || client.reconnects(),
        200,
    );
    stop.store(true, Ordering::Relaxed);
    let published = publisher.join().expect("publisher thread");

    check_prompt_failure(&seen, published);
    assert!(client.reconnects() >= 1, "the client reconnected");
    assert_eq!(
        stat(&broker, "link_gap_failures"),
        0,
        "the memory bound came first"
    );
    assert_eq!(stat(&broker, "bad_frames"), 0);
    drop(client);
    broker.shutdown();
}

/// The broker's fabric endpoint fails (every poll errs from the 30th frame
/// it receives on, as when its device goes away): the sessions whose links
/// are on it end with the reason, the broker stops offering it and keeps
/// serving, and the clients reconnect on TCP and carry on, in order.
#[test]
fn a_failed_fabric_endpoint_moves_its_clients_to_tcp() {
    let Some(broker) = start_broker("scheme = \"efa-rdm\"\nfail_polls_after = 30", "") else {
        return;
    };
    let subscriber = fabric_client(&broker, "subscriber");
    let subscription = subscriber.subscribe("fail.>").unwrap();
    subscriber.flush(WAIT).unwrap();
    let publisher = fabric_client(&broker, "publisher");
    // Enough frames on the fabric to fail it; some may be lost with it.
    for n in 0..100u32 {
        publisher
            .publish("fail.before", n.to_le_bytes().to_vec())
            .unwrap();
    }
    let deadline = Instant::now() + WAIT;
    while publisher.reconnects() == 0 || subscriber.reconnects() == 0 {
        assert!(
            Instant::now() < deadline,
            "the clients never left the failed endpoint"
        );
        thread::sleep(Duration::from_millis(10));
    }
    for client in [&subscriber, &publisher] {
        client.flush(WAIT).unwrap();
        let link = client.link();
        assert_eq!(link.reliable, "tcp", "back on TCP: {link:?}");
    }
    while subscription.try_recv().is_ok() {}
    hundred_in_order(&publisher, &subscription, "fail.after");
    assert_eq!(stat(&broker, "connections"), 2);
}

/// A flush whose ping went with a connection that is then lost (here on a
/// data link the broker drops everything from, given up as silent) fails
/// at once with `NotConnected`: no pong can answer it. (It waited its
/// whole timeout, however soon the client was connected again.)
#[test]
fn a_flush_lost_with_its_connection_fails_at_once() {
    let Some(broker) = start_broker("scheme = \"efa-rdm\"\ndrop = 1.0", "") else {
        return;
    };
    let options = ClientOptions {
        name: "flushing".into(),
        connect_timeout: Duration::from_millis(1_500),
        data_paths: vec!["efa-rdm".to_string()],
        fabric: broker.config().fabric.clone(),
        ..ClientOptions::default()
    };
    let endpoint = broker.endpoint("tcp").expect("the broker listens on TCP");
    let client = Client::connect_with(&endpoint, options, Registry::with_builtins())
        .unwrap_or_else(|err| panic!("the client connects: {err}"));
    assert!(client.link().reliable.starts_with("efa-rdm via "));
    let asked = Instant::now();
    let flushed = client.flush(WAIT);
    assert!(
        matches!(flushed, Err(Error::NotConnected(_))),
        "{flushed:?} after {:?}",
        asked.elapsed()
    );
    assert!(asked.elapsed() < WAIT, "{:?}", asked.elapsed());
    assert!(client.link().silent_data_links >= 1);
    // Connected again, over TCP, a flush is answered.
    client.flush(WAIT).expect("a flush on the new connection");
}

/// A reliable data link that carries nothing back, as one whose provider
/// refused the connection underneath without a word (here the broker drops
/// every frame it receives on `efa-rdm`), moves its client to TCP within
/// the connect timeout, with the reason and a count; what it publishes
/// then arrives, in order.
#[test]
fn a_silent_data_link_moves_its_client_to_tcp() {
    let Some(broker) = start_broker("scheme = \"efa-rdm\"\ndrop = 1.0", "") else {
        return;
    };
    let connect_timeout = Duration::from_millis(1_500);
    let options = ClientOptions {
        name: "silent".into(),
        connect_timeout,
        data_paths: vec!["efa-rdm".to_string()],
        fabric: broker.config().fabric.clone(),
        ..ClientOptions::default()
    };
    let endpoint = broker.endpoint("tcp").expect("the broker listens on TCP");
    // The client's first frame on the data link (a ping, once welcomed)
    // goes out before `connect_with` returns; the broker never sees it.
    let sent_at = Instant::now();
    let client = Client::connect_with(&endpoint, options, Registry::with_builtins())
        .unwrap_or_else(|err| panic!("the client connects: {err}"));
    let link = client.link();
    assert!(link.reliable.starts_with("efa-rdm via "), "{link:?}");
    let subscription = client.subscribe("silent.>").unwrap();
    client.publish("silent.before", b"lost".to_vec()).unwrap();
    while client.link().silent_data_links == 0 {
        assert!(
            sent_at.elapsed() < WAIT,
            "the silent link was never given up: {:?}",
            client.link()
        );
        thread::sleep(Duration::from_millis(10));
    }
    assert!(
        sent_at.elapsed() >= connect_timeout,
        "given up after {:?}, before the connect timeout",
        sent_at.elapsed()
    );
    client.flush(WAIT).unwrap();
    let link = client.link();
    assert_eq!(link.reliable, "tcp", "{link:?}");
    assert!(
        link.reasons
            .iter()
            .any(|reason| reason.starts_with("efa-rdm: its data link carried nothing back")),
        "{link:?}"
    );
    assert_eq!(link.silent_data_links, 1);
    // The broker acknowledged nothing sent on the link: all of it counts
    // as possibly lost.
    assert!(link.fabric_frames_out > 0, "{link:?}");
    assert_eq!(
        link.unacknowledged_at_close, link.fabric_frames_out,
        "{link:?}"
    );
    assert!(client.reconnects() >= 1);
    for n in 0..100u32 {
        client
            .publish("silent.after", n.to_le_bytes().to_vec())
            .unwrap();
    }
    client.flush(WAIT).unwrap();
    let mut next = 0u32;
    while next < 100 {
        let message = subscription
            .recv_timeout(WAIT)
            .expect("the messages published on TCP");
        if &message.subject[..] == "silent.before" {
            continue;
        }
        assert_eq!(message.payload[..], next.to_le_bytes());
        next += 1;
    }
    assert_eq!(client.link().silent_data_links, 1, "once, and not again");
}

/// A scheme given up for a silent data link is offered again once its
/// pause is over, at the next connection: a broker restarted on the same
/// address before then still gets the client on TCP, one restarted after
/// it (its fabric mended) gets it back on `efa-rdm`.
#[test]
fn a_silent_scheme_is_offered_again_after_its_pause() {
    let Some(broker) = start_broker("scheme = \"efa-rdm\"\ndrop = 1.0", "") else {
        return;
    };
    let pause = Duration::from_secs(5);
    let options = ClientOptions {
        name: "retrying".into(),
        connect_timeout: Duration::from_millis(1_000),
        max_backoff: Duration::from_millis(100),
        silent_link_retry: pause,
        data_paths: vec!["efa-rdm".to_string()],
        fabric: broker.config().fabric.clone(),
        ..ClientOptions::default()
    };
    let endpoint = broker.endpoint("tcp").expect("the broker listens on TCP");
    let address = endpoint.trim_start_matches("tcp/").to_string();
    let client = Client::connect_with(&endpoint, options, Registry::with_builtins())
        .unwrap_or_else(|err| panic!("the client connects: {err}"));
    let subscription = client.subscribe("retry.>").unwrap();
    let started = Instant::now();
    while client.link().silent_data_links == 0 {
        assert!(
            started.elapsed() < WAIT,
            "never given up: {:?}",
            client.link()
        );
        thread::sleep(Duration::from_millis(10));
    }
    let given_up = Instant::now();
    // Back on TCP with the broker that went silent, before it goes.
    client.flush(WAIT).expect("flushed on TCP");
    let silent_reason = |link: &efabus_broker::client::LinkReport| {
        link.reasons
            .iter()
            .any(|reason| reason.starts_with("efa-rdm: its data link carried nothing back"))
    };

    // Restarted (mended) within the pause: the client comes back on TCP.
    let restart = |broker: Broker, reconnects: u64| -> Broker {
        broker.shutdown();
        drop(broker);
        let deadline = Instant::now() + WAIT;
        while matches!(client.state(), ConnectionState::Connected { .. }) {
            assert!(
                Instant::now() < deadline,
                "the client never saw the broker go"
            );
            thread::sleep(Duration::from_millis(5));
        }
        let broker = start_broker_at(&address, "", "").expect("the broker starts again");
        let deadline = Instant::now() + WAIT;
        while client.reconnects() <= reconnects
            || !matches!(client.state(), ConnectionState::Connected { .. })
        {
            assert!(
                Instant::now() < deadline,
                "no reconnection: {:?}",
                client.state()
            );
            thread::sleep(Duration::from_millis(10));
        }
        client.flush(WAIT).expect("flushed after reconnecting");
        broker
    };
    let broker = restart(broker, client.reconnects());
    assert!(
        given_up.elapsed() < pause,
        "the first restart took {:?}, longer than the pause",
        given_up.elapsed()
    );
    let link = client.link();
    assert_eq!(link.reliable, "tcp", "{link:?}");
    assert!(silent_reason(&link), "{link:?}");

    // Restarted after the pause: the scheme is offered again and taken.
    thread::sleep(pause.saturating_sub(given_up.elapsed()));
    let broker = restart(broker, client.reconnects());
    let link = client.link();
    assert!(link.reliable.starts_with("efa-rdm via "), "{link:?}");
    assert!(!silent_reason(&link), "{link:?}");
    assert_eq!(link.silent_data_links, 1, "{link:?}");
    let fabric_in = link.fabric_frames_in;
    hundred_in_order(&client, &subscription, "retry.after");
    assert!(
        client.link().fabric_frames_in >= fabric_in + 100,
        "{:?}",
        client.link()
    );
    assert_eq!(stat(&broker, "silent_data_links"), 0);
}

/// A data link that the client's endpoint closes under it (an injected
/// disconnect on a send) ends the connection; what the link had sent and
/// the broker had not acknowledged is counted, and the client reconnects.
#[test]
fn a_data_link_closed_under_a_client_counts_what_it_left_unacknowledged() {
    let Some(broker) = start_broker("", "") else {
        return;
    };
    let faults = efabus_broker::config::Faults {
        seed: 5,
        direction: efabus_transports::fault::FaultDirection::Send,
        disconnect: 0.02,
        scheme: Some("efa-rdm".to_string()),
        ..Default::default()
    };
    let options = ClientOptions {
        name: "disconnected".into(),
        connect_timeout: Duration::from_secs(5),
        max_backoff: Duration::from_millis(100),
        data_paths: vec!["efa-rdm".to_string()],
        fabric: broker.config().fabric.clone(),
        faults: Some(faults),
        ..ClientOptions::default()
    };
    let endpoint = broker.endpoint("tcp").expect("the broker listens on TCP");
    let client = Arc::new(
        Client::connect_with(&endpoint, options, Registry::with_builtins())
            .unwrap_or_else(|err| panic!("the client connects: {err}")),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = {
        let client = client.clone();
        spawn_publisher(
            64,
            move |payload| {
                // The connection may be down for a moment: the outbox
                // keeps what is published meanwhile.
                client.publish("closed.test", payload).expect("publish");
            },
            stop.clone(),
        )
    };
    let started = Instant::now();
    while client.reconnects() == 0 {
        assert!(
            started.elapsed() < WAIT,
            "never disconnected: {:?}",
            client.link()
        );
        thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::Relaxed);
    publisher.join().expect("publisher thread");
    let link = client.link();
    assert!(
        link.unacknowledged_at_close >= 1,
        "the frame the link was closed on at least: {link:?}"
    );
}

/// A client's own close after the server confirmed its publishes (a
/// flush) counts none of them as unacknowledged, though the credit for the
/// last may still be on its way, and all of them arrive.
#[test]
fn a_client_that_closes_counts_nothing_unacknowledged() {
    let Some(broker) = start_broker("", "") else {
        return;
    };
    let subscription = broker.subscribe("closing.test").expect("subscribe");
    let client = fabric_client(&broker, "closing");
    for n in 0..2_000u32 {
        client
            .publish("closing.test", n.to_le_bytes().to_vec())
            .expect("publish");
    }
    client.flush(WAIT).expect("the broker took them");
    client.shutdown();
    for n in 0..2_000u32 {
        let message = subscription.recv_timeout(WAIT).expect("every message");
        assert_eq!(message.payload[..], n.to_le_bytes());
    }
    assert_eq!(
        client.link().unacknowledged_at_close,
        0,
        "{:?}",
        client.link()
    );
}

/// Publishes a client still holds when it closes (the broker pushes back:
/// its only subscriber stopped reading, under `block`) are counted, never
/// more than did not arrive; over the fabric and over TCP.
#[test]
fn publishes_a_client_still_holds_at_close_are_counted() {
    let tables = "[limits]\nsubscription_queue = 64\nmax_pending_bytes = 65536\n\
                  [slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 60000";
    for data_paths in [vec!["efa-rdm".to_string()], Vec::new()] {
        let broker = if data_paths.is_empty() {
            // TCP alone, whether or not the fabric opens here.
            let text =
                format!("name = \"link-failures\"\nlisten = [\"tcp/127.0.0.1:0\"]\n{tables}\n");
            Broker::start(Config::from_toml_str(&text, "tcp test").expect("valid test config"))
                .expect("broker starts")
        } else {
            match start_broker_at("127.0.0.1:0", "", tables) {
                Some(broker) => broker,
                None => continue,
            }
        };
        let subscription = broker.subscribe("held.test").expect("subscribe");
        let options = ClientOptions {
            name: "holding".into(),
            block_timeout: Duration::from_millis(300),
            max_pending_bytes: 256 << 10,
            data_paths: data_paths.clone(),
            fabric: broker.config().fabric.clone(),
            ..ClientOptions::default()
        };
        let endpoint = broker.endpoint("tcp").expect("the broker listens on TCP");
        let client = Client::connect_with(&endpoint, options, Registry::with_builtins())
            .unwrap_or_else(|err| panic!("the client connects: {err}"));
        let mut published = 0u64;
        let started = Instant::now();
        // Until the client's own bound holds the publisher back.
        while client
            .publish("held.test", published.to_le_bytes().to_vec())
            .is_ok()
        {
            published += 1;
            assert!(started.elapsed() < WAIT, "never held back");
        }
        client.shutdown();
        let mut delivered = 0u64;
        // The broker resumes once its subscriber reads: every message it
        // took arrives within this gap.
        while let Ok(message) = subscription.recv_timeout(Duration::from_secs(2)) {
            assert_eq!(seq_of(&message.payload), delivered, "in order");
            delivered += 1;
        }
        let link = client.link();
        eprintln!(
            "{data_paths:?}: published {published}, delivered {delivered}, discarded {}, \
             unacknowledged {}",
            link.discarded_at_close, link.unacknowledged_at_close
        );
        if data_paths.is_empty() {
            // Over TCP the publisher is held back at once. Over the fabric
            // the broker takes what is in flight (its credit window) while
            // it holds the message its subscriber has no room for, and the
            // client may have handed over all it held by the time it
            // closes.
            assert!(link.discarded_at_close > 0, "{link:?}");
        }
        assert!(
            delivered + link.discarded_at_close <= published,
            "counted more than was lost: {link:?}"
        );
        if !data_paths.is_empty() {
            // On the fabric every message is delivered or counted (over
            // TCP, what the kernel's socket buffers held is not).
            assert!(
                delivered + link.discarded_at_close + link.unacknowledged_at_close >= published,
                "lost without a count: {link:?}"
            );
        }
        broker.shutdown();
    }
}
