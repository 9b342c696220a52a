//! Users with permissions (`[[auth.users]]`): logging in with a password
//! or a token, refused with a wrong one, and every publish and subscription
//! checked against the user's allow and deny patterns, a refusal answered
//! with an error that names the subject and the rule, and counted.
//! Request/reply works for users who may not subscribe to `_INBOX.>`.

use std::time::{Duration, Instant};

use efabus_broker::accounts::hash_secret;
use efabus_broker::{Broker, Client, ClientOptions, Config, Error};
use efabus_core::frame::{ErrorCode, Frame, Hello, RouteHello, PROTOCOL_VERSION};
use efabus_transports::registry::Registry;

mod raw_common;
use raw_common::{CutRelay, Raw, WAIT};

fn broker() -> Broker {
    broker_with("")
}

/// [`broker`] with `extra` tables (before the users).
fn broker_with(extra: &str) -> Broker {
    let text = format!(
        r#"
        name = "accounts"
        listen = ["tcp/127.0.0.1:0"]
        {extra}
        [[auth.users]]
        name = "alice"
        password = "{alice}"
        [auth.users.permissions.publish]
        allow = ["orders.>"]
        deny = ["orders.secret"]
        [auth.users.permissions.subscribe]
        allow = ["orders.>"]
        deny = ["orders.secret"]

        [[auth.users]]
        name = "watcher"
        token = "{token}"

        [[auth.users]]
        name = "requester"
        password = "{requester}"
        [auth.users.permissions.publish]
        allow = ["svc.>"]
        [auth.users.permissions.subscribe]
        allow = ["updates.>"]

        [[auth.users]]
        name = "responder"
        password = "{responder}"
        [auth.users.permissions.publish]
        allow = ["audit.>"]
        [auth.users.permissions.subscribe]
        allow = ["svc.>"]
        "#,
        alice = hash_secret("alice-password").unwrap(),
        token = hash_secret("watcher-token").unwrap(),
        requester = hash_secret("requester-password").unwrap(),
        responder = hash_secret("responder-password").unwrap(),
    );
    let config = Config::from_toml_str(&text, "accounts test").expect("valid config");
    Broker::start(config).expect("the broker starts")
}

/// A raw client's hello named `name`, logging in as `user`.
fn user_hello(name: &str, user: &str, password: &str) -> Frame {
    let Frame::Hello(mut hello) = raw_common::client_hello(name) else {
        unreachable!("a hello")
    };
    hello.user = Some(user.to_string());
    hello.credentials = Some(password.to_string());
    Frame::Hello(hello)
}

fn login(broker: &Broker, user: Option<&str>, secret: Option<&str>) -> Result<Client, Error> {
    // Without a name, the secret is a token.
    let (credentials, token) = match user {
        Some(_) => (secret.map(str::to_string), None),
        None => (None, secret.map(str::to_string)),
    };
    let options = ClientOptions {
        user: user.map(str::to_string),
        credentials,
        token,
        connect_timeout: WAIT,
        reconnect: false,
        ..ClientOptions::default()
    };
    let server = broker.endpoint("tcp").expect("tcp listener");
    Client::connect_with(&server, options, Registry::with_builtins())
}

