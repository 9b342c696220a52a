//! Configuration: one TOML format for the embedded broker, the standalone
//! binary and the client.
//!
//! Every section has safe defaults, so an empty file is a valid config.
//! Unknown keys and bad values are errors that name the file, the line and
//! the key (the TOML parser reports the position; we add the file name).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The built-in default configuration: `mem` plus `tcp` on 127.0.0.1:7420.
/// `config/default.toml` holds the same text.
pub const DEFAULT_CONFIG: &str = include_str!("../../config/default.toml");

/// Environment variable naming a config file to use when none is given.
pub const CONFIG_ENV: &str = "EFABUS_CONFIG";

/// Errors reading or checking a configuration.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The parser's message carries the line, column and key.
    #[error("invalid config {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("invalid config {origin}: {key}: {message}")]
    Invalid {
        origin: String,
        key: String,
        message: String,
    },
}

/// What to do when a subscriber cannot keep up and its queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum SlowConsumerPolicy {
    /// Make the publisher wait (up to `block_timeout_ms`, then drop and count).
    Block,
    /// Drop the oldest queued message for that subscriber and count it.
    #[default]
    DropOldest,
    /// Send the subscriber an error and close its connection.
    Disconnect,
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Name of this node, sent in the handshake and shown in logs.
    pub name: String,
    /// Log filter (`error`, `warn`, `info`, `debug`, `trace`, or a tracing
    /// filter such as `efabus_broker=debug`). `RUST_LOG` overrides it.
    pub log_level: String,
    /// Endpoint strings to listen on: `mem/NAME`, `tcp/HOST:PORT`, `efa-rdm`, `efa-dgram`.
    pub listen: Vec<String>,
    /// Other brokers to route to, as endpoint strings (`tcp/HOST:PORT`,
    /// their listening address). This broker connects to each (and
    /// reconnects with backoff), accepts routes from brokers that list it,
    /// and forwards its clients' messages one hop over them: list every
    /// other broker of the cluster (a full mesh).
    pub peers: Vec<String>,
    pub limits: Limits,
    pub slow_consumer: SlowConsumer,
    pub auth: Auth,
    pub heartbeat: Heartbeat,
    pub negotiation: Negotiation,
    pub fabric: Fabric,
    pub shutdown: Shutdown,
    /// Testing aids; absent in any real deployment.
    pub testing: Testing,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            name: "efabus".to_string(),
            log_level: "info".to_string(),
            listen: Vec::new(),
            peers: Vec::new(),
            limits: Limits::default(),
            slow_consumer: SlowConsumer::default(),
            auth: Auth::default(),
            heartbeat: Heartbeat::default(),
            negotiation: Negotiation::default(),
            fabric: Fabric::default(),
            shutdown: Shutdown::default(),
            testing: Testing::default(),
        }
    }
}

/// Limits that protect the broker from clients and clients from each other.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest payload accepted in one publish, in bytes.
    pub max_payload: u64,
    /// Largest subject, in bytes.
    pub max_subject_len: usize,
    /// Most tokens in a subject or pattern.
    pub max_subject_tokens: usize,
    /// Most simultaneous connections; more are refused with an error.
    pub max_connections: usize,
    /// Most subscriptions one connection may hold.
    pub max_subscriptions_per_peer: usize,
    /// A connection that has not completed its handshake by then is closed.
    pub handshake_timeout_ms: u64,
    /// Bytes queued towards one peer before the slow-consumer policy applies.
    pub max_pending_bytes: usize,
    /// Messages queued for one in-process subscription before the policy applies.
    pub subscription_queue: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_payload: 1 << 20,
            max_subject_len: 512,
            max_subject_tokens: 32,
            max_connections: 10_000,
            max_subscriptions_per_peer: 100_000,
            handshake_timeout_ms: 5_000,
            max_pending_bytes: 16 << 20,
            subscription_queue: 65_536,
        }
    }
}

/// Slow-consumer handling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlowConsumer {
    pub policy: SlowConsumerPolicy,
    /// Under `block`, the longest a publisher waits before the message is
    /// dropped and counted.
    pub block_timeout_ms: u64,
}

impl Default for SlowConsumer {
    fn default() -> Self {
        SlowConsumer {
            policy: SlowConsumerPolicy::default(),
            block_timeout_ms: 2_000,
        }
    }
}

