//! The wire encoding of [`Frame`]s, and the stream reassembly of frames.
//!
//! This module owns the byte layout of every frame and the checks made on
//! untrusted input before anything is allocated for it.
//!
//! # Layout
//!
//! Every frame is a 4-byte little-endian length `N` of the bytes that follow,
//! then `N` bytes: one [`FrameKind`] byte, then the body. `N` counts the kind
//! byte, so the whole frame is `N + 4` bytes; [`CodecLimits::max_frame`]
//! bounds that whole size.
//!
//! Control frames (`Hello`, `Welcome`, `Subscribe`, `Unsubscribe`,
//! `UnsubscribeAfter`, `Ping`, `Pong`, `Error`, `Goodbye`, `Route`,
//! `RoutePeers`, `Dropped`, `Challenge`, `BestEffortClosed`,
//! `BestEffortReopen`) carry their
//! struct encoded with bincode 2 (serde, `config::standard()`: varint
//! integers, little-endian). Their body is at most [`MAX_CONTROL_BODY`]
//! bytes, a handshake carries at most [`MAX_OFFERS`] offers, a
//! `BestEffortClosed` a reason of at most [`MAX_CLOSE_REASON`] bytes, and
//! the decoder runs with a byte limit of sixteen
//! times the body length (rounded up to a tier: the largest ratio between
//! memory bincode claims for a value and its varint encoding), so a forged
//! length inside a body cannot make it allocate beyond that.
//!
//! Data frames have fixed little-endian headers; variable parts follow the
//! header in the order listed, and must fill the body exactly:
//!
//! | kind | header | then |
//! |---|---|---|
//! | `Publish` (0x10) | seq u64, flags u8, subject_len u16, reply_len u16, payload_len u32 | subject, reply, payload |
//! | `Message` (0x11) | sid u64, seq u64, flags u8, subject_len u16, reply_len u16, payload_len u32 | subject, reply, payload |
//! | `Fragment` (0x12) | msg_id u64, index u32, count u32, total_len u32, data_len u32 | data |
//! | `Credit` (0x13) | messages u32, bytes u64, ack_seq u64 | nothing |
//! | `Run` (0x14) | nothing | whole frames, back to back |
//! | `Probe` (0x15) | nonce u64, sent_through u64 | nothing |
//!
//! Flag bit 0 ([`FLAG_REPLY`]) says a reply subject is present (so an empty
//! reply is distinguishable from none). Flag bit 1 ([`FLAG_HEADERS`]) says
//! the message has headers: its payload field then starts with a u32
//! length `H`, then `H` bytes of header block (NATS's
//! `NATS/1.0\r\n...\r\n\r\n` form, opaque here), then the body; `H` must fit
//! the payload field. Other bits must be zero. Subjects
//! must be UTF-8 and at most [`CodecLimits::max_subject_len`] bytes; whether
//! they are *valid subjects* is for [`crate::subject`] to say. Payloads and
//! fragment data are slices of the received buffer, never copies.
//!
//! On the hot path, `Publish` and `Message` frames need no [`Frame`] value:
//! [`peek_routed`] reads one in place (subjects borrowed, nothing
//! allocated, the same checks as [`decode`]), and [`routed_head_into`] /
//! [`routed_into`] append one to a batch from borrowed parts.

use std::fmt;
use std::io;

use bincode::de::read::Reader;
use bincode::de::DecoderImpl;
use bincode::enc::write::{SizeWriter, Writer};
use bincode::serde::Compat;
use bincode::Decode;
use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;
use thiserror::Error;

use crate::caps::Offer;
use crate::frame::{
    Challenge, Credit, Dropped, ErrorFrame, Fragment, Frame, Goodbye, Hello, LinkAuth, Message,
    Publish, RouteHello, RoutePeers, SecretProof, Subscribe, Welcome, MAX_CLOSE_REASON,
    PROTOCOL_VERSION,
};
use crate::transport::OutFrame;

/// Bytes of the length prefix in front of every frame.
pub const PREFIX_LEN: usize = 4;
/// Bytes of prefix and kind byte: the smallest possible frame.
pub const FRAME_OVERHEAD: usize = PREFIX_LEN + 1;
/// Header bytes of a `Publish` body before its subject.
pub const PUBLISH_HEADER_LEN: usize = 8 + 1 + 2 + 2 + 4;
/// Header bytes of a `Message` body before its subject.
pub const MESSAGE_HEADER_LEN: usize = 8 + 8 + 1 + 2 + 2 + 4;
/// Header bytes of a `Fragment` body before its data.
pub const FRAGMENT_HEADER_LEN: usize = 8 + 4 + 4 + 4 + 4;
/// Body bytes of a `Credit` frame.
pub const CREDIT_BODY_LEN: usize = 4 + 8 + 8;
/// Body bytes of a `Probe` frame.
pub const PROBE_BODY_LEN: usize = 8 + 8;
/// Encoded size of a `Fragment` frame minus its data: what fragmentation
/// spends per piece.
pub const FRAGMENT_OVERHEAD: usize = FRAME_OVERHEAD + FRAGMENT_HEADER_LEN;
/// Most bytes of frames one [`Frame::Run`] holds: what its length prefix
/// can count besides the kind byte.
pub const MAX_RUN_LEN: usize = u32::MAX as usize - 1;
/// Largest body of a control frame. Handshakes and subscriptions are small;
/// this keeps the decoder's memory claim for them small too.
pub const MAX_CONTROL_BODY: usize = 64 * 1024;
/// Most offers a `Hello` or `Welcome` may carry.
pub const MAX_OFFERS: usize = 64;
/// Flag bit of `Publish`/`Message`: a reply subject follows the subject.
pub const FLAG_REPLY: u8 = 0x01;
/// Flag bit of `Publish`/`Message`: the payload field starts with a header
/// block and its length (see the module docs).
pub const FLAG_HEADERS: u8 = 0x02;
/// Bytes of the header block's length in front of it.
pub const HEADERS_PREFIX_LEN: usize = 4;

/// Default largest payload of one publish: 8 MiB.
pub const DEFAULT_MAX_PAYLOAD: usize = 8 << 20;
/// Default largest subject (and reply subject) in bytes.
pub const DEFAULT_MAX_SUBJECT_LEN: usize = 512;
/// Default frame limit: the default payload plus 4 KiB of room for the
/// prefix, header, subject and reply subject.
pub const DEFAULT_MAX_FRAME: usize = DEFAULT_MAX_PAYLOAD + 4096;

/// What the decoder accepts. Checked before anything is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodecLimits {
    /// Largest whole frame, length prefix included (default
    /// [`DEFAULT_MAX_FRAME`]: 8 MiB of payload plus 4 KiB of header room).
    pub max_frame: usize,
    /// Largest subject or reply subject in bytes (default
    /// [`DEFAULT_MAX_SUBJECT_LEN`], 512). Must not exceed `u16::MAX`, the
    /// width of the wire field.
    pub max_subject_len: usize,
}

impl Default for CodecLimits {
    fn default() -> Self {
        CodecLimits {
            max_frame: DEFAULT_MAX_FRAME,
            max_subject_len: DEFAULT_MAX_SUBJECT_LEN,
        }
    }
}

/// The kind byte that follows the length prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// [`Frame::Hello`] (control).
    Hello = 0x01,
    /// [`Frame::Welcome`] (control).
    Welcome = 0x02,
    /// [`Frame::Subscribe`] (control).
    Subscribe = 0x03,
    /// [`Frame::Unsubscribe`] (control).
    Unsubscribe = 0x04,
    /// [`Frame::Ping`] (control).
    Ping = 0x05,
    /// [`Frame::Pong`] (control).
    Pong = 0x06,
    /// [`Frame::Error`] (control).
    Error = 0x07,
    /// [`Frame::Goodbye`] (control).
    Goodbye = 0x08,
    /// [`Frame::Route`] (control).
    Route = 0x09,
    /// [`Frame::Dropped`] (control).
    Dropped = 0x0a,
    /// [`Frame::RoutePeers`] (control).
    RoutePeers = 0x0b,
    /// [`Frame::Challenge`] (control).
    Challenge = 0x0c,
    /// [`Frame::UnsubscribeAfter`] (control).
    UnsubscribeAfter = 0x0d,
    /// [`Frame::BestEffortClosed`] (control).
    BestEffortClosed = 0x0e,
    /// [`Frame::BestEffortReopen`] (control).
    BestEffortReopen = 0x0f,
    /// [`Frame::Publish`] (data).
    Publish = 0x10,
    /// [`Frame::Message`] (data).
    Message = 0x11,
    /// [`Frame::Fragment`] (data).
    Fragment = 0x12,
    /// [`Frame::Credit`] (data).
    Credit = 0x13,
    /// [`Frame::Run`] (data).
    Run = 0x14,
    /// [`Frame::Probe`] (data).
    Probe = 0x15,
}

impl FrameKind {
    /// The kind of a frame value.
    pub fn of(frame: &Frame) -> FrameKind {
        match frame {
            Frame::Hello(_) => FrameKind::Hello,
            Frame::Welcome(_) => FrameKind::Welcome,
            Frame::Subscribe(_) => FrameKind::Subscribe,
            Frame::Unsubscribe { .. } => FrameKind::Unsubscribe,
            Frame::Publish(_) => FrameKind::Publish,
            Frame::Message(_) => FrameKind::Message,
            Frame::Fragment(_) => FrameKind::Fragment,
            Frame::Credit(_) => FrameKind::Credit,
            Frame::Run(_) => FrameKind::Run,
            Frame::Probe { .. } => FrameKind::Probe,
            Frame::Ping { .. } => FrameKind::Ping,
            Frame::Pong { .. } => FrameKind::Pong,
            Frame::Error(_) => FrameKind::Error,
            Frame::Goodbye(_) => FrameKind::Goodbye,
            Frame::Route(_) => FrameKind::Route,
            Frame::RoutePeers(_) => FrameKind::RoutePeers,
            Frame::Challenge(_) => FrameKind::Challenge,
            Frame::Dropped(_) => FrameKind::Dropped,
            Frame::UnsubscribeAfter { .. } => FrameKind::UnsubscribeAfter,
            Frame::BestEffortClosed { .. } => FrameKind::BestEffortClosed,
            Frame::BestEffortReopen { .. } => FrameKind::BestEffortReopen,
        }
    }

