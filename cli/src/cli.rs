//! The `efabus` command line: the arguments of `serve`, `pub`, `sub`,
//! `req`, `caps` and `bench`, the running of `serve`, `pub`, `sub` and `req`
//! (`caps` and `bench` have their own modules), logging and signal
//! handling for `serve` and `sub`, and how every command reports failures
//! ([`Failure`]) and writes results ([`Output`]).
//!
//! Errors are printed as one line with the cause and what to do; usage and
//! configuration errors exit with code 2, other failures with 1. Results go
//! to standard output through [`Output`], so a reader that goes away
//! (`efabus caps | head`) ends the command quietly with status 0.

use std::fmt;
use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use efabus_core::frame::ErrorCode;
use efabus_core::transport::TransportError;
use efabus_transports::registry::{EndpointSpec, Registry, RegistryError};
use efabus_transports::tcp;

use efabus_broker::{
    Broker, Client, ClientOptions, Config, ConfigError, ConnectionState, Error, Message, RecvError,
};

/// The default server for client commands.
pub const DEFAULT_SERVER: &str = "tcp/127.0.0.1:7420";

#[derive(Debug, Parser)]
#[command(
    name = "efabus",
    version,
    about = "A subject-based message broker for EFA clusters"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a broker (config: --config, else $EFABUS_CONFIG, else the built-in default).
    Serve(ServeArgs),
    /// Publish messages.
    #[command(name = "pub")]
    Pub(PubArgs),
    /// Subscribe and print messages.
    Sub(SubArgs),
    /// Send a request and print the reply.
    Req(ReqArgs),
    /// Answer requests on a subject with a fixed payload.
    Reply(ReplyArgs),
    /// Show transport capabilities in fi_info layout, and what would be negotiated.
    Caps(crate::caps::CapsArgs),
    /// Measure throughput or request/reply latency.
    Bench(crate::bench::BenchArgs),
    /// Show a running broker's counters, from its monitoring listener.
    Stats(crate::monitor::StatsArgs),
    /// List a running broker's connections and their links, from its
    /// monitoring listener.
    Conns(crate::monitor::ConnsArgs),
    /// Hash a user's password (or a new token) for [[auth.users]].
    Passwd(PasswdArgs),
}

/// `efabus passwd`: the argon2id hash a user entry stores.
#[derive(Debug, Args)]
pub struct PasswdArgs {
    /// Make a random token instead of reading a password: prints the
    /// token (for the client) on the first line and its hash (for the
    /// user's `token`) on the second.
    #[arg(long)]
    pub generate: bool,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Config file (TOML).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Endpoint to listen on, replacing the config's list (repeatable):
    /// tcp/HOST:PORT, nats/IP:PORT (NATS clients), mem/NAME, efa-rdm,
    /// efa-dgram, shm.
    #[arg(long = "listen", short = 'l')]
    pub listen: Vec<String>,
    /// Node name.
    #[arg(long)]
    pub name: Option<String>,
    /// Log level or filter (RUST_LOG overrides).
    #[arg(long)]
    pub log_level: Option<String>,
    /// Log lines as text (coloured on a terminal unless NO_COLOR is set)
    /// or as JSON objects.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Shared secret clients must present. Visible to other users in `ps`:
    /// prefer --secret-file or EFABUS_SECRET.
    #[arg(long, env = "EFABUS_SECRET", hide_env_values = true)]
    pub secret: Option<String>,
    /// Read the shared secret from this file (its first line); it takes
    /// precedence over --secret and EFABUS_SECRET.
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Secret that opens routes between brokers (cluster.secret); when
    /// set, the clients' secret does not. Visible in `ps`: prefer
    /// --cluster-secret-file or EFABUS_CLUSTER_SECRET.
    #[arg(long, env = "EFABUS_CLUSTER_SECRET", hide_env_values = true)]
    pub cluster_secret: Option<String>,
    /// Read the cluster secret from this file (its first line); it takes
    /// precedence over --cluster-secret and EFABUS_CLUSTER_SECRET.
    #[arg(long, value_name = "FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// Check the configuration and exit: 0 when it is valid (listeners
    /// are not opened).
    #[arg(long)]
    pub check: bool,
    /// Serve HTTP monitoring (/varz, /connz, /routez, /subsz, /healthz,
    /// /metrics) on HOST:PORT, e.g. 127.0.0.1:8222 (config: monitor).
    #[arg(long, short = 'm', value_name = "HOST:PORT")]
    pub monitor: Option<String>,
    /// Certificate chain (PEM) the TCP and NATS listeners present; with
    /// --tls-key every such listener accepts TLS only (config: tls.cert).
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<String>,
    /// The certificate's private key (PEM; config: tls.key).
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<String>,
    /// Authorities (PEM) trusted for peer brokers' certificates and, with
    /// --tls-verify-clients, clients' (config: tls.ca).
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<String>,
    /// Ask every client for a certificate from --tls-ca: mutual TLS
    /// (config: tls.verify_clients).
    #[arg(long)]
    pub tls_verify_clients: bool,
}

/// How `serve` writes its log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct ClientArgs {
    /// Broker endpoint.
    #[arg(long, short, default_value = DEFAULT_SERVER, env = "EFABUS_SERVER")]
    pub server: String,
    /// Shared secret, if the broker requires one. Visible to other users
    /// in `ps`: prefer --secret-file or EFABUS_SECRET.
    #[arg(long, env = "EFABUS_SECRET", hide_env_values = true)]
    pub secret: Option<String>,
    /// Read the shared secret from this file (its first line); it takes
    /// precedence over --secret and EFABUS_SECRET.
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Log in as this user of the broker's [[auth.users]]; --secret (or
    /// --secret-file, EFABUS_SECRET) gives its password. Without it the
    /// secret is the broker's shared secret, only proven, never sent.
    /// Without --user or --token, EFABUS_USER is read.
    #[arg(long)]
    pub user: Option<String>,
    /// Log in with a user's token (sent to the broker: use TLS). Visible
    /// in `ps`: prefer EFABUS_TOKEN, read without --user or --token.
    #[arg(long, conflicts_with = "user")]
    pub token: Option<String>,
    /// Config the client takes what applies to a client from: its fabric
    /// endpoints (`listen` entries efa-rdm/efa-dgram/shm, the [fabric]
    /// table, the preference list), auth.secret, [tls] (a cert and key
    /// there are the client's certificate), limits, heartbeats and the
    /// slow-consumer policy. Give a client a file of its own.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Say on stderr which path the connection negotiated (and why not
    /// the fabric).
    #[arg(long, short)]
    pub verbose: bool,
    /// Connect with TLS, verifying the broker's certificate against these
    /// authorities (PEM).
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<String>,
    /// Client certificate (PEM) for a broker that asks for one.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<String>,
    /// The client certificate's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<String>,
    /// Verify the broker's certificate against this name rather than the
    /// host in --server.
    #[arg(long, value_name = "NAME")]
    pub tls_server_name: Option<String>,
}