/// Shared-secret authentication. With a secret set, every connecting side
/// must present the same secret in its hello.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Auth {
    pub secret: Option<String>,
}

/// Keepalive: a ping every `interval_ms` on an idle link; a peer silent for
/// `timeout_ms` is considered dead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Heartbeat {
    pub interval_ms: u64,
    pub timeout_ms: u64,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat {
            interval_ms: 2_000,
            timeout_ms: 10_000,
        }
    }
}

/// Which data path to prefer for a peer, best first. Schemes missing here
/// are never chosen; `tcp` is always the last resort for the reliable link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Negotiation {
    pub preference: Vec<String>,
}

impl Default for Negotiation {
    fn default() -> Self {
        Negotiation {
            preference: vec![
                "efa-rdm".to_string(),
                "efa-dgram".to_string(),
                "tcp".to_string(),
            ],
        }
    }
}

/// libfabric settings for the `efa-rdm` and `efa-dgram` endpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Fabric {
    /// Provider for the reliable endpoint: `efa` on EFA hosts; `tcp;ofi_rxm`,
    /// `udp;ofi_rxd` or `sockets` for development.
    pub provider: String,
    /// Provider for the datagram endpoint: `efa`, or `udp` for development.
    pub dgram_provider: String,
    /// Domain of the reliable endpoint (e.g. `rdmap0s6-rdm`); empty picks
    /// the first. The datagram endpoint picks its own domain.
    pub domain: String,
    /// Node address to bind the fabric endpoints to (e.g. `127.0.0.1` for
    /// the socket providers); empty lets the provider choose.
    pub node: String,
    /// Receive buffers posted per endpoint, capped by the provider's rx
    /// size; 0 keeps the default of 256.
    pub rx_depth: usize,
    /// Largest frame carried in one fabric message on RDM, in bytes.
    pub max_frame: usize,
    /// How an idle event loop polls fabric completion queues.
    pub polling: Polling,
    /// Testing aid: reserve this many prefix bytes in every fabric buffer
    /// as if the provider required `FI_MSG_PREFIX` (a multiple of 8; 0
    /// leaves it to the provider), so the prefix path runs on machines
    /// whose providers have none.
    pub test_force_prefix: usize,
    /// Testing aid: register the fabric buffers and pass descriptors as if
    /// the provider required `FI_MR_LOCAL`.
    pub test_force_mr_local: bool,
}

/// Fabric completion queues have no wait object here, so a loop that owns
/// fabric endpoints polls them: it spins for `busy_polls` idle rounds (one
/// core at 100%, lowest latency), then sleeps 50 us between polls for as
/// many rounds again, then `idle_sleep_us` between polls. An idle broker
/// thus wakes about 1000 times a second with the defaults (well under 1% of
/// a core); traffic resets the count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Polling {
    pub busy_polls: u32,
    pub idle_sleep_us: u64,
}

impl Default for Polling {
    fn default() -> Self {
        Polling {
            busy_polls: 64,
            idle_sleep_us: 1_000,
        }
    }
}

impl Default for Fabric {
    fn default() -> Self {
        Fabric {
            provider: "efa".to_string(),
            dgram_provider: "efa".to_string(),
            domain: String::new(),
            node: String::new(),
            rx_depth: 0,
            // A payload at the default limit and its header fit one message.
            max_frame: (1 << 20) + 4096,
            polling: Polling::default(),
            test_force_prefix: 0,
            test_force_mr_local: false,
        }
    }
}

/// Graceful shutdown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Shutdown {
    /// The longest the broker spends flushing queued messages on shutdown.
    pub drain_timeout_ms: u64,
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown {
            drain_timeout_ms: 5_000,
        }
    }
}

/// Testing aids. Nothing here belongs in a production config.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Testing {
    /// `[testing.faults]`: TESTING AID, injects faults, never use in
    /// production. When present, every endpoint the broker listens on (and
    /// a client's endpoints, through `ClientOptions::from_config`) is
    /// wrapped in a fault injector with these seed and rates (see
    /// `efabus_transports::fault`); the `n`-th endpoint uses seed `seed + n`.
    pub faults: Option<Faults>,
}