    /// The kind for a wire byte, if it names one.
    pub fn from_byte(byte: u8) -> Option<FrameKind> {
        Some(match byte {
            0x01 => FrameKind::Hello,
            0x02 => FrameKind::Welcome,
            0x03 => FrameKind::Subscribe,
            0x04 => FrameKind::Unsubscribe,
            0x05 => FrameKind::Ping,
            0x06 => FrameKind::Pong,
            0x07 => FrameKind::Error,
            0x08 => FrameKind::Goodbye,
            0x09 => FrameKind::Route,
            0x0a => FrameKind::Dropped,
            0x0b => FrameKind::RoutePeers,
            0x0c => FrameKind::Challenge,
            0x0d => FrameKind::UnsubscribeAfter,
            0x0e => FrameKind::BestEffortClosed,
            0x0f => FrameKind::BestEffortReopen,
            0x10 => FrameKind::Publish,
            0x11 => FrameKind::Message,
            0x12 => FrameKind::Fragment,
            0x13 => FrameKind::Credit,
            0x14 => FrameKind::Run,
            0x15 => FrameKind::Probe,
            _ => return None,
        })
    }

    /// Whether the body is bincode (control) rather than a fixed header (data).
    pub fn is_control(self) -> bool {
        (self as u8) < 0x10
    }

    /// Name for messages and logs.
    pub fn name(self) -> &'static str {
        match self {
            FrameKind::Hello => "hello",
            FrameKind::Welcome => "welcome",
            FrameKind::Subscribe => "subscribe",
            FrameKind::Unsubscribe => "unsubscribe",
            FrameKind::Ping => "ping",
            FrameKind::Pong => "pong",
            FrameKind::Error => "error",
            FrameKind::Goodbye => "goodbye",
            FrameKind::Route => "route",
            FrameKind::Dropped => "dropped",
            FrameKind::RoutePeers => "route peers",
            FrameKind::Challenge => "challenge",
            FrameKind::UnsubscribeAfter => "unsubscribe after",
            FrameKind::BestEffortClosed => "best-effort closed",
            FrameKind::BestEffortReopen => "best-effort reopen",
            FrameKind::Publish => "publish",
            FrameKind::Message => "message",
            FrameKind::Fragment => "fragment",
            FrameKind::Credit => "credit",
            FrameKind::Run => "run",
            FrameKind::Probe => "probe",
        }
    }
}

impl fmt::Display for FrameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// Fewer bytes than the layout needs.
    #[error("truncated frame: {needed} bytes needed, {available} available")]
    Truncated {
        /// Bytes the layout needs.
        needed: usize,
        /// Bytes there are.
        available: usize,
    },
    /// The length prefix disagrees with the bytes delivered as one frame.
    #[error("length prefix declares {declared} bytes but {actual} follow it")]
    LengthMismatch {
        /// Bytes the prefix declares.
        declared: usize,
        /// Bytes that follow the prefix.
        actual: usize,
    },
    /// The declared frame (prefix included) is over the limit.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Declared size of the whole frame, prefix included.
        len: u64,
        /// The limit ([`CodecLimits::max_frame`]).
        max: usize,
    },
    /// A length prefix of zero: not even a kind byte.
    #[error("empty frame: no kind byte")]
    Empty,
    /// The kind byte names no frame kind.
    #[error("unknown frame kind {0:#04x}")]
    UnknownKind(u8),
    /// A [`Frame::Run`] that does not hold whole frames of the kinds a run
    /// may carry.
    #[error("malformed run: {0}")]
    BadRun(&'static str),
    /// A `Publish` or `Message` sets flag bits other than [`FLAG_REPLY`],
    /// or declares a reply subject without that flag.
    #[error("unknown flags {flags:#04x} in a {kind} frame")]
    UnknownFlags {
        /// Kind of the frame.
        kind: FrameKind,
        /// The whole flags byte.
        flags: u8,
    },
    /// A length-bounded field (subject, reply, control body, ...) is too long.
    #[error("{field} of a {kind} frame is {len} bytes, over the limit of {max}")]
    FieldTooLong {
        /// Kind of the frame.
        kind: FrameKind,
        /// Which field.
        field: &'static str,
        /// Its declared length in bytes.
        len: usize,
        /// The limit for it.
        max: usize,
    },
    /// A subject or reply subject is not UTF-8.
    #[error("{field} of a {kind} frame is not valid UTF-8")]
    InvalidUtf8 {
        /// Kind of the frame.
        kind: FrameKind,
        /// Which field.
        field: &'static str,
    },
    /// A header block's length runs past the payload field it starts.
    #[error("{kind} frame declares {declared} bytes of headers in a payload field of {available}")]
    HeadersLength {
        /// Kind of the frame.
        kind: FrameKind,
        /// Header bytes declared.
        declared: u64,
        /// Bytes of the payload field.
        available: usize,
    },
    /// The header's lengths do not add up to the body's length.
    #[error("{kind} header declares a body of {declared} bytes but it holds {actual}")]
    BodyLength {
        /// Kind of the frame.
        kind: FrameKind,
        /// Body length the header adds up to.
        declared: u64,
        /// Body length there is.
        actual: usize,
    },
    /// A control body decoded without using all its bytes.
    #[error("{count} trailing bytes after the {kind} body")]
    TrailingBytes {
        /// Kind of the frame.
        kind: FrameKind,
        /// Bytes left over.
        count: usize,
    },
    /// A `Hello` or `Welcome` declares more than [`MAX_OFFERS`] offers.
    #[error("{kind} frame carries {count} offers, over the limit of {max}")]
    TooManyOffers {
        /// Kind of the frame.
        kind: FrameKind,
        /// Offers declared.
        count: u64,
        /// The limit ([`MAX_OFFERS`]).
        max: usize,
    },
    /// bincode rejected a control body; the text is its reason.
    #[error("invalid {kind} body: {text}")]
    Body {
        /// Kind of the frame.
        kind: FrameKind,
        /// bincode's reason.
        text: String,
    },
}

/// Why a frame value cannot be encoded: a field wider than its wire field.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EncodeError {
    /// A subject, payload, control body or whole frame is longer than its
    /// length field can say.
    #[error("{field} of a {kind} frame is {len} bytes, over the wire limit of {max}")]
    FieldTooLong {
        /// Kind of the frame.
        kind: FrameKind,
        /// Which field.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The most the wire allows.
        max: usize,
    },
    /// A `Hello` or `Welcome` with more than [`MAX_OFFERS`] offers.
    #[error("{kind} frame carries {count} offers, over the limit of {max}")]
    TooManyOffers {
        /// Kind of the frame.
        kind: FrameKind,
        /// Offers in the frame.
        count: usize,
        /// The limit ([`MAX_OFFERS`]).
        max: usize,
    },
    /// bincode could not encode a control body.
    #[error("cannot encode {kind} body: {text}")]
    Body {
        /// Kind of the frame.
        kind: FrameKind,
        /// bincode's reason.
        text: String,
    },
}

// ---------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------

/// Encode a frame in two parts: for `Publish`, `Message` and `Fragment`,
/// `head` holds prefix, kind, header and subjects and `body` is the payload
/// (or fragment data) shared, not copied; other frames are all in `head`.
///
/// # Panics
///
/// If a field is wider than its wire field (see [`try_encode`]). Callers
/// enforce subject and payload limits long before encoding, so this is a
/// programming error; use [`try_encode`] where that is not guaranteed.
pub fn encode(frame: &Frame) -> OutFrame {
    match try_encode(frame) {
        Ok(out) => out,
        Err(err) => panic!("frame cannot be encoded: {err}"),
    }
}

/// Encode a frame as [`encode`] does, or say which field does not fit: a
/// subject over 65535 bytes, a payload or whole frame over `u32::MAX`
/// bytes, a control body over [`MAX_CONTROL_BODY`], more than
/// [`MAX_OFFERS`] offers, or a close reason over [`MAX_CLOSE_REASON`].
pub fn try_encode(frame: &Frame) -> Result<OutFrame, EncodeError> {
    let (payload, head_len) = match frame {
        Frame::Publish(p) => (
            Some(&p.payload),
            FRAME_OVERHEAD + PUBLISH_HEADER_LEN + p.subject.len() + reply_len(&p.reply),
        ),
        Frame::Message(m) => (
            Some(&m.payload),
            FRAME_OVERHEAD + MESSAGE_HEADER_LEN + m.subject.len() + reply_len(&m.reply),
        ),
        Frame::Fragment(f) => (Some(&f.data), FRAGMENT_OVERHEAD),
        Frame::Run(frames) => (Some(frames), FRAME_OVERHEAD),
        _ => (None, 64),
    };
    let mut head = BytesMut::with_capacity(head_len);
    match payload {
        Some(payload) => {
            write_head(frame, &mut head)?;
            Ok(OutFrame {
                head: head.freeze(),
                body: payload.clone(),
            })
        }
        None => {
            try_encode_into(frame, &mut head)?;
            Ok(OutFrame::whole(head.freeze()))
        }
    }
}

/// Append the whole encoded frame to `out`, contiguously (for batching).
///
/// # Panics
///
/// As [`encode`].
pub fn encode_into(frame: &Frame, out: &mut BytesMut) {
    if let Err(err) = try_encode_into(frame, out) {
        panic!("frame cannot be encoded: {err}");
    }
}