/// Password and token hashes are checked off the event loop: while a
/// wrong token is checked against eight token users' hashes (tens of
/// milliseconds each, on purpose), a connected client is served as usual.
#[test]
fn checking_hashes_holds_up_nobody_else() {
    let tokens: String = (0..8)
        .map(|n| {
            format!(
                "[[auth.users]]\nname = \"service-{n}\"\ntoken = \"{}\"\n",
                hash_secret(&format!("token-{n}")).unwrap()
            )
        })
        .collect();
    let broker = broker_with(&tokens);
    let alice = login(&broker, Some("alice"), Some("alice-password")).expect("alice");
    // The hashes checked this second are spent: the next login's wait.
    std::thread::sleep(Duration::from_millis(1100));
    let mut wrong = Raw::connect(&broker);
    let Frame::Hello(mut hello) = raw_common::client_hello("wrong-token") else {
        unreachable!("a hello")
    };
    hello.credentials = Some("no-such-token".to_string());
    wrong.send(&Frame::Hello(hello));
    let started = Instant::now();
    let (refusal, flushes) = std::thread::scope(|scope| {
        let refused =
            scope.spawn(move || wrong.expect("the refusal", |f| matches!(f, Frame::Error(_))));
        // Flushes answered from the hello's sending to its refusal: with
        // the hashes checked on the loop, one or two (it answers nothing
        // while it checks); with the login thread, hundreds.
        let mut flushes = 0;
        while !refused.is_finished() {
            alice.flush(WAIT).expect("flushed");
            flushes += 1;
        }
        (refused.join().expect("the refusal's reader"), flushes)
    });
    let took = started.elapsed();
    assert!(
        matches!(&refusal, Frame::Error(e) if e.code == ErrorCode::Auth),
        "a wrong token is refused: {refusal:?}"
    );
    assert!(
        flushes >= 15,
        "{flushes} flushes while a login took {took:?}"
    );
}

/// What a client sends right behind its hello, while its password is
/// checked off the loop, is handled once it is logged in, in order.
#[test]
fn frames_behind_a_hello_being_checked_wait_for_its_verdict() {
    use efabus_core::codec::encode;
    let broker = broker();
    // Each login a user's first, so that its password is checked on the
    // login thread (one remembered is taken at once).
    let hello = |user: &str, password: &str| user_hello(user, user, password);
    // A hello and the frames behind it, in one write, so that they all
    // arrive before the verdict.
    let pipelined = |hello: &Frame, behind: &[Frame]| {
        let raw = Raw::connect(&broker);
        let mut bytes = encode(hello).to_bytes().to_vec();
        for frame in behind {
            bytes.extend_from_slice(&encode(frame).to_bytes());
        }
        std::io::Write::write_all(&mut raw.stream(), &bytes).expect("written");
        (raw, bytes.len() as u64)
    };
    let behind = [
        raw_common::subscribe(1, "orders.new"),
        Frame::Ping { nonce: 7 },
    ];
    let (mut raw, sent) = pipelined(&hello("alice", "alice-password"), &behind);
    raw.expect("the welcome", |f| matches!(f, Frame::Welcome(_)));
    raw.expect("the pong, after the subscription", |f| {
        matches!(f, Frame::Pong { nonce: 7 })
    });
    broker.publish("orders.new", &b"made"[..]).expect("publish");
    raw.expect(
        "the message",
        |f| matches!(f, Frame::Message(m) if m.sid == 1),
    );
    // Each byte counted once, those kept waiting too.
    assert_eq!(broker.stats().value("bytes_in"), Some(sent));

    // What waits is bounded: 64 frames are taken, more end the connection.
    let pings = |count: u64| {
        (0..count)
            .map(|nonce| Frame::Ping { nonce })
            .collect::<Vec<_>>()
    };
    let (mut raw, more) = pipelined(&hello("requester", "requester-password"), &pings(64));
    raw.expect("the welcome", |f| matches!(f, Frame::Welcome(_)));
    raw.expect("the last pong", |f| matches!(f, Frame::Pong { nonce: 63 }));
    assert_eq!(broker.stats().value("bytes_in"), Some(sent + more));
    let (mut flood, _) = pipelined(&hello("responder", "not-its-password"), &pings(100));
    let frames = flood.until_closed();
    let refused = |f: &Frame| {
        matches!(f, Frame::Error(e) if e.code == ErrorCode::Protocol
            && e.text.contains("more than 64 frames behind a hello"))
    };
    assert!(frames.iter().any(refused), "{frames:?}");
    assert!(
        !frames.iter().any(|f| matches!(f, Frame::Pong { .. })),
        "{frames:?}"
    );
}

