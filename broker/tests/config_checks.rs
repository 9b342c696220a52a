//! Configurations handed to the embedded API are checked like files: values
//! the wire cannot carry and unknown listener schemes are refused with a
//! configuration error naming the key, before anything starts.

use efabus_broker::config::{ConfigError, MAX_NAME_LEN, MAX_SUBJECT_LEN_LIMIT};
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
        message.contains(&format!("1 to {MAX_SUBJECT_LEN_LIMIT}")),
        "{message}"
    );

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
