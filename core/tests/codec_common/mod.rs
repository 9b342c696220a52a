//! Proptest strategies shared by the codec tests.

use bytes::Bytes;
use efabus_core::caps::{EpType, MsgOrder, Offer, Protocol};
use efabus_core::frame::{
    Credit, DeliveryClass, Dropped, ErrorCode, ErrorFrame, Fragment, Frame, Goodbye, Hello,
    LinkAuth, Message, Publish, RouteHello, RouteLimits, RoutePeers, Subscribe, Welcome,
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

/// Integers of every varint width bincode uses (1, 3, 5 and 9 bytes).
fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..251,
        251u64..=u64::from(u16::MAX),
        0u64..=u64::from(u32::MAX),
        any::<u64>(),
    ]
}

/// A scheme or provider name: one transports really use, or any text
/// within an offer's bounds (at most 8 characters: 32 bytes).
fn name_from(known: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::sample::select(known).prop_map(str::to_string),
        1 => proptest::string::string_regex(".{0,8}").expect("valid regex"),
    ]
}

fn ep_type() -> impl Strategy<Value = EpType> {
    prop_oneof![
        // Known values, and `Other("Unknown")` past them.
        4 => (0u32..8).prop_map(EpType::from_c_value),
        1 => "FI_EP_[A-Z_]{1,12}".prop_map(|name| EpType::from_name(&name)),
    ]
}

fn protocol() -> impl Strategy<Value = Protocol> {
    prop_oneof![
        4 => (0u32..40).prop_map(Protocol::from_c_value),
        1 => "FI_PROTO_[A-Z_]{1,12}".prop_map(|name| Protocol::from_name(&name)),
    ]
}

/// Known bits (and bits without a name), plus names this build does not know.
fn msg_order() -> impl Strategy<Value = MsgOrder> {
    (
        prop_oneof![0u64..0x200, any::<u64>()],
        proptest::collection::vec("FI_ORDER_[A-Z_]{1,10}", 0..3),
    )
        .prop_map(|(bits, names)| {
            let mut order = MsgOrder::from_bits(bits);
            for name in &names {
                order.insert_name(name);
            }
            order
        })
}

/// An endpoint address as transports give them: an EFA address (32 bytes),
/// a `sockaddr_in` or `sockaddr_in6`, a `host:port` text, or any bytes.
fn address() -> impl Strategy<Value = Vec<u8>> {
    use proptest::collection::vec;
    prop_oneof![
        vec(any::<u8>(), 32),
        vec(any::<u8>(), 16),
        vec(any::<u8>(), 28),
        "[0-9]{1,3}(\\.[0-9]{1,3}){3}:[0-9]{1,5}".prop_map(String::into_bytes),
        vec(any::<u8>(), 0..80),
    ]
}

fn offer() -> impl Strategy<Value = Offer> {
    (
        (
            name_from(&["efa-rdm", "efa-dgram", "tcp", "mem"]),
            ep_type(),
            name_from(&[
                "efa",
                "tcp;ofi_rxm",
                "udp;ofi_rxd",
                "sockets",
                "udp",
                "efabus-tcp",
            ]),
            protocol(),
            any::<u32>(),
        ),
        (size(), size(), size(), msg_order(), size(), size(), size()),
        (address(), size(), size()),
    )
        .prop_map(
            |(
                (scheme, ep_type, provider, protocol, protocol_version),
                (
                    max_msg_size,
                    msg_prefix_size,
                    inject_size,
                    msg_order,
                    cq_data_size,
                    tx_size,
                    rx_size,
                ),
                (address, rendezvous_max, provider_eager_limit),
            )| Offer {
                scheme,
                ep_type,
                provider,
                protocol,
                protocol_version,
                max_msg_size,
                msg_prefix_size,
                inject_size,
                msg_order,
                cq_data_size,
                tx_size,
                rx_size,
                address,
                host: String::new(),
                rendezvous_max,
                provider_eager_limit,
            },
        )
}