/// A frame behind a hello being checked that is larger than what a peer
/// may send before it is accepted (32 KiB) waits for the verdict, and
/// then passes: it was refused as too large, the limit still in force
/// when it was looked at again.
#[test]
fn a_large_frame_behind_a_hello_being_checked_passes_once_accepted() {
    use efabus_core::codec::encode;
    use efabus_core::frame::Publish;
    let broker = broker();
    let sub = broker.subscribe("orders.big").expect("subscribes");
    let payload = bytes::Bytes::from(vec![7u8; 40 << 10]);
    let publish = Frame::Publish(Publish {
        headers: None,
        subject: "orders.big".into(),
        reply: None,
        seq: 0,
        payload: payload.clone(),
    });
    let hello = user_hello("alice", "alice", "alice-password");
    let mut bytes = encode(&hello).to_bytes().to_vec();
    bytes.extend_from_slice(&encode(&publish).to_bytes());
    let mut raw = Raw::connect(&broker);
    std::io::Write::write_all(&mut raw.stream(), &bytes).expect("written");
    raw.expect("the welcome", |f| matches!(f, Frame::Welcome(_)));
    let message = sub
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the large publish arrives");
    assert_eq!(message.payload, payload);
}

/// `client` was refused once, in an error naming `text`.
fn one_error_naming(client: &Client, text: &str) {
    let errors = client.take_errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].1.contains(text), "{errors:?}");
}

fn denials(broker: &Broker) -> u64 {
    broker.stats().value("permission_denials").unwrap_or(0)
}

#[test]
fn wrong_or_missing_credentials_are_refused() {
    let broker = broker();
    for (user, secret) in [
        (Some("alice"), Some("wrong")),
        (Some("mallory"), Some("alice-password")),
        (None, Some("alice-password")),
        (None, None),
        (Some("alice"), None),
    ] {
        match login(&broker, user, secret) {
            Err(Error::Refused {
                code: ErrorCode::Auth,
                text,
            }) => assert!(!text.contains("alice-password"), "{text}"),
            Err(other) => panic!("{user:?}/{secret:?}: {other}"),
            Ok(_) => panic!("{user:?}/{secret:?} logged in"),
        }
    }
    assert_eq!(broker.stats().value("auth_failures"), Some(5));
}

#[test]
fn a_user_publishes_and_subscribes_within_its_permissions_only() {
    let broker = broker();
    let alice = login(&broker, Some("alice"), Some("alice-password")).expect("alice");
    let watcher = login(&broker, None, Some("watcher-token")).expect("the token logs in");
    let everything = watcher.subscribe(">").expect("subscribe");
    watcher.flush(WAIT).unwrap();

    // Subscriptions: within allow, and never one that could carry a
    // denied subject.
    let eu = alice.subscribe("orders.eu").expect("subscribe");
    let _secret = alice.subscribe("orders.secret").expect("sent");
    let _all = alice.subscribe("orders.>").expect("sent");
    let _billing = alice.subscribe("billing.>").expect("sent");
    alice.flush(WAIT).unwrap();
    let errors = alice.take_errors();
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(errors
        .iter()
        .all(|(code, _)| *code == ErrorCode::PermissionDenied));
    assert!(
        errors[0].1.contains("subscribe to \"orders.secret\"")
            && errors[0].1.contains("subscribe deny \"orders.secret\"")
            && errors[0].1.contains("alice"),
        "{errors:?}"
    );
    assert!(errors[2].1.contains("not in subscribe allow"), "{errors:?}");

    // Publishes: orders.eu goes through; orders.secret and billing.eu are
    // refused, answered and counted, and reach nobody.
    alice.publish("orders.eu", b"1".to_vec()).unwrap();
    alice.publish("orders.secret", b"2".to_vec()).unwrap();
    alice.publish("billing.eu", b"3".to_vec()).unwrap();
    alice.flush(WAIT).unwrap();
    let errors = alice.take_errors();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors[0]
            .1
            .contains("publish to \"orders.secret\" (publish deny"),
        "{errors:?}"
    );
    assert!(errors[1].1.contains("billing.eu") && errors[1].1.contains("not in publish allow"));
    assert_eq!(&eu.recv_timeout(WAIT).unwrap().payload[..], b"1");
    let seen = everything.recv_timeout(WAIT).unwrap();
    assert_eq!(&seen.subject[..], "orders.eu");
    assert!(everything.recv_timeout(Duration::from_millis(200)).is_err());
    assert_eq!(denials(&broker), 5);
}

