//! The NATS listener with a second language's client: nats-py, the NATS
//! project's Python client from PyPI, runs `scripts/nats-py-check.py`
//! against `efabus serve`, with a native client on the other side, in the
//! clear and over mutual TLS.
//! `scripts/test` installs nats-py in a virtual environment and names its
//! interpreter in `EFABUS_NATS_PYTHON`; without it the test is skipped,
//! except under CI=true, where it must run.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::temp_path;
use efabus::broker::config::Tls;
use efabus::core::headers::Headers;
use efabus::transports::conformance::pki;
use efabus::transports::registry::Registry;
use efabus::{Client, ClientOptions};

const WAIT: Duration = Duration::from_secs(60);

/// A child process killed when the test ends, however it ends (a broker
/// left running would hold the test's output open).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Lines of a child's stdout, as they come.
fn lines(stdout: std::process::ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

#[test]
fn nats_py_talks_to_the_nats_listener_and_to_native_clients() {
    check_with_nats_py("nats.toml", "", Vec::new(), Tls::default());
}

#[test]
fn nats_py_talks_over_mutual_tls() {
    let pki = pki::shared();
    // The only user logs in by its certificate: nothing gets in without
    // mutual TLS.
    let section = format!(
        "[tls]\ncert = {:?}\nkey = {:?}\nca = {:?}\nverify_clients = true\n\
         [[auth.users]]\nname = \"by-certificate\"\ncertificate = \"client\"\n",
        pki.server_cert, pki.server_key, pki.ca
    );
    let files = vec![
        pki.ca.clone(),
        pki.client_cert.clone(),
        pki.client_key.clone(),
    ];
    let native = Tls {
        ca: Some(pki.ca.clone()),
        cert: Some(pki.client_cert.clone()),
        key: Some(pki.client_key.clone()),
        ..Tls::default()
    };
    check_with_nats_py("nats-tls.toml", &section, files, native);
}

/// Run the nats-py check against `efabus serve` with `extra` in its
/// config, the script given `script_args` after the URL and the native
/// client `tls`.
fn check_with_nats_py(config_name: &str, extra: &str, script_args: Vec<String>, tls: Tls) {
    let Ok(python) = std::env::var("EFABUS_NATS_PYTHON") else {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "EFABUS_NATS_PYTHON is not set: scripts/test installs nats-py and sets it"
        );
        eprintln!("skipped: EFABUS_NATS_PYTHON is not set (scripts/test sets it)");
        return;
    };
    let config = temp_path(config_name);
    std::fs::write(
        &config,
        format!(
            "listen = [\"tcp/127.0.0.1:0\", \"nats/127.0.0.1:0\"]\nlog_level = \"error\"\n{extra}"
        ),
    )
    .expect("writes the config");
    let mut broker = Killed(
        Command::new(env!("CARGO_BIN_EXE_efabus"))
            .args(["serve", "--config"])
            .arg(&config)
            .stdout(Stdio::piped())
            .spawn()
            .expect("starts efabus serve"),
    );
    let said = lines(broker.0.stdout.take().expect("stdout"));
    let (mut tcp, mut nats) = (None, None);
    while tcp.is_none() || nats.is_none() {
        let line = said
            .recv_timeout(WAIT)
            .expect("the broker reports its listeners");
        if let Some(endpoint) = line.strip_prefix("listening on ") {
            if endpoint.starts_with("nats/") {
                nats = Some(endpoint.replacen("nats/", "nats://", 1));
            } else if endpoint.starts_with("tcp/") {
                tcp = Some(endpoint.to_string());
            }
        }
    }
    let (tcp, nats) = (tcp.expect("tcp"), nats.expect("nats"));

    let options = ClientOptions {
        tls,
        ..ClientOptions::default()
    };
    let native = Client::connect_with(&tcp, options, Registry::with_builtins())
        .expect("a native client connects");
    let from_python = native.subscribe("to.native").expect("subscribes");
    native.flush(Duration::from_secs(10)).expect("flushed");

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/nats-py-check.py");
    let mut check = Killed(
        Command::new(&python)
            .arg(script)
            .arg(&nats)
            .args(&script_args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("runs the nats-py check"),
    );
    let output = lines(check.0.stdout.take().expect("stdout"));
    let mut transcript = Vec::new();
    loop {
        let line = output
            .recv_timeout(WAIT)
            .unwrap_or_else(|_| panic!("the check stopped before `ready`: {transcript:?}"));
        transcript.push(line.clone());
        if line == "ready" {
            break;
        }
    }
    native
        .publish("from.native", "from native")
        .expect("publishes");
    native.flush(Duration::from_secs(10)).expect("flushed");

    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = check.0.try_wait().expect("waits") {
            break status;
        }
        assert!(Instant::now() < deadline, "the check did not end");
        std::thread::sleep(Duration::from_millis(20));
    };
    transcript.extend(output.try_iter());
    assert!(status.success(), "nats-py check failed: {transcript:?}");
    assert!(
        transcript.iter().any(|line| line == "drained: ok"),
        "{transcript:?}"
    );
    if !script_args.is_empty() {
        assert!(
            transcript.iter().any(|line| line == "tls: ok"),
            "{transcript:?}"
        );
    }

    let message = from_python
        .recv_timeout(Duration::from_secs(10))
        .expect("python's message");
    assert_eq!(&message.payload[..], b"from python");
    let headers = Headers::parse(message.headers.as_ref().expect("headers")).expect("parses");
    assert_eq!(headers.get("Lang"), Some("python"));
    drop(broker);
    let _ = std::fs::remove_file(config);
}
