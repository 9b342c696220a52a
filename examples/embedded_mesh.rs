//! Services that each embed a broker, meshed over the fabric with no
//! standalone broker: every service process starts its own `Broker`, the
//! first one is the others' seed, and they find each other and route over
//! `efa-rdm` (or `shm` on one host). A request from one service to another
//! is one fabric hop each way, answered where it arrives
//! (`Broker::respond`) and awaited by a requester that runs the broker's
//! loop while it waits (`Broker::request`).
//!
//! ```text
//! cargo run --release --example embedded_mesh                    # tcp;ofi_rxm, 3 services
//! cargo run --release --example embedded_mesh -- shm 2           # shm, 2 services
//! cargo run --release --example embedded_mesh -- efa 3 --json    # on an EFA host
//! cargo run --example embedded_mesh -- "tcp;ofi_rxm" 3 --quick   # a short run
//! cargo run --release --example embedded_mesh -- tcp 2           # routes on TCP, to compare
//! ```
//!
//! Run without a role, the example is the launcher: it starts the service
//! processes (this same program with `service` as its first argument),
//! passes each the seed's address, and paces them through their stdin.
//! Each service waits for its routes to every other one and prints the
//! path of each; then, one service at a time, each asks every other
//! service 64 B requests (round-trip times), streams 16 B messages to it
//! (messages sent per second) and 1 MiB messages (bytes delivered per
//! second: timed until a request sent behind them is answered), so what
//! is measured is one service's traffic, as
//! `fi_pingpong` and `efabus bench` measure one pair, not the services
//! contending for the cores. Each stays up until the launcher says all
//! are done (by closing its stdin).
//! Exit status: 0 on success, 2 when the fabric cannot be used here (the
//! reason is printed), 1 on any other failure.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, Ordering};

use efabus::{Broker, Bytes, Config};

const WAIT: Duration = Duration::from_secs(20);

/// How much each service sends to each other one.
#[derive(Clone, Copy)]
struct Sizes {
    round_trips: usize,
    stream: usize,
    /// Messages of [`BULK`] bytes.
    bulk: usize,
}

const FULL: Sizes = Sizes {
    round_trips: 2_000,
    stream: 200_000,
    bulk: 1_000,
};
/// `--quick`: enough to show it works, for the tests.
const QUICK: Sizes = Sizes {
    round_trips: 50,
    stream: 2_000,
    bulk: 20,
};

/// Bytes of each message of the bulk stream.
const BULK: usize = 1 << 20;

