//! An embedded broker: wildcard subscriptions, a queue group, publish and
//! receive, all inside one process.
//!
//! Run with `cargo run --example embedded_pubsub`.

use std::time::Duration;

use efabus::{Broker, Bytes, Config, RecvError};

const WAIT: Duration = Duration::from_secs(1);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Only the in-process transport: nothing is opened on the network.
    let config = Config::from_toml_str(
        r#"
        name = "embedded-example"
        listen = ["mem/embedded-example"]
        "#,
        "embedded_pubsub example",
    )?;
    let broker = Broker::start(config)?;

    // `>` matches one or more trailing tokens, `*` exactly one token.
    let everything = broker.subscribe("metrics.>")?;
    let cpu_only = broker.subscribe("metrics.*.cpu")?;

    // Three members of one queue group: each job goes to exactly one of them.
    let workers = (0..3)
        .map(|_| broker.queue_subscribe("jobs.resize", "resizers"))
        .collect::<Result<Vec<_>, _>>()?;

    broker.publish("metrics.host1.cpu", Bytes::from_static(b"0.93"))?;
    broker.publish("metrics.host1.mem.free", Bytes::from_static(b"512M"))?;
    for n in 0..6 {
        broker.publish("jobs.resize", Bytes::from(format!("image-{n}.png")))?;
    }

    // In-process subscribers receive on the publisher's thread, so the
    // messages are already queued here; the timeout only bounds the wait.
    for _ in 0..2 {
        let message = everything.recv_timeout(WAIT)?;
        println!(
            "metrics.>      got {} = {}",
            message.subject,
            String::from_utf8_lossy(&message.payload)
        );
    }
    let message = cpu_only.recv_timeout(WAIT)?;
    println!(
        "metrics.*.cpu  got {} = {}",
        message.subject,
        String::from_utf8_lossy(&message.payload)
    );
    // The memory metric has three tokens after `metrics`, so `*.cpu` skips it.
    assert_eq!(cpu_only.try_recv(), Err(RecvError::Empty));

    let mut total = 0;
    for (n, worker) in workers.iter().enumerate() {
        let jobs: Vec<String> = std::iter::from_fn(|| worker.try_recv().ok())
            .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
            .collect();
        println!("worker {n} took {jobs:?}");
        total += jobs.len();
    }
    assert_eq!(total, 6, "every job went to exactly one worker");

    broker.shutdown();
    Ok(())
}
