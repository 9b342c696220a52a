//! Helpers for tests that run the real `efabus` binary on loopback.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Run `efabus ARGS...` to its end.
pub fn efabus(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_efabus"))
        .args(args)
        .output()
        .expect("run efabus")
}

/// Output bytes as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Whether a fabric provider that cannot open must fail the test (CI sets
/// `EFABUS_REQUIRE_FABRIC=1`) rather than skip it.
pub fn fabric_required() -> bool {
    std::env::var("EFABUS_REQUIRE_FABRIC").is_ok_and(|v| v.trim() == "1")
}

/// Run `efabus serve ARGS --config FILE` to its end, FILE holding
/// `config` (removed afterwards).
pub fn serve_with_config(config: &str, args: &[&str]) -> std::process::Output {
    let path = temp_path("serve.toml");
    std::fs::write(&path, config).expect("write config");
    let output = Command::new(env!("CARGO_BIN_EXE_efabus"))
        .arg("serve")
        .args(args)
        .arg("--config")
        .arg(&path)
        .output()
        .expect("run efabus serve");
    let _ = std::fs::remove_file(&path);
    output
}

/// The variables that set `ofi_rxm`'s eager limit, which must agree
/// between processes: tests leave them out unless they set them.
pub const RXM_EAGER_VARS: [&str; 2] = ["FI_OFI_RXM_EAGER_LIMIT", "FI_OFI_RXM_BUFFER_SIZE"];

/// A broker process listening on a TCP port chosen by the kernel.
pub struct Server {
    pub child: Child,
    pub endpoint: String,
    pub address: String,
    /// The monitoring listener's address, when the config asks for one.
    pub monitor: Option<String>,
    config_path: PathBuf,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A temporary file path unique to this test process.
pub fn temp_path(name: &str) -> PathBuf {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("efabus-test-{}-{n}-{name}", std::process::id()))
}

impl Server {
    /// Start `efabus serve` with the given extra config text (TOML without
    /// a `listen` key; the server listens on tcp/127.0.0.1:0).
    pub fn start(extra_config: &str) -> Server {
        Server::start_at("127.0.0.1:0", extra_config)
    }

    /// Start a broker listening on a given TCP address (e.g. the address of
    /// a broker that was killed, to restart it in its place).
    pub fn start_at(address: &str, extra_config: &str) -> Server {
        Server::start_with_env(address, extra_config, &[])
    }

    /// As [`Server::start_at`], with environment variables set for the
    /// process (e.g. `EFABUS_CLUSTER_SECRET`).
    pub fn start_with_env(address: &str, extra_config: &str, env: &[(&str, &str)]) -> Server {
        Server::start_listening(&[&format!("tcp/{address}")], extra_config, env)
    }

    /// Start a broker on the given listen entries, of which the first is
    /// a TCP one. It chooses the providers' tunables as the command does
    /// (those the test runner sets are removed) unless `env` sets them.
    pub fn start_listening(listen: &[&str], extra_config: &str, env: &[(&str, &str)]) -> Server {
        Server::start_logging(listen, extra_config, env, "error", Stdio::inherit())
    }

    /// As [`Server::start_listening`], logging at `log_level` to `stderr`
    /// (piped: the test reads `child.stderr`, after [`Server::terminate`]).
    pub fn start_logging(
        listen: &[&str],
        extra_config: &str,
        env: &[(&str, &str)],
        log_level: &str,
        stderr: Stdio,
    ) -> Server {
        let config_path = temp_path("broker.toml");
        let listen: Vec<String> = listen.iter().map(|entry| format!("\"{entry}\"")).collect();
        let config = format!(
            "listen = [{}]\nlog_level = \"{log_level}\"\n{extra_config}",
            listen.join(", ")
        );
        std::fs::write(&config_path, config).expect("write config");
        let mut command = Command::new(env!("CARGO_BIN_EXE_efabus"));
        for (name, _) in efabus_transports::fabric::PROVIDER_ENV_DEFAULTS {
            command.env_remove(name);
        }
        // Tests that need ofi_rxm's eager limit set it in `env`.
        for name in RXM_EAGER_VARS {
            command.env_remove(name);
        }
        let mut child = command
            .args(["serve", "--config"])
            .arg(&config_path)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn efabus serve");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let next_line = |what: &str| {
            rx.recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|_| panic!("broker did not report its {what}"))
        };
        let endpoint = loop {
            if let Some(endpoint) = next_line("listening address").strip_prefix("listening on ") {
                break endpoint.to_string();
            }
        };
        let monitor = extra_config.contains("monitor =").then(|| loop {
            let line = next_line("monitoring address");
            if let Some(address) = line.strip_prefix("monitoring on http://") {
                break address.to_string();
            }
        });
        let address = endpoint.trim_start_matches("tcp/").to_string();
        Server {
            child,
            endpoint,
            address,
            monitor,
            config_path,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident memory of the broker process, in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .unwrap_or(0)
    }

    /// Stop the process (SIGSTOP), as a hung one: it takes nothing more.
    /// Returns once every thread of it has stopped: the signal only asks,
    /// and on a busy machine a thread may run on for a while after `kill`
    /// returns.
    pub fn stop(&self) {
        let pid = self.pid();
        let status = Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -STOP failed");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !all_threads_stopped(pid) {
            assert!(Instant::now() < deadline, "broker {pid} did not stop");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Kill the process at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Send SIGTERM and wait (bounded) for the exit status code.
    pub fn terminate(&mut self) -> Option<i32> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config_path);
    }
}

/// The JSON a broker's monitoring listener at `monitor` (host:port)
/// answers for `path` (e.g. `/varz`).
pub fn monitor_json(monitor: &str, path: &str) -> serde_json::Value {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(monitor).expect("the monitor answers");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("a read timeout");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {monitor}\r\n\r\n").expect("ask");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the answer");
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    serde_json::from_str(body).unwrap_or_else(|err| panic!("{path} is not JSON: {err}"))
}

/// The count `name` among the totals `/varz` at `monitor` reports.
pub fn varz_total(monitor: &str, name: &str) -> u64 {
    monitor_json(monitor, "/varz")["totals"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("/varz has no total {name}"))
}

/// Poll `condition` until it holds or `timeout` passes.
pub fn eventually(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    condition()
}

/// A child process killed and reaped when dropped, so a failing test
/// leaves nothing running.
pub struct Process(pub Child);

impl Process {
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether every thread of process `pid` is stopped (state `T` in its
/// `/proc` entry).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // The state follows the command name, which is in parentheses.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "T")
    })
}
