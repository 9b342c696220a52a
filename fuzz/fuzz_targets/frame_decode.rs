//! The frame decoder on arbitrary bytes: it never panics, and whatever it
//! accepts encodes again, no longer than it came, into a frame that decodes
//! to the same value. The in-place view of data frames (`peek_routed`)
//! accepts exactly the publish and message frames the decoder accepts, with
//! the same fields, and otherwise fails with the same error.
//!
//! The first input byte picks the mode: raw bytes, or one of a set of valid
//! frames with bytes overwritten (3 input bytes per edit: position, value)
//! and its length prefix fixed, which gets mutants past the length check
//! into the frame bodies. A run that decodes opens without panicking, and
//! what it opens into is the run's bytes again, frame by frame.

#![no_main]

use std::sync::OnceLock;

use bytes::Bytes;
use efabus_core::codec::{self, CodecLimits};
use efabus_core::frame::{
    Credit, DeliveryClass, Dropped, ErrorCode, ErrorFrame, Fragment, Frame, Goodbye, Message,
    Publish, RouteHello, RouteLimits, RoutePeers, Subscribe, PROTOCOL_VERSION,
};
use libfuzzer_sys::fuzz_target;

fn bases() -> &'static [Vec<u8>] {
    static BASES: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    BASES.get_or_init(|| {
        let frames = [
            Frame::Publish(Publish {
                subject: "orders.eu.new".into(),
                reply: Some("_INBOX.1".into()),
                seq: 7,
                headers: Some(Bytes::from_static(b"NATS/1.0\r\nA: b\r\n\r\n")),
                payload: Bytes::from_static(b"payload"),
            }),
            Frame::Message(Message {
                sid: 3,
                subject: "a.b".into(),
                reply: None,
                seq: 1,
                headers: None,
                payload: Bytes::from_static(b"xyz"),
            }),
            Frame::Fragment(Fragment {
                msg_id: 9,
                index: 1,
                count: 3,
                total_len: 40,
                data: Bytes::from_static(b"0123456789"),
            }),
            Frame::Credit(Credit {
                messages: 10,
                bytes: 4096,
                ack_seq: 5,
            }),
            Frame::Subscribe(Subscribe {
                sid: 4,
                pattern: "metrics.>".into(),
                queue: Some("workers".into()),
                class: DeliveryClass::BestEffort,
            }),
            Frame::Unsubscribe { sid: 4 },
            Frame::Probe {
                nonce: 12,
                sent_through: 40,
            },
            Frame::Ping { nonce: 11 },
            Frame::Error(ErrorFrame {
                code: ErrorCode::InvalidSubject,
                text: "bad".into(),
                fatal: false,
            }),
            Frame::Goodbye(Goodbye {
                reason: "bye".into(),
            }),
            Frame::Route(RouteHello {
                broker_id: 7,
                advertise: Some("tcp/127.0.0.1:7420".into()),
                seeded: false,
                limits: RouteLimits {
                    max_payload: 1 << 20,
                    max_subject_len: 512,
                    max_subject_tokens: 32,
                },
            }),
            Frame::RoutePeers(RoutePeers {
                addresses: vec!["tcp/10.0.0.2:7420".into()],
            }),
            Frame::Dropped(Dropped {
                sid: 3,
                count: 1 << 20,
            }),
            Frame::best_effort_closed(17, 20, 1, "3 pings there went unanswered".into()),
            Frame::BestEffortReopen { epoch: 2 },
            Frame::Run(Bytes::from(
                [
                    codec::encode(&Frame::Ping { nonce: 1 }).to_bytes(),
                    codec::encode(&Frame::Unsubscribe { sid: 2 }).to_bytes(),
                ]
                .concat(),
            )),
        ];
        frames
            .iter()
            .map(|f| codec::encode(f).to_bytes().to_vec())
            .collect()
    })
}