#[derive(Debug, Args)]
pub struct PubArgs {
    pub subject: String,
    /// Payload text (default: empty, or --size bytes).
    pub data: Option<String>,
    /// Read the payload from a file (`-`: standard input).
    #[arg(long, conflicts_with = "data")]
    pub file: Option<PathBuf>,
    /// Number of messages.
    #[arg(long, default_value_t = 1)]
    pub count: u64,
    /// Payload size in bytes when no data is given.
    #[arg(long, conflicts_with_all = ["data", "file"])]
    pub size: Option<usize>,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct SubArgs {
    pub pattern: String,
    /// Join a queue group.
    #[arg(long, short)]
    pub queue: Option<String>,
    /// Exit after this many messages (received or missed).
    #[arg(long)]
    pub count: Option<u64>,
    /// Keep reconnecting when the broker goes away, and subscribe again
    /// (without it, a lost connection ends `sub` with status 1).
    #[arg(long)]
    pub reconnect: bool,
    /// Print only each payload, as it is, followed by a newline.
    #[arg(long, conflicts_with = "json")]
    pub raw: bool,
    /// Print one JSON object per message: subject, reply, size, and the
    /// payload as text (`payload`) or, when not UTF-8, as base64
    /// (`payload_base64`).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct ReplyArgs {
    /// Subject (or pattern) of the requests to answer.
    pub subject: String,
    /// The answer to every request.
    #[arg(default_value = "")]
    pub data: String,
    /// Join a queue group (responders sharing the requests).
    #[arg(long, short)]
    pub queue: Option<String>,
    /// Exit after answering this many requests.
    #[arg(long)]
    pub count: Option<u64>,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct ReqArgs {
    pub subject: String,
    #[arg(default_value = "")]
    pub data: String,
    /// How long to wait for the reply, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub timeout: u64,
    #[command(flatten)]
    pub client: ClientArgs,
}

/// A failure of a command: the message to print and the exit code. Code 0
/// (see [`Failure::quiet`]) stops the command without a message and is no
/// failure: [`run`] turns it into success.
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    pub code: i32,
}

impl Failure {
    /// Stop quietly: standard output was closed by its reader.
    pub fn quiet() -> Failure {
        Failure {
            message: String::new(),
            code: 0,
        }
    }

    pub fn usage(message: impl Into<String>) -> Failure {
        Failure {
            message: message.into(),
            code: 2,
        }
    }

