//! The link layer on concrete cases: the EFA numbers from the fixture,
//! zero-copy piece layout, the tail of a lossy link, and each refusal.

mod link_common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::budget::MemoryBudget;
use efabus_core::caps::{negotiate, parse_fi_info_dump, Offer};
use efabus_core::codec::{
    self, encode, fragment_head, try_encode, DecodeError, FrameKind, FRAGMENT_OVERHEAD,
};
use efabus_core::fragment::{ReassemblyConfig, ReassemblyError};
use efabus_core::frame::{Fragment, Frame};
use efabus_core::link::{LinkConfig, LinkError, LinkReceiver, LinkSender, LinkTuning};
use efabus_core::reorder::ReorderError;
use efabus_core::transport::OutFrame;
use link_common::{config, frame_id, settle, test_frame};

const EFA: &str = include_str!("fixtures/efa-fi_info-v.txt");

fn efa_host(id: u8) -> Vec<Offer> {
    let infos = parse_fi_info_dump(EFA).expect("fixture parses");
    vec![
        Offer::from_info("efa-rdm", &infos[0], vec![id; 32]),
        Offer::from_info("efa-dgram", &infos[1], vec![id ^ 0x80; 32]),
    ]
}

fn fragment_bytes(msg_id: u64, index: u32, count: u32, total_len: u32, data: &[u8]) -> Bytes {
    encode(&Frame::Fragment(Fragment {
        msg_id,
        index,
        count,
        total_len,
        data: Bytes::copy_from_slice(data),
    }))
    .to_bytes()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn efa_dgram_wire_frames_fit_8888_bytes() {
    let negotiated = negotiate(&efa_host(1), &efa_host(2), &["efa-rdm", "efa-dgram"]).unwrap();
    let params = negotiated.best_effort.expect("a datagram link").params;
    // What the endpoint reports: max_msg_size 8928 minus the 40 B prefix.
    let cfg = LinkConfig::from_params(&params, 8928 - 40, &LinkTuning::default());
    assert_eq!(cfg.frame_limit, 8888);
    assert!(cfg.sequenced && cfg.lossy);

    let mut tx = LinkSender::new(&cfg).unwrap();
    let mut rx = LinkReceiver::new(&cfg);
    let now = Instant::now();
    let sizes = [
        13,
        100,
        8888,
        8889,
        8888 - FRAGMENT_OVERHEAD,
        65_536,
        1 << 20,
    ];
    let mut wire = Vec::new();
    let mut delivered = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        let frame = test_frame(i as u64 + 1, len, 61);
        wire.clear();
        tx.prepare(frame.clone(), &mut wire).unwrap();
        let expected_pieces = len.div_ceil(8888 - FRAGMENT_OVERHEAD);
        assert_eq!(wire.len(), expected_pieces, "frame of {len} bytes");
        for piece in &wire {
            assert!(piece.len() <= 8888, "wire frame of {} bytes", piece.len());
            rx.receive(now, piece.to_bytes(), &mut delivered).unwrap();
        }
        assert_eq!(delivered.last(), Some(&frame.to_bytes()));
    }
    assert_eq!(delivered.len(), sizes.len());
    assert_eq!(tx.next_sequence(), sizes.len() as u64 + 1);
}

#[test]
fn efa_rdm_without_sas_wraps_each_frame_without_copying_its_payload() {
    let negotiated = negotiate(&efa_host(1), &efa_host(2), &["efa-rdm"]).unwrap();
    let cfg = LinkConfig::from_params(&negotiated.reliable.params, 8 << 20, &LinkTuning::default());
    assert!(cfg.sequenced && !cfg.lossy);
    assert_eq!(cfg.frame_limit, 8 << 20);

    let mut tx = LinkSender::new(&cfg).unwrap();
    let frame = test_frame(7, 100_000, 40);
    let mut wire = Vec::new();
    tx.prepare(frame.clone(), &mut wire).unwrap();
    assert_eq!(wire.len(), 1);
    assert_eq!(wire[0].head.len(), FRAGMENT_OVERHEAD + 40);
    assert_eq!(&wire[0].head[FRAGMENT_OVERHEAD..], &frame.head[..]);
    assert_eq!(wire[0].body.as_ptr(), frame.body.as_ptr());
    assert_eq!(wire[0].body.len(), frame.body.len());

    // The receiver hands back a slice of the received buffer.
    let mut rx = LinkReceiver::new(&cfg);
    let message = wire[0].to_bytes();
    let mut out = Vec::new();
    rx.receive(Instant::now(), message.clone(), &mut out)
        .unwrap();
    assert_eq!(out, vec![frame.to_bytes()]);
    assert_eq!(out[0].as_ptr(), message[FRAGMENT_OVERHEAD..].as_ptr());
}

#[test]
fn pieces_share_the_frame_buffers_except_the_spanning_one() {
    let cfg = config(1472, true, true, 64, ms(10), ms(10));
    let mut tx = LinkSender::new(&cfg).unwrap();
    let frame = test_frame(1, 65_536, 3000);
    let within = |piece: &OutFrame, buf: &Bytes| {
        let (start, end) = (buf.as_ptr() as usize, buf.as_ptr() as usize + buf.len());
        let p = piece.body.as_ptr() as usize;
        start <= p && p + piece.body.len() <= end
    };
    let mut wire = Vec::new();
    tx.prepare(frame.clone(), &mut wire).unwrap();
    let spanning: Vec<usize> = (0..wire.len())
        .filter(|&i| wire[i].head.len() != FRAGMENT_OVERHEAD)
        .collect();
    // 3000 is not a multiple of the chunk, so exactly one piece spans.
    assert_eq!(spanning.len(), 1);
    for (i, piece) in wire.iter().enumerate() {
        assert!(
            within(piece, &frame.head) || within(piece, &frame.body),
            "piece {i}"
        );
    }
    let joined: Vec<u8> = wire
        .iter()
        .flat_map(|p| {
            let mut all = p.head[FRAGMENT_OVERHEAD..].to_vec();
            all.extend_from_slice(&p.body);
            all
        })
        .collect();
    assert_eq!(joined, frame.to_bytes());
}

#[test]
fn fragment_head_matches_the_encoder() {
    let data = Bytes::from(vec![9u8; 300]);
    let f = Fragment {
        msg_id: 0x0102_0304_0506_0708,
        index: 3,
        count: 9,
        total_len: 2500,
        data: data.clone(),
    };
    let encoded = try_encode(&Frame::Fragment(f.clone())).unwrap();
    let head = fragment_head(
        &Fragment {
            data: Bytes::new(),
            ..f
        },
        data.len(),
    )
    .unwrap();
    assert_eq!(&head[..], &encoded.head[..]);
    assert!(fragment_head(&tiny_fragment(), u32::MAX as usize).is_err());
}

