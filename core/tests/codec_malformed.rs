//! Hostile input to the codec: random bytes, mutated frames, forged lengths.
//! Decoding must return errors, never panic, and never allocate what a
//! forged length asks for.

mod codec_common;

use bytes::{BufMut, Bytes, BytesMut};
use codec_common::frame;
use efabus_core::codec::{
    decode, encode, frame_len, peek_routed, peek_routed_known, try_encode, CodecLimits,
    DecodeError, EncodeError, FrameKind, FrameReader, FLAG_REPLY, MAX_CONTROL_BODY, MAX_OFFERS,
};
use efabus_core::frame::{Frame, Goodbye, Publish, PROTOCOL_VERSION};
use proptest::prelude::*;

/// Wraps a kind byte and body in a correct length prefix.
fn framed(kind: u8, body: &[u8]) -> Bytes {
    let mut out = BytesMut::new();
    out.put_u32_le(body.len() as u32 + 1);
    out.put_u8(kind);
    out.extend_from_slice(body);
    out.freeze()
}

/// A decoded frame must survive another round trip unchanged.
fn assert_stable(frame: &Frame, limits: &CodecLimits) {
    let again = decode(encode(frame).to_bytes(), limits);
    assert_eq!(again.as_ref(), Ok(frame));
}

/// The in-place view accepts exactly the publish and message frames that
/// decode, with the same fields, and fails with the same error otherwise.
fn assert_view_agrees(bytes: &Bytes, limits: &CodecLimits) {
    let decoded = decode(bytes.clone(), limits);
    let peeked = peek_routed(bytes, limits);
    // A known subject, matching or not, changes nothing but where the
    // subject is borrowed from.
    let subject = match &decoded {
        Ok(Frame::Publish(p)) => p.subject.clone(),
        Ok(Frame::Message(m)) => m.subject.clone(),
        _ => "a.b".to_string(),
    };
    for known in [&subject[..], "a.b", ""] {
        assert_eq!(peek_routed_known(bytes, limits, known), peeked);
    }
    match (&decoded, &peeked) {
        (Ok(Frame::Publish(p)), Ok(Some(view))) => {
            assert_eq!(view.kind, FrameKind::Publish);
            assert_eq!(
                (view.subject, view.reply),
                (&p.subject[..], p.reply.as_deref())
            );
            assert_eq!(view.seq, p.seq);
            let parts = (p.headers.as_deref(), &p.payload[..]);
            assert_eq!(view.headers_and_body(), parts);
        }
        (Ok(Frame::Message(m)), Ok(Some(view))) => {
            assert_eq!(view.kind, FrameKind::Message);
            assert_eq!(
                (view.subject, view.reply),
                (&m.subject[..], m.reply.as_deref())
            );
            assert_eq!((view.sid, view.seq), (m.sid, m.seq));
            let parts = (m.headers.as_deref(), &m.payload[..]);
            assert_eq!(view.headers_and_body(), parts);
        }
        (Ok(Frame::Publish(_) | Frame::Message(_)), _) => {
            panic!("decoded as a data frame but peeked as {peeked:?}")
        }
        (Ok(_), Ok(None)) => {}
        (Err(a), Err(b)) => assert_eq!(a, b),
        (Err(_), Ok(None)) => {
            let kind = bytes.get(4).copied().and_then(FrameKind::from_byte);
            assert!(
                !matches!(kind, Some(FrameKind::Publish | FrameKind::Message)),
                "a malformed data frame passed the view: {decoded:?}"
            );
        }
        _ => panic!("decode gave {decoded:?} but the view {peeked:?}"),
    }
}

#[test]
fn absurd_declared_length_is_rejected_from_the_prefix() {
    let limits = CodecLimits::default();
    let prefix = 0xFFFF_FFF0u32.to_le_bytes();
    let expected = DecodeError::TooLarge {
        len: 0xFFFF_FFF0 + 4,
        max: limits.max_frame,
    };
    assert_eq!(frame_len(&prefix, &limits), Err(expected.clone()));
    assert_eq!(frame_len(&prefix[..3], &limits), Ok(None));

    let mut reader = FrameReader::new(limits);
    reader.push(&prefix);
    assert_eq!(reader.next_frame(), Err(expected.clone()));
    // Nothing was reserved for the declared frame.
    assert!(reader.read_buf().capacity() < 4096);
    // The stream cannot recover: the error stays.
    reader.push(&[0; 16]);
    assert_eq!(reader.next_frame(), Err(expected.clone()));

    assert_eq!(
        decode(Bytes::copy_from_slice(&prefix), &limits),
        Err(expected)
    );
}

