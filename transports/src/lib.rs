//! efabus-transports: the in-process, TCP and libfabric transports and the
//! scheme registry that selects them from endpoint strings.
//!
//! - [`mem`]: in-process endpoints addressed by name; one-buffer frames
//!   cross without a copy (a header and payload are joined once).
//! - [`tcp`]: non-blocking TCP over mio, framed by the 4-byte length prefix.
//! - [`nats`]: a listener speaking the NATS client protocol, so NATS
//!   clients in any language are sessions of the broker.
//! - [`fabric`]: libfabric endpoints (EFA RDM and DGRAM, and libfabric's
//!   socket providers for development), through a thin C shim.
//! - `fault` (feature `testing`): a seeded fault-injecting endpoint wrapper
//!   (`faulty+mem`, `faulty+tcp`, ... once registered), a testing aid for
//!   tests and chaos runs, absent from production builds.
//! - [`registry`]: endpoint strings (`tcp/127.0.0.1:7420`) and the map from
//!   scheme to transport.
//! - `conformance` (feature `conformance`): the one test suite every
//!   transport's endpoints must pass.

#[cfg(feature = "conformance")]
pub mod conformance;
pub mod fabric;
#[cfg(feature = "testing")]
pub mod fault;
pub mod mem;
pub mod nats;
pub mod registry;
pub mod tcp;
pub mod tls;

pub use registry::{EndpointSpec, Registry, RegistryError, SpecError};

/// The address a peer is counted under where bounds and turns are kept
/// per address: an IPv4 address (an IPv4-mapped IPv6 one as that), or the
/// /64 of an IPv6 one (a host commonly holds a whole /64, and one share
/// per address would let it take as many as it likes).
pub fn address_key(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip.to_canonical() {
        std::net::IpAddr::V6(v6) => {
            let mut octets = v6.octets();
            octets[8..].fill(0);
            std::net::IpAddr::from(octets)
        }
        v4 => v4,
    }
}

/// The 4-byte little-endian length prefix every frame starts with
/// ([`PREFIX_LEN`](efabus_core::codec::PREFIX_LEN), defined by the codec),
/// as the stream and in-process transports check it.
pub(crate) mod prefix {
    use efabus_core::codec::PREFIX_LEN as LEN;
    use efabus_core::transport::{OutFrame, SendError, TransportError};

    /// Check an outgoing frame before it is queued: within `max` bytes and
    /// carrying a prefix that matches its length. A frame whose prefix lies
    /// would desynchronise a stream for every frame after it, so it is
    /// refused here rather than discovered by the peer.
    pub fn check(frame: &OutFrame, max: usize) -> Result<(), SendError> {
        let len = frame.len();
        if len > max {
            return Err(SendError::TooLarge { len, max });
        }
        if len < LEN {
            return Err(SendError::Transport(TransportError::Other(format!(
                "frame of {len} bytes is shorter than its {LEN}-byte length prefix"
            ))));
        }
        let mut raw = [0u8; LEN];
        for (slot, byte) in raw
            .iter_mut()
            .zip(frame.head.iter().chain(frame.body.iter()))
        {
            *slot = *byte;
        }
        let declared = u32::from_le_bytes(raw) as usize;
        if declared != len - LEN {
            return Err(SendError::Transport(TransportError::Other(format!(
                "frame length prefix declares {declared} bytes but {} follow",
                len - LEN
            ))));
        }
        Ok(())
    }

    /// The length a received prefix declares for the whole frame, prefix
    /// included, or `None` when fewer than four bytes are at hand.
    pub fn declared_total(buf: &[u8]) -> Option<usize> {
        let raw: [u8; LEN] = buf.get(..LEN)?.try_into().ok()?;
        Some(u32::from_le_bytes(raw) as usize + LEN)
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use bytes::Bytes;

        fn framed(payload: &[u8]) -> Vec<u8> {
            let mut v = (payload.len() as u32).to_le_bytes().to_vec();
            v.extend_from_slice(payload);
            v
        }

        #[test]
        fn accepts_prefix_split_across_head_and_body() {
            let all = framed(b"hello");
            let frame = OutFrame {
                head: Bytes::copy_from_slice(&all[..2]),
                body: Bytes::copy_from_slice(&all[2..]),
            };
            assert!(check(&frame, 64).is_ok());
        }

        #[test]
        fn rejects_lying_short_and_large_frames() {
            let mut bad = framed(b"hello");
            bad[0] = 9;
            assert!(matches!(
                check(&OutFrame::whole(bad.into()), 64),
                Err(SendError::Transport(_))
            ));
            assert!(matches!(
                check(&OutFrame::whole(Bytes::from_static(b"ab")), 64),
                Err(SendError::Transport(_))
            ));
            assert!(matches!(
                check(&OutFrame::whole(framed(&[0; 61]).into()), 64),
                Err(SendError::TooLarge { len: 65, max: 64 })
            ));
            assert!(check(&OutFrame::whole(framed(&[0; 60]).into()), 64).is_ok());
        }

        #[test]
        fn declared_total_needs_four_bytes() {
            assert_eq!(declared_total(&[1, 0, 0]), None);
            assert_eq!(declared_total(&[1, 0, 0, 0, 7]), Some(5));
            assert_eq!(
                declared_total(&[0xff, 0xff, 0xff, 0xff]),
                Some(u32::MAX as usize + 4)
            );
        }
    }
}