/// A one-byte, one-piece fragment header.
fn tiny_fragment() -> Fragment {
    Fragment {
        msg_id: 1,
        index: 0,
        count: 1,
        total_len: 1,
        data: Bytes::new(),
    }
}

/// Both ends of a lossy, sequenced link whose pieces carry 16 bytes, with
/// these gap and reassembly timeouts.
fn small_piece_lossy_link(gap: Duration, reassembly: Duration) -> (LinkSender, LinkReceiver) {
    let cfg = config(FRAGMENT_OVERHEAD + 16, true, true, 64, gap, reassembly);
    (LinkSender::new(&cfg).unwrap(), LinkReceiver::new(&cfg))
}

/// A message partly received, the sequence due with nothing behind it,
/// is given up at the gap timeout (the sender's credits may be stopped at
/// it), counted once; a piece of it arriving later is dropped as settled.
#[test]
fn a_lost_tail_is_settled_and_counted() {
    // Sequence 1 arrives whole; of sequence 2 one piece of two; 3 never.
    let (mut tx, mut rx) = small_piece_lossy_link(ms(10), ms(50));
    let mut wire = Vec::new();
    tx.prepare(test_frame(1, 16, 16), &mut wire).unwrap();
    tx.prepare(test_frame(2, 32, 32), &mut wire).unwrap();
    tx.prepare(test_frame(3, 16, 16), &mut wire).unwrap();
    assert_eq!(wire.len(), 4);

    let t0 = Instant::now();
    let mut out = Vec::new();
    rx.receive(t0, wire[0].to_bytes(), &mut out).unwrap();
    rx.receive(t0, wire[1].to_bytes(), &mut out).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(rx.partial_messages(), 1);
    // The partial message is the sequence due, with nothing behind it:
    // given up at the gap timeout, not the reassembly timeout.
    assert_eq!(rx.next_deadline(), Some(t0 + ms(10)));
    rx.poll(t0 + ms(9), &mut out).unwrap();
    assert_eq!(rx.partial_messages(), 1);
    rx.poll(t0 + ms(10), &mut out).unwrap();
    assert_eq!((rx.partial_messages(), rx.buffered_bytes()), (0, 0));
    let stats = rx.stats();
    assert_eq!((stats.lost, stats.expired_partials), (1, 1));
    assert_eq!(rx.expected_sequence(), Some(3));
    assert_eq!(rx.next_deadline(), None);

    // The missing piece arriving now is dropped as settled.
    rx.receive(t0 + ms(60), wire[2].to_bytes(), &mut out)
        .unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(rx.stats().duplicates, 1);
    assert_eq!(frame_id(&out[0]), 1);
}

/// The same once the message's last piece has come: the sender sent all
/// of it, so the piece still missing is given up after a twentieth of the
/// gap timeout (`LAST_PIECE_WAIT_SHARE`), and the link goes on.
#[test]
fn a_message_missing_a_piece_before_its_last_is_settled_sooner() {
    use efabus_core::link::LAST_PIECE_WAIT_SHARE;
    // Sequence 1 of three pieces: the middle one is lost.
    let (mut tx, mut rx) = small_piece_lossy_link(ms(100), ms(500));
    let mut wire = Vec::new();
    tx.prepare(test_frame(1, 40, 40), &mut wire).unwrap();
    tx.prepare(test_frame(2, 16, 16), &mut wire).unwrap();
    assert_eq!(wire.len(), 4, "three pieces, then one");
    let t0 = Instant::now();
    let mut out = Vec::new();
    rx.receive(t0, wire[0].to_bytes(), &mut out).unwrap();
    // With only its first piece, the message waits the whole timeout.
    assert_eq!(rx.next_deadline(), Some(t0 + ms(100)));
    rx.receive(t0, wire[2].to_bytes(), &mut out).unwrap();
    let sooner = t0 + ms(100) / LAST_PIECE_WAIT_SHARE;
    assert!(sooner < t0 + ms(10), "a small share of the timeout");
    assert_eq!(rx.next_deadline(), Some(sooner));
    rx.poll(sooner - Duration::from_micros(1), &mut out)
        .unwrap();
    assert_eq!(rx.partial_messages(), 1, "not before");
    rx.poll(sooner, &mut out).unwrap();
    assert_eq!(rx.partial_messages(), 0);
    assert_eq!(rx.stats().lost, 1);
    // What the sender's credits let through next is delivered.
    rx.receive(sooner, wire[3].to_bytes(), &mut out).unwrap();
    assert_eq!(
        out.iter().map(|frame| frame_id(frame)).collect::<Vec<_>>(),
        [2]
    );
}

/// Pieces reordered behind the last one are waited for while they keep
/// coming within that share of the timeout of each other.
#[test]
fn pieces_reordered_behind_the_last_still_complete_their_message() {
    use efabus_core::link::LAST_PIECE_WAIT_SHARE;
    let (mut tx, mut rx) = small_piece_lossy_link(ms(100), ms(500));
    let mut wire = Vec::new();
    tx.prepare(test_frame(1, 40, 40), &mut wire).unwrap();
    assert_eq!(wire.len(), 3);
    let share = ms(100) / LAST_PIECE_WAIT_SHARE;
    let step = share - Duration::from_micros(1);
    let t0 = Instant::now();
    let mut out = Vec::new();
    let mut at = t0;
    for piece in [2, 0, 1] {
        rx.poll(at, &mut out).unwrap();
        rx.receive(at, wire[piece].to_bytes(), &mut out).unwrap();
        at += step;
    }
    rx.poll(at, &mut out).unwrap();
    assert_eq!(
        out.iter().map(|frame| frame_id(frame)).collect::<Vec<_>>(),
        [1]
    );
    assert_eq!(rx.stats().lost, 0);
}

