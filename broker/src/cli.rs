//! The `efabus` command line: `serve`, `pub`, `sub`, `req`, `caps`, `bench`.
//!
//! Errors are printed as one line with the cause and what to do; usage and
//! configuration errors exit with code 2, other failures with 1.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use efabus_core::transport::TransportError;
use efabus_transports::registry::RegistryError;

use crate::config::{Config, ConfigError};
use crate::error::Error;
use crate::{Broker, Client, ClientOptions, RecvError};

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
    /// Show transport capabilities in fi_info layout, and what would be negotiated.
    Caps(crate::caps_cmd::CapsArgs),
    /// Measure throughput or request/reply latency.
    Bench(crate::bench::BenchArgs),
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Config file (TOML).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Endpoint to listen on, replacing the config's list (repeatable).
    #[arg(long = "listen", short = 'l')]
    pub listen: Vec<String>,
    /// Node name.
    #[arg(long)]
    pub name: Option<String>,
    /// Log level or filter (RUST_LOG overrides).
    #[arg(long)]
    pub log_level: Option<String>,
    /// Shared secret clients must present.
    #[arg(long, env = "EFABUS_SECRET", hide_env_values = true)]
    pub secret: Option<String>,
}

#[derive(Debug, Args)]
pub struct ClientArgs {
    /// Broker endpoint.
    #[arg(long, short, default_value = DEFAULT_SERVER, env = "EFABUS_SERVER")]
    pub server: String,
    /// Shared secret, if the broker requires one.
    #[arg(long, env = "EFABUS_SECRET", hide_env_values = true)]
    pub secret: Option<String>,
    /// Config whose fabric endpoints (`listen` entries efa-rdm/efa-dgram,
    /// the [fabric] table, the preference list) the client offers the broker.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct PubArgs {
    pub subject: String,
    /// Payload text (default: empty, or --size bytes).
    pub data: Option<String>,
    /// Read the payload from a file.
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
    /// Exit after this many messages.
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

/// A failure of a command: the message to print and the exit code.
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    pub code: i32,
}

impl Failure {
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
        Failure::usage(format!(
            "{err}; fix the file or run without --config for the built-in default"
        ))
    }
}

/// Turn a library error into one line that says what to do.
fn explain(err: Error, server: Option<&str>) -> Failure {
    let hint = match &err {
        Error::Config(_) => return Failure::usage(err.to_string()),
        Error::Endpoint { source, .. } => match source {
            RegistryError::Transport {
                source: TransportError::Bind { .. },
                ..
            } => {
                "is another broker running there? pick another address with --listen".to_string()
            }
            RegistryError::Transport {
                source: TransportError::Unavailable { .. },
                ..
            } => {
                "remove that listener from the config or install what it needs (see README, Running on EFA)".to_string()
            }
            _ => "check the endpoint string (mem/NAME, tcp/HOST:PORT, efa-rdm, efa-dgram)".to_string(),
        },
        Error::NotConnected(_) => format!(
            "is a broker running at {}? start one with `efabus serve`",
            server.unwrap_or(DEFAULT_SERVER)
        ),
        Error::Refused { .. } => "check --secret (or EFABUS_SECRET) against the broker's auth.secret".to_string(),
        Error::Subject { .. } => "subjects are dot-separated tokens; wildcards * and > only in patterns".to_string(),
        Error::Timeout(_) => "is anything subscribed to that subject? raise --timeout if it is slow".to_string(),
        Error::NoResponders(_) => "start a responder that subscribes to that subject".to_string(),
        _ => String::new(),
    };
    let code = if matches!(err, Error::Subject { .. }) {
        2
    } else {
        1
    };
    let message = if hint.is_empty() {
        err.to_string()
    } else {
        format!("{err}; {hint}")
    };
    Failure { message, code }
}

/// Run the parsed command line.
pub fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Serve(args) => serve(args),
        Command::Pub(args) => publish(args),
        Command::Sub(args) => subscribe(args),
        Command::Req(args) => request(args),
        Command::Caps(args) => crate::caps_cmd::run(args),
        Command::Bench(args) => crate::bench::run(args),
    }
}

fn init_logging(level: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// A flag set by SIGINT or SIGTERM.
fn stop_on_signals() -> Result<Arc<AtomicBool>, Failure> {
    let cannot =
        |err: std::io::Error| Failure::runtime(format!("cannot install signal handlers: {err}"));
    efabus_transports::fabric::reset_inherited_termination_handlers().map_err(cannot)?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone()).map_err(cannot)?;
    }
    Ok(stop)
}

