//! A broker with `[tls]`: clients over TLS and mutual TLS, refused
//! without the right authority or certificate, and never in cleartext; a
//! route between two brokers over mutual TLS; a fabric data path agreed
//! inside a TLS control connection; certificates read again on reload.
//! Certificates are made for each test process with rcgen.

use std::time::{Duration, Instant};

use efabus_broker::config::Tls;
use efabus_broker::reload::TLS_FILES;
use efabus_broker::{Broker, Client, ClientOptions, Config, Error};
use efabus_transports::conformance::pki::{self, Pki};
use efabus_transports::registry::Registry;

const WAIT: Duration = Duration::from_secs(10);

fn fabric_required() -> bool {
    std::env::var("EFABUS_REQUIRE_FABRIC").is_ok_and(|v| v == "1")
}

fn toml_tls(pki: &Pki, verify_clients: bool) -> String {
    format!(
        "[tls]\ncert = {:?}\nkey = {:?}\nca = {:?}\nverify_clients = {verify_clients}\n",
        pki.server_cert, pki.server_key, pki.ca
    )
}

fn broker(name: &str, extra: &str) -> Broker {
    let text = format!("name = \"{name}\"\nlisten = [\"tcp/127.0.0.1:0\"]\n{extra}");
    let config = Config::from_toml_str(&text, "tls test").expect("valid config");
    Broker::start(config).expect("the broker starts")
}

fn client_tls(pki: &Pki, with_cert: bool) -> Tls {
    Tls {
        ca: Some(pki.ca.clone()),
        cert: with_cert.then(|| pki.client_cert.clone()),
        key: with_cert.then(|| pki.client_key.clone()),
        ..Tls::default()
    }
}

fn connect(broker: &Broker, tls: Tls) -> Result<Client, Error> {
    connect_to(
        &broker.endpoint("tcp").expect("tcp listener"),
        tls,
        Vec::new(),
    )
}

fn connect_to(server: &str, tls: Tls, data_paths: Vec<String>) -> Result<Client, Error> {
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(3),
        reconnect: false,
        tls,
        data_paths,
        ..ClientOptions::default()
    };
    Client::connect_with(server, options, Registry::with_builtins())
}

fn round_trip(publisher: &Client, subscriber: &Client, subject: &str) {
    let sub = subscriber.subscribe(subject).expect("subscribe");
    subscriber.flush(WAIT).expect("flush");
    for n in 0..100u32 {
        publisher
            .publish(subject, n.to_le_bytes().to_vec())
            .expect("publish");
    }
    publisher.flush(WAIT).expect("flush");
    for n in 0..100u32 {
        let message = sub.recv_timeout(WAIT).expect("delivered over TLS");
        assert_eq!(message.payload[..], n.to_le_bytes());
    }
}