#[test]
fn a_gap_before_an_abandoned_message_is_skipped_after_the_gap_timeout() {
    // 1 never arrives, one piece of 2 does and expires: 1 and 2 are lost.
    let (mut tx, mut rx) = small_piece_lossy_link(ms(10), ms(50));
    let mut wire = Vec::new();
    tx.prepare(test_frame(1, 16, 16), &mut wire).unwrap();
    tx.prepare(test_frame(2, 32, 32), &mut wire).unwrap();
    let t0 = Instant::now();
    let mut out = Vec::new();
    rx.receive(t0, wire[1].to_bytes(), &mut out).unwrap();
    rx.poll(t0 + ms(50), &mut out).unwrap();
    assert_eq!(rx.stats().lost, 0);
    assert_eq!(rx.next_deadline(), Some(t0 + ms(60)));
    rx.poll(t0 + ms(60), &mut out).unwrap();
    assert!(out.is_empty());
    assert_eq!(rx.stats().lost, 2);
    assert_eq!(rx.expected_sequence(), Some(3));
}

#[test]
fn reliable_links_refuse_beyond_the_window_and_keep_partials_being_filled() {
    let cfg = config(1472, true, false, 4, ms(1), ms(1));
    let mut rx = LinkReceiver::new(&cfg);
    let frame = test_frame(1, 20, 20).to_bytes();
    let t0 = Instant::now();
    let mut out = Vec::new();
    let err = rx
        .receive(t0, fragment_bytes(5, 0, 1, 20, &frame), &mut out)
        .unwrap_err();
    assert_eq!(
        err,
        LinkError::Reorder(ReorderError::WindowExceeded {
            seq: 5,
            expected: 1,
            capacity: 4
        })
    );
    assert_eq!(rx.stats().window_exceeded, 1);
    assert_eq!(rx.buffered_bytes(), 0);

    // A partial message is kept, never expired, while its pieces keep
    // coming within the reassembly timeout (1 ms here) of each other; a
    // reliable link fails only when they stop (see
    // `a_reliable_gap_being_filled_is_waited_for`).
    rx.receive(t0, fragment_bytes(1, 0, 2, 20, &frame[..10]), &mut out)
        .unwrap();
    assert_eq!(rx.next_deadline(), Some(t0 + ms(1)));
    rx.poll(t0 + Duration::from_micros(500), &mut out).unwrap();
    assert_eq!(rx.partial_messages(), 1);
    rx.receive(
        t0 + Duration::from_micros(900),
        fragment_bytes(1, 1, 2, 20, &frame[10..]),
        &mut out,
    )
    .unwrap();
    assert_eq!(out, vec![frame]);
    assert_eq!(rx.stats().lost, 0);
    assert_eq!(rx.next_deadline(), None);
}

#[test]
fn reassembly_budget_is_an_error_on_reliable_links_and_a_loss_on_lossy_ones() {
    for lossy in [false, true] {
        let mut cfg = config(1472, true, lossy, 64, ms(10), ms(50));
        cfg.reassembly = ReassemblyConfig {
            max_messages: 1,
            timeout: ms(50),
            ..ReassemblyConfig::default()
        };
        let mut rx = LinkReceiver::new(&cfg);
        let t0 = Instant::now();
        let mut out = Vec::new();
        let a = test_frame(1, 40, 40).to_bytes();
        let b = test_frame(2, 40, 40).to_bytes();
        rx.receive(t0, fragment_bytes(1, 0, 2, 40, &a[..20]), &mut out)
            .unwrap();
        let second = rx.receive(t0, fragment_bytes(2, 0, 2, 40, &b[..20]), &mut out);
        assert_eq!(rx.stats().over_budget, 1);
        if lossy {
            assert_eq!(second, Ok(()));
            settle(&mut rx, t0, &mut out).unwrap();
            assert_eq!(rx.stats().lost, 2);
            assert_eq!(rx.buffered_bytes(), 0);
        } else {
            assert!(matches!(
                second,
                Err(LinkError::Reassembly(ReassemblyError::OverBudget {
                    msg_id: 2,
                    ..
                }))
            ));
        }
    }
}

#[test]
fn malformed_messages_are_refused_with_the_reason() {
    let seq = config(1472, true, true, 16, ms(10), ms(10));
    let plain = config(1472, false, true, 16, ms(10), ms(10));
    let now = Instant::now();
    let mut out = Vec::new();
    let frame = test_frame(1, 20, 20).to_bytes();

    let mut rx = LinkReceiver::new(&plain);
    let cases: Vec<(Bytes, LinkError)> = vec![
        (
            Bytes::from_static(&[1, 0]),
            DecodeError::Truncated {
                needed: 5,
                available: 2,
            }
            .into(),
        ),
        (Bytes::from_static(&[0, 0, 0, 0]), DecodeError::Empty.into()),
        (
            Bytes::from_static(&[3, 0, 0, 0, 0x10]),
            DecodeError::LengthMismatch {
                declared: 3,
                actual: 1,
            }
            .into(),
        ),
        (
            Bytes::from_static(&[1, 0, 0, 0, 0x7f]),
            DecodeError::UnknownKind(0x7f).into(),
        ),
        // Fragment fields that contradict each other.
        (
            fragment_bytes(1, 2, 2, 20, &frame[..10]),
            LinkError::Reassembly(ReassemblyError::Invalid {
                msg_id: 1,
                index: 2,
                count: 2,
                reason: "index not below count",
            }),
        ),
        // Pieces that join into something that is not a frame.
        (
            fragment_bytes(2, 0, 1, 3, b"abc"),
            LinkError::BadFrame {
                msg_id: 2,
                reason: DecodeError::Truncated {
                    needed: 5,
                    available: 3,
                }
                .to_string(),
            },
        ),
        // A fragment inside a fragment.
        (
            {
                let inner = fragment_bytes(9, 0, 1, 20, &frame);
                fragment_bytes(3, 0, 1, inner.len() as u32, &inner)
            },
            LinkError::NestedFragment,
        ),
    ];
    let n = cases.len() as u64;
    for (message, expected) in cases {
        assert_eq!(rx.receive(now, message, &mut out), Err(expected));
    }
    assert!(out.is_empty());
    assert_eq!(rx.stats().refused, n);

    let mut rx = LinkReceiver::new(&seq);
    assert_eq!(
        rx.receive(now, frame.clone(), &mut out),
        Err(LinkError::Unsequenced {
            kind: FrameKind::Publish
        })
    );
    assert_eq!(
        rx.receive(now, fragment_bytes(0, 0, 1, 20, &frame), &mut out),
        Err(LinkError::ZeroSequence)
    );
    // A bad frame still settles its sequence: the next one flows.
    assert!(rx
        .receive(now, fragment_bytes(1, 0, 1, 3, b"abc"), &mut out)
        .is_err());
    rx.receive(now, fragment_bytes(2, 0, 1, 20, &frame), &mut out)
        .unwrap();
    assert_eq!(out, vec![frame]);
    assert_eq!(rx.stats().lost, 1);
}

