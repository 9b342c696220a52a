//! Request/reply: a responder answers on each request's reply subject;
//! requesters wait for the first answer, with a timeout, both in-process
//! and through a [`Client`] over TCP.
//!
//! Run with `cargo run --example request_reply`.

use std::time::Duration;

use efabus::{Broker, Bytes, Client, Config, Error};

const WAIT: Duration = Duration::from_secs(2);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = Config::from_toml_str(
        r#"
        name = "request-reply-example"
        listen = ["tcp/127.0.0.1:0"]
        "#,
        "request_reply example",
    )?;
    let broker = Broker::start(config)?;

    // Subscribe before the responder thread starts, so no request is missed.
    let requests = broker.subscribe("math.double")?;

    std::thread::scope(|scope| -> Result<(), Box<dyn std::error::Error>> {
        let broker = &broker;
        // The responder: iterating a subscription ends when the broker
        // shuts down.
        scope.spawn(move || {
            for request in requests {
                let Some(reply) = request.reply.as_deref() else {
                    continue;
                };
                let answer = std::str::from_utf8(&request.payload)
                    .ok()
                    .and_then(|text| text.parse::<i64>().ok())
                    .map(|n| (n * 2).to_string())
                    .unwrap_or_else(|| "not a number".to_string());
                if let Err(err) = broker.publish(reply, Bytes::from(answer)) {
                    eprintln!("cannot reply: {err}");
                }
            }
        });

        // In-process request.
        let answer = broker.request("math.double", Bytes::from_static(b"21"), WAIT)?;
        println!(
            "embedded: double(21) = {}",
            String::from_utf8_lossy(&answer.payload)
        );

        // Nobody subscribed: the embedded broker knows at once.
        match broker.request("math.triple", Bytes::from_static(b"1"), WAIT) {
            Err(Error::NoResponders(subject)) => println!("embedded: no responder for {subject}"),
            other => return Err(format!("expected NoResponders, got {other:?}").into()),
        }

        // The same through a client over TCP.
        let endpoint = broker.endpoint("tcp").ok_or("no TCP listener")?;
        let client = Client::connect(&endpoint)?;
        let answer = client.request("math.double", Bytes::from_static(b"50"), WAIT)?;
        println!(
            "client:   double(50) = {}",
            String::from_utf8_lossy(&answer.payload)
        );

        // A client cannot tell "nobody listens" from "slow": it times out.
        let short = Duration::from_millis(200);
        match client.request("math.triple", Bytes::from_static(b"1"), short) {
            Err(Error::Timeout(after)) => println!("client:   no reply within {after:?}"),
            other => return Err(format!("expected a timeout, got {other:?}").into()),
        }

        client.shutdown();
        // Ends the responder's subscription, and so its thread.
        broker.shutdown();
        Ok(())
    })
}
