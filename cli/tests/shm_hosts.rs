//! `shm` pairs only peers of one host. An embedded broker listens on TCP,
//! `shm` and `efa-rdm` (`tcp;ofi_rxm`); an `efabus sub` process offering
//! `shm` and `efa-rdm` moves its reliable traffic to `shm` when it is on
//! the broker's host, and to `efa-rdm` when `EFABUS_HOST_ID` says it is on
//! another (as a container that does not share `/dev/shm` would be told).
//! Either way it receives what is published.
//!
//! Skipped with a message where `shm` cannot open, unless
//! `EFABUS_REQUIRE_FABRIC=1` (CI).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use efabus::{Broker, Bytes, Client, ClientOptions, Config};

mod common;
use common::temp_path;

const WAIT: Duration = Duration::from_secs(10);

const FABRIC: &str = "[fabric]\nprovider = \"tcp;ofi_rxm\"\nnode = \"127.0.0.1\"\n";

fn start_broker() -> Option<Broker> {
    let text =
        format!("name = \"hosts\"\nlisten = [\"tcp/127.0.0.1:0\", \"shm\", \"efa-rdm\"]\n{FABRIC}");
    let broker = Broker::start(Config::from_toml_str(&text, "shm hosts test").expect("config"))
        .expect("the broker starts");
    if broker.endpoint("shm").is_none() || broker.endpoint("efa-rdm").is_none() {
        assert!(
            !common::fabric_required(),
            "EFABUS_REQUIRE_FABRIC=1 but shm did not open"
        );
        eprintln!("skipping: shm or tcp;ofi_rxm cannot open here");
        return None;
    }
    Some(broker)
}

/// Runs `efabus sub` offering `shm` and `efa-rdm`, with `host_id` as
/// `EFABUS_HOST_ID` if given (else with this process's environment, so the
/// broker's identity); returns the data link it reports and checks that it
/// receives a message published once it is up.
fn subscriber_link(broker: &Broker, host_id: Option<&str>) -> String {
    let config = temp_path("shm-hosts.toml");
    std::fs::write(
        &config,
        format!("listen = [\"shm\", \"efa-rdm\"]\n{FABRIC}"),
    )
    .expect("write the client config");
    let mut command = Command::new(env!("CARGO_BIN_EXE_efabus"));
    command
        .args(["sub", "hosts.>", "--server"])
        .arg(broker.endpoint("tcp").expect("tcp listener"))
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "efabus_broker=info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(id) = host_id {
        command.env("EFABUS_HOST_ID", id);
    }
    let mut child = command.spawn().expect("spawn efabus sub");
    let (line_tx, lines) = mpsc::channel();
    let stdout = child.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = line_tx.send(line);
        }
    });
    let (link_tx, link_line) = mpsc::channel();
    let stderr = child.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("reliable traffic moves to the data link") {
                let _ = link_tx.send(line);
            }
        }
    });
    let link = link_line.recv_timeout(WAIT).unwrap_or_else(|_| {
        let _ = child.kill();
        panic!("the subscriber never reported a data link")
    });
    let publisher = Client::connect_with(
        &broker.endpoint("tcp").expect("tcp listener"),
        ClientOptions {
            name: "publisher".into(),
            connect_timeout: WAIT,
            ..ClientOptions::default()
        },
        efabus::transports::registry::Registry::with_builtins(),
    )
    .expect("publisher connects");
    let deadline = Instant::now() + WAIT;
    let received = loop {
        publisher
            .publish("hosts.hello", Bytes::from_static(b"hello"))
            .unwrap();
        if let Ok(line) = lines.recv_timeout(Duration::from_millis(100)) {
            break line;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the subscriber received nothing");
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(received.contains("hello"), "{received}");
    link
}

#[test]
fn shm_pairs_only_peers_of_one_host() {
    let Some(broker) = start_broker() else {
        return;
    };
    let here = subscriber_link(&broker, None);
    assert!(here.contains("shm via shm"), "same host: {here}");
    let elsewhere = subscriber_link(&broker, Some("another-host"));
    assert!(
        elsewhere.contains("efa-rdm via tcp;ofi_rxm"),
        "another host: {elsewhere}"
    );
}