#[test]
fn limit_is_inclusive_of_the_prefix() {
    let limits = CodecLimits {
        max_frame: 100,
        ..CodecLimits::default()
    };
    assert_eq!(frame_len(&96u32.to_le_bytes(), &limits), Ok(Some(100)));
    assert_eq!(
        frame_len(&97u32.to_le_bytes(), &limits),
        Err(DecodeError::TooLarge { len: 101, max: 100 })
    );
}

#[test]
fn structural_errors_are_reported() {
    let limits = CodecLimits::default();
    assert_eq!(
        decode(Bytes::from_static(&[0, 0, 0, 0]), &limits),
        Err(DecodeError::Empty)
    );
    assert_eq!(
        decode(Bytes::from_static(&[1, 0]), &limits),
        Err(DecodeError::Truncated {
            needed: 4,
            available: 2
        })
    );
    assert_eq!(
        decode(framed(0x7F, b""), &limits),
        Err(DecodeError::UnknownKind(0x7F))
    );

    let ping = encode(&Frame::Ping { nonce: 5 }).to_bytes();
    let mut longer = BytesMut::from(&ping[..]);
    longer.put_u8(0);
    assert_eq!(
        decode(longer.freeze(), &limits),
        Err(DecodeError::LengthMismatch {
            declared: ping.len() - 4,
            actual: ping.len() - 3
        })
    );
    let short = ping.slice(..ping.len() - 1);
    assert!(matches!(
        decode(short, &limits),
        Err(DecodeError::LengthMismatch { .. })
    ));

    // A valid ping body followed by a stray byte, correctly prefixed.
    let mut body = ping[5..].to_vec();
    body.push(0);
    assert_eq!(
        decode(framed(FrameKind::Ping as u8, &body), &limits),
        Err(DecodeError::TrailingBytes {
            kind: FrameKind::Ping,
            count: 1
        })
    );
}

fn publish_body(
    flags: u8,
    subject: &[u8],
    reply: &[u8],
    payload_len: u32,
    payload: &[u8],
) -> Bytes {
    let mut body = BytesMut::new();
    body.put_u64_le(1);
    body.put_u8(flags);
    body.put_u16_le(subject.len() as u16);
    body.put_u16_le(reply.len() as u16);
    body.put_u32_le(payload_len);
    body.extend_from_slice(subject);
    body.extend_from_slice(reply);
    body.extend_from_slice(payload);
    framed(FrameKind::Publish as u8, &body)
}

#[test]
fn data_frame_errors_are_reported() {
    let limits = CodecLimits {
        max_subject_len: 8,
        ..CodecLimits::default()
    };
    let ok = publish_body(FLAG_REPLY, b"a.b", b"r", 2, b"xy");
    assert_view_agrees(&ok, &limits);
    assert!(decode(ok, &limits).is_ok());
    for bad in [
        publish_body(0, b"a\xffb", b"", 0, b""),
        publish_body(FLAG_REPLY, b"a", b"\xc3", 0, b""),
        publish_body(0, b"a.b.c.d.e", b"", 0, b""),
        publish_body(0x82, b"a", b"", 0, b""),
        publish_body(0, b"a", b"r", 0, b""),
        publish_body(0, b"a", b"", 3, b"xy"),
        framed(FrameKind::Message as u8, &[0; 10]),
    ] {
        assert!(peek_routed(&bad, &limits).is_err());
        assert_view_agrees(&bad, &limits);
    }

    assert_eq!(
        decode(publish_body(0, b"a\xffb", b"", 0, b""), &limits),
        Err(DecodeError::InvalidUtf8 {
            kind: FrameKind::Publish,
            field: "subject"
        })
    );
    assert_eq!(
        decode(publish_body(FLAG_REPLY, b"a", b"\xc3", 0, b""), &limits),
        Err(DecodeError::InvalidUtf8 {
            kind: FrameKind::Publish,
            field: "reply subject"
        })
    );
    assert_eq!(
        decode(publish_body(0, b"a.b.c.d.e", b"", 0, b""), &limits),
        Err(DecodeError::FieldTooLong {
            kind: FrameKind::Publish,
            field: "subject",
            len: 9,
            max: 8
        })
    );
    assert_eq!(
        decode(publish_body(0x82, b"a", b"", 0, b""), &limits),
        Err(DecodeError::UnknownFlags {
            kind: FrameKind::Publish,
            flags: 0x82
        })
    );
    // A reply length without the reply flag is inconsistent.
    assert!(matches!(
        decode(publish_body(0, b"a", b"r", 0, b""), &limits),
        Err(DecodeError::UnknownFlags { .. })
    ));
    // payload_len disagreeing with what follows, both ways.
    for declared in [1, 3, u32::MAX] {
        assert!(matches!(
            decode(publish_body(0, b"a", b"", declared, b"xy"), &limits),
            Err(DecodeError::BodyLength {
                kind: FrameKind::Publish,
                ..
            })
        ));
    }
    // Header cut short.
    assert!(matches!(
        decode(framed(FrameKind::Message as u8, &[0; 10]), &limits),
        Err(DecodeError::Truncated { .. })
    ));
    assert!(matches!(
        decode(framed(FrameKind::Credit as u8, &[0; 21]), &limits),
        Err(DecodeError::BodyLength { .. })
    ));
    for len in [15, 17] {
        assert!(matches!(
            decode(framed(FrameKind::Probe as u8, &vec![0; len]), &limits),
            Err(DecodeError::Truncated { .. } | DecodeError::BodyLength { .. })
        ));
    }
}