/// Append the whole encoded frame to `out`, or leave `out` as it was and
/// say which field does not fit (see [`try_encode`]).
pub fn try_encode_into(frame: &Frame, out: &mut BytesMut) -> Result<(), EncodeError> {
    let start = out.len();
    let result = match frame {
        Frame::Publish(Publish { payload, .. })
        | Frame::Message(Message { payload, .. })
        | Frame::Fragment(Fragment { data: payload, .. })
        | Frame::Run(payload) => write_head(frame, out).map(|()| out.extend_from_slice(payload)),
        _ => write_control(frame, out),
    };
    if result.is_err() {
        out.truncate(start);
    }
    result
}

/// Length of the frame once encoded, prefix included.
pub fn encoded_len(frame: &Frame) -> Result<usize, EncodeError> {
    Ok(match frame {
        Frame::Publish(p) => data_frame_len(
            FrameKind::Publish,
            PUBLISH_HEADER_LEN,
            &p.subject,
            &p.reply,
            headers_field_len(&p.headers) + p.payload.len(),
        )?,
        Frame::Message(m) => data_frame_len(
            FrameKind::Message,
            MESSAGE_HEADER_LEN,
            &m.subject,
            &m.reply,
            headers_field_len(&m.headers) + m.payload.len(),
        )?,
        Frame::Fragment(f) => data_frame_len(
            FrameKind::Fragment,
            FRAGMENT_HEADER_LEN,
            "",
            &None,
            f.data.len(),
        )?,
        Frame::Credit(_) => FRAME_OVERHEAD + CREDIT_BODY_LEN,
        Frame::Probe { .. } => FRAME_OVERHEAD + PROBE_BODY_LEN,
        Frame::Run(frames) => {
            check_width(FrameKind::Run, "frames", frames.len(), MAX_RUN_LEN)?;
            FRAME_OVERHEAD + frames.len()
        }
        _ => {
            let mut size = SizeWriter::default();
            encode_control_body(frame, &mut size)?;
            FRAME_OVERHEAD + size.bytes_written
        }
    })
}

/// Length of an encoded `Publish` or `Message` frame (prefix included)
/// with these parts, as [`routed_head_into`] and the payload make it.
pub fn routed_frame_len(
    kind: FrameKind,
    subject_len: usize,
    reply_len: usize,
    payload_len: usize,
) -> usize {
    // `payload_len` counts a header block and its length, when there is one.
    let header = match kind {
        FrameKind::Message => MESSAGE_HEADER_LEN,
        _ => PUBLISH_HEADER_LEN,
    };
    FRAME_OVERHEAD + header + subject_len + reply_len + payload_len
}

fn reply_len(reply: &Option<String>) -> usize {
    reply.as_ref().map_or(0, String::len)
}

/// Bytes a header block takes in the payload field: its length and itself.
fn headers_field_len(headers: &Option<Bytes>) -> usize {
    headers
        .as_ref()
        .map_or(0, |block| HEADERS_PREFIX_LEN + block.len())
}

fn data_frame_len(
    kind: FrameKind,
    header: usize,
    subject: &str,
    reply: &Option<String>,
    payload_len: usize,
) -> Result<usize, EncodeError> {
    check_width(kind, "subject", subject.len(), u16::MAX as usize)?;
    check_width(kind, "reply subject", reply_len(reply), u16::MAX as usize)?;
    check_width(kind, "payload", payload_len, u32::MAX as usize)?;
    let total = FRAME_OVERHEAD + header + subject.len() + reply_len(reply) + payload_len;
    check_width(kind, "frame", total - PREFIX_LEN, u32::MAX as usize)?;
    Ok(total)
}

fn check_width(
    kind: FrameKind,
    field: &'static str,
    len: usize,
    max: usize,
) -> Result<(), EncodeError> {
    if len > max {
        return Err(EncodeError::FieldTooLong {
            kind,
            field,
            len,
            max,
        });
    }
    Ok(())
}

/// Writes prefix, kind and header (and subjects) of a data frame whose
/// payload will follow; the prefix already counts the payload.
fn write_head(frame: &Frame, out: &mut BytesMut) -> Result<(), EncodeError> {
    match frame {
        Frame::Publish(p) => {
            let fields = RoutedFields {
                subject: &p.subject,
                reply: p.reply.as_deref(),
                headers: p.headers.is_some(),
            };
            let payload_len = headers_field_len(&p.headers) + p.payload.len();
            routed_head_into(out, FrameKind::Publish, 0, p.seq, fields, payload_len)?;
            put_headers(out, &p.headers)
        }
        Frame::Message(m) => {
            let fields = RoutedFields {
                subject: &m.subject,
                reply: m.reply.as_deref(),
                headers: m.headers.is_some(),
            };
            let payload_len = headers_field_len(&m.headers) + m.payload.len();
            routed_head_into(out, FrameKind::Message, m.sid, m.seq, fields, payload_len)?;
            put_headers(out, &m.headers)
        }
        Frame::Fragment(f) => {
            encoded_len(frame)?;
            out.reserve(FRAGMENT_OVERHEAD);
            put_fragment_head(out, f, f.data.len() as u32);
            Ok(())
        }
        Frame::Run(frames) => {
            out.extend_from_slice(&run_head(frames.len())?);
            Ok(())
        }
        // Only data frames with a payload come here.
        _ => write_control(frame, out),
    }
}

/// The length and bytes of a header block, behind a frame's head.
fn put_headers(out: &mut BytesMut, headers: &Option<Bytes>) -> Result<(), EncodeError> {
    if let Some(block) = headers {
        let len = u32::try_from(block.len()).map_err(|_| EncodeError::FieldTooLong {
            kind: FrameKind::Publish,
            field: "headers",
            len: block.len(),
            max: u32::MAX as usize,
        })?;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(block);
    }
    Ok(())
}

/// The subject, reply subject and headers flag of a `Publish` or `Message`
/// frame built from parts ([`routed_head_into`], [`routed_into`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoutedFields<'a> {
    /// The subject.
    pub subject: &'a str,
    /// The reply subject, if any.
    pub reply: Option<&'a str>,
    /// Whether the payload field starts with a header block and its length
    /// ([`FLAG_HEADERS`]); the caller puts them there.
    pub headers: bool,
}

impl<'a> RoutedFields<'a> {
    /// A subject and reply subject, without headers.
    #[inline]
    pub fn new(subject: &'a str, reply: Option<&'a str>) -> Self {
        RoutedFields {
            subject,
            reply,
            headers: false,
        }
    }
}

/// Append the head of a `Publish` or `Message` frame (prefix, kind, header,
/// subjects) whose `payload_len` payload bytes the caller appends next, or
/// sends behind it as a separate part. `sid` is ignored for `Publish`.
/// With `fields.headers`, the payload field (counted in `payload_len`)
/// must start with a header block's length and the block.
/// Builds the same bytes as [`encode_into`] with a frame value, without one:
/// nothing is allocated beyond room in `out`. On error `out` is unchanged.
#[inline]
pub fn routed_head_into(
    out: &mut BytesMut,
    kind: FrameKind,
    sid: u64,
    seq: u64,
    fields: RoutedFields<'_>,
    payload_len: usize,
) -> Result<(), EncodeError> {
    let RoutedFields {
        subject,
        reply,
        headers,
    } = fields;
    let header = match kind {
        FrameKind::Publish => PUBLISH_HEADER_LEN,
        FrameKind::Message => MESSAGE_HEADER_LEN,
        _ => {
            return Err(EncodeError::Body {
                kind,
                text: "only publish and message frames carry subjects".to_string(),
            })
        }
    };
    let reply_len = reply.map_or(0, str::len);
    check_width(kind, "subject", subject.len(), u16::MAX as usize)?;
    check_width(kind, "reply subject", reply_len, u16::MAX as usize)?;
    check_width(kind, "payload", payload_len, u32::MAX as usize)?;
    let head_len = FRAME_OVERHEAD + header + subject.len() + reply_len;
    check_width(
        kind,
        "frame",
        head_len - PREFIX_LEN + payload_len,
        u32::MAX as usize,
    )?;
    // The fixed part is built on the stack and appended at once: one
    // capacity check per piece instead of one per field.
    let mut fixed = [0u8; FRAME_OVERHEAD + MESSAGE_HEADER_LEN];
    // Checked above: the body length fits u32.
    fixed[..4].copy_from_slice(&((head_len - PREFIX_LEN + payload_len) as u32).to_le_bytes());
    fixed[4] = kind as u8;
    let mut at = FRAME_OVERHEAD;
    if kind == FrameKind::Message {
        fixed[at..at + 8].copy_from_slice(&sid.to_le_bytes());
        at += 8;
    }
    fixed[at..at + 8].copy_from_slice(&seq.to_le_bytes());
    fixed[at + 8] =
        if reply.is_some() { FLAG_REPLY } else { 0 } | if headers { FLAG_HEADERS } else { 0 };
    fixed[at + 9..at + 11].copy_from_slice(&(subject.len() as u16).to_le_bytes());
    fixed[at + 11..at + 13].copy_from_slice(&(reply_len as u16).to_le_bytes());
    fixed[at + 13..at + 17].copy_from_slice(&(payload_len as u32).to_le_bytes());
    out.reserve(head_len);
    out.extend_from_slice(&fixed[..at + 17]);
    out.extend_from_slice(subject.as_bytes());
    if let Some(reply) = reply {
        out.extend_from_slice(reply.as_bytes());
    }
    Ok(())
}

/// Change the subscription id of the `Message` frame that starts at the
/// beginning of `frame` (as [`routed_into`] encoded it): a message fanned
/// out to several subscriptions is encoded once, copied, and given each
/// subscription's id. Does nothing to a slice too short to hold a header.
#[inline]
pub fn set_message_sid(frame: &mut [u8], sid: u64) {
    if let Some(field) = frame.get_mut(FRAME_OVERHEAD..FRAME_OVERHEAD + 8) {
        field.copy_from_slice(&sid.to_le_bytes());
    }
}

