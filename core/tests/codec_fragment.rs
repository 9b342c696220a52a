//! Fragmentation and reassembly against a model: frames cut into pieces,
//! pieces shuffled, duplicated and dropped, sent through the codec; only
//! whole original frames come out, each at most once, within the memory
//! bounds, and stale partial messages are freed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::codec::{decode, encode, CodecLimits, FRAGMENT_OVERHEAD};
use efabus_core::fragment::{
    FragmentError, Fragmenter, Reassembler, ReassemblyConfig, ReassemblyError,
};
use efabus_core::frame::{Fragment, Frame};
use efabus_core::transport::OutFrame;
use proptest::prelude::*;

/// A distinct frame per index: the index is written at its head.
fn original(index: usize, len: usize) -> Bytes {
    let mut bytes: Vec<u8> = (0..len).map(|i| (i * 31 + index * 7) as u8).collect();
    let tag = (index as u32).to_le_bytes();
    let n = tag.len().min(len);
    bytes[..n].copy_from_slice(&tag[..n]);
    bytes.into()
}

/// What happens to one piece on the way.
#[derive(Debug, Clone, Copy)]
struct Fate {
    drop: bool,
    duplicate: bool,
    order_key: u32,
}

fn fate(drop_pct: u32) -> impl Strategy<Value = Fate> {
    (0u32..100, 0u32..100, any::<u32>()).prop_map(move |(d, dup, order_key)| Fate {
        drop: d < drop_pct,
        duplicate: dup < 15,
        order_key,
    })
}

struct Delivery {
    frame_index: usize,
    fragment: Fragment,
}

