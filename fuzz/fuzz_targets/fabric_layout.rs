//! The fabric message layout on arbitrary received bytes: decoding never
//! panics; what it accepts splits into whole frames that cover the run
//! exactly; and frames packed by `encode` and `append` come back unchanged.
//!
//! The first input byte picks the prefix size (a multiple of 8, as
//! libfabric's are); the rest is the received buffer, whose length is the
//! completion length.

#![no_main]

use bytes::Bytes;
use efabus_core::transport::OutFrame;
use efabus_transports::fabric::layout::{frame_declared_len, frames, BufferLayout, Received};
use libfuzzer_sys::fuzz_target;

fn frame(payload: &[u8]) -> OutFrame {
    OutFrame {
        head: Bytes::from((payload.len() as u32).to_le_bytes().to_vec()),
        body: Bytes::copy_from_slice(payload),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let prefix = usize::from(first % 4) * 8;
    let layout = BufferLayout::new(prefix, 4096);
    let mut slot = vec![0u8; layout.slot_stride()];
    let len = rest.len().min(slot.len());
    slot[..len].copy_from_slice(&rest[..len]);

    if let Ok(Received::Frames(message)) = layout.decode(&slot, rest.len()) {
        let run = message.frames;
        let mut covered = 0;
        for range in frames(run) {
            assert_eq!(range.start, covered, "frames leave a gap");
            let declared = frame_declared_len(&run[range.clone()]).expect("a whole prefix");
            assert_eq!(range.len(), 4 + declared);
            covered = range.end;
        }
        assert_eq!(covered, run.len(), "frames do not cover the run");
    }

    // Pack the input's chunks as frames and read them back.
    let chunks: Vec<&[u8]> = rest.chunks(usize::from(first / 4).max(1)).collect();
    let sender = [7u8; 16];
    let mut out = vec![0u8; layout.slot_stride()];
    let Some((head, tail)) = chunks.split_first() else {
        return;
    };
    let link = (9, 41);
    let Ok(mut used) = layout.encode(&mut out, &sender, link, &frame(head)) else {
        return;
    };
    let mut sent = vec![*head];
    for chunk in tail {
        match layout.append(&mut out, used, &frame(chunk)) {
            Ok(n) => {
                used = n;
                sent.push(chunk);
            }
            Err(_) => break,
        }
    }
    let Ok(Received::Frames(message)) = layout.decode(&out, used) else {
        panic!("a packed message did not decode");
    };
    assert_eq!(message.sender, sender);
    assert_eq!((message.link_id, message.counter), link);
    let run = message.frames;
    let got: Vec<&[u8]> = frames(run).map(|r| &run[r][4..]).collect();
    assert_eq!(got, sent);
});
