//! `efabus serve --monitor` and the commands that read it, `efabus stats`
//! and `efabus conns`, run as a user runs them.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use common::{efabus, text, Server};
use efabus::{Bytes, Client, ClientOptions};

const WAIT: Duration = Duration::from_secs(10);

/// A port nothing listens on (bound, then freed).
fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("address").port()
}

#[test]
fn stats_and_conns_read_a_running_broker() {
    let server = Server::start("monitor = \"127.0.0.1:0\"");
    let monitor = server
        .monitor
        .clone()
        .expect("the broker serves monitoring");
    let options = ClientOptions {
        name: "watched".to_string(),
        ..ClientOptions::default()
    };
    let client = Client::connect_with(
        &server.endpoint,
        options,
        efabus::transports::registry::Registry::with_builtins(),
    )
    .expect("connect");
    let sub = client.subscribe("metrics.>").expect("subscribe");
    for n in 0..3u8 {
        client
            .publish("metrics.cpu", Bytes::from(vec![n; 10]))
            .expect("publish");
    }
    for _ in 0..3 {
        sub.recv_timeout(WAIT).expect("delivered");
    }

    let stats = efabus(&["stats", "--monitor", &monitor]);
    let out = text(&stats.stdout);
    assert!(stats.status.success(), "{}", text(&stats.stderr));
    let messages_in = out
        .lines()
        .find_map(|line| line.trim().strip_prefix("messages_in"))
        .map(str::trim);
    assert_eq!(messages_in, Some("3"), "{out}");
    assert!(out.contains("1 subscriptions"), "{out}");

    // The address may be given as a URL.
    let url = format!("http://{monitor}/");
    let conns = efabus(&["conns", "--monitor", &url, "--sort", "msgs_to"]);
    let out = text(&conns.stdout);
    assert!(conns.status.success(), "{}", text(&conns.stderr));
    let row = out
        .lines()
        .find(|line| line.contains("watched"))
        .unwrap_or_else(|| panic!("no row for the client: {out}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    // CID NAME REMOTE LINK PROVIDER MSGS-IN MSGS-OUT PENDING DROPPED SUBS
    assert_eq!(cells[3], "tcp", "{row}");
    assert_eq!(&cells[5..10], ["3", "3", "0", "0", "1"], "{row}");
}

/// `/varz` names the libfabric a broker with a fabric listener loaded,
/// and none for a broker without one (asking does not load it).
#[test]
fn varz_names_the_libfabric_in_use() {
    let tcp_only = Server::start("monitor = \"127.0.0.1:0\"");
    let varz = common::monitor_json(tcp_only.monitor.as_ref().unwrap(), "/varz");
    if efabus::transports::fabric::LIBFABRIC_LOADED_AT_FIRST_USE {
        assert!(varz["libfabric"].is_null(), "{varz}");
    }
    if !efabus::transports::fabric::LIBFABRIC_LINKED {
        return;
    }
    let with_shm = Server::start_listening(
        &["tcp/127.0.0.1:0", "shm"],
        "monitor = \"127.0.0.1:0\"",
        &[],
    );
    let varz = common::monitor_json(with_shm.monitor.as_ref().unwrap(), "/varz");
    if varz["libfabric"].is_null() && !common::fabric_required() {
        eprintln!("skipping: the broker could not load libfabric here: {varz}");
        return;
    }
    let path = varz["libfabric"]["path"].as_str().unwrap_or_default();
    assert!(std::path::Path::new(path).exists(), "{varz}");
    let version = varz["libfabric"]["version"].as_str().unwrap_or_default();
    assert!(
        version.starts_with("1.") || version.starts_with("2."),
        "{varz}"
    );
}

#[test]
fn a_monitor_that_is_not_there_is_one_line_that_says_where_to_look() {
    let address = format!("127.0.0.1:{}", closed_port());
    for command in ["stats", "conns"] {
        let output = efabus(&[command, "--monitor", &address]);
        assert_eq!(output.status.code(), Some(1), "{command}");
        let err = text(&output.stderr);
        assert_eq!(err.lines().count(), 1, "{command}: {err}");
        assert!(
            err.contains("cannot read the monitor") && err.contains(&address),
            "{command}: {err}"
        );
    }
    // An order it does not know is a usage error before any request.
    let output = efabus(&["conns", "--monitor", &address, "--sort", "bogus"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text(&output.stderr).contains("possible values"));
}

#[test]
fn serve_refuses_a_bad_or_taken_monitor_address() {
    let output = efabus(&["serve", "-l", "tcp/127.0.0.1:0", "--monitor", "8222"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output.stderr));
    assert!(text(&output.stderr).contains("monitor"));

    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = taken.local_addr().expect("address").to_string();
    let output = efabus(&["serve", "-l", "tcp/127.0.0.1:0", "--monitor", &address]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output.stderr));
    let err = text(&output.stderr);
    assert!(
        err.contains("cannot listen for monitoring") && err.contains(&address),
        "{err}"
    );
}