/// Whether a whole frame (prefix included) is a `Publish`, by its kind
/// byte alone.
pub fn is_publish(frame: &[u8]) -> bool {
    frame.get(PREFIX_LEN) == Some(&(FrameKind::Publish as u8))
}

/// The subscription id of the `Message` frame that starts at the beginning
/// of `frame` (encoded as [`routed_into`] or [`encode`] do), or `None` if
/// it is not one.
#[inline]
pub fn message_sid(frame: &[u8]) -> Option<u64> {
    if frame.get(PREFIX_LEN) != Some(&(FrameKind::Message as u8)) {
        return None;
    }
    let field = frame.get(FRAME_OVERHEAD..FRAME_OVERHEAD + 8)?;
    Some(u64::from_le_bytes(field.try_into().ok()?))
}

/// Append a whole `Publish` or `Message` frame, payload copied in: the
/// batching form of [`routed_head_into`] for small payloads.
#[inline]
pub fn routed_into(
    out: &mut BytesMut,
    kind: FrameKind,
    sid: u64,
    fields: RoutedFields<'_>,
    payload: &[u8],
) -> Result<(), EncodeError> {
    // Exactly the frame's length: a caller that left just that much room
    // (a run filled to its end) must not see its buffer grow.
    let header = match kind {
        FrameKind::Publish => PUBLISH_HEADER_LEN,
        _ => MESSAGE_HEADER_LEN,
    };
    let reply_len = fields.reply.map_or(0, str::len);
    out.reserve(FRAME_OVERHEAD + header + fields.subject.len() + reply_len + payload.len());
    routed_head_into(out, kind, sid, 0, fields, payload.len())?;
    out.extend_from_slice(payload);
    Ok(())
}

/// The head of a `Fragment` frame whose `data_len` data bytes travel
/// separately: the same bytes [`try_encode`] puts in `head` for a fragment
/// with that much data. `fragment.data` is ignored, so a sender can pass one
/// piece's data from several buffers without joining them.
pub fn fragment_head(
    fragment: &Fragment,
    data_len: usize,
) -> Result<[u8; FRAGMENT_OVERHEAD], EncodeError> {
    check_width(FrameKind::Fragment, "payload", data_len, u32::MAX as usize)?;
    check_width(
        FrameKind::Fragment,
        "frame",
        FRAGMENT_OVERHEAD - PREFIX_LEN + data_len,
        u32::MAX as usize,
    )?;
    let mut head = [0u8; FRAGMENT_OVERHEAD];
    // Checked above: data_len fits u32.
    put_fragment_head(&mut &mut head[..], fragment, data_len as u32);
    Ok(head)
}

/// Prefix, kind and header of a `Fragment` frame with `data_len` data bytes.
fn put_fragment_head<B: BufMut>(out: &mut B, f: &Fragment, data_len: u32) {
    out.put_u32_le((FRAGMENT_OVERHEAD - PREFIX_LEN) as u32 + data_len);
    out.put_u8(FrameKind::Fragment as u8);
    out.put_u64_le(f.msg_id);
    out.put_u32_le(f.index);
    out.put_u32_le(f.count);
    out.put_u32_le(f.total_len);
    out.put_u32_le(data_len);
}

/// Appends to a `BytesMut` for bincode.
struct BufWriter<'a>(&'a mut BytesMut);

impl Writer for BufWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> Result<(), bincode::error::EncodeError> {
        self.0.extend_from_slice(bytes);
        Ok(())
    }
}

/// Encodes a control frame, `Credit` or `Probe` (anything without a
/// payload).
fn write_control(frame: &Frame, out: &mut BytesMut) -> Result<(), EncodeError> {
    let start = out.len();
    out.put_u32_le(0);
    out.put_u8(FrameKind::of(frame) as u8);
    match frame {
        Frame::Credit(c) => {
            out.put_u32_le(c.messages);
            out.put_u64_le(c.bytes);
            out.put_u64_le(c.ack_seq);
        }
        Frame::Probe {
            nonce,
            sent_through,
        } => {
            out.put_u64_le(*nonce);
            out.put_u64_le(*sent_through);
        }
        _ => encode_control_body(frame, BufWriter(out))?,
    }
    let body = out.len() - start - FRAME_OVERHEAD;
    let kind = FrameKind::of(frame);
    check_width(kind, "control body", body, MAX_CONTROL_BODY)?;
    let n = (body + 1) as u32;
    out[start..start + PREFIX_LEN].copy_from_slice(&n.to_le_bytes());
    Ok(())
}

fn encode_control_body<W: Writer>(frame: &Frame, writer: W) -> Result<(), EncodeError> {
    let kind = FrameKind::of(frame);
    let config = bincode::config::standard();
    let result = match frame {
        Frame::Hello(h) => {
            check_offers(kind, &h.offers)?;
            bincode::serde::encode_into_writer(h, writer, config)
        }
        Frame::Welcome(w) => {
            check_offers(kind, &w.offers)?;
            bincode::serde::encode_into_writer(w, writer, config)
        }
        Frame::Subscribe(s) => bincode::serde::encode_into_writer(s, writer, config),
        Frame::Unsubscribe { sid } => bincode::serde::encode_into_writer(sid, writer, config),
        Frame::Ping { nonce } | Frame::Pong { nonce } => {
            bincode::serde::encode_into_writer(nonce, writer, config)
        }
        Frame::Error(e) => bincode::serde::encode_into_writer(e, writer, config),
        Frame::Goodbye(g) => bincode::serde::encode_into_writer(g, writer, config),
        Frame::Route(r) => bincode::serde::encode_into_writer(r, writer, config),
        Frame::RoutePeers(p) => bincode::serde::encode_into_writer(p, writer, config),
        Frame::Challenge(c) => bincode::serde::encode_into_writer(c, writer, config),
        Frame::Dropped(d) => bincode::serde::encode_into_writer(d, writer, config),
        Frame::UnsubscribeAfter { sid, total } => {
            bincode::serde::encode_into_writer((sid, total), writer, config)
        }
        Frame::BestEffortClosed {
            settled_through,
            sent_through,
            epoch,
            reason,
        } => {
            check_close_reason(kind, reason.len())
                .map_err(|text| EncodeError::Body { kind, text })?;
            let fields = (settled_through, sent_through, epoch, reason);
            bincode::serde::encode_into_writer(fields, writer, config)
        }
        Frame::BestEffortReopen { epoch } => {
            bincode::serde::encode_into_writer(epoch, writer, config)
        }
        Frame::Publish(_)
        | Frame::Message(_)
        | Frame::Fragment(_)
        | Frame::Credit(_)
        | Frame::Probe { .. }
        | Frame::Run(_) => {
            return Err(EncodeError::Body {
                kind,
                text: "data frames have no bincode body".to_string(),
            })
        }
    };
    result.map_err(|err| body_error(kind, err))
}

fn body_error(kind: FrameKind, err: bincode::error::EncodeError) -> EncodeError {
    EncodeError::Body {
        kind,
        text: err.to_string(),
    }
}

fn check_offers(kind: FrameKind, offers: &[Offer]) -> Result<(), EncodeError> {
    if offers.len() > MAX_OFFERS {
        return Err(EncodeError::TooManyOffers {
            kind,
            count: offers.len(),
            max: MAX_OFFERS,
        });
    }
    // What the peer would refuse is not sent.
    offers
        .iter()
        .try_for_each(Offer::check_sizes)
        .map_err(|text| EncodeError::Body { kind, text })
}