fn main() -> ExitCode {
    // First, while this is the only thread: libfabric's own buffer counts.
    efabus::transports::fabric::apply_provider_env_defaults();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if args.first().map(String::as_str) == Some("service") {
        service(&args[1..])
    } else {
        launch(&args)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Unavailable(reason)) => {
            println!("embedded_mesh: the fabric cannot be used here: {reason}");
            ExitCode::from(2)
        }
        Err(Failure::Other(err)) => {
            eprintln!("embedded_mesh: {err}");
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

/// `[PROVIDER [SERVICES]] [--json] [--quick]`: start the services and
/// wait for them.
fn launch(args: &[String]) -> Result<(), Failure> {
    let positional: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let provider = positional
        .first()
        .map_or_else(|| "tcp;ofi_rxm".to_string(), |p| p.to_string());
    let count: usize = match positional.get(1) {
        None => 3,
        Some(text) => match text.parse() {
            Ok(n) if (2..=8).contains(&n) => n,
            _ => return Err("SERVICES must be 2 to 8".into()),
        },
    };
    let flags: Vec<&String> = args.iter().filter(|a| a.starts_with("--")).collect();
    let exe = std::env::current_exe()?;
    let spawn = |name: &str, seed: &str| -> Result<Child, Failure> {
        let mut command = Command::new(&exe);
        command
            .args(["service", name, &provider, &count.to_string(), seed])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        command.args(&flags);
        Ok(command.spawn()?)
    };
    // The first service is the seed: its address is its first line.
    let mut first = spawn("s0", "-")?;
    let mut first_out = BufReader::new(first.stdout.take().ok_or("no stdout")?);
    let mut line = String::new();
    first_out.read_line(&mut line)?;
    let Some(seed) = line.trim().strip_prefix("listening ") else {
        let mut rest = String::new();
        let _ = first_out.read_to_string(&mut rest);
        let _ = first.wait();
        return match (line + &rest).trim() {
            text if text.contains("cannot be used here") => {
                Err(Failure::Unavailable(text.to_string()))
            }
            text => Err(format!("the first service said {text:?}").into()),
        };
    };
    let seed = seed.to_string();
    let mut children = vec![(first, first_out)];
    let mut outputs = vec![line];
    for n in 1..count {
        let mut child = spawn(&format!("s{n}"), &seed)?;
        let out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        children.push((child, out));
    }
    outputs.resize(count, String::new());
    // Every service ready; then each measures in turn. A service that
    // failed says so in its lines (and its stdin may be closed: what
    // cannot be written to it is its failure, told below).
    for (index, (_, out)) in children.iter_mut().enumerate() {
        read_until(out, READY, &mut outputs[index])?;
    }
    for (index, (child, out)) in children.iter_mut().enumerate() {
        let _ = tell(child, GO);
        read_until(out, MEASURED, &mut outputs[index])?;
    }
    for (index, (_, out)) in children.iter_mut().enumerate() {
        read_until(out, DONE, &mut outputs[index])?;
    }
    for (child, _) in &mut children {
        drop(child.stdin.take());
    }
    let mut failed = false;
    let mut stdout = std::io::stdout().lock();
    for ((child, _), text) in children.iter_mut().zip(&outputs) {
        stdout.write_all(text.as_bytes())?;
        failed |= !child.wait()?.success() || !text.ends_with(&format!("{DONE}\n"));
    }
    if failed {
        stdout.flush()?;
        return Err("a service failed".into());
    }
    if flags.iter().any(|f| *f == "--json") {
        // One summary line last: the median over every pair of services.
        let all = outputs.concat();
        let rtt = median(json_numbers(&all, "rtt_p50_us"));
        let rate = median(json_numbers(&all, "stream_16_per_sec"));
        let bulk = median(json_numbers(&all, "stream_1mib_mb_per_sec"));
        writeln!(
            stdout,
            "{{\"provider\":\"{provider}\",\"services\":{count},\
             \"rtt_p50_us\":{rtt:.1},\"stream_16_per_sec\":{rate:.0},\
             \"stream_1mib_mb_per_sec\":{bulk:.0}}}"
        )?;
    }
    stdout.flush()?;
    Ok(())
}

/// What the launcher and a service say to pace a run, a line each: the
/// service is `READY` (its routes up), the launcher says `GO` (measure
/// now), the service has `MEASURED`, and, once it has received every
/// other service's stream, it is `DONE`.
const READY: &str = "ready";
const GO: &str = "go";
const MEASURED: &str = "measured";
const DONE: &str = "done";

/// Appends a service's lines to `text` up to and with `marker`, or to the
/// end of its output.
fn read_until(out: &mut impl BufRead, marker: &str, text: &mut String) -> std::io::Result<()> {
    for line in out.lines() {
        let line = line?;
        text.push_str(&line);
        text.push('\n');
        if line == marker {
            break;
        }
    }
    Ok(())
}

fn tell(child: &mut Child, word: &str) -> std::io::Result<()> {
    let stdin = child
        .stdin
        .as_mut()
        .ok_or("no stdin")
        .map_err(std::io::Error::other)?;
    writeln!(stdin, "{word}")?;
    stdin.flush()
}

/// Every value of the numeric field `name` in the JSON lines of `text`.
fn json_numbers(text: &str, name: &str) -> Vec<f64> {
    let key = format!("\"{name}\":");
    text.lines()
        .filter_map(|line| {
            let rest = &line[line.find(&key)? + key.len()..];
            let end = rest.find([',', '}']).unwrap_or(rest.len());
            rest[..end].parse().ok()
        })
        .collect()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// `service NAME PROVIDER COUNT SEED [--json]`: one service process.
fn service(args: &[String]) -> Result<(), Failure> {
    let [name, provider, count, seed, ..] = args else {
        return Err(
            "usage: embedded_mesh service NAME PROVIDER COUNT SEED [--json] [--quick]".into(),
        );
    };
    let count: usize = count.parse()?;
    let json = args.iter().any(|a| a == "--json");
    let sizes = if args.iter().any(|a| a == "--quick") {
        QUICK
    } else {
        FULL
    };
    // `tcp`: routes on TCP alone, for comparison.
    let (scheme, fabric_provider) = match provider.as_str() {
        "shm" => (Some("shm"), "tcp;ofi_rxm"),
        "tcp" => (None, "tcp;ofi_rxm"),
        other => (Some("efa-rdm"), other),
    };
    let listen = match scheme {
        Some(scheme) => format!(r#""tcp/127.0.0.1:0", "{scheme}""#),
        None => r#""tcp/127.0.0.1:0""#.to_string(),
    };
    let node = if provider.starts_with("efa") {
        ""
    } else {
        "127.0.0.1"
    };
    let peers = if seed == "-" {
        String::new()
    } else {
        format!("{seed:?}")
    };
    let config = Config::from_toml_str(
        &format!(
            r#"
            name = "{name}"
            log_level = "warn"
            listen = [{listen}]
            peers = [{peers}]
            [slow_consumer]
            policy = "block"
            block_timeout_ms = 20000
            [negotiation]
            preference = ["shm", "efa-rdm", "tcp"]
            [fabric]
            provider = "{fabric_provider}"
            node = "{node}"
            "#
        ),
        "embedded_mesh service",
    )?;
    let broker = Broker::start(config)?;
    if let Some(scheme) = scheme.filter(|scheme| broker.endpoint(scheme).is_none()) {
        let why: Vec<String> = broker
            .unopened()
            .iter()
            .map(|(entry, reason)| format!("{entry}: {reason}"))
            .collect();
        return Err(Failure::Unavailable(format!(
            "{scheme} via {provider} did not open ({})",
            why.join("; ")
        )));
    }
    println!("listening {}", broker.endpoint("tcp").ok_or("no tcp")?);

    // Requests to this service are answered where they arrive (the
    // broker's event loop), with no hand-over to a thread of the service;
    // streams to it are counted on a thread of their own, until the
    // launcher says all are done.
    let _answering = broker.respond(&format!("svc.{name}"), |request| {
        Some(request.payload.clone())
    })?;
    let stream = broker.subscribe(&format!("stream.{name}"))?;
    let bulk = broker.subscribe(&format!("bulk.{name}"))?;
    let stop = AtomicBool::new(false);
    let expected = sizes.stream * (count - 1);
    let expected_bulk = sizes.bulk * (count - 1);
    std::thread::scope(|scope| -> Result<(), Failure> {
        let counter = scope.spawn(|| count_messages(&stream, expected, 16));
        let bulk_counter = scope.spawn(|| count_messages(&bulk, expected_bulk, BULK));
        let mut commands = std::io::stdin().lock().lines();
        let result = exchange(&broker, name, count, sizes, json, &mut commands);
        if result.is_ok() {
            let received = counter.join().map_err(|_| "the counting thread failed")?;
            let received_bulk = bulk_counter
                .join()
                .map_err(|_| "the counting thread failed")?;
            if received != expected || received_bulk != expected_bulk {
                stop.store(true, Ordering::Relaxed);
                return Err(format!(
                    "{name}: {received} of {expected} streamed messages, {received_bulk} of \
                     {expected_bulk} of 1 MiB; {}",
                    broker_state(&broker)
                )
                .into());
            }
            println!("{name} received {expected} streamed messages and {expected_bulk} of 1 MiB");
            print_resident(name, count - 1, "after the exchange");
            say(DONE)?;
            // Serve the others until the launcher closes stdin.
            for _ in commands.by_ref() {}
        }
        stop.store(true, Ordering::Relaxed);
        result
    })
}

/// Counts the messages of `len` bytes `subscription` receives, up to
/// `expected` and then any that come within a further 200 ms
/// (duplicates); stops early at a message of another length, or when
/// none comes for [`WAIT`].
fn count_messages(subscription: &efabus::Subscription, expected: usize, len: usize) -> usize {
    let mut received = 0;
    loop {
        let wait = if received < expected {
            WAIT
        } else {
            Duration::from_millis(200)
        };
        match subscription.recv_timeout(wait) {
            Ok(message) if message.payload.len() == len => received += 1,
            _ => return received,
        }
    }
}

/// A request that got no answer: what this broker's routes and counters
/// say, to tell a lost message from a stalled route.
fn unanswered(broker: &Broker, name: &str, other: &str, err: efabus::Error) -> Failure {
    format!(
        "{name}: no answer from {other} ({err}); {}",
        broker_state(broker)
    )
    .into()
}

/// This broker's routes and its counters that are not zero.
fn broker_state(broker: &Broker) -> String {
    let routes: Vec<String> = broker
        .routes()
        .iter()
        .map(|route| format!("{} over {}", route.name, route.reliable))
        .collect();
    let counters: Vec<String> = broker
        .stats()
        .snapshot()
        .into_iter()
        .filter(|(name, value)| *value > 0 && !name.starts_with("fabric_rendezvous"))
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    format!(
        "routes: {}; counters: {}",
        routes.join(", "),
        counters.join(" ")
    )
}

/// Wait for the routes to every other service and print their paths; when
/// the launcher says, measure round trips to each and stream to each, and
/// print what was measured.
fn exchange(
    broker: &Broker,
    name: &str,
    count: usize,
    sizes: Sizes,
    json: bool,
    commands: &mut impl Iterator<Item = std::io::Result<String>>,
) -> Result<(), Failure> {
    let deadline = Instant::now() + WAIT;
    while broker.routes().len() < count - 1 {
        if Instant::now() > deadline {
            return Err(
                format!("{name}: {} of {} routes", broker.routes().len(), count - 1).into(),
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // The others' three subscriptions each, announced over the routes.
    while broker.route_interest_count() < 3 * (count - 1) {
        if Instant::now() > deadline {
            return Err(format!("{name}: the others' subscriptions never arrived").into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut routes = broker.routes();
    routes.sort_by(|a, b| a.name.cmp(&b.name));
    for route in &routes {
        println!("{name} route to {}: {}", route.name, route.reliable);
    }
    print_resident(name, count - 1, "before any traffic");
    say(READY)?;
    await_word(commands, GO)?;
    let payload = Bytes::from(vec![7u8; 64]);
    let mut medians = Vec::with_capacity(routes.len());
    for route in &routes {
        let other = &route.name;
        let service = format!("svc.{other}");
        let mut times = Vec::with_capacity(sizes.round_trips);
        for _ in 0..sizes.round_trips {
            let started = Instant::now();
            // `Broker::request` waits by running the broker's loop rounds
            // itself: the answer needs no hand-over from the loop thread.
            let answer = broker
                .request(&service, payload.clone(), WAIT)
                .map_err(|err| unanswered(broker, name, other, err))?;
            times.push(started.elapsed());
            if answer.payload != payload {
                return Err(format!("{name}: {other} answered something else").into());
            }
        }
        times.sort_unstable();
        medians.push(times[times.len() / 2].as_secs_f64() * 1e6);
    }
    let small = Bytes::from_static(b"0123456789abcdef");
    let mut rates = Vec::with_capacity(routes.len());
    for route in &routes {
        let subject = format!("stream.{}", route.name);
        let started = Instant::now();
        for _ in 0..sizes.stream {
            broker.publish(&subject, small.clone())?;
        }
        broker.flush(WAIT)?;
        rates.push(sizes.stream as f64 / started.elapsed().as_secs_f64());
    }
    // 1 MiB messages, timed until a request sent behind them on the same
    // route is answered: the other service has taken them all by then.
    let large = Bytes::from(vec![7u8; BULK]);
    let mut bulk_rates = Vec::with_capacity(routes.len());
    for route in &routes {
        let other = &route.name;
        let subject = format!("bulk.{other}");
        let started = Instant::now();
        for _ in 0..sizes.bulk {
            broker.publish(&subject, large.clone())?;
        }
        broker
            .request(&format!("svc.{other}"), payload.clone(), WAIT)
            .map_err(|err| unanswered(broker, name, other, err))?;
        let bytes = (sizes.bulk * BULK) as f64;
        bulk_rates.push(bytes / started.elapsed().as_secs_f64() / 1e6);
    }
    for (((route, p50), rate), mbs) in routes.iter().zip(medians).zip(rates).zip(bulk_rates) {
        let other = &route.name;
        if json {
            println!(
                "{{\"from\":\"{name}\",\"to\":\"{other}\",\"path\":\"{}\",\
                 \"rtt_p50_us\":{p50:.1},\"stream_16_per_sec\":{rate:.0},\
                 \"stream_1mib_mb_per_sec\":{mbs:.0}}}",
                route.reliable
            );
        } else {
            println!(
                "{name} asked {other}: 64 B round trip p50 {p50:.1} us; \
                 16 B stream sent at {rate:.0}/s; 1 MiB stream delivered at {mbs:.0} MB/s"
            );
        }
    }
    say(MEASURED)?;
    Ok(())
}

/// One line to the launcher, at once.
fn say(word: &str) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{word}")?;
    stdout.flush()
}

/// Waits for the launcher's `word`.
fn await_word(
    commands: &mut impl Iterator<Item = std::io::Result<String>>,
    word: &str,
) -> Result<(), Failure> {
    match commands.next() {
        Some(Ok(line)) if line.trim() == word => Ok(()),
        Some(Ok(line)) => Err(format!("expected {word:?} from the launcher, got {line:?}").into()),
        Some(Err(err)) => Err(err.into()),
        None => Err(format!("the launcher closed stdin before {word:?}").into()),
    }
}

/// Prints this process's resident memory (Linux), for the cost of a
/// route; nothing where it cannot be read.
fn print_resident(name: &str, routes: usize, when: &str) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next());
    if let Some(kib) = kib {
        println!("{name} resident memory {kib} KiB with {routes} routes, {when}");
    }
}