#[test]
fn requests_work_without_permission_to_subscribe_to_inboxes() {
    let broker = broker();
    let responder = login(&broker, Some("responder"), Some("responder-password")).expect("login");
    let requests = responder.subscribe("svc.echo").expect("subscribe");
    responder.flush(WAIT).unwrap();
    let server = std::thread::spawn(move || {
        let request = requests.recv_timeout(WAIT).expect("a request");
        let reply = request.reply.expect("a reply subject");
        responder
            .publish(&reply, request.payload.clone())
            .expect("reply");
        responder.flush(WAIT).unwrap();
        let answered = responder.take_errors();
        // What the reply subject tells the responder opens nothing else:
        // not another inbox subject, nor the requester's inbox to read.
        let inbox = reply
            .rsplit_once('.')
            .map(|(inbox, _)| inbox)
            .unwrap()
            .to_string();
        responder
            .publish(&format!("{inbox}.forged"), b"x".to_vec())
            .unwrap();
        let _eavesdrop = responder.subscribe(&format!("{inbox}.>")).unwrap();
        responder.flush(WAIT).unwrap();
        (answered, responder.take_errors())
    });
    let requester = login(&broker, Some("requester"), Some("requester-password")).expect("login");
    let deadline = Instant::now() + WAIT;
    let answer = loop {
        match requester.request("svc.echo", b"ping".to_vec(), Duration::from_secs(2)) {
            Ok(answer) => break answer,
            Err(err) => assert!(Instant::now() < deadline, "no answer: {err}"),
        }
    };
    assert_eq!(&answer.payload[..], b"ping");
    let (answered, after) = server.join().unwrap();
    assert_eq!(answered, Vec::new(), "the reply was allowed");
    assert_eq!(after.len(), 2, "{after:?}");
    assert!(after[0].1.contains("forged") && after[0].1.contains("not in publish allow"));
    assert!(after[1].1.contains("another connection's"), "{after:?}");
    assert!(requester.take_errors().is_empty());
    // The requester still may not subscribe elsewhere, nor to every inbox.
    let _every_inbox = requester.subscribe("_INBOX.>").expect("sent");
    requester.flush(WAIT).unwrap();
    let errors = requester.take_errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(denials(&broker), 3);
}

/// A responder learns its requester's inbox from the reply subject. Once
/// the requester's connection is gone the inbox is held by no one, but
/// the responder still may not subscribe under it: the requester, back,
/// gets its replies, not the responder.
#[test]
fn a_responder_does_not_take_over_its_requester_s_inbox() {
    let broker = broker();
    let responder = login(&broker, Some("responder"), Some("responder-password")).expect("login");
    let requests = responder.subscribe("svc.echo").expect("subscribe");
    responder.flush(WAIT).unwrap();
    let requester = login(&broker, None, Some("watcher-token")).expect("login");
    let asked = std::thread::spawn(move || {
        requester
            .request("svc.echo", b"ping".to_vec(), WAIT)
            .expect("an answer");
        // The requester's connection ends: its inbox falls free.
    });
    let request = requests.recv_timeout(WAIT).expect("a request");
    let reply = request.reply.expect("a reply subject");
    responder.publish(&reply, b"pong".to_vec()).expect("reply");
    responder.flush(WAIT).unwrap();
    asked.join().expect("the requester got its answer");
    let inbox = reply.rsplit_once('.').map(|(inbox, _)| inbox).unwrap();
    wait_until("the requester gone", || {
        broker.stats().value("connections") == Some(1)
    });
    let _squat = responder.subscribe(&format!("{inbox}.>")).unwrap();
    responder.flush(WAIT).unwrap();
    let errors = responder.take_errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].1.contains("a requester's"), "{errors:?}");
}

