//! The `efabus` command line: client commands against a real broker,
//! `caps`, configuration errors, and output to a reader that goes away.

mod common;

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use common::{Process, Server};
use efabus::{Bytes, Client, RecvError};

const WAIT: Duration = Duration::from_secs(10);

fn efabus() -> Command {
    Command::new(env!("CARGO_BIN_EXE_efabus"))
}

fn run(args: &[&str]) -> Output {
    efabus().args(args).output().expect("run efabus")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A usage or configuration error: exit code 2 and one line on stderr.
fn usage_error(output: &Output) -> String {
    let text = stderr(output);
    assert_eq!(
        output.status.code(),
        Some(2),
        "stderr: {text}; stdout: {}",
        stdout(output)
    );
    assert_eq!(text.trim().lines().count(), 1, "one line: {text}");
    assert!(!text.contains("panicked"), "{text}");
    text
}

fn fixture(name: &str) -> String {
    format!(
        "{}/../core/tests/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// Lines a child process writes, as they come.
fn lines_of(stream: impl Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// `efabus sub ARGS...` against the server, once its subscription is live
/// (it says so on stderr after the broker has it); its stdout lines.
fn spawn_sub(server: &Server, args: &[&str]) -> (Process, Receiver<String>) {
    let (child, lines, _) = spawn_sub_with_status(server, args);
    (child, lines)
}

/// [`spawn_sub`], with the status lines it writes to stderr after the
/// first.
fn spawn_sub_with_status(
    server: &Server,
    args: &[&str],
) -> (Process, Receiver<String>, Receiver<String>) {
    let mut all = vec!["sub"];
    all.extend(args);
    all.extend(["--server", &server.endpoint]);
    let mut child = spawn_piped(&all);
    let lines = lines_of(child.0.stdout.take().unwrap());
    let status = lines_of(child.0.stderr.take().unwrap());
    let said = status
        .recv_timeout(WAIT)
        .expect("sub reports its subscription");
    assert!(said.starts_with("subscribed to "), "{said}");
    (child, lines, status)
}

/// `efabus ARGS...` with its stdout and stderr piped to the test.
fn spawn_piped(args: &[&str]) -> Process {
    Process(
        efabus()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn efabus"),
    )
}

/// Wait (bounded) for a child to exit; its status code.
fn exit_code(child: &mut Process) -> Option<i32> {
    exit_code_within(child, WAIT)
}

/// Wait up to `limit` for a child to exit; its status code.
fn exit_code_within(child: &mut Process, limit: Duration) -> Option<i32> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.0.try_wait() {
            return status.code();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn caps_lists_the_transports_and_the_negotiation() {
    let output = run(&["caps"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    for expected in [
        "mem: 1 entry",
        "tcp: 1 entry",
        "efabus-tcp FI_EP_MSG",
        "negotiation between two hosts like this one",
        "reliable: tcp via efabus-tcp",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}

/// `shm` names its endpoints with text of varying length, and each
/// message carries its sender's name: a dump of it is read as endpoints
/// opened on it limit frames, leaving room for the longest name a header
/// carries (32512 - 19 - 255 - 16), as a live `shm` link reports.
#[test]
fn caps_leaves_room_for_the_longest_shm_name() {
    let dump = fixture("libfabric-1.17-shm-rdm.txt");
    let output = run(&["caps", "--input", &dump]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    let expected = "reliable: efa-rdm via shm FI_EP_RDM: frame limit 32222,";
    assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
}

/// A dump whose prefix sizes no provider would report (near 2^64) is
/// laid out without an overflow (it panicked a debug build).
#[test]
fn caps_lays_out_any_prefix_a_dump_gives() {
    let dump = std::fs::read_to_string(fixture("efa-fi_info-v.txt")).expect("fixture");
    let crafted = dump
        .replace(
            "msg_prefix_size: 176",
            "msg_prefix_size: 18446744073709551600",
        )
        .replace(
            "msg_prefix_size: 40",
            "msg_prefix_size: 9223372036854775808",
        );
    assert_ne!(crafted, dump);
    let path = common::temp_path("crafted-dump.txt");
    std::fs::write(&path, crafted).unwrap();
    let output = run(&["caps", "-v", "--input", &path.display().to_string()]);
    let _ = std::fs::remove_file(&path);
    assert!(output.status.success(), "{}", stderr(&output));
}

#[test]
fn caps_reads_a_saved_dump_and_says_what_efabus_would_choose() {
    let dump = fixture("efa-fi_info-v.txt");
    let output = run(&["caps", "-v", "--input", &dump]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    for expected in [
        // The dump printed back in fi_info -v layout.
        "fi_info:",
        "    fi_ep_attr:",
        "        type: FI_EP_RDM",
        "        type: FI_EP_DGRAM",
        "mode: [ FI_MSG_PREFIX ]",
        // What efabus makes of it.
        "accepted efa rdmap70s0-rdm FI_EP_RDM as efa-rdm",
        "accepted efa rdmap70s0-dgrm FI_EP_DGRAM as efa-dgram",
        // As endpoints opened on it would offer it: what an eager buffer
        // holds after the endpoint header (32512 - 67), larger frames by
        // rendezvous up to the broker's frame limit (the dump grants
        // FI_RMA, FI_READ and FI_REMOTE_READ), what a datagram holds
        // after prefix and endpoint header (8928 - 40 - 67), and queues at
        // the configured depth, as live links report them.
        "reliable: efa-rdm via efa FI_EP_RDM: frame limit 32445, \
         rendezvous (RMA read) up to 1049664, prefix 176",
        "best-effort: efa-dgram via efa FI_EP_DGRAM: frame limit 8821, prefix 40",
        // What the buffers take: 256 receives as multi-receive buffers
        // and 256 sends, all registered (the dump's FI_MR_LOCAL).
        "efa-rdm: buffers 16.0 MiB, of which registered (pinned) 16.0 MiB; \
         receives in 32 multi-receive buffers of 255 KiB",
        "efa-dgram: buffers 4.4 MiB, of which registered (pinned) 4.4 MiB",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    for link in ["reliable: efa-rdm", "best-effort: efa-dgram"] {
        let line = text.lines().find(|line| line.starts_with(link));
        assert!(
            line.is_some_and(|line| line.ends_with("queues 256/256")),
            "{link}: {line:?}"
        );
    }

    // A loopback dump without EFA: its RDM entry is taken as efa-rdm and
    // negotiated against the EFA host, which has no provider in common.
    let peer = fixture("libfabric-1.17-tcp-rxm-rdm-lo.txt");
    let output = run(&["caps", "--input", &dump, "--peer", &peer]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(
        text.contains(&format!("efabus selection for {peer}:")),
        "{text}"
    );
    assert!(text.contains("negotiation with"), "{text}");

    let output = run(&["caps", "--input", &fixture("missing.txt")]);
    assert!(usage_error(&output).contains("missing.txt"));
}

#[test]
fn output_to_a_closed_pipe_ends_quietly() {
    // `efabus caps -v --input DUMP | head -1`: the reader leaves early.
    let mut caps = Process(
        efabus()
            .args(["caps", "-v", "--input"])
            .arg(fixture("libfabric-1.17-tcp-rxm-rdm-lo.txt"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut first = String::new();
    let mut out = BufReader::new(caps.0.stdout.take().unwrap());
    out.read_line(&mut first).unwrap();
    assert_eq!(first.trim(), "---");
    drop(out);
    let mut errors = String::new();
    caps.0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut errors)
        .unwrap();
    assert_eq!(exit_code(&mut caps), Some(0), "{errors}");
    assert!(errors.is_empty(), "nothing on stderr: {errors}");

    // `efabus sub ... | head -1`.
    let server = Server::start("");
    let mut sub = Process(
        efabus()
            .args(["sub", "pipe.>", "--server", &server.endpoint])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let status = lines_of(sub.0.stderr.take().unwrap());
    assert!(status.recv_timeout(WAIT).unwrap().starts_with("subscribed"));
    let mut out = BufReader::new(sub.0.stdout.take().unwrap());
    let publisher = Client::connect(&server.endpoint).unwrap();
    publisher
        .publish("pipe.first", Bytes::from_static(b"1"))
        .unwrap();
    publisher.flush(WAIT).unwrap();
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    assert_eq!(first.trim(), "[pipe.first] 1");
    drop(out);
    // The next line it writes finds the pipe closed.
    let deadline = Instant::now() + WAIT;
    while sub.0.try_wait().unwrap().is_none() && Instant::now() < deadline {
        publisher
            .publish("pipe.more", Bytes::from_static(b"2"))
            .unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(exit_code(&mut sub), Some(0));
    let rest: Vec<String> = status.try_iter().collect();
    assert!(rest.is_empty(), "nothing more on stderr: {rest:?}");
}

#[test]
fn pub_sends_a_file_or_sized_payloads() {
    let server = Server::start("[limits]\nmax_payload = 4096\n");
    let watcher = Client::connect(&server.endpoint).unwrap();
    let sub = watcher.subscribe("files.>").unwrap();
    watcher.flush(WAIT).unwrap();

    let file = common::temp_path("payload.bin");
    let content: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&file, &content).unwrap();
    let output = efabus()
        .args(["pub", "files.one", "--server", &server.endpoint, "--file"])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(stdout(&output).trim(), "published 1 message to files.one");
    let message = sub.recv_timeout(WAIT).unwrap();
    assert_eq!(message.subject.as_ref(), "files.one");
    assert_eq!(&message.payload[..], &content[..]);

    let output = run(&[
        "pub",
        "files.sized",
        "--count",
        "5",
        "--size",
        "4096",
        "--server",
        &server.endpoint,
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stdout(&output).starts_with("published 5 messages of 4096 bytes"),
        "{}",
        stdout(&output)
    );
    for _ in 0..5 {
        let message = sub.recv_timeout(WAIT).unwrap();
        assert_eq!(message.subject.as_ref(), "files.sized");
        assert!(message.payload.len() == 4096 && message.payload.iter().all(|&b| b == b'x'));
    }
    watcher.flush(WAIT).unwrap();
    assert_eq!(sub.try_recv(), Err(RecvError::Empty), "exactly five");

    // Larger than the server takes: refused before anything is allocated.
    let output = run(&[
        "pub",
        "files.big",
        "--size",
        "4097",
        "--server",
        &server.endpoint,
    ]);
    let text = usage_error(&output);
    assert!(text.contains("4097") && text.contains("4096"), "{text}");
    // Larger than any wire could carry: refused before connecting.
    let output = run(&[
        "pub",
        "files.big",
        "--size",
        "99999999999999",
        "--server",
        "tcp/127.0.0.1:1",
    ]);
    let text = usage_error(&output);
    assert!(text.contains("99999999999999"), "{text}");
    // A file whose size says nothing is read no further than the limit.
    let output = run(&[
        "pub",
        "files.endless",
        "--file",
        "/dev/zero",
        "--server",
        &server.endpoint,
    ]);
    let text = usage_error(&output);
    assert!(text.contains("4096"), "{text}");
}

/// The first connection to `listener` within [`WAIT`].
fn accept_within_wait(listener: &std::net::TcpListener) -> std::net::TcpStream {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).unwrap();
                return stream;
            }
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(Instant::now() < deadline, "nobody connected");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(err) => panic!("accept: {err}"),
        }
    }
}

/// A broker that welcomes the client and then answers nothing (its loop
/// stuck, or holding its publishers back): `sub` does not wait for ever
/// for the broker to confirm the subscription, and says where to look.
#[test]
fn a_broker_that_never_confirms_is_named_with_where_to_look() {
    use efabus_core::codec;
    use efabus_core::frame::{Challenge, Frame, Welcome, PROTOCOL_VERSION};
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp/{}", listener.local_addr().unwrap());
    let stuck = std::thread::spawn(move || {
        let mut stream = accept_within_wait(&listener);
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let challenge = Frame::Challenge(Challenge { nonce: [7; 32] });
        stream
            .write_all(&codec::encode(&challenge).to_bytes())
            .unwrap();
        // The hello: its length, then that many bytes.
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).unwrap();
        let mut hello = vec![0; u32::from_le_bytes(len) as usize];
        stream.read_exact(&mut hello).unwrap();
        let welcome = Frame::Welcome(Welcome {
            version: PROTOCOL_VERSION,
            name: "stuck".into(),
            offers: Vec::new(),
            max_payload: 4096,
            link_auth: None,
            max_subject_len: 512,
            max_subject_tokens: 32,
            proof: None,
        });
        stream
            .write_all(&codec::encode(&welcome).to_bytes())
            .unwrap();
        // Reads on, answering nothing, until the client goes.
        let mut ignored = [0u8; 4096];
        while matches!(stream.read(&mut ignored), Ok(n) if n > 0) {}
    });
    let output = run(&["sub", "jobs", "--server", &endpoint]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let text = stderr(&output);
    assert!(
        text.contains("did not confirm") && text.contains("efabus stats"),
        "{text}"
    );
    stuck.join().unwrap();
}

#[test]
fn sub_count_exits_after_that_many() {
    let server = Server::start("");
    let (mut sub, lines) = spawn_sub(&server, &["count.>", "--count", "3"]);
    let publisher = Client::connect(&server.endpoint).unwrap();
    for i in 0..5 {
        publisher
            .publish("count.n", Bytes::from(i.to_string()))
            .unwrap();
    }
    publisher.flush(WAIT).unwrap();
    assert_eq!(exit_code(&mut sub), Some(0), "exits by itself");
    let got: Vec<String> = lines.iter().collect();
    assert_eq!(got, ["[count.n] 0", "[count.n] 1", "[count.n] 2"]);
}

#[test]
fn sub_ends_when_the_broker_goes_away_or_rides_it_out_when_asked() {
    let mut server = Server::start("");
    let (mut plain, _, plain_status) = spawn_sub_with_status(&server, &["gone.>"]);
    let (mut riding, riding_lines, _) = spawn_sub_with_status(&server, &["gone.>", "--reconnect"]);
    let address = server.address.clone();
    server.kill();
    assert_eq!(exit_code(&mut plain), Some(1), "sub ends with the broker");
    let said: Vec<String> = plain_status.try_iter().collect();
    assert!(
        said.iter()
            .any(|line| line.contains("connection to the broker was lost (")),
        "{said:?}"
    );

    let server = Server::start_at(&address, "");
    let publisher = Client::connect(&server.endpoint).unwrap();
    let back = common::eventually(Duration::from_secs(20), || {
        publisher
            .publish("gone.back", Bytes::from_static(b"again"))
            .unwrap();
        publisher.flush(WAIT).unwrap();
        riding_lines
            .recv_timeout(Duration::from_millis(200))
            .is_ok_and(|line| line == "[gone.back] again")
    });
    assert!(back, "sub --reconnect subscribed again after the restart");
    assert!(riding.0.try_wait().unwrap().is_none(), "still running");
}

#[test]
fn sub_says_how_many_messages_it_missed() {
    let server = Server::start("");
    // A small queue on the subscriber's side, and a reader that does not
    // read while the messages arrive: most are dropped.
    let config = common::temp_path("small-queue.toml");
    std::fs::write(&config, "[limits]\nsubscription_queue = 100\n").unwrap();
    let total = 20_000u64;
    let (mut sub, lines, status) = spawn_sub_with_status(
        &server,
        &[
            "flood.>",
            "--count",
            &total.to_string(),
            "--config",
            config.to_str().unwrap(),
        ],
    );
    let publisher = Client::connect(&server.endpoint).unwrap();
    for _ in 0..total {
        publisher
            .publish("flood.x", Bytes::from(vec![b'x'; 1000]))
            .unwrap();
    }
    publisher.flush(WAIT).unwrap();
    let received = lines.iter().count() as u64;
    assert_eq!(
        exit_code(&mut sub),
        Some(0),
        "--count counts what was missed"
    );
    let _ = std::fs::remove_file(&config);
    let said: Vec<String> = status.try_iter().collect();
    let missed: u64 = said
        .iter()
        .find_map(|line| line.strip_prefix("missed "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("sub says what it missed: {said:?}"));
    assert!(missed > 0, "{said:?}");
    assert_eq!(received + missed, total, "{said:?}");
}

#[test]
fn sub_queue_members_share_the_messages() {
    let server = Server::start("");
    let (mut first, first_lines) = spawn_sub(&server, &["work.*", "--queue", "workers"]);
    let (mut second, second_lines) = spawn_sub(&server, &["work.*", "-q", "workers"]);
    let publisher = Client::connect(&server.endpoint).unwrap();
    let total = 200;
    for i in 0..total {
        publisher
            .publish("work.item", Bytes::from(i.to_string()))
            .unwrap();
    }
    publisher.flush(WAIT).unwrap();
    let mut seen = HashSet::new();
    let mut per_member = [0, 0];
    let deadline = Instant::now() + WAIT;
    while seen.len() < total && Instant::now() < deadline {
        for (member, lines) in [&first_lines, &second_lines].into_iter().enumerate() {
            while let Ok(line) = lines.try_recv() {
                assert!(seen.insert(line.clone()), "{line} delivered twice");
                per_member[member] += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(seen.len(), total, "every message reached one member");
    assert!(
        per_member.iter().all(|&n| n > 0),
        "both members got a share: {per_member:?}"
    );
    // Nothing more arrives after everything was shared out.
    std::thread::sleep(Duration::from_millis(200));
    assert!(first_lines.try_recv().is_err() && second_lines.try_recv().is_err());
    first.kill();
    second.kill();
}

#[test]
fn client_errors_are_one_line_and_say_what_happened() {
    // A bad address fails at once, without claiming to reconnect.
    let output = run(&["pub", "-s", "tcp/notahost:99999", "x"]);
    let text = usage_error(&output);
    assert!(!text.contains("reconnecting"), "{text}");
    assert!(text.contains("notahost:99999"), "{text}");

    // Nothing listening: a runtime failure at once (the refusal is the
    // answer; the connect timeout is 5 s), saying why and what to do.
    let started = Instant::now();
    let output = run(&["pub", "x", "--server", "tcp/127.0.0.1:1"]);
    assert_eq!(output.status.code(), Some(1));
    let text = stderr(&output);
    assert!(!text.contains("reconnecting"), "{text}");
    assert!(text.contains("refused"), "{text}");
    assert!(text.contains("efabus serve"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "took {:?}",
        started.elapsed()
    );

    // bench alike: no "(reconnecting)" while it gives up.
    let output = run(&["bench", "--count", "10", "--server", "tcp/127.0.0.1:1"]);
    assert_eq!(output.status.code(), Some(1));
    let text = stderr(&output);
    assert!(
        text.contains("refused") && !text.contains("reconnecting"),
        "{text}"
    );
    assert_eq!(text.trim().lines().count(), 1, "{text}");

    // A web URL gets the endpoint form to write instead.
    let output = run(&["pub", "x", "--server", "http://127.0.0.1:7420"]);
    let text = usage_error(&output);
    assert!(text.contains("write tcp/127.0.0.1:7420"), "{text}");

    // Subjects no broker takes are usage errors before anything is sent
    // (nothing listens at this server).
    for args in [
        ["pub", "", "x"],
        ["pub", "a.*", "x"],
        ["req", "", "x"],
        ["sub", "a.>.b", "--count=1"],
    ] {
        let mut args = args.to_vec();
        args.extend(["--server", "tcp/127.0.0.1:1"]);
        let text = usage_error(&run(&args));
        assert!(text.contains("invalid"), "{args:?}: {text}");
    }

    // An unknown scheme is a usage error.
    let output = run(&["pub", "x", "--server", "foo/bar"]);
    let text = usage_error(&output);
    assert!(text.contains("known schemes"), "{text}");

    // A long invalid subject is echoed cut short.
    let subject = format!("bad..{}", "s".repeat(5000));
    let server = Server::start("");
    let output = run(&["pub", &subject, "x", "--server", &server.endpoint]);
    let text = usage_error(&output);
    assert!(text.contains("bad..sss") && text.contains('…'), "{text}");
    assert!(text.len() < 400, "{} bytes: {text}", text.len());
}

#[test]
fn serve_refuses_bad_configuration_with_exit_2() {
    let output = run(&["serve", "--listen", "foo/bar"]);
    let text = usage_error(&output);
    assert!(text.contains("listen[0]"), "{text}");
    assert!(
        text.contains("known schemes: efa-dgram, efa-rdm, mem, nats, shm, tcp"),
        "{text}"
    );

    let long_name = "n".repeat(70_000);
    let output = run(&["serve", "--listen", "tcp/127.0.0.1:0", "--name", &long_name]);
    let text = usage_error(&output);
    assert!(text.contains("name") && text.contains("1024"), "{text}");
    assert!(
        text.len() < 400,
        "the value is not echoed: {} bytes",
        text.len()
    );

    let output = run(&[
        "serve",
        "--listen",
        "tcp/127.0.0.1:0",
        "--log-level",
        "loud",
    ]);
    let text = usage_error(&output);
    assert!(text.contains("log_level"), "{text}");

    // A port out of range is the same usage error in --listen as in
    // --server.
    let text = usage_error(&run(&["serve", "--listen", "tcp/127.0.0.1:74400"]));
    assert!(text.contains("74400"), "{text}");

    // A TOML syntax error is one line, with where it is.
    let broken = common::temp_path("broken.toml");
    std::fs::write(
        &broken,
        "listen = [\"tcp/127.0.0.1:0\"]\n[limits]\nmax_payload = \"big\"\n",
    )
    .unwrap();
    let output = efabus()
        .args(["serve", "--config"])
        .arg(&broken)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&broken);
    let text = usage_error(&output);
    assert!(text.contains("line 3, column 15: invalid type"), "{text}");

    // A broker with nothing to listen on refuses to start.
    let empty = common::temp_path("empty.toml");
    std::fs::write(&empty, "name = \"x\"\n").unwrap();
    let output = efabus()
        .args(["serve", "--config"])
        .arg(&empty)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&empty);
    let text = usage_error(&output);
    assert!(text.contains("nothing to listen on"), "{text}");

    // An empty route credential is refused, not taken for none, from the
    // flag and from the environment alike.
    let output = run(&[
        "serve",
        "--listen",
        "tcp/127.0.0.1:0",
        "--cluster-secret",
        "",
    ]);
    let text = usage_error(&output);
    assert!(text.contains("EFABUS_CLUSTER_SECRET) is empty"), "{text}");
    let output = efabus()
        .args(["serve", "--listen", "tcp/127.0.0.1:0"])
        .env("EFABUS_CLUSTER_SECRET", "")
        .output()
        .unwrap();
    let text = usage_error(&output);
    assert!(text.contains("EFABUS_CLUSTER_SECRET) is empty"), "{text}");

    let cases = [
        (
            "listen = [\n  \"tcp/127.0.0.1:0\",\n  \"foo/bar\",\n]\n",
            "line 3: listen[1]",
        ),
        (
            "listen = [\"tcp/127.0.0.1:0\"]\nlog_level = \"chatty\"\n",
            "line 2: log_level",
        ),
        (
            "listen = [\"tcp/127.0.0.1:0\"]\n[limits]\nmax_subject_len = 200000\n",
            "line 3: limits.max_subject_len",
        ),
        (
            &format!("listen = [\"tcp/127.0.0.1:0\"]\nname = \"{long_name}\"\n"),
            "line 2: name",
        ),
        (
            "listen = [\"tcp/127.0.0.1:0\"]\n[negotiation]\npreference = [\"rdma\"]\n",
            "line 3: negotiation.preference[0]: unknown data path \"rdma\"",
        ),
    ];
    for (text, expected) in cases {
        let file = common::temp_path("bad.toml");
        std::fs::write(&file, text).unwrap();
        let output = efabus()
            .args(["serve", "--config"])
            .arg(&file)
            .output()
            .unwrap();
        let _ = std::fs::remove_file(&file);
        let message = usage_error(&output);
        assert!(
            message.contains(&format!("{}, {expected}", file.display())),
            "expected {expected:?}: {message}"
        );
    }
}

/// A number field of the one-line JSON object `efabus bench --json` prints.
fn json_number(json: &str, name: &str) -> f64 {
    let key = format!("\"{name}\":");
    let at = json
        .find(&key)
        .unwrap_or_else(|| panic!("no {name} in {json}"))
        + key.len();
    let text: String = json[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || matches!(c, '.' | '-' | 'e' | '+'))
        .collect();
    text.parse()
        .unwrap_or_else(|_| panic!("{name} is not a number in {json}"))
}

/// `efabus bench --via route` measures across a route between two
/// embedded brokers: over the fabric of its --config (efa-rdm via
/// `tcp;ofi_rxm` here) and over TCP without one; every message crosses
/// once to each subscriber, and request/reply works across it. --config
/// without --server or `--via route` is a usage error.
#[test]
fn bench_measures_across_a_route() {
    let config = common::temp_path("route-bench.toml");
    std::fs::write(
        &config,
        "listen = [\"efa-rdm\"]\n[negotiation]\npreference = [\"efa-rdm\", \"tcp\"]\n\
         [fabric]\nprovider = \"tcp;ofi_rxm\"\nnode = \"127.0.0.1\"\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let fabric_required = common::fabric_required();
    for (args, path) in [
        (&["--config", config][..], "efa-rdm via tcp;ofi_rxm"),
        (&[][..], "tcp"),
    ] {
        let output = run(&[
            &[
                "bench", "--json", "--via", "route", "--count", "20000", "--subs", "2",
            ][..],
            args,
        ]
        .concat());
        assert!(output.status.success(), "{args:?}: {}", stderr(&output));
        let json = stdout(&output);
        let on_path = json.contains(&format!("\"link\":\"{path}"));
        if !on_path && !fabric_required && !args.is_empty() {
            // A fabric listener that cannot open leaves the route on TCP.
            eprintln!("skipping the fabric route, which cannot open here: {json}");
            continue;
        }
        assert!(on_path, "{json}");
        assert_eq!(json_number(&json, "published"), 20000.0, "{json}");
        assert_eq!(json_number(&json, "delivered"), 40000.0, "{json}");
    }
    let output = run(&[
        "bench", "--mode", "latency", "--via", "route", "--config", config, "--count", "100",
        "--json",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(json_number(&stdout(&output), "round_trips"), 100.0);
    assert!(stdout(&output).contains("\"responder\":\"thread\""));
    // The far broker answers on its loop.
    let output = run(&[
        "bench", "--mode", "latency", "--via", "route", "--config", config, "--count", "100",
        "--inline", "--json",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(json_number(&stdout(&output), "round_trips"), 100.0);
    assert!(stdout(&output).contains("\"responder\":\"inline\""));
    let text = usage_error(&run(&["bench", "--config", config]));
    assert!(text.contains("--via route"), "{text}");
    let text = usage_error(&run(&["bench", "--inline", "--count", "10"]));
    assert!(text.contains("--mode latency"), "{text}");
}

/// Over `tcp;ofi_rxm` the provider itself would post 4,096 receive buffers
/// of 16 KiB per endpoint (65 MiB resident before any traffic); the binary
/// has it post 128, within one 16 MiB chunk of its pool, unless the
/// environment sets the count itself.
#[test]
fn the_binary_bounds_the_receive_buffers_of_ofi_rxm() {
    let fabric = "[negotiation]\npreference = [\"efa-rdm\", \"tcp\"]\n\
                  [fabric]\nprovider = \"tcp;ofi_rxm\"\nnode = \"127.0.0.1\"\n";
    let client_config = common::temp_path("rxm-client.toml");
    std::fs::write(&client_config, format!("listen = [\"efa-rdm\"]\n{fabric}")).unwrap();
    let client_config = client_config.to_str().unwrap();
    let fabric_required = common::fabric_required();
    let mut resident_kib = Vec::new();
    for env in [&[][..], &[("FI_OFI_RXM_MSG_RX_SIZE", "4096")][..]] {
        let server = Server::start_listening(&["tcp/127.0.0.1:0", "efa-rdm"], fabric, env);
        // A stream over the broker's fabric listener: it opened, and the
        // provider's buffers both ways are in use.
        let output = run(&[
            "bench",
            "--json",
            "--server",
            &server.endpoint,
            "--config",
            client_config,
            "--count",
            "20000",
        ]);
        assert!(output.status.success(), "{env:?}: {}", stderr(&output));
        let json = stdout(&output);
        if !json.contains("\"link\":\"efa-rdm via tcp;ofi_rxm") && !fabric_required {
            eprintln!("skipping: the broker's efa-rdm listener cannot open here: {json}");
            return;
        }
        assert!(
            json.contains("\"link\":\"efa-rdm via tcp;ofi_rxm"),
            "{json}"
        );
        assert_eq!(json_number(&json, "delivered"), 20000.0, "{json}");
        resident_kib.push(server.rss_kib());
    }
    let [bounded, provider_default] = resident_kib[..] else {
        unreachable!("two brokers measured")
    };
    eprintln!("broker resident: {bounded} KiB, with 4,096 buffers {provider_default} KiB");
    assert!(
        bounded + 40 * 1024 < provider_default,
        "4,096 buffers hold three more 16 MiB chunks: {bounded} against {provider_default} KiB"
    );
    assert!(bounded < 96 * 1024, "{bounded} KiB resident");
}

/// Over `tcp;ofi_rxm` a fabric link's eager buffers stay within the
/// provider's eager limit (above it `ofi_rxm` would move each message by a
/// rendezvous of its own): 16 KiB by default, more where every process
/// raises `FI_OFI_RXM_EAGER_LIMIT`, as it must (`ofi_rxm` refuses
/// connections between different limits).
#[test]
fn fabric_links_over_ofi_rxm_keep_eager_buffers_within_its_eager_limit() {
    let fabric_required = common::fabric_required();
    for (env, most) in [
        (&[][..], 16 << 10),
        (&[("FI_OFI_RXM_EAGER_LIMIT", "32768")][..], 32 << 10),
    ] {
        let said = pub_over_rxm(env, env);
        let Some(link) = said
            .lines()
            .find(|line| line.contains("efa-rdm via tcp;ofi_rxm"))
        else {
            assert!(!fabric_required, "the fabric path did not open: {said}");
            eprintln!("skipping: efa-rdm via tcp;ofi_rxm cannot open here: {said}");
            return;
        };
        let limit: usize = link
            .split("frame limit ")
            .nth(1)
            .and_then(|rest| rest.split(',').next())
            .and_then(|number| number.parse().ok())
            .unwrap_or_else(|| panic!("no frame limit in {link:?}"));
        // The limit is what a buffer holds after the endpoint header.
        assert!(
            limit <= most && limit > most - 512,
            "{env:?}: frame limit {limit}, eager limit {most}"
        );
    }
}

/// `ofi_rxm` refuses connections between endpoints whose eager limits
/// differ: a client and a broker that disagree are not paired on it, and
/// the client's link says why.
#[test]
fn fabric_peers_whose_rxm_eager_limits_differ_link_over_tcp_and_say_why() {
    let said = pub_over_rxm(&[("FI_OFI_RXM_EAGER_LIMIT", "32768")], &[]);
    // Without the fabric here, the reasons name neither the limits nor a
    // link on it.
    if !said.contains("eager limits differ") && !said.contains("efa-rdm via tcp;ofi_rxm") {
        assert!(
            !common::fabric_required(),
            "the eager limits were not compared: {said}"
        );
        eprintln!("skipping: efa-rdm via tcp;ofi_rxm cannot open here: {said}");
        return;
    }
    assert!(
        said.contains("not on the fabric")
            && said.contains("16384 here, 32768 at the peer")
            && said.contains("FI_OFI_RXM_EAGER_LIMIT"),
        "{said}"
    );
}

/// A fabric path that carries nothing back (here the broker drops every
/// frame it receives on `efa-rdm`, as a provider that refused the
/// connection underneath would) is given up within the connect timeout.
/// `efabus sub` then ends saying why, or with `--reconnect` goes on over
/// TCP and gets what is published: its subscription's confirmation, lost
/// with the first connection, is asked for again on the next.
#[test]
fn sub_over_a_silent_fabric_path_says_why_or_goes_on_over_tcp() {
    let fabric = "[negotiation]\npreference = [\"efa-rdm\", \"tcp\"]\n\
                  [fabric]\nprovider = \"tcp;ofi_rxm\"\nnode = \"127.0.0.1\"\n";
    let server = Server::start_listening(
        &["tcp/127.0.0.1:0", "efa-rdm"],
        &format!("{fabric}[testing.faults]\nscheme = \"efa-rdm\"\ndrop = 1.0\n"),
        &[],
    );
    let config = common::temp_path("silent-path.toml");
    std::fs::write(&config, format!("listen = [\"efa-rdm\"]\n{fabric}")).unwrap();
    let config = config.to_str().expect("a UTF-8 path");
    let sub = |extra: &[&str]| {
        let mut args = vec![
            "sub",
            "-v",
            "--server",
            &server.endpoint,
            "--config",
            config,
        ];
        args.extend(extra);
        args.push("silent.>");
        // The broker runs without ofi_rxm's eager-limit variables.
        let mut command = efabus();
        for name in common::RXM_EAGER_VARS {
            command.env_remove(name);
        }
        let mut child = Process(
            command
                .args(&args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn efabus sub"),
        );
        let lines = lines_of(child.0.stdout.take().unwrap());
        let status = lines_of(child.0.stderr.take().unwrap());
        (child, lines, status)
    };

    let (mut plain, _, plain_status) = sub(&[]);
    let connected = plain_status
        .recv_timeout(WAIT)
        .expect("sub says how it connected");
    if !connected.contains("efa-rdm via tcp;ofi_rxm") {
        assert!(!common::fabric_required(), "no fabric path: {connected}");
        eprintln!("skipping: efa-rdm via tcp;ofi_rxm cannot open here: {connected}");
        return;
    }
    assert_eq!(exit_code_within(&mut plain, 3 * WAIT), Some(1), "sub ends");
    // Until its end of file: the process has ended.
    let said: Vec<String> = plain_status.iter().collect();
    assert!(
        said.iter()
            .any(|line| line.contains("lost the connection to")
                && line.contains("efa-rdm: its data link carried nothing back")),
        "{said:?}"
    );

    let (mut riding, lines, status) = sub(&["--reconnect"]);
    let deadline = Instant::now() + 3 * WAIT;
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|line: &String| line.starts_with("subscribed to "))
    {
        assert!(Instant::now() < deadline, "never subscribed: {seen:?}");
        if let Ok(line) = status.recv_timeout(Duration::from_millis(100)) {
            seen.push(line);
        }
        assert!(riding.0.try_wait().unwrap().is_none(), "ended: {seen:?}");
    }
    assert!(
        seen[0].contains("efa-rdm via tcp;ofi_rxm")
            && seen
                .iter()
                .any(|line| line.contains("carried nothing back")),
        "it started on the fabric and left it: {seen:?}"
    );
    let published = efabus()
        .args(["pub", "--server", &server.endpoint, "silent.x", "over tcp"])
        .output()
        .expect("run efabus pub");
    assert!(published.status.success(), "{}", stderr(&published));
    assert_eq!(
        lines.recv_timeout(WAIT).as_deref(),
        Ok("[silent.x] over tcp"),
        "{seen:?}"
    );
    let _ = std::fs::remove_file(config);
}

/// A broker listening on `efa-rdm` via `tcp;ofi_rxm` with `server_env`,
/// and `efabus pub --verbose` to it from a process with `client_env`
/// (neither with the runner's eager-limit variables): what the client
/// said, once it succeeded.
fn pub_over_rxm(server_env: &[(&str, &str)], client_env: &[(&str, &str)]) -> String {
    let fabric = "[negotiation]\npreference = [\"efa-rdm\", \"tcp\"]\n\
                  [fabric]\nprovider = \"tcp;ofi_rxm\"\nnode = \"127.0.0.1\"\n";
    let config = common::temp_path("rxm-eager.toml");
    std::fs::write(&config, format!("listen = [\"efa-rdm\"]\n{fabric}")).unwrap();
    let server = Server::start_listening(&["tcp/127.0.0.1:0", "efa-rdm"], fabric, server_env);
    let mut command = efabus();
    for name in common::RXM_EAGER_VARS {
        command.env_remove(name);
    }
    let output = command
        .envs(client_env.iter().copied())
        .args(["pub", "--verbose", "--server", &server.endpoint, "--config"])
        .arg(&config)
        .args(["eager.check", "hello"])
        .output()
        .expect("run efabus pub");
    let said = stderr(&output);
    assert!(
        output.status.success(),
        "broker {server_env:?}, client {client_env:?}: {said}"
    );
    said
}

/// A warm-up larger than what a bench subscription queues (2^20
/// messages) and the server holds for it still arrives whole under the
/// server's default slow-consumer policy: the subscriptions are read while
/// the warm-up is published, so the server has no reason to drop any.
#[test]
fn bench_warm_up_larger_than_a_subscription_queue_arrives_whole() {
    let server = Server::start("[limits]\nmax_pending_bytes = 65536\n");
    let output = run(&[
        "bench",
        "--json",
        "--server",
        &server.endpoint,
        "--size",
        "1",
        "--warmup",
        "1600000",
        "--count",
        "1000",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let json = stdout(&output);
    assert_eq!(json_number(&json, "delivered"), 1000.0, "{json}");
}

/// A TLS file that cannot be used is a configuration error, found by
/// `serve --check` too, and a client's `--tls-*` file is named as such,
/// not taken for a bad endpoint string.
#[test]
fn unusable_tls_files_are_configuration_errors() {
    let missing = "/nonexistent/efabus-test.pem";
    for args in [
        &[
            "serve",
            "-l",
            "tcp/127.0.0.1:0",
            "--tls-cert",
            missing,
            "--tls-key",
            missing,
            "--check",
        ][..],
        &[
            "pub",
            "x",
            "hi",
            "--tls-ca",
            missing,
            "--server",
            "tcp/127.0.0.1:9",
        ][..],
    ] {
        let output = run(args);
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(missing) && err.contains("tls"), "{err}");
        assert!(!err.contains("endpoint string"), "{err}");
    }
}

/// Files are read within a bound: a path that names no file with an end
/// (`/dev/zero`) is refused in one line, not read until memory runs out.
#[test]
fn files_too_large_are_refused_not_read_to_the_end() {
    for (args, names) in [
        (
            &["serve", "--secret-file", "/dev/zero", "--check"][..],
            "secret file",
        ),
        (
            &["serve", "--config", "/dev/zero", "--check"][..],
            "config file",
        ),
        (&["caps", "--input", "/dev/zero"][..], "/dev/zero"),
    ] {
        let output = run(args);
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(names) && err.contains("longer than"), "{err}");
    }
}

/// An empty secret is refused where it came from: an empty
/// `EFABUS_SECRET=` (as an environment file leaves it) or a secret file
/// whose first line is empty, not as the configuration's `auth.secret`
/// with a hint to fix an option never given.
#[test]
fn an_empty_secret_is_refused_naming_where_it_came_from() {
    let output = efabus()
        .args(["serve", "--check"])
        .env("EFABUS_SECRET", "")
        .output()
        .expect("run efabus");
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("EFABUS_SECRET) is empty"), "{err}");
    let output = efabus()
        .args(["bench", "--server", "tcp/127.0.0.1:1", "-n", "1"])
        .env("EFABUS_SECRET", "")
        .output()
        .expect("run efabus");
    let err = usage_error(&output);
    assert!(err.contains("EFABUS_SECRET) is empty"), "{err}");
    let dir = std::env::temp_dir().join(format!("efabus-empty-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("secret");
    std::fs::write(&file, "\nsecond line\n").unwrap();
    for command in [&["serve", "--check"][..], &["pub", "x", "y"][..]] {
        let output = efabus()
            .args(command)
            .arg("--secret-file")
            .arg(&file)
            .env_remove("EFABUS_SECRET")
            .output()
            .expect("run efabus");
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{command:?}: {err}");
        assert!(
            err.contains(&file.display().to_string()) && err.contains("first line is empty"),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A login flag is meant over the environment: `$EFABUS_USER` beside
/// `--token` (or `$EFABUS_TOKEN` beside `--user`) is no conflict; both
/// variables set with neither flag is a usage error saying so.
#[test]
fn login_flags_win_over_the_environment() {
    let server = Server::start("");
    for (env, flag) in [
        ("EFABUS_USER", ["--token", "t0ken"]),
        ("EFABUS_TOKEN", ["--user", "alice"]),
    ] {
        let output = efabus()
            .args(["pub", "x", "y", "--server", &server.endpoint])
            .args(flag)
            .env(env, "from-env")
            .output()
            .expect("run efabus");
        let err = stderr(&output);
        assert!(!err.contains("cannot be used with"), "{env}: {err}");
    }
    let output = efabus()
        .args(["pub", "x", "y", "--server", &server.endpoint])
        .env("EFABUS_USER", "alice")
        .env("EFABUS_TOKEN", "t0ken")
        .output()
        .expect("run efabus");
    let text = usage_error(&output);
    assert!(text.contains("both EFABUS_USER and EFABUS_TOKEN"), "{text}");
}

/// A client's TLS settings refused by name (`tls.ca`) say which flag
/// sets that name.
#[test]
fn a_client_s_tls_settings_are_named_by_their_flags() {
    let output = run(&["pub", "x", "y", "--tls-cert", "c.pem", "--tls-key", "k.pem"]);
    let text = usage_error(&output);
    assert!(
        text.contains("tls.ca") && text.contains("--tls-ca"),
        "{text}"
    );
}

/// `bench --server` takes its endpoint as the other client commands do:
/// an unknown scheme or a port above 65535 is a usage error (status 2).
#[test]
fn bench_server_endpoints_are_checked_as_other_clients_are() {
    for server in ["foo/x", "tcp/127.0.0.1:99999"] {
        let output = run(&["bench", "--server", server, "-n", "1"]);
        let text = usage_error(&output);
        assert!(text.contains(server) || text.contains("foo"), "{text}");
    }
    // A --size above the broker's limit too, with what to do.
    let server = Server::start("[limits]\nmax_payload = 4096\n");
    let output = run(&[
        "bench",
        "--server",
        &server.endpoint,
        "--size",
        "5000",
        "-n",
        "1",
    ]);
    let text = usage_error(&output);
    assert!(text.contains("--size"), "{text}");
}

/// More publishers or subscribers than a bench starts threads for is a
/// usage error in one line, not a panic once the system refuses a thread.
#[test]
fn bench_refuses_more_threads_than_it_starts() {
    for flag in ["--subs", "--pubs"] {
        let output = run(&["bench", flag, "1000000", "--count", "1"]);
        assert_eq!(output.status.code(), Some(2), "{flag}: {}", stderr(&output));
        let err = stderr(&output);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("at most 4096"), "{err}");
    }
    // Counts past 64 bits are refused before anything runs, the warm-up's
    // too (it wrapped in a release build).
    for flag in ["--count", "--warmup"] {
        let output = run(&["bench", "-S", "2", flag, "18446744073709551615"]);
        let err = usage_error(&output);
        assert!(err.contains("too large to count"), "{flag}: {err}");
    }
}

/// `efabus bench` counts what it measured: every message of the run and
/// none of the warm-up, for a count or a duration, and a queue group's run
/// ends with its last message, not with a member's idle wait for more
/// (3 s).
#[test]
fn bench_reports_what_it_measured() {
    for (args, expected) in [
        (&["--via", "embedded", "--count", "20000"][..], 20000.0),
        (
            &[
                "--via", "tcp", "--count", "20000", "--subs", "2", "--warmup", "500",
            ][..],
            40000.0,
        ),
        (
            &["--via", "mem", "--count", "20000", "--subs", "2", "--queue"][..],
            20000.0,
        ),
    ] {
        let output = run(&[&["bench", "--json"][..], args].concat());
        assert!(output.status.success(), "{args:?}: {}", stderr(&output));
        let json = stdout(&output);
        assert_eq!(json_number(&json, "published"), 20000.0, "{json}");
        assert_eq!(json_number(&json, "expected"), expected, "{json}");
        assert_eq!(json_number(&json, "delivered"), expected, "{json}");
        assert!(json_number(&json, "seconds") < 3.0, "{json}");
    }
    // For a duration: publishers stop at the deadline and readers at what
    // was published, whatever that came to.
    for args in [
        &["--via", "tcp", "--subs", "2"][..],
        &["--via", "mem", "--subs", "2", "--queue"][..],
    ] {
        let output = run(&[&["bench", "--json", "--duration", "0.3"][..], args].concat());
        assert!(output.status.success(), "{args:?}: {}", stderr(&output));
        let json = stdout(&output);
        let published = json_number(&json, "published");
        let copies = if args.contains(&"--queue") { 1.0 } else { 2.0 };
        assert!(published > 0.0, "{json}");
        assert_eq!(json_number(&json, "expected"), published * copies, "{json}");
        assert_eq!(
            json_number(&json, "delivered"),
            published * copies,
            "{json}"
        );
        assert!(json_number(&json, "seconds") >= 0.3, "{json}");
    }
    for bad in ["0", "-1", "nan", "1e9"] {
        let text = usage_error(&run(&["bench", &format!("--duration={bad}")]));
        assert!(text.contains("--duration"), "{text}");
    }
    // Counts no counter holds, and sizes no one sends, are refused up front.
    let count = u64::MAX.to_string();
    let text = usage_error(&run(&["bench", "--count", &count, "--pubs", "2"]));
    assert!(text.contains("--count"), "{text}");
    let text = usage_error(&run(&["bench", "--size", "99999999999999"]));
    assert!(text.contains("--size"), "{text}");
    let output = run(&[
        "bench", "--mode", "latency", "--via", "tcp", "--count", "200", "--warmup", "20", "--json",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let json = stdout(&output);
    assert_eq!(json_number(&json, "round_trips"), 200.0, "{json}");
    assert!(
        json_number(&json, "p50_us") <= json_number(&json, "p99_us"),
        "{json}"
    );
}

#[test]
fn serve_check_validates_without_starting() {
    let good = common::temp_path("good.toml");
    std::fs::write(&good, "listen = [\"tcp/127.0.0.1:1\"]\n").unwrap();
    let output = efabus()
        .args([
            "serve",
            "--check",
            "--monitor",
            "127.0.0.1:8222",
            "--config",
        ])
        .arg(&good)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let said = stdout(&output);
    assert!(
        said.starts_with("configuration valid") && said.contains("tcp/127.0.0.1:1"),
        "{said}"
    );
    // The file $EFABUS_CONFIG names is said to come from there; one that
    // cannot be read, likewise.
    let output = efabus()
        .args(["serve", "--check"])
        .env("EFABUS_CONFIG", &good)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&good);
    assert!(output.status.success(), "{}", stderr(&output));
    let said = stdout(&output);
    assert!(said.contains("(from $EFABUS_CONFIG)"), "{said}");
    let output = efabus()
        .args(["serve", "--check"])
        .env("EFABUS_CONFIG", &good)
        .output()
        .unwrap();
    let text = usage_error(&output);
    assert!(
        text.contains("cannot read config file") && text.contains("given with $EFABUS_CONFIG"),
        "{text}"
    );
    let output = run(&[
        "serve",
        "--check",
        "--listen",
        "tcp/127.0.0.1:0",
        "--log-level",
        "loud",
    ]);
    assert!(usage_error(&output).contains("log_level"));
}

/// Start `efabus serve` on `config`; its stderr lines.
fn spawn_serve(
    config: &std::path::Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Process, Receiver<String>) {
    let mut child = Process(
        efabus()
            .args(["serve", "--config"])
            .arg(config)
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn efabus serve"),
    );
    let lines = lines_of(child.0.stderr.take().unwrap());
    (child, lines)
}

/// The TCP endpoint a `serve` log's last line (its listening line) names.
fn endpoint_from_log(lines: &[String]) -> String {
    let line = lines.last().expect("a listening line");
    let (_, port) = line
        .rsplit_once("address=127.0.0.1:")
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    format!("tcp/127.0.0.1:{}", port.trim())
}

/// Lines until one contains `needle` (bounded); all of them.
fn lines_until(lines: &Receiver<String>, needle: &str) -> Vec<String> {
    let deadline = Instant::now() + WAIT;
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        if let Ok(line) = lines.recv_timeout(Duration::from_millis(100)) {
            let found = line.contains(needle);
            seen.push(line);
            if found {
                return seen;
            }
        }
    }
    panic!("no line with {needle:?} in {seen:?}");
}

/// `efabus serve` on TCP with `config` (TOML after the `listen` line),
/// sent one publish by `efabus pub`: its log until it says it exits with
/// status 3, its endpoint, and the status it ended with.
fn serve_until_it_exits_3(name: &str, config: &str) -> (Vec<String>, String, Option<i32>) {
    let path = common::temp_path(name);
    std::fs::write(&path, format!("listen = [\"tcp/127.0.0.1:0\"]\n{config}")).unwrap();
    let (mut server, lines) = spawn_serve(&path, &[], &[]);
    let endpoint = endpoint_from_log(&lines_until(&lines, "listening"));
    // Its hello is the frame after which the faults come.
    let _publisher = Process(
        efabus()
            .args(["pub", "-s", &endpoint, "faults.test", "x"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn efabus pub"),
    );
    let seen = lines_until(&lines, "exiting with status 3");
    let status = server.0.wait().expect("serve ends");
    (seen, endpoint, status.code())
}

/// A broker whose event loop is stuck in one round (`[testing.faults]`:
/// its TCP listener's poll blocks for a minute once a frame has come, as a
/// provider call stuck on a lock would) says where, and `serve` exits with
/// status 3 after `shutdown.exit_on_stall_ms`, where nothing else would
/// stop it.
#[test]
fn serve_exits_with_status_3_when_its_event_loop_is_stuck() {
    let (seen, endpoint, status) = serve_until_it_exits_3(
        "stall.toml",
        "[shutdown]\nexit_on_stall_ms = 1500\n\
         [testing.faults]\nscheme = \"tcp\"\nstall_after = 1\nstall_ms = 60000\n",
    );
    let polling = format!("polling {endpoint}");
    assert!(
        seen.iter()
            .any(|line| line.contains("in one round for ") && line.contains(&polling)),
        "{seen:?}"
    );
    assert_eq!(status, Some(3));
}

/// A broker whose event loop panicked (`[testing.faults]`: its TCP
/// listener's poll panics once a frame has come) serves nothing: `serve`
/// says so and exits with status 3 at once.
#[test]
fn serve_exits_with_status_3_when_its_event_loop_has_ended() {
    let (seen, _, status) = serve_until_it_exits_3(
        "loop-panic.toml",
        "[testing.faults]\nscheme = \"tcp\"\npanic_after = 1\n",
    );
    assert!(
        seen.iter()
            .any(|line| line.contains("event loop has ended")),
        "{seen:?}"
    );
    assert!(
        seen.iter()
            .any(|line| line.contains("injected fault: a poll panics")),
        "the panic is told: {seen:?}"
    );
    assert_eq!(status, Some(3));
}

#[test]
fn sighup_applies_log_level_and_limits_and_names_what_needs_a_restart() {
    let config = common::temp_path("reload.toml");
    std::fs::write(
        &config,
        "listen = [\"tcp/127.0.0.1:0\"]\nlog_level = \"info\"\n",
    )
    .unwrap();
    let (mut server, lines) = spawn_serve(&config, &[], &[]);
    let started = lines_until(&lines, "listening");
    // Not a terminal: no colour codes.
    assert!(
        started.iter().all(|line| !line.contains('\u{1b}')),
        "{started:?}"
    );
    let endpoint = endpoint_from_log(&started);
    let publish = |len: usize| {
        efabus()
            .args(["pub", "-s", &endpoint, "reload.test", &"x".repeat(len)])
            .output()
            .unwrap()
    };
    assert!(publish(6000).status.success(), "6000 B within the default");
    let hup = || {
        Command::new("kill")
            .args(["-HUP", &server.0.id().to_string()])
            .status()
            .unwrap()
    };
    std::fs::write(
        &config,
        "name = \"renamed\"\nlisten = [\"tcp/127.0.0.1:0\"]\nlog_level = \"debug\"\n\
         [limits]\nmax_payload = 5000\n[slow_consumer]\npolicy = \"disconnect\"\n",
    )
    .unwrap();
    assert!(hup().success());
    let said = lines_until(&lines, "take effect after a restart");
    let said = said.join("\n");
    assert!(said.contains("log level changed"), "{said}");
    let applied = said
        .lines()
        .find(|line| line.contains("applied"))
        .unwrap_or_else(|| panic!("no line says what was applied: {said}"));
    assert!(
        applied.contains("limits.max_payload") && applied.contains("slow_consumer.policy"),
        "{applied}"
    );
    let restart = said.lines().last().unwrap();
    assert!(
        restart.contains("name") && !restart.contains("max_payload"),
        "{restart}"
    );
    // The new limit is in force: a new client learns it in the welcome.
    let refused = publish(6000);
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(stderr(&refused).contains("5000"), "{}", stderr(&refused));
    assert!(publish(4000).status.success());

    // Past the starting limit, and a bad log level: refused, nothing
    // changes.
    std::fs::write(
        &config,
        "listen = [\"tcp/127.0.0.1:0\"]\n[limits]\nmax_payload = 2000000\n",
    )
    .unwrap();
    assert!(hup().success());
    let said = lines_until(&lines, "reload refused").join("\n");
    assert!(said.contains("raising it needs a restart"), "{said}");
    std::fs::write(
        &config,
        "listen = [\"tcp/127.0.0.1:0\"]\nlog_level = \"loud\"\n",
    )
    .unwrap();
    assert!(hup().success());
    lines_until(&lines, "reload refused");
    assert!(!publish(6000).status.success(), "still 5000");
    assert_eq!(server.0.try_wait().unwrap(), None, "still serving");
    let _ = Command::new("kill")
        .args(["-TERM", &server.0.id().to_string()])
        .status();
    assert_eq!(exit_code(&mut server), Some(0));
    let _ = std::fs::remove_file(&config);
}

#[test]
fn logs_as_json_and_refuse_a_bad_rust_log() {
    let config = common::temp_path("json.toml");
    std::fs::write(
        &config,
        "listen = [\"tcp/127.0.0.1:0\"]\nlog_level = \"info\"\n",
    )
    .unwrap();
    let (mut server, lines) = spawn_serve(&config, &["--log-format", "json"], &[]);
    let line = lines_until(&lines, "listening").pop().unwrap();
    let value: serde_json::Value = serde_json::from_str(&line).expect("a JSON log line");
    assert_eq!(value["level"], "INFO", "{line}");
    server.kill();

    let output = efabus()
        .args(["serve", "--config"])
        .arg(&config)
        .env("RUST_LOG", "garbage")
        .output()
        .unwrap();
    assert!(usage_error(&output).contains("RUST_LOG"));
    let _ = std::fs::remove_file(&config);
}

#[test]
fn secrets_come_from_files() {
    let secret = common::temp_path("secret");
    std::fs::write(&secret, "from-a-file\n").unwrap();
    let secret_path = secret.to_str().unwrap();
    let config = common::temp_path("secret.toml");
    std::fs::write(&config, "listen = [\"tcp/127.0.0.1:0\"]\n").unwrap();
    let server = Server::start("[auth]\nsecret = \"from-a-file\"\n");
    let output = run(&[
        "pub",
        "s.x",
        "y",
        "--server",
        &server.endpoint,
        "--secret-file",
        secret_path,
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let output = run(&[
        "pub",
        "s.x",
        "y",
        "--server",
        &server.endpoint,
        "--secret",
        "wrong",
    ]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let said = stderr(&output);
    assert_eq!(said.trim().lines().count(), 1, "one line: {said}");
    assert!(!said.contains('\u{1b}'), "no colour codes: {said}");
    let output = run(&[
        "pub",
        "s.x",
        "y",
        "--server",
        &server.endpoint,
        "--secret-file",
        "/nonexistent/secret",
    ]);
    assert!(usage_error(&output).contains("secret file"));
    let _ = std::fs::remove_file(&secret);
    let _ = std::fs::remove_file(&config);
}

#[test]
fn sub_shows_replies_binary_payloads_raw_and_json() {
    let server = Server::start("");
    let (mut plain, plain_lines) = spawn_sub(&server, &["show.>", "--count", "2"]);
    let (mut json, json_lines) = spawn_sub(&server, &["show.>", "--count", "2", "--json"]);
    // The raw payloads are not text: read as bytes once it has exited.
    let mut raw = spawn_piped(&[
        "sub",
        "show.>",
        "--count",
        "2",
        "--raw",
        "--server",
        &server.endpoint,
    ]);
    let raw_status = lines_of(raw.0.stderr.take().unwrap());
    assert!(raw_status
        .recv_timeout(WAIT)
        .unwrap()
        .starts_with("subscribed"));
    // A binary payload from standard input, then a request.
    let mut publish = efabus()
        .args([
            "pub",
            "show.bin",
            "--file",
            "-",
            "--server",
            &server.endpoint,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut publish.stdin.take().unwrap(), &[0xff, 0xfe, 0x00]).unwrap();
    assert!(publish.wait().unwrap().success());
    let output = run(&[
        "req",
        "show.ask",
        "hi",
        "--timeout",
        "300",
        "--server",
        &server.endpoint,
    ]);
    assert_eq!(
        output.status.code(),
        Some(1),
        "nobody answers: {}",
        stderr(&output)
    );
    for child in [&mut plain, &mut json, &mut raw] {
        assert_eq!(exit_code(child), Some(0));
    }

    let plain: Vec<String> = plain_lines.iter().collect();
    assert_eq!(
        plain[0],
        "[show.bin] <3 bytes, not UTF-8: see --raw or --json>"
    );
    assert!(
        plain[1].starts_with("[show.ask] (reply to _INBOX.") && plain[1].ends_with(" hi"),
        "{}",
        plain[1]
    );
    let json: Vec<serde_json::Value> = json_lines
        .iter()
        .map(|line| serde_json::from_str(&line).expect("one JSON object per line"))
        .collect();
    assert_eq!(json[0]["payload_base64"], "//4A");
    assert_eq!(json[0]["size"], 3);
    assert_eq!(json[1]["payload"], "hi");
    assert!(json[1]["reply"]
        .as_str()
        .is_some_and(|r| r.starts_with("_INBOX.")));
    let mut bytes = Vec::new();
    raw.0
        .stdout
        .take()
        .unwrap()
        .read_to_end(&mut bytes)
        .unwrap();
    assert_eq!(bytes, b"\xff\xfe\x00\nhi\n");
}

#[test]
fn reply_answers_requests_and_verbose_says_the_path() {
    let server = Server::start("");
    let mut responder = spawn_piped(&[
        "reply",
        "svc.time",
        "noon",
        "--count",
        "2",
        "--server",
        &server.endpoint,
    ]);
    let status = lines_of(responder.0.stderr.take().unwrap());
    let said = status.recv_timeout(WAIT).expect("reply says it is ready");
    assert!(said.starts_with("answering requests on svc.time"), "{said}");
    for _ in 0..2 {
        let output = run(&["req", "svc.time", "-v", "--server", &server.endpoint]);
        assert!(output.status.success(), "{}", stderr(&output));
        assert_eq!(stdout(&output).trim(), "noon");
        let verbose = stderr(&output);
        assert!(
            verbose.contains("reliable: tcp") && verbose.contains("not on the fabric"),
            "{verbose}"
        );
    }
    assert_eq!(exit_code(&mut responder), Some(0));
    let mut answered = String::new();
    responder
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut answered)
        .unwrap();
    assert_eq!(answered.trim(), "answered 2 requests");
}

#[test]
fn an_interrupted_pub_says_how_far_it_got() {
    let server = Server::start("");
    let mut publish = spawn_piped(&[
        "pub",
        "many.x",
        "y",
        "--count",
        "100000000",
        "--server",
        &server.endpoint,
    ]);
    std::thread::sleep(Duration::from_millis(700));
    let _ = Command::new("kill")
        .args(["-INT", &publish.0.id().to_string()])
        .status();
    assert_eq!(exit_code(&mut publish), Some(130));
    let mut said = String::new();
    publish
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    let published: u64 = said
        .strip_prefix("interrupted: published ")
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{said}"));
    assert!(published > 0 && published < 100_000_000, "{said}");
}

/// Runs `efabus bench` with `args`, sends it SIGINT after 1.5 s, and
/// returns its exit code (`None` if it did not exit in time, and was
/// killed), standard output and standard error.
fn interrupted_bench(args: &[&str]) -> (Option<i32>, String, String) {
    let mut bench = spawn_piped(&[&["bench"], args].concat());
    std::thread::sleep(Duration::from_millis(1500));
    let _ = Command::new("kill")
        .args(["-INT", &bench.0.id().to_string()])
        .status();
    let code = exit_code(&mut bench);
    if code.is_none() {
        // Still running: its pipes would not close for the reads below.
        let _ = bench.0.kill();
    }
    let (mut report, mut said) = (String::new(), String::new());
    let mut stdout = bench.0.stdout.take().unwrap();
    stdout.read_to_string(&mut report).unwrap();
    let mut stderr = bench.0.stderr.take().unwrap();
    stderr.read_to_string(&mut said).unwrap();
    (code, report, said)
}

#[test]
fn an_interrupted_bench_reports_what_it_measured() {
    let (code, report, said) = interrupted_bench(&["--via", "embedded", "--count", "1000000000"]);
    assert_eq!(code, Some(130));
    assert!(report.contains("msg/s delivered"), "{report}");
    let published: u64 = said
        .split("interrupted: ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{said}"));
    assert!(published > 0 && published < 1_000_000_000, "{said}");
}

/// Ctrl-C in a warm-up ends it (it did nothing until the warm-up was
/// over, up to a minute, and a second Ctrl-C left its bar on screen).
#[test]
fn a_bench_interrupted_in_its_warm_up_stops_there() {
    for mode in ["throughput", "latency"] {
        let (code, _, said) = interrupted_bench(&[
            "--mode",
            mode,
            "--via",
            "embedded",
            "--count",
            "10",
            "--warmup",
            "1000000000",
        ]);
        assert_eq!(code, Some(130), "{mode}");
        assert!(
            said.contains("interrupted in the warm-up"),
            "{mode}: {said}"
        );
        assert!(said.contains("nothing measured"), "{mode}: {said}");
    }
}

#[test]
fn an_interrupted_latency_bench_reports_the_round_trips_it_measured() {
    let (code, report, said) = interrupted_bench(&[
        "--mode",
        "latency",
        "--via",
        "embedded",
        "--count",
        "1000000000",
    ]);
    assert_eq!(code, Some(130));
    assert!(
        report.contains("round trips of") && report.contains("p50"),
        "{report}"
    );
    let measured: u64 = said
        .split("interrupted after ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{said}"));
    assert!(measured > 0 && measured < 1_000_000_000, "{said}");
    assert!(
        report.contains(&format!("{measured} round trips")),
        "{report}"
    );
}

/// `serve --tls-cert --tls-key` makes the listener TLS only; client
/// commands connect with `--tls-ca`, and without it, or with another
/// authority, fail in one line that says why.
#[test]
fn tls_from_the_command_line() {
    use efabus_transports::conformance::pki::Pki;
    let pki = Pki::new("cli-tls");
    let config = common::temp_path("tls.toml");
    std::fs::write(&config, "listen = [\"tcp/127.0.0.1:0\"]\n").unwrap();
    let (mut server, lines) = spawn_serve(
        &config,
        &["--tls-cert", &pki.server_cert, "--tls-key", &pki.server_key],
        &[],
    );
    let started = lines_until(&lines, "listening");
    let endpoint = endpoint_from_log(&started);
    let publish = |tls: &[&str]| {
        efabus()
            .args(["pub", "-s", &endpoint, "tls.cli", "x"])
            .args(tls)
            .output()
            .unwrap()
    };
    let ok = publish(&["--tls-ca", &pki.ca]);
    assert!(ok.status.success(), "{}", stderr(&ok));

    let cleartext = publish(&[]);
    assert_eq!(cleartext.status.code(), Some(1));
    let said = stderr(&cleartext);
    assert_eq!(said.trim().lines().count(), 1, "{said}");
    assert!(
        said.contains("speaks TLS") && said.contains("--tls-ca"),
        "{said}"
    );

    let other = Pki::new("cli-tls-other");
    let stranger = publish(&["--tls-ca", &other.ca]);
    assert_eq!(stranger.status.code(), Some(1));
    let said = stderr(&stranger);
    assert_eq!(said.trim().lines().count(), 1, "{said}");
    assert!(said.contains("certificate"), "{said}");

    let half = publish(&["--tls-ca", &pki.ca, "--tls-cert", &pki.client_cert]);
    assert_eq!(
        half.status.code(),
        Some(2),
        "a certificate without its key is a usage error"
    );
    server.kill();
    let _ = std::fs::remove_file(&config);
}

/// No secret reaches a log line or an error: the broker logs at `trace`
/// while clients present the right secret and a wrong one, and a route
/// is refused for the wrong cluster secret; neither the broker's log nor
/// the clients' errors hold any of them.
#[test]
fn no_secret_appears_in_logs_or_errors() {
    const SECRET: &str = "client-secret-7f3a9";
    const CLUSTER: &str = "cluster-secret-b81c2";
    const WRONG: &str = "wrong-secret-44e0d";
    let config = common::temp_path("secrets.toml");
    std::fs::write(
        &config,
        format!(
            "listen = [\"tcp/127.0.0.1:0\"]\n[auth]\nsecret = \"{SECRET}\"\n\
             [cluster]\nsecret = \"{CLUSTER}\"\n"
        ),
    )
    .unwrap();
    let (mut server, lines) = spawn_serve(&config, &[], &[("RUST_LOG", "trace")]);
    let started = lines_until(&lines, "listening");
    let endpoint = endpoint_from_log(&started);
    let mut said = String::new();
    for secret in [SECRET, WRONG, CLUSTER] {
        let output = efabus()
            .args(["pub", "-s", &endpoint, "--secret", secret, "-v", "s.x", "y"])
            .env("RUST_LOG", "trace")
            .output()
            .unwrap();
        said.push_str(&stderr(&output));
        said.push_str(&stdout(&output));
    }
    // A broker dialing with the wrong cluster secret.
    let peer_config = common::temp_path("secrets-peer.toml");
    std::fs::write(
        &peer_config,
        format!(
            "listen = [\"tcp/127.0.0.1:0\"]\npeers = [\"{endpoint}\"]\n\
             [cluster]\nsecret = \"{WRONG}\"\n"
        ),
    )
    .unwrap();
    let (mut peer, peer_lines) = spawn_serve(&peer_config, &[], &[("RUST_LOG", "trace")]);
    lines_until(&peer_lines, "listening");
    std::thread::sleep(Duration::from_millis(500));
    peer.kill();
    server.kill();
    let mut logged: Vec<String> = lines.try_iter().collect();
    logged.extend(started);
    logged.extend(peer_lines.try_iter());
    let logged = logged.join("\n");
    assert!(
        logged.contains("TRACE") || logged.contains("DEBUG"),
        "{logged}"
    );
    for secret in [SECRET, WRONG, CLUSTER] {
        assert!(!logged.contains(secret), "{secret} in the log:\n{logged}");
        assert!(
            !said.contains(secret),
            "{secret} in a client's output:\n{said}"
        );
    }
    let _ = std::fs::remove_file(&config);
    let _ = std::fs::remove_file(&peer_config);
}

/// `efabus passwd` hashes a password read from standard input (and makes
/// tokens); a broker with that user lets the client commands log in with
/// `--user` and refuses, in one line naming the subject and the rule, what
/// the user's permissions do not allow.
#[test]
fn users_from_passwd_log_in_and_are_held_to_their_permissions() {
    use std::io::Write as _;
    let hash_of = |input: &str| {
        let mut child = efabus()
            .arg("passwd")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "{}", stderr(&output));
        stdout(&output).trim().to_string()
    };
    let hash = hash_of("orders-password\n");
    assert!(hash.starts_with("$argon2id$"), "{hash}");
    assert!(!hash.contains("orders-password"));
    let generated = run(&["passwd", "--generate"]);
    let lines: Vec<String> = stdout(&generated).lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0].len() >= 32 && lines[1].starts_with("$argon2id$"));
    assert!(usage_error(&run(&["passwd"])).contains("empty"));

    let server = Server::start(&format!(
        "[[auth.users]]\nname = \"alice\"\npassword = \"{hash}\"\n\
         [auth.users.permissions.publish]\nallow = [\"orders.>\"]\ndeny = [\"orders.secret\"]\n\
         [[auth.users]]\nname = \"robot\"\ntoken = \"{}\"\n",
        lines[1]
    ));
    let as_alice = |extra: &[&str]| {
        let mut args = vec![
            "-s",
            &server.endpoint,
            "--user",
            "alice",
            "--secret",
            "orders-password",
        ];
        args.splice(0..0, extra.iter().copied());
        run(&args)
    };
    let ok = as_alice(&["pub", "orders.eu", "x"]);
    assert!(ok.status.success(), "{}", stderr(&ok));
    let denied = as_alice(&["pub", "orders.secret", "x"]);
    assert_eq!(denied.status.code(), Some(1));
    let said = stderr(&denied);
    assert_eq!(said.trim().lines().count(), 1, "{said}");
    assert!(
        said.contains("permission denied: publish to \"orders.secret\"")
            && said.contains("publish deny")
            && said.contains("permissions in [[auth.users]]"),
        "{said}"
    );
    // A long subject is shown cut, the line stays short.
    let long = format!("other.{}", "x".repeat(400));
    let denied = as_alice(&["pub", &long, "x"]);
    let said = stderr(&denied);
    assert_eq!(said.trim().lines().count(), 1, "{said}");
    assert!(said.len() < 400, "{} chars: {said}", said.len());
    let wrong = run(&[
        "pub",
        "-s",
        &server.endpoint,
        "--user",
        "alice",
        "--secret",
        "guess",
        "o.x",
        "y",
    ]);
    assert_eq!(wrong.status.code(), Some(1));
    assert!(
        stderr(&wrong).contains("invalid user or password"),
        "{}",
        stderr(&wrong)
    );
    let token = run(&[
        "pub",
        "-s",
        &server.endpoint,
        "--token",
        &lines[0],
        "any.subject",
        "y",
    ]);
    assert!(token.status.success(), "{}", stderr(&token));
}

#[test]
fn reply_counts_plain_messages_beside_the_requests_it_answers() {
    let server = Server::start("");
    let mut responder = spawn_piped(&[
        "reply",
        "svc.ask",
        "yes",
        "--count",
        "1",
        "--server",
        &server.endpoint,
    ]);
    let status = lines_of(responder.0.stderr.take().unwrap());
    let said = status.recv_timeout(WAIT).expect("reply says it is ready");
    assert!(said.starts_with("answering requests on svc.ask"), "{said}");
    let output = run(&["pub", "svc.ask", "plain", "--server", &server.endpoint]);
    assert!(output.status.success(), "{}", stderr(&output));
    let output = run(&["req", "svc.ask", "--server", &server.endpoint]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(stdout(&output).trim(), "yes");
    assert_eq!(exit_code(&mut responder), Some(0));
    let mut said = String::new();
    responder
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    assert_eq!(
        said.trim(),
        "answered 1 requests; 1 messages had no reply subject"
    );
}

#[test]
fn reply_says_when_the_broker_is_gone() {
    let mut server = Server::start("");
    let mut responder = spawn_piped(&["reply", "svc.ask", "yes", "--server", &server.endpoint]);
    let status = lines_of(responder.0.stderr.take().unwrap());
    let said = status.recv_timeout(WAIT).expect("reply says it is ready");
    assert!(said.starts_with("answering requests on svc.ask"), "{said}");
    let output = run(&["req", "svc.ask", "--server", &server.endpoint]);
    assert!(output.status.success(), "{}", stderr(&output));
    server.kill();
    assert_eq!(exit_code(&mut responder), Some(1));
    let error = status.recv_timeout(WAIT).expect("reply says why it ended");
    assert!(
        error.contains("the connection to the broker was lost after 1 answers"),
        "{error}"
    );
}