#[test]
fn clients_connect_over_tls_and_cleartext_or_a_stranger_ca_is_refused() {
    let pki = pki::shared();
    let broker = broker("tls", &toml_tls(pki, false));
    let a = connect(&broker, client_tls(pki, false)).expect("a TLS client connects");
    let b = connect(&broker, client_tls(pki, false)).expect("another");
    round_trip(&a, &b, "tls.orders");

    let err = connect(&broker, Tls::default()).expect_err("cleartext is refused");
    assert!(err.to_string().contains("speaks TLS"), "{err}");

    let stranger = Pki::new("stranger");
    let err = connect(&broker, client_tls(&stranger, false))
        .expect_err("a server the client's CA did not issue is refused");
    assert!(err.to_string().contains("certificate"), "{err}");
    // The refusals were the clients'; the broker learns of them when
    // their connections close, which may come after the clients return.
    let deadline = Instant::now() + WAIT;
    while broker.stats().value("connections") != Some(2) {
        assert!(
            Instant::now() < deadline,
            "refused connections still counted: {:?}",
            broker.stats().value("connections")
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn mutual_tls_needs_a_client_certificate_from_the_ca() {
    let pki = pki::shared();
    let broker = broker("mtls", &toml_tls(pki, true));
    assert!(
        connect(&broker, client_tls(pki, false)).is_err(),
        "a client without a certificate is refused"
    );
    let a = connect(&broker, client_tls(pki, true)).expect("a client with one connects");
    let b = connect(&broker, client_tls(pki, true)).expect("another");
    round_trip(&a, &b, "mtls.orders");
}

#[test]
fn a_route_runs_over_mutual_tls() {
    let pki = pki::shared();
    let a = broker("route-a", &toml_tls(pki, true));
    let seed = a.endpoint("tcp").expect("tcp listener");
    let b = broker(
        "route-b",
        &format!("peers = [{seed:?}]\n{}", toml_tls(pki, true)),
    );
    let deadline = Instant::now() + WAIT;
    while a.routes().is_empty() || b.routes().is_empty() {
        assert!(Instant::now() < deadline, "the route never came up");
        std::thread::sleep(Duration::from_millis(10));
    }
    let on_a = connect(&a, client_tls(pki, true)).expect("client on a");
    let on_b = connect(&b, client_tls(pki, true)).expect("client on b");
    let sub = on_b.subscribe("across.>").expect("subscribe");
    on_b.flush(WAIT).expect("flush");
    let deadline = Instant::now() + WAIT;
    let mut got = None;
    while got.is_none() {
        assert!(Instant::now() < deadline, "nothing crossed the route");
        on_a.publish("across.tls", b"hello".to_vec())
            .expect("publish");
        got = sub.recv_timeout(Duration::from_millis(100)).ok();
    }
    assert_eq!(&got.unwrap().payload[..], b"hello");

    // A broker without the CA's certificate cannot join.
    let stranger = Pki::new("route-stranger");
    let c = broker(
        "route-c",
        &format!("peers = [{seed:?}]\n{}", toml_tls(&stranger, true)),
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(c.routes().is_empty(), "{:?}", c.routes());
    assert_eq!(a.routes().len(), 1);
}

#[test]
fn a_fabric_data_path_is_agreed_inside_tls() {
    let pki = pki::shared();
    let text = format!(
        "name = \"tls-fabric\"\nlisten = [\"tcp/127.0.0.1:0\", \"efa-rdm\"]\n\
         [fabric]\nprovider = \"tcp;ofi_rxm\"\nnode = \"127.0.0.1\"\n{}",
        toml_tls(pki, false)
    );
    let config = Config::from_toml_str(&text, "tls fabric test").expect("valid config");
    let broker = Broker::start(config).expect("the broker starts");
    if broker.endpoint("efa-rdm").is_none() {
        assert!(
            !fabric_required(),
            "EFABUS_REQUIRE_FABRIC=1 but tcp;ofi_rxm did not open"
        );
        eprintln!("skipping: tcp;ofi_rxm cannot open here");
        return;
    }
    let server = broker.endpoint("tcp").expect("tcp listener");
    let fabric_client = || {
        let options = ClientOptions {
            connect_timeout: WAIT,
            reconnect: false,
            tls: client_tls(pki, false),
            data_paths: vec!["efa-rdm".to_string()],
            fabric: broker.config().fabric.clone(),
            ..ClientOptions::default()
        };
        Client::connect_with(&server, options, Registry::with_builtins()).expect("connects")
    };
    let a = fabric_client();
    let b = fabric_client();
    for client in [&a, &b] {
        assert!(
            client.link().reliable.starts_with("efa-rdm"),
            "{:?}",
            client.link()
        );
    }
    round_trip(&a, &b, "tls.fabric");
    assert!(broker.stats().value("fabric_frames_in") > Some(0));
}

#[test]
fn reload_reads_the_certificates_again() {
    let first = Pki::new("reload-first");
    let broker = broker("reloading-tls", &toml_tls(&first, false));
    let before = connect(&broker, client_tls(&first, false)).expect("connects");

    // New certificate and key from another authority, in the same files.
    let second = Pki::new("reload-second");
    std::fs::copy(&second.server_cert, &first.server_cert).unwrap();
    std::fs::copy(&second.server_key, &first.server_key).unwrap();
    let reloaded = broker.reload(&broker.running_config()).expect("reload");
    assert_eq!(reloaded.applied, [TLS_FILES]);
    connect(&broker, client_tls(&second, false)).expect("the new certificate is presented");
    assert!(connect(&broker, client_tls(&first, false)).is_err());
    before
        .flush(WAIT)
        .expect("the session made before stays up");

    // A key that does not fit: refused, and the certificate in use stays.
    std::fs::copy(&first.client_key, &first.server_key).unwrap();
    let err = broker
        .reload(&broker.running_config())
        .expect_err("a mismatched key is refused");
    assert!(err.to_string().contains("stay"), "{err}");
    connect(&broker, client_tls(&second, false)).expect("still the second");
}

/// A reload takes the new files on every listener or on none: when one
/// listener cannot (here an injected failure on the NATS listener, read
/// after the TCP one), the TCP listener goes back to the certificate in
/// use.
#[test]
fn a_reload_one_listener_refuses_changes_no_listener() {
    let first = Pki::new("reload-all-or-none");
    let text = format!(
        "name = \"all-or-none\"\nlisten = [\"tcp/127.0.0.1:0\", \"nats/127.0.0.1:0\"]\n{}\
         [testing.faults]\nfail_tls_reload = true\nscheme = \"nats\"\n",
        toml_tls(&first, false)
    );
    let config = Config::from_toml_str(&text, "tls test").expect("valid config");
    let broker = Broker::start(config).expect("the broker starts");
    connect(&broker, client_tls(&first, false)).expect("connects");
    let second = Pki::new("reload-all-or-none-second");
    std::fs::copy(&second.server_cert, &first.server_cert).unwrap();
    std::fs::copy(&second.server_key, &first.server_key).unwrap();
    let err = broker
        .reload(&broker.running_config())
        .expect_err("the NATS listener refuses");
    assert!(err.to_string().contains("stay"), "{err}");
    connect(&broker, client_tls(&first, false)).expect("the TCP listener's certificate stays");
    assert!(connect(&broker, client_tls(&second, false)).is_err());
}

/// A reload reads new TLS files while the broker holds publishers back
/// for a slow consumer under `block` (its event loop reads no commands
/// then, and the reload does not wait for them); a client dialing once
/// the slow consumer has gone is given the new certificate.
#[test]
fn a_reload_takes_new_certificates_while_publishers_are_held_up() {
    let pki = Pki::new("reload-while-held");
    let extra = format!(
        "{}[limits]\nmax_pending_bytes = 65536\n\
         [slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 60000\n\
         [shutdown]\ndrain_timeout_ms = 300\n",
        toml_tls(&pki, false)
    );
    let broker = std::sync::Arc::new(broker("reload-held", &extra));
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(3),
        reconnect: false,
        tls: client_tls(&pki, false),
        subscription_queue: 1,
        slow_consumer: efabus_broker::SlowConsumerPolicy::Block,
        block_timeout: Duration::from_secs(60),
        ..ClientOptions::default()
    };
    let server = broker.endpoint("tcp").expect("tcp listener");
    let stalled =
        Client::connect_with(&server, options, Registry::with_builtins()).expect("connects");
    let sub = stalled.subscribe("held").unwrap();
    stalled.flush(WAIT).unwrap();
    let publisher = std::thread::spawn({
        let broker = std::sync::Arc::clone(&broker);
        move || {
            let payload = bytes::Bytes::from(vec![1u8; 4096]);
            // Stops once held up for good (the broker's shutdown below).
            for _ in 0..100_000 {
                if broker.publish("held", payload.clone()).is_err() {
                    break;
                }
            }
        }
    });
    let deadline = Instant::now() + WAIT;
    while broker.stats().value("queued_bytes") < Some(65536) {
        assert!(Instant::now() < deadline, "the publisher was never held up");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(!publisher.is_finished(), "the publisher is held up");
    let second = Pki::new("reload-while-held-second");
    std::fs::copy(&second.server_cert, &pki.server_cert).unwrap();
    std::fs::copy(&second.server_key, &pki.server_key).unwrap();
    let reloaded = broker
        .reload(&broker.running_config())
        .expect("reloaded while publishers are held");
    assert_eq!(reloaded.applied, [TLS_FILES]);
    // The slow consumer goes: the broker serves again.
    drop(sub);
    drop(stalled);
    connect(&broker, client_tls(&second, false)).expect("the new certificate is presented");
    broker.shutdown();
    publisher.join().unwrap();
}

#[test]
fn tls_settings_that_cannot_work_are_refused_at_start() {
    let pki = pki::shared();
    let no_key = format!("[tls]\ncert = {:?}\n", pki.server_cert);
    let text = format!("listen = [\"tcp/127.0.0.1:0\"]\n{no_key}");
    let err = Config::from_toml_str(&text, "t").expect_err("a certificate without a key");
    assert!(err.to_string().contains("tls"), "{err}");
    let routes_without_ca = format!(
        "listen = [\"tcp/127.0.0.1:0\"]\npeers = [\"tcp/127.0.0.1:9\"]\n\
         [tls]\ncert = {:?}\nkey = {:?}\n",
        pki.server_cert, pki.server_key
    );
    let err = Config::from_toml_str(&routes_without_ca, "t").expect_err("routes need a CA");
    assert!(err.to_string().contains("tls.ca"), "{err}");
    // A client's file needs only the authority; a broker's listener needs
    // a certificate.
    let ca_only = format!("[tls]\nca = {:?}\n", pki.ca);
    Config::from_toml_str(&ca_only, "client").expect("a client config with only tls.ca");
    let listener = format!("listen = [\"tcp/127.0.0.1:0\"]\n{ca_only}");
    let err =
        Config::from_toml_str(&listener, "t").expect_err("a TLS listener without a certificate");
    assert!(err.to_string().contains("tls.cert"), "{err}");
    let missing = format!(
        "listen = [\"tcp/127.0.0.1:0\"]\n[tls]\ncert = \"/nonexistent/cert.pem\"\nkey = {:?}\n",
        pki.server_key
    );
    let config = Config::from_toml_str(&missing, "t").expect("valid syntax");
    let err = Broker::start(config).expect_err("a missing certificate file");
    assert!(err.to_string().contains("/nonexistent/cert.pem"), "{err}");
}

/// A user named by its client certificate: with mutual TLS, a client that
/// presents a certificate whose subject name a user lists, and no other
/// credentials, is that user and held to its permissions; another name
/// from the same authority is refused.
#[test]
fn a_client_certificate_names_its_user() {
    let pki = pki::shared();
    let users = "[[auth.users]]\nname = \"robot\"\ncertificate = \"client\"\n\
                 [auth.users.permissions.publish]\nallow = [\"robot.>\"]\n";
    let broker = broker("cert-users", &format!("{}{users}", toml_tls(pki, true)));
    let robot = connect(&broker, client_tls(pki, true)).expect("the certificate logs in");
    robot.publish("robot.status", b"up".to_vec()).unwrap();
    robot.publish("orders.eu", b"no".to_vec()).unwrap();
    robot.flush(WAIT).unwrap();
    let errors = robot.take_errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].1.contains("orders.eu") && errors[0].1.contains("robot"),
        "{errors:?}"
    );

    let dir = pki.dir.join("cert-users");
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = pki
        .authority
        .issue(&dir, "other", "someone-else", &["other.local"], false);
    let other = Tls {
        ca: Some(pki.ca.clone()),
        cert: Some(cert),
        key: Some(key),
        ..Tls::default()
    };
    match connect(&broker, other) {
        Err(Error::Refused { text, .. }) => assert!(text.contains("credentials"), "{text}"),
        Err(err) => panic!("{err}"),
        Ok(_) => panic!("a certificate no user names logged in"),
    }

    // Certificate users need the broker to ask for certificates.
    let text = format!(
        "listen = [\"tcp/127.0.0.1:0\"]\n{}{users}",
        toml_tls(pki, false)
    );
    let err = Config::from_toml_str(&text, "t").expect_err("without verify_clients");
    assert!(err.to_string().contains("verify_clients"), "{err}");
}
