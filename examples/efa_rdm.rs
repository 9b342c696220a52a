//! A broker and a client whose data path is a libfabric RDM endpoint
//! (`efa-rdm`), with the provider named on the command line.
//!
//! ```text
//! cargo run --example efa_rdm               # efa, on an EFA host
//! cargo run --example efa_rdm -- "tcp;ofi_rxm"   # any machine with libfabric
//! ```
//!
//! The broker listens on TCP (where clients say hello and negotiate) and on
//! `efa-rdm`; the client offers `efa-rdm` too, so after the handshake its
//! traffic moves to the fabric. The example checks that it did, then
//! publishes, subscribes and makes one request. Exit status: 0 on success,
//! 2 when the provider cannot be used here (the reason is printed), 1 on
//! any other failure.

use std::process::ExitCode;
use std::time::Duration;

use efabus::transports::registry::Registry;
use efabus::{Broker, Bytes, Client, ClientOptions, Config};

const WAIT: Duration = Duration::from_secs(5);

fn main() -> ExitCode {
    // First, while this is the only thread: libfabric's own buffer counts.
    efabus::transports::fabric::apply_provider_env_defaults();
    let provider = std::env::args().nth(1).unwrap_or_else(|| "efa".to_string());
    match run(&provider) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Unavailable(reason)) => {
            println!("efa_rdm: provider {provider:?} cannot be used here: {reason}");
            ExitCode::from(2)
        }
        Err(Failure::Other(err)) => {
            eprintln!("efa_rdm: {err}");
            ExitCode::FAILURE
        }
    }
}

enum Failure {
    /// The fabric endpoint did not open: the transport's reason.
    Unavailable(String),
    Other(Box<dyn std::error::Error + Send + Sync>),
}

impl<E: Into<Box<dyn std::error::Error + Send + Sync>>> From<E> for Failure {
    fn from(err: E) -> Failure {
        Failure::Other(err.into())
    }
}

fn run(provider: &str) -> Result<(), Failure> {
    // EFA picks its device itself; the socket-based providers (`tcp;ofi_rxm`,
    // `udp;ofi_rxd`, `sockets`) are pinned to loopback so the example needs
    // no network.
    let node = if provider.starts_with("efa") {
        ""
    } else {
        "127.0.0.1"
    };
    let config = Config::from_toml_str(
        &format!(
            r#"
            name = "efa-rdm-example"
            log_level = "warn"
            listen = ["tcp/127.0.0.1:0", "efa-rdm"]
            [fabric]
            provider = "{provider}"
            node = "{node}"
            "#
        ),
        "efa_rdm example",
    )?;
    // A broker whose efa-rdm listener cannot open serves on TCP alone.
    let broker = Broker::start(config)?;
    let endpoint = broker
        .endpoint("tcp")
        .ok_or("the broker has no TCP listener")?;
    let fabric_listener = broker.endpoint("efa-rdm").is_some();
    if fabric_listener {
        println!("broker listening on {endpoint} and efa-rdm via {provider}");
    }

    // The client offers what the broker's config lists (`efa-rdm` here) with
    // the same [fabric] settings; negotiation happens over TCP.
    let options = ClientOptions {
        name: "efa-rdm-example-client".to_string(),
        connect_timeout: WAIT,
        ..ClientOptions::from_config(broker.config())
    };
    let client = Client::connect_with(&endpoint, options, Registry::with_builtins())?;
    let link = client.link();
    if !link.reliable.starts_with("efa-rdm via ") {
        // The client opened its endpoint with the same settings: its
        // reason is the transport's.
        let unavailable = link
            .reasons
            .iter()
            .find_map(|reason| reason.strip_prefix("efa-rdm: "))
            .filter(|reason| reason.contains(" is unavailable: "));
        if let (false, Some(reason)) = (fabric_listener, unavailable) {
            return Err(Failure::Unavailable(reason.to_string()));
        }
        // Both sides opened the endpoint, yet negotiation kept TCP: say why.
        return Err(format!(
            "negotiation kept the client on {}: {}",
            link.reliable,
            link.reasons.join("; ")
        )
        .into());
    }
    println!("client data path: {}", link.reliable);

    // Broker to client over the fabric. `flush` returns once the broker has
    // the subscription, so the publish cannot overtake it.
    let greetings = client.subscribe("greetings.*")?;
    client.flush(WAIT)?;
    broker.publish("greetings.client", Bytes::from_static(b"hello over RDM"))?;
    let message = greetings.recv_timeout(WAIT)?;
    println!(
        "client got   {} = {}",
        message.subject,
        String::from_utf8_lossy(&message.payload)
    );

    // Client to broker.
    let telemetry = broker.subscribe("telemetry.>")?;
    client.publish("telemetry.node7.temp", Bytes::from_static(b"61C"))?;
    let message = telemetry.recv_timeout(WAIT)?;
    println!(
        "broker got   {} = {}",
        message.subject,
        String::from_utf8_lossy(&message.payload)
    );

    // One request from the client, answered by an in-process responder.
    let requests = broker.subscribe("svc.upper")?;
    let reply = std::thread::scope(|scope| {
        let responder = scope.spawn(|| -> Result<(), Failure> {
            let request = requests.recv_timeout(WAIT)?;
            let inbox = request.reply.ok_or("a request without a reply subject")?;
            let upper = request.payload.to_ascii_uppercase();
            broker.publish(&inbox, Bytes::from(upper))?;
            Ok(())
        });
        let reply = client.request("svc.upper", Bytes::from_static(b"shout this"), WAIT);
        let answered = responder.join().map_err(|_| "the responder panicked")?;
        answered.and(Ok(reply?))
    })?;
    println!(
        "request      svc.upper = {}",
        String::from_utf8_lossy(&reply.payload)
    );

    // The counters show the messages crossed the fabric, not TCP.
    let link = client.link();
    println!(
        "fabric frames in/out at the client: {}/{}",
        link.fabric_frames_in, link.fabric_frames_out
    );
    if link.fabric_frames_in < 2 || link.fabric_frames_out < 2 {
        return Err("the messages did not cross the fabric endpoint".into());
    }

    client.shutdown();
    broker.shutdown();
    Ok(())
}