/// A [`Frame::BestEffortClosed`]'s reason is within [`MAX_CLOSE_REASON`].
fn check_close_reason(kind: FrameKind, len: usize) -> Result<(), String> {
    if len > MAX_CLOSE_REASON {
        return Err(format!(
            "{kind}: a reason of {len} bytes, past the limit of {MAX_CLOSE_REASON}"
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------

/// Total length (prefix included) of the frame at the start of `buf`, for
/// splitting a byte stream: `Ok(None)` until the 4-byte prefix is there.
/// Rejects a declared length over `limits.max_frame` (or of zero) from the
/// prefix alone, so the caller allocates nothing for it.
#[inline]
pub fn frame_len(buf: &[u8], limits: &CodecLimits) -> Result<Option<usize>, DecodeError> {
    let Some(prefix) = buf.first_chunk::<PREFIX_LEN>() else {
        return Ok(None);
    };
    let declared = u32::from_le_bytes(*prefix);
    if declared == 0 {
        return Err(DecodeError::Empty);
    }
    let total = u64::from(declared) + PREFIX_LEN as u64;
    if total > limits.max_frame as u64 {
        return Err(DecodeError::TooLarge {
            len: total,
            max: limits.max_frame,
        });
    }
    // total <= max_frame, a usize: the cast is exact.
    Ok(Some(total as usize))
}

/// The kind of one whole frame, after checking that its length prefix
/// matches its length exactly and is within the limits.
#[inline]
fn whole_frame_kind(frame: &[u8], limits: &CodecLimits) -> Result<FrameKind, DecodeError> {
    let Some(total) = frame_len(frame, limits)? else {
        return Err(DecodeError::Truncated {
            needed: PREFIX_LEN,
            available: frame.len(),
        });
    };
    if total != frame.len() {
        return Err(DecodeError::LengthMismatch {
            declared: total - PREFIX_LEN,
            actual: frame.len() - PREFIX_LEN,
        });
    }
    let kind_byte = frame[PREFIX_LEN];
    let kind = FrameKind::from_byte(kind_byte).ok_or(DecodeError::UnknownKind(kind_byte))?;
    Ok(kind)
}

/// The length prefix and kind byte of a [`Frame::Run`] holding
/// `frames_len` bytes of whole frames, which follow it unchanged.
pub fn run_head(frames_len: usize) -> Result<[u8; FRAME_OVERHEAD], EncodeError> {
    check_width(FrameKind::Run, "frames", frames_len, MAX_RUN_LEN)?;
    let mut head = [0u8; FRAME_OVERHEAD];
    // Within MAX_RUN_LEN, the kind byte included still fits the prefix.
    head[..PREFIX_LEN].copy_from_slice(&((frames_len + 1) as u32).to_le_bytes());
    head[PREFIX_LEN] = FrameKind::Run as u8;
    Ok(head)
}

/// Append the frames of a run's body (a [`Frame::Run`]'s bytes) to `out`
/// as slices of it, and say how many there were. A run must hold at
/// least one frame, only whole ones, and none of the link layer's own
/// (run, fragment, credit); otherwise nothing is appended.
/// Each frame is checked for a known kind only: decoding it is for the
/// caller, as for a frame that came alone.
pub fn open_run(frames: &Bytes, out: &mut Vec<Bytes>) -> Result<usize, DecodeError> {
    let count = check_run(frames)?;
    out.extend(crate::transport::split_run(frames).map(|frame| frame.head));
    Ok(count)
}

/// Check the frames of a [`Frame::Run`] (its body, `frames`) as
/// [`open_run`] does, without taking them out: how many there are, or why
/// the run does not open. A run that checks splits into exactly its frames
/// with [`crate::transport::split_run_slices`].
pub fn check_run(frames: &[u8]) -> Result<usize, DecodeError> {
    let mut at = 0;
    let mut count = 0;
    loop {
        if at == frames.len() {
            return if at == 0 {
                Err(DecodeError::BadRun("it holds no frame"))
            } else {
                Ok(count)
            };
        }
        let Some(len) = frames[at..]
            .first_chunk::<PREFIX_LEN>()
            .map(|prefix| u32::from_le_bytes(*prefix) as usize)
        else {
            return Err(DecodeError::BadRun("it ends inside a length prefix"));
        };
        let end = (at + PREFIX_LEN).checked_add(len);
        let Some(end) = end.filter(|&end| len > 0 && end <= frames.len()) else {
            return Err(DecodeError::BadRun("a frame's length runs past its end"));
        };
        match FrameKind::from_byte(frames[at + PREFIX_LEN]) {
            None => return Err(DecodeError::UnknownKind(frames[at + PREFIX_LEN])),
            Some(FrameKind::Run | FrameKind::Fragment | FrameKind::Credit | FrameKind::Probe) => {
                return Err(DecodeError::BadRun("it holds a link frame"))
            }
            Some(_) => count += 1,
        }
        at = end;
    }
}

/// Decode one whole frame, length prefix included, as endpoints deliver
/// them. Payloads and fragment data are slices of `frame`. Never panics.
pub fn decode(frame: Bytes, limits: &CodecLimits) -> Result<Frame, DecodeError> {
    let kind = whole_frame_kind(&frame, limits)?;
    match kind {
        FrameKind::Publish | FrameKind::Message => decode_routed(kind, &frame, limits),
        FrameKind::Fragment => decode_fragment(frame.slice(FRAME_OVERHEAD..)),
        FrameKind::Credit => decode_credit(&frame[FRAME_OVERHEAD..]),
        FrameKind::Probe => decode_probe(&frame[FRAME_OVERHEAD..]),
        FrameKind::Run => Ok(Frame::Run(frame.slice(FRAME_OVERHEAD..))),
        _ => decode_control(kind, &frame[FRAME_OVERHEAD..]),
    }
}

/// Little-endian field reader over a body; every read is bounds-checked.
struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Fields<'a> {
    fn new(buf: &'a [u8], header_len: usize) -> Result<Self, DecodeError> {
        if buf.len() < header_len {
            return Err(DecodeError::Truncated {
                needed: FRAME_OVERHEAD + header_len,
                available: FRAME_OVERHEAD + buf.len(),
            });
        }
        Ok(Fields { buf, pos: 0 })
    }

    /// [`Self::new`] for a body of `kind` that is `len` bytes exactly.
    fn exact(buf: &'a [u8], len: usize, kind: FrameKind) -> Result<Self, DecodeError> {
        let fields = Self::new(buf, len)?;
        if buf.len() != len {
            return Err(DecodeError::BodyLength {
                kind,
                declared: len as u64,
                actual: buf.len(),
            });
        }
        Ok(fields)
    }

    // The constructor checked the header length, so the reads below are
    // in bounds; they still go through `get` so nothing here can panic.
    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        if let Some(src) = self.buf.get(self.pos..self.pos + N) {
            out.copy_from_slice(src);
        }
        self.pos += N;
        out
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

/// A `Publish` or `Message` frame read in place: the subjects borrow the
/// frame's bytes, nothing is allocated. [`peek_routed`] checks exactly what
/// [`decode`] checks, so a view exists for a frame if and only if it
/// decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutedView<'a> {
    /// `Publish` or `Message`.
    pub kind: FrameKind,
    /// The subscription id (`Message`); 0 for a `Publish`.
    pub sid: u64,
    /// The sequence number from the header.
    pub seq: u64,
    /// The subject.
    pub subject: &'a str,
    /// The reply subject, if the frame has one.
    pub reply: Option<&'a str>,
    /// Whether `payload` starts with a header block and its length
    /// ([`FLAG_HEADERS`]; checked to fit).
    pub headers: bool,
    /// The payload field as on the wire: with `headers`, the header
    /// block's length and the block come before the body (see
    /// [`RoutedView::headers_and_body`]). Routers pass it on whole.
    pub payload: &'a [u8],
    /// Where the payload starts in the frame (prefix included), for
    /// slicing it out of the frame's `Bytes` without a copy.
    pub payload_at: usize,
}

impl<'a> RoutedView<'a> {
    /// The payload as a slice of `frame`, the buffer this view was read
    /// from: shared, not copied.
    #[inline]
    pub fn payload_of(&self, frame: &Bytes) -> Bytes {
        frame.slice(self.payload_at..self.payload_at + self.payload.len())
    }

    /// The header block (when the frame has one) and the body.
    #[inline]
    pub fn headers_and_body(&self) -> (Option<&'a [u8]>, &'a [u8]) {
        if !self.headers {
            return (None, self.payload);
        }
        split_headers(self.payload)
            .map_or((None, self.payload), |(block, body)| (Some(block), body))
    }
}

/// The payload field of a message with headers: the block's length, the
/// block, the body (copied into one buffer).
pub fn join_headers(block: &[u8], body: &[u8]) -> Bytes {
    let mut field = BytesMut::with_capacity(HEADERS_PREFIX_LEN + block.len() + body.len());
    // Header blocks are held to the payload limit, far below 4 GiB (the
    // length saturates rather than wraps).
    field.extend_from_slice(&(block.len().min(u32::MAX as usize) as u32).to_le_bytes());
    field.extend_from_slice(block);
    field.extend_from_slice(body);
    field.freeze()
}

/// A payload field with [`FLAG_HEADERS`] as its header block and body, or
/// `None` when its length prefix does not fit it.
#[inline]
pub fn split_headers(field: &[u8]) -> Option<(&[u8], &[u8])> {
    let prefix = field.first_chunk::<HEADERS_PREFIX_LEN>()?;
    let len = u32::from_le_bytes(*prefix) as usize;
    let rest = &field[HEADERS_PREFIX_LEN..];
    (len <= rest.len()).then(|| rest.split_at(len))
}

/// Read a whole frame (prefix included, as endpoints deliver them) without
/// allocating: `Ok(Some(view))` for a valid `Publish` or `Message`,
/// `Ok(None)` for any other kind (decode those with [`decode`]), and the
/// error [`decode`] would give for a malformed data frame. Never panics.
pub fn peek_routed<'a>(
    frame: &'a [u8],
    limits: &CodecLimits,
) -> Result<Option<RoutedView<'a>>, DecodeError> {
    peek_routed_known(frame, limits, "")
}

/// [`peek_routed`] for a receiver that expects a subject it has seen
/// before: when the frame's subject bytes equal `known`, the view's subject
/// is `known` itself and the UTF-8 check is skipped (`known` is a `str`
/// already). Same results as [`peek_routed`] for every input.
#[inline]
pub fn peek_routed_known<'a>(
    frame: &'a [u8],
    limits: &CodecLimits,
    known: &'a str,
) -> Result<Option<RoutedView<'a>>, DecodeError> {
    let kind = whole_frame_kind(frame, limits)?;
    let body = &frame[FRAME_OVERHEAD..];
    match kind {
        FrameKind::Publish | FrameKind::Message => routed_view(kind, body, limits, known).map(Some),
        _ => Ok(None),
    }
}