    pub fn runtime(message: impl Into<String>) -> Failure {
        Failure {
            message: message.into(),
            code: 1,
        }
    }
}

impl From<ConfigError> for Failure {
    fn from(err: ConfigError) -> Failure {
        let from_flags =
            matches!(&err, ConfigError::Invalid { origin, .. } if origin == COMMAND_LINE);
        if from_flags {
            Failure::usage(format!("{err}; fix the option (see `efabus serve --help`)"))
        } else if let ConfigError::Read { path, .. } = &err {
            let named_by = match std::env::var_os(efabus_broker::config::CONFIG_ENV) {
                Some(env) if env == path.as_os_str() => "$EFABUS_CONFIG",
                _ => "--config",
            };
            Failure::usage(format!(
                "{err}; check the path given with {named_by}, or leave it out for the \
                 built-in default"
            ))
        } else {
            Failure::usage(format!(
                "{err}; fix the file (README \"Configuration\" lists every key with its default)"
            ))
        }
    }
}

/// How errors name values given as command-line flags.
const COMMAND_LINE: &str = "(command line)";

/// Longest excerpt of a user's subject (or of a server's text) echoed in an
/// error message, in characters.
const EXCERPT_CHARS: usize = 64;

/// A subject or other user text as shown in messages: at most `max` characters,
/// with "…" when cut.
pub fn excerpt(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

/// Standard output for a command's results. A closed pipe (the reader went
/// away, as `head` does) becomes [`Failure::quiet`] rather than the panic
/// `println!` gives; other write errors are failures.
pub struct Output {
    out: io::StdoutLock<'static>,
}

impl Output {
    pub fn new() -> Output {
        Output {
            out: io::stdout().lock(),
        }
    }

    /// Write formatted text (use with `format_args!`).
    pub fn write(&mut self, text: fmt::Arguments<'_>) -> Result<(), Failure> {
        self.out.write_fmt(text).map_err(write_failure)
    }

    /// Write bytes as they are.
    pub fn bytes(&mut self, bytes: &[u8]) -> Result<(), Failure> {
        self.out.write_all(bytes).map_err(write_failure)
    }

    /// Write formatted text and a newline.
    pub fn line(&mut self, text: fmt::Arguments<'_>) -> Result<(), Failure> {
        self.write(text)?;
        self.out.write_all(b"\n").map_err(write_failure)
    }

    /// Push out what is buffered (lines are flushed as they end; this is for
    /// text without a final newline).
    pub fn flush(&mut self) -> Result<(), Failure> {
        self.out.flush().map_err(write_failure)
    }
}

impl Default for Output {
    fn default() -> Self {
        Output::new()
    }
}

fn write_failure(err: io::Error) -> Failure {
    if err.kind() == io::ErrorKind::BrokenPipe {
        Failure::quiet()
    } else {
        Failure::runtime(format!("cannot write to standard output: {err}"))
    }
}

/// `writeln!` for an [`Output`]: `out!(output, "x = {x}")?`.
macro_rules! out {
    ($output:expr) => {
        $output.line(format_args!(""))
    };
    ($output:expr, $($arg:tt)*) => {
        $output.line(format_args!($($arg)*))
    };
}
pub(crate) use out;

/// Turn a library error into one line that says what to do. Subjects and
/// texts from the server are cut to a readable length.
pub(crate) fn explain(err: Error, server: Option<&str>) -> Failure {
    let client = server.is_some();
    let server = server.unwrap_or(DEFAULT_SERVER);
    let short = |text: &str| excerpt(text, EXCERPT_CHARS);
    let (message, hint, code) = match &err {
        // A client's TLS keys come from its --tls-* flags.
        Error::Config(ConfigError::Invalid { key, .. }) if client && key.starts_with("tls.") => {
            return Failure::usage(format!(
                "{err}; a client's tls.ca, tls.cert and tls.key are its --tls-ca, --tls-cert \
                 and --tls-key (or the [tls] table of its --config)"
            ))
        }
        Error::Config(_) => return Failure::usage(err.to_string()),
        Error::Endpoint { endpoint, source } => {
            let (hint, code) = match source {
                RegistryError::Transport {
                    source: TransportError::Bind { source, .. },
                    ..
                } => match source.kind() {
                    io::ErrorKind::AddrInUse => (
                        "is another broker running there? pick another address with --listen",
                        1,
                    ),
                    io::ErrorKind::AddrNotAvailable => (
                        "that address is not one of this host's; listen on one of its \
                         addresses, or 0.0.0.0 for all",
                        1,
                    ),
                    io::ErrorKind::PermissionDenied => (
                        "ports below 1024 need privileges; pick a port from 1024 up",
                        1,
                    ),
                    _ => ("pick another address with --listen", 1),
                },
                RegistryError::Transport {
                    source: TransportError::Unavailable { .. },
                    ..
                } => ("remove that listener from the config or install what it needs (see README, Running on EFA)", 1),
                RegistryError::UnknownScheme { .. } | RegistryError::Spec(_) => (
                    "endpoints are mem/NAME, tcp/HOST:PORT, efa-rdm, efa-dgram or shm",
                    2,
                ),
                // The endpoint string itself is wrong: a usage error, as
                // for --server.
                RegistryError::Transport {
                    source: TransportError::InvalidAddress { .. },
                    ..
                } => (
                    "check the endpoint string (tcp/HOST:PORT with a port from 0 to 65535)",
                    2,
                ),
                // The TLS files a client was given (`--tls-*`).
                RegistryError::Transport {
                    source: TransportError::Tls(_),
                    ..
                } => (
                    "fix the --tls-* files (a PEM certificate chain, its key, a CA)",
                    2,
                ),
                _ => (
                    "check the endpoint string (mem/NAME, tcp/HOST:PORT, efa-rdm, efa-dgram, shm)",
                    1,
                ),
            };
            (
                format!("cannot open {}: {}", short(endpoint), source.cause()),
                hint.to_string(),
                code,
            )
        }
        Error::Unreachable { reason, .. } => (
            format!("cannot connect to {}: {reason}", short(server)),
            "is a broker running there? start one with `efabus serve`".to_string(),
            1,
        ),
        Error::NotConnected(_) => (
            // The command line does not reconnect: it gave up.
            format!("could not connect to {}", short(server)),
            "is a broker running there? start one with `efabus serve`".to_string(),
            1,
        ),
        Error::Refused { code, text } => (
            format!(
                "the server refused: {code:?}: {}",
                excerpt(text, 4 * EXCERPT_CHARS)
            ),
            if *code == ErrorCode::Auth {
                "check --secret (or EFABUS_SECRET) against the broker's auth.secret, or \
                 --user and its password, or --token"
                    .to_string()
            } else {
                String::new()
            },
            1,
        ),
        Error::Subject { subject, source } => (
            format!("invalid subject {:?}: {source}", short(subject)),
            "subjects are dot-separated tokens; wildcards * and > only in patterns".to_string(),
            2,
        ),
        Error::Subscription { pattern, source } => (
            format!("cannot subscribe to {:?}: {source}", short(pattern)),
            String::new(),
            1,
        ),
        Error::Timeout(_) => (
            err.to_string(),
            "is anything subscribed to that subject? raise --timeout if it is slow".to_string(),
            1,
        ),
        Error::Blocked(_) => (
            err.to_string(),
            "the broker holds publishers back for a slow subscriber (slow_consumer.policy = \
             \"block\"); `efabus conns` shows whose queue is full"
                .to_string(),
            1,
        ),
        Error::NoResponders(subject) => (
            format!("no subscriber for {}", short(subject)),
            "start a responder that subscribes to that subject".to_string(),
            1,
        ),
        Error::PayloadTooLarge { .. } => (err.to_string(), String::new(), 2),
        _ => (err.to_string(), String::new(), 1),
    };
    let message = if hint.is_empty() {
        message
    } else {
        format!("{message}; {hint}")
    };
    Failure { message, code }
}

/// Run the parsed command line.
pub fn run(cli: Cli) -> Result<(), Failure> {
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::Pub(args) => publish(args),
        Command::Sub(args) => subscribe(args),
        Command::Req(args) => request(args),
        Command::Reply(args) => reply(args),
        Command::Caps(args) => crate::caps::run(args),
        Command::Bench(args) => crate::bench::run(args),
        Command::Stats(args) => crate::monitor::stats(args),
        Command::Conns(args) => crate::monitor::conns(args),
        Command::Passwd(args) => passwd(&args),
    };
    match result {
        Err(failure) if failure.code == 0 => Ok(()),
        other => other,
    }
}

/// Changes the log filter of a running command (`serve` on SIGHUP).
type LogReload =
    tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, tracing_subscriber::Registry>;

/// Log to stderr at `level`, or at `RUST_LOG` when set (an invalid one is
/// a usage error, not ignored). Colour only on a terminal, and not when
/// `NO_COLOR` is set. The handle changes the level later; none when
/// `RUST_LOG` decides.
fn init_logging(level: &str, format: LogFormat) -> Result<Option<LogReload>, Failure> {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{reload, EnvFilter};
    let from_env = std::env::var("RUST_LOG")
        .ok()
        .filter(|text| !text.trim().is_empty());
    if let Some(text) = &from_env {
        efabus_broker::config::check_log_level(text).map_err(|message| {
            Failure::usage(format!("RUST_LOG {message}; fix or unset RUST_LOG"))
        })?;
    }
    let filter = EnvFilter::try_new(from_env.as_deref().unwrap_or(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, handle) = reload::Layer::new(filter);
    let colour = io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty());
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(io::stderr)
        .with_ansi(colour);
    let registry = tracing_subscriber::registry().with(filter);
    // A subscriber set before (by a test harness) keeps its place.
    let _ = match format {
        LogFormat::Text => registry.with(layer).try_init(),
        LogFormat::Json => registry.with(layer.json()).try_init(),
    };
    Ok(from_env.is_none().then_some(handle))
}

/// Where a secret comes from, as an error names it.
pub(crate) const SECRET_FLAGS: &str = "--secret or EFABUS_SECRET";

/// Largest secret file read.
const SECRET_FILE_MAX: u64 = 64 << 10;

/// The first line of `file` when one is given (a file named on the
/// command line is meant over a secret in the environment), else the
/// secret given as a flag or its environment variable.
/// An empty secret is refused here, naming where it came from (an empty
/// line in an environment file is easily left behind), rather than as the
/// configuration's `auth.secret`.
pub(crate) fn secret_from(
    value: &Option<String>,
    file: &Option<PathBuf>,
    names: &str,
) -> Result<Option<String>, Failure> {
    let Some(path) = file else {
        if value.as_deref() == Some("") {
            return Err(Failure::usage(format!(
                "the secret given ({names}) is empty; give one, or leave it unset to run \
                 without"
            )));
        }
        return Ok(value.clone());
    };
    // A secret is at most 4 KiB: a file far longer is not one.
    let text = efabus_broker::config::read_bounded(path, SECRET_FILE_MAX).map_err(|err| {
        Failure::usage(format!(
            "cannot read the secret file {}: {err}; name a file whose first line is the secret",
            path.display()
        ))
    })?;
    match text.lines().next() {
        Some(secret) if !secret.is_empty() => Ok(Some(secret.to_string())),
        _ => Err(Failure::usage(format!(
            "the secret file {}: its first line is empty; put the secret there",
            path.display()
        ))),
    }
}

/// `efabus passwd`: reads a password (twice, without echo, from a
/// terminal; else the first line of standard input), or makes a token,
/// and prints the argon2id hash to store in `[[auth.users]]`.
fn passwd(args: &PasswdArgs) -> Result<(), Failure> {
    use std::io::IsTerminal;
    let mut output = Output::new();
    let secret = if args.generate {
        let bytes: [u8; 24] = efabus_broker::link_auth::random_bytes()
            .map_err(|err| Failure::runtime(err.to_string()))?;
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        out!(output, "{token}")?;
        token
    } else if io::stdin().is_terminal() {
        let read = |prompt: &str| {
            rpassword::prompt_password(prompt)
                .map_err(|err| Failure::runtime(format!("cannot read the password: {err}")))
        };
        let password = read("password: ")?;
        if read("again: ")? != password {
            return Err(Failure::usage(
                "the two passwords differ; nothing was hashed",
            ));
        }
        password
    } else {
        let mut line = String::new();
        io::stdin()
            .read_line(&mut line)
            .map_err(|err| Failure::runtime(format!("cannot read the password: {err}")))?;
        line.trim_end_matches(['\r', '\n']).to_string()
    };
    if secret.is_empty() {
        return Err(Failure::usage("an empty password is not a password"));
    }
    let hash = efabus_broker::accounts::hash_secret(&secret)
        .map_err(|err| Failure::runtime(format!("cannot hash: {err}")))?;
    out!(output, "{hash}")
}

/// SIGINT and SIGTERM (stop), and SIGHUP (reload), caught from now on,
/// to be waited for.
fn stop_signals() -> Result<signal_hook::iterator::Signals, Failure> {
    let cannot =
        |err: std::io::Error| Failure::runtime(format!("cannot install signal handlers: {err}"));
    efabus_transports::fabric::reset_inherited_termination_handlers().map_err(cannot)?;
    signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ])
    .map_err(cannot)
}

