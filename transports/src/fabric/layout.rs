//! The byte layout of every buffer a fabric endpoint posts, and the small
//! endpoint header that names the sender.
//!
//! ```text
//! | provider prefix (msg_prefix_size) | ver | alen | sender address | efabus frame (u32 LE len + len bytes) |
//! ^ pointer passed to fi_send/fi_recv  ^ payload starts here
//! ```
//!
//! - With `FI_MSG_PREFIX` the provider owns the first `msg_prefix_size`
//!   bytes; the pointer posted is the start of the prefix and every length
//!   posted includes it. Received completions report lengths that include
//!   it too, and a completion no longer than the prefix is a provider packet
//!   without application data (fi_getinfo(3)), skipped.
//! - The endpoint header carries the sender's own `fi_getname` bytes. Not
//!   every provider reports a source address (`tcp;ofi_rxm` in 1.17 offers
//!   no FI_SOURCE), and an address in band also lets a receiver learn a peer
//!   it has not inserted yet, so every provider is handled the same way.
//! - A message carries one or more whole frames back to back (a sender
//!   packs the frames it is handed between two polls, up to the peer's
//!   frame limit); their own length prefixes must account for the rest of
//!   the message exactly.
//!
//! The limits count the prefix against the provider's `max_msg_size` and
//! `inject_size` even though fi_getinfo(3) says the prefix is not counted:
//! that costs at most one prefix of each limit and is right whichever way a
//! provider reads the rule.

use efabus_core::codec::PREFIX_LEN;
use efabus_core::transport::OutFrame;

/// Version of the endpoint header.
pub const HEADER_VERSION: u8 = 1;
/// Bytes of the endpoint header before the sender address.
pub const HEADER_FIXED: usize = 2;
/// Slots start on this boundary (a cache line), so prefixes and payloads
/// never share lines between slots.
pub const SLOT_ALIGN: usize = 64;

/// Sizes of one posted buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferLayout {
    /// Bytes reserved for the provider in front of the payload.
    pub prefix: usize,
    /// Bytes after the prefix: endpoint header plus frame.
    pub payload: usize,
}

/// What a received buffer holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Received<'a> {
    /// A provider packet with no application data (length <= prefix).
    ProviderOnly,
    /// Whole frames, back to back (checked), from the sender whose address
    /// is given; [`frames`] splits them.
    Frames { sender: &'a [u8], frames: &'a [u8] },
}

/// Why a received buffer was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("completion length {len} exceeds the {cap}-byte buffer")]
    Overrun { len: usize, cap: usize },
    #[error("message of {len} bytes is too short for the endpoint header")]
    Short { len: usize },
    #[error("unknown endpoint header version {0}")]
    Version(u8),
    #[error("sender address of {addr_len} bytes overruns a {len}-byte message")]
    Address { addr_len: usize, len: usize },
    #[error("frame length prefix says {declared} bytes but {actual} follow")]
    FrameLength { declared: usize, actual: usize },
    #[error("no frame follows the endpoint header")]
    NoFrame,
    #[error("sender address of {0} bytes does not fit the header")]
    AddressTooLong(usize),
}

impl BufferLayout {
    /// A layout with the provider's prefix and the payload bytes after it.
    pub fn new(prefix: usize, payload: usize) -> Self {
        BufferLayout { prefix, payload }
    }

    /// The payload a provider allows: `max_msg_size` less the prefix,
    /// capped by `cap` (efabus's buffer size for providers without a
    /// practical limit, such as RDM's 2^64-1).
    pub fn payload_for(max_msg_size: u64, prefix: usize, cap: usize) -> usize {
        let max = usize::try_from(max_msg_size).unwrap_or(usize::MAX);
        max.saturating_sub(prefix).min(cap)
    }

    /// Bytes from one slot's start to the next.
    pub fn slot_stride(&self) -> usize {
        (self.prefix + self.payload).div_ceil(SLOT_ALIGN) * SLOT_ALIGN
    }

