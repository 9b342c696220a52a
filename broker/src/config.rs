//! Configuration: one TOML format for the embedded broker, the standalone
//! binary and the client.
//!
//! Every section has safe defaults, so an empty file is a valid config.
//! Unknown keys and bad values are errors that name the file, the line and
//! the key: the TOML parser reports the position of what it refuses, and
//! for the checks made after parsing ([`Config::validate`]) the key's line
//! is looked up in the text (see [`locate`]). Values are bounded so that
//! none can exceed what the wire codec carries.

use std::path::{Path, PathBuf};
use std::time::Duration;

use efabus_core::codec::MAX_CONTROL_BODY;
use efabus_transports::fabric::{DGRAM_SCHEME, RDM_SCHEME, SHM_SCHEME};
use efabus_transports::tcp;
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
    /// A value the parser accepted but the checks refuse; `line` is where
    /// the key is in the file, when it is there.
    #[error("invalid config {origin}{}: {key}: {message}", at_line(.line))]
    Invalid {
        origin: String,
        line: Option<usize>,
        key: String,
        message: String,
    },
}

/// A TOML parse error on one line: where, and what (the parser's own
/// text draws the line with a caret over several lines).
fn parse_message(text: &str, err: &toml::de::Error) -> String {
    let what = err.message().trim().replace('\n', ", ");
    match err.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |at| at + 1) + 1;
            format!("line {line}, column {column}: {what}")
        }
        None => what,
    }
}

fn at_line(line: &Option<usize>) -> String {
    line.map(|line| format!(", line {line}"))
        .unwrap_or_default()
}

/// Longest `name`, in bytes. The name travels in the hello and welcome,
/// control frames of at most [`MAX_CONTROL_BODY`] bytes that also carry up
/// to 64 capability offers; 1 KiB leaves them ample room.
pub const MAX_NAME_LEN: usize = 1024;

/// Longest `auth.secret` or `cluster.secret`, in bytes (it travels in the
/// hello, like the name).
pub const MAX_SECRET_LEN: usize = 4096;

/// Largest `limits.max_subject_len`. The wire field is 16 bits wide, and a
/// subscribe (a control frame of at most [`MAX_CONTROL_BODY`] bytes)
/// carries a pattern and a queue name of up to this length each, so a
/// quarter of the control body is the bound, with room to spare.
pub const MAX_SUBJECT_LEN_LIMIT: usize = MAX_CONTROL_BODY / 4;

/// Smallest `limits.max_subject_len` and `limits.max_subject_tokens`: a
/// request's reply inbox, `_INBOX.<16 hex digits>.<n>`, takes up to 44
/// bytes and 3 tokens (NATS clients' inboxes about as many), and with
/// lower limits every request would be refused.
pub const MIN_SUBJECT_LEN: usize = 64;
pub const MIN_SUBJECT_TOKENS: usize = 3;

/// Level names `log_level` accepts, alone or after `target=`.
const LOG_LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// What to do when a subscriber cannot keep up and its queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum SlowConsumerPolicy {
    /// Make publishers wait for the slow subscriber. A remote subscriber
    /// that takes nothing for `block_timeout_ms` is disconnected (with a
    /// `SlowConsumer` error); for an in-process subscription the message
    /// is dropped and counted after that time.
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
    /// Name of this node, sent in the handshake and shown in logs (at most
    /// [`MAX_NAME_LEN`] bytes).
    pub name: String,
    /// Log filter (`off`, `error`, `warn`, `info`, `debug`, `trace`, or a
    /// tracing filter such as `efabus_broker=debug`). `RUST_LOG` overrides
    /// it.
    pub log_level: String,
    /// Endpoint strings to listen on: `mem/NAME`, `tcp/HOST:PORT` (or `tcp`
    /// alone, to dial routes only), `nats/IP:PORT`, `efa-rdm`,
    /// `efa-dgram`, `shm`.
    pub listen: Vec<String>,
    /// Other brokers to route to, as endpoint strings (`tcp/HOST:PORT`,
    /// their listening address). This broker connects to each (and
    /// reconnects with backoff), accepts routes from brokers that list it,
    /// learns the other brokers of the cluster from its routes and
    /// connects to those too (one seed is enough), and forwards its
    /// clients' messages one hop over them.
    pub peers: Vec<String>,
    /// Address (`HOST:PORT`) of the HTTP monitoring listener, which the
    /// `efabus` command serves (`/varz`, `/connz`, `/routez`, `/subsz`,
    /// `/healthz`, `/metrics`); none by default.
    pub monitor: Option<String>,
    /// `[cluster]`: who may open a route, where this broker is dialed,
    /// when learned brokers are forgotten (see [`Cluster`]).
    pub cluster: Cluster,
    pub limits: Limits,
    pub slow_consumer: SlowConsumer,
    pub auth: Auth,
    /// `[tls]`: TLS on every TCP listener, route and client connection.
    pub tls: Tls,
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
            monitor: None,
            cluster: Cluster::default(),
            limits: Limits::default(),
            slow_consumer: SlowConsumer::default(),
            auth: Auth::default(),
            tls: Tls::default(),
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
    /// Largest subject, in bytes (at most [`MAX_SUBJECT_LEN_LIMIT`]).
    pub max_subject_len: usize,
    /// Most tokens in a subject or pattern.
    pub max_subject_tokens: usize,
    /// Most simultaneous connections; more are refused with an error.
    pub max_connections: usize,
    /// Most accepted connections from one address still in their
    /// handshake (they have not said hello); more are refused.
    pub max_handshakes_per_address: usize,
    /// Most accepted connections still in their handshake, all addresses
    /// together, and never more than half of `max_connections`: past it,
    /// the one waiting longest for its hello is closed to make room (a
    /// peer that says hello at once still gets in while many addresses
    /// hold silent connections), but while publishers are held back (no
    /// hello is read) the newcomer is refused instead.
    pub max_handshakes: usize,
    /// Most subscriptions one connection may hold.
    pub max_subscriptions_per_peer: usize,
    /// Most interest entries one route may announce: the deduplicated
    /// patterns of all the peer broker's subscribers.
    pub max_route_interest: usize,
    /// A connection that has not completed its handshake by then is closed.
    pub handshake_timeout_ms: u64,
    /// Bytes queued towards one peer before the slow-consumer policy applies.
    pub max_pending_bytes: usize,
    /// Messages queued for one in-process subscription before the policy applies.
    pub subscription_queue: usize,
    /// Bytes all fabric data links together may hold for reordering and
    /// reassembly (each link is also bounded on its own); a link that
    /// would need more fails its session. At least the frame limit.
    pub max_link_memory: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_payload: 1 << 20,
            max_subject_len: 512,
            max_subject_tokens: 32,
            max_connections: 10_000,
            max_handshakes_per_address: 256,
            max_handshakes: 1024,
            max_subscriptions_per_peer: 100_000,
            max_route_interest: 1_000_000,
            handshake_timeout_ms: 5_000,
            max_pending_bytes: 16 << 20,
            subscription_queue: 65_536,
            max_link_memory: 512 << 20,
        }
    }
}