#[test]
fn the_sender_refuses_what_it_cannot_carry() {
    let small = config(FRAGMENT_OVERHEAD, true, true, 16, ms(1), ms(1));
    assert_eq!(
        LinkSender::new(&small).unwrap_err(),
        LinkError::FrameLimitTooSmall {
            limit: FRAGMENT_OVERHEAD,
            min: FRAGMENT_OVERHEAD + 1
        }
    );
    for sequenced in [false, true] {
        let cfg = config(1472, sequenced, false, 16, ms(1), ms(1));
        let mut tx = LinkSender::new(&cfg).unwrap();
        let mut out = Vec::new();
        assert_eq!(
            tx.prepare(OutFrame::default(), &mut out),
            Err(LinkError::EmptyFrame)
        );
        let nested = codec::encode(&Frame::Fragment(tiny_fragment()));
        assert_eq!(tx.prepare(nested, &mut out), Err(LinkError::NestedFragment));
        assert!(out.is_empty());
        assert_eq!(tx.stats().frames, 0);
    }
}

#[test]
fn stale_partials_dropped_for_room_are_a_loss_or_an_error() {
    for lossy in [false, true] {
        let mut cfg = config(1472, true, lossy, 64, ms(10), ms(50));
        cfg.reassembly = ReassemblyConfig {
            max_messages: 1,
            timeout: ms(50),
            ..ReassemblyConfig::default()
        };
        let mut rx = LinkReceiver::new(&cfg);
        let t0 = Instant::now();
        let mut out = Vec::new();
        let a = test_frame(1, 40, 40).to_bytes();
        let b = test_frame(2, 40, 40).to_bytes();
        rx.receive(t0, fragment_bytes(1, 0, 2, 40, &a[..20]), &mut out)
            .unwrap();
        // Message 1 is idle for the timeout: making room for 2 drops it.
        let second = rx.receive(t0 + ms(50), fragment_bytes(2, 0, 2, 40, &b[..20]), &mut out);
        assert_eq!(rx.stats().expired_partials, 1);
        if lossy {
            assert_eq!(second, Ok(()));
            rx.receive(t0 + ms(51), fragment_bytes(2, 1, 2, 40, &b[20..]), &mut out)
                .unwrap();
            settle(&mut rx, t0, &mut out).unwrap();
            assert_eq!(out, vec![b]);
            assert_eq!((rx.stats().lost, rx.stats().delivered), (1, 1));
        } else {
            assert_eq!(second, Err(LinkError::ReliableLoss { count: 1 }));
        }
    }
}

#[test]
fn an_unbounded_frame_limit_is_capped_to_what_the_wire_can_express() {
    let cfg = config(usize::MAX, true, false, 16, ms(1), ms(1));
    let mut tx = LinkSender::new(&cfg).unwrap();
    let mut wire = Vec::new();
    tx.prepare(test_frame(1, 5000, 100), &mut wire).unwrap();
    assert_eq!(wire.len(), 1);
    let mut rx = LinkReceiver::new(&cfg);
    let mut out = Vec::new();
    rx.receive(Instant::now(), wire[0].to_bytes(), &mut out)
        .unwrap();
    assert_eq!(out, vec![test_frame(1, 5000, 100).to_bytes()]);
}

