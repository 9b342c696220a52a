//! The stream splitter on arbitrary bytes in arbitrary chunks: it never
//! panics, hands out only whole frames (as their prefix declares), loses no
//! bytes, and once it fails it stays failed.

#![no_main]

use bytes::Bytes;
use efabus_core::codec::{self, CodecLimits, FrameReader};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, stream)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(chunk % 64) + 1;
    let limits = CodecLimits {
        max_frame: 4096,
        max_subject_len: 64,
    };
    let mut reader = FrameReader::new(limits);
    let mut taken = 0usize;
    let mut failed = false;
    for piece in stream.chunks(chunk) {
        reader.push(piece);
        loop {
            match reader.next_frame() {
                Ok(Some(frame)) => {
                    assert!(!failed, "a frame after an error");
                    let declared =
                        u32::from_le_bytes(frame[..4].try_into().expect("a prefix")) as usize;
                    assert_eq!(declared + 4, frame.len(), "not a whole frame");
                    assert!(frame.len() <= limits.max_frame);
                    taken += frame.len();
                    let _ = codec::decode(Bytes::clone(&frame), &limits);
                }
                Ok(None) => {
                    assert!(!failed, "recovered after an error");
                    break;
                }
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
    }
    if !failed {
        assert_eq!(taken + reader.buffered(), stream.len(), "bytes lost");
    }
});
