//! The link layer against simple models: whatever the wire does within the
//! link's promises (reorder, duplicate, and on lossy links drop), the
//! receiver yields whole original frames, in order, at most once, and
//! accounts for every frame it does not deliver.

mod link_common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::budget::MemoryBudget;
use efabus_core::codec::{self, FRAGMENT_OVERHEAD};
use efabus_core::frame::{Fragment, Frame};
use efabus_core::link::{LinkError, LinkReceiver, LinkSender};
use efabus_core::transport::OutFrame;
use link_common::{config, frame_id, settle, test_frame, MIN_FRAME};
use proptest::prelude::*;

/// One wire frame as sent: the sequence (frame index + 1) it belongs to.
struct Wire {
    seq: u64,
    bytes: Bytes,
}

/// Frame sizes: mostly small, some large enough to fragment at any limit.
fn frame_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => MIN_FRAME..200usize,
        2 => 200usize..10_000,
        1 => 10_000usize..=65_536,
    ]
}

/// Frames with their head/body split point.
fn frames(max: usize) -> impl Strategy<Value = Vec<(usize, usize)>> {
    proptest::collection::vec((frame_len(), 0usize..120), 0..max)
}

/// A frame limit with frames for it: at most 64 pieces per frame, so tiny
/// limits stay quick.
fn limit_and_frames(max: usize) -> impl Strategy<Value = (usize, Vec<(usize, usize)>)> {
    limit().prop_flat_map(move |limit| {
        let cap = ((limit - FRAGMENT_OVERHEAD) * 64).max(MIN_FRAME + 1);
        let specs = proptest::collection::vec(
            (frame_len().prop_map(move |len| len.min(cap)), 0usize..120),
            0..max,
        );
        (Just(limit), specs)
    })
}

/// Sends every frame through a sender; returns the originals (as one
/// buffer each) and the wire frames in send order.
fn send_all(
    sender: &mut LinkSender,
    specs: &[(usize, usize)],
    limit: usize,
) -> (Vec<Bytes>, Vec<Wire>) {
    let mut originals = Vec::new();
    let mut wire = Vec::new();
    let mut out: Vec<OutFrame> = Vec::new();
    for (i, &(len, split)) in specs.iter().enumerate() {
        let frame = test_frame(i as u64 + 1, len, split);
        originals.push(frame.to_bytes());
        out.clear();
        sender.prepare(frame, &mut out).expect("frame is sendable");
        for piece in out.drain(..) {
            assert!(piece.len() <= limit, "{} > {limit}", piece.len());
            wire.push(Wire {
                seq: i as u64 + 1,
                bytes: piece.to_bytes(),
            });
        }
    }
    (originals, wire)
}

/// Arrival order: wire frame `i` of sequence `s` keyed `s + offset` with
/// offsets below `window`, stable-sorted by key. When a piece of sequence
/// `s` arrives, every piece of sequences up to `s - window` has arrived.
fn shuffle_within(wire: &[Wire], offsets: &[u64], window: u64) -> Vec<usize> {
    let mut keyed: Vec<(u64, usize)> = wire
        .iter()
        .enumerate()
        .map(|(i, w)| (w.seq + offsets.get(i).copied().unwrap_or(0) % window, i))
        .collect();
    keyed.sort();
    keyed.into_iter().map(|(_, i)| i).collect()
}

/// Sequence `seq` of a sequenced link: `frame` as one piece.
fn fragment_message(seq: u64, frame: &Bytes) -> Vec<u8> {
    codec::encode(&Frame::Fragment(Fragment {
        msg_id: seq,
        index: 0,
        count: 1,
        total_len: frame.len() as u32,
        data: frame.clone(),
    }))
    .to_bytes()
    .to_vec()
}

/// Inserts copies of arrivals somewhere after their original.
fn add_duplicates(order: &mut Vec<usize>, dups: &[(usize, usize)]) -> usize {
    let mut added = 0;
    for &(which, later) in dups {
        if order.is_empty() {
            break;
        }
        let pos = which % order.len();
        let at = pos + 1 + later % (order.len() - pos);
        order.insert(at, order[pos]);
        added += 1;
    }
    added
}

