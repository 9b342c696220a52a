//! The fabric examples, run as built:
//! - `examples/efa_rdm.rs`: for each RDM provider of this machine it
//!   negotiates the fabric, exchanges messages and exits 0; for a provider
//!   that does not exist it prints one line with the transport's reason and
//!   exits 2.
//! - `examples/fabric_pingpong.rs`: a short run prints its figures for each
//!   RDM provider; bad arguments exit 2.
//! - `examples/embedded_mesh.rs`: service processes that each embed a
//!   broker find each other from one seed and route over `efa-rdm`
//!   (`tcp;ofi_rxm`, three services) and `shm` (two), and exchange
//!   requests and streams.
//!
//! `cargo test` builds the examples next to the test binaries
//! (`target/<profile>/examples/`), `cargo test --all-targets` does not
//! (`scripts/test` builds them first); a run without them skips with a
//! message. A provider that cannot open here skips too. With
//! `EFABUS_REQUIRE_FABRIC=1` (CI) either is a failure instead.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Bound on one run of an example (each takes well under a second).
const RUN_LIMIT: Duration = Duration::from_secs(60);

fn required() -> bool {
    std::env::var("EFABUS_REQUIRE_FABRIC").is_ok_and(|v| v.trim() == "1")
}

/// The built example `name`: `target/<profile>/examples/<name>`, found
/// from this test's own path (`target/<profile>/deps/<test>`).
fn example(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let path = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if path.is_file() {
        Some(path)
    } else {
        assert!(
            !required(),
            "EFABUS_REQUIRE_FABRIC=1 but {} is not built (`cargo build --examples`)",
            path.display()
        );
        eprintln!(
            "skipping: {} is not built (run `cargo test` without a --test filter, \
             or `cargo build --example {name}`)",
            path.display()
        );
        None
    }
}

struct Run {
    pid: u32,
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Run the example with `args`, killing it if it outlives [`RUN_LIMIT`].
fn run(example: &PathBuf, args: &[&str]) -> Run {
    let mut command = Command::new(example);
    command.args(args);
    run_command(command, args)
}

/// [`run`] for any command; `args` name it if it runs too long.
fn run_command(mut command: Command, args: &[&str]) -> Run {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the example");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + RUN_LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the example") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the example {args:?} ran longer than {RUN_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        pid: child.id(),
        code: status.code(),
        stdout: out.join().expect("stdout reader"),
        stderr: err.join().expect("stderr reader"),
    }
}

/// Whether a run with `provider` succeeded (exit 0); false when the
/// provider cannot be used here (exit 2, the reason in `reason`), which
/// fails under `EFABUS_REQUIRE_FABRIC=1`; any other outcome fails.
fn succeeded(run: &Run, provider: &str, reason: &str) -> bool {
    match run.code {
        Some(0) => true,
        Some(2) => {
            assert!(
                !required(),
                "EFABUS_REQUIRE_FABRIC=1 but {provider} is unavailable: {reason}"
            );
            eprintln!("skipping {provider}: {}", reason.trim());
            false
        }
        code => panic!(
            "run with {provider} exited with {code:?}\nstdout:\n{}\nstderr:\n{}",
            run.stdout, run.stderr
        ),
    }
}

#[test]
fn runs_over_each_rdm_provider() {
    let Some(example) = example("efa_rdm") else {
        return;
    };
    for provider in ["tcp;ofi_rxm", "udp;ofi_rxd", "sockets"] {
        let run = run(&example, &[provider]);
        if !succeeded(&run, provider, &run.stdout) {
            continue;
        }
        for expected in [
            format!("client data path: efa-rdm via {provider} FI_EP_RDM"),
            "client got   greetings.client = hello over RDM".to_string(),
            "broker got   telemetry.node7.temp = 61C".to_string(),
            "request      svc.upper = SHOUT THIS".to_string(),
        ] {
            assert!(
                run.stdout.contains(&expected),
                "{provider}: missing {expected:?} in:\n{}",
                run.stdout
            );
        }
    }
}

#[test]
fn an_unknown_provider_gives_one_line_and_status_2() {
    let Some(example) = example("efa_rdm") else {
        return;
    };
    let run = run(&example, &["no-such-provider"]);
    assert_eq!(run.code, Some(2), "{}{}", run.stdout, run.stderr);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {}", run.stdout);
    let reason = lines[0]
        .split_once("\"no-such-provider\" cannot be used here: ")
        .map(|(_, reason)| reason)
        .unwrap_or_else(|| panic!("not the unavailable line: {}", lines[0]));
    // With libfabric the reason is fi_getinfo's; without, the build's.
    let expected = match efabus::transports::fabric::build_unavailable_reason() {
        None => "fi_getinfo found nothing for provider \"no-such-provider\"",
        Some(missing) => missing,
    };
    assert!(reason.contains(expected), "{reason}");
}