/// The view of a `Publish` or `Message` body; payload offsets count from
/// the start of the whole frame.
#[inline]
fn routed_view<'a>(
    kind: FrameKind,
    body: &'a [u8],
    limits: &CodecLimits,
    known: &'a str,
) -> Result<RoutedView<'a>, DecodeError> {
    // Both headers end in the same 17 bytes (seq, flags, three lengths); a
    // message has its sid in front.
    let (sid, at) = if kind == FrameKind::Message {
        let sid = body
            .first_chunk::<8>()
            .map_or(0, |raw| u64::from_le_bytes(*raw));
        (sid, 8)
    } else {
        (0, 0)
    };
    let Some(fixed) = body.get(at..).and_then(|rest| rest.first_chunk::<17>()) else {
        return Err(DecodeError::Truncated {
            needed: FRAME_OVERHEAD + at + 17,
            available: FRAME_OVERHEAD + body.len(),
        });
    };
    let field = |from: usize, to: usize| &fixed[from..to];
    let seq = u64::from_le_bytes(field(0, 8).try_into().unwrap_or_default());
    let flags = fixed[8];
    if flags & !(FLAG_REPLY | FLAG_HEADERS) != 0 {
        return Err(DecodeError::UnknownFlags { kind, flags });
    }
    let subject_len = usize::from(u16::from_le_bytes([fixed[9], fixed[10]]));
    let reply_len = usize::from(u16::from_le_bytes([fixed[11], fixed[12]]));
    let payload_len = u32::from_le_bytes([fixed[13], fixed[14], fixed[15], fixed[16]]) as usize;
    if flags & FLAG_REPLY == 0 && reply_len != 0 {
        return Err(DecodeError::UnknownFlags { kind, flags });
    }
    if subject_len.max(reply_len) > limits.max_subject_len {
        let (field, len) = if subject_len > limits.max_subject_len {
            ("subject", subject_len)
        } else {
            ("reply subject", reply_len)
        };
        return Err(DecodeError::FieldTooLong {
            kind,
            field,
            len,
            max: limits.max_subject_len,
        });
    }
    let header = at + 17;
    let declared = (header + subject_len + reply_len) as u64 + payload_len as u64;
    if declared != body.len() as u64 {
        return Err(DecodeError::BodyLength {
            kind,
            declared,
            actual: body.len(),
        });
    }
    let subject_end = header + subject_len;
    let reply_end = subject_end + reply_len;
    // The lengths add up to the body's (checked above): these are in range.
    let subject = &body[header..subject_end];
    let reply = &body[subject_end..reply_end];
    let payload = &body[reply_end..];
    let headers = flags & FLAG_HEADERS != 0;
    if headers && split_headers(payload).is_none() {
        let declared = payload
            .first_chunk::<HEADERS_PREFIX_LEN>()
            .map_or(HEADERS_PREFIX_LEN as u64, |raw| {
                u64::from(u32::from_le_bytes(*raw))
            });
        return Err(DecodeError::HeadersLength {
            kind,
            declared,
            available: payload.len(),
        });
    }
    let subject = if subject == known.as_bytes() {
        known
    } else {
        utf8(kind, "subject", subject)?
    };
    let reply = if flags & FLAG_REPLY != 0 {
        Some(utf8(kind, "reply subject", reply)?)
    } else {
        None
    };
    Ok(RoutedView {
        kind,
        sid,
        seq,
        subject,
        reply,
        headers,
        payload,
        payload_at: FRAME_OVERHEAD + reply_end,
    })
}

fn utf8<'a>(kind: FrameKind, field: &'static str, bytes: &'a [u8]) -> Result<&'a str, DecodeError> {
    std::str::from_utf8(bytes).map_err(|_| DecodeError::InvalidUtf8 { kind, field })
}

/// A whole `Publish` or `Message` frame (prefix included) as a value; the
/// payload is a slice of `frame`.
fn decode_routed(
    kind: FrameKind,
    frame: &Bytes,
    limits: &CodecLimits,
) -> Result<Frame, DecodeError> {
    let view = routed_view(kind, &frame[FRAME_OVERHEAD..], limits, "")?;
    let field = view.payload_of(frame);
    let (headers, payload) = match view.headers_and_body() {
        (Some(block), body) => {
            let block_at = HEADERS_PREFIX_LEN;
            let body_at = field.len() - body.len();
            (
                Some(field.slice(block_at..block_at + block.len())),
                field.slice(body_at..),
            )
        }
        (None, _) => (None, field),
    };
    let subject = view.subject.to_owned();
    let reply = view.reply.map(str::to_owned);
    Ok(if kind == FrameKind::Message {
        Frame::Message(Message {
            sid: view.sid,
            subject,
            reply,
            seq: view.seq,
            headers,
            payload,
        })
    } else {
        Frame::Publish(Publish {
            subject,
            reply,
            seq: view.seq,
            headers,
            payload,
        })
    })
}

fn decode_fragment(body: Bytes) -> Result<Frame, DecodeError> {
    let mut fields = Fields::new(&body, FRAGMENT_HEADER_LEN)?;
    let msg_id = fields.u64();
    let index = fields.u32();
    let count = fields.u32();
    let total_len = fields.u32();
    let data_len = fields.u32();
    let declared = FRAGMENT_HEADER_LEN as u64 + u64::from(data_len);
    if declared != body.len() as u64 {
        return Err(DecodeError::BodyLength {
            kind: FrameKind::Fragment,
            declared,
            actual: body.len(),
        });
    }
    Ok(Frame::Fragment(Fragment {
        msg_id,
        index,
        count,
        total_len,
        data: body.slice(FRAGMENT_HEADER_LEN..),
    }))
}

fn decode_credit(body: &[u8]) -> Result<Frame, DecodeError> {
    let mut fields = Fields::exact(body, CREDIT_BODY_LEN, FrameKind::Credit)?;
    Ok(Frame::Credit(Credit {
        messages: fields.u32(),
        bytes: fields.u64(),
        ack_seq: fields.u64(),
    }))
}

fn decode_probe(body: &[u8]) -> Result<Frame, DecodeError> {
    let mut fields = Fields::exact(body, PROBE_BODY_LEN, FrameKind::Probe)?;
    Ok(Frame::Probe {
        nonce: fields.u64(),
        sent_through: fields.u64(),
    })
}

/// A bincode reader over a body slice that knows how much it consumed.
struct BodyReader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Reader for BodyReader<'_> {
    fn read(&mut self, bytes: &mut [u8]) -> Result<(), bincode::error::DecodeError> {
        let end = self.pos.saturating_add(bytes.len());
        match self.buf.get(self.pos..end) {
            Some(src) => {
                bytes.copy_from_slice(src);
                self.pos = end;
                Ok(())
            }
            None => Err(bincode::error::DecodeError::UnexpectedEnd {
                additional: end - self.buf.len(),
            }),
        }
    }
}

/// Memory bincode may claim per body byte: a one-byte varint can decode to
/// a 16-byte integer. Anything beyond that ratio is a forged length.
const CLAIM_PER_BODY_BYTE: usize = 16;

fn decode_control(kind: FrameKind, body: &[u8]) -> Result<Frame, DecodeError> {
    if body.len() > MAX_CONTROL_BODY {
        return Err(DecodeError::FieldTooLong {
            kind,
            field: "control body",
            len: body.len(),
            max: MAX_CONTROL_BODY,
        });
    }
    // The claim limit is a const generic in bincode; pick the smallest tier
    // that covers this body.
    let claim = body.len() * CLAIM_PER_BODY_BYTE;
    if claim <= 4 << 10 {
        decode_control_limited::<{ 4 << 10 }>(kind, body)
    } else if claim <= 64 << 10 {
        decode_control_limited::<{ 64 << 10 }>(kind, body)
    } else {
        decode_control_limited::<{ MAX_CONTROL_BODY * CLAIM_PER_BODY_BYTE }>(kind, body)
    }
}

fn decode_control_limited<const LIMIT: usize>(
    kind: FrameKind,
    body: &[u8],
) -> Result<Frame, DecodeError> {
    let mut reader = BodyReader { buf: body, pos: 0 };
    let config = bincode::config::standard().with_limit::<LIMIT>();
    let decoded = control_body(kind, &mut DecoderImpl::new(&mut reader, config, ()));
    let result = match decoded {
        Ok(frame) if reader.pos == body.len() => return Ok(frame),
        Ok(_) => Err(DecodeError::TrailingBytes {
            kind,
            count: body.len() - reader.pos,
        }),
        Err(err) => Err(err),
    };
    if kind == FrameKind::Hello {
        if let Some(hello) = other_version_hello(body) {
            return Ok(hello);
        }
    }
    result
}

/// A hello of another protocol version may not decode as this one (its
/// fields differ), but its version, the first field, still does: the
/// hello is given with that version alone, so that the peer is told which
/// version this side speaks rather than that its frame is malformed.
fn other_version_hello(body: &[u8]) -> Option<Frame> {
    let mut reader = BodyReader { buf: body, pos: 0 };
    let config = bincode::config::standard().with_limit::<64>();
    let version = u16::decode(&mut DecoderImpl::new(&mut reader, config, ())).ok()?;
    (version != PROTOCOL_VERSION).then(|| {
        Frame::Hello(Hello {
            no_echo: false,
            no_responders: false,
            version,
            name: String::new(),
            credentials: None,
            user: None,
            proof: None,
            offers: Vec::new(),
            link_auth: None,
        })
    })
}