fn limit() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(FRAGMENT_OVERHEAD + 1),
        FRAGMENT_OVERHEAD + 2..300usize,
        Just(1472usize),
        Just(8888usize),
        Just(1usize << 20),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Reliable, sequenced: permuted within the window and duplicated, the
    /// receiver yields exactly the original frames, in order, once.
    #[test]
    fn reliable_sequenced_delivers_everything_in_order_once(
        (limit, specs) in limit_and_frames(24),
        window in 1usize..12,
        offsets in proptest::collection::vec(any::<u64>(), 0..4096),
        dups in proptest::collection::vec((any::<usize>(), any::<usize>()), 0..30),
    ) {
        let mut cfg = config(limit, true, false, window, Duration::from_millis(5), Duration::from_millis(5));
        cfg.reliable_gap_timeout = Duration::from_secs(1 << 20);
        cfg.reassembly.timeout = Duration::from_secs(1 << 20);
        let mut sender = LinkSender::new(&cfg).unwrap();
        let mut rx = LinkReceiver::new(&cfg);
        let (originals, wire) = send_all(&mut sender, &specs, limit);
        let mut order = shuffle_within(&wire, &offsets, window as u64);
        let added = add_duplicates(&mut order, &dups);

        // Time runs a second a piece, far past the lossy timeouts (5 ms);
        // every gap and partial message fills before the reliable ones.
        let mut now = Instant::now();
        let mut out = Vec::new();
        for i in order {
            now += Duration::from_secs(1);
            rx.receive(now, wire[i].bytes.clone(), &mut out).unwrap();
            rx.poll(now, &mut out).unwrap();
        }
        prop_assert_eq!(&out, &originals);
        prop_assert_eq!(rx.next_deadline(), None);
        prop_assert_eq!(rx.stats().gap_failures, 0);
        let stats = rx.stats();
        prop_assert_eq!(stats.delivered, originals.len() as u64);
        prop_assert_eq!(stats.duplicates, added as u64);
        prop_assert_eq!(stats.lost, 0);
        prop_assert_eq!(stats.messages, (wire.len() + added) as u64);
        prop_assert_eq!((rx.held(), rx.partial_messages(), rx.buffered_bytes()), (0, 0, 0));
    }

    /// Lossy, sequenced, no time passing during arrival and a window wider
    /// than the traffic: exactly the frames whose every piece arrived are
    /// delivered, in order; every other sequence up to the last one seen is
    /// counted lost, every extra piece a duplicate; memory returns to 0.
    #[test]
    fn lossy_sequenced_delivers_exactly_the_complete_frames(
        limit in prop_oneof![Just(1472usize), Just(8888usize)],
        specs in frames(24),
        fate in proptest::collection::vec((0u8..100, any::<u64>()), 0..2048),
        drop_percent in 0u8..60,
        dups in proptest::collection::vec((any::<usize>(), any::<usize>()), 0..30),
    ) {
        let cfg = config(limit, true, true, 4096, Duration::from_millis(10), Duration::from_millis(50));
        let mut sender = LinkSender::new(&cfg).unwrap();
        let mut rx = LinkReceiver::new(&cfg);
        let (originals, wire) = send_all(&mut sender, &specs, limit);

        // Drop some wire frames, shuffle the rest completely, duplicate some.
        let mut kept: Vec<(u64, usize)> = (0..wire.len())
            .filter(|&i| fate.get(i).map_or(0, |f| f.0) >= drop_percent)
            .map(|i| (fate.get(i).map_or(0, |f| f.1), i))
            .collect();
        kept.sort();
        let mut order: Vec<usize> = kept.into_iter().map(|(_, i)| i).collect();
        let distinct = order.len();
        let added = add_duplicates(&mut order, &dups);

        let mut pieces_of: BTreeMap<u64, usize> = BTreeMap::new();
        for w in &wire {
            *pieces_of.entry(w.seq).or_default() += 1;
        }
        let mut arrived: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
        for &i in &order {
            arrived.entry(wire[i].seq).or_default().insert(i);
        }
        let complete: Vec<u64> = arrived
            .iter()
            .filter(|(seq, got)| got.len() == pieces_of[seq])
            .map(|(&seq, _)| seq)
            .collect();
        let highest = arrived.keys().next_back().copied().unwrap_or(0);

        let t0 = Instant::now();
        let mut out = Vec::new();
        for &i in &order {
            rx.receive(t0, wire[i].bytes.clone(), &mut out).unwrap();
        }
        settle(&mut rx, t0, &mut out).expect("lossy links fail nothing by time");

        let ids: Vec<u64> = out.iter().map(|f| frame_id(f)).collect();
        prop_assert_eq!(&ids, &complete);
        for frame in &out {
            prop_assert_eq!(frame, &originals[frame_id(frame) as usize - 1]);
        }
        let stats = rx.stats();
        prop_assert_eq!(stats.delivered + stats.lost, highest);
        prop_assert_eq!(stats.duplicates, added as u64);
        prop_assert_eq!(stats.messages, (distinct + added) as u64);
        prop_assert_eq!((rx.held(), rx.partial_messages(), rx.buffered_bytes()), (0, 0, 0));
    }

    /// Lossy, sequenced, with time passing, a small window and timeouts
    /// firing during arrival: only whole original frames, in increasing
    /// order, each at most once, each of them complete on the wire; losses
    /// account exactly for the rest up to the last sequence seen.
    #[test]
    fn lossy_sequenced_under_timeouts_accounts_for_every_frame(
        limit in prop_oneof![Just(1472usize), Just(8888usize)],
        window in 1usize..16,
        skip_distance in 1usize..32,
        specs in frames(24),
        fate in proptest::collection::vec((0u8..100, any::<u64>(), 0u64..30), 0..2048),
        drop_percent in 0u8..40,
        dups in proptest::collection::vec((any::<usize>(), any::<usize>()), 0..30),
    ) {
        let mut cfg = config(limit, true, true, window, Duration::from_millis(10), Duration::from_millis(25));
        cfg.skip_distance = skip_distance;
        let mut sender = LinkSender::new(&cfg).unwrap();
        let mut rx = LinkReceiver::new(&cfg);
        let (originals, wire) = send_all(&mut sender, &specs, limit);

        let offsets: Vec<u64> = fate.iter().map(|f| f.1).collect();
        let mut order: Vec<usize> = shuffle_within(&wire, &offsets, 2 * window as u64)
            .into_iter()
            .filter(|&i| fate.get(i).map_or(0, |f| f.0) >= drop_percent)
            .collect();
        add_duplicates(&mut order, &dups);

        let mut pieces_of: BTreeMap<u64, usize> = BTreeMap::new();
        for w in &wire {
            *pieces_of.entry(w.seq).or_default() += 1;
        }
        let mut arrived: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
        for &i in &order {
            arrived.entry(wire[i].seq).or_default().insert(i);
        }
        let highest = arrived.keys().next_back().copied().unwrap_or(0);

        let mut now = Instant::now();
        let mut out = Vec::new();
        for (k, &i) in order.iter().enumerate() {
            now += Duration::from_millis(fate.get(k).map_or(0, |f| f.2));
            rx.receive(now, wire[i].bytes.clone(), &mut out).unwrap();
            if k % 3 == 0 {
                rx.poll(now, &mut out).expect("lossy links fail nothing by time");
            }
        }
        settle(&mut rx, now, &mut out).expect("lossy links fail nothing by time");

        let ids: Vec<u64> = out.iter().map(|f| frame_id(f)).collect();
        prop_assert!(ids.windows(2).all(|w| w[0] < w[1]), "not increasing: {:?}", ids);
        for frame in &out {
            let id = frame_id(frame);
            prop_assert_eq!(frame, &originals[id as usize - 1]);
            prop_assert_eq!(arrived.get(&id).map(BTreeSet::len), Some(pieces_of[&id]));
        }
        let stats = rx.stats();
        prop_assert_eq!(stats.delivered, out.len() as u64);
        prop_assert_eq!(stats.delivered + stats.lost, highest);
        prop_assert_eq!((rx.held(), rx.partial_messages(), rx.buffered_bytes()), (0, 0, 0));
    }

    /// Reliable, sequenced, with some sequences withheld and the rest in
    /// any order: what the receiver holds never passes its own bound nor
    /// the budget it shares with a second receiver, the budget always
    /// equals what both hold, a refusal names the bound that was reached,
    /// and dropping the receivers gives everything back.
    #[test]
    fn reliable_memory_stays_within_the_link_and_shared_bounds(
        (limit, specs) in limit_and_frames(24),
        withheld in proptest::collection::vec(any::<bool>(), 24),
        order_keys in proptest::collection::vec(any::<u64>(), 0..2048),
        max_bytes in 1usize..400_000,
        shared in 1usize..400_000,
        other_holds in 0usize..100_000,
    ) {
        let budget = MemoryBudget::new(shared);
        let mut cfg = config(limit, true, false, 4096, Duration::from_millis(5), Duration::from_millis(5));
        cfg.reassembly.max_bytes = max_bytes;
        cfg.memory = budget.clone();
        let mut sender = LinkSender::new(&cfg).unwrap();
        let (_, wire) = send_all(&mut sender, &specs, limit);
        // A second receiver holds one frame behind a gap of its own.
        let mut other_cfg = cfg.clone();
        other_cfg.reassembly.max_bytes = usize::MAX;
        let mut other = LinkReceiver::new(&other_cfg);
        let other_frame = test_frame(2, other_holds.max(MIN_FRAME), 16).to_bytes();
        let mut out = Vec::new();
        let now = Instant::now();
        let _ = other.receive(
            now,
            Bytes::from(fragment_message(2, &other_frame)),
            &mut out,
        );
        prop_assert_eq!(budget.used(), other.buffered_bytes());

        let mut rx = LinkReceiver::new(&cfg);
        let mut order: Vec<(u64, usize)> = (0..wire.len())
            .filter(|&i| !withheld[(wire[i].seq - 1) as usize])
            .map(|i| (order_keys.get(i).copied().unwrap_or(0), i))
            .collect();
        order.sort();
        for (_, i) in order {
            let result = rx.receive(now, wire[i].bytes.clone(), &mut out);
            prop_assert!(rx.buffered_bytes() <= max_bytes);
            prop_assert!(budget.used() <= shared);
            prop_assert_eq!(budget.used(), rx.buffered_bytes() + other.buffered_bytes());
            if let Err(err) = result {
                prop_assert!(
                    matches!(err, LinkError::MemoryBound { limit, .. } if limit == max_bytes)
                        || matches!(err, LinkError::SharedMemoryBound { limit, .. } if limit == shared),
                    "unexpected refusal: {:?}", err
                );
                break;
            }
        }
        drop(rx);
        prop_assert_eq!(budget.used(), other.buffered_bytes());
        drop(other);
        prop_assert_eq!(budget.used(), 0);
    }

    /// Not sequenced, with a frame limit: frames that fit pass through
    /// untouched (same buffers, both ways), larger ones are fragmented and
    /// reassembled; the order is kept.
    #[test]
    fn unsequenced_passes_small_frames_and_fragments_large_ones(
        (limit, specs) in limit_and_frames(24),
        lossy in any::<bool>(),
    ) {
        let cfg = config(limit, false, lossy, 64, Duration::from_millis(5), Duration::from_millis(5));
        let mut sender = LinkSender::new(&cfg).unwrap();
        let mut rx = LinkReceiver::new(&cfg);
        let now = Instant::now();
        let mut wire = Vec::new();
        let mut out = Vec::new();
        let mut originals = Vec::new();
        for (i, &(len, split)) in specs.iter().enumerate() {
            let frame = test_frame(i as u64 + 1, len, split);
            originals.push(frame.to_bytes());
            wire.clear();
            sender.prepare(frame.clone(), &mut wire).unwrap();
            if frame.len() <= limit {
                prop_assert_eq!(wire.len(), 1);
                prop_assert_eq!(wire[0].head.as_ptr(), frame.head.as_ptr());
                prop_assert_eq!(wire[0].head.len(), frame.head.len());
                prop_assert_eq!(wire[0].body.as_ptr(), frame.body.as_ptr());
                prop_assert_eq!(wire[0].body.len(), frame.body.len());
                let message = wire[0].to_bytes();
                let before = out.len();
                rx.receive(now, message.clone(), &mut out).unwrap();
                prop_assert_eq!(out.len(), before + 1);
                prop_assert_eq!(out[before].as_ptr(), message.as_ptr());
            } else {
                prop_assert!(wire.len() > 1);
                for piece in &wire {
                    prop_assert!(piece.len() <= limit);
                    rx.receive(now, piece.to_bytes(), &mut out).unwrap();
                }
            }
        }
        prop_assert_eq!(&out, &originals);
        let stats = rx.stats();
        prop_assert_eq!(stats.delivered, originals.len() as u64);
        prop_assert_eq!(stats.reassembled, sender.stats().fragmented);
        prop_assert_eq!(rx.buffered_bytes(), 0);
    }

    /// Arbitrary bytes never panic, in any mode, and are counted.
    #[test]
    fn garbage_never_panics(
        sequenced in any::<bool>(),
        lossy in any::<bool>(),
        messages in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..80), 0..40),
    ) {
        let cfg = config(1472, sequenced, lossy, 16, Duration::from_millis(5), Duration::from_millis(5));
        let mut rx = LinkReceiver::new(&cfg);
        let now = Instant::now();
        let mut out = Vec::new();
        let mut errors = 0;
        for m in &messages {
            if rx.receive(now, Bytes::from(m.clone()), &mut out).is_err() {
                errors += 1;
            }
        }
        // A reliable link may fail a gap left by refused messages.
        let _ = settle(&mut rx, now, &mut out);
        let stats = rx.stats();
        prop_assert_eq!(stats.messages, messages.len() as u64);
        prop_assert_eq!(stats.refused, errors);
        prop_assert_eq!(stats.delivered, out.len() as u64);
    }

    /// Valid wire frames with bytes flipped, truncated or extended never
    /// panic either; whatever is delivered is a whole frame by its prefix.
    #[test]
    fn corrupted_wire_frames_never_panic(
        sequenced in any::<bool>(),
        lossy in any::<bool>(),
        specs in frames(8),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..4), 0..64),
    ) {
        let limit = 1472;
        let cfg = config(limit, sequenced, lossy, 16, Duration::from_millis(5), Duration::from_millis(5));
        let mut sender = LinkSender::new(&cfg).unwrap();
        let mut rx = LinkReceiver::new(&cfg);
        let (_, wire) = send_all(&mut sender, &specs, limit);
        let now = Instant::now();
        let mut out = Vec::new();
        for (i, w) in wire.iter().enumerate() {
            let mut bytes = w.bytes.to_vec();
            if let Some(&(at, value, how)) = edits.get(i) {
                match how {
                    0 => {}
                    1 => {
                        let at = at % bytes.len();
                        bytes[at] ^= value | 1;
                    }
                    2 => bytes.truncate(at % bytes.len()),
                    _ => bytes.push(value),
                }
            }
            let _ = rx.receive(now, Bytes::from(bytes), &mut out);
        }
        // A reliable link may fail a gap left by refused messages.
        let _ = settle(&mut rx, now, &mut out);
        for frame in &out {
            let declared = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
            prop_assert_eq!(declared + 4, frame.len());
        }
    }
}