/// Fault injection settings (TESTING AID: never use in production): the
/// injector's own configuration, read from `[testing.faults]`. Rates are per
/// frame, from 0.0 to 1.0.
pub type Faults = efabus_transports::fault::FaultConfig;

impl Config {
    /// The built-in default (`config/default.toml`).
    pub fn embedded_default() -> Config {
        // The default file is part of the build and covered by a test, so a
        // failure here is a build defect, not bad input.
        Config::from_toml_str(DEFAULT_CONFIG, "config/default.toml (built in)")
            .expect("built-in default config is valid")
    }

    /// Read and check a config file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Config, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_toml_str(&text, &path.display().to_string())
    }

    /// Parse and check config text; `origin` names it in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|err| ConfigError::Parse {
            origin: origin.to_string(),
            message: err.to_string().trim_end().replace('\n', " "),
        })?;
        config.validate(origin)?;
        Ok(config)
    }

    /// The file named by `EFABUS_CONFIG`, or the built-in default.
    pub fn from_env_or_default() -> Result<Config, ConfigError> {
        match std::env::var_os(CONFIG_ENV) {
            Some(path) if !path.is_empty() => Config::from_file(PathBuf::from(path)),
            _ => Ok(Config::embedded_default()),
        }
    }

    /// Check values the types alone cannot.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            origin: origin.to_string(),
            key: key.to_string(),
            message,
        };
        if self.name.trim().is_empty() {
            return Err(invalid("name", "must not be empty".into()));
        }
        for (i, listen) in self.listen.iter().enumerate() {
            efabus_transports::registry::EndpointSpec::parse(listen)
                .map_err(|err| invalid(&format!("listen[{i}]"), err.to_string()))?;
        }
        for (i, peer) in self.peers.iter().enumerate() {
            check_peer(peer).map_err(|message| invalid(&format!("peers[{i}]"), message))?;
        }
        let nonzero = [
            ("limits.max_payload", self.limits.max_payload as usize),
            ("limits.max_subject_len", self.limits.max_subject_len),
            ("limits.max_subject_tokens", self.limits.max_subject_tokens),
            ("limits.max_connections", self.limits.max_connections),
            (
                "limits.max_subscriptions_per_peer",
                self.limits.max_subscriptions_per_peer,
            ),
            (
                "limits.handshake_timeout_ms",
                self.limits.handshake_timeout_ms as usize,
            ),
            ("limits.max_pending_bytes", self.limits.max_pending_bytes),
            ("limits.subscription_queue", self.limits.subscription_queue),
            ("heartbeat.interval_ms", self.heartbeat.interval_ms as usize),
            ("fabric.max_frame", self.fabric.max_frame),
        ];
        for (key, value) in nonzero {
            if value == 0 {
                return Err(invalid(key, "must be greater than 0".into()));
            }
        }
        if self.limits.max_payload > u32::MAX as u64 - 4096 {
            return Err(invalid(
                "limits.max_payload",
                format!("must be at most {}", u32::MAX as u64 - 4096),
            ));
        }
        if self.heartbeat.timeout_ms <= self.heartbeat.interval_ms {
            return Err(invalid(
                "heartbeat.timeout_ms",
                format!(
                    "must be larger than heartbeat.interval_ms ({})",
                    self.heartbeat.interval_ms
                ),
            ));
        }
        if let Some(faults) = &self.testing.faults {
            faults.validate().map_err(|err| {
                invalid(
                    "testing.faults",
                    err.to_string().replace("fault option fault_", ""),
                )
            })?;
        }
        if self.fabric.test_force_prefix % 8 != 0 || self.fabric.test_force_prefix > 4096 {
            return Err(invalid(
                "fabric.test_force_prefix",
                "must be a multiple of 8 no larger than 4096, as libfabric's prefixes are".into(),
            ));
        }
        if self.negotiation.preference.is_empty() {
            return Err(invalid(
                "negotiation.preference",
                "must name at least one scheme (e.g. [\"tcp\"])".into(),
            ));
        }
        Ok(())
    }

    pub fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.limits.handshake_timeout_ms)
    }

    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat.interval_ms)
    }

    pub fn heartbeat_timeout(&self) -> Duration {
        Duration::from_millis(self.heartbeat.timeout_ms)
    }

    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.shutdown.drain_timeout_ms)
    }

    pub fn block_timeout(&self) -> Duration {
        Duration::from_millis(self.slow_consumer.block_timeout_ms)
    }

    /// The largest frame a peer may send: the payload limit plus room for
    /// the header, subjects and reply subject.
    pub fn max_frame(&self) -> usize {
        self.limits.max_payload as usize + 2 * self.limits.max_subject_len + 64
    }
}