/// A restricted requester whose network path was cut reconnects while
/// its old connection lingers (the broker notices only at the heartbeat
/// timeout): that connection still holds the inbox, so the new one's
/// subscription under it waits, and takes the inbox when the old one
/// ends. Requests are answered again without another reconnection.
/// (The subscription was refused for good: every request timed out until
/// the client happened to reconnect again.)
#[test]
fn a_reconnected_requester_gets_its_inbox_back_when_the_old_connection_ends() {
    let broker = broker_with("[heartbeat]\ninterval_ms = 200\ntimeout_ms = 1500");
    let responder = login(&broker, None, Some("watcher-token")).expect("login");
    let requests = responder.subscribe("svc.echo").expect("subscribe");
    responder.flush(WAIT).unwrap();
    std::thread::spawn(move || {
        while let Ok(request) = requests.recv_timeout(Duration::from_secs(30)) {
            if let Some(reply) = request.reply {
                let _ = responder.publish(&reply, request.payload);
            }
        }
    });
    let relay = CutRelay::start(&broker);
    let options = ClientOptions {
        user: Some("requester".to_string()),
        credentials: Some("requester-password".to_string()),
        connect_timeout: WAIT,
        ..ClientOptions::default()
    };
    let requester = Client::connect_with(&relay.endpoint(), options, Registry::with_builtins())
        .expect("the requester connects");
    let ask = || requester.request("svc.echo", b"ping".to_vec(), Duration::from_millis(500));
    assert_eq!(&ask().expect("an answer").payload[..], b"ping");
    relay.cut_clients();
    wait_until("the requester back", || requester.reconnects() == 1);
    let deadline = Instant::now() + WAIT;
    loop {
        match ask() {
            Ok(answer) => {
                assert_eq!(&answer.payload[..], b"ping");
                break;
            }
            Err(err) => assert!(Instant::now() < deadline, "no answer since: {err}"),
        }
    }
    assert_eq!(requester.reconnects(), 1);
}

/// A delivery limit (the NATS listener's `UNSUB sid max`) given to a
/// subscription that waits for its inbox holds once the subscription is
/// made.
#[test]
fn a_limit_on_a_subscription_waiting_for_its_inbox_holds_once_it_is_made() {
    use efabus_core::frame::{DeliveryClass, Subscribe};
    let broker = broker();
    let first = login(&broker, Some("requester"), Some("requester-password")).unwrap();
    let held = first.subscribe("_INBOX.q8.>").unwrap();
    first.flush(WAIT).unwrap();
    let mut raw = Raw::connect(&broker);
    raw.send(&user_hello("waiting", "requester", "requester-password"));
    raw.expect("the welcome", |f| matches!(f, Frame::Welcome(_)));
    raw.send(&Frame::Subscribe(Subscribe {
        sid: 1,
        pattern: "_INBOX.q8.>".to_string(),
        queue: Some("g".to_string()),
        class: DeliveryClass::Reliable,
    }));
    raw.send(&Frame::UnsubscribeAfter { sid: 1, total: 2 });
    raw.send(&Frame::Ping { nonce: 8 });
    raw.expect("both taken", |f| matches!(f, Frame::Pong { nonce: 8 }));
    drop(held);
    first.flush(WAIT).unwrap();
    let watcher = login(&broker, None, Some("watcher-token")).unwrap();
    wait_until("the waiting subscription made", || {
        broker.subscription_count() >= 1
    });
    for _ in 0..5 {
        watcher.publish("_INBOX.q8.x", b"answer".to_vec()).unwrap();
    }
    watcher.flush(WAIT).unwrap();
    raw.send(&Frame::Ping { nonce: 9 });
    let mut messages = 0;
    loop {
        match raw.next_frame(WAIT) {
            Some(Frame::Message(_)) => messages += 1,
            Some(Frame::Pong { nonce: 9 }) => break,
            Some(_) => {}
            None => panic!("no answer to the ping"),
        }
    }
    assert_eq!(messages, 2, "the limit held");
}