fn control_body<D: bincode::de::Decoder<Context = ()>>(
    kind: FrameKind,
    de: &mut D,
) -> Result<Frame, DecodeError> {
    let err = |e: bincode::error::DecodeError| DecodeError::Body {
        kind,
        text: e.to_string(),
    };
    Ok(match kind {
        // Hello and Welcome are read field by field, in the order serde
        // writes them, so the offer count is bounded before any offer is
        // decoded (serde would preallocate from the declared count).
        FrameKind::Hello => {
            let version = u16::decode(de).map_err(err)?;
            let name = String::decode(de).map_err(err)?;
            let user = Option::<String>::decode(de).map_err(err)?;
            let credentials = Option::<String>::decode(de).map_err(err)?;
            let proof = serde_value::<Option<SecretProof>, D>(kind, de)?;
            let offers = decode_offers(kind, de)?;
            let link_auth = serde_value::<Option<LinkAuth>, D>(kind, de)?;
            let no_echo = bool::decode(de).map_err(err)?;
            let no_responders = bool::decode(de).map_err(err)?;
            Frame::Hello(Hello {
                no_echo,
                no_responders,
                version,
                name,
                user,
                credentials,
                proof,
                offers,
                link_auth,
            })
        }
        FrameKind::Welcome => {
            let version = u16::decode(de).map_err(err)?;
            let name = String::decode(de).map_err(err)?;
            let offers = decode_offers(kind, de)?;
            let max_payload = u64::decode(de).map_err(err)?;
            let link_auth = serde_value::<Option<LinkAuth>, D>(kind, de)?;
            let max_subject_len = u32::decode(de).map_err(err)?;
            let max_subject_tokens = u32::decode(de).map_err(err)?;
            let proof = serde_value::<Option<[u8; 32]>, D>(kind, de)?;
            Frame::Welcome(Welcome {
                version,
                name,
                offers,
                max_payload,
                link_auth,
                max_subject_len,
                max_subject_tokens,
                proof,
            })
        }
        FrameKind::Subscribe => Frame::Subscribe(serde_value::<Subscribe, D>(kind, de)?),
        FrameKind::Unsubscribe => Frame::Unsubscribe {
            sid: u64::decode(de).map_err(err)?,
        },
        FrameKind::Ping => Frame::Ping {
            nonce: u64::decode(de).map_err(err)?,
        },
        FrameKind::Pong => Frame::Pong {
            nonce: u64::decode(de).map_err(err)?,
        },
        FrameKind::Error => Frame::Error(serde_value::<ErrorFrame, D>(kind, de)?),
        FrameKind::Goodbye => Frame::Goodbye(serde_value::<Goodbye, D>(kind, de)?),
        FrameKind::Route => Frame::Route(serde_value::<RouteHello, D>(kind, de)?),
        FrameKind::RoutePeers => Frame::RoutePeers(serde_value::<RoutePeers, D>(kind, de)?),
        FrameKind::Challenge => Frame::Challenge(serde_value::<Challenge, D>(kind, de)?),
        FrameKind::Dropped => Frame::Dropped(serde_value::<Dropped, D>(kind, de)?),
        FrameKind::UnsubscribeAfter => Frame::UnsubscribeAfter {
            sid: u64::decode(de).map_err(err)?,
            total: u64::decode(de).map_err(err)?,
        },
        FrameKind::BestEffortClosed => {
            let settled_through = u64::decode(de).map_err(err)?;
            let sent_through = u64::decode(de).map_err(err)?;
            let epoch = u32::decode(de).map_err(err)?;
            let reason = String::decode(de).map_err(err)?;
            check_close_reason(kind, reason.len())
                .map_err(|text| DecodeError::Body { kind, text })?;
            Frame::BestEffortClosed {
                settled_through,
                sent_through,
                epoch,
                reason,
            }
        }
        FrameKind::BestEffortReopen => Frame::BestEffortReopen {
            epoch: u32::decode(de).map_err(err)?,
        },
        FrameKind::Publish
        | FrameKind::Message
        | FrameKind::Fragment
        | FrameKind::Credit
        | FrameKind::Probe
        | FrameKind::Run => {
            return Err(DecodeError::Body {
                kind,
                text: "not a control frame".to_string(),
            })
        }
    })
}

fn serde_value<T: DeserializeOwned + Serialize, D: bincode::de::Decoder<Context = ()>>(
    kind: FrameKind,
    de: &mut D,
) -> Result<T, DecodeError> {
    Compat::<T>::decode(de)
        .map(|Compat(value)| value)
        .map_err(|e| DecodeError::Body {
            kind,
            text: e.to_string(),
        })
}