/// Why a `peers` entry cannot name a route: routes run over TCP, to a
/// broker's listening address.
pub(crate) fn check_peer(peer: &str) -> Result<(), String> {
    let spec = efabus_transports::registry::EndpointSpec::parse(peer).map_err(|e| e.to_string())?;
    if spec.scheme() != "tcp" {
        return Err(format!(
            "routes to other brokers run over tcp (`tcp/HOST:PORT`), not {}",
            spec.scheme()
        ));
    }
    if spec.address().is_none_or(str::is_empty) {
        return Err("needs the peer broker's address (`tcp/HOST:PORT`)".to_string());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_default_parses_and_listens_on_mem_and_tcp() {
        let config = Config::embedded_default();
        assert_eq!(config.listen, vec!["mem/default", "tcp/127.0.0.1:7420"]);
    }

    #[test]
    fn shipped_config_files_are_valid() {
        for file in ["default.toml", "efa.toml", "dev-fabric.toml"] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../config")
                .join(file);
            Config::from_file(&path).unwrap_or_else(|err| panic!("{file}: {err}"));
        }
    }

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(
            Config::from_toml_str("", "t").unwrap(),
            Config::default(),
            "an empty file must equal the defaults"
        );
    }

    #[test]
    fn unknown_key_names_file_line_and_key() {
        let err = Config::from_toml_str("name = \"a\"\n[limits]\nmax_paylod = 5\n", "b.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("b.toml"), "{err}");
        assert!(err.contains("line 3"), "{err}");
        assert!(err.contains("max_paylod"), "{err}");
    }

    #[test]
    fn bad_value_names_the_key() {
        let err = Config::from_toml_str("[slow_consumer]\npolicy = \"sometimes\"\n", "c.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2"), "{err}");
        assert!(err.contains("sometimes"), "{err}");
        let err = Config::from_toml_str("[limits]\nmax_connections = 0\n", "c.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("limits.max_connections"), "{err}");
        let err = Config::from_toml_str("listen = [\"\"]\n", "c.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("listen[0]"), "{err}");
        let err = Config::from_toml_str("[fabric]\ntest_force_prefix = 12\n", "c.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("fabric.test_force_prefix"), "{err}");
    }

    #[test]
    fn testing_faults_are_off_unless_configured_and_checked() {
        assert_eq!(Config::default().testing.faults, None);
        let config = Config::from_toml_str(
            "[testing.faults]\nseed = 3\ndrop = 0.25\ndirection = \"both\"\n",
            "f.toml",
        )
        .unwrap();
        let faults = config.testing.faults.expect("table present");
        assert_eq!(faults.seed, 3);
        assert_eq!(faults.drop, 0.25);
        assert_eq!(
            faults.direction,
            efabus_transports::fault::FaultDirection::Both
        );
        assert_eq!(faults.duplicate, 0.0);
        let err = Config::from_toml_str("[testing.faults]\ncorrupt = 1.5\n", "f.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("testing.faults") && err.contains("corrupt"),
            "{err}"
        );
        let err = Config::from_toml_str("[testing.faults]\nsed = 1\n", "f.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("sed"), "{err}");
    }

    #[test]
    fn peers_are_tcp_endpoints() {
        assert!(Config::default().peers.is_empty());
        let config = Config::from_toml_str("peers = [\"tcp/10.0.0.2:7420\"]\n", "p.toml").unwrap();
        assert_eq!(config.peers, ["tcp/10.0.0.2:7420"]);
        for bad in ["mem/x", "efa-rdm", "nonsense"] {
            let err = Config::from_toml_str(&format!("peers = [\"{bad}\"]\n"), "p.toml")
                .unwrap_err()
                .to_string();
            assert!(err.contains("peers[0]"), "{bad}: {err}");
        }
    }

    #[test]
    fn missing_file_is_a_read_error() {
        let err = Config::from_file("/nonexistent/efabus.toml").unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }));
    }
}
