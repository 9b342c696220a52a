//! Random and mutated frames thrown at a live broker over TCP: the broker
//! must answer each offender with an error or a close, never crash, and
//! keep serving a well-behaved client throughout.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::Server;
use efabus::core::codec;
use efabus::core::frame::{self, DeliveryClass, Frame, Hello, PROTOCOL_VERSION};
use efabus::{Bytes, Client};
use proptest::prelude::*;

const WAIT: Duration = Duration::from_secs(10);

/// Valid frames to start mutations from.
fn seeds() -> Vec<Vec<u8>> {
    let frames = [
        Frame::Hello(Hello {
            no_echo: false,
            no_responders: false,
            version: PROTOCOL_VERSION,
            name: "fuzz".into(),
            credentials: None,
            user: None,
            proof: None,
            offers: Vec::new(),
            link_auth: None,
        }),
        Frame::Subscribe(frame::Subscribe {
            sid: 1,
            pattern: "a.*".into(),
            queue: Some("q".into()),
            class: DeliveryClass::Reliable,
        }),
        Frame::Publish(frame::Publish {
            headers: None,
            subject: "a.b".into(),
            reply: Some("r.1".into()),
            seq: 0,
            payload: Bytes::from_static(b"payload"),
        }),
        Frame::Unsubscribe { sid: 1 },
        Frame::Ping { nonce: 9 },
    ];
    frames
        .iter()
        .map(|f| codec::encode(f).to_bytes().to_vec())
        .collect()
}

/// Write the bytes, then read until the broker closes or goes quiet.
fn throw(address: &str, bytes: &[u8]) {
    let Ok(mut stream) = TcpStream::connect(address) else {
        panic!("broker stopped accepting connections");
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
    let _ = stream.write_all(bytes);
    let mut sink = [0u8; 4096];
    for _ in 0..5 {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, bit: u8 },
    Truncate { at: usize },
    Extend { bytes: Vec<u8> },
    SetByte { at: usize, value: u8 },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        proptest::collection::vec(any::<u8>(), 1..64).prop_map(|bytes| Mutation::Extend { bytes }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::SetByte { at, value }),
    ]
}

fn apply(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        if bytes.is_empty() {
            break;
        }
        let len = bytes.len();
        match m {
            Mutation::Flip { at, bit } => bytes[at % len] ^= 1 << bit,
            Mutation::Truncate { at } => bytes.truncate(at % len),
            Mutation::Extend { bytes: more } => bytes.extend_from_slice(more),
            Mutation::SetByte { at, value } => bytes[at % len] = *value,
        }
    }
    bytes
}

#[test]
fn random_and_mutated_frames_never_stop_the_broker() {
    let server = Server::start("[limits]\nhandshake_timeout_ms = 500\n");
    let good = Client::connect(&server.endpoint).unwrap();
    let sub = good.subscribe("alive.>").unwrap();
    good.flush(WAIT).unwrap();
    let seeds = seeds();
    let hello = seeds[0].clone();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 96,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let round = std::cell::Cell::new(0u32);
    let strategy = (
        0..seeds.len(),
        proptest::collection::vec(mutation(), 1..6),
        any::<bool>(),
        proptest::collection::vec(any::<u8>(), 0..256),
    );
    runner
        .run(&strategy, |(seed, mutations, after_hello, noise)| {
            let mut bytes = if after_hello {
                hello.clone()
            } else {
                Vec::new()
            };
            bytes.extend(apply(seeds[seed].clone(), &mutations));
            bytes.extend_from_slice(&noise);
            throw(&server.address, &bytes);
            round.set(round.get() + 1);
            let n = round.get();
            // The well-behaved client is still served, in order.
            good.publish("alive.check", Bytes::from(n.to_le_bytes().to_vec()))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let m = sub
                .recv_timeout(WAIT)
                .map_err(|e| TestCaseError::fail(format!("good client starved: {e}")))?;
            prop_assert_eq!(&m.payload[..], &n.to_le_bytes()[..]);
            Ok(())
        })
        .unwrap();
    assert!(
        server.rss_kib() < 256 * 1024,
        "broker memory stayed bounded"
    );
}