/// A lossy link that really lost a long run (far beyond the window) still
/// follows the sender once several pieces agree on the new position; a lone
/// far piece (as a corrupted sequence number would be) is refused instead.
#[test]
fn lossy_link_follows_a_long_real_gap_but_not_a_lone_far_piece() {
    let cfg = config(
        1472,
        true,
        true,
        8,
        Duration::from_millis(100),
        Duration::from_secs(1),
    );
    let mut tx = LinkSender::new(&cfg).expect("sender");
    let mut rx = LinkReceiver::new(&cfg);
    let now = Instant::now();
    let mut wire = Vec::new();
    for id in 0..1400u64 {
        tx.prepare(test_frame(id, 64, 64), &mut wire)
            .expect("prepare");
    }
    assert_eq!(wire.len(), 1400, "small frames: one piece each");
    let mut out = Vec::new();
    for piece in &wire[..3] {
        rx.receive(now, piece.to_bytes(), &mut out)
            .expect("in window");
    }
    // One piece far ahead alone is refused and moves nothing.
    assert!(rx.receive(now, wire[1200].to_bytes(), &mut out).is_err());
    rx.receive(now, wire[3].to_bytes(), &mut out)
        .expect("still in order");
    assert_eq!(
        out.iter().map(|f| frame_id(f)).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    // Everything from 4 to 1349 is lost; from 1350 on the pieces agree.
    out.clear();
    for piece in &wire[1350..] {
        let _ = rx.receive(now, piece.to_bytes(), &mut out);
    }
    settle(&mut rx, now, &mut out).unwrap();
    let ids: Vec<u64> = out.iter().map(|f| frame_id(f)).collect();
    assert!(
        ids.len() >= 45 && ids.windows(2).all(|w| w[0] < w[1]) && ids[ids.len() - 1] == 1399,
        "the link follows the sender after the gap: {ids:?}"
    );
}

/// Sequences count up from 1, so a piece numbered near the end of the
/// range is not a real one, however often it comes: a lossy link refuses
/// it rather than skip towards it (which ran the next expected sequence
/// past `u64::MAX` and counted about 2^64 frames lost).
#[test]
fn a_lossy_link_refuses_sequences_at_the_end_of_the_range() {
    let cfg = config(1472, true, true, 8, ms(10), Duration::from_secs(1));
    let mut rx = LinkReceiver::new(&cfg);
    let now = Instant::now();
    let mut out = Vec::new();
    for _ in 0..3 {
        let piece = fragment_bytes(u64::MAX, 0, 1, 8, &[0; 8]);
        assert!(rx.receive(now, piece, &mut out).is_err(), "refused");
    }
    rx.poll(now + ms(20), &mut out).expect("nothing held");
    rx.poll(now + ms(40), &mut out).expect("nothing held");
    assert!(out.is_empty());
    assert_eq!(rx.stats().lost, 0, "{:?}", rx.stats());
    // The link carries on from where it was.
    let mut tx = LinkSender::new(&cfg).expect("sender");
    let mut wire = Vec::new();
    tx.prepare(test_frame(0, 64, 64), &mut wire)
        .expect("prepare");
    rx.receive(now + ms(50), wire[0].to_bytes(), &mut out)
        .expect("sequence 1");
    assert_eq!(out.len(), 1);
}

/// The early skip must be reachable: with its credits stopped at a gap,
/// a peer sends at most the piece window it was granted, so the distance
/// is half of that, however many receives the endpoints posted.
#[test]
fn the_skip_distance_fits_the_window_the_peer_is_granted() {
    let negotiated = negotiate(&efa_host(1), &efa_host(2), &["efa-rdm", "efa-dgram"]).unwrap();
    let mut params = negotiated.best_effort.expect("a datagram link").params;
    for (queues, distance) in [(256, 128), (2048, 1024), (4096, 1024), (8192, 1024)] {
        params.recv_window = queues;
        let cfg = LinkConfig::from_params(&params, 8928 - 40, &LinkTuning::default());
        assert_eq!(cfg.piece_limit(), 2048, "twice the 1,024 reassembly slots");
        assert_eq!(cfg.skip_distance, distance, "{queues} posted receives");
    }
}

/// On a lossy link a missing sequence is given up once `skip_distance`
/// pieces of later sequences have been taken since it became due (and
/// frames wait behind it), without the gap timeout: the sender, whose
/// credits stop at the gap, need not wait. Repeated pieces do not count.
#[test]
fn a_lossy_gap_is_given_up_after_skip_distance_pieces() {
    let mut cfg = config(1472, true, true, 64, Duration::from_secs(3600), ms(1000));
    cfg.skip_distance = 4;
    let mut tx = LinkSender::new(&cfg).expect("sender");
    let mut rx = LinkReceiver::new(&cfg);
    let now = Instant::now();
    // Frame 2 in three pieces, the others in one.
    let wire = wire_frames_sized(&mut tx, 8, |id| if id == 2 { 4000 } else { 64 });
    assert_eq!(wire[1].len(), 3);
    let mut out = Vec::new();
    rx.receive(now, wire[0][0].clone(), &mut out).unwrap();
    // Two of frame 2's pieces; the third is lost.
    for piece in &wire[1][..2] {
        rx.receive(now, piece.clone(), &mut out).unwrap();
    }
    for frame in &wire[2..5] {
        rx.receive(now, frame[0].clone(), &mut out).unwrap();
        rx.receive(now, frame[0].clone(), &mut out).unwrap();
    }
    let ids = |out: &Vec<Bytes>| out.iter().map(|f| frame_id(f)).collect::<Vec<_>>();
    assert_eq!(
        ids(&out),
        [1],
        "three pieces behind the gap: it is waited for"
    );
    assert_eq!(rx.partial_messages(), 1);
    rx.receive(now, wire[5][0].clone(), &mut out).unwrap();
    assert_eq!(ids(&out), [1, 3, 4, 5, 6], "the fourth gives it up");
    assert_eq!(
        (rx.partial_messages(), rx.buffered_bytes()),
        (0, 0),
        "frame 2's pieces can no longer complete: freed"
    );
    for frame in &wire[6..] {
        rx.receive(now, frame[0].clone(), &mut out).unwrap();
    }
    rx.receive(now, wire[1][2].clone(), &mut out).unwrap();
    assert_eq!(
        ids(&out),
        [1, 3, 4, 5, 6, 7, 8],
        "the late piece is dropped"
    );
    assert_eq!(rx.stats().lost, 1);
}

/// A message with more pieces than the skip distance, one of them lost:
/// its own later pieces pass the missing one, so it is given up once
/// `skip_distance` of them have come, though no later message is whole
/// (with the sender's credits stopped at the gap, none may come until
/// then). Pieces that come in order pass nothing.
#[test]
fn a_piece_lost_from_a_message_larger_than_the_skip_distance_is_given_up() {
    let mut cfg = config(1472, true, true, 64, Duration::from_secs(3600), ms(1000));
    cfg.skip_distance = 4;
    let mut tx = LinkSender::new(&cfg).expect("sender");
    let mut rx = LinkReceiver::new(&cfg);
    let now = Instant::now();
    let wire = wire_frames_sized(&mut tx, 3, |id| if id == 2 { 12_000 } else { 64 });
    let pieces = &wire[1];
    assert!(pieces.len() >= 8, "{} pieces", pieces.len());
    let mut out = Vec::new();
    rx.receive(now, wire[0][0].clone(), &mut out).unwrap();
    // Piece 1 is lost; pieces 2 to 4 pass it, three of the four needed.
    for piece in [&pieces[0], &pieces[2], &pieces[3], &pieces[4]] {
        rx.receive(now, piece.clone(), &mut out).unwrap();
    }
    assert_eq!((rx.stats().lost, rx.partial_messages()), (0, 1));
    rx.receive(now, pieces[5].clone(), &mut out).unwrap();
    assert_eq!(
        (rx.stats().lost, rx.partial_messages(), rx.buffered_bytes()),
        (1, 0, 0),
        "the fourth piece past the lost one gives the message up"
    );
    for piece in &pieces[6..] {
        rx.receive(now, piece.clone(), &mut out).unwrap();
    }
    rx.receive(now, wire[2][0].clone(), &mut out).unwrap();
    let ids = out.iter().map(|f| frame_id(f)).collect::<Vec<_>>();
    assert_eq!(ids, [1, 3], "the rest of frame 2 is late, frame 3 goes on");
    assert_eq!(rx.stats().lost, 1);
}

/// What a lossy link holds unsettled is what it would lose if it ended
/// now: frames waiting behind a gap, partial messages and the missing
/// sequences up to the highest seen, none of them delivered or counted.
#[test]
fn a_lossy_link_counts_what_it_holds_unsettled() {
    let cfg = config(1472, true, true, 64, Duration::from_secs(3600), ms(1000));
    let mut tx = LinkSender::new(&cfg).expect("sender");
    let mut rx = LinkReceiver::new(&cfg);
    let now = Instant::now();
    let wire = wire_frames_sized(&mut tx, 5, |id| if id == 5 { 4000 } else { 64 });
    let mut out = Vec::new();
    assert_eq!(rx.unsettled(), 0);
    rx.receive(now, wire[0][0].clone(), &mut out).unwrap();
    assert_eq!(rx.unsettled(), 0, "delivered");
    // 2 missing, 3 waiting, 4 missing, 5 partial.
    rx.receive(now, wire[2][0].clone(), &mut out).unwrap();
    rx.receive(now, wire[4][0].clone(), &mut out).unwrap();
    assert_eq!((out.len(), rx.held(), rx.partial_messages()), (1, 1, 1));
    assert_eq!(rx.unsettled(), 4);
    assert_eq!(rx.stats().lost, 0);
    // Sequence 2 arrives: 2 and 3 are delivered.
    rx.receive(now, wire[1][0].clone(), &mut out).unwrap();
    assert_eq!(out.len(), 3);
    assert_eq!(rx.unsettled(), 2);
    // A reliable link holds nothing it could lose.
    let reliable = LinkReceiver::new(&config(1472, true, false, 64, ms(100), ms(1000)));
    assert_eq!(reliable.unsettled(), 0);
}

/// The sender's probe says how far it sent: a lost tail, which no later
/// frame reveals, is counted lost a gap timeout after the probe (and the
/// gap's own timeout after that), but a frame of it that comes meanwhile
/// is delivered; a claim behind what came changes nothing, one past the
/// window settles the window's sequences.
#[test]
fn a_probe_settles_the_lost_tail_it_announces() {
    let gap = ms(10);
    let cfg = config(1472, true, true, 64, gap, ms(1000));
    let mut tx = LinkSender::new(&cfg).expect("sender");
    let mut rx = LinkReceiver::new(&cfg);
    let wire = wire_frames_sized(&mut tx, 5, |_| 64);
    let t0 = Instant::now();
    let mut out = Vec::new();
    rx.receive(t0, wire[0][0].clone(), &mut out).unwrap();
    rx.receive(t0, wire[1][0].clone(), &mut out).unwrap();
    assert_eq!(out.len(), 2);
    // Without a probe nothing past sequence 2 is known, nothing is due.
    rx.poll(t0 + ms(500), &mut out).unwrap();
    assert_eq!((rx.stats().lost, rx.next_deadline()), (0, None));
    // A claim behind what came is ignored.
    rx.note_sent_through(2, t0);
    assert_eq!(rx.next_deadline(), None);
    // Sent through 5: 3 comes before the probe's wait is over, 4 and 5
    // never do.
    rx.note_sent_through(5, t0);
    assert_eq!(rx.next_deadline(), Some(t0 + gap));
    rx.receive(t0 + ms(5), wire[2][0].clone(), &mut out)
        .unwrap();
    assert_eq!(out.len(), 3);
    rx.poll(t0 + ms(9), &mut out).unwrap();
    assert_eq!(rx.stats().lost, 0, "not yet");
    rx.poll(t0 + gap, &mut out).unwrap();
    let settled_at = rx.next_deadline().expect("the tail's gap is timed");
    assert!(settled_at <= t0 + gap + gap, "{settled_at:?}");
    rx.poll(settled_at, &mut out).unwrap();
    let stats = rx.stats();
    assert_eq!((out.len(), stats.lost, stats.delivered), (3, 2, 3));
    assert_eq!(rx.expected_sequence(), Some(6));
    assert_eq!(rx.unsettled(), 0);
    // A frame of the tail coming later still is dropped as settled.
    rx.receive(settled_at + ms(1), wire[4][0].clone(), &mut out)
        .unwrap();
    assert_eq!((out.len(), rx.stats().duplicates), (3, 1));
    // A claim past the window (of 64, from sequence 6) settles 6 to 69.
    let t1 = settled_at + ms(2);
    rx.note_sent_through(u64::MAX, t1);
    let mut at = t1;
    while let Some(next) = rx.next_deadline().filter(|_| at < t1 + ms(100)) {
        at = next;
        rx.poll(at, &mut out).unwrap();
    }
    assert_eq!(rx.stats().lost, 2 + 64);
    assert_eq!(rx.expected_sequence(), Some(70));
    // Closing on the sender's word: what it sent past the window is
    // unsettled, lost with the link, up to 64 windows (of 64) past the
    // next sequence due.
    rx.settle_at_close(100);
    assert_eq!(rx.unsettled(), 100 - 70 + 1);
    rx.settle_at_close(u64::MAX);
    assert_eq!(rx.unsettled(), 64 * 64 + 1);
}

/// A gap given up by its timeout while a piece is being received (not at
/// a poll) frees the partial message of the missing sequence at once.
#[test]
fn a_partial_message_given_up_on_the_way_in_is_freed_at_once() {
    let mut cfg = config(1472, true, true, 64, ms(10), ms(1000));
    cfg.skip_distance = 1000;
    let mut tx = LinkSender::new(&cfg).expect("sender");
    let mut rx = LinkReceiver::new(&cfg);
    let wire = wire_frames_sized(&mut tx, 4, |id| if id == 2 { 4000 } else { 64 });
    let now = Instant::now();
    let mut out = Vec::new();
    rx.receive(now, wire[0][0].clone(), &mut out).unwrap();
    rx.receive(now, wire[1][0].clone(), &mut out).unwrap();
    rx.receive(now, wire[2][0].clone(), &mut out).unwrap();
    assert_eq!((rx.partial_messages(), rx.held()), (1, 1));
    // Frame 3 has waited out the gap timeout when frame 4 comes.
    rx.receive(now + ms(20), wire[3][0].clone(), &mut out)
        .unwrap();
    assert_eq!(
        out.iter().map(|f| frame_id(f)).collect::<Vec<_>>(),
        [1, 3, 4]
    );
    assert_eq!(
        (rx.partial_messages(), rx.buffered_bytes()),
        (0, 0),
        "frame 2's piece freed without waiting for a poll"
    );
}

/// Wire frames for frames `1..=count` of `len` bytes each.
fn wire_frames(tx: &mut LinkSender, count: u64, len: usize) -> Vec<Vec<Bytes>> {
    wire_frames_sized(tx, count, |_| len)
}

/// Wire frames for frames `1..=count`, frame `id` of `len(id)` bytes.
fn wire_frames_sized(
    tx: &mut LinkSender,
    count: u64,
    len: impl Fn(u64) -> usize,
) -> Vec<Vec<Bytes>> {
    (1..=count)
        .map(|id| {
            let mut wire = Vec::new();
            tx.prepare(test_frame(id, len(id), 64), &mut wire).unwrap();
            wire.iter().map(OutFrame::to_bytes).collect()
        })
        .collect()
}

/// A peer that withholds sequence 1 and sends large frames behind it
/// makes a reliable receiver hold them: whole (one piece each) or in
/// pieces, it fails at its memory bound, naming it, and never holds more.
#[test]
fn a_withheld_sequence_fails_the_reliable_link_at_its_memory_bound() {
    const BOUND: usize = 1 << 20;
    const LEN: usize = 100_000;
    for frame_limit in [1 << 20, 8888] {
        let mut cfg = config(frame_limit, true, false, 4096, ms(10), ms(10));
        cfg.reassembly.max_bytes = BOUND;
        let mut tx = LinkSender::new(&cfg).unwrap();
        let mut rx = LinkReceiver::new(&cfg);
        let frames = wire_frames(&mut tx, 40, LEN);
        let now = Instant::now();
        let mut out = Vec::new();
        let mut failure = None;
        'frames: for (index, pieces) in frames.iter().enumerate().skip(1) {
            for piece in pieces {
                let result = rx.receive(now, piece.clone(), &mut out);
                assert!(
                    rx.buffered_bytes() <= BOUND,
                    "limit {frame_limit}: {} bytes held",
                    rx.buffered_bytes()
                );
                if let Err(err) = result {
                    failure = Some((index as u64 + 1, err));
                    break 'frames;
                }
            }
        }
        let (seq, err) = failure.expect("the bound is reached");
        assert!(out.is_empty(), "nothing passes the withheld sequence");
        // Ten frames fit in 1 MiB (partials reserve a little more than a
        // frame), so the twelfth sequence is the first refused.
        assert_eq!(seq, 12, "limit {frame_limit}");
        match err {
            LinkError::MemoryBound {
                needed,
                held,
                limit,
            } => {
                assert_eq!(limit, BOUND);
                assert!(held <= BOUND && held + needed > BOUND, "{held} + {needed}");
                assert!(err.to_string().contains("reassembly.max_bytes"), "{err}");
            }
            other => panic!("limit {frame_limit}: expected the memory bound, got {other:?}"),
        }
        assert_eq!(rx.stats().over_budget, 1);
        assert_eq!(rx.held(), 10);
    }
}