/// Slow-consumer handling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlowConsumer {
    pub policy: SlowConsumerPolicy,
    /// Under `block`, how long a subscriber may hold publishers up: a remote
    /// subscriber whose queue stays over `limits.max_pending_bytes` that
    /// long is disconnected with a `SlowConsumer` error; a message for a
    /// full in-process subscription is dropped and counted after waiting
    /// that long. It also bounds how long an in-process publish, or a
    /// request to the broker's loop (a flush, a reload, a report), waits
    /// for room among those queued for the loop (65,536 of each).
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

/// Who may connect. With a shared secret set, a connecting side may
/// present it (or, when `cluster.secret` is set, that one: see
/// [`Cluster`]) and may then do anything. With `users`, a client may also
/// log in as one (see [`crate::accounts`]), and does what its permissions
/// allow. With neither, anyone may connect.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Auth {
    pub secret: Option<String>,
    /// `[[auth.users]]`.
    pub users: Vec<User>,
}

/// A user: a name, and a password or a token stored only as the argon2id
/// hash `efabus passwd` prints (a PHC string, `$argon2id$...`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct User {
    pub name: String,
    /// Hash of the password a client gives with this name.
    pub password: Option<String>,
    /// Hash of a token: a client that presents it (without a name) is
    /// this user.
    pub token: Option<String>,
    /// The subject common name (CN) of a TLS client certificate: a client
    /// that presents such a certificate, verified against `tls.ca`
    /// (`tls.verify_clients`), and no other credentials is this user.
    pub certificate: Option<String>,
    pub permissions: Permissions,
}

/// What a user may do; empty lists allow everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Permissions {
    pub publish: Rule,
    pub subscribe: Rule,
}

/// Subject patterns allowed and denied (wildcards as in subscriptions).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Rule {
    /// When not empty, only what these patterns take in is allowed.
    pub allow: Vec<String>,
    /// Refused even where `allow` takes it in.
    pub deny: Vec<String>,
}

/// TLS (rustls) on the broker's TCP connections. With `cert` and `key`
/// set, every TCP and NATS listener of the broker accepts TLS only (no
/// cleartext fallback); routes it dials verify the peer broker's certificate against
/// `ca` and present this broker's own (so brokers that verify clients
/// authenticate each other). Files are PEM; SIGHUP reads them again for
/// new connections. A client reading this table connects with TLS when
/// `ca` is set and presents `cert` and `key` when they are.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tls {
    /// Certificate chain presented to clients and peer brokers.
    pub cert: Option<String>,
    /// Its private key.
    pub key: Option<String>,
    /// Authorities trusted: for peer brokers' certificates (routes dialed)
    /// and, with `verify_clients`, clients' certificates.
    pub ca: Option<String>,
    /// Ask every client for a certificate from `ca` (mutual TLS).
    pub verify_clients: bool,
    /// Verify dialed brokers' certificates against this name rather than
    /// the host in their address.
    pub server_name: Option<String>,
    /// NATS listeners: clients start TLS before the server's `INFO`
    /// (NATS's "TLS first"); clients that wait for `INFO` cannot connect.
    pub handshake_first: bool,
}

impl Tls {
    /// Whether any TLS key is set.
    pub fn is_set(&self) -> bool {
        *self != Tls::default()
    }

    /// The TCP endpoint options for these settings (see
    /// `efabus_transports::tls`); none when TLS is off.
    pub fn endpoint_options(&self) -> Vec<(String, String)> {
        let mut options = Vec::new();
        let mut add = |name: &str, value: &Option<String>| {
            if let Some(value) = value {
                options.push((name.to_string(), value.clone()));
            }
        };
        add("tls_cert", &self.cert);
        add("tls_key", &self.key);
        add("tls_ca", &self.ca);
        add("tls_server_name", &self.server_name);
        if self.verify_clients {
            options.push(("tls_verify_clients".to_string(), "true".to_string()));
        }
        options
    }

    /// `serves` says whether the configuration listens on TCP or NATS (a
    /// broker's); a client's needs no certificate of its own.
    fn check(&self, serves: bool, routes: bool) -> Result<(), (&'static str, String)> {
        if !self.is_set() {
            return Ok(());
        }
        if self.cert.is_some() != self.key.is_some() {
            return Err((
                "tls.cert",
                "a certificate needs its key: give tls.cert and tls.key".to_string(),
            ));
        }
        if !serves && self.cert.is_some() && self.ca.is_none() {
            return Err((
                "tls.ca",
                "a client certificate is presented only over TLS, which needs tls.ca, the \
                 authority to verify the broker with"
                    .to_string(),
            ));
        }
        if serves && self.cert.is_none() {
            return Err((
                "tls.cert",
                "TLS on the broker needs tls.cert and tls.key, the certificate it presents"
                    .to_string(),
            ));
        }
        if self.verify_clients && self.ca.is_none() {
            return Err((
                "tls.verify_clients",
                "needs tls.ca, the authority client certificates must come from".to_string(),
            ));
        }
        // Without `peers` a broker without `ca` dials no one: the route
        // to a broker learned from gossip fails with the reason, as its
        // endpoint dials only with TLS.
        if routes && self.ca.is_none() {
            return Err((
                "tls.ca",
                "is needed to verify the peer brokers this broker dials over TLS".to_string(),
            ));
        }
        Ok(())
    }
}

/// Routes between brokers. A connection may become a route (and learn
/// which patterns this broker's subscribers want) only if its hello carried
/// the route credential ([`Config::route_secret`]):
///
/// - `cluster.secret` when it is set: brokers present it when they dial
///   their peers, and a client's secret (`auth.secret`) does not open a
///   route. A hello with the cluster secret is accepted whether or not
///   `auth.secret` is set.
/// - else `auth.secret`: any peer that authenticated may open a route.
/// - else (no secret at all) any peer may: the open mode, for a trusted
///   network only.
///
/// Brokers tell their routes the addresses of the brokers they have routes
/// to, and dial those they have none to: a cluster forms its full mesh
/// from any one seed in `peers`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Cluster {
    pub secret: Option<String>,
    /// The address other brokers dial this one at (`tcp/HOST:PORT`), told
    /// to its routes. Default: the first TCP listener's address; with an
    /// unspecified host (`0.0.0.0`), peers take the address they see.
    pub advertise: Option<String>,
    /// How long a broker learned from a peer, not one in `peers`, is
    /// redialed after it was last reached before it is forgotten.
    pub forget_after_ms: u64,
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster {
            secret: None,
            advertise: None,
            forget_after_ms: 120_000,
        }
    }
}

impl Cluster {
    /// `forget_after_ms` as a duration.
    pub fn forget_after(&self) -> Duration {
        Duration::from_millis(self.forget_after_ms)
    }
}

