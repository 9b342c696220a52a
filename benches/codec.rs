//! Wire codec and link logic: encode and decode of publishes at several
//! payload sizes, fragmentation plus reassembly of a large frame at a UDP
//! sized limit, reordering of a shuffled window, and the authenticator
//! every fabric message carries (sealing and checking its tag) at 16 B and
//! 1 MiB.

use std::hint::black_box;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use efabus_core::codec::{decode, encode, encode_into, CodecLimits};
use efabus_core::fragment::{Fragmenter, Reassembler, ReassemblyConfig};
use efabus_core::frame::{Frame, Publish};
use efabus_core::reorder::{ReorderBuffer, ReorderConfig};
use efabus_core::transport::OutFrame;

const SIZES: [usize; 3] = [16, 1024, 64 * 1024];

fn publish(size: usize) -> Frame {
    Frame::Publish(Publish {
        headers: None,
        subject: "metrics.gpu0.utilisation".to_string(),
        reply: Some("_INBOX.7f3a9c.1".to_string()),
        seq: 42,
        payload: Bytes::from(vec![0xA5; size]),
    })
}

fn codec(c: &mut Criterion) {
    let limits = CodecLimits::default();
    let mut group = c.benchmark_group("codec");
    for size in SIZES {
        let frame = publish(size);
        let wire = encode(&frame).to_bytes();
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("encode", size), &frame, |b, frame| {
            b.iter(|| encode(black_box(frame)))
        });
        group.bench_with_input(BenchmarkId::new("encode_into", size), &frame, |b, frame| {
            let mut out = BytesMut::with_capacity(wire.len());
            b.iter(|| {
                out.clear();
                encode_into(black_box(frame), &mut out);
                black_box(out.len())
            })
        });
        group.bench_with_input(BenchmarkId::new("decode", size), &wire, |b, wire| {
            b.iter(|| decode(black_box(wire.clone()), &limits))
        });
    }
    group.finish();
}

/// Sealing a fabric message (its tag written) and checking it, as each
/// sender and receiver does once per message, for payloads of 16 B,
/// 10,000 B (a packed run of small frames is of that order), 16 KiB and
/// 1 MiB behind a 16-byte sender address.
fn fabric_tag(c: &mut Criterion) {
    use efabus_transports::fabric::layout::{BufferLayout, Received, TagKey};
    let key = TagKey::new(&[7u8; 32]);
    let sender = [1u8; 16];
    let mut group = c.benchmark_group("fabric_tag");
    for size in [16usize, 10_000, 16 << 10, 1 << 20] {
        let layout = BufferLayout::new(0, size + 4096);
        let frame = encode(&publish(size));
        let mut slot = vec![0u8; layout.slot_stride()];
        let len = layout
            .encode(&mut slot, &sender, (3, 1), &frame)
            .expect("the frame fits");
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("seal", size), &len, |b, &len| {
            b.iter(|| layout.seal(black_box(&mut slot), len, &[], &key))
        });
        layout.seal(&mut slot, len, &[], &key);
        group.bench_with_input(BenchmarkId::new("check", size), &len, |b, &len| {
            b.iter(|| match layout.decode(black_box(&slot), len) {
                Ok(Received::Frames(message)) => message.is_authentic(&key),
                _ => false,
            })
        });
    }
    group.finish();
}

fn fragmentation(c: &mut Criterion) {
    let limits = CodecLimits::default();
    let frame = encode(&publish(64 * 1024));
    let mut group = c.benchmark_group("fragment");
    group.throughput(Throughput::Bytes(frame.len() as u64));
    group.bench_function("split_encode_decode_reassemble_64KiB_at_1472", |b| {
        let mut fragmenter = Fragmenter::new();
        let mut reassembler = Reassembler::new(ReassemblyConfig::default());
        let now = Instant::now();
        b.iter(|| {
            let pieces = fragmenter.fragment(&frame, 1472).expect("room for data");
            let mut whole = None;
            for piece in pieces {
                let wire = encode(&Frame::Fragment(piece)).to_bytes();
                let Ok(Frame::Fragment(piece)) = decode(wire, &limits) else {
                    unreachable!("fragment round trip")
                };
                whole = reassembler
                    .handle_fragment(now, 0u32, piece)
                    .expect("valid");
            }
            black_box(whole)
        })
    });
    group.finish();
}

/// Sequences 1..=n, each displaced by less than `jitter` positions.
fn shuffled(n: u64, jitter: u64) -> Vec<u64> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut keyed: Vec<(u64, u64)> = (1..=n)
        .map(|seq| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (seq + state % jitter, seq)
        })
        .collect();
    keyed.sort();
    keyed.into_iter().map(|(_, seq)| seq).collect()
}

fn reorder(c: &mut Criterion) {
    let n = 4096;
    let order = shuffled(n, 256);
    let mut group = c.benchmark_group("reorder");
    group.throughput(Throughput::Elements(n));
    group.bench_function("shuffled_4096_jitter_256", |b| {
        let now = Instant::now();
        let mut out = Vec::with_capacity(n as usize);
        b.iter(|| {
            let mut buf = ReorderBuffer::new(ReorderConfig {
                capacity: 256,
                ..ReorderConfig::default()
            });
            out.clear();
            for &seq in &order {
                buf.push(now, seq, seq, &mut out).expect("within window");
            }
            black_box(out.len())
        })
    });
    group.finish();
}

fn fragment_only(c: &mut Criterion) {
    // The sender side alone: no copies, just slicing.
    let frame: OutFrame = encode(&publish(64 * 1024));
    let mut group = c.benchmark_group("fragment");
    group.throughput(Throughput::Bytes(frame.len() as u64));
    group.bench_function("split_only_64KiB_at_1472", |b| {
        let mut fragmenter = Fragmenter::new();
        b.iter(|| {
            let pieces = fragmenter.fragment(&frame, 1472).expect("room for data");
            black_box(pieces.map(|p| p.data.len()).sum::<usize>())
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    codec,
    fabric_tag,
    fragmentation,
    fragment_only,
    reorder
);
criterion_main!(benches);
