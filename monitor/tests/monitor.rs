//! The monitoring listener against a running broker with a client on the
//! fabric (`tcp;ofi_rxm` on loopback) and one on TCP only: every view is
//! read over HTTP as a user's tools would, `/metrics` through a Prometheus
//! text parser and the Prometheus project's own OpenMetrics parser. Where libfabric cannot open the fabric client is left out,
//! unless `EFABUS_REQUIRE_FABRIC=1` (set in CI).

use std::sync::Arc;
use std::time::{Duration, Instant};

use efabus_broker::{Broker, Client, ClientOptions, Config, EndpointCall};
use efabus_monitor::{Monitor, MonitorOptions};
use efabus_transports::registry::Registry;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(10);

fn fabric_required() -> bool {
    std::env::var("EFABUS_REQUIRE_FABRIC").is_ok_and(|v| v == "1")
}

fn start_broker() -> Arc<Broker> {
    start_broker_with("")
}

/// A broker on TCP and `tcp;ofi_rxm`, with `extra` TOML appended.
fn start_broker_with(extra: &str) -> Arc<Broker> {
    let text = format!(
        r#"
        name = "monitored"
        listen = ["tcp/127.0.0.1:0", "efa-rdm"]
        [fabric]
        provider = "tcp;ofi_rxm"
        node = "127.0.0.1"
        {extra}
    "#
    );
    let config = Config::from_toml_str(&text, "monitor test").expect("valid config");
    Arc::new(Broker::start(config).expect("the broker starts"))
}

fn client(broker: &Broker, name: &str, fabric: bool) -> Client {
    let options = ClientOptions {
        name: name.to_string(),
        connect_timeout: WAIT,
        data_paths: if fabric {
            vec!["efa-rdm".to_string()]
        } else {
            Vec::new()
        },
        fabric: broker.config().fabric.clone(),
        ..ClientOptions::default()
    };
    let server = broker.endpoint("tcp").expect("a TCP listener");
    Client::connect_with(&server, options, Registry::with_builtins()).expect("client connects")
}

fn get(monitor: &Monitor, path: &str) -> (u16, String) {
    let url = format!("http://{}{path}", monitor.local_addr());
    let agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(WAIT))
        .build()
        .new_agent();
    let mut response = agent
        .get(&url)
        .call()
        .unwrap_or_else(|err| panic!("GET {url}: {err}"));
    let status = response.status().as_u16();
    let body = response
        .body_mut()
        .read_to_string()
        .unwrap_or_else(|err| panic!("GET {url}: body: {err}"));
    (status, body)
}

fn get_json(monitor: &Monitor, path: &str) -> Value {
    let (status, body) = get(monitor, path);
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|err| panic!("GET {path}: {err}: {body}"))
}

/// Parses `text` with the Prometheus project's OpenMetrics parser (its
/// Python client's, installed by `scripts/test`), which refuses what a
/// scraper would, and checks one sample's value. Skipped where the parser
/// is missing, unless `CI=true`.
fn assert_official_parser_reads(text: &str, sample: &str, value: f64) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    const SCRIPT: &str = "import sys\n\
        from prometheus_client.openmetrics.parser import text_string_to_metric_families\n\
        for family in text_string_to_metric_families(sys.stdin.read()):\n\
        \x20   for s in family.samples:\n\
        \x20       if not s.labels: print(s.name, s.value)\n";
    let available = Command::new("/usr/bin/python3")
        .args(["-c", "import prometheus_client.openmetrics.parser"])
        .status()
        .is_ok_and(|status| status.success());
    if !available {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but python3-prometheus-client is missing (scripts/test installs it)"
        );
        eprintln!("skipping the OpenMetrics parser check: python3-prometheus-client is missing");
        return;
    }
    let mut child = Command::new("/usr/bin/python3")
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("metrics written to the parser");
    let output = child.wait_with_output().expect("the parser ends");
    assert!(
        output.status.success(),
        "the OpenMetrics parser refused the metrics: {}\n{text}",
        String::from_utf8_lossy(&output.stderr)
    );
    let parsed = String::from_utf8_lossy(&output.stdout);
    let found = parsed.lines().find_map(|line| {
        let (name, number) = line.split_once(' ')?;
        (name == sample)
            .then(|| number.parse::<f64>().ok())
            .flatten()
    });
    assert_eq!(
        found,
        Some(value),
        "{sample} as the parser read it:\n{parsed}"
    );
}