/// The offers of a handshake: none, one, or several different ones.
fn offers() -> impl Strategy<Value = Vec<Offer>> {
    proptest::collection::vec(offer(), 0..6)
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
        Just(ErrorCode::RateLimited),
    ]
}

/// A side's part of the link keys, or none.
pub fn link_auth() -> impl Strategy<Value = Option<LinkAuth>> {
    proptest::option::of(
        (any::<[u8; 32]>(), any::<u64>())
            .prop_map(|(key_share, link_id)| LinkAuth { key_share, link_id }),
    )
}

/// Any frame, every kind reachable.
pub fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (
            any::<u16>(),
            text(),
            proptest::option::of(text()),
            offers(),
            link_auth(),
            any::<(bool, bool)>()
        )
            .prop_map(
                |(version, name, credentials, offers, link_auth, (no_echo, no_responders))| {
                    Frame::Hello(Hello {
                        no_echo,
                        no_responders,
                        version,
                        name,
                        credentials,
                        user: None,
                        proof: None,
                        offers,
                        link_auth,
                    })
                }
            ),
        (
            (any::<u16>(), text(), offers(), any::<u64>(), link_auth()),
            (any::<u32>(), any::<u32>())
        )
            .prop_map(
                |(
                    (version, name, offers, max_payload, link_auth),
                    (max_subject_len, max_subject_tokens),
                )| Frame::Welcome(Welcome {
                    version,
                    name,
                    offers,
                    max_payload,
                    link_auth,
                    max_subject_len,
                    max_subject_tokens,
                    proof: None,
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
            proptest::option::of(payload()),
            payload()
        )
            .prop_map(
                |(subject, reply, seq, headers, payload)| Frame::Publish(Publish {
                    headers,
                    subject,
                    reply,
                    seq,
                    payload
                })
            ),
        (
            any::<u64>(),
            subject(),
            proptest::option::of(subject()),
            any::<u64>(),
            proptest::option::of(payload()),
            payload()
        )
            .prop_map(
                |(sid, subject, reply, seq, headers, payload)| Frame::Message(Message {
                    headers,
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
        (any::<u64>(), any::<u64>()).prop_map(|(nonce, sent_through)| Frame::Probe {
            nonce,
            sent_through
        }),
        any::<u64>().prop_map(|nonce| Frame::Ping { nonce }),
        any::<u64>().prop_map(|nonce| Frame::Pong { nonce }),
        (error_code(), text(), any::<bool>())
            .prop_map(|(code, text, fatal)| Frame::Error(ErrorFrame { code, text, fatal })),
        text().prop_map(|reason| Frame::Goodbye(Goodbye { reason })),
        (
            any::<u64>(),
            proptest::option::of(text()),
            any::<bool>(),
            any::<(u64, u32, u32)>()
        )
            .prop_map(|(broker_id, advertise, seeded, limits)| {
                Frame::Route(RouteHello {
                    broker_id,
                    advertise,
                    seeded,
                    limits: RouteLimits {
                        max_payload: limits.0,
                        max_subject_len: limits.1,
                        max_subject_tokens: limits.2,
                    },
                })
            }),
        proptest::collection::vec(text(), 0..4)
            .prop_map(|addresses| Frame::RoutePeers(RoutePeers { addresses })),
        (any::<u64>(), any::<u64>())
            .prop_map(|(sid, count)| Frame::Dropped(Dropped { sid, count })),
        (any::<u64>(), any::<u64>(), any::<u32>(), text()).prop_map(
            |(settled, sent, epoch, reason)| Frame::best_effort_closed(
                settled, sent, epoch, reason
            )
        ),
        any::<u32>().prop_map(|epoch| Frame::BestEffortReopen { epoch }),
        proptest::collection::vec(any::<u8>(), 0..64)
            .prop_map(|frames| Frame::Run(Bytes::from(frames))),
    ]
}