    /// Bytes posted for a receive: the prefix and the whole payload.
    pub fn recv_len(&self) -> usize {
        self.prefix + self.payload
    }

    /// Endpoint header bytes for a sender address of `addr_len` bytes.
    pub fn header_len(addr_len: usize) -> usize {
        HEADER_FIXED + addr_len
    }

    /// Largest frame (length prefix included) a sender with an address of
    /// `addr_len` bytes can put in one message.
    pub fn max_frame(&self, addr_len: usize) -> usize {
        self.payload.saturating_sub(Self::header_len(addr_len))
    }

    /// Bytes posted to send `frame_len` bytes of frame.
    pub fn send_len(&self, addr_len: usize, frame_len: usize) -> usize {
        self.prefix + Self::header_len(addr_len) + frame_len
    }

    /// Whether a message of `posted_len` bytes (prefix, header and frames)
    /// may go with `fi_inject`: only when the provider allows inject at all
    /// and the whole posted length fits its `inject_size`.
    pub fn fits_inject(inject_size: usize, posted_len: usize) -> bool {
        inject_size > 0 && posted_len <= inject_size
    }

    /// Writes the header and frame after the prefix of `slot` and returns
    /// the length to post. The prefix bytes are left as they are: they
    /// belong to the provider. The caller has checked the frame against
    /// [`max_frame`](Self::max_frame); a slot too small is a bug, reported
    /// as an error rather than a panic.
    pub fn encode(
        &self,
        slot: &mut [u8],
        sender: &[u8],
        frame: &OutFrame,
    ) -> Result<usize, LayoutError> {
        let addr_len =
            u8::try_from(sender.len()).map_err(|_| LayoutError::AddressTooLong(sender.len()))?;
        let total = self.send_len(sender.len(), frame.len());
        if total > slot.len() || total > self.prefix + self.payload {
            return Err(LayoutError::Overrun {
                len: total,
                cap: slot.len().min(self.prefix + self.payload),
            });
        }
        let mut at = self.prefix;
        slot[at] = HEADER_VERSION;
        slot[at + 1] = addr_len;
        at += HEADER_FIXED;
        slot[at..at + sender.len()].copy_from_slice(sender);
        at += sender.len();
        slot[at..at + frame.head.len()].copy_from_slice(&frame.head);
        at += frame.head.len();
        slot[at..at + frame.body.len()].copy_from_slice(&frame.body);
        Ok(total)
    }

    /// Appends `frame` after the `used` bytes already encoded in `slot`
    /// (by [`encode`](Self::encode) and earlier appends) and returns the new
    /// length to post; `Overrun` when it does not fit.
    pub fn append(
        &self,
        slot: &mut [u8],
        used: usize,
        frame: &OutFrame,
    ) -> Result<usize, LayoutError> {
        let total = used + frame.len();
        let cap = slot.len().min(self.prefix + self.payload);
        if total > cap {
            return Err(LayoutError::Overrun { len: total, cap });
        }
        slot[used..used + frame.head.len()].copy_from_slice(&frame.head);
        slot[used + frame.head.len()..total].copy_from_slice(&frame.body);
        Ok(total)
    }