/// Two later connections of one user wait for the inbox an earlier one
/// holds: when it is let go the newest takes it, and the older one, as
/// stale as the first, is refused.
#[test]
fn a_freed_inbox_goes_to_the_newest_connection_waiting_for_it() {
    let broker = broker();
    let requester = || login(&broker, Some("requester"), Some("requester-password")).unwrap();
    let first = requester();
    let held = first.subscribe("_INBOX.q7.>").unwrap();
    first.flush(WAIT).unwrap();
    let older = requester();
    let older_waits = older.subscribe("_INBOX.q7.>").unwrap();
    older.flush(WAIT).unwrap();
    let newer = requester();
    let newer_waits = newer.subscribe("_INBOX.q7.>").unwrap();
    newer.flush(WAIT).unwrap();
    assert!(older.take_errors().is_empty(), "waiting, not refused");
    assert!(newer.take_errors().is_empty(), "waiting, not refused");

    drop(held);
    first.flush(WAIT).unwrap();
    wait_until("the older connection refused", || {
        let errors = older.take_errors();
        assert!(
            errors.iter().all(|e| e.1.contains("another connection's")),
            "{errors:?}"
        );
        !errors.is_empty()
    });
    let watcher = login(&broker, None, Some("watcher-token")).unwrap();
    watcher
        .publish("_INBOX.q7.answer", b"yours".to_vec())
        .unwrap();
    watcher.flush(WAIT).unwrap();
    let answer = newer_waits
        .recv_timeout(WAIT)
        .expect("the newest holds the inbox");
    assert_eq!(&answer.payload[..], b"yours");
    assert!(older_waits.try_recv().is_err(), "one holder only");
    assert!(newer.take_errors().is_empty());
}

/// A restricted user cannot make a reply subject a way to publish where
/// it may not, and an inbox is held only while subscriptions under it
/// last (an inbox a route announces: the next test).
#[test]
fn reply_subjects_and_inboxes_open_nothing_beyond_the_permissions() {
    let broker = broker();
    let alice = login(&broker, Some("alice"), Some("alice-password")).expect("alice");
    // A reply subject alice may not receive is refused with the publish.
    alice
        .publish_request("orders.loop", "billing.charge", b"x".to_vec())
        .unwrap();
    // One she may receive is fine.
    alice
        .publish_request("orders.loop", "orders.answers", b"x".to_vec())
        .unwrap();
    alice.flush(WAIT).unwrap();
    one_error_naming(&alice, "reply subject \"billing.charge\"");

    // An inbox is one connection's while it has a subscription under it.
    let requester = login(&broker, Some("requester"), Some("requester-password")).unwrap();
    let responder = login(&broker, Some("responder"), Some("responder-password")).unwrap();
    let held = requester.subscribe("_INBOX.b7e1.>").unwrap();
    requester.flush(WAIT).unwrap();
    let _taken = responder.subscribe("_INBOX.b7e1.*").unwrap();
    responder.flush(WAIT).unwrap();
    let errors = responder.take_errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].1.contains("another connection's"), "{errors:?}");
    drop(held);
    requester.flush(WAIT).unwrap();
    let _now = responder.subscribe("_INBOX.b7e1.*").unwrap();
    responder.flush(WAIT).unwrap();
    assert_eq!(
        responder.take_errors(),
        Vec::new(),
        "released with its subscription"
    );
    assert!(requester.take_errors().is_empty());
}

