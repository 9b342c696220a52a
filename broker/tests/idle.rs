//! An idle broker and its clients use no CPU: the loops poll on for their
//! window after work (`fabric.polling.spin_us`, up to five times that) and
//! then wait on their descriptors.
//! Alone in its binary, so that no other test's loops are counted.

use std::time::Duration;

use bytes::Bytes;
use efabus_broker::{Broker, Client, ClientOptions, Config, Error};
use efabus_transports::registry::Registry;

const WAIT: Duration = Duration::from_secs(10);

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