    /// Reads a received buffer whose completion reported `len` bytes
    /// (prefix included).
    pub fn decode<'a>(&self, slot: &'a [u8], len: usize) -> Result<Received<'a>, LayoutError> {
        let cap = slot.len().min(self.prefix + self.payload);
        if len > cap {
            return Err(LayoutError::Overrun { len, cap });
        }
        if len <= self.prefix {
            return Ok(Received::ProviderOnly);
        }
        let message = &slot[self.prefix..len];
        if message.len() < HEADER_FIXED {
            return Err(LayoutError::Short { len: message.len() });
        }
        if message[0] != HEADER_VERSION {
            return Err(LayoutError::Version(message[0]));
        }
        let addr_len = usize::from(message[1]);
        let rest = &message[HEADER_FIXED..];
        if addr_len > rest.len() {
            return Err(LayoutError::Address {
                addr_len,
                len: message.len(),
            });
        }
        let (sender, frames) = rest.split_at(addr_len);
        if frames.is_empty() {
            return Err(LayoutError::NoFrame);
        }
        let mut at = 0;
        while at < frames.len() {
            let frame = &frames[at..];
            if frame.len() < PREFIX_LEN {
                return Err(LayoutError::Short { len: message.len() });
            }
            let declared = frame_declared_len(frame).unwrap_or(usize::MAX);
            let actual = frame.len() - PREFIX_LEN;
            if declared > actual {
                return Err(LayoutError::FrameLength { declared, actual });
            }
            at += PREFIX_LEN + declared;
        }
        Ok(Received::Frames { sender, frames })
    }
}

/// The frames of a [`Received::Frames`] run, as ranges of it. The run was
/// checked by [`BufferLayout::decode`]; anything else ends the iteration.
pub fn frames(run: &[u8]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        let declared = frame_declared_len(run.get(at..)?)?;
        let end = at.checked_add(PREFIX_LEN)?.checked_add(declared)?;
        if end > run.len() {
            return None;
        }
        let range = at..end;
        at = end;
        Some(range)
    })
}

/// The length a frame's 4-byte little-endian prefix declares.
pub fn frame_declared_len(frame: &[u8]) -> Option<usize> {
    let bytes: [u8; PREFIX_LEN] = frame.get(..PREFIX_LEN)?.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(bytes)).ok()
}