/// Two receivers sharing a budget hold no more than it together: the one
/// that would cross it fails naming the shared bound; what is delivered
/// or dropped (frames waiting, partial messages) is given back.
#[test]
fn receivers_sharing_a_budget_stay_within_it_and_give_it_back() {
    const LIMIT: usize = 1 << 20;
    const LEN: usize = 100_000;
    let budget = MemoryBudget::new(LIMIT);
    let mut cfg = config(1 << 20, true, false, 4096, ms(10), ms(10));
    cfg.memory = budget.clone();
    let mut tx_a = LinkSender::new(&cfg).unwrap();
    let mut tx_b = LinkSender::new(&cfg).unwrap();
    let mut a = LinkReceiver::new(&cfg);
    let mut b = LinkReceiver::new(&cfg);
    let frames_a = wire_frames(&mut tx_a, 8, LEN);
    let frames_b = wire_frames(&mut tx_b, 20, LEN);
    let now = Instant::now();
    let mut out = Vec::new();
    for pieces in &frames_a[1..7] {
        a.receive(now, pieces[0].clone(), &mut out).unwrap();
    }
    assert_eq!(budget.used(), a.buffered_bytes());
    assert_eq!(a.buffered_bytes(), 6 * LEN);
    let mut refused = None;
    for pieces in &frames_b[1..] {
        match b.receive(now, pieces[0].clone(), &mut out) {
            Ok(()) => {}
            Err(err) => {
                refused = Some(err);
                break;
            }
        }
        assert!(budget.used() <= LIMIT);
    }
    assert_eq!(b.buffered_bytes(), 4 * LEN);
    assert_eq!(budget.used(), 10 * LEN);
    assert_eq!(
        refused,
        Some(LinkError::SharedMemoryBound {
            needed: LEN,
            used: 10 * LEN,
            limit: LIMIT
        })
    );

    // Delivered frames give their memory back.
    a.receive(now, frames_a[0][0].clone(), &mut out).unwrap();
    assert_eq!(out.len(), 7);
    assert_eq!((a.buffered_bytes(), budget.used()), (0, 4 * LEN));
    // A partial message reserves its whole length; dropping the receiver
    // gives that back, as it does the frames waiting.
    let mut small = config(8888, true, false, 4096, ms(10), ms(10));
    small.memory = budget.clone();
    let mut tx_c = LinkSender::new(&small).unwrap();
    let mut c = LinkReceiver::new(&small);
    let frames_c = wire_frames(&mut tx_c, 1, LEN);
    c.receive(now, frames_c[0][0].clone(), &mut out).unwrap();
    assert_eq!(c.partial_messages(), 1);
    assert_eq!(budget.used(), 4 * LEN + c.buffered_bytes());
    assert!(c.buffered_bytes() > LEN);
    drop(c);
    assert_eq!(budget.used(), 4 * LEN);
    drop(b);
    assert_eq!(budget.used(), 0);
}

