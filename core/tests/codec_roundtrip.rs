//! Round trips of every frame kind through the codec, over contiguous input
//! and over a byte stream split at arbitrary points.

mod codec_common;

use bytes::BytesMut;
use codec_common::frame;
use efabus_core::codec::{
    decode, encode, encode_into, encoded_len, join_headers, peek_routed, routed_head_into,
    routed_into, set_message_sid, CodecLimits, FrameKind, FrameReader, RoutedFields,
};
use efabus_core::frame::{Frame, Message, Publish};
use proptest::prelude::*;

/// Splits `bytes` into pieces whose lengths cycle through `cuts` (each >= 1).
fn split<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut pieces = Vec::new();
    let mut rest = bytes;
    let mut i = 0;
    while !rest.is_empty() {
        let n = cuts[i % cuts.len()].clamp(1, rest.len());
        let (piece, tail) = rest.split_at(n);
        pieces.push(piece);
        rest = tail;
        i += 1;
    }
    pieces
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn contiguous_round_trip(frame in frame()) {
        let limits = CodecLimits::default();
        let out = encode(&frame);
        let wire = out.to_bytes();
        prop_assert_eq!(encoded_len(&frame), Ok(wire.len()));
        prop_assert_eq!(wire[4], FrameKind::of(&frame) as u8);

        let mut contiguous = BytesMut::new();
        encode_into(&frame, &mut contiguous);
        prop_assert_eq!(&contiguous[..], &wire[..]);

        // Payload-carrying frames keep their payload out of the head.
        match &frame {
            Frame::Publish(Publish { payload, .. }) | Frame::Message(Message { payload, .. }) => {
                prop_assert_eq!(&out.body, payload);
            }
            _ => {}
        }

        // Publish and message frames built from borrowed parts are the same
        // bytes, and read back in place to the same fields.
        let parts = match &frame {
            Frame::Publish(p) => Some((FrameKind::Publish, 0, p.seq, &p.subject, &p.reply, &p.headers, &p.payload)),
            Frame::Message(m) => Some((FrameKind::Message, m.sid, m.seq, &m.subject, &m.reply, &m.headers, &m.payload)),
            _ => None,
        };
        match parts {
            Some((kind, sid, seq, subject, reply, headers, payload)) => {
                // The payload field: a header block (with its length) joined
                // in front of the body, or the body alone.
                let field = match headers {
                    Some(block) => join_headers(block, payload),
                    None => payload.clone(),
                };
                let fields = RoutedFields { subject, reply: reply.as_deref(), headers: headers.is_some() };
                let mut built = BytesMut::from(&b"keep"[..]);
                routed_head_into(&mut built, kind, sid, seq, fields, field.len())
                    .expect("fits the wire");
                built.extend_from_slice(&field);
                prop_assert_eq!(&built[4..], &wire[..]);
                let view = peek_routed(&wire, &limits).expect("valid").expect("a data frame");
                prop_assert_eq!((view.kind, view.sid, view.seq), (kind, sid, seq));
                prop_assert_eq!((view.subject, view.reply), (&subject[..], reply.as_deref()));
                prop_assert_eq!(&view.payload_of(&wire), &field);
                prop_assert_eq!(view.headers_and_body(), (headers.as_deref(), &payload[..]));
                if seq == 0 {
                    let mut whole = BytesMut::new();
                    routed_into(&mut whole, kind, sid, fields, &field)
                        .expect("fits the wire");
                    prop_assert_eq!(&whole[..], &wire[..]);
                    if kind == FrameKind::Message {
                        // Encoded for one subscription, re-addressed to another.
                        let mut other = BytesMut::new();
                        routed_into(&mut other, kind, sid ^ 1, fields, &field)
                            .expect("fits the wire");
                        set_message_sid(&mut other, sid);
                        prop_assert_eq!(&other[..], &wire[..]);
                    }
                }
            }
            None => prop_assert_eq!(peek_routed(&wire, &limits), Ok(None)),
        }

        let decoded = decode(wire, &limits);
        prop_assert_eq!(decoded, Ok(frame));
    }

    #[test]
    fn byte_by_byte_round_trip(frames in proptest::collection::vec(frame(), 1..6)) {
        let limits = CodecLimits::default();
        let mut stream = BytesMut::new();
        for frame in &frames {
            encode_into(frame, &mut stream);
        }
        let mut reader = FrameReader::new(limits);
        let mut got = Vec::new();
        for byte in stream.iter() {
            reader.push(std::slice::from_ref(byte));
            while let Some(whole) = reader.next_frame().expect("valid stream") {
                got.push(decode(whole, &limits).expect("valid frame"));
            }
        }
        prop_assert_eq!(reader.buffered(), 0);
        prop_assert_eq!(got, frames);
    }

    #[test]
    fn split_stream_round_trip(
        frames in proptest::collection::vec(frame(), 1..8),
        cuts in proptest::collection::vec(1usize..600, 1..8),
    ) {
        let limits = CodecLimits::default();
        let mut stream = BytesMut::new();
        for frame in &frames {
            encode_into(frame, &mut stream);
        }
        let mut reader = FrameReader::new(limits);
        let mut got = Vec::new();
        for piece in split(&stream, &cuts) {
            reader.push(piece);
            while let Some(whole) = reader.next_frame().expect("valid stream") {
                got.push(decode(whole, &limits).expect("valid frame"));
            }
        }
        prop_assert_eq!(got, frames);
    }

    #[test]
    fn read_from_round_trip(
        frames in proptest::collection::vec(frame(), 1..6),
        cuts in proptest::collection::vec(1usize..300, 1..5),
    ) {
        // A reader that returns short reads, as sockets do.
        struct Chunked<'a> { pieces: std::vec::IntoIter<&'a [u8]> }
        impl std::io::Read for Chunked<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                match self.pieces.next() {
                    Some(p) => { buf[..p.len()].copy_from_slice(p); Ok(p.len()) }
                    None => Ok(0),
                }
            }
        }
        let limits = CodecLimits::default();
        let mut stream = BytesMut::new();
        for frame in &frames {
            encode_into(frame, &mut stream);
        }
        let mut source = Chunked { pieces: split(&stream, &cuts).into_iter() };
        let mut reader = FrameReader::new(limits);
        let mut got = Vec::new();
        while reader.read_from(&mut source).expect("in-memory read") > 0 {
            while let Some(whole) = reader.next_frame().expect("valid stream") {
                got.push(decode(whole, &limits).expect("valid frame"));
            }
        }
        prop_assert_eq!(got, frames);
    }
}