/// Checks an outgoing frame's own length prefix against its length, so a
/// malformed frame fails at the sender instead of being dropped remotely.
pub fn check_frame(frame: &OutFrame) -> Result<(), LayoutError> {
    let len = frame.len();
    if len < PREFIX_LEN {
        return Err(LayoutError::Short { len });
    }
    let mut prefix = [0u8; PREFIX_LEN];
    let head = frame.head.len().min(PREFIX_LEN);
    prefix[..head].copy_from_slice(&frame.head[..head]);
    prefix[head..].copy_from_slice(&frame.body[..PREFIX_LEN - head]);
    let declared = u32::from_le_bytes(prefix) as usize;
    if declared != len - PREFIX_LEN {
        return Err(LayoutError::FrameLength {
            declared,
            actual: len - PREFIX_LEN,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    /// Values from the EFA fixture (`efa-fi_info-v.txt`).
    const EFA_RDM_PREFIX: usize = 176;
    const EFA_RDM_INJECT: usize = 4096;
    const EFA_DGRAM_PREFIX: usize = 40;
    const EFA_DGRAM_MAX_MSG: u64 = 8928;
    const EFA_ADDR_LEN: usize = 32;

    fn frame(payload: &[u8]) -> OutFrame {
        let mut head = (payload.len() as u32).to_le_bytes().to_vec();
        head.extend_from_slice(&payload[..payload.len() / 2]);
        OutFrame {
            head: head.into(),
            body: Bytes::copy_from_slice(&payload[payload.len() / 2..]),
        }
    }

    fn round_trip(layout: BufferLayout, sender: &[u8], payload: &[u8]) {
        let mut slot = vec![0xAAu8; layout.slot_stride()];
        let out = frame(payload);
        let len = layout.encode(&mut slot, sender, &out).unwrap();
        assert_eq!(len, layout.prefix + 2 + sender.len() + 4 + payload.len());
        // The provider's prefix is untouched.
        assert!(slot[..layout.prefix].iter().all(|&b| b == 0xAA));
        // The payload starts right after the prefix.
        assert_eq!(slot[layout.prefix], HEADER_VERSION);
        assert_eq!(usize::from(slot[layout.prefix + 1]), sender.len());
        match layout.decode(&slot, len).unwrap() {
            Received::Frames {
                sender: s,
                frames: f,
            } => {
                assert_eq!(s, sender);
                assert_eq!(f, &out.to_bytes()[..]);
                assert_eq!(frames(f).collect::<Vec<_>>(), vec![0..f.len()]);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn appended_frames_come_back_one_by_one() {
        let layout = BufferLayout::new(EFA_DGRAM_PREFIX, 100);
        let mut slot = vec![0u8; layout.slot_stride()];
        let sender = [5u8; 8];
        let mut len = layout.encode(&mut slot, &sender, &frame(b"first")).unwrap();
        len = layout.append(&mut slot, len, &frame(b"")).unwrap();
        len = layout.append(&mut slot, len, &frame(b"third one")).unwrap();
        // 40 prefix + 10 header + (9 + 4 + 13) frames = 76; 30 more do not fit.
        assert_eq!(len, 76);
        assert_eq!(
            layout.append(&mut slot, len, &frame(&[0u8; 61])),
            Err(LayoutError::Overrun { len: 141, cap: 140 })
        );
        let Received::Frames {
            sender: s,
            frames: run,
        } = layout.decode(&slot, len).unwrap()
        else {
            panic!("no frames")
        };
        assert_eq!(s, sender);
        let payloads: Vec<&[u8]> = frames(run).map(|r| &run[r][4..]).collect();
        assert_eq!(payloads, vec![&b"first"[..], &b""[..], &b"third one"[..]]);
        // A run whose last frame is cut short is refused as a whole.
        assert!(matches!(
            layout.decode(&slot, len - 1),
            Err(LayoutError::FrameLength { .. })
        ));
    }

    #[test]
    fn efa_rdm_layout_reserves_the_prefix() {
        let payload = BufferLayout::payload_for(u64::MAX, EFA_RDM_PREFIX, 65536);
        assert_eq!(payload, 65536);
        let layout = BufferLayout::new(EFA_RDM_PREFIX, payload);
        assert_eq!(layout.recv_len(), 176 + 65536);
        assert_eq!(layout.slot_stride() % SLOT_ALIGN, 0);
        assert!(layout.slot_stride() >= layout.recv_len());
        assert_eq!(layout.max_frame(EFA_ADDR_LEN), 65536 - 34);
        round_trip(layout, &[7u8; EFA_ADDR_LEN], b"hello over srd");
        let max = vec![0x5Au8; layout.max_frame(EFA_ADDR_LEN) - 4];
        round_trip(layout, &[7u8; EFA_ADDR_LEN], &max);
    }

    #[test]
    fn efa_dgram_layout_counts_the_prefix_against_max_msg_size() {
        let payload = BufferLayout::payload_for(EFA_DGRAM_MAX_MSG, EFA_DGRAM_PREFIX, 1 << 20);
        assert_eq!(payload, 8928 - 40);
        let layout = BufferLayout::new(EFA_DGRAM_PREFIX, payload);
        // The whole posted length never exceeds what the provider allows.
        assert_eq!(layout.recv_len(), 8928);
        let max_frame = layout.max_frame(EFA_ADDR_LEN);
        assert_eq!(max_frame, 8928 - 40 - 34);
        assert_eq!(layout.send_len(EFA_ADDR_LEN, max_frame), 8928);
        round_trip(layout, &[1u8; EFA_ADDR_LEN], &vec![3u8; max_frame - 4]);
    }

    #[test]
    fn inject_only_within_the_limit_prefix_included() {
        let layout = BufferLayout::new(EFA_RDM_PREFIX, 65536);
        let fits = EFA_RDM_INJECT - EFA_RDM_PREFIX - 2 - EFA_ADDR_LEN;
        let posted = |frame_len| layout.send_len(EFA_ADDR_LEN, frame_len);
        assert!(BufferLayout::fits_inject(EFA_RDM_INJECT, posted(fits)));
        assert!(!BufferLayout::fits_inject(EFA_RDM_INJECT, posted(fits + 1)));
        // EFA DGRAM has inject_size 0: never inject.
        let dgram = BufferLayout::new(EFA_DGRAM_PREFIX, 8888);
        assert!(!BufferLayout::fits_inject(
            0,
            dgram.send_len(EFA_ADDR_LEN, 4)
        ));
    }

    #[test]
    fn short_completions_are_provider_packets() {
        let layout = BufferLayout::new(EFA_DGRAM_PREFIX, 1024);
        let slot = vec![0u8; layout.slot_stride()];
        assert_eq!(layout.decode(&slot, 0).unwrap(), Received::ProviderOnly);
        assert_eq!(
            layout.decode(&slot, EFA_DGRAM_PREFIX).unwrap(),
            Received::ProviderOnly
        );
    }

    #[test]
    fn no_prefix_layout_starts_at_zero() {
        let layout = BufferLayout::new(0, 1472);
        round_trip(layout, &[9u8; 16], b"x");
        assert_eq!(layout.max_frame(16), 1472 - 18);
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        let layout = BufferLayout::new(8, 64);
        let mut slot = vec![0u8; layout.slot_stride()];
        // Longer than the buffer.
        assert!(matches!(
            layout.decode(&slot, 1000),
            Err(LayoutError::Overrun { .. })
        ));
        // One byte of payload.
        assert!(matches!(
            layout.decode(&slot, 9),
            Err(LayoutError::Short { .. })
        ));
        // Wrong version.
        slot[8] = 9;
        assert_eq!(layout.decode(&slot, 20), Err(LayoutError::Version(9)));
        // Address longer than the message.
        slot[8] = HEADER_VERSION;
        slot[9] = 200;
        assert!(matches!(
            layout.decode(&slot, 20),
            Err(LayoutError::Address { .. })
        ));
        // Frame length prefix disagrees with the message length.
        slot[9] = 2;
        slot[12..16].copy_from_slice(&100u32.to_le_bytes());
        assert_eq!(
            layout.decode(&slot, 20),
            Err(LayoutError::FrameLength {
                declared: 100,
                actual: 4
            })
        );
        // Every length over arbitrary contents decodes or errs, never panics.
        for (i, b) in slot.iter_mut().enumerate() {
            *b = (i * 37) as u8;
        }
        for len in 0..=layout.slot_stride() + 1 {
            let _ = layout.decode(&slot, len);
        }
    }

    #[test]
    fn encode_refuses_what_does_not_fit() {
        let layout = BufferLayout::new(16, 32);
        let mut slot = vec![0u8; layout.slot_stride()];
        let big = frame(&[0u8; 40]);
        assert!(matches!(
            layout.encode(&mut slot, &[0u8; 4], &big),
            Err(LayoutError::Overrun { .. })
        ));
        assert!(matches!(
            layout.encode(&mut slot, &[0u8; 300], &frame(b"")),
            Err(LayoutError::AddressTooLong(300))
        ));
    }

    #[test]
    fn frames_are_checked_against_their_length_prefix() {
        assert!(check_frame(&frame(b"abc")).is_ok());
        assert!(check_frame(&frame(b"")).is_ok());
        // Prefix split across head and body.
        let split = OutFrame {
            head: Bytes::from_static(&[2, 0]),
            body: Bytes::from_static(&[0, 0, 1, 2]),
        };
        assert!(check_frame(&split).is_ok());
        let wrong = OutFrame::whole(Bytes::from_static(&[5, 0, 0, 0, 1]));
        assert!(matches!(
            check_frame(&wrong),
            Err(LayoutError::FrameLength { .. })
        ));
        let short = OutFrame::whole(Bytes::from_static(&[1, 0]));
        assert!(matches!(
            check_frame(&short),
            Err(LayoutError::Short { .. })
        ));
    }
}