/// Keepalive: a ping every `interval_ms` on an idle link; a peer silent for
/// `timeout_ms` is considered dead, and a NATS client that leaves
/// `max_pings_out` pings unanswered is closed with `Stale Connection`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Heartbeat {
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub max_pings_out: u32,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat {
            interval_ms: 2_000,
            timeout_ms: 10_000,
            max_pings_out: 2,
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
                SHM_SCHEME.to_string(),
                RDM_SCHEME.to_string(),
                DGRAM_SCHEME.to_string(),
                tcp::SCHEME.to_string(),
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
    /// Post an `efa` RDM endpoint's receive memory as a few large
    /// `FI_MULTI_RECV` buffers (eight buffers' worth each), so that each
    /// message takes only the bytes it needs; `false`, and the other
    /// providers, post `rx_depth` buffers of `eager_size` each.
    pub multi_recv: bool,
    /// Bytes of each RDM buffer (the eager size): frames up to it travel in
    /// posted buffers; larger ones by rendezvous (one-sided reads) with
    /// peers that have RMA, fragmented otherwise. 256 receive and 256 send
    /// buffers of it make an endpoint's memory. Unset: 32,512, or over
    /// `tcp;ofi_rxm` that provider's eager limit where it is lower (its
    /// own rendezvous would carry what is above). (`max_frame` is read as
    /// an older name of it.)
    #[serde(alias = "max_frame")]
    pub eager_size: Option<usize>,
    /// Move RDM frames above `eager_size` by rendezvous where both sides
    /// have RMA; `false` fragments them over eager messages.
    pub rendezvous: bool,
    /// A broker's `shm` endpoint lands rendezvous frames of 1 MiB and more
    /// in transparent huge pages, which its subscribers read about twice
    /// as fast; each such frame holds whole 2 MiB pages while it lives.
    /// `false` saves that memory. Clients never do it (they pass nothing
    /// on).
    pub huge_landing: bool,
    /// How long frames may wait on a reliable data link behind a message
    /// that went missing, with no piece of it arriving, before the session
    /// is ended (and the peer reconnects) instead of stalling until the
    /// heartbeat gives up. Shorter than `heartbeat.timeout_ms`.
    pub reliable_gap_timeout_ms: u64,
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

/// How an event loop waits. After a round with work every loop polls on
/// for `spin_us`, or up to five times as long while it serves an exchange
/// (see `spin_us`). Then a loop that owns fabric endpoints waits for their
/// completion queues as follows (idle rounds counted from the end of the
/// spin). With a wait set (`wait_fd`, used with libfabric's tcp, udp and
/// rxd providers) it spins for at most 8 of `busy_polls` idle
/// rounds and then sleeps on the descriptor, which wakes it as soon as a
/// completion is due: an idle broker uses no CPU. Without one (efa on
/// libfabric 1.17, shm, or `wait_fd = false`) it spins for `busy_polls` idle
/// rounds (one core at 100%, lowest latency), then polls and yields the
/// core for as many again, then sleeps 50 us between polls for
/// `busy_polls` rounds, then `idle_sleep_us` between polls, so
/// an idle broker wakes about 1000 times a second (about 3% of a core with
/// `tcp;ofi_rxm`, whose progress call is costly). Traffic resets the count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Polling {
    /// Every event loop (the broker's and each client's, whatever its
    /// transports) keeps polling for this long after a round with work,
    /// yielding its core between rounds, before it waits as described
    /// above: a reply or the next message that arrives meanwhile costs no
    /// wake-up. While rounds with work come at most ten times this apart
    /// (a request/reply exchange), the window grows to twice the longest
    /// gap between them, up to five times this; one longer gap takes it
    /// back. It also bounds how long a thread waiting for a message (a
    /// subscription's reader, a request) yields before it sleeps: up to
    /// five times this, at least 20 us. 0 waits at once. Once it has
    /// passed, an idle loop costs what it did before (nothing with a wait
    /// set or without fabric endpoints). The NATS listener's I/O thread polls for a fixed 50 us.
    pub spin_us: u64,
    pub busy_polls: u32,
    pub idle_sleep_us: u64,
    /// Sleep on the provider's wait set where it has one (the descriptor
    /// wakes the loop as soon as a completion is due) instead of sleeping
    /// blind; off, the CQs are always polled as on efa.
    pub wait_fd: bool,
}

impl Default for Polling {
    fn default() -> Self {
        Polling {
            spin_us: 50,
            busy_polls: 64,
            idle_sleep_us: 1_000,
            wait_fd: true,
        }
    }
}

impl Polling {
    /// `spin_us` as a duration.
    pub fn spin(&self) -> Duration {
        Duration::from_micros(self.spin_us)
    }
}

impl Fabric {
    /// `reliable_gap_timeout_ms` as a duration.
    pub fn reliable_gap_timeout(&self) -> Duration {
        Duration::from_millis(self.reliable_gap_timeout_ms)
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
            multi_recv: true,
            // A payload at the default limit and its header fit one message.
            eager_size: None,
            rendezvous: true,
            huge_landing: true,
            reliable_gap_timeout_ms: 250,
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
    /// The longest the broker spends flushing queued messages on shutdown,
    /// and the longest a peer being closed (after an error or goodbye) has
    /// to take what is queued for it.
    pub drain_timeout_ms: u64,
    /// `efabus serve` ends with status 3 once it has seen its event loop
    /// in one round for this long. Rounds take microseconds; one that
    /// lasts is stuck in a call that does not return (README "shm": a
    /// same-host peer stopped or killed inside libfabric's `shm`), and
    /// such a broker serves nothing and would not stop for a signal
    /// either: exiting lets a supervisor start it again. A pause of the
    /// whole process (a debugger, SIGSTOP) does not count. An error saying
    /// where the loop is stuck is logged at 10 s (or at this, if shorter).
    /// 0 never exits. An embedded broker reports it
    /// ([`crate::Broker::stalled_round`]) and leaves the decision to its
    /// service.
    pub exit_on_stall_ms: u64,
}

/// Shortest `shutdown.exit_on_stall_ms` other than 0: a loop must not be
/// taken for stuck in a round that is merely long.
pub const MIN_EXIT_ON_STALL_MS: u64 = 1_000;

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown {
            drain_timeout_ms: 5_000,
            exit_on_stall_ms: 60_000,
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
    /// Only a build with the `testing` feature injects faults; any other
    /// refuses a config that sets it ([`NO_FAULT_INJECTION`]).
    pub faults: Option<Faults>,
}

/// Fault injection settings (TESTING AID: never use in production): the
/// injector's own configuration, read from `[testing.faults]`. Rates are per
/// frame, from 0.0 to 1.0.
#[cfg(feature = "testing")]
pub type Faults = efabus_transports::fault::FaultConfig;

/// `[testing.faults]` in a build without the `testing` feature: the table
/// is read as it is (so the config parses) and then refused with
/// [`NO_FAULT_INJECTION`]; nothing else makes one.
#[cfg(not(feature = "testing"))]
pub type Faults = NoFaults;

/// What `[testing.faults]` reads into without the `testing` feature: the
/// table, untouched, for [`Config::validate`] to refuse.
#[cfg(any(test, not(feature = "testing")))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NoFaults(toml::Table);

/// Why a build without the `testing` feature refuses `[testing.faults]`.
pub const NO_FAULT_INJECTION: &str =
    "this build has no fault injection: built without the `testing` feature";

/// The `[testing.faults]` check of a build without the `testing` feature:
/// any table is refused.
#[cfg(any(test, not(feature = "testing")))]
fn refuse_faults(faults: Option<&NoFaults>) -> Result<(), String> {
    match faults {
        Some(_) => Err(NO_FAULT_INJECTION.to_string()),
        None => Ok(()),
    }
}

impl Config {
    /// The built-in default (`config/default.toml`).
    pub fn embedded_default() -> Config {
        // The default file is part of the build and covered by a test, so a
        // failure here is a build defect, not bad input.
        Config::from_toml_str(DEFAULT_CONFIG, "config/default.toml (built in)")
            .expect("built-in default config is valid")
    }

