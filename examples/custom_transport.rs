//! The transport plugin point: an application-defined transport registered
//! under its own scheme and selected by endpoint strings like any built-in.
//!
//! `loop` here wraps the built-in in-process transport and counts the
//! frames and bytes it carries. A real plugin (shared memory, another
//! fabric) implements the same two traits: [`Transport`], a factory named
//! by its scheme, and [`Endpoint`], a peer-addressed, non-blocking message
//! endpoint.
//!
//! Run with `cargo run --example custom_transport`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use efabus::core::caps::FabricInfo;
use efabus::core::transport::{
    Endpoint, EndpointConfig, Event, OutFrame, PeerId, Readiness, SendError, Transport,
    TransportError,
};
use efabus::transports::mem::MemTransport;
use efabus::transports::registry::Registry;
use efabus::{Broker, Bytes, Client, ClientOptions, Config};

const WAIT: Duration = Duration::from_secs(2);

/// Frames and bytes sent through every `loop` endpoint.
#[derive(Debug, Default)]
struct Counters {
    frames: AtomicU64,
    bytes: AtomicU64,
}

/// The factory: names the scheme and opens endpoints.
struct LoopTransport {
    inner: MemTransport,
    counters: Arc<Counters>,
}

impl Transport for LoopTransport {
    fn scheme(&self) -> &str {
        "loop"
    }

    fn infos(&self) -> Result<Vec<FabricInfo>, TransportError> {
        // Same capabilities as the transport underneath.
        self.inner.infos()
    }

    fn open(&self, config: &EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        // `config.bind` is what follows `loop/` in the endpoint string.
        Ok(Box::new(LoopEndpoint {
            inner: self.inner.open(config)?,
            counters: self.counters.clone(),
        }))
    }
}

/// One endpoint: everything is delegated, sends are counted.
struct LoopEndpoint {
    inner: Box<dyn Endpoint>,
    counters: Arc<Counters>,
}

impl Endpoint for LoopEndpoint {
    fn scheme(&self) -> &str {
        "loop"
    }

    fn local_addr(&self) -> Vec<u8> {
        self.inner.local_addr()
    }

    fn max_frame(&self) -> usize {
        self.inner.max_frame()
    }

    fn connect(&mut self, addr: &str) -> Result<PeerId, TransportError> {
        self.inner.connect(addr)
    }

    fn send(&mut self, peer: PeerId, frame: OutFrame) -> Result<(), SendError> {
        let len = frame.len() as u64;
        self.inner.send(peer, frame)?;
        // Counted only once accepted: a `WouldBlock` frame comes back and
        // is sent again later.
        self.counters.frames.fetch_add(1, Ordering::Relaxed);
        self.counters.bytes.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), TransportError> {
        self.inner.poll(events)
    }

    fn close(&mut self, peer: PeerId) {
        self.inner.close(peer)
    }

    fn readiness(&self) -> Readiness {
        self.inner.readiness()
    }

    fn queued_bytes(&self, peer: PeerId) -> usize {
        self.inner.queued_bytes(peer)
    }

    // Flow control: the broker pauses reading from publishers while a
    // subscriber is slow under the `block` policy.
    fn set_read_paused(&mut self, peer: PeerId, paused: bool) {
        self.inner.set_read_paused(peer, paused)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let counters = Arc::new(Counters::default());
    let mut registry = Registry::with_builtins();
    registry.register(Arc::new(LoopTransport {
        inner: MemTransport::new(),
        counters: counters.clone(),
    }));
    println!("registered schemes: {:?}", registry.schemes());

    // The config names the new scheme like any other.
    let config = Config::from_toml_str(
        r#"
        name = "custom-transport-example"
        listen = ["loop/custom-example"]
        "#,
        "custom_transport example",
    )?;
    let broker = Broker::start_with_registry(config, registry.clone())?;
    let endpoint = broker.endpoint("loop").ok_or("no loop listener")?;
    println!("broker listening on {endpoint}");

    let client = Client::connect_with(&endpoint, ClientOptions::default(), registry)?;
    let orders = client.subscribe("orders.>")?;
    client.flush(WAIT)?;

    for n in 1..=3 {
        broker.publish("orders.new", Bytes::from(format!("order {n}")))?;
    }
    for _ in 1..=3 {
        let message = orders.recv_timeout(WAIT)?;
        println!(
            "client got {} = {}",
            message.subject,
            String::from_utf8_lossy(&message.payload)
        );
    }

    client.shutdown();
    broker.shutdown();
    println!(
        "the loop transport carried {} frames, {} bytes",
        counters.frames.load(Ordering::Relaxed),
        counters.bytes.load(Ordering::Relaxed)
    );
    Ok(())
}
