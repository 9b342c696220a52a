//! The link layer's receiver driven by a script: pieces of real frames
//! (cut by a `LinkSender` at a small frame limit) delivered in any order,
//! duplicated, skipped, corrupted or cut short, with time advancing, on
//! every combination of sequenced and lossy links. Nothing panics;
//! delivered frames are whole; without damage they are original frames,
//! each at most once, in sequence order on sequenced links; memory stays
//! within its bounds; a lossy receiver, once settled, holds nothing.

#![no_main]

use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::budget::MemoryBudget;
use efabus_core::codec;
use efabus_core::fragment::ReassemblyConfig;
use efabus_core::frame::{Frame, Publish};
use efabus_core::link::{LinkConfig, LinkReceiver, LinkSender};
use efabus_core::transport::OutFrame;
use libfuzzer_sys::fuzz_target;

const FRAMES: u64 = 12;
const WINDOW: usize = 8;
const MAX_BYTES: usize = 8 << 10;

fn frame(id: u64) -> Bytes {
    let len = [0usize, 40, 300, 700][(id % 4) as usize];
    codec::encode(&Frame::Publish(Publish {
        headers: None,
        subject: "fuzz.link".into(),
        reply: None,
        seq: id,
        payload: vec![id as u8; len].into(),
    }))
    .to_bytes()
}

fn id_of(frame: &Bytes) -> Option<u64> {
    match codec::decode(frame.clone(), &codec::CodecLimits::default()) {
        Ok(Frame::Publish(p)) => Some(p.seq),
        _ => None,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, script)) = data.split_first() else {
        return;
    };
    let config = LinkConfig {
        frame_limit: 128 + usize::from(mode >> 2) * 8,
        sequenced: mode & 1 == 1,
        lossy: mode & 2 == 2,
        gap_timeout: Duration::from_millis(10),
        reliable_gap_timeout: Duration::from_millis(10),
        reorder_window: WINDOW,
        skip_distance: WINDOW / 2,
        reassembly: ReassemblyConfig {
            max_bytes: MAX_BYTES,
            max_messages: 4,
            max_frame: 4096,
            timeout: Duration::from_millis(20),
            done_window: 16,
        },
        memory: MemoryBudget::unlimited(),
    };
    let mut sender = LinkSender::new(&config).expect("limit holds a fragment");
    let originals: Vec<Bytes> = (0..FRAMES).map(frame).collect();
    let mut pieces: Vec<OutFrame> = Vec::new();
    for original in &originals {
        sender
            .prepare(OutFrame::whole(original.clone()), &mut pieces)
            .expect("prepare");
    }
    let pieces: Vec<Bytes> = pieces.iter().map(OutFrame::to_bytes).collect();

    let mut receiver = LinkReceiver::new(&config);
    let start = Instant::now();
    let mut now = start;
    let mut out = Vec::new();
    let mut damaged = false;
    for op in script.chunks(3) {
        let (kind, a, b) = (op[0], op.get(1).copied(), op.get(2).copied());
        let piece = a.map(|a| pieces[usize::from(a) % pieces.len()].clone());
        match (kind % 4, piece) {
            (0 | 1, Some(piece)) => {
                let _ = receiver.receive(now, piece, &mut out);
            }
            (2, Some(piece)) => {
                // Damage: flip one byte, or cut the piece short.
                let mut bytes = piece.to_vec();
                let b = usize::from(b.unwrap_or(0));
                if kind & 0x80 == 0 {
                    let at = b % bytes.len();
                    bytes[at] ^= kind | 1;
                } else {
                    bytes.truncate(b % bytes.len());
                }
                damaged = true;
                let _ = receiver.receive(now, bytes.into(), &mut out);
            }
            _ => {
                now += Duration::from_millis(u64::from(kind >> 2));
                // A reliable link may fail a gap: the fuzzer carries on.
                let _ = receiver.poll(now, &mut out);
            }
        }
        // Partial messages and frames waiting share one bound.
        assert!(
            receiver.buffered_bytes() <= MAX_BYTES,
            "buffered {}",
            receiver.buffered_bytes()
        );
        assert!(receiver.held() <= WINDOW);
        assert!(receiver.partial_messages() <= 4);
    }
    if config.lossy {
        let mut later = now + Duration::from_secs(3600);
        receiver.poll(later, &mut out).expect("lossy");
        for _ in 0..8 {
            match receiver.next_deadline() {
                Some(deadline) => {
                    later = later.max(deadline);
                    receiver.poll(later, &mut out).expect("lossy");
                }
                None => break,
            }
        }
        assert_eq!(receiver.next_deadline(), None, "settles");
        assert_eq!(receiver.buffered_bytes(), 0);
        assert_eq!(receiver.partial_messages(), 0);
        assert_eq!(receiver.held(), 0);
    }
    for frame in &out {
        assert!(frame.len() >= 5);
        let declared = u32::from_le_bytes(frame[..4].try_into().expect("prefix")) as usize;
        assert_eq!(declared + 4, frame.len(), "a whole frame");
    }
    if damaged {
        return;
    }
    let ids: Vec<u64> = out
        .iter()
        .map(|f| id_of(f).expect("an original frame"))
        .collect();
    for (frame, id) in out.iter().zip(&ids) {
        assert_eq!(frame, &originals[*id as usize], "frame {id} altered");
    }
    // Unsequenced links pass frames that fit through as they come (the link
    // below them keeps order and drops nothing); sequenced ones restore the
    // order and deliver each frame once.
    if config.sequenced {
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "out of order or twice: {ids:?}"
        );
    }
});