#[test]
fn services_mesh_over_the_fabric_without_a_broker() {
    let Some(example) = example("embedded_mesh") else {
        return;
    };
    for (provider, services, path) in [
        ("tcp;ofi_rxm", "3", "efa-rdm via tcp;ofi_rxm FI_EP_RDM"),
        ("shm", "2", "shm via shm FI_EP_RDM"),
    ] {
        let run = run(&example, &[provider, services, "--quick"]);
        if !succeeded(&run, provider, &run.stdout) {
            continue;
        }
        let count: usize = services.parse().unwrap();
        for from in 0..count {
            for to in (0..count).filter(|&to| to != from) {
                for expected in [
                    format!("s{from} route to s{to}: {path}"),
                    format!("s{from} asked s{to}: 64 B round trip p50 "),
                ] {
                    assert!(
                        run.stdout.contains(&expected),
                        "{provider}: missing {expected:?} in:\n{}",
                        run.stdout
                    );
                }
            }
            let received = format!("s{from} received {} streamed messages", 2_000 * (count - 1));
            assert!(run.stdout.contains(&received), "{provider}: {}", run.stdout);
        }
    }
}

#[test]
fn pingpong_reports_each_rdm_provider() {
    let Some(example) = example("fabric_pingpong") else {
        return;
    };
    for provider in ["tcp;ofi_rxm", "udp;ofi_rxd", "sockets", "shm"] {
        // Below the eager size, and above it: by rendezvous where the
        // provider's reads are used (not ofi_rxd's).
        // Each side sending its own frame (the default), and the frame
        // received sent back as a broker forwards it.
        for (size, rendezvous) in [("64", false), ("100000", provider != "udp;ofi_rxd")] {
            for echo in [None, Some("forward")] {
                let mut args = vec![provider, size, "20"];
                args.extend(echo);
                let run = run(&example, &args);
                if !succeeded(&run, provider, &run.stderr) {
                    continue;
                }
                let expected = format!(
                    "{{\"provider\":\"{provider}\",\"size\":{size},\"iterations\":20,\
                     \"rendezvous\":{rendezvous},\"echo\":\"{}\",\"usec_per_xfer\":",
                    echo.unwrap_or("own")
                );
                assert!(run.stdout.starts_with(&expected), "{}", run.stdout);
            }
        }
    }
    let bad_size = run(&example, &["tcp;ofi_rxm", "0"]);
    assert_eq!(bad_size.code, Some(2));
    assert!(
        bad_size.stderr.contains("SIZE must be a positive integer"),
        "{}",
        bad_size.stderr
    );
    let bad_echo = run(&example, &["tcp;ofi_rxm", "64", "20", "back"]);
    assert_eq!(bad_echo.code, Some(2));
    assert!(
        bad_echo.stderr.contains("ECHO must be own or forward"),
        "{}",
        bad_echo.stderr
    );
}

/// A `shm` region that a dead process with the same process id left in
/// `/dev/shm` does not keep `shm` from opening. libfabric's `shm` would
/// name this process's first region `PID:N:0` (N the user, or the domain's
/// index, by version) and fail `fi_enable` with `-FI_EBUSY` on an existing
/// name. The shell leaves old regions under both names, then becomes the
/// example, keeping its process id.
#[test]
fn a_dead_process_s_shm_region_does_not_block_shm() {
    let Some(example) = example("fabric_pingpong") else {
        return;
    };
    let plain = run(&example, &["shm", "64", "10"]);
    if !succeeded(&plain, "shm", &plain.stderr) {
        return;
    }
    let script = r#"for name in "$$:0:0" "$$:$(id -u):0"; do
                        touch -d 2000-01-01 "/dev/shm/$name" || exit 1
                    done
                    exec "$0" shm 64 10"#;
    let mut command = Command::new("sh");
    command.args(["-c", script]).arg(&example);
    let run = run_command(command, &["sh", "-c", "(stale regions)"]);
    // What the shell left is this test's to remove.
    for name in [
        format!("{}:0:0", run.pid),
        format!("{}:{}:0", run.pid, uid()),
    ] {
        let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
    }
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(
        run.stdout.starts_with("{\"provider\":\"shm\",\"size\":64,"),
        "{}",
        run.stdout
    );
}

/// This process's user id, as `id -u` says it.
fn uid() -> String {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .unwrap_or_default()
}