fn serve(args: ServeArgs) -> Result<(), Failure> {
    let mut config = match &args.config {
        Some(path) => Config::from_file(path)?,
        None => Config::from_env_or_default()?,
    };
    if !args.listen.is_empty() {
        config.listen = args.listen.clone();
    }
    if let Some(name) = args.name {
        config.name = name;
    }
    if let Some(level) = args.log_level {
        config.log_level = level;
    }
    if args.secret.is_some() {
        config.auth.secret = args.secret;
    }
    config.validate("(command line)")?;
    init_logging(&config.log_level);

    let stop = stop_on_signals()?;
    let broker = Broker::start(config).map_err(|err| explain(err, None))?;
    for (scheme, address) in broker.listening() {
        println!("listening on {scheme}/{address}");
    }
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
    }
    broker.shutdown();
    let stats: Vec<String> = broker
        .stats()
        .snapshot()
        .into_iter()
        .filter(|(name, _)| *name != "connections" && *name != "queued_bytes")
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    println!("stopped: {}", stats.join(" "));
    Ok(())
}

fn connect(args: &ClientArgs) -> Result<Client, Failure> {
    init_logging("warn");
    let base = match &args.config {
        Some(path) => ClientOptions::from_config(&Config::from_file(path)?),
        None => ClientOptions::default(),
    };
    let options = ClientOptions {
        name: format!("efabus-cli-{}", std::process::id()),
        credentials: args.secret.clone().or(base.credentials.clone()),
        reconnect: false,
        ..base
    };
    Client::connect_with(
        &args.server,
        options,
        efabus_transports::registry::Registry::with_builtins(),
    )
    .map_err(|err| explain(err, Some(&args.server)))
}

fn publish(args: PubArgs) -> Result<(), Failure> {
    let payload: Bytes = if let Some(path) = &args.file {
        std::fs::read(path)
            .map_err(|err| Failure::usage(format!("cannot read {}: {err}", path.display())))?
            .into()
    } else if let Some(size) = args.size {
        vec![b'x'; size].into()
    } else {
        Bytes::from(args.data.clone().unwrap_or_default())
    };
    let client = connect(&args.client)?;
    let started = Instant::now();
    for _ in 0..args.count {
        client
            .publish(&args.subject, payload.clone())
            .map_err(|err| explain(err, Some(&args.client.server)))?;
    }
    client
        .flush(Duration::from_secs(30))
        .map_err(|err| explain(err, Some(&args.client.server)))?;
    let elapsed = started.elapsed();
    if args.count > 1 {
        let rate = args.count as f64 / elapsed.as_secs_f64().max(1e-9);
        println!(
            "published {} messages of {} bytes in {:.3} s ({:.0} msg/s)",
            args.count,
            payload.len(),
            elapsed.as_secs_f64(),
            rate
        );
    } else {
        println!("published 1 message to {}", args.subject);
    }
    Ok(())
}

fn subscribe(args: SubArgs) -> Result<(), Failure> {
    let client = connect(&args.client)?;
    let subscription = match &args.queue {
        Some(group) => client.queue_subscribe(&args.pattern, group),
        None => client.subscribe(&args.pattern),
    }
    .map_err(|err| explain(err, Some(&args.client.server)))?;
    client
        .flush(Duration::from_secs(5))
        .map_err(|err| explain(err, Some(&args.client.server)))?;
    eprintln!("subscribed to {}", args.pattern);
    let stop = stop_on_signals()?;
    let mut received = 0u64;
    while !stop.load(Ordering::Relaxed) && args.count.is_none_or(|count| received < count) {
        match subscription.recv_timeout(Duration::from_millis(100)) {
            Ok(message) => {
                received += 1;
                println!(
                    "[{}] {}",
                    message.subject,
                    String::from_utf8_lossy(&message.payload)
                );
            }
            Err(RecvError::Timeout | RecvError::Empty) => {}
            Err(RecvError::Closed) => {
                return Err(Failure::runtime("subscription closed by the broker"))
            }
        }
    }
    Ok(())
}

fn request(args: ReqArgs) -> Result<(), Failure> {
    let client = connect(&args.client)?;
    let reply = client
        .request(
            &args.subject,
            Bytes::from(args.data.clone()),
            Duration::from_millis(args.timeout),
        )
        .map_err(|err| explain(err, Some(&args.client.server)))?;
    println!("{}", String::from_utf8_lossy(&reply.payload));
    Ok(())
}