/// On a lossy link the bounds give a frame up rather than fail: it is
/// counted as over budget and as lost, and the link carries on.
#[test]
fn a_lossy_link_gives_up_what_exceeds_its_memory_and_counts_it() {
    const LEN: usize = 100_000;
    let mut cfg = config(1 << 20, true, true, 4096, ms(10), ms(10));
    cfg.reassembly.max_bytes = 3 * LEN;
    let mut tx = LinkSender::new(&cfg).unwrap();
    let mut rx = LinkReceiver::new(&cfg);
    let frames = wire_frames(&mut tx, 6, LEN);
    let t0 = Instant::now();
    let mut out = Vec::new();
    for pieces in &frames[1..] {
        rx.receive(t0, pieces[0].clone(), &mut out).unwrap();
        assert!(rx.buffered_bytes() <= 3 * LEN);
    }
    // Sequences 2 to 4 are held, 5 and 6 given up; the gap timeout then
    // settles 1.
    settle(&mut rx, t0, &mut out).unwrap();
    let ids: Vec<u64> = out.iter().map(|f| frame_id(f)).collect();
    assert_eq!(ids, [2, 3, 4]);
    let stats = rx.stats();
    assert_eq!((stats.over_budget, stats.lost), (2, 3));
    assert_eq!(rx.buffered_bytes(), 0);
}

