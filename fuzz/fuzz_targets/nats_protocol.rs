//! The NATS listener's protocol parser and translator. Input: a first byte
//! choosing where to cut the rest into reads, then the bytes a client
//! sends. Nothing panics; every frame handed to the broker decodes; what
//! is buffered stays within the control line and payload limits; after an
//! error nothing more is read. The same bytes, as a frame and as a run of
//! frames from the broker, are translated without a panic.

#![no_main]

use bytes::{Bytes, BytesMut};
use efabus_core::codec::{self, CodecLimits};
use efabus_transports::nats::{NatsSession, ServerInfo, MAX_CONNECT_LINE};
use libfuzzer_sys::fuzz_target;

const MAX_PAYLOAD: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, rest)) = data.split_first() else {
        return;
    };
    let info = ServerInfo {
        max_payload: MAX_PAYLOAD,
        auth_required: cut & 0x80 != 0,
        ..ServerInfo::default()
    };
    let mut session = NatsSession::new(info);
    let limits = CodecLimits {
        max_frame: usize::MAX,
        max_subject_len: u16::MAX as usize,
    };
    let step = usize::from(cut & 0x7f) + 1;
    let mut input = BytesMut::new();
    let (mut frames, mut out) = (Vec::new(), BytesMut::new());
    for piece in rest.chunks(step) {
        input.extend_from_slice(piece);
        let result = session.receive(&mut input, &mut frames, &mut out);
        for frame in frames.drain(..) {
            assert!(
                codec::decode(frame, &limits).is_ok(),
                "a frame that does not decode"
            );
        }
        // A line waits for its end within the limit; a payload within its own.
        assert!(input.len() <= MAX_CONNECT_LINE + MAX_PAYLOAD + 2 + step);
        if result.is_err() {
            assert!(input.is_empty(), "nothing is kept after an error");
            break;
        }
    }
    let _ = session.deliver(&Bytes::copy_from_slice(rest), &mut out, &mut frames);
    // And as a run of frames, read in place: it ends within the bytes.
    if let Ok(end) = session.deliver_run(rest, &mut out, &mut frames) {
        assert!(end <= rest.len());
    }
});
