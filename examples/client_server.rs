//! A broker embedded in this process listening on TCP, and a [`Client`]
//! talking to it over a real loopback socket.
//!
//! Run with `cargo run --example client_server`.

use std::time::Duration;

use efabus::{Broker, Bytes, Client, Config};

const WAIT: Duration = Duration::from_secs(2);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Port 0: the kernel picks a free port; `endpoint("tcp")` tells which.
    let config = Config::from_toml_str(
        r#"
        name = "client-server-example"
        listen = ["tcp/127.0.0.1:0"]
        "#,
        "client_server example",
    )?;
    let broker = Broker::start(config)?;
    let endpoint = broker
        .endpoint("tcp")
        .ok_or("the broker has no TCP listener")?;
    println!("broker listening on {endpoint}");

    let client = Client::connect(&endpoint)?;
    println!("client state: {:?}", client.state());

    // Broker to client: the client subscribes, and `flush` waits until the
    // broker has processed that subscription before anything is published.
    let greetings = client.subscribe("greetings.*")?;
    client.flush(WAIT)?;
    broker.publish(
        "greetings.client",
        Bytes::from_static(b"hello from the broker"),
    )?;
    let message = greetings.recv_timeout(WAIT)?;
    println!(
        "client got   {} = {}",
        message.subject,
        String::from_utf8_lossy(&message.payload)
    );

    // Client to broker: an in-process subscription sees what the client sends.
    let telemetry = broker.subscribe("telemetry.>")?;
    client.publish("telemetry.node7.temp", Bytes::from_static(b"61C"))?;
    let message = telemetry.recv_timeout(WAIT)?;
    println!(
        "broker got   {} = {}",
        message.subject,
        String::from_utf8_lossy(&message.payload)
    );

    let stats = broker.stats().snapshot();
    println!("broker stats: {stats:?}");

    client.shutdown();
    broker.shutdown();
    Ok(())
}