/// A reliable link waits for a missing sequence, but not for ever: once a
/// frame has waited the gap timeout behind it, the poll at the deadline
/// fails the link, and not one before; the failure stays and is counted
/// once.
#[test]
fn a_reliable_gap_fails_the_link_at_its_deadline_and_not_before() {
    let cfg = config(1472, true, false, 64, ms(250), ms(50));
    let mut tx = LinkSender::new(&cfg).unwrap();
    let mut rx = LinkReceiver::new(&cfg);
    let frames = wire_frames(&mut tx, 4, 100);
    let t0 = Instant::now();
    let mut out = Vec::new();
    assert_eq!(rx.next_deadline(), None);
    rx.receive(t0, frames[1][0].clone(), &mut out).unwrap();
    assert_eq!(rx.next_deadline(), Some(t0 + ms(250)));
    rx.receive(t0 + ms(100), frames[2][0].clone(), &mut out)
        .unwrap();
    // The oldest frame waiting sets the deadline.
    assert_eq!(rx.next_deadline(), Some(t0 + ms(250)));
    rx.poll(t0 + ms(249), &mut out).unwrap();
    rx.receive(t0 + ms(249), frames[3][0].clone(), &mut out)
        .unwrap();
    assert!(out.is_empty());
    assert_eq!(rx.stats().gap_failures, 0);

    let expected = LinkError::GapTimeout {
        missing: 1,
        held: 3,
        waited: ms(250),
    };
    assert_eq!(rx.poll(t0 + ms(250), &mut out), Err(expected.clone()));
    assert!(expected.to_string().contains("sequence 1 still missing"));
    // The missing frame arriving late does not revive the link.
    assert_eq!(
        rx.receive(t0 + ms(250), frames[0][0].clone(), &mut out),
        Err(expected.clone())
    );
    assert!(out.is_empty());
    assert_eq!(rx.poll(t0 + ms(900), &mut out), Err(expected));
    let stats = rx.stats();
    assert_eq!((stats.gap_failures, stats.lost, stats.delivered), (1, 0, 0));
}

/// What the owner hands over before it polls counts, however late: the
/// missing frame received after the deadline fills the gap. An owner
/// held up well past the deadline (more than the timeout) could not watch
/// the gap: the gap gets a fresh timeout rather than failing at once.
#[test]
fn a_reliable_gap_is_judged_when_the_owner_polls_on_time() {
    let cfg = config(1472, true, false, 64, ms(250), ms(50));
    let mut tx = LinkSender::new(&cfg).unwrap();
    let frames = wire_frames(&mut tx, 2, 100);
    let t0 = Instant::now();
    let mut out = Vec::new();

    let mut rx = LinkReceiver::new(&cfg);
    rx.receive(t0, frames[1][0].clone(), &mut out).unwrap();
    rx.receive(t0 + ms(300), frames[0][0].clone(), &mut out)
        .unwrap();
    rx.poll(t0 + ms(300), &mut out).unwrap();
    assert_eq!(out.iter().map(|f| frame_id(f)).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(rx.next_deadline(), None);

    let mut rx = LinkReceiver::new(&cfg);
    rx.receive(t0, frames[1][0].clone(), &mut out).unwrap();
    assert_eq!(rx.next_deadline(), Some(t0 + ms(250)));
    // Late by the timeout: still judged.
    let mut late = LinkReceiver::new(&cfg);
    late.receive(t0, frames[1][0].clone(), &mut out).unwrap();
    assert!(late.poll(t0 + ms(500), &mut out).is_err());
    // Later than that: held up, so a fresh timeout from now.
    rx.poll(t0 + ms(501), &mut out).unwrap();
    assert_eq!(rx.next_deadline(), Some(t0 + ms(751)));
    rx.poll(t0 + ms(750), &mut out).unwrap();
    assert!(matches!(
        rx.poll(t0 + ms(751), &mut out),
        Err(LinkError::GapTimeout { missing: 1, .. })
    ));
}

/// A gap that fills in time clears the deadline; pieces of a large missing
/// frame arriving restart its clock (it is being filled), pieces of frames
/// behind the waiting one do not. A partial message with nothing behind
/// it is timed by the reassembly timeout from its last piece: a peer that
/// sends first pieces only cannot hold their memory for ever.
#[test]
fn a_reliable_gap_being_filled_is_waited_for() {
    let cfg = config(FRAGMENT_OVERHEAD + 100, true, false, 64, ms(250), ms(1000));
    let mut tx = LinkSender::new(&cfg).unwrap();
    let mut rx = LinkReceiver::new(&cfg);
    let mut frames = Vec::new();
    for (id, len) in [(1, 1000), (2, 50), (3, 1000)] {
        let mut wire = Vec::new();
        tx.prepare(test_frame(id, len, 64), &mut wire).unwrap();
        frames.push(wire.iter().map(OutFrame::to_bytes).collect::<Vec<_>>());
    }
    assert_eq!(frames.iter().map(Vec::len).collect::<Vec<_>>(), [10, 1, 10]);
    let t0 = Instant::now();
    let mut out = Vec::new();
    rx.receive(t0, frames[1][0].clone(), &mut out).unwrap();
    assert_eq!(rx.next_deadline(), Some(t0 + ms(250)));
    // A piece of frame 3, behind the waiting frame 2: no progress on the gap.
    rx.receive(t0 + ms(100), frames[2][0].clone(), &mut out)
        .unwrap();
    assert_eq!(rx.next_deadline(), Some(t0 + ms(250)));
    // A piece of frame 1, the missing one: its clock starts again.
    rx.receive(t0 + ms(200), frames[0][0].clone(), &mut out)
        .unwrap();
    assert_eq!(rx.next_deadline(), Some(t0 + ms(450)));
    // The same piece again is no progress.
    rx.receive(t0 + ms(300), frames[0][0].clone(), &mut out)
        .unwrap();
    assert_eq!(rx.next_deadline(), Some(t0 + ms(450)));
    rx.poll(t0 + ms(449), &mut out).unwrap();
    for piece in &frames[0][1..] {
        rx.receive(t0 + ms(449), piece.clone(), &mut out).unwrap();
    }
    let ids: Vec<u64> = out.iter().map(|f| frame_id(f)).collect();
    assert_eq!(ids, [1, 2]);
    assert_eq!(rx.stats().gap_failures, 0);
    // Frame 3 is partial with nothing behind it: its last piece came at
    // 100 ms, so it fails at 1100 ms, and not before.
    assert_eq!(rx.next_deadline(), Some(t0 + ms(1100)));
    rx.poll(t0 + ms(1099), &mut out).unwrap();
    let failed = rx.poll(t0 + ms(1100), &mut out);
    assert!(
        matches!(
            failed,
            Err(LinkError::PartialTimeout {
                msg_id: 3,
                received: 1,
                count: 10,
                ..
            })
        ),
        "{failed:?}"
    );
    assert_eq!(out.len(), 2);
    assert_eq!(rx.stats().gap_failures, 1);
}