/// A flag set by SIGINT or SIGTERM.
pub(crate) fn stop_on_signals() -> Result<Arc<AtomicBool>, Failure> {
    let cannot =
        |err: std::io::Error| Failure::runtime(format!("cannot install signal handlers: {err}"));
    efabus_transports::fabric::reset_inherited_termination_handlers().map_err(cannot)?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // A second signal, while the first is being acted on, ends the
        // command at once.
        signal_hook::flag::register_conditional_shutdown(signal, 130, stop.clone())
            .map_err(cannot)?;
        signal_hook::flag::register(signal, stop.clone()).map_err(cannot)?;
    }
    Ok(stop)
}

/// The configuration `serve` runs with: the file (or the built-in
/// default), the flags over it, checked. Listeners are checked against the
/// transports this binary has, so an unknown scheme is a configuration
/// error naming the entry.
fn serve_config(args: &ServeArgs, schemes: &[&str]) -> Result<Config, Failure> {
    let mut config = match &args.config {
        Some(path) => Config::from_file_with_schemes(path, schemes)?,
        None => Config::from_env_or_default_with_schemes(schemes)?,
    };
    if !args.listen.is_empty() {
        config.listen = args.listen.clone();
    }
    if let Some(name) = &args.name {
        config.name = name.clone();
    }
    if let Some(level) = &args.log_level {
        config.log_level = level.clone();
    }
    if let Some(secret) = secret_from(&args.secret, &args.secret_file, SECRET_FLAGS)? {
        config.auth.secret = Some(secret);
    }
    let cluster_flags = "--cluster-secret or EFABUS_CLUSTER_SECRET";
    if let Some(secret) = secret_from(
        &args.cluster_secret,
        &args.cluster_secret_file,
        cluster_flags,
    )? {
        config.cluster.secret = Some(secret);
    }
    if args.monitor.is_some() {
        config.monitor = args.monitor.clone();
    }
    let tls = &mut config.tls;
    for (flag, key) in [
        (&args.tls_cert, &mut tls.cert),
        (&args.tls_key, &mut tls.key),
        (&args.tls_ca, &mut tls.ca),
    ] {
        if flag.is_some() {
            key.clone_from(flag);
        }
    }
    tls.verify_clients |= args.tls_verify_clients;
    config.validate(COMMAND_LINE)?;
    config.check_schemes(COMMAND_LINE, schemes)?;
    if config.listen.is_empty() {
        return Err(Failure::usage(
            "nothing to listen on: the config has no `listen` entries; add for example \
             listen = [\"tcp/127.0.0.1:7420\"] or pass --listen tcp/127.0.0.1:7420",
        ));
    }
    Ok(config)
}