/// Fragments each frame, encodes/decodes every piece through the codec (as
/// the link would), and orders the surviving copies by the given fates.
fn deliver(frames: &[Bytes], frame_limit: usize, fates: &[Fate]) -> (Vec<Delivery>, Vec<bool>) {
    let mut fragmenter = Fragmenter::new();
    let limits = CodecLimits::default();
    let mut keyed = Vec::new();
    let mut complete = vec![true; frames.len()];
    let mut k = 0;
    for (frame_index, frame) in frames.iter().enumerate() {
        let pieces = fragmenter
            .fragment(&OutFrame::whole(frame.clone()), frame_limit)
            .expect("limit leaves room");
        for piece in pieces {
            let wire = encode(&Frame::Fragment(piece)).to_bytes();
            assert!(wire.len() <= frame_limit, "encoded fragment over the limit");
            let Ok(Frame::Fragment(fragment)) = decode(wire, &limits) else {
                panic!("fragment did not decode");
            };
            let f = fates[k % fates.len()];
            k += 1;
            if f.drop {
                complete[frame_index] = false;
                continue;
            }
            let copies = if f.duplicate { 2 } else { 1 };
            for c in 0..copies {
                keyed.push((
                    f.order_key.wrapping_add(c * 7919),
                    keyed.len(),
                    Delivery {
                        frame_index,
                        fragment: fragment.clone(),
                    },
                ));
            }
        }
    }
    keyed.sort_by_key(|(key, seq, _)| (*key, *seq));
    (keyed.into_iter().map(|(_, _, d)| d).collect(), complete)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Generous bounds: every frame with all pieces delivered comes out once,
    /// no other does, and nothing is left behind after expiry.
    #[test]
    fn reassembles_exactly_the_complete_frames(
        lens in proptest::collection::vec(1usize..6000, 1..8),
        frame_limit in (FRAGMENT_OVERHEAD + 1)..1600,
        fates in proptest::collection::vec(fate(10), 1..64),
        peers in 1u8..3,
    ) {
        let frames: Vec<Bytes> = lens.iter().enumerate().map(|(i, &n)| original(i, n)).collect();
        let (deliveries, complete) = deliver(&frames, frame_limit, &fates);
        let config = ReassemblyConfig {
            timeout: Duration::from_secs(10),
            ..ReassemblyConfig::default()
        };
        let mut reassembler = Reassembler::new(config.clone());
        let start = Instant::now();
        let mut out: HashMap<(u8, usize), usize> = HashMap::new();
        for (step, d) in deliveries.iter().enumerate() {
            // Every peer sends the same stream, interleaved.
            for peer in 0..peers {
                let now = start + Duration::from_micros(step as u64);
                let got = reassembler.handle_fragment(now, peer, d.fragment.clone());
                let got = got.expect("valid pieces within budget");
                if let Some(whole) = got {
                    prop_assert_eq!(&whole, &frames[d.frame_index]);
                    *out.entry((peer, d.frame_index)).or_default() += 1;
                }
                prop_assert!(reassembler.in_flight_bytes() <= config.max_bytes);
            }
        }
        for peer in 0..peers {
            for (i, &whole) in complete.iter().enumerate() {
                let times = out.get(&(peer, i)).copied().unwrap_or(0);
                prop_assert_eq!(times, usize::from(whole), "frame {} peer {}", i, peer);
            }
        }
        let stats = *reassembler.stats();
        let completed = complete.iter().filter(|&&c| c).count() as u64 * u64::from(peers);
        prop_assert_eq!(stats.completed, completed);
        prop_assert_eq!(stats.invalid, 0);
        // Incomplete frames are held until the timeout, then freed.
        let end = start + Duration::from_micros(deliveries.len() as u64);
        prop_assert_eq!(reassembler.expire(end), 0);
        let incomplete_held = reassembler.partial_messages();
        let freed = reassembler.expire(end + config.timeout);
        prop_assert_eq!(freed, incomplete_held);
        prop_assert_eq!(reassembler.partial_messages(), 0);
        prop_assert_eq!(reassembler.in_flight_bytes(), 0);
        prop_assert_eq!(reassembler.next_deadline(), None);
    }

    /// Tight bounds: the budget is never exceeded, and whatever comes out is
    /// still a whole original frame, at most once.
    #[test]
    fn budget_is_respected(
        lens in proptest::collection::vec(100usize..4000, 1..10),
        frame_limit in (FRAGMENT_OVERHEAD + 16)..600,
        fates in proptest::collection::vec(fate(5), 1..64),
        max_bytes in 0usize..9000,
        max_messages in 0usize..4,
        timeout_us in 1u64..200,
    ) {
        let frames: Vec<Bytes> = lens.iter().enumerate().map(|(i, &n)| original(i, n)).collect();
        let (deliveries, _) = deliver(&frames, frame_limit, &fates);
        let config = ReassemblyConfig {
            max_bytes,
            max_messages,
            timeout: Duration::from_micros(timeout_us),
            ..ReassemblyConfig::default()
        };
        let mut reassembler = Reassembler::new(config);
        let start = Instant::now();
        let mut seen = vec![0usize; frames.len()];
        let mut over_budget = 0u64;
        for (step, d) in deliveries.iter().enumerate() {
            let now = start + Duration::from_micros(step as u64 * 3);
            match reassembler.handle_fragment(now, (), d.fragment.clone()) {
                Ok(Some(whole)) => {
                    prop_assert_eq!(&whole, &frames[d.frame_index]);
                    seen[d.frame_index] += 1;
                }
                Ok(None) => {}
                Err(ReassemblyError::OverBudget { .. }) => over_budget += 1,
                Err(err) => prop_assert!(false, "unexpected {}", err),
            }
            prop_assert!(reassembler.in_flight_bytes() <= max_bytes);
            prop_assert!(reassembler.partial_messages() <= max_messages);
            if step % 5 == 0 {
                reassembler.expire(now);
            }
        }
        prop_assert!(seen.iter().all(|&n| n <= 1));
        prop_assert_eq!(reassembler.stats().dropped_over_budget, over_budget);
    }

    /// Arbitrary fragment fields: no panic, bounds hold, invalid ones counted.
    #[test]
    fn arbitrary_fragments_are_safe(
        pieces in proptest::collection::vec(
            (0u64..4, 0u32..6, 0u32..6, 0u32..64, 0usize..40),
            1..80,
        ),
    ) {
        let config = ReassemblyConfig {
            max_bytes: 256,
            max_messages: 3,
            max_frame: 48,
            ..ReassemblyConfig::default()
        };
        let mut reassembler = Reassembler::new(config);
        let now = Instant::now();
        let mut invalid = 0u64;
        for (msg_id, index, count, total_len, len) in pieces {
            let fragment = Fragment { msg_id, index, count, total_len, data: Bytes::from(vec![7u8; len]) };
            match reassembler.handle_fragment(now, 0u32, fragment) {
                Ok(Some(whole)) => prop_assert_eq!(whole.len(), total_len as usize),
                Err(ReassemblyError::Invalid { .. }) => invalid += 1,
                _ => {}
            }
            prop_assert!(reassembler.in_flight_bytes() <= 256);
            prop_assert!(reassembler.partial_messages() <= 3);
        }
        prop_assert_eq!(reassembler.stats().invalid, invalid);
    }
}

