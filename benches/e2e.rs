//! End-to-end benchmarks: publish on one handle, receive on a subscription
//! of another, through a broker, for each way of reaching it:
//!
//! - `embedded`: the in-process API (`Broker::publish`, a local subscription);
//! - `mem`: two clients over the in-process `mem` transport;
//! - `tcp`: two clients over TCP loopback;
//! - `fabric`: two clients whose traffic the handshake moved to `efa-rdm`,
//!   with the libfabric provider named by `EFABUS_BENCH_PROVIDER` (default
//!   `tcp;ofi_rxm`, which runs on loopback anywhere libfabric is installed).
//!   Skipped with a message when the fabric endpoint cannot open or the
//!   handshake does not choose it.
//!
//! Cases per path: `batch_16B` publishes 10,000 messages of 16 B and then
//! receives them (throughput in messages), `one_16B` one message there and
//! back to the subscriber (a one-way delivery latency), and for tcp and
//! fabric `batch_1MiB` 16 messages of 1 MiB (throughput in bytes).
//! Samples are few and short so the whole file runs in about a minute.
//! Run as a test (`cargo test --all-targets`), `batch_16B` sends 100
//! messages instead, enough to prove each path works.

use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use efabus::broker::config::Fabric;
use efabus::transports::registry::Registry;
use efabus::{Broker, Client, ClientOptions, Config, PubSub, SlowConsumerPolicy, Subscription};

mod support;

const SMALL: usize = 16;
const SMALL_BATCH: u64 = 10_000;
/// `SMALL_BATCH` in a test run.
const SMALL_BATCH_TEST: u64 = 100;
const LARGE: usize = 1 << 20;
const LARGE_BATCH: u64 = 16;
const RECV_TIMEOUT: Duration = Duration::from_secs(30);

/// How the publisher and subscriber reach the broker.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Embedded,
    Mem,
    Tcp,
    Fabric,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Embedded => "embedded",
            Path::Mem => "mem",
            Path::Tcp => "tcp",
            Path::Fabric => "fabric",
        }
    }
}

/// A broker, a publishing handle and a subscription on the bench subject.
struct Rig {
    // Field order is drop order: clients leave before the broker stops.
    subscription: Subscription,
    publisher: Option<Client>,
    _subscriber: Option<Client>,
    broker: Broker,
    subject: String,
}

impl Rig {
    fn publisher(&self) -> &dyn PubSub {
        match &self.publisher {
            Some(client) => client,
            None => &self.broker,
        }
    }

    /// Publish `count` copies of `payload`, then receive them all.
    fn round(&self, payload: &Bytes, count: u64) {
        let publisher = self.publisher();
        for _ in 0..count {
            if let Err(err) = publisher.publish(&self.subject, payload.clone()) {
                panic!("publish failed: {err}");
            }
        }
        for _ in 0..count {
            if let Err(err) = self.subscription.recv_timeout(RECV_TIMEOUT) {
                panic!("a published message did not arrive: {err}");
            }
        }
    }
}

fn fabric_table() -> Fabric {
    let provider =
        std::env::var("EFABUS_BENCH_PROVIDER").unwrap_or_else(|_| "tcp;ofi_rxm".to_string());
    Fabric {
        provider,
        node: "127.0.0.1".to_string(),
        ..Fabric::default()
    }
}

fn broker_config(path: Path) -> Config {
    let listen = match path {
        Path::Embedded => Vec::new(),
        Path::Mem => vec![format!("mem/e2e-bench-{}", std::process::id())],
        Path::Tcp => vec!["tcp/127.0.0.1:0".to_string()],
        Path::Fabric => vec!["tcp/127.0.0.1:0".to_string(), "efa-rdm".to_string()],
    };
    let mut config = Config {
        log_level: "warn".to_string(),
        listen,
        ..Config::default()
    };
    if path == Path::Fabric {
        config.fabric = fabric_table();
    }
    config.limits.subscription_queue = 1 << 20;
    config.limits.max_pending_bytes = 64 << 20;
    config.limits.max_payload = 2 << 20;
    config.slow_consumer.policy = SlowConsumerPolicy::Block;
    config.slow_consumer.block_timeout_ms = 30_000;
    config
}