fn serve(args: ServeArgs) -> Result<(), Failure> {
    let registry = Registry::with_builtins();
    let schemes: Vec<String> = registry.schemes().iter().map(|s| s.to_string()).collect();
    let schemes: Vec<&str> = schemes.iter().map(String::as_str).collect();
    let config = serve_config(&args, &schemes)?;
    let tls = &config.tls;
    efabus_transports::tls::check_files(
        tls.cert.as_deref(),
        tls.key.as_deref(),
        tls.ca.as_deref(),
        tls.verify_clients,
    )
    .map_err(|err| {
        Failure::usage(format!(
            "{err}; fix tls.cert, tls.key or tls.ca (or --tls-*)"
        ))
    })?;
    if args.check {
        let from_env = std::env::var_os(efabus_broker::config::CONFIG_ENV)
            .filter(|path| !path.is_empty())
            .map(|path| format!("{} (from $EFABUS_CONFIG)", PathBuf::from(path).display()));
        let source = args.config.as_ref().map_or_else(
            || from_env.unwrap_or_else(|| "the built-in default".to_string()),
            |path| path.display().to_string(),
        );
        let monitor = config
            .monitor
            .as_ref()
            .map_or(String::new(), |address| format!("; monitor on {address}"));
        return out!(
            Output::new(),
            "configuration valid: {source}: listens on {}{monitor} \
             (addresses are not opened by --check)",
            config.listen.join(", ")
        );
    }
    let log_reload = init_logging(&config.log_level, args.log_format)?;
    let mut log_level = config.log_level.clone();

    // Caught before anything starts, so a stop at any time is graceful.
    let mut signals = stop_signals()?;
    let monitor_address = config.monitor.clone();
    let exit_on_stall = Duration::from_millis(config.shutdown.exit_on_stall_ms);
    let broker = Broker::start_with_registry(config, registry).map_err(|err| explain(err, None))?;
    let broker = Arc::new(broker);
    let stall_watch = Arc::clone(&broker);
    // Runs through shutdown too: a stuck loop would hold the join forever.
    std::thread::Builder::new()
        .name("efabus-stall-watch".into())
        .spawn(move || watch_for_stalls(&stall_watch, exit_on_stall))
        .map_err(|err| Failure::runtime(format!("cannot start the stall watch: {err}")))?;
    let monitor = match &monitor_address {
        Some(address) => Some(
            efabus_monitor::Monitor::start(Arc::clone(&broker), address).map_err(|err| {
                broker.shutdown();
                Failure::runtime(format!(
                    "{err}; choose another monitor address or stop what holds it"
                ))
            })?,
        ),
        None => None,
    };
    let mut output = Output::new();
    let mut lines: Vec<String> = broker
        .listening()
        .iter()
        .map(|(scheme, address)| format!("listening on {scheme}/{address}"))
        .collect();
    if let Some(monitor) = &monitor {
        lines.push(format!("monitoring on http://{}", monitor.local_addr()));
    }
    for line in lines {
        // Serving goes on when nobody reads these lines any more.
        if out!(output, "{line}").is_err() {
            break;
        }
    }
    // Sleep until told to stop (no polling); reload on SIGHUP.
    for signal in signals.forever() {
        if signal != signal_hook::consts::SIGHUP {
            break;
        }
        reload(
            &args,
            &schemes,
            &broker,
            &mut log_level,
            log_reload.as_ref(),
        );
    }
    drop(monitor);
    broker.shutdown();
    let stats: Vec<String> = broker
        .stats()
        .snapshot()
        .into_iter()
        .filter(|(name, _)| *name != "connections" && *name != "queued_bytes")
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    out!(output, "stopped: {}", stats.join(" "))
}

/// How often the stall watch looks at the event loop.
const STALL_CHECK: Duration = Duration::from_secs(1);
/// How long a round is seen under way before the stall watch logs where
/// it is stuck.
const STALL_REPORT: Duration = Duration::from_secs(10);
/// `serve`'s exit status when its event loop is stuck or has ended.
const STALLED_EXIT: i32 = 3;

/// Watches the broker's event loop for a round that does not end: logs an
/// error saying where it is stuck once it has seen the round under way for
/// `STALL_REPORT` (or `exit_after`, if shorter), and ends the process with
/// [`STALLED_EXIT`] once it has seen it for `exit_after` (never when
/// zero), as nothing else would stop it; and at once when the loop has
/// ended (a panic), as it would serve nothing. Only this
/// thread's own waits
/// count, each at most twice `STALL_CHECK`: a pause of the whole process
/// (a debugger, SIGSTOP) is no stall of the loop. It lasts as long as the
/// process: a shutdown's drain is watched too.
fn watch_for_stalls(broker: &Broker, exit_after: Duration) {
    let report_after = if exit_after.is_zero() {
        STALL_REPORT
    } else {
        STALL_REPORT.min(exit_after)
    };
    // The round seen under way, and for how long.
    let mut seen: Option<(u64, Duration)> = None;
    let mut reported = false;
    let mut last = Instant::now();
    loop {
        std::thread::sleep(STALL_CHECK);
        let now = Instant::now();
        let waited = now.duration_since(last).min(2 * STALL_CHECK);
        last = now;
        if broker.loop_ended() {
            tracing::error!("the broker's event loop has ended: it panicked (see above)");
            eprintln!(
                "efabus: error: the broker's event loop has ended (it panicked, as said \
                 above); exiting with status {STALLED_EXIT} so that a supervisor can start it \
                 again"
            );
            efabus_transports::fabric::exit_at_once(STALLED_EXIT);
        }
        let Some(stall) = broker.stalled_round(STALL_CHECK) else {
            seen = None;
            reported = false;
            continue;
        };
        let observed = match seen {
            Some((round, observed)) if round == stall.round => observed + waited,
            _ => Duration::ZERO,
        };
        seen = Some((stall.round, observed));
        if !exit_after.is_zero() && observed >= exit_after {
            tracing::error!(%stall, "exiting: the broker serves nothing while its loop is stuck");
            eprintln!(
                "efabus: error: {stall}, a call that does not return (README \"shm\"); \
                 exiting with status {STALLED_EXIT} so that a supervisor can start it \
                 again (shutdown.exit_on_stall_ms)"
            );
            // Not `process::exit`: libfabric's destructor would tear its
            // providers down under the stuck thread.
            efabus_transports::fabric::exit_at_once(STALLED_EXIT);
        }
        if !reported && observed >= report_after {
            reported = true;
            tracing::error!(
                %stall,
                "the broker serves nothing meanwhile (README \"shm\"); see shutdown.exit_on_stall_ms"
            );
        }
    }
}

/// SIGHUP: read the configuration again. The log level changes at once
/// (unless `RUST_LOG` decides it), the limits and slow-consumer policy
/// through [`Broker::reload`]; other keys that changed are named as needing
/// a restart. A configuration that does not load leaves the running one,
/// and says why.
fn reload(
    args: &ServeArgs,
    schemes: &[&str],
    broker: &Broker,
    log_level: &mut String,
    log: Option<&LogReload>,
) {
    let refused = |error: &dyn std::fmt::Display| {
        tracing::warn!(%error, "reload refused; the running configuration stays");
    };
    let config = match serve_config(args, schemes) {
        Ok(config) => config,
        Err(failure) => return refused(&failure.message),
    };
    let reloaded = match broker.reload(&config) {
        Ok(reloaded) => reloaded,
        Err(err) => return refused(&err),
    };
    if config.log_level != *log_level {
        match log {
            Some(log) => {
                let changed = tracing_subscriber::EnvFilter::try_new(&config.log_level)
                    .is_ok_and(|filter| log.reload(filter).is_ok());
                if changed {
                    tracing::warn!(log_level = %config.log_level, "log level changed");
                    log_level.clone_from(&config.log_level);
                } else {
                    tracing::warn!("the log level could not be changed");
                }
            }
            None => tracing::warn!(
                "log_level changed, but RUST_LOG sets the log level: unset it to use the file's"
            ),
        }
    }
    if !reloaded.applied.is_empty() {
        tracing::warn!(keys = %reloaded.applied.join(", "), "applied");
    }
    if reloaded.needs_restart.is_empty() {
        tracing::info!("configuration reloaded");
    } else {
        tracing::warn!(
            keys = %reloaded.needs_restart.join(", "),
            "configuration reloaded; these changes take effect after a restart"
        );
    }
}