    /// Read and check a config file. Listeners may name any scheme (an
    /// application may register its own transports); see
    /// [`Config::from_file_with_schemes`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Config, ConfigError> {
        Config::load_file(path.as_ref(), None)
    }

    /// Read and check a config file whose listeners must name one of
    /// `schemes` (e.g. `Registry::schemes()` of the registry that will
    /// open them).
    pub fn from_file_with_schemes(
        path: impl AsRef<Path>,
        schemes: &[&str],
    ) -> Result<Config, ConfigError> {
        Config::load_file(path.as_ref(), Some(schemes))
    }

    fn load_file(path: &Path, schemes: Option<&[&str]>) -> Result<Config, ConfigError> {
        let text = read_bounded(path, CONFIG_FILE_MAX).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::load(&text, &path.display().to_string(), schemes)
    }

    /// Parse and check config text; `origin` names it in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        Config::load(text, origin, None)
    }

    /// As [`Config::from_toml_str`], and every listener must name one of
    /// `schemes`.
    pub fn from_toml_str_with_schemes(
        text: &str,
        origin: &str,
        schemes: &[&str],
    ) -> Result<Config, ConfigError> {
        Config::load(text, origin, Some(schemes))
    }

    fn load(text: &str, origin: &str, schemes: Option<&[&str]>) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|err| ConfigError::Parse {
            origin: origin.to_string(),
            message: parse_message(text, &err),
        })?;
        let checked = config.validate(origin).and_then(|()| match schemes {
            Some(schemes) => config.check_schemes(origin, schemes),
            None => Ok(()),
        });
        match checked {
            Ok(()) => Ok(config),
            Err(ConfigError::Invalid {
                origin,
                key,
                message,
                ..
            }) => Err(ConfigError::Invalid {
                line: locate(text, &key),
                origin,
                key,
                message,
            }),
            Err(other) => Err(other),
        }
    }

    /// The file named by `EFABUS_CONFIG`, or the built-in default.
    pub fn from_env_or_default() -> Result<Config, ConfigError> {
        Config::env_or_default(None)
    }

    /// As [`Config::from_env_or_default`], and every listener must name one
    /// of `schemes`.
    pub fn from_env_or_default_with_schemes(schemes: &[&str]) -> Result<Config, ConfigError> {
        Config::env_or_default(Some(schemes))
    }

    fn env_or_default(schemes: Option<&[&str]>) -> Result<Config, ConfigError> {
        match std::env::var_os(CONFIG_ENV) {
            Some(path) if !path.is_empty() => Config::load_file(Path::new(&path), schemes),
            _ => Ok(Config::embedded_default()),
        }
    }

    /// Check that every listener and every data path in
    /// `negotiation.preference` names one of `schemes`; the error names the
    /// entry (`listen[i]`, `negotiation.preference[i]`) and lists the known
    /// schemes.
    pub fn check_schemes(&self, origin: &str, schemes: &[&str]) -> Result<(), ConfigError> {
        for (i, listen) in self.listen.iter().enumerate() {
            let invalid = |message: String| ConfigError::Invalid {
                origin: origin.to_string(),
                line: None,
                key: format!("listen[{i}]"),
                message,
            };
            let spec = efabus_transports::registry::EndpointSpec::parse(listen)
                .map_err(|err| invalid(err.to_string()))?;
            if !schemes
                .iter()
                .any(|known| known.eq_ignore_ascii_case(spec.scheme()))
            {
                let mut known = schemes.to_vec();
                known.sort_unstable();
                return Err(invalid(format!(
                    "unknown transport scheme {:?} in {listen:?}; known schemes: {}",
                    spec.scheme(),
                    known.join(", ")
                )));
            }
        }
        // The built-in data paths are always valid names, so the default
        // preference holds for a registry that lacks some of them.
        let builtin = [SHM_SCHEME, RDM_SCHEME, DGRAM_SCHEME, tcp::SCHEME];
        for (i, scheme) in self.negotiation.preference.iter().enumerate() {
            let known_here = |known: &&str| known.eq_ignore_ascii_case(scheme);
            if !schemes.iter().any(known_here) && !builtin.iter().any(known_here) {
                let mut known: Vec<&str> = schemes.iter().chain(&builtin).copied().collect();
                known.sort_unstable();
                known.dedup();
                return Err(ConfigError::Invalid {
                    origin: origin.to_string(),
                    line: None,
                    key: format!("negotiation.preference[{i}]"),
                    message: format!("unknown data path {scheme:?}; known: {}", known.join(", ")),
                });
            }
        }
        Ok(())
    }

    /// Check values the types alone cannot. Errors name the key and the
    /// allowed values; they carry no line (see [`Config::from_toml_str`]).
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            origin: origin.to_string(),
            line: None,
            key: key.to_string(),
            message,
        };
        if self.name.trim().is_empty() {
            return Err(invalid("name", "must not be empty".into()));
        }
        if self.name.len() > MAX_NAME_LEN {
            return Err(invalid(
                "name",
                format!(
                    "is {} bytes long; the allowed length is 1 to {MAX_NAME_LEN} bytes",
                    self.name.len()
                ),
            ));
        }
        check_log_level(&self.log_level).map_err(|message| invalid("log_level", message))?;
        let exit_on_stall = self.shutdown.exit_on_stall_ms;
        if exit_on_stall != 0 && exit_on_stall < MIN_EXIT_ON_STALL_MS {
            return Err(invalid(
                "shutdown.exit_on_stall_ms",
                format!(
                    "{exit_on_stall} is too short to tell a stuck event loop from a slow round: \
                     use 0 (never) or at least {MIN_EXIT_ON_STALL_MS}"
                ),
            ));
        }
        for (i, listen) in self.listen.iter().enumerate() {
            check_listen(listen).map_err(|message| invalid(&format!("listen[{i}]"), message))?;
        }
        for (i, peer) in self.peers.iter().enumerate() {
            check_peer(peer).map_err(|message| invalid(&format!("peers[{i}]"), message))?;
        }
        if let Some(monitor) = &self.monitor {
            check_monitor(monitor).map_err(|message| invalid("monitor", message))?;
        }
        // NATS listeners take `[tls]` as TCP ones do.
        let serves_tcp = self.listen.iter().any(|listen| {
            let scheme = crate::endpoints::scheme_of(listen);
            scheme == efabus_transports::tcp::SCHEME || scheme == efabus_transports::nats::SCHEME
        });
        self.tls
            .check(serves_tcp, !self.peers.is_empty())
            .map_err(|(key, message)| invalid(key, message))?;
        crate::accounts::check_users(&self.auth.users)
            .map_err(|(key, message)| invalid(&key, message))?;
        if !self.peers.is_empty() && !self.auth.users.is_empty() && self.route_secret().is_none() {
            // Routes present no user's credentials, and a broker with users
            // takes no hello without any: the brokers that dial this one
            // (its peers dial back, and others learn of it) are refused,
            // each refusal counting against their address.
            return Err(invalid(
                "peers",
                "with auth.users set, routes that present no secret are refused (users never \
                 open routes): set cluster.secret, the same on every broker"
                    .to_string(),
            ));
        }
        if let Some(i) = self
            .auth
            .users
            .iter()
            .position(|user| user.certificate.is_some())
        {
            if !self.tls.verify_clients {
                return Err(invalid(
                    &format!("auth.users[{i}].certificate"),
                    "names a client certificate, which only tls.verify_clients checks: set it"
                        .to_string(),
                ));
            }
        }
        if let Some(advertise) = &self.cluster.advertise {
            check_advertised(advertise).map_err(|message| invalid("cluster.advertise", message))?;
        }
        if self.cluster.forget_after_ms == 0 {
            return Err(invalid(
                "cluster.forget_after_ms",
                "must be positive".to_string(),
            ));
        }
        let nonzero = [
            ("limits.max_payload", self.limits.max_payload as usize),
            ("limits.max_subject_len", self.limits.max_subject_len),
            ("limits.max_subject_tokens", self.limits.max_subject_tokens),
            ("limits.max_connections", self.limits.max_connections),
            (
                "limits.max_handshakes_per_address",
                self.limits.max_handshakes_per_address,
            ),
            ("limits.max_handshakes", self.limits.max_handshakes),
            (
                "limits.max_subscriptions_per_peer",
                self.limits.max_subscriptions_per_peer,
            ),
            ("limits.max_route_interest", self.limits.max_route_interest),
            (
                "limits.handshake_timeout_ms",
                self.limits.handshake_timeout_ms as usize,
            ),
            ("limits.max_pending_bytes", self.limits.max_pending_bytes),
            ("limits.subscription_queue", self.limits.subscription_queue),
            ("limits.max_link_memory", self.limits.max_link_memory),
            ("heartbeat.interval_ms", self.heartbeat.interval_ms as usize),
            (
                "heartbeat.max_pings_out",
                self.heartbeat.max_pings_out as usize,
            ),
            (
                "fabric.reliable_gap_timeout_ms",
                self.fabric.reliable_gap_timeout_ms as usize,
            ),
        ];
        for (key, value) in nonzero {
            if value == 0 {
                return Err(invalid(key, "must be greater than 0".into()));
            }
        }
        // Unset, the eager size is the provider's default.
        if self.fabric.eager_size == Some(0) {
            return Err(invalid(
                "fabric.eager_size",
                "must be greater than 0".into(),
            ));
        }
        if self.limits.max_payload > u32::MAX as u64 - 4096 {
            return Err(invalid(
                "limits.max_payload",
                format!(
                    "is {}; the allowed range is 1 to {}",
                    self.limits.max_payload,
                    u32::MAX as u64 - 4096
                ),
            ));
        }
        if !(MIN_SUBJECT_LEN..=MAX_SUBJECT_LEN_LIMIT).contains(&self.limits.max_subject_len) {
            return Err(invalid(
                "limits.max_subject_len",
                format!(
                    "is {}; the allowed range is {MIN_SUBJECT_LEN} to {MAX_SUBJECT_LEN_LIMIT} \
                     bytes (request inboxes such as `_INBOX.<16 hex digits>.<n>` must fit; \
                     subjects travel in 16-bit fields and 64 KiB control frames)",
                    self.limits.max_subject_len
                ),
            ));
        }
        if self.limits.max_subject_tokens < MIN_SUBJECT_TOKENS {
            return Err(invalid(
                "limits.max_subject_tokens",
                format!(
                    "is {}; at least {MIN_SUBJECT_TOKENS} (a request inbox, \
                     `_INBOX.<id>.<n>`, has three tokens)",
                    self.limits.max_subject_tokens
                ),
            ));
        }
        let one_frame = efabus_core::fragment::ReassemblyConfig::reservation_for(self.max_frame());
        if self.limits.max_link_memory < one_frame {
            // Below that, the largest frame could never be reassembled.
            return Err(invalid(
                "limits.max_link_memory",
                format!(
                    "is {}; it must be at least {one_frame} bytes, what putting together \
                     one frame of the frame limit of {} bytes takes \
                     (limits.max_payload + 2 × limits.max_subject_len + 64)",
                    self.limits.max_link_memory,
                    self.max_frame()
                ),
            ));
        }
        check_secret(
            self.auth.secret.as_deref(),
            "remove the key to run without authentication",
        )
        .map_err(|message| invalid("auth.secret", message))?;
        check_secret(
            self.cluster.secret.as_deref(),
            "remove the key to let auth.secret open routes (or, without it, any peer)",
        )
        .map_err(|message| invalid("cluster.secret", message))?;
        if self.heartbeat.timeout_ms <= self.heartbeat.interval_ms {
            return Err(invalid(
                "heartbeat.timeout_ms",
                format!(
                    "must be larger than heartbeat.interval_ms ({})",
                    self.heartbeat.interval_ms
                ),
            ));
        }
        if self.fabric.reliable_gap_timeout_ms >= self.heartbeat.timeout_ms {
            return Err(invalid(
                "fabric.reliable_gap_timeout_ms",
                format!(
                    "must be shorter than heartbeat.timeout_ms ({})",
                    self.heartbeat.timeout_ms
                ),
            ));
        }
        #[cfg(feature = "testing")]
        if let Some(faults) = &self.testing.faults {
            faults.validate().map_err(|err| {
                invalid(
                    "testing.faults",
                    err.to_string().replace("fault option fault_", ""),
                )
            })?;
        }
        #[cfg(not(feature = "testing"))]
        refuse_faults(self.testing.faults.as_ref())
            .map_err(|message| invalid("testing.faults", message))?;
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

    /// The credential that opens a route, and that this broker presents
    /// when it dials its peers: `cluster.secret`, else `auth.secret`.
    /// `None` (no secret configured) is the open mode: any peer that
    /// connects may become a route.
    pub fn route_secret(&self) -> Option<&str> {
        self.cluster
            .secret
            .as_deref()
            .or(self.auth.secret.as_deref())
    }

    /// The link settings of this broker's data links: the reliable gap
    /// timeout, one memory budget of `limits.max_link_memory` for all, and
    /// no frame reassembled beyond what `limits.max_payload` allows (with
    /// room per link for one of the largest).
    pub(crate) fn link_tuning(&self) -> efabus_core::link::LinkTuning {
        let defaults = efabus_core::link::LinkTuning::default();
        efabus_core::link::LinkTuning {
            reliable_gap_timeout: self.fabric.reliable_gap_timeout(),
            memory: efabus_core::budget::MemoryBudget::new(self.limits.max_link_memory),
            reassembly: efabus_core::fragment::ReassemblyConfig::for_frames_up_to(self.max_frame()),
            ..defaults
        }
    }

    /// The largest frame a peer may send: the payload limit plus room for
    /// the header, subjects and reply subject.
    pub fn max_frame(&self) -> usize {
        self.limits.max_payload as usize + 2 * self.limits.max_subject_len + 64
    }
}