fn mutate(base: &[u8], edits: &[u8]) -> Vec<u8> {
    let mut frame = base.to_vec();
    let mut edits = edits.chunks_exact(3);
    if let Some(first) = edits.next() {
        let len = u16::from_le_bytes([first[0], first[1]]) as usize;
        if first[2] & 1 == 1 && len >= 5 {
            frame.resize(len.min(base.len() * 2), first[2]);
        }
    }
    for edit in edits {
        let at = u16::from_le_bytes([edit[0], edit[1]]) as usize;
        if let Some(byte) = frame.get_mut(at.max(4)) {
            *byte = edit[2];
        }
    }
    if frame.len() >= 4 {
        let declared = (frame.len() - 4) as u32;
        frame[..4].copy_from_slice(&declared.to_le_bytes());
    }
    frame
}

fuzz_target!(|data: &[u8]| {
    let input = match data {
        [mode, which, edits @ ..] if mode % 2 == 1 => {
            let bases = bases();
            mutate(&bases[usize::from(*which) % bases.len()], edits)
        }
        [_, rest @ ..] => rest.to_vec(),
        [] => return,
    };
    let tight = CodecLimits {
        max_frame: 1024,
        max_subject_len: 16,
    };
    for limits in [CodecLimits::default(), tight] {
        let decoded = codec::decode(Bytes::copy_from_slice(&input), &limits);
        let peeked = codec::peek_routed(&input, &limits);
        let known = match &decoded {
            Ok(Frame::Publish(p)) => p.subject.clone(),
            Ok(Frame::Message(m)) => m.subject.clone(),
            _ => String::from("orders.eu.new"),
        };
        assert_eq!(codec::peek_routed_known(&input, &limits, &known), peeked);
        match (&decoded, &peeked) {
            (Ok(Frame::Publish(p)), Ok(Some(view))) => {
                assert_eq!(view.subject, p.subject);
                assert_eq!(view.reply, p.reply.as_deref());
                assert_eq!(view.seq, p.seq);
                let parts = (p.headers.as_deref(), &p.payload[..]);
                assert_eq!(view.headers_and_body(), parts);
            }
            (Ok(Frame::Message(m)), Ok(Some(view))) => {
                assert_eq!(view.subject, m.subject);
                assert_eq!(view.reply, m.reply.as_deref());
                assert_eq!((view.sid, view.seq), (m.sid, m.seq));
                let parts = (m.headers.as_deref(), &m.payload[..]);
                assert_eq!(view.headers_and_body(), parts);
            }
            (Ok(Frame::Publish(_) | Frame::Message(_)), _) => panic!("view refused {decoded:?}"),
            (Ok(_), Ok(None)) => {}
            (Err(_), Ok(None)) => assert!(!matches!(
                input.get(4).copied().and_then(codec::FrameKind::from_byte),
                Some(codec::FrameKind::Publish | codec::FrameKind::Message)
            )),
            (Err(a), Err(b)) => assert_eq!(a, b),
            _ => panic!("decode gave {decoded:?}, the view {peeked:?}"),
        }
        let Ok(frame) = decoded else {
            continue;
        };
        if let Frame::Run(frames) = &frame {
            let mut opened = Vec::new();
            if codec::open_run(frames, &mut opened).is_ok() {
                assert_eq!(opened.concat(), frames[..]);
            } else {
                assert!(opened.is_empty());
            }
        }
        let out = codec::try_encode(&frame).expect("a decoded frame encodes");
        assert_eq!(
            codec::encoded_len(&frame).expect("a decoded frame has a length"),
            out.len()
        );
        // A hello of another version decodes to its version alone, filled
        // out with empty fields, which can encode longer than it came.
        let other_version =
            matches!(&frame, Frame::Hello(hello) if hello.version != PROTOCOL_VERSION);
        assert!(
            other_version || out.len() <= input.len(),
            "re-encoding grew the frame: {} > {}",
            out.len(),
            input.len()
        );
        let again = codec::decode(out.to_bytes(), &limits).expect("the re-encoded frame decodes");
        assert_eq!(again, frame);
    }
});