/// The user or token a client command logs in with: `--user` or
/// `--token` as given (a flag is meant over the environment), else
/// `$EFABUS_USER` or `$EFABUS_TOKEN`; both variables set, with neither
/// flag, is a usage error.
fn login(args: &ClientArgs) -> Result<(Option<String>, Option<String>), Failure> {
    if args.user.is_some() || args.token.is_some() {
        return Ok((args.user.clone(), args.token.clone()));
    }
    let env = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
    match (env("EFABUS_USER"), env("EFABUS_TOKEN")) {
        (Some(_), Some(_)) => Err(Failure::usage(
            "both EFABUS_USER and EFABUS_TOKEN are set; unset one, or give --user or --token",
        )),
        login => Ok(login),
    }
}

/// A `tcp/HOST:PORT` server whose address cannot be resolved fails at once,
/// with the resolver's reason, instead of after the connect timeout.
pub(crate) fn check_server(server: &str) -> Result<(), Failure> {
    let Ok(spec) = EndpointSpec::parse(server) else {
        // The client reports a malformed endpoint itself.
        return Ok(());
    };
    if spec.scheme() != tcp::SCHEME {
        return Ok(());
    }
    let address = spec.address().unwrap_or_default();
    match std::net::ToSocketAddrs::to_socket_addrs(address) {
        Ok(_) => Ok(()),
        Err(err) => {
            let message = format!(
                "cannot resolve --server {}: {err}; expected tcp/HOST:PORT with a port from 1 to 65535",
                excerpt(server, EXCERPT_CHARS)
            );
            Err(if err.kind() == io::ErrorKind::InvalidInput {
                Failure::usage(message)
            } else {
                Failure::runtime(message)
            })
        }
    }
}

fn connect(args: &ClientArgs) -> Result<Client, Failure> {
    connect_with(args, false)
}

/// Connect; with `reconnect` the client rides out the broker going away.
fn connect_with(args: &ClientArgs, reconnect: bool) -> Result<Client, Failure> {
    // What goes wrong is the command's one-line error; the library's
    // warnings about the same would say it twice.
    init_logging("error", LogFormat::Text)?;
    let base = match &args.config {
        Some(path) => ClientOptions::from_config(&Config::from_file(path)?),
        None => ClientOptions::default(),
    };
    check_server(&args.server)?;
    let (user, token) = login(args)?;
    let mut tls = base.tls.clone();
    for (flag, key) in [
        (&args.tls_ca, &mut tls.ca),
        (&args.tls_cert, &mut tls.cert),
        (&args.tls_key, &mut tls.key),
        (&args.tls_server_name, &mut tls.server_name),
    ] {
        if flag.is_some() {
            key.clone_from(flag);
        }
    }
    let options = ClientOptions {
        name: format!("efabus-cli-{}", std::process::id()),
        credentials: secret_from(&args.secret, &args.secret_file, SECRET_FLAGS)?
            .or(base.credentials.clone()),
        user,
        token: token.or(base.token.clone()),
        reconnect,
        tls,
        ..base
    };
    let client = Client::connect_with(&args.server, options, Registry::with_builtins())
        .map_err(|err| explain(err, Some(&args.server)))?;
    if args.verbose {
        let link = client.link();
        let mut said = format!("connected to {}; reliable: {}", args.server, link.reliable);
        if let Some(best_effort) = &link.best_effort {
            said.push_str(&format!("; best effort: {best_effort}"));
        }
        if !efabus_broker::monitoring::is_fabric_path(&link.reliable) && !link.reasons.is_empty() {
            said.push_str(&format!("; not on the fabric: {}", link.reasons.join("; ")));
        }
        // A status line: a closed stderr is no reason to fail.
        let _ = writeln!(io::stderr(), "{said}");
    }
    Ok(client)
}

/// A subject (or, for `sub`, a pattern) that no broker would take is a
/// usage error before anything is sent. Only the syntax is checked here,
/// within what the wire carries: the server enforces its own length and
/// token limits.
fn check_subject(subject: &str, pattern: bool) -> Result<(), Failure> {
    let wire = efabus_core::subject::SubjectLimits {
        max_len: u16::MAX as usize,
        max_tokens: usize::MAX,
    };
    let checked = if pattern {
        efabus_core::subject::validate_pattern(subject, &wire)
    } else {
        efabus_core::subject::validate_subject(subject, &wire)
    };
    checked.map_err(|err| {
        let what = if pattern { "pattern" } else { "subject" };
        Failure::usage(format!(
            "invalid {what} {:?}: {err}; subjects are dot-separated tokens such as orders.eu{}",
            excerpt(subject, EXCERPT_CHARS),
            if pattern {
                " (`*` matches one token, a final `>` the rest)"
            } else {
                " (no wildcards when publishing)"
            }
        ))
    })
}

/// Largest payload the wire can carry at all (the config's own bound on
/// `limits.max_payload`); sizes above it are refused before connecting.
const WIRE_MAX_PAYLOAD: u64 = u32::MAX as u64 - 4096;

fn too_large(what: &str, len: u64, max: u64, whose: &str) -> Failure {
    Failure::usage(format!(
        "{what} is {len} bytes, above {whose} limit of {max} bytes; send less"
    ))
}

