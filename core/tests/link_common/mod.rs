//! Helpers shared by the link tests: numbered test frames, link configs,
//! and driving a receiver until it has settled.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::budget::MemoryBudget;
use efabus_core::fragment::ReassemblyConfig;
use efabus_core::link::{LinkConfig, LinkError, LinkReceiver};
use efabus_core::transport::OutFrame;

/// Smallest test frame: prefix, kind, 8-byte id.
pub const MIN_FRAME: usize = 4 + 1 + 8;

/// A `Publish`-kind frame of `len` bytes (at least [`MIN_FRAME`]) carrying
/// `id` and a pattern derived from it, split into head and body at `split`
/// (clamped to the frame).
pub fn test_frame(id: u64, len: usize, split: usize) -> OutFrame {
    let len = len.max(MIN_FRAME);
    let mut bytes = Vec::with_capacity(len);
    bytes.extend_from_slice(&((len - 4) as u32).to_le_bytes());
    bytes.push(0x10);
    bytes.extend_from_slice(&id.to_le_bytes());
    let seed = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    bytes.extend((MIN_FRAME..len).map(|i| (seed >> (i % 57)) as u8 ^ i as u8));
    let mut head = Bytes::from(bytes);
    let body = head.split_off(split.min(len));
    OutFrame { head, body }
}

/// The id a test frame carries.
pub fn frame_id(frame: &[u8]) -> u64 {
    let mut id = [0u8; 8];
    id.copy_from_slice(&frame[5..13]);
    u64::from_le_bytes(id)
}

/// A link config with explicit values; on reliable links a gap may go
/// unfilled for `gap` too before the link fails.
pub fn config(
    frame_limit: usize,
    sequenced: bool,
    lossy: bool,
    window: usize,
    gap: Duration,
    reassembly_timeout: Duration,
) -> LinkConfig {
    LinkConfig {
        frame_limit,
        sequenced,
        lossy,
        gap_timeout: gap,
        reliable_gap_timeout: gap,
        reorder_window: window,
        skip_distance: window,
        reassembly: ReassemblyConfig {
            timeout: reassembly_timeout,
            ..ReassemblyConfig::default()
        },
        memory: MemoryBudget::unlimited(),
    }
}

/// Poll far past every timeout, then at each deadline, until nothing is
/// due, appending what is released to `out`. A reliable link whose gap
/// timed out has failed: its error ends the settling. Fails the test if
/// the receiver never settles.
pub fn settle(rx: &mut LinkReceiver, from: Instant, out: &mut Vec<Bytes>) -> Result<(), LinkError> {
    let mut now = from + Duration::from_secs(3600);
    rx.poll(now, out)?;
    for _ in 0..8 {
        match rx.next_deadline() {
            Some(deadline) => {
                now = now.max(deadline);
                rx.poll(now, out)?;
            }
            None => return Ok(()),
        }
    }
    panic!("receiver did not settle: deadline {:?}", rx.next_deadline());
}