fn connection<'a>(connz: &'a Value, name: &str) -> &'a Value {
    connz["connections"]
        .as_array()
        .and_then(|list| list.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no connection {name} in {connz:#}"))
}

#[test]
fn the_views_show_the_broker_its_connections_and_their_links() {
    let broker = start_broker();
    let fabric = broker.endpoint("efa-rdm").is_some();
    assert!(
        fabric || !fabric_required(),
        "EFABUS_REQUIRE_FABRIC=1 but tcp;ofi_rxm did not open"
    );
    let monitor = Monitor::start(Arc::clone(&broker), "127.0.0.1:0").expect("monitor starts");

    let plain = client(&broker, "plain", false);
    let sub = plain.subscribe("orders.>").expect("subscribe");
    let _workers = plain
        .queue_subscribe("orders.eu", "workers")
        .expect("queue subscribe");
    plain.flush(WAIT).expect("flush");
    let on_fabric = fabric.then(|| client(&broker, "fast", true));
    if let Some(fast) = &on_fabric {
        assert!(fast.link().reliable.starts_with("efa-rdm via tcp;ofi_rxm"));
        for n in 0..10u8 {
            fast.publish("orders.us", vec![n; 100]).expect("publish");
        }
        fast.flush(WAIT).expect("flush");
        for _ in 0..10 {
            sub.recv_timeout(WAIT).expect("delivered");
        }
    }

    let varz = get_json(&monitor, "/varz");
    assert_eq!(varz["server_name"], "monitored");
    assert_eq!(varz["server_id"], format!("{:016x}", broker.broker_id()));
    assert!(varz["listeners"][0]["scheme"] == "tcp", "{varz:#}");
    assert_eq!(
        varz["limits"]["max_payload"],
        broker.config().limits.max_payload
    );
    // Spelled as the configuration spells it.
    assert_eq!(varz["limits"]["slow_consumer_policy"], "drop-oldest");
    assert!(varz["memory"]["resident_bytes"].as_u64() > Some(0));
    assert_eq!(varz["subscriptions"], 2);

    let connz = get_json(&monitor, "/connz?subs=1");
    let expected = if fabric { 2 } else { 1 };
    assert_eq!(connz["total"], expected, "{connz:#}");
    let plain_view = connection(&connz, "plain");
    assert_eq!(plain_view["link"]["kind"], "tcp");
    assert_eq!(plain_view["link"]["on_fabric"], false);
    let reasons = plain_view["link"]["reasons"].to_string();
    assert!(
        reasons.contains("efa-rdm"),
        "a TCP client says why not the fabric: {reasons}"
    );
    assert_eq!(plain_view["subscriptions"], 2);
    let listed = plain_view["subscriptions_list"].to_string();
    assert!(
        listed.contains("orders.>") && listed.contains("workers"),
        "{listed}"
    );
    if fabric {
        let fast = connection(&connz, "fast");
        assert_eq!(fast["link"]["kind"], "efa-rdm");
        assert_eq!(fast["link"]["provider"], "tcp;ofi_rxm");
        assert_eq!(fast["link"]["on_fabric"], true);
        assert_eq!(fast["in_msgs"], 10);
        assert_eq!(plain_view["out_msgs"], 10);
        assert!(plain_view["out_bytes"].as_u64() > Some(1000));
        // Sorted by messages received: the publisher first; paged.
        let sorted = get_json(&monitor, "/connz?sort=msgs_from&limit=1");
        assert_eq!(sorted["connections"].as_array().map(Vec::len), Some(1));
        assert_eq!(sorted["connections"][0]["name"], "fast");
    }
    assert_eq!(get(&monitor, "/connz?sort=nonsense").0, 400);
    assert_eq!(get(&monitor, "/connz?limit=x").0, 400);

    let subsz = get_json(&monitor, "/subsz?test=orders.eu");
    assert_eq!(subsz["subscriptions"], 2);
    assert_eq!(subsz["test"]["total"], 2, "{subsz:#}");
    let matched = subsz["test"]["remote"].to_string();
    assert!(
        matched.contains("workers") && matched.contains("plain"),
        "{matched}"
    );
    assert_eq!(get_json(&monitor, "/subsz?test=other")["test"]["total"], 0);
    assert_eq!(get(&monitor, "/subsz?test=bad..subject").0, 400);

    assert_eq!(get_json(&monitor, "/routez")["total"], 0);
    assert_eq!(get(&monitor, "/nowhere").0, 404);

    let (status, text) = get(&monitor, "/metrics");
    assert_eq!(status, 200);
    let lines = text.lines().map(|line| Ok(line.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("the metrics parse");
    let value = |name: &str, labels: &[(&str, &str)]| -> Option<f64> {
        scrape
            .samples
            .iter()
            .find(|sample| {
                sample.metric == name
                    && labels
                        .iter()
                        .all(|(key, value)| sample.labels.get(key) == Some(*value))
            })
            .map(|sample| match sample.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => f64::NAN,
            })
    };
    assert_eq!(value("efabus_connections", &[]), Some(expected as f64));
    assert_eq!(
        value("efabus_sessions", &[("kind", "client"), ("link", "tcp")]),
        Some(1.0)
    );
    let fallback = scrape
        .samples
        .iter()
        .any(|s| s.metric == "efabus_fabric_fallbacks" && s.labels.get("kind") == Some("client"));
    assert!(fallback, "the TCP client's fallback is counted:\n{text}");
    if fabric {
        assert_eq!(value("efabus_messages_in_total", &[]), Some(10.0), "{text}");
        // The provider's own counts, summed over the listeners.
        assert!(
            value("efabus_fabric_messages_received_total", &[]) > Some(0.0),
            "{text}"
        );
        assert!(
            value("efabus_fabric_completion_reads_total", &[]) > Some(0.0),
            "{text}"
        );
        assert_eq!(
            value("efabus_fabric_completion_errors_total", &[]),
            Some(0.0)
        );
        assert_eq!(
            value(
                "efabus_session_messages_in",
                &[("link", "efa-rdm"), ("provider", "tcp;ofi_rxm")]
            ),
            Some(10.0),
            "{text}"
        );
    }

    assert_official_parser_reads(&text, "efabus_connections", expected as f64);
    if fabric {
        // The client's address is in the listener's address vector.
        assert!(value("efabus_fabric_addresses", &[]) >= Some(1.0), "{text}");
        assert!(
            value("efabus_fabric_address_capacity", &[]) >= value("efabus_fabric_addresses", &[]),
            "{text}"
        );
        assert_eq!(value("efabus_fabric_rnr_failures_total", &[]), Some(0.0));
    }

    assert_eq!(get_json(&monitor, "/healthz")["status"], "ok");
    drop(on_fabric);
    drop(plain);
    broker.shutdown();
    let (status, body) = get(&monitor, "/healthz");
    assert_eq!(status, 503, "{body}");
}

#[test]
fn a_monitor_address_in_use_is_an_error_naming_it() {
    let broker = start_broker();
    let first = Monitor::start(Arc::clone(&broker), "127.0.0.1:0").expect("monitor starts");
    let taken = first.local_addr().to_string();
    let started = Instant::now();
    let err = Monitor::start(broker, &taken)
        .err()
        .expect("a second listener on the same address fails");
    assert!(err.to_string().contains(&taken), "{err}");
    assert!(started.elapsed() < WAIT);
}

/// A listener that fails (the fabric endpoint's polls fail from its 20th
/// frame on, as when its device goes away) turns `/healthz` to 503 naming
/// it, while the broker goes on serving TCP; `/varz` shows it down.
#[test]
fn healthz_answers_503_when_a_listener_is_gone() {
    let broker = start_broker_with("[testing.faults]\nscheme = \"efa-rdm\"\nfail_polls_after = 20");
    if broker.endpoint("efa-rdm").is_none() {
        assert!(
            !fabric_required(),
            "EFABUS_REQUIRE_FABRIC=1 but tcp;ofi_rxm did not open"
        );
        eprintln!("skipping: tcp;ofi_rxm cannot open here");
        return;
    }
    let monitor = Monitor::start(Arc::clone(&broker), "127.0.0.1:0").expect("monitor starts");
    let (status, body) = get(&monitor, "/healthz");
    assert_eq!(status, 200, "{body}");

    let fast = client(&broker, "fast", true);
    let deadline = Instant::now() + WAIT;
    let (status, body) = loop {
        for n in 0..10u8 {
            // The failure ends the session; the client may be between
            // connections when it publishes.
            let _ = fast.publish("health.probe", vec![n; 16]);
        }
        let (status, body) = get(&monitor, "/healthz");
        if status != 200 || Instant::now() > deadline {
            break (status, body);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status, 503, "{body}");
    let health: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(health["status"], "unavailable");
    assert_eq!(
        health["listeners_down"][0]["scheme"], "efa-rdm",
        "{health:#}"
    );
    assert!(
        health["listeners_down"][0]["error"]
            .as_str()
            .is_some_and(|error| !error.is_empty()),
        "{health:#}"
    );
    let varz = get_json(&monitor, "/varz");
    let listeners = varz["listeners"].as_array().expect("listeners");
    assert_eq!(listeners.len(), 2, "{varz:#}");
    assert_eq!(listeners[0]["up"], true);
    assert_eq!(listeners[1]["up"], false);
    // The TCP listener still serves.
    let plain = client(&broker, "plain", false);
    plain.flush(WAIT).expect("a TCP client is served");
}

/// `/healthz` asked every 50 ms until its status is `wanted`, or `WAIT`
/// has passed: the last answer.
fn healthz_once(monitor: &Monitor, wanted: impl Fn(u16) -> bool) -> (u16, String) {
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, body) = get(monitor, "/healthz");
        if wanted(status) || Instant::now() > deadline {
            return (status, body);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An event loop stuck in one round (the TCP listener's poll blocks for 6 s
/// once a frame has come, as a provider call stuck on a lock would) turns
/// `/healthz` to 503, saying which listener the loop is polling (without
/// waiting for the loop once the round has lasted 2 s), and back to 200
/// when the round ends.
#[test]
fn healthz_says_where_a_stuck_event_loop_is() {
    let broker =
        start_broker_with("[testing.faults]\nscheme = \"tcp\"\nstall_after = 1\nstall_ms = 6000");
    let monitor = Monitor::start(Arc::clone(&broker), "127.0.0.1:0").expect("monitor starts");
    assert_eq!(get(&monitor, "/healthz").0, 200);
    // Its hello is the frame that stalls the next poll.
    let connecting = {
        let broker = Arc::clone(&broker);
        std::thread::spawn(move || client(&broker, "staller", false))
    };
    let tcp = broker.endpoint("tcp").expect("a TCP listener");
    let (status, body) = healthz_once(&monitor, |status| status != 200);
    assert_eq!(status, 503, "{body}");
    let health: Value = serde_json::from_str(&body).expect("JSON");
    let error = health["error"].as_str().expect("an error");
    assert!(
        error.contains("in one round") && error.contains(&format!("polling {tcp}")),
        "{health:#}"
    );
    let stall = broker
        .stalled_round(Duration::from_secs(2))
        .expect("still stuck");
    assert_eq!(stall.endpoint, Some((tcp.clone(), EndpointCall::Poll)));
    assert!(stall.running_for < Duration::from_secs(7), "{stall}");
    // Known stuck: answered without waiting 2 s for the loop.
    let asked = Instant::now();
    let (status, body) = get(&monitor, "/healthz");
    assert_eq!(status, 503, "{body}");
    assert!(asked.elapsed() < Duration::from_secs(2), "{body}");
    let (status, body) = healthz_once(&monitor, |status| status == 200);
    assert_eq!(status, 200, "the round ended: {body}");
    let staller = connecting.join().expect("the client connects");
    staller.flush(WAIT).expect("and is served");
}

/// An event loop that panicked (the TCP listener's poll panics once a
/// frame has come) turns `/healthz` to 503 saying so, and is no stall.
#[test]
fn healthz_says_when_the_event_loop_has_ended() {
    let broker = start_broker_with("[testing.faults]\nscheme = \"tcp\"\npanic_after = 1");
    let monitor = Monitor::start(Arc::clone(&broker), "127.0.0.1:0").expect("monitor starts");
    assert_eq!(get(&monitor, "/healthz").0, 200);
    assert!(!broker.loop_ended());
    // Its hello is the frame whose poll panics; the connect
    // itself may fail.
    let connecting = {
        let broker = Arc::clone(&broker);
        std::thread::spawn(move || {
            let _ = Client::connect_with(
                &broker.endpoint("tcp").expect("a TCP listener"),
                ClientOptions {
                    connect_timeout: Duration::from_secs(1),
                    reconnect: false,
                    ..ClientOptions::default()
                },
                Registry::with_builtins(),
            );
        })
    };
    let deadline = Instant::now() + WAIT;
    while !broker.loop_ended() {
        assert!(Instant::now() < deadline, "the loop never ended");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (status, body) = get(&monitor, "/healthz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("the event loop has ended"), "{body}");
    assert_eq!(
        broker.stalled_round(Duration::ZERO),
        None,
        "a dead loop is not stuck"
    );
    connecting.join().expect("the connect ends");
}

/// `/varz` gives the broker's start and uptime, not the monitor's: an
/// embedding service may start its monitor later.
#[test]
fn uptime_is_the_broker_s_whenever_the_monitor_started() {
    let broker = start_broker();
    std::thread::sleep(Duration::from_millis(1100));
    let monitor = Monitor::start(Arc::clone(&broker), "127.0.0.1:0").expect("monitor starts");
    let varz = get_json(&monitor, "/varz");
    assert!(varz["uptime_secs"].as_u64() >= Some(1), "{varz}");
}

/// `/connz?subs=1` lists a connection's first 1,024 subscriptions (by id)
/// and counts them all; `/subsz?test=` names any of them.
#[test]
fn a_connection_s_subscriptions_are_listed_up_to_a_bound() {
    let broker = start_broker();
    let monitor = Monitor::start(Arc::clone(&broker), "127.0.0.1:0").expect("monitor starts");
    let many = client(&broker, "many", false);
    let subs: Vec<_> = (0..1100)
        .map(|n| many.subscribe(&format!("many.{n}")).unwrap())
        .collect();
    many.flush(WAIT).unwrap();
    let connz = get_json(&monitor, "/connz?subs=1");
    let row = connection(&connz, "many");
    assert_eq!(row["subscriptions"], 1100, "{row}");
    let listed = row["subscriptions_list"].as_array().map(Vec::len);
    assert_eq!(listed, Some(1024), "{row}");
    // A page lists its own connections' subscriptions (the loop copies
    // those alone).
    let few = client(&broker, "few", false);
    let _few_sub = few.subscribe("few.one").unwrap();
    few.flush(WAIT).unwrap();
    for (offset, name, listed) in [(0, "many", 1024), (1, "few", 1)] {
        let path = format!("/connz?subs=1&sort=subs&offset={offset}&limit=1");
        let connz = get_json(&monitor, &path);
        let page = connz["connections"].as_array().expect("a page");
        assert_eq!(page.len(), 1, "{connz}");
        assert_eq!(page[0]["name"], name, "{connz}");
        let list = page[0]["subscriptions_list"].as_array().map(Vec::len);
        assert_eq!(list, Some(listed), "{connz}");
    }
    let subsz = get_json(&monitor, "/subsz?test=many.1099");
    assert!(
        subsz["test"]["remote"].to_string().contains("many.1099"),
        "{subsz:#}"
    );
    // A page with subscriptions lists at most 64 connections (each up to
    // 1,024 subscriptions copied between two rounds); without, 10,000.
    assert_eq!(get_json(&monitor, "/connz?subs=1&limit=5000")["limit"], 64);
    assert_eq!(get_json(&monitor, "/connz?limit=5000")["limit"], 5000);
    assert_eq!(get_json(&monitor, "/connz?limit=50000")["limit"], 10_000);
    drop(subs);
}

/// A connection to the monitor with a small receive buffer, so that an
/// answer it does not read soon fills what the sockets hold.
fn raw_connection(monitor: &Monitor) -> std::net::TcpStream {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
    socket.set_recv_buffer_size(4096).expect("receive buffer");
    socket
        .connect(&monitor.local_addr().into())
        .expect("connects to the monitor");
    socket.into()
}

/// Reads until the server closes the connection; the bytes read, or
/// `None` if it was still open after `WAIT`.
fn read_until_closed(stream: &mut std::net::TcpStream) -> Option<usize> {
    use std::io::Read;
    stream.set_read_timeout(Some(WAIT)).expect("read timeout");
    let mut buffer = vec![0; 1 << 16];
    let mut total = 0;
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return Some(total),
            Ok(n) => total += n,
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionReset => return Some(total),
            Err(_) => return None,
        }
    }
}

/// Clients that send requests ahead and never read the answers lose their
/// connections after the write timeout: with as many of them as the
/// monitor serves at once, a request on a new connection waits for that
/// and is answered.
#[test]
fn clients_that_stop_reading_lose_their_connection() {
    use std::io::Write;
    const STALLED: usize = 5;
    // Each answer lists 1,024 subscriptions of 200-byte subjects (about
    // 300 KB): 40 of them are far beyond what the socket buffers hold.
    const PIPELINED: usize = 40;
    let broker = start_broker();
    let options = MonitorOptions {
        write_timeout: Duration::from_millis(200),
        max_connections: STALLED,
        ..MonitorOptions::default()
    };
    let monitor =
        Monitor::start_with(Arc::clone(&broker), "127.0.0.1:0", &options).expect("monitor starts");
    let many = client(&broker, "many", false);
    let long = "x".repeat(200);
    let subs: Vec<_> = (0..1024)
        .map(|n| many.subscribe(&format!("{long}.{n}")).unwrap())
        .collect();
    many.flush(WAIT).unwrap();
    let requests = "GET /connz?subs=1 HTTP/1.1\r\nHost: monitor\r\n\r\n".repeat(PIPELINED);
    let stalled: Vec<std::net::TcpStream> = (0..STALLED)
        .map(|_| {
            let mut stream = raw_connection(&monitor);
            stream
                .write_all(requests.as_bytes())
                .expect("requests sent");
            stream
        })
        .collect();
    let (status, body) = get(&monitor, "/healthz");
    assert_eq!(status, 200, "{body}");
    drop(stalled);
    drop(subs);
}

/// One client holds no slot for ever: connections from one address past
/// its share are closed at once, and a connection that keeps asking now
/// and then is served `max_connection_time`, then closed once its answer
/// is out.
#[test]
fn one_client_holds_no_slot_for_ever() {
    use std::io::{Read, Write};
    let broker = start_broker();
    let options = MonitorOptions {
        max_connections_per_address: 2,
        max_connection_time: Duration::from_millis(500),
        ..MonitorOptions::default()
    };
    let monitor =
        Monitor::start_with(Arc::clone(&broker), "127.0.0.1:0", &options).expect("monitor starts");
    let mut kept: Vec<std::net::TcpStream> = (0..2).map(|_| raw_connection(&monitor)).collect();
    // Both taken in before the third comes (each answers a request).
    for stream in &mut kept {
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: monitor\r\n\r\n")
            .expect("request sent");
        stream.set_read_timeout(Some(WAIT)).expect("read timeout");
        let mut buffer = [0u8; 4096];
        assert!(stream.read(&mut buffer).expect("an answer") > 0);
    }
    let mut third = raw_connection(&monitor);
    // Closed before it is read: no answer comes.
    let _ = third.write_all(b"GET /healthz HTTP/1.1\r\nHost: monitor\r\n\r\n");
    assert_eq!(
        read_until_closed(&mut third),
        Some(0),
        "a third connection from one address was served"
    );
    // A request every 100 ms on the first: answered, until the connection
    // has been served its time.
    let stream = &mut kept[0];
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("read timeout");
    let started = Instant::now();
    let mut answers = 0;
    let mut buffer = [0u8; 4096];
    // Until the server closes it (the loop fails if it does not).
    loop {
        assert!(
            started.elapsed() < 4 * WAIT / 10,
            "still served after {:?}",
            started.elapsed()
        );
        let request = b"GET /healthz HTTP/1.1\r\nHost: monitor\r\n\r\n";
        if stream.write_all(request).is_err() {
            break;
        }
        match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(_) => answers += 1,
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(_) => {}
        }
    }
    assert!(answers > 0, "no request was answered before the close");
    // Those connections served their time: a new one from the address is.
    let (status, body) = get(&monitor, "/healthz");
    assert_eq!(status, 200, "{body}");
}

/// Connections that send nothing, or half a request, are closed after the
/// read timeout: with as many as the monitor serves at once, a request on
/// a new connection waits for that and is answered.
#[test]
fn idle_connections_are_closed_after_the_read_timeout() {
    use std::io::Write;
    let broker = start_broker();
    let options = MonitorOptions {
        read_timeout: Duration::from_millis(300),
        max_connections: 4,
        ..MonitorOptions::default()
    };
    let monitor =
        Monitor::start_with(Arc::clone(&broker), "127.0.0.1:0", &options).expect("monitor starts");
    let mut idle: Vec<std::net::TcpStream> = (0..4).map(|_| raw_connection(&monitor)).collect();
    idle[0]
        .write_all(b"GET /varz HTTP/1.1\r\nHost: mon")
        .expect("half a request sent");
    let (status, body) = get(&monitor, "/healthz");
    assert_eq!(status, 200, "{body}");
    for stream in &mut idle {
        assert!(
            read_until_closed(stream).is_some(),
            "an idle connection stayed open"
        );
    }
}