/// A user allowed to subscribe under every inbox still may not name
/// another connection's inbox as its reply subject: the answer would land
/// in a requester's inbox as the answer to a request it never made.
#[test]
fn a_reply_subject_may_not_be_another_connection_s_inbox() {
    let broker = broker_with(&format!(
        r#"
        [[auth.users]]
        name = "inboxes"
        password = "{hash}"
        [auth.users.permissions.publish]
        allow = ["svc.>"]
        [auth.users.permissions.subscribe]
        allow = ["_INBOX.>"]
        "#,
        hash = hash_secret("inboxes-password").unwrap(),
    ));
    let requester = login(&broker, Some("requester"), Some("requester-password")).unwrap();
    let held = requester.subscribe("_INBOX.r9.>").unwrap();
    requester.flush(WAIT).unwrap();
    let other = login(&broker, Some("inboxes"), Some("inboxes-password")).unwrap();
    other
        .publish_request("svc.pay", "_INBOX.r9.1", b"x".to_vec())
        .unwrap();
    // An inbox nobody holds, under its permissions, is its own to name.
    other
        .publish_request("svc.pay", "_INBOX.o4.1", b"x".to_vec())
        .unwrap();
    other.flush(WAIT).unwrap();
    one_error_naming(&other, "reply subject \"_INBOX.r9.1\"");
    drop(held);
}

/// A raw peer posing as broker `broker_id`, with a route to `broker`
/// (whose `cluster.secret` is "mesh") announcing interest in `pattern`.
fn route_announcing(broker: &Broker, broker_id: u64, pattern: &str) -> Raw {
    let mut raw = Raw::connect(broker);
    raw.send(&Frame::Hello(Hello {
        no_echo: false,
        no_responders: false,
        version: PROTOCOL_VERSION,
        name: format!("broker-{broker_id}"),
        credentials: Some("mesh".to_string()),
        user: None,
        proof: None,
        offers: Vec::new(),
        link_auth: None,
    }));
    raw.send(&Frame::Route(RouteHello {
        broker_id,
        advertise: None,
        seeded: false,
        limits: raw_common::default_route_limits(),
    }));
    raw.expect("the route hello back", |f| matches!(f, Frame::Route(_)));
    raw.send(&raw_common::subscribe(1, pattern));
    raw
}

/// An inbox a route announces is held for the requester behind it while
/// any route still subscribes under it: when the first route to announce
/// it goes (as the losing one of two links between the same brokers
/// does), the other keeps it, and a restricted user still may not
/// subscribe under it; with the last route gone, it is free.
#[test]
fn an_inbox_stays_held_while_any_route_subscribes_under_it() {
    let text = format!(
        r#"
        name = "inboxes"
        listen = ["tcp/127.0.0.1:0"]
        [cluster]
        secret = "mesh"
        [[auth.users]]
        name = "responder"
        password = "{responder}"
        [auth.users.permissions.subscribe]
        allow = ["svc.>"]
        "#,
        responder = hash_secret("responder-password").unwrap(),
    );
    let config = Config::from_toml_str(&text, "inbox test").expect("valid config");
    let broker = Broker::start(config).expect("the broker starts");
    let routes = || broker.stats().value("routes").unwrap_or(0);
    let first = route_announcing(&broker, 42, "_INBOX.f00d.*");
    let second = route_announcing(&broker, 43, "_INBOX.f00d.*");
    wait_until("both routes' interest", || {
        routes() == 2 && broker.route_interest_count() == 2
    });
    drop(first);
    wait_until("the first route gone", || {
        routes() == 1 && broker.route_interest_count() == 1
    });
    let responder = login(&broker, Some("responder"), Some("responder-password")).unwrap();
    let taken = responder.subscribe("_INBOX.f00d.*").unwrap();
    responder.flush(WAIT).unwrap();
    let errors = responder.take_errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].1.contains("another connection's"), "{errors:?}");
    drop(taken);
    drop(second);
    wait_until("the second route gone", || routes() == 0);
    let _now = responder.subscribe("_INBOX.f00d.*").unwrap();
    responder.flush(WAIT).unwrap();
    assert_eq!(
        responder.take_errors(),
        Vec::new(),
        "free with the last route"
    );
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}