fn publish(args: PubArgs) -> Result<(), Failure> {
    // Sizes are checked before anything is allocated: first against what
    // the wire can carry, then against the server's limit from its welcome.
    let stdin_payload = args.file.as_deref() == Some(std::path::Path::new("-"));
    let wanted = match (&args.file, args.size) {
        // Standard input's length is known once read (after connecting).
        (Some(_), _) if stdin_payload => None,
        (Some(path), _) => {
            let len = std::fs::metadata(path)
                .map_err(|err| Failure::usage(format!("cannot read {}: {err}", path.display())))?
                .len();
            Some(("--file", len))
        }
        (None, Some(size)) => Some(("--size", size as u64)),
        (None, None) => None,
    };
    if let Some((what, len)) = wanted {
        if len > WIRE_MAX_PAYLOAD {
            return Err(too_large(what, len, WIRE_MAX_PAYLOAD, "the wire's"));
        }
    }
    check_subject(&args.subject, false)?;
    let client = connect(&args.client)?;
    let max = client.max_payload();
    if let Some((what, len)) = wanted {
        if len > max {
            return Err(too_large(what, len, max, "the server's"));
        }
    }
    let payload: Bytes = if stdin_payload {
        // At most one byte over the limit is read: enough to refuse.
        let mut data = Vec::new();
        Read::take(io::stdin(), max.saturating_add(1))
            .read_to_end(&mut data)
            .map_err(|err| Failure::usage(format!("cannot read standard input: {err}")))?;
        if data.len() as u64 > max {
            return Err(Failure::usage(format!(
                "standard input is over the server's limit of {max} bytes; send less"
            )));
        }
        data.into()
    } else if let Some(path) = &args.file {
        // Read as standard input is: a file whose size says nothing
        // (`/dev/zero`, a pipe) is not read past the limit.
        let cannot =
            |err: io::Error| Failure::usage(format!("cannot read {}: {err}", path.display()));
        let mut data = Vec::new();
        Read::take(
            std::fs::File::open(path).map_err(cannot)?,
            max.saturating_add(1),
        )
        .read_to_end(&mut data)
        .map_err(cannot)?;
        if data.len() as u64 > max {
            // The file grew since it was measured.
            return Err(too_large("--file", data.len() as u64, max, "the server's"));
        }
        data.into()
    } else if let Some(size) = args.size {
        vec![b'x'; size].into()
    } else {
        Bytes::from(args.data.clone().unwrap_or_default())
    };
    let stop = stop_on_signals()?;
    let progress = publish_progress(args.count);
    let started = Instant::now();
    let mut published = 0u64;
    while published < args.count && !stop.load(Ordering::Relaxed) {
        client
            .publish(&args.subject, payload.clone())
            .map_err(|err| explain(err, Some(&args.client.server)))?;
        published += 1;
        if published % PROGRESS_STEP == 0 {
            progress.set_position(published);
        }
    }
    progress.finish_and_clear();
    confirm(&client, &args.client.server, Duration::from_secs(30))?;
    refused_by_broker(&client)?;
    let elapsed = started.elapsed();
    let mut output = Output::new();
    if published < args.count {
        out!(
            output,
            "interrupted: published {published} of {} messages of {} bytes in {:.3} s",
            args.count,
            payload.len(),
            elapsed.as_secs_f64()
        )?;
        return Err(Failure {
            message: format!("interrupted after {published} of {} messages", args.count),
            code: 130,
        });
    }
    if args.count != 1 {
        let rate = args.count as f64 / elapsed.as_secs_f64().max(1e-9);
        out!(
            output,
            "published {} messages of {} bytes in {:.3} s ({:.0} msg/s)",
            args.count,
            payload.len(),
            elapsed.as_secs_f64(),
            rate
        )
    } else {
        out!(
            output,
            "published 1 message to {}",
            excerpt(&args.subject, EXCERPT_CHARS)
        )
    }
}

/// Messages between two updates of `pub`'s progress bar.
const PROGRESS_STEP: u64 = 1024;

/// A progress bar for a long `pub` on a terminal; hidden otherwise.
fn publish_progress(total: u64) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if total < 100_000 || !io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} published {per_sec} {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}

/// How `sub` prints a message.
fn print_message(
    output: &mut Output,
    message: &efabus_broker::Message,
    args: &SubArgs,
) -> Result<(), Failure> {
    let text = std::str::from_utf8(&message.payload).ok();
    if args.raw {
        output.bytes(&message.payload)?;
        return out!(output);
    }
    if args.json {
        let mut value = serde_json::json!({
            "subject": &*message.subject,
            "reply": message.reply.as_deref(),
            "size": message.payload.len(),
        });
        match text {
            Some(text) => value["payload"] = text.into(),
            None => {
                use base64::Engine;
                value["payload_base64"] = base64::engine::general_purpose::STANDARD
                    .encode(&message.payload)
                    .into();
            }
        }
        return out!(output, "{value}");
    }
    let reply = message
        .reply
        .as_deref()
        .map_or(String::new(), |reply| format!(" (reply to {reply})"));
    match text {
        Some(text) => out!(output, "[{}]{reply} {text}", message.subject),
        None => out!(
            output,
            "[{}]{reply} <{} bytes, not UTF-8: see --raw or --json>",
            message.subject,
            message.payload.len()
        ),
    }
}

fn subscribe(args: SubArgs) -> Result<(), Failure> {
    check_subject(&args.pattern, true)?;
    let client = connect_with(&args.client, args.reconnect)?;
    let subscription = match &args.queue {
        Some(group) => client.queue_subscribe(&args.pattern, group),
        None => client.subscribe(&args.pattern),
    }
    .map_err(|err| explain(err, Some(&args.client.server)))?;
    confirm(&client, &args.client.server, Duration::from_secs(5))?;
    refused_by_broker(&client)?;
    // A status line, not a result: a closed stderr is no reason to stop.
    let _ = writeln!(
        io::stderr(),
        "subscribed to {}",
        excerpt(&args.pattern, EXCERPT_CHARS)
    );
    let stop = stop_on_signals()?;
    let mut output = Output::new();
    let mut received = 0u64;
    let stats = subscription.stats();
    // Messages dropped for this subscription count towards --count: they
    // will not come.
    let mut ended = None;
    while !stop.load(Ordering::Relaxed)
        && args
            .count
            .is_none_or(|count| received + stats.dropped() < count)
    {
        match subscription.recv_timeout(Duration::from_millis(100)) {
            Ok(message) => {
                received += 1;
                print_message(&mut output, &message, &args)?;
            }
            Err(RecvError::Timeout | RecvError::Empty) => {}
            Err(RecvError::Closed) => {
                let why = client
                    .closed_because()
                    .map_or(String::new(), |reason| format!(" ({reason})"));
                ended = Some(Failure::runtime(format!(
                    "the connection to the broker was lost{why} after {received} messages; \
                     run `efabus sub --reconnect` to ride out broker restarts"
                )));
                break;
            }
        }
    }
    let missed = stats.dropped();
    if missed > 0 {
        // A status line: a closed stderr is no reason to fail.
        let _ = writeln!(
            io::stderr(),
            "missed {missed} messages: dropped as a slow consumer ({} by the broker, \
             {} by this client's queue); read faster, or raise the broker's \
             limits.max_pending_bytes",
            stats.dropped_by_broker(),
            missed - stats.dropped_by_broker()
        );
    }
    ended.map_or(Ok(()), Err)
}