/// Check a secret: 1 to [`MAX_SECRET_LEN`] bytes when set; `instead` says
/// what to do rather than set an empty one.
fn check_secret(secret: Option<&str>, instead: &str) -> Result<(), String> {
    let Some(secret) = secret else {
        return Ok(());
    };
    if secret.is_empty() {
        // An empty secret would be taken for no secret at all.
        return Err(format!("is empty; {instead}, or set a secret"));
    }
    if secret.len() > MAX_SECRET_LEN {
        return Err(format!(
            "is {} bytes long; the allowed length is up to {MAX_SECRET_LEN} bytes",
            secret.len()
        ));
    }
    Ok(())
}

/// Check a log filter: comma-separated directives, each a level name or
/// `target=level` (a bare word would silently select a target instead).
/// Check a log filter as `log_level` takes it: levels, or `target=level`
/// directives; the error says what is expected.
pub fn check_log_level(filter: &str) -> Result<(), String> {
    let expected = || {
        format!(
            "expected a level ({}) or a filter such as \"efabus_broker=debug,info\"",
            LOG_LEVELS.join(", ")
        )
    };
    let is_level = |word: &str| {
        LOG_LEVELS
            .iter()
            .any(|l| l.eq_ignore_ascii_case(word.trim()))
    };
    if filter.trim().is_empty() {
        return Err(format!("is empty; {}", expected()));
    }
    for directive in filter.split(',') {
        let level = match directive.rsplit_once('=') {
            Some((target, level)) if !target.trim().is_empty() => level,
            _ => directive,
        };
        if !is_level(level) {
            return Err(format!("{directive:?} is not a level; {}", expected()));
        }
    }
    tracing_subscriber::EnvFilter::try_new(filter)
        .map(|_| ())
        .map_err(|err| format!("{filter:?}: {err}; {}", expected()))
}

