//! Configurations handed to the embedded API are checked like files: values
//! the wire cannot carry and unknown listener schemes are refused with a
//! configuration error naming the key, before anything starts.

use efabus_broker::config::{
    ConfigError, MAX_NAME_LEN, MAX_SUBJECT_LEN_LIMIT, MIN_SUBJECT_LEN, MIN_SUBJECT_TOKENS,
};
use efabus_broker::{Broker, Client, ClientOptions, Config, Error};
use efabus_transports::registry::Registry;

fn refused_key(config: Config) -> (String, String) {
    match Broker::start(config) {
        Err(Error::Config(ConfigError::Invalid { key, message, .. })) => (key, message),
        Err(other) => panic!("expected a config error, got {other}"),
        Ok(_) => panic!("the broker started"),
    }
}

#[test]
fn values_beyond_the_wire_are_refused_by_key_and_range() {
    let config = Config {
        name: "n".repeat(70_000),
        ..Config::default()
    };
    let (key, message) = refused_key(config);
    assert_eq!(key, "name");
    assert!(message.contains(&MAX_NAME_LEN.to_string()), "{message}");

    let mut config = Config::default();
    config.limits.max_subject_len = 200_000;
    let (key, message) = refused_key(config);
    assert_eq!(key, "limits.max_subject_len");
    assert!(
        message.contains(&format!("{MIN_SUBJECT_LEN} to {MAX_SUBJECT_LEN_LIMIT}")),
        "{message}"
    );

    // Below what a request's reply inbox needs, every request would fail.
    let mut config = Config::default();
    config.limits.max_subject_len = MIN_SUBJECT_LEN - 1;
    let (key, message) = refused_key(config);
    assert_eq!(key, "limits.max_subject_len");
    assert!(message.contains("_INBOX"), "{message}");
    let mut config = Config::default();
    config.limits.max_subject_tokens = MIN_SUBJECT_TOKENS - 1;
    let (key, message) = refused_key(config);
    assert_eq!(key, "limits.max_subject_tokens");
    assert!(message.contains("_INBOX"), "{message}");

    let config = Config {
        log_level: "everything".into(),
        ..Config::default()
    };
    assert_eq!(refused_key(config).0, "log_level");

    // At the bounds, the broker starts and serves a connection.
    let mut config = Config {
        name: "n".repeat(MAX_NAME_LEN),
        listen: vec!["tcp/127.0.0.1:0".into()],
        ..Config::default()
    };
    config.limits.max_subject_len = MAX_SUBJECT_LEN_LIMIT;
    // The client takes the same limits (and the long name, for its hello).
    let options = ClientOptions {
        reconnect: false,
        ..ClientOptions::from_config(&config)
    };
    let broker = Broker::start(config).expect("start at the bounds");
    let endpoint = broker.endpoint("tcp").expect("tcp listener");
    let client =
        Client::connect_with(&endpoint, options, Registry::with_builtins()).expect("connect");
    // A pattern and a queue name at the limit fit one subscribe frame.
    let subject = format!("s.{}", "x".repeat(MAX_SUBJECT_LEN_LIMIT - 2));
    let group = "g".repeat(MAX_SUBJECT_LEN_LIMIT);
    let sub = client.queue_subscribe(&subject, &group);
    assert!(sub.is_ok(), "a pattern at the limit is accepted");
    let sub = sub.unwrap();
    client.flush(std::time::Duration::from_secs(10)).unwrap();
    assert!(client.publish(&subject, &b"at the limit"[..]).is_ok());
    let message = sub
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("delivered");
    assert_eq!(&message.payload[..], b"at the limit");
    client.shutdown();
    broker.shutdown();
}

#[test]
fn listeners_must_name_a_registered_scheme() {
    let config = Config {
        listen: vec!["mem/config-checks".into(), "foo/bar".into()],
        ..Config::default()
    };
    let (key, message) = refused_key(config);
    assert_eq!(key, "listen[1]");
    assert!(
        message.contains("known schemes: efa-dgram, efa-rdm, mem, nats, shm, tcp"),
        "{message}"
    );
}

/// At the smallest subject limits a broker takes, requests get their
/// replies: the reply inboxes, the broker's own and a client's, fit.
#[test]
fn requests_work_at_the_smallest_subject_limits() {
    let mut config = Config {
        listen: vec!["tcp/127.0.0.1:0".into()],
        ..Config::default()
    };
    config.limits.max_subject_len = MIN_SUBJECT_LEN;
    config.limits.max_subject_tokens = MIN_SUBJECT_TOKENS;
    let options = ClientOptions {
        reconnect: false,
        ..ClientOptions::from_config(&config)
    };
    let broker = Broker::start(config).expect("start at the smallest limits");
    let _echo = broker
        .respond("svc.echo", |request| Some(request.payload.clone()))
        .expect("a responder");
    let wait = std::time::Duration::from_secs(10);
    let reply = broker
        .request("svc.echo", bytes::Bytes::from_static(b"in"), wait)
        .expect("the broker's own request");
    assert_eq!(&reply.payload[..], b"in");
    let endpoint = broker.endpoint("tcp").expect("tcp listener");
    let client =
        Client::connect_with(&endpoint, options, Registry::with_builtins()).expect("connect");
    let reply = client
        .request("svc.echo", bytes::Bytes::from_static(b"out"), wait)
        .expect("a client's request");
    assert_eq!(&reply.payload[..], b"out");
}