fn connect(endpoint: &str, path: Path, name: &str) -> Result<Client, String> {
    let mut options = ClientOptions {
        name: name.to_string(),
        subscription_queue: 1 << 20,
        slow_consumer: SlowConsumerPolicy::Block,
        block_timeout: Duration::from_secs(30),
        max_pending_bytes: 64 << 20,
        reconnect: false,
        ..ClientOptions::default()
    };
    if path == Path::Fabric {
        options.data_paths = vec!["efa-rdm".to_string()];
        options.fabric = fabric_table();
    }
    let client = Client::connect_with(endpoint, options, Registry::with_builtins())
        .map_err(|err| format!("cannot connect to {endpoint}: {err}"))?;
    if path == Path::Fabric {
        let link = client.link().reliable;
        if !link.starts_with("efa-rdm") {
            return Err(format!("the handshake chose {link:?}, not efa-rdm"));
        }
    }
    Ok(client)
}

/// Start a broker and connect the two handles, or say why not.
fn rig(path: Path) -> Result<Rig, String> {
    let broker =
        Broker::start(broker_config(path)).map_err(|err| format!("broker did not start: {err}"))?;
    let subject = format!("e2e.{}.{}", path.name(), std::process::id());
    let (publisher, subscriber, subscription) = if path == Path::Embedded {
        let subscription = broker
            .subscribe(&subject)
            .map_err(|err| format!("cannot subscribe: {err}"))?;
        (None, None, subscription)
    } else {
        let scheme = if path == Path::Mem { "mem" } else { "tcp" };
        let endpoint = broker
            .endpoint(scheme)
            .ok_or_else(|| format!("the broker has no {scheme} endpoint"))?;
        let subscriber = connect(&endpoint, path, "e2e-sub")?;
        let subscription = subscriber
            .subscribe(&subject)
            .map_err(|err| format!("cannot subscribe: {err}"))?;
        subscriber
            .flush(Duration::from_secs(10))
            .map_err(|err| format!("subscribe not confirmed: {err}"))?;
        let publisher = connect(&endpoint, path, "e2e-pub")?;
        (Some(publisher), Some(subscriber), subscription)
    };
    Ok(Rig {
        subscription,
        publisher,
        _subscriber: subscriber,
        broker,
        subject,
    })
}

fn cases(group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>, path: Path) {
    let rig = match rig(path) {
        Ok(rig) => rig,
        Err(reason) => {
            println!("e2e/{}: skipped: {reason}", path.name());
            return;
        }
    };
    let small = Bytes::from(vec![0x5a; SMALL]);
    let batch = if support::test_mode() {
        SMALL_BATCH_TEST
    } else {
        SMALL_BATCH
    };
    group.throughput(Throughput::Elements(batch));
    group.bench_function(format!("{}/batch_16B", path.name()), |b| {
        b.iter(|| rig.round(&small, batch))
    });
    group.throughput(Throughput::Elements(1));
    group.bench_function(format!("{}/one_16B", path.name()), |b| {
        b.iter(|| rig.round(&small, 1))
    });
    if matches!(path, Path::Tcp | Path::Fabric) {
        let large = Bytes::from(vec![0x5a; LARGE]);
        group.throughput(Throughput::Bytes(LARGE_BATCH * LARGE as u64));
        group.bench_function(format!("{}/batch_1MiB", path.name()), |b| {
            b.iter(|| rig.round(&large, LARGE_BATCH))
        });
    }
}

fn e2e(c: &mut Criterion) {
    let mut group = c.benchmark_group("e2e");
    for path in [Path::Embedded, Path::Mem, Path::Tcp, Path::Fabric] {
        cases(&mut group, path);
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = e2e
}
criterion_main!(benches);
