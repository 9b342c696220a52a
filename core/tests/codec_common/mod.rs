//! Proptest strategies shared by the codec tests.

use bytes::Bytes;
use efabus_core::caps::Offer;
use efabus_core::frame::{
    Credit, DeliveryClass, ErrorCode, ErrorFrame, Fragment, Frame, Goodbye, Hello, Message,
    Publish, RouteHello, Subscribe, Welcome,
};
use proptest::prelude::*;

fn text() -> impl Strategy<Value = String> {
    // Any Unicode, multi-byte characters included.
    proptest::string::string_regex(".{0,24}").expect("valid regex")
}

fn subject() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[a-zA-Z0-9.*>_é€-]{0,48}").expect("valid regex")
}

fn payload() -> impl Strategy<Value = Bytes> {
    prop_oneof![
        3 => proptest::collection::vec(any::<u8>(), 0..64),
        1 => proptest::collection::vec(any::<u8>(), 0..4096),
    ]
    .prop_map(Bytes::from)
}

fn offers() -> impl Strategy<Value = Vec<Offer>> {
    (0usize..4).prop_map(|n| vec![Offer::default(); n])
}

fn error_code() -> impl Strategy<Value = ErrorCode> {
    prop_oneof![
        Just(ErrorCode::Malformed),
        Just(ErrorCode::Version),
        Just(ErrorCode::Auth),
        Just(ErrorCode::InvalidSubject),
        Just(ErrorCode::PayloadTooLarge),
        Just(ErrorCode::TooManySubscriptions),
        Just(ErrorCode::TooManyConnections),
        Just(ErrorCode::HandshakeTimeout),
        Just(ErrorCode::SlowConsumer),
        Just(ErrorCode::Protocol),
        Just(ErrorCode::NoResponders),
        Just(ErrorCode::Internal),
    ]
}

/// Any frame, every kind reachable.
pub fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (any::<u16>(), text(), proptest::option::of(text()), offers()).prop_map(
            |(version, name, credentials, offers)| Frame::Hello(Hello {
                version,
                name,
                credentials,
                offers
            })
        ),
        (any::<u16>(), text(), offers(), any::<u64>()).prop_map(
            |(version, name, offers, max_payload)| Frame::Welcome(Welcome {
                version,
                name,
                offers,
                max_payload
            })
        ),
        (
            any::<u64>(),
            subject(),
            proptest::option::of(text()),
            any::<bool>()
        )
            .prop_map(|(sid, pattern, queue, best)| Frame::Subscribe(Subscribe {
                sid,
                pattern,
                queue,
                class: if best {
                    DeliveryClass::BestEffort
                } else {
                    DeliveryClass::Reliable
                },
            })),
        any::<u64>().prop_map(|sid| Frame::Unsubscribe { sid }),
        (
            subject(),
            proptest::option::of(subject()),
            any::<u64>(),
            payload()
        )
            .prop_map(|(subject, reply, seq, payload)| Frame::Publish(Publish {
                subject,
                reply,
                seq,
                payload
            })),
        (
            any::<u64>(),
            subject(),
            proptest::option::of(subject()),
            any::<u64>(),
            payload()
        )
            .prop_map(
                |(sid, subject, reply, seq, payload)| Frame::Message(Message {
                    sid,
                    subject,
                    reply,
                    seq,
                    payload
                })
            ),
        (
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            payload()
        )
            .prop_map(|(msg_id, index, count, total_len, data)| Frame::Fragment(
                Fragment {
                    msg_id,
                    index,
                    count,
                    total_len,
                    data
                }
            )),
        (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(messages, bytes, ack_seq)| {
            Frame::Credit(Credit {
                messages,
                bytes,
                ack_seq,
            })
        }),
        any::<u64>().prop_map(|nonce| Frame::Ping { nonce }),
        any::<u64>().prop_map(|nonce| Frame::Pong { nonce }),
        (error_code(), text(), any::<bool>())
            .prop_map(|(code, text, fatal)| Frame::Error(ErrorFrame { code, text, fatal })),
        text().prop_map(|reason| Frame::Goodbye(Goodbye { reason })),
        any::<u64>().prop_map(|broker_id| Frame::Route(RouteHello { broker_id })),
    ]
}