/// An offer's text fields are bounded, both ways: a peer's offer whose
/// orderings (names this build does not know) or provider name pass the
/// bounds is refused as it is read, and none such is sent.
#[test]
fn offers_past_their_bounds_are_refused_both_ways() {
    use efabus_core::caps::{FabricInfo, MsgOrder, Offer};
    use efabus_core::frame::Hello;
    let mut offer = Offer::from_info("efa-rdm", &FabricInfo::tcp(None), vec![1; 16]);
    let mut orders = MsgOrder::empty();
    for n in 0..17 {
        orders.insert_name(&format!("FI_ORDER_FUTURE_{n}"));
    }
    offer.msg_order = orders;
    let mut long_provider = Offer::from_info("efa-rdm", &FabricInfo::tcp(None), vec![1; 16]);
    long_provider.provider = "p".repeat(65);
    for (offer, says) in [(offer, "orderings"), (long_provider, "provider")] {
        let hello = Hello {
            no_echo: false,
            no_responders: false,
            version: PROTOCOL_VERSION,
            name: "n".into(),
            credentials: None,
            user: None,
            proof: None,
            offers: vec![offer],
            link_auth: None,
        };
        let body = bincode::serde::encode_to_vec(&hello, bincode::config::standard())
            .expect("bincode encodes it");
        match decode(
            framed(FrameKind::Hello as u8, &body),
            &CodecLimits::default(),
        ) {
            Err(DecodeError::Body { text, .. }) => assert!(text.contains(says), "{text}"),
            other => panic!("{says}: {other:?}"),
        }
        let err = efabus_core::codec::try_encode(&Frame::Hello(hello)).expect_err(says);
        assert!(err.to_string().contains(says), "{err}");
    }
}

#[test]
fn control_body_limits_hold() {
    let limits = CodecLimits::default();
    // More offers than allowed: this version, empty name, no user, no
    // credentials, no proof, count. (A hello of another version gives only
    // its version.)
    let version = PROTOCOL_VERSION as u8;
    let body = [version, 0, 0, 0, 0, MAX_OFFERS as u8 + 1];
    assert_eq!(
        decode(framed(FrameKind::Hello as u8, &body), &limits),
        Err(DecodeError::TooManyOffers {
            kind: FrameKind::Hello,
            count: MAX_OFFERS as u64 + 1,
            max: MAX_OFFERS
        })
    );
    // A name claiming 2^40 bytes: refused by the claim limit, not allocated.
    let mut body = vec![version, 253];
    body.extend_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        decode(framed(FrameKind::Hello as u8, &body), &limits),
        Err(DecodeError::Body {
            kind: FrameKind::Hello,
            ..
        })
    ));
    // Same for a goodbye reason.
    let mut body = vec![253u8];
    body.extend_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        decode(framed(FrameKind::Goodbye as u8, &body), &limits),
        Err(DecodeError::Body { .. })
    ));
    // An oversized control body is refused on both sides.
    let huge = Frame::Goodbye(Goodbye {
        reason: "x".repeat(MAX_CONTROL_BODY),
    });
    assert!(matches!(
        try_encode(&huge),
        Err(EncodeError::FieldTooLong {
            field: "control body",
            ..
        })
    ));
    assert!(matches!(
        decode(
            framed(FrameKind::Goodbye as u8, &[0; MAX_CONTROL_BODY + 1]),
            &limits
        ),
        Err(DecodeError::FieldTooLong {
            field: "control body",
            ..
        })
    ));
}