/// The line (from 1) of a key such as `limits.max_payload` or `listen[2]`
/// in config text, if the text sets it: where the key is written (for an
/// array entry, where the entry is). Only run when a check made after
/// parsing refuses a value, so the happy path parses once.
pub fn locate(text: &str, key: &str) -> Option<usize> {
    let document = toml_edit::ImDocument::parse(text).ok()?;
    let mut item = document.as_item();
    let mut span = None;
    let mut parts = key.split('.').peekable();
    while let Some(part) = parts.next() {
        let (name, index) = match part.split_once('[') {
            Some((name, rest)) => (name, Some(rest.strip_suffix(']')?.parse::<usize>().ok()?)),
            None => (part, None),
        };
        let (found_key, found) = item.as_table_like()?.get_key_value(name)?;
        span = found_key.span().or_else(|| found.span());
        item = found;
        if let Some(index) = index {
            // Array entries are values, not items: nothing is looked up
            // below one.
            if parts.peek().is_some() {
                return None;
            }
            span = item.as_array()?.get(index)?.span();
        }
    }
    let start = span?.start.min(text.len());
    Some(text[..start].matches('\n').count() + 1)
}

/// A listener's endpoint string: a TCP listener binds `HOST:PORT` (or, as
/// bare `tcp`, listens nowhere and only dials, for routes), a NATS one
/// `IP:PORT`; port 0 picks a free one. Checked here so that `serve
/// --check` refuses what the listener could not open.
fn check_listen(listen: &str) -> Result<(), String> {
    let spec =
        efabus_transports::registry::EndpointSpec::parse(listen).map_err(|e| e.to_string())?;
    let scheme = spec.scheme();
    let address = spec.address().unwrap_or_default();
    let valid = if scheme == tcp::SCHEME {
        address.is_empty() || host_and_port(address).is_some()
    } else if scheme == efabus_transports::nats::SCHEME {
        address.parse::<std::net::SocketAddr>().is_ok()
    } else {
        return Ok(());
    };
    if !valid {
        let (form, example) = if scheme == tcp::SCHEME {
            ("HOST:PORT", "0.0.0.0:7420")
        } else {
            ("IP:PORT", "0.0.0.0:4222")
        };
        return Err(format!(
            "`{listen}` needs the address to bind, `{scheme}/{form}` (port 0 picks a free \
             one), e.g. `{scheme}/{example}`"
        ));
    }
    Ok(())
}

/// Why a `peers` entry cannot name a route: routes are dialed over TCP,
/// to a broker's listening address (their data path is negotiated then).
pub(crate) fn check_peer(peer: &str) -> Result<(), String> {
    let spec = efabus_transports::registry::EndpointSpec::parse(peer).map_err(|e| e.to_string())?;
    if spec.scheme() != tcp::SCHEME {
        return Err(format!(
            "routes to other brokers are dialed over tcp (`tcp/HOST:PORT`), not {}",
            spec.scheme()
        ));
    }
    let Some(address) = spec.address().filter(|a| !a.is_empty()) else {
        return Err("needs the peer broker's address (`tcp/HOST:PORT`)".to_string());
    };
    if address.len() > MAX_PEER_ADDRESS_LEN {
        return Err(format!(
            "an address of {} bytes; at most {MAX_PEER_ADDRESS_LEN}",
            address.len()
        ));
    }
    if host_and_port(address).is_none_or(|(_, port)| port == 0) {
        return Err(format!("`{address}` is not HOST:PORT"));
    }
    Ok(())
}

/// `HOST:PORT` taken apart: a host, and a port from 0 to 65535.
fn host_and_port(address: &str) -> Option<(&str, u16)> {
    let (host, port) = address.rsplit_once(':')?;
    let port = port.parse().ok()?;
    (!host.is_empty()).then_some((host, port))
}

/// Longest `HOST:PORT` of a route peer: a full DNS name and a port.
const MAX_PEER_ADDRESS_LEN: usize = 253 + 6;

/// A monitoring address is `HOST:PORT` with a numeric port (a name is
/// resolved when the listener binds).
pub fn check_monitor(address: &str) -> Result<(), String> {
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err(format!(
            "{address:?} is not HOST:PORT (for example \"127.0.0.1:8222\")"
        ));
    };
    if host.is_empty() {
        return Err(format!(
            "{address:?} has no host (for example \"127.0.0.1:8222\")"
        ));
    }
    match port.parse::<u16>() {
        Ok(_) => Ok(()),
        Err(_) => Err(format!("{address:?} has no valid port (0 to 65535)")),
    }
}