fn reply(args: ReplyArgs) -> Result<(), Failure> {
    check_subject(&args.subject, true)?;
    let client = connect(&args.client)?;
    let server = &args.client.server;
    // Requests are answered on the client's loop as they arrive
    // (`Client::respond`): no hand-over to this thread per request.
    let answered = Arc::new(AtomicU64::new(0));
    let without_reply = Arc::new(AtomicU64::new(0));
    let handler = {
        let (answered, without_reply) = (answered.clone(), without_reply.clone());
        let answer = Bytes::from(args.data.clone());
        let limit = args.count;
        move |request: &Message| {
            if request.reply.is_none() {
                // A plain publish on the subject: nobody to answer.
                without_reply.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            // Past --count, requests go unanswered while this exits.
            let claimed = answered.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                limit.is_none_or(|max| n < max).then_some(n + 1)
            });
            claimed.is_ok().then(|| answer.clone())
        }
    };
    let responder = match &args.queue {
        Some(group) => client.queue_respond(&args.subject, group, handler),
        None => client.respond(&args.subject, handler),
    }
    .map_err(|err| explain(err, Some(server)))?;
    confirm(&client, server, Duration::from_secs(5))?;
    refused_by_broker(&client)?;
    let _ = writeln!(
        io::stderr(),
        "answering requests on {}",
        excerpt(&args.subject, EXCERPT_CHARS)
    );
    let stop = stop_on_signals()?;
    let done = || {
        args.count
            .is_some_and(|count| answered.load(Ordering::Relaxed) >= count)
    };
    while !stop.load(Ordering::Relaxed) && !done() {
        if matches!(
            client.state(),
            ConnectionState::Closed
                | ConnectionState::Refused { .. }
                | ConnectionState::Unreachable { .. }
        ) {
            return Err(Failure::runtime(format!(
                "the connection to the broker was lost after {} answers",
                answered.load(Ordering::Relaxed)
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(responder);
    // The answers went out before the flush asked for.
    confirm(&client, server, Duration::from_secs(5))?;
    let mut said = format!("answered {} requests", answered.load(Ordering::Relaxed));
    let without_reply = without_reply.load(Ordering::Relaxed);
    if without_reply > 0 {
        said.push_str(&format!("; {without_reply} messages had no reply subject"));
    }
    out!(Output::new(), "{said}")
}

fn request(args: ReqArgs) -> Result<(), Failure> {
    check_subject(&args.subject, false)?;
    let client = connect(&args.client)?;
    let reply = client
        .request(
            &args.subject,
            Bytes::from(args.data.clone()),
            Duration::from_millis(args.timeout),
        )
        .map_err(|err| {
            // A request the broker refused waits for no reply: say why.
            match refused_by_broker(&client) {
                Err(refused) => refused,
                Ok(()) => explain(err, Some(&args.client.server)),
            }
        })?;
    out!(Output::new(), "{}", String::from_utf8_lossy(&reply.payload))
}

/// Waits up to `timeout` for the broker to confirm what the client asked
/// of it so far. A data path that carries nothing back (a provider that
/// refused the connection underneath) is given up within the connect
/// timeout, and with it the confirmation: a client that reconnects is
/// asked again once connected anew without that path; one that does not
/// has ended, and the reason is the command's failure.
fn confirm(client: &Client, server: &str, timeout: Duration) -> Result<(), Failure> {
    let deadline = Instant::now() + 2 * timeout;
    loop {
        let reconnects = client.reconnects();
        let result = client.flush(timeout);
        let lost = matches!(result, Err(Error::NotConnected(_) | Error::Timeout(_)));
        if !lost || !connected_anew(client, reconnects, deadline) {
            return result.map_err(|err| match (client.closed_because(), err) {
                (Some(reason), _) => Failure::runtime(format!(
                    "lost the connection to {}: {}",
                    excerpt(server, EXCERPT_CHARS),
                    excerpt(&reason, 4 * EXCERPT_CHARS)
                )),
                // Not a request's timeout: `explain`'s hint is for `req`.
                (None, Error::Timeout(waited)) => Failure::runtime(format!(
                    "{} did not confirm within {waited:?}; it may be holding publishers back \
                     for a slow subscriber (slow_consumer.policy = \"block\") or be stuck: \
                     see `efabus stats` and `efabus conns`",
                    excerpt(server, EXCERPT_CHARS)
                )),
                (None, err) => explain(err, Some(server)),
            });
        }
    }
}

/// Whether the client, connected `reconnects` times again when its flush
/// went, is on a newer connection before `deadline`. One still on the
/// same connection gets a moment to say that it lost it (a broker merely
/// slow to answer does not get a second wait).
fn connected_anew(client: &Client, reconnects: u64, deadline: Instant) -> bool {
    let moment = Instant::now() + Duration::from_millis(200);
    loop {
        let now = Instant::now();
        match client.state() {
            ConnectionState::Connected { .. } if client.reconnects() > reconnects => {
                return now < deadline
            }
            ConnectionState::Connected { .. } if now < moment.min(deadline) => {}
            ConnectionState::Connecting if now < deadline => {}
            _ => return false,
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What the broker refused without closing (a permission denied, a payload
/// over its limit) is the command's failure, in one line.
fn refused_by_broker(client: &Client) -> Result<(), Failure> {
    let errors = client.take_errors();
    let Some((code, first)) = errors.first() else {
        return Ok(());
    };
    let more = match errors.len() {
        1 => String::new(),
        n => format!(" (and {} more)", n - 1),
    };
    let hint = match code {
        ErrorCode::PermissionDenied => "; the user's permissions in [[auth.users]] decide this",
        ErrorCode::PayloadTooLarge => "; send less, or raise limits.max_payload on the broker",
        ErrorCode::InvalidSubject => "; fix the subject (tokens separated by dots, none empty)",
        _ => "",
    };
    // The broker's text may carry a subject of up to its limit whole.
    Err(Failure::runtime(format!(
        "the broker refused: {}{more}{hint}",
        excerpt(first, 4 * EXCERPT_CHARS)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A publish held back by the broker's `block` policy says where to
    /// look; a request's timeout keeps the hint about subscribers.
    #[test]
    fn errors_are_explained_with_their_own_next_step() {
        let blocked = explain(Error::Blocked(Duration::from_secs(2)), None);
        assert_eq!(blocked.code, 1);
        assert!(
            blocked.message.contains("slow_consumer.policy") && blocked.message.contains("conns"),
            "{}",
            blocked.message
        );
        let timeout = explain(Error::Timeout(Duration::from_secs(5)), None);
        assert!(timeout.message.contains("--timeout"), "{}", timeout.message);
        assert!(!timeout.message.contains('\n'));
    }
}