#[test]
fn message_ids_increase_and_limits_are_checked() {
    let mut fragmenter = Fragmenter::new();
    let frame = OutFrame::whole(original(0, 100));
    let first = fragmenter.fragment(&frame, 60).expect("room");
    let second = fragmenter.fragment(&frame, 60).expect("room");
    assert_eq!((first.msg_id(), second.msg_id()), (1, 2));
    assert_eq!(first.len(), 100usize.div_ceil(60 - FRAGMENT_OVERHEAD));
    assert_eq!(
        fragmenter.fragment(&frame, FRAGMENT_OVERHEAD).err(),
        Some(FragmentError::LimitTooSmall {
            frame_limit: FRAGMENT_OVERHEAD,
            min: FRAGMENT_OVERHEAD + 1
        })
    );
    assert_eq!(
        fragmenter.fragment(&OutFrame::default(), 100).err(),
        Some(FragmentError::Empty)
    );
    assert!(Fragmenter::needs_fragmenting(1473, 1472));
    assert!(!Fragmenter::needs_fragmenting(1472, 1472));
}

#[test]
fn a_payload_body_is_fragmented_without_copying() {
    let payload = Bytes::from(vec![5u8; 10_000]);
    let frame = OutFrame {
        head: Bytes::from_static(b"0123456789"),
        body: payload.clone(),
    };
    let body_range = payload.as_ptr() as usize..payload.as_ptr() as usize + payload.len();
    let pieces: Vec<Fragment> = Fragmenter::new()
        .fragment(&frame, 1472)
        .expect("room")
        .collect();
    // All pieces but the first (which straddles head and body) point into
    // the payload's own buffer.
    for piece in &pieces[1..] {
        assert!(body_range.contains(&(piece.data.as_ptr() as usize)));
    }
    let mut reassembler = Reassembler::new(ReassemblyConfig::default());
    let now = Instant::now();
    let mut whole = None;
    for piece in pieces.into_iter().rev() {
        whole = reassembler.handle_fragment(now, 1u8, piece).expect("valid");
    }
    assert_eq!(whole, Some(frame.to_bytes()));
}

#[test]
fn expiry_frees_and_late_pieces_are_ignored() {
    let config = ReassemblyConfig {
        timeout: Duration::from_millis(100),
        ..ReassemblyConfig::default()
    };
    let mut reassembler = Reassembler::new(config);
    let frame = OutFrame::whole(original(3, 3000));
    let pieces: Vec<Fragment> = Fragmenter::new()
        .fragment(&frame, 1000)
        .expect("room")
        .collect();
    let t0 = Instant::now();
    assert_eq!(
        reassembler.handle_fragment(t0, 'p', pieces[0].clone()),
        Ok(None)
    );
    assert_eq!(reassembler.partial_messages(), 1);
    assert!(reassembler.in_flight_bytes() >= 3000);
    assert_eq!(
        reassembler.next_deadline(),
        Some(t0 + Duration::from_millis(100))
    );
    assert_eq!(reassembler.expire(t0 + Duration::from_millis(99)), 0);
    assert_eq!(reassembler.expire(t0 + Duration::from_millis(100)), 1);
    assert_eq!(reassembler.in_flight_bytes(), 0);
    // The rest arrives too late: dropped, counted, not held.
    for piece in &pieces[1..] {
        let t = t0 + Duration::from_millis(150);
        assert_eq!(reassembler.handle_fragment(t, 'p', piece.clone()), Ok(None));
    }
    assert_eq!(reassembler.partial_messages(), 0);
    let stats = *reassembler.stats();
    assert_eq!((stats.expired, stats.completed), (1, 0));
    assert_eq!(stats.late, pieces.len() as u64 - 1);
    // Removing the peer forgets its ids: the same message is accepted anew.
    reassembler.remove_peer(&'p');
    let mut whole = None;
    for piece in pieces {
        whole = reassembler.handle_fragment(t0, 'p', piece).expect("valid");
    }
    assert_eq!(whole, Some(frame.to_bytes()));
}

#[test]
fn done_window_bounds_memory_and_keeps_dedupe() {
    let config = ReassemblyConfig {
        done_window: 4,
        ..ReassemblyConfig::default()
    };
    let mut reassembler = Reassembler::new(config);
    let mut fragmenter = Fragmenter::new();
    let now = Instant::now();
    let mut all = Vec::new();
    for i in 0..10 {
        let pieces: Vec<Fragment> = fragmenter
            .fragment(&OutFrame::whole(original(i, 200)), 100)
            .expect("room")
            .collect();
        let mut got = None;
        for piece in &pieces {
            got = reassembler
                .handle_fragment(now, 0, piece.clone())
                .expect("valid");
        }
        assert!(got.is_some());
        all.extend(pieces);
    }
    // Replaying everything yields nothing, old ids included.
    for piece in all {
        assert_eq!(reassembler.handle_fragment(now, 0, piece), Ok(None));
    }
    assert_eq!(reassembler.stats().completed, 10);
    assert_eq!(reassembler.partial_messages(), 0);
}