#[test]
fn encode_refuses_fields_wider_than_the_wire() {
    let frame = Frame::Publish(Publish {
        headers: None,
        subject: "s".into(),
        reply: Some("r".repeat(usize::from(u16::MAX) + 1)),
        seq: 0,
        payload: Bytes::new(),
    });
    assert!(matches!(
        try_encode(&frame),
        Err(EncodeError::FieldTooLong {
            field: "reply subject",
            ..
        })
    ));
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip {
        at: usize,
        mask: u8,
    },
    Set {
        at: usize,
        value: u8,
    },
    Truncate {
        len: usize,
    },
    Append {
        bytes: Vec<u8>,
    },
    /// Rewrite the prefix to match the mutated length, so the body parser
    /// sees the damage.
    FixPrefix,
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..).prop_map(|(at, mask)| Mutation::Flip { at, mask }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::Set { at, value }),
        any::<usize>().prop_map(|len| Mutation::Truncate { len }),
        proptest::collection::vec(any::<u8>(), 1..8).prop_map(|bytes| Mutation::Append { bytes }),
        Just(Mutation::FixPrefix),
    ]
}

fn apply(bytes: &mut Vec<u8>, mutation: &Mutation) {
    match mutation {
        Mutation::Flip { at, mask } if !bytes.is_empty() => {
            let i = at % bytes.len();
            bytes[i] ^= mask;
        }
        Mutation::Set { at, value } if !bytes.is_empty() => {
            let i = at % bytes.len();
            bytes[i] = *value;
        }
        Mutation::Truncate { len } => bytes.truncate(len % (bytes.len() + 1)),
        Mutation::Append { bytes: more } => bytes.extend_from_slice(more),
        Mutation::FixPrefix if bytes.len() >= 4 => {
            let n = (bytes.len() - 4) as u32;
            bytes[..4].copy_from_slice(&n.to_le_bytes());
        }
        _ => {}
    }
}

/// Runs bytes through a FrameReader in the given chunk size, decoding what
/// comes out; checks each yielded frame is as long as its prefix says.
fn feed_reader(bytes: &[u8], chunk: usize, limits: &CodecLimits) {
    let mut reader = FrameReader::new(*limits);
    for piece in bytes.chunks(chunk.max(1)) {
        reader.push(piece);
        loop {
            match reader.next_frame() {
                Ok(Some(whole)) => {
                    assert_eq!(frame_len(&whole, limits), Ok(Some(whole.len())));
                    if let Ok(frame) = decode(whole, limits) {
                        assert_stable(&frame, limits);
                    }
                }
                Ok(None) => break,
                Err(err) => {
                    // Sticky.
                    assert_eq!(reader.next_frame(), Err(err));
                    return;
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256), chunk in 1usize..32) {
        let limits = CodecLimits { max_frame: 4096, max_subject_len: 64 };
        assert_view_agrees(&Bytes::from(bytes.clone()), &limits);
        if let Ok(frame) = decode(Bytes::from(bytes.clone()), &limits) {
            assert_stable(&frame, &limits);
        }
        feed_reader(&bytes, chunk, &limits);
    }

    #[test]
    fn random_bodies_never_panic(kind in any::<u8>(), body in proptest::collection::vec(any::<u8>(), 0..256)) {
        // Kinds are often valid here, so body parsers see random input.
        let kind = if kind < 128 { kind % 0x14 } else { kind };
        let limits = CodecLimits::default();
        assert_view_agrees(&framed(kind, &body), &limits);
        if let Ok(frame) = decode(framed(kind, &body), &limits) {
            assert_stable(&frame, &limits);
        }
    }

    #[test]
    fn mutated_frames_never_panic(
        frames in proptest::collection::vec(frame(), 1..4),
        mutations in proptest::collection::vec(mutation(), 1..4),
        chunk in 1usize..64,
    ) {
        let limits = CodecLimits::default();
        let mut stream = Vec::new();
        for frame in &frames {
            let mut one = encode(frame).to_bytes().to_vec();
            for m in &mutations {
                apply(&mut one, m);
            }
            assert_view_agrees(&Bytes::from(one.clone()), &limits);
            if let Ok(decoded) = decode(Bytes::from(one.clone()), &limits) {
                assert_stable(&decoded, &limits);
            }
            stream.extend_from_slice(&one);
        }
        feed_reader(&stream, chunk, &limits);
    }
}