/// Why an address cannot be advertised to other brokers: it must be an IP
/// address and port (`tcp/10.0.0.2:7420`), so that a broker learning it
/// dials it without a name lookup on its event loop.
/// Largest configuration file read: far past any real one, and a bound
/// for a path that names no file at all (`/dev/zero`).
pub const CONFIG_FILE_MAX: u64 = 16 << 20;

/// The text of `path`, refused (`InvalidData`) past `max` bytes instead of
/// read to the end, whatever the path names.
pub fn read_bounded(path: &Path, max: u64) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("longer than {max} bytes"),
        ));
    }
    Ok(text)
}

pub(crate) fn check_advertised(address: &str) -> Result<(), String> {
    check_peer(address)?;
    let literal = address
        .strip_prefix("tcp/")
        .is_some_and(|a| a.parse::<std::net::SocketAddr>().is_ok());
    if !literal {
        return Err(format!(
            "`{address}` must be an IP address and port (`tcp/10.0.0.2:7420`)"
        ));
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
    fn link_memory_must_hold_the_largest_frame() {
        assert_eq!(Config::default().limits.max_link_memory, 512 << 20);
        let err = Config::from_toml_str("[limits]\nmax_link_memory = 0\n", "m.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("limits.max_link_memory: must be greater than 0"),
            "{err}"
        );
        let err = Config::from_toml_str("[limits]\nmax_link_memory = 1048576\n", "m.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("limits.max_link_memory"), "{err}");
        assert!(err.contains("frame limit of 1049664 bytes"), "{err}");
        let config = Config::from_toml_str(
            "[limits]\nmax_payload = 1024\nmax_link_memory = 4096\n",
            "m.toml",
        )
        .expect("a frame of 2112 bytes fits");
        assert_eq!(config.limits.max_link_memory, 4096);
        // The frame alone is not enough: its piece bitmap is reserved too.
        let err = Config::from_toml_str(
            "[limits]\nmax_payload = 1024\nmax_link_memory = 2112\n",
            "m.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("at least 2178 bytes"), "{err}");
    }

    #[test]
    fn each_link_can_put_the_largest_frame_together() {
        let config = Config::from_toml_str("[limits]\nmax_payload = 104857600\n", "p.toml")
            .expect("100 MiB payloads");
        let reassembly = config.link_tuning().reassembly;
        assert_eq!(reassembly.max_frame, config.max_frame());
        assert!(
            reassembly.max_bytes > config.max_frame(),
            "{} bytes of reassembly for frames of {}",
            reassembly.max_bytes,
            config.max_frame()
        );
    }

    #[test]
    fn the_reliable_gap_timeout_is_shorter_than_the_heartbeat_timeout() {
        let config = Config::default();
        assert_eq!(
            config.link_tuning().reliable_gap_timeout,
            Duration::from_millis(250)
        );
        assert_eq!(config.link_tuning().memory.limit(), 512 << 20);
        assert_eq!(
            config.link_tuning().reassembly.max_frame,
            config.max_frame(),
            "no frame reassembled beyond max_payload"
        );
        let err = Config::from_toml_str("[fabric]\nreliable_gap_timeout_ms = 0\n", "g.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("fabric.reliable_gap_timeout_ms: must be greater than 0"),
            "{err}"
        );
        let err = Config::from_toml_str("[fabric]\neager_size = 0\n", "e.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("fabric.eager_size: must be greater than 0"),
            "{err}"
        );
        assert_eq!(
            config.fabric.eager_size, None,
            "unset: the provider's default"
        );
        let err = Config::from_toml_str("[fabric]\nreliable_gap_timeout_ms = 10000\n", "g.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("shorter than heartbeat.timeout_ms (10000)"),
            "{err}"
        );
    }

    #[test]
    fn checks_after_parsing_name_file_line_key_and_range() {
        let text = "name = \"n\"\n\n[limits]\nmax_payload = 10\nmax_subject_len = 200000\n";
        let err = Config::from_toml_str(text, "d.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("invalid config d.toml, line 5: limits.max_subject_len:"),
            "{err}"
        );
        assert!(
            err.contains(&format!("{MIN_SUBJECT_LEN} to {MAX_SUBJECT_LEN_LIMIT}")),
            "{err}"
        );
        // The codec's own bound on the wire field is never reached.
        const { assert!(MAX_SUBJECT_LEN_LIMIT <= u16::MAX as usize) };

        let long = "x".repeat(70_000);
        let err = Config::from_toml_str(
            &format!("log_level = \"warn\"\nname = \"{long}\"\n"),
            "d.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("d.toml, line 2: name:"), "{err}");
        assert!(err.contains(&format!("1 to {MAX_NAME_LEN} bytes")), "{err}");
        assert!(!err.contains(&long), "the value itself is not echoed");

        let err = Config::from_toml_str(
            &format!("[auth]\nsecret = \"{}\"\n", "s".repeat(MAX_SECRET_LEN + 1)),
            "d.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 2: auth.secret:"), "{err}");

        let err = Config::from_toml_str("[auth]\nsecret = \"\"\n", "d.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2: auth.secret: is empty"), "{err}");
        assert!(err.contains("without authentication"), "{err}");

        let err = Config::from_toml_str("name = \"n\"\n[cluster]\nsecret = \"\"\n", "d.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 3: cluster.secret: is empty"), "{err}");
        assert!(err.contains("auth.secret open routes"), "{err}");
        let err = Config::from_toml_str(
            &format!(
                "[cluster]\nsecret = \"{}\"\n",
                "s".repeat(MAX_SECRET_LEN + 1)
            ),
            "d.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 2: cluster.secret:"), "{err}");
        assert!(!err.contains("sss"), "the value itself is not echoed");

        // Keys left at their defaults have no line to name.
        let err = Config::from_toml_str("[heartbeat]\ninterval_ms = 20000\n", "d.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("invalid config d.toml: heartbeat.timeout_ms:"),
            "{err}"
        );
        let err = Config::from_toml_str("[heartbeat]\ninterval_ms = 0\n", "d.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2: heartbeat.interval_ms"), "{err}");
    }

    #[test]
    fn log_level_must_be_a_level_or_a_filter() {
        for good in [
            "info",
            "WARN",
            "off",
            "efabus_broker=debug,info",
            "a=trace,b=error",
        ] {
            let text = format!("log_level = \"{good}\"\n");
            Config::from_toml_str(&text, "l.toml").unwrap_or_else(|err| panic!("{good}: {err}"));
        }
        for bad in ["loud", "", "info,", "efabus_broker=loud", "debug[", "=info"] {
            let text = format!("name = \"n\"\nlog_level = \"{bad}\"\n");
            let err = Config::from_toml_str(&text, "l.toml")
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(err.contains("l.toml, line 2: log_level:"), "{bad:?}: {err}");
            assert!(err.contains("error, warn, info"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn unknown_listen_scheme_names_the_entry_and_the_known_schemes() {
        let text = "name = \"n\"\nlisten = [\n  \"mem/a\",\n  \"foo/bar\",\n]\n";
        // Any scheme parses: an application may register its own.
        assert!(Config::from_toml_str(text, "s.toml").is_ok());
        let err = Config::from_toml_str_with_schemes(text, "s.toml", &["tcp", "mem"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("s.toml, line 4: listen[1]:"), "{err}");
        assert!(
            err.contains("\"foo\"") && err.contains("known schemes: mem, tcp"),
            "{err}"
        );
        let config = Config::from_toml_str_with_schemes(text, "s.toml", &["foo", "MEM"]).unwrap();
        assert_eq!(config.listen.len(), 2);

        // Preferred data paths: the registry's and the built-in ones.
        let preferring = |list: &str| {
            let text = format!("listen = [\"mem/a\"]\n[negotiation]\npreference = {list}\n");
            Config::from_toml_str_with_schemes(&text, "p.toml", &["foo", "mem"])
        };
        assert!(preferring(r#"["foo", "efa-rdm", "tcp"]"#).is_ok());
        let err = preferring(r#"["tcp", "rdma"]"#).unwrap_err().to_string();
        assert!(
            err.contains("line 3: negotiation.preference[1]: unknown data path \"rdma\"")
                && err.contains("efa-rdm, foo, mem, shm, tcp"),
            "{err}"
        );
    }

    #[test]
    fn locate_finds_keys_in_tables_arrays_and_inline_tables() {
        let text = "name = \"n\"\n[limits]\n# comment\nmax_payload = 5\n\n[testing.faults]\nseed = 1\n[fabric]\npolling = { busy_polls = 3 }\n";
        assert_eq!(locate(text, "name"), Some(1));
        assert_eq!(locate(text, "limits.max_payload"), Some(4));
        assert_eq!(locate(text, "testing.faults.seed"), Some(7));
        assert_eq!(locate(text, "fabric.polling.busy_polls"), Some(9));
        assert_eq!(locate(text, "limits.max_connections"), None);
        assert_eq!(locate(text, "listen[0]"), None);
        assert_eq!(locate("listen = [\"a\",\n\"b\"]", "listen[1]"), Some(2));
        assert_eq!(locate("listen = [\"a\"]", "listen[3]"), None);
        assert_eq!(locate("not toml [", "name"), None);
    }

    #[cfg(feature = "testing")]
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

    /// What a build without the `testing` feature does with
    /// `[testing.faults]` (this suite is built with the feature, so the
    /// pieces are checked here rather than through `Config`).
    #[test]
    fn testing_faults_without_the_feature_are_read_then_refused() {
        #[derive(Deserialize)]
        struct Testing {
            faults: Option<NoFaults>,
        }
        let read: Testing = toml::from_str("[faults]\nseed = 3\ndrop = 0.25\n").unwrap();
        let err = refuse_faults(read.faults.as_ref()).unwrap_err();
        assert_eq!(
            err,
            "this build has no fault injection: built without the `testing` feature"
        );
        let unset: Testing = toml::from_str("").unwrap();
        assert_eq!(refuse_faults(unset.faults.as_ref()), Ok(()));
    }

    /// TCP and NATS listeners need an address to bind, with a port the
    /// listener can open, before anything opens (`serve --check`).
    #[test]
    fn tcp_and_nats_listeners_bind_host_and_port() {
        let listen = |entry: &str| {
            Config::from_toml_str(&format!("listen = [\"mem/a\", \"{entry}\"]\n"), "l.toml")
        };
        // Bare `tcp` listens nowhere: it dials routes.
        for good in [
            "tcp/127.0.0.1:0",
            "tcp/node-1:7420",
            "tcp",
            "nats/[::1]:4222",
            "nats/0.0.0.0:4222",
            "efa-rdm",
        ] {
            assert!(listen(good).is_ok(), "{good}");
        }
        for bad in [
            "tcp/127.0.0.1",
            "tcp/127.0.0.1:99999",
            "tcp/:7420",
            "nats/host",
            "nats/localhost:4222",
        ] {
            let err = listen(bad).unwrap_err().to_string();
            assert!(
                err.contains("line 1: listen[1]") && err.contains(":PORT`"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn peers_are_tcp_endpoints() {
        assert!(Config::default().peers.is_empty());
        let config = Config::from_toml_str("peers = [\"tcp/10.0.0.2:7420\"]\n", "p.toml").unwrap();
        assert_eq!(config.peers, ["tcp/10.0.0.2:7420"]);
        for bad in ["mem/x", "efa-rdm", "nonsense", "tcp/10.0.0.2", "tcp/:7420"] {
            let err = Config::from_toml_str(&format!("peers = [\"{bad}\"]\n"), "p.toml")
                .unwrap_err()
                .to_string();
            assert!(err.contains("peers[0]"), "{bad}: {err}");
        }
        // A configured peer may be a host name; an advertised address not.
        assert!(Config::from_toml_str("peers = [\"tcp/node-2:7420\"]\n", "p.toml").is_ok());
        let cluster = |body: &str| Config::from_toml_str(&format!("[cluster]\n{body}\n"), "c.toml");
        assert!(cluster("advertise = \"tcp/10.0.0.1:7420\"").is_ok());
        for (bad, key) in [
            ("advertise = \"tcp/node-1:7420\"", "cluster.advertise"),
            ("advertise = \"tcp/10.0.0.1\"", "cluster.advertise"),
            ("forget_after_ms = 0", "cluster.forget_after_ms"),
        ] {
            let err = cluster(bad).unwrap_err().to_string();
            assert!(err.contains(key), "{bad}: {err}");
        }
    }

    #[test]
    fn the_route_credential_is_the_cluster_secret_else_the_client_secret() {
        let route_secret = |text: &str| {
            Config::from_toml_str(text, "r.toml")
                .unwrap()
                .route_secret()
                .map(str::to_string)
        };
        assert_eq!(route_secret(""), None, "open mode");
        assert_eq!(
            route_secret("[auth]\nsecret = \"clients\"\n").as_deref(),
            Some("clients")
        );
        assert_eq!(
            route_secret("[cluster]\nsecret = \"mesh\"\n").as_deref(),
            Some("mesh")
        );
        assert_eq!(
            route_secret("[auth]\nsecret = \"clients\"\n[cluster]\nsecret = \"mesh\"\n").as_deref(),
            Some("mesh")
        );
    }

    #[test]
    fn routes_among_users_need_a_secret() {
        let hash = crate::accounts::hash_secret("pw").unwrap();
        let users = format!("[[auth.users]]\nname = \"app\"\npassword = \"{hash}\"\n");
        let peers = "peers = [\"tcp/127.0.0.1:7421\"]\n";
        let err = Config::from_toml_str(&format!("{peers}{users}"), "u.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("peers") && err.contains("cluster.secret"),
            "{err}"
        );
        // Users alone, or routes with a secret, are fine.
        Config::from_toml_str(&users, "u.toml").unwrap();
        Config::from_toml_str(
            &format!("{peers}{users}[cluster]\nsecret = \"mesh\"\n"),
            "u.toml",
        )
        .unwrap();
    }

    #[test]
    fn missing_file_is_a_read_error() {
        let err = Config::from_file("/nonexistent/efabus.toml").unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }));
    }
}