fn decode_offers<D: bincode::de::Decoder<Context = ()>>(
    kind: FrameKind,
    de: &mut D,
) -> Result<Vec<Offer>, DecodeError> {
    let count = u64::decode(de).map_err(|e| DecodeError::Body {
        kind,
        text: e.to_string(),
    })?;
    if count > MAX_OFFERS as u64 {
        return Err(DecodeError::TooManyOffers {
            kind,
            count,
            max: MAX_OFFERS,
        });
    }
    (0..count)
        .map(|_| {
            let offer = serde_value::<Offer, D>(kind, de)?;
            offer
                .check_sizes()
                .map_err(|text| DecodeError::Body { kind, text })?;
            Ok(offer)
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Stream reassembly
// ---------------------------------------------------------------------------

/// Splits a byte stream into whole frames by their length prefix.
///
/// Bytes go in with [`push`](FrameReader::push), by reading straight into
/// [`read_buf`](FrameReader::read_buf), or with
/// [`read_from`](FrameReader::read_from); whole frames (prefix included)
/// come out of [`next_frame`](FrameReader::next_frame) as slices of the
/// internal buffer, ready for [`decode`]. A declared length over the limit
/// is an error as soon as its 4 prefix bytes are in, before room is made for
/// the frame. Errors are sticky: the stream cannot be resynchronised.
#[derive(Debug)]
pub struct FrameReader {
    buf: BytesMut,
    limits: CodecLimits,
    failed: Option<DecodeError>,
}

/// How much [`FrameReader::read_from`] reads at most per call, unless a
/// larger frame is pending.
pub const READ_CHUNK: usize = 64 * 1024;

impl FrameReader {
    /// An empty reader refusing frames over `limits.max_frame`.
    pub fn new(limits: CodecLimits) -> Self {
        FrameReader {
            buf: BytesMut::new(),
            limits,
            failed: None,
        }
    }

    /// The limits the reader checks.
    pub fn limits(&self) -> &CodecLimits {
        &self.limits
    }

    /// Append received bytes.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The buffer itself, for a caller that reads into its spare capacity.
    /// Only append to it.
    pub fn read_buf(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// Bytes received and not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Read once from `reader` into the buffer: up to [`READ_CHUNK`] bytes,
    /// or the rest of a pending frame when that is larger (so a big frame
    /// takes few reads). Returns what `read` returned; `Ok(0)` is end of
    /// stream.
    pub fn read_from<R: io::Read>(&mut self, reader: &mut R) -> io::Result<usize> {
        let pending = match frame_len(&self.buf, &self.limits) {
            Ok(Some(total)) => total.saturating_sub(self.buf.len()),
            _ => 0,
        };
        let want = pending.max(READ_CHUNK);
        let start = self.buf.len();
        self.buf.resize(start + want, 0);
        let result = reader.read(&mut self.buf[start..]);
        let got = *result.as_ref().unwrap_or(&0);
        self.buf.truncate(start + got);
        result
    }

    /// The next whole frame, `Ok(None)` if more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Bytes>, DecodeError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        match frame_len(&self.buf, &self.limits) {
            Ok(Some(total)) if self.buf.len() >= total => {
                Ok(Some(self.buf.split_to(total).freeze()))
            }
            Ok(Some(total)) => {
                // The length is within the limit: make room for the whole
                // frame so it arrives in one buffer.
                self.buf.reserve(total - self.buf.len());
                Ok(None)
            }
            Ok(None) => Ok(None),
            Err(err) => {
                self.failed = Some(err.clone());
                Err(err)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_layout_is_as_documented() {
        let frame = Frame::Publish(Publish {
            headers: None,
            subject: "a.b".into(),
            reply: Some("r".into()),
            seq: 7,
            payload: Bytes::from_static(b"xyz"),
        });
        let out = encode(&frame);
        assert_eq!(out.body, Bytes::from_static(b"xyz"));
        let all = out.to_bytes();
        let mut expect = Vec::new();
        expect.extend_from_slice(&(1 + 17 + 3 + 1 + 3u32).to_le_bytes());
        expect.push(0x10);
        expect.extend_from_slice(&7u64.to_le_bytes());
        expect.push(FLAG_REPLY);
        expect.extend_from_slice(&3u16.to_le_bytes());
        expect.extend_from_slice(&1u16.to_le_bytes());
        expect.extend_from_slice(&3u32.to_le_bytes());
        expect.extend_from_slice(b"a.br");
        expect.extend_from_slice(b"xyz");
        assert_eq!(&all[..], &expect[..]);
        assert_eq!(encoded_len(&frame), Ok(expect.len()));
    }

    #[test]
    fn payload_is_sliced_not_copied() {
        let frame = Frame::Message(Message {
            headers: None,
            sid: 1,
            subject: "s".into(),
            reply: None,
            seq: 0,
            payload: Bytes::from(vec![9u8; 100]),
        });
        let wire = encode(&frame).to_bytes();
        let range = wire.as_ptr() as usize..wire.as_ptr() as usize + wire.len();
        match decode(wire.clone(), &CodecLimits::default()) {
            Ok(Frame::Message(m)) => assert!(range.contains(&(m.payload.as_ptr() as usize))),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn oversized_subject_is_an_encode_error() {
        let frame = Frame::Publish(Publish {
            headers: None,
            subject: "x".repeat(70_000),
            reply: None,
            seq: 0,
            payload: Bytes::new(),
        });
        let mut out = BytesMut::from(&b"keep"[..]);
        assert!(matches!(
            try_encode_into(&frame, &mut out),
            Err(EncodeError::FieldTooLong {
                field: "subject",
                ..
            })
        ));
        assert_eq!(&out[..], b"keep");
    }

    #[test]
    fn a_hello_of_another_version_gives_its_version_even_if_undecodable() {
        // Version 2, then fields this version cannot read.
        let mut body = vec![FrameKind::Hello as u8, 2];
        body.extend_from_slice(&[0xff; 9]);
        let mut bytes = (body.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&body);
        match decode(Bytes::from(bytes), &CodecLimits::default()) {
            Ok(Frame::Hello(hello)) => assert_eq!(hello.version, 2),
            other => panic!("expected a hello of version 2, got {other:?}"),
        }
        // This version's own hello, malformed, stays an error.
        let mut body = vec![FrameKind::Hello as u8, PROTOCOL_VERSION as u8];
        body.extend_from_slice(&[0xff; 9]);
        let mut bytes = (body.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&body);
        assert!(decode(Bytes::from(bytes), &CodecLimits::default()).is_err());
    }

    #[test]
    fn dropped_layout_is_kind_0x0a_then_two_varints() {
        let frame = Frame::Dropped(Dropped { sid: 7, count: 300 });
        let wire = encode(&frame).to_bytes();
        // bincode varints: below 251 one byte; up to u16::MAX, 251 then two.
        assert_eq!(&wire[..], &[5, 0, 0, 0, 0x0a, 7, 251, 0x2c, 0x01]);
        assert_eq!(encoded_len(&frame), Ok(wire.len()));
        assert_eq!(decode(wire, &CodecLimits::default()), Ok(frame.clone()));
        let mut trailing = BytesMut::new();
        encode_into(&frame, &mut trailing);
        trailing.put_u8(0);
        trailing[..PREFIX_LEN].copy_from_slice(&6u32.to_le_bytes());
        assert!(matches!(
            decode(trailing.freeze(), &CodecLimits::default()),
            Err(DecodeError::TrailingBytes {
                kind: FrameKind::Dropped,
                count: 1
            })
        ));
    }

    #[test]
    fn a_routed_frame_fits_exactly_the_room_it_needs() {
        for (kind, reply) in [
            (FrameKind::Publish, None),
            (FrameKind::Publish, Some("_INBOX.a.1")),
            (FrameKind::Message, None),
            (FrameKind::Message, Some("r")),
        ] {
            let fields = RoutedFields {
                subject: "bench.x",
                reply,
                headers: false,
            };
            let payload = [7u8; 16];
            let mut sized = BytesMut::new();
            routed_into(&mut sized, kind, 9, fields, &payload).expect("encodes");
            // A buffer with exactly that much room left keeps its memory.
            let mut out = BytesMut::with_capacity(100 + sized.len());
            out.extend_from_slice(&[0u8; 100]);
            let (at, capacity) = (out.as_ptr(), out.capacity());
            routed_into(&mut out, kind, 9, fields, &payload).expect("encodes");
            assert_eq!(
                (out.as_ptr(), out.capacity()),
                (at, capacity),
                "{kind:?} {reply:?}"
            );
            assert_eq!(&out[100..], &sized[..]);
        }
    }

    #[test]
    fn a_header_length_past_its_field_is_refused() {
        let fields = RoutedFields {
            subject: "s",
            reply: None,
            headers: true,
        };
        let limits = CodecLimits::default();
        // Fields too short for a length, or with a length past their end.
        for field in [
            &b""[..],
            b"\x01\0\0",
            b"\x05\0\0\0abcd",
            b"\xff\xff\xff\xffx",
        ] {
            let mut frame = BytesMut::new();
            routed_into(&mut frame, FrameKind::Publish, 0, fields, field).expect("encodes");
            assert!(
                matches!(
                    peek_routed(&frame, &limits),
                    Err(DecodeError::HeadersLength { .. })
                ),
                "{field:?}"
            );
            assert!(matches!(
                decode(frame.freeze(), &limits),
                Err(DecodeError::HeadersLength { .. })
            ));
        }
        // A block that fills its field exactly leaves an empty body.
        let mut frame = BytesMut::new();
        routed_into(&mut frame, FrameKind::Publish, 0, fields, b"\x02\0\0\0ab").expect("encodes");
        let view = peek_routed(&frame, &limits)
            .expect("valid")
            .expect("a publish");
        assert_eq!(view.headers_and_body(), (Some(&b"ab"[..]), &b""[..]));
    }

    #[test]
    fn message_sid_reads_what_set_message_sid_wrote() {
        let mut out = BytesMut::new();
        routed_into(
            &mut out,
            FrameKind::Message,
            3,
            RoutedFields::new("s", None),
            b"x",
        )
        .expect("encodes");
        assert_eq!(message_sid(&out), Some(3));
        set_message_sid(&mut out, 1 << 40);
        assert_eq!(message_sid(&out), Some(1 << 40));
        let mut publish = BytesMut::new();
        routed_into(
            &mut publish,
            FrameKind::Publish,
            0,
            RoutedFields::new("s", None),
            b"x",
        )
        .expect("encodes");
        assert_eq!(message_sid(&publish), None, "not a message");
        assert_eq!(message_sid(&out[..FRAME_OVERHEAD + 4]), None, "too short");
    }

    fn ping(nonce: u64) -> Bytes {
        encode(&Frame::Ping { nonce }).to_bytes()
    }

    #[test]
    fn a_run_is_its_frames_behind_a_head_and_opens_into_them() {
        let publish = encode(&Frame::Publish(Publish {
            headers: None,
            subject: "a".into(),
            reply: None,
            seq: 1,
            payload: Bytes::from_static(b"xy"),
        }))
        .to_bytes();
        let frames = Bytes::from([ping(1), publish.clone(), ping(2)].concat());
        let wire = encode(&Frame::Run(frames.clone())).to_bytes();
        assert_eq!(wire[..FRAME_OVERHEAD], run_head(frames.len()).unwrap());
        assert_eq!(wire[PREFIX_LEN], 0x14);
        assert_eq!(wire[FRAME_OVERHEAD..], frames[..]);
        let limits = CodecLimits::default();
        assert_eq!(decode(wire, &limits), Ok(Frame::Run(frames.clone())));

        assert_eq!(check_run(&frames), Ok(3));
        let mut out = vec![ping(9)];
        assert_eq!(open_run(&frames, &mut out), Ok(3));
        assert_eq!(out, [ping(9), ping(1), publish, ping(2)]);
    }

    #[test]
    fn a_run_that_is_not_whole_frames_opens_into_nothing() {
        let run_in_run = encode(&Frame::Run(ping(1))).to_bytes();
        let credit = encode(&Frame::Credit(Credit {
            messages: 1,
            bytes: 1,
            ack_seq: 1,
        }))
        .to_bytes();
        let probe = encode(&Frame::Probe {
            nonce: 1,
            sent_through: 1,
        })
        .to_bytes();
        let truncated = ping(2).slice(..ping(2).len() - 1);
        let mut zero_length = ping(3).to_vec();
        zero_length.extend_from_slice(&[0, 0, 0, 0]);
        let mut unknown_kind = ping(4).to_vec();
        unknown_kind.extend_from_slice(&[1, 0, 0, 0, 0x7f]);
        for (bad, why) in [
            (Bytes::new(), "empty"),
            (Bytes::from([ping(1), run_in_run].concat()), "nested run"),
            (Bytes::from([ping(1), credit].concat()), "credit"),
            (Bytes::from([ping(1), probe].concat()), "probe"),
            (Bytes::from([ping(1), truncated].concat()), "cut short"),
            (Bytes::from(zero_length), "zero length"),
            (Bytes::from(unknown_kind), "unknown kind"),
            (Bytes::from_static(&[5, 0]), "cut in the prefix"),
        ] {
            assert!(check_run(&bad).is_err(), "{why}");
            let mut out = vec![ping(9)];
            assert!(open_run(&bad, &mut out).is_err(), "{why}");
            assert_eq!(out, [ping(9)], "{why}: nothing appended");
        }
    }

    #[test]
    fn control_frames_carry_their_kind() {
        for (frame, kind) in [
            (Frame::Ping { nonce: 3 }, FrameKind::Ping),
            (Frame::Unsubscribe { sid: 9 }, FrameKind::Unsubscribe),
            (
                Frame::UnsubscribeAfter { sid: 9, total: 2 },
                FrameKind::UnsubscribeAfter,
            ),
            (
                Frame::best_effort_closed(41, 7, 2, "3 pings went unanswered".into()),
                FrameKind::BestEffortClosed,
            ),
            (
                Frame::BestEffortReopen { epoch: 3 },
                FrameKind::BestEffortReopen,
            ),
            (
                Frame::Route(RouteHello {
                    broker_id: 1 << 40,
                    advertise: Some("tcp/0.0.0.0:7420".into()),
                    seeded: false,
                    limits: crate::frame::RouteLimits {
                        max_payload: 1 << 20,
                        max_subject_len: 512,
                        max_subject_tokens: 32,
                    },
                }),
                FrameKind::Route,
            ),
            (
                Frame::RoutePeers(RoutePeers {
                    addresses: vec!["tcp/10.0.0.2:7420".into()],
                }),
                FrameKind::RoutePeers,
            ),
            (
                Frame::Dropped(Dropped {
                    sid: 7,
                    count: u64::MAX,
                }),
                FrameKind::Dropped,
            ),
        ] {
            let wire = encode(&frame).to_bytes();
            assert_eq!(wire[PREFIX_LEN], kind as u8);
            assert_eq!(FrameKind::from_byte(kind as u8), Some(kind));
            assert!(kind.is_control());
            let limits = CodecLimits::default();
            assert_eq!(decode(wire, &limits).ok(), Some(frame));
        }
    }

    #[test]
    fn a_close_reason_is_cut_to_its_bound_and_refused_past_it() {
        // Cut at a character: 'é' is two bytes, the bound even.
        let long = format!("x{}", "é".repeat(MAX_CLOSE_REASON));
        let Frame::BestEffortClosed { reason, .. } = Frame::best_effort_closed(0, 0, 0, long)
        else {
            unreachable!("the constructor makes that frame");
        };
        assert_eq!(reason.len(), MAX_CLOSE_REASON - 1);
        let over = Frame::BestEffortClosed {
            settled_through: 0,
            sent_through: 0,
            epoch: 0,
            reason: "r".repeat(MAX_CLOSE_REASON + 1),
        };
        assert!(matches!(try_encode(&over), Err(EncodeError::Body { .. })));
        // Forged by hand: the kind byte, the two sequences, the epoch and
        // the string (varints: 0, 0, 0, then 251 and two bytes for the
        // length).
        let text = "r".repeat(MAX_CLOSE_REASON + 1);
        let mut body = vec![FrameKind::BestEffortClosed as u8, 0, 0, 0, 251];
        body.extend_from_slice(&(text.len() as u16).to_le_bytes());
        body.extend_from_slice(text.as_bytes());
        let mut wire = (body.len() as u32).to_le_bytes().to_vec();
        wire.extend_from_slice(&body);
        let refused = decode(Bytes::from(wire), &CodecLimits::default());
        assert!(
            matches!(
                refused,
                Err(DecodeError::Body {
                    kind: FrameKind::BestEffortClosed,
                    ..
                })
            ),
            "{refused:?}"
        );
    }
}
