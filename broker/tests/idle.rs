//! An idle broker and its clients use no CPU: the loops poll on for their
//! window after work (`fabric.polling.spin_us`, up to five times that) and
//! then wait on their descriptors.
//! The same holds while the block policy holds publishers up: the loop
//! reads none of their commands then, and they do not keep it awake.
//! Alone in their binary, and one at a time, so that no other test's
//! loops are counted.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_broker::{Broker, Client, ClientOptions, Config, Error};
use efabus_transports::registry::Registry;

mod raw_common;

const WAIT: Duration = Duration::from_secs(10);

/// Held by each test: the CPU counted is all the process's loops.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// CPU time (user + system, in clock ticks) of this process's threads
/// whose name starts with `efabus-`: the broker's and the clients' loops.
fn loop_ticks() -> u64 {
    let mut ticks = 0;
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task is readable");
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue; // the thread ended meanwhile
        };
        // "tid (comm) state ppid ...": comm may hold spaces, so split at
        // the last parenthesis; utime and stime are fields 14 and 15.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !stat[open + 1..close].starts_with("efabus-") {
            continue;
        }
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let field = |n: usize| fields[n - 3].parse::<u64>().expect("numeric stat field");
        ticks += field(14) + field(15);
    }
    ticks
}

#[test]
fn loops_stop_spinning_once_the_traffic_ends() {
    let _alone = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let required = std::env::var("EFABUS_REQUIRE_FABRIC").is_ok_and(|v| v.trim() == "1");
    let start = |listen: &str| {
        let text = format!(
            "name = \"idle\"\nlisten = {listen}\n\
             [fabric]\nprovider = \"tcp;ofi_rxm\"\nnode = \"127.0.0.1\"\n"
        );
        Broker::start(Config::from_toml_str(&text, "idle test").expect("valid test config"))
    };
    // Without the fabric here, the TCP loops are checked alone.
    let broker = match start(r#"["tcp/127.0.0.1:0", "efa-rdm"]"#) {
        Ok(broker) if broker.endpoint("efa-rdm").is_some() => broker,
        Ok(_) | Err(Error::Endpoint { .. }) if !required => {
            eprintln!("tcp;ofi_rxm cannot open here: TCP only");
            start(r#"["tcp/127.0.0.1:0"]"#).expect("a TCP broker starts")
        }
        Ok(_) => panic!("EFABUS_REQUIRE_FABRIC=1 but tcp;ofi_rxm did not open"),
        Err(err) => panic!("broker does not start: {err}"),
    };
    let on_fabric = broker.endpoint("efa-rdm").is_some();
    let server = broker.endpoint("tcp").expect("a TCP listener");
    let connect = |name: &str, data_paths: Vec<String>| {
        let options = ClientOptions {
            name: name.to_string(),
            connect_timeout: WAIT,
            data_paths,
            fabric: broker.config().fabric.clone(),
            ..ClientOptions::default()
        };
        Client::connect_with(&server, options, Registry::with_builtins()).expect("client connects")
    };
    let fabric_paths = if on_fabric {
        vec!["efa-rdm".to_string()]
    } else {
        Vec::new()
    };
    let responder = connect("responder", fabric_paths);
    assert_eq!(
        responder.link().reliable.starts_with("efa-rdm"),
        on_fabric,
        "the responder's path: {:?}",
        responder.link()
    );
    let requester = connect("requester", Vec::new());
    let requests = responder.subscribe("idle.rpc").expect("subscribe");
    responder.flush(WAIT).expect("flush");
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for request in requests.take(200) {
                let reply = request.reply.expect("requests carry a reply subject");
                responder.publish(&reply, request.payload).expect("reply");
            }
        });
        for i in 0..200u32 {
            let reply = requester
                .request("idle.rpc", Bytes::from(i.to_le_bytes().to_vec()), WAIT)
                .expect("a reply");
            assert_eq!(reply.payload.as_ref(), i.to_le_bytes());
        }
    });

    // Well past the spin window, the loops wait on their descriptors and
    // timers. A loop that kept spinning would take most of a core.
    std::thread::sleep(Duration::from_millis(200));
    let ticks_per_second = 100; // USER_HZ on Linux (x86 and arm64)
    let before = loop_ticks();
    std::thread::sleep(Duration::from_secs(2));
    // A thread that ended meanwhile takes its ticks with it.
    let used = loop_ticks().saturating_sub(before);
    assert!(
        used * 10 <= 2 * ticks_per_second,
        "the idle loops used {used} ticks over 2 s (at most 10% of a core allowed)"
    );
}

/// A subscriber that reads nothing holds in-process publishers up under
/// the block policy. Their commands wait in the loop's queue, unread until
/// the subscriber takes something, and the loop sleeps meanwhile.
#[test]
fn a_loop_holding_publishers_up_sleeps() {
    let _alone = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let text = "name = \"held\"\nlisten = [\"tcp/127.0.0.1:0\"]\n\
                [limits]\nmax_pending_bytes = 65536\n\
                [slow_consumer]\npolicy = \"block\"\nblock_timeout_ms = 30000\n";
    let broker =
        Arc::new(Broker::start(Config::from_toml_str(text, "idle test").unwrap()).unwrap());
    let mut raw = raw_common::Raw::connect(&broker);
    raw.hello_as_client("reads-nothing");
    raw.send(&raw_common::subscribe(1, "held"));
    let deadline = Instant::now() + WAIT;
    while broker.subscription_count() == 0 {
        assert!(Instant::now() < deadline, "the subscription did not arrive");
        std::thread::sleep(Duration::from_millis(5));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = std::thread::spawn({
        let broker = Arc::clone(&broker);
        let stop = Arc::clone(&stop);
        move || {
            let payload = Bytes::from(vec![0u8; 1024]);
            while !stop.load(Ordering::Relaxed) {
                if broker.publish("held", payload.clone()).is_err() {
                    return;
                }
            }
        }
    });
    // The socket buffers fill, then the broker's queue, then the command
    // queue behind the held publisher.
    let stats = broker.stats();
    while stats.queued_bytes.load(Ordering::Relaxed) < 65536 {
        assert!(
            Instant::now() < deadline,
            "the subscriber's queue did not fill"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    let ticks_per_second = 100;
    let before = loop_ticks();
    std::thread::sleep(Duration::from_secs(1));
    let used = loop_ticks().saturating_sub(before);
    // The subscriber goes, and with it the hold.
    stop.store(true, Ordering::Relaxed);
    drop(raw);
    publisher.join().expect("the publisher ends");
    assert!(
        used * 10 <= ticks_per_second,
        "the loop used {used} ticks over 1 s while holding publishers up (at most 10% of a core allowed)"
    );
}
