//! What names a fabric endpoint: its kind ([`EpKind`]) and scheme
//! ([`RDM_SCHEME`], [`DGRAM_SCHEME`]), and its address as text
//! ([`addr_to_hex`], [`addr_from_hex`]). The endpoint options are typed
//! ([`FabricOptions`], defined beside `EndpointConfig` in
//! `efabus_core::transport`, which carries them) and re-exported here.

use efabus_core::transport::BufferMemory;
pub use efabus_core::transport::{
    FabricOptionError, FabricOptions, OrderWanted, DEFAULT_RDM_MSG_SIZE, MAX_MSG_SIZE,
};

/// The scheme of the reliable-datagram endpoints ([`EpKind::Rdm`]).
pub const RDM_SCHEME: &str = "efa-rdm";
/// The scheme of the unreliable-datagram endpoints ([`EpKind::Dgram`]).
pub const DGRAM_SCHEME: &str = "efa-dgram";
/// The scheme of the same-host reliable-datagram endpoints, on libfabric's
/// `shm` provider.
pub const SHM_SCHEME: &str = "shm";
/// libfabric's shared-memory provider.
pub const SHM_PROVIDER: &str = "shm";

/// Which kind of fabric endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EpKind {
    /// `FI_EP_RDM`: reliable datagrams (EFA SRD).
    Rdm,
    /// `FI_EP_DGRAM`: unreliable datagrams (EFA UD).
    Dgram,
}

impl EpKind {
    /// The endpoint-string scheme.
    pub fn scheme(self) -> &'static str {
        match self {
            EpKind::Rdm => RDM_SCHEME,
            EpKind::Dgram => DGRAM_SCHEME,
        }
    }

    /// libfabric's name for the endpoint type.
    pub fn fi_name(self) -> &'static str {
        match self {
            EpKind::Rdm => "FI_EP_RDM",
            EpKind::Dgram => "FI_EP_DGRAM",
        }
    }

    /// libfabric's value for the endpoint type.
    pub fn fi_value(self) -> u64 {
        match self {
            EpKind::Rdm => super::consts::FI_EP_RDM,
            EpKind::Dgram => super::consts::FI_EP_DGRAM,
        }
    }
}

/// Eager buffers' worth of memory in one multi-receive buffer: a buffer
/// takes at least `MULTI_RECV_SLOTS - 1` messages of the largest size, and
/// many more small ones, before the provider releases it; the receive
/// memory of `rx_depth` eager buffers makes `rx_depth / MULTI_RECV_SLOTS`
/// of them (at least two, so one is posted while the other is taken
/// back).
pub const MULTI_RECV_SLOTS: usize = 8;

/// Whether `provider` lets go of a multi-receive buffer only once every
/// message that landed in it is complete, so that it may be posted again
/// at once: efa does (it tracks each buffer's messages). libfabric 1.17's
/// `ofi_rxm` does not: it reports the buffer released with the message
/// that filled it while one matched before it may still be arriving (its
/// segmented and rendezvous messages, and over `tcp` a message read
/// straight into the buffer), so that message would land in a buffer
/// posted again; seen here as a completion for a buffer already given
/// back, with 64 KiB eager buffers. The other providers here are not
/// relied on either.
pub fn releases_whole_buffers(provider: &str) -> bool {
    provider == "efa"
}

/// Whether an endpoint of `kind` with `options` asks for FI_MULTI_RECV,
/// and posts multi-receive buffers where it is granted.
pub fn wants_multi_recv(kind: EpKind, options: &FabricOptions) -> bool {
    kind == EpKind::Rdm
        && options.multi_recv
        && (options.force_multi_recv || releases_whole_buffers(&options.provider))
}

/// An endpoint's queue depth: `wanted`, within the provider's `size`
/// for that queue (0 or unknown: no limit given).
pub fn queue_depth(wanted: usize, size: u64) -> usize {
    match usize::try_from(size) {
        Ok(0) | Err(_) => wanted,
        Ok(size) => wanted.min(size),
    }
}

/// What an endpoint's buffer pools take, with `depths` (receives, sends)
/// eager buffers of `stride` bytes: receives as multi-receive buffers of
/// [`MULTI_RECV_SLOTS`] eager buffers each (at least two) where
/// `multi_recv`, all of it registered where the provider needs local
/// registrations (`mr_local`). The endpoint and `efabus caps` decide
/// through this one function.
pub fn buffer_memory(
    stride: usize,
    (rx_depth, tx_depth): (usize, usize),
    multi_recv: bool,
    mr_local: bool,
) -> BufferMemory {
    let (rx_slots, rx_stride) = if multi_recv {
        (
            rx_depth.div_ceil(MULTI_RECV_SLOTS).max(2),
            stride.saturating_mul(MULTI_RECV_SLOTS),
        )
    } else {
        (rx_depth, stride)
    };
    // Saturating: `efabus caps` sizes what any dump says.
    let held = rx_slots
        .saturating_mul(rx_stride)
        .saturating_add(tx_depth.saturating_mul(stride));
    BufferMemory {
        held,
        registered: if mr_local { held } else { 0 },
        multi_recv: multi_recv.then_some((rx_slots, rx_stride)),
    }
}

/// Capability bits rendezvous needs (`FI_RMA | FI_READ | FI_REMOTE_READ`):
/// reads issued and served.
pub const RMA_READ_CAPS: u64 = (1 << 2) | (1 << 8) | (1 << 12);

/// Bytes of each posted buffer of an endpoint of `kind` on `provider`
/// (before the provider's own `max_msg_size` caps it): the eager size
/// `options` give, else on RDM [`DEFAULT_RDM_MSG_SIZE`] (over `tcp;ofi_rxm`
/// within the provider's own eager limit, see [`provider_eager_limit`]),
/// on DGRAM [`MAX_MSG_SIZE`]. The endpoint and `efabus caps` decide through
/// this one function.
///
/// [`provider_eager_limit`]: super::provider_eager_limit
pub fn buffer_size(kind: EpKind, provider: &str, options: &FabricOptions) -> usize {
    options.msg_size.unwrap_or_else(|| match kind {
        // Capped over `tcp` only, where it was measured; over other
        // `ofi_rxm` cores a larger message takes the provider's
        // segmentation instead, whose cost is unknown here.
        EpKind::Rdm if super::provider_env::rxm_over_tcp(provider) => {
            let cap = super::provider_env::provider_eager_limit(provider);
            DEFAULT_RDM_MSG_SIZE.min(cap.unwrap_or(usize::MAX))
        }
        EpKind::Rdm => DEFAULT_RDM_MSG_SIZE,
        EpKind::Dgram => MAX_MSG_SIZE,
    })
}

/// Receive buffers an endpoint of `kind` on `provider` keeps posted, each of
/// `buffer` bytes, before the provider's own rx size caps it:
/// `options.rx_depth`, except on `udp` datagram endpoints. There a datagram
/// waits in the kernel's socket until a poll reads it into a posted buffer,
/// and the socket holds far fewer than 256 (`net.core.rmem_default`, 208
/// KiB here): a peer sending the credit window of posted buffers lost a
/// third of its 1,472-byte datagrams on the way (counted as lost), and
/// each loss held its credits until the gap was given up. So the posted
/// receives, and with them the window a peer is given, are capped at what
/// the socket holds ([`udp_socket_datagrams`]). EFA receives datagrams
/// straight into the posted buffers. The endpoint and `efabus caps` decide
/// through this one function (`caps` reads this host's socket size, also
/// for a dump taken on another).
pub fn receive_depth(
    kind: EpKind,
    provider: &str,
    options: &FabricOptions,
    buffer: usize,
) -> usize {
    match kind {
        EpKind::Dgram if provider == "udp" => options.rx_depth.min(udp_socket_datagrams(
            buffer,
            std::fs::read_to_string("/proc/sys/net/core/rmem_default").ok(),
        )),
        _ => options.rx_depth,
    }
}

/// Datagrams of `buffer` bytes a UDP socket holds, given the kernel's
/// default receive buffer (`rmem_default`, as read; 212,992 bytes, Linux's
/// own default, where it cannot be read). The kernel charges a datagram
/// its buffer's true size, more than the datagram: here 64 datagrams of
/// 1,472 bytes at full rate lost none and 80 lost a few, so each is
/// counted at twice its size and 512 bytes more (61 of them). At least 8.
pub fn udp_socket_datagrams(buffer: usize, rmem_default: Option<String>) -> usize {
    const LINUX_RMEM_DEFAULT: usize = 212_992;
    let socket = rmem_default
        .and_then(|text| text.trim().parse::<usize>().ok())
        .unwrap_or(LINUX_RMEM_DEFAULT);
    let charged = buffer.saturating_mul(2).saturating_add(512);
    (socket / charged).max(8)
}

/// Largest frame an endpoint of `kind` on `provider` moves by rendezvous,
/// given the caps its info grants, whether `options` enable it, the
/// provider's `max_msg_size` and the caller's `max_frame`; 0 when it has
/// no rendezvous, or when no frame above `eager_max` would use it. The
/// endpoint and `efabus caps` decide through this one function.
///
/// `ofi_rxd` grants FI_RMA, but with libfabric 1.17 its reads stalled for
/// good under a few concurrent links here (transfers never completed on
/// either side), so its large frames are fragmented over eager messages.
pub fn rendezvous_max(
    kind: EpKind,
    provider: &str,
    caps: u64,
    options: &FabricOptions,
    (max_msg_size, max_frame, eager_max): (u64, usize, usize),
) -> usize {
    let usable = asks_rendezvous(kind, provider, options) && caps & RMA_READ_CAPS == RMA_READ_CAPS;
    let largest = max_frame.min(usize::try_from(max_msg_size).unwrap_or(usize::MAX));
    if usable && largest > eager_max {
        largest
    } else {
        0
    }
}

/// Whether an endpoint of `kind` on `provider` asks for RMA reads (see
/// [`rendezvous_max`]): RDM with rendezvous enabled, not `ofi_rxd`.
pub fn asks_rendezvous(kind: EpKind, provider: &str, options: &FabricOptions) -> bool {
    kind == EpKind::Rdm
        && options.rendezvous
        && !provider.split(';').any(|layer| layer == "ofi_rxd")
}

/// Lower-case hex of address bytes, as `connect` accepts them.
pub fn addr_to_hex(addr: &[u8]) -> String {
    let mut text = String::with_capacity(addr.len() * 2);
    for byte in addr {
        text.push_str(&format!("{byte:02x}"));
    }
    text
}

/// Parses hex (optionally `0x`-prefixed) into address bytes.
pub fn addr_from_hex(text: &str) -> Option<Vec<u8>> {
    let text = text.trim();
    let text = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    if text.is_empty() || text.len() % 2 != 0 {
        return None;
    }
    let digits = text.as_bytes();
    let mut out = Vec::with_capacity(digits.len() / 2);
    for pair in digits.chunks(2) {
        let hi = (pair[0] as char).to_digit(16)?;
        let lo = (pair[1] as char).to_digit(16)?;
        out.push((hi * 16 + lo) as u8);
    }
    Some(out)
}

const THP: &str = "/sys/kernel/mm/transparent_hugepage";

/// The size of a transparent huge page here (2 MiB on x86-64, and on
/// arm64 with 4 KiB pages), or `None` where the kernel gives none to
/// memory that asks (`never` in `enabled`, or no such setting): where a
/// broker's large `shm` frames can land in huge pages
/// ([`FabricOptions::huge_landing`]).
pub fn huge_page_size() -> Option<usize> {
    static SIZE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *SIZE.get_or_init(|| {
        let enabled = std::fs::read_to_string(format!("{THP}/enabled")).ok()?;
        if enabled.contains("[never]") {
            return None;
        }
        std::fs::read_to_string(format!("{THP}/hpage_pmd_size"))
            .ok()?
            .trim()
            .parse()
            .ok()
            .filter(|size: &usize| size.is_power_of_two())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_huge_page_size_is_the_kernel_s_where_it_gives_them() {
        let dir = "/sys/kernel/mm/transparent_hugepage";
        let enabled = std::fs::read_to_string(format!("{dir}/enabled")).unwrap_or_default();
        let size = std::fs::read_to_string(format!("{dir}/hpage_pmd_size"))
            .ok()
            .and_then(|text| text.trim().parse::<usize>().ok());
        if enabled.contains("[always]") || enabled.contains("[madvise]") {
            assert_eq!(huge_page_size(), size, "{enabled:?}");
            assert!(size.is_some_and(|size| size >= 1 << 20), "{size:?}");
        } else {
            assert_eq!(huge_page_size(), None, "{enabled:?}");
        }
    }

    #[test]
    fn a_udp_endpoint_posts_what_its_socket_holds() {
        assert_eq!(udp_socket_datagrams(1472, Some("212992\n".into())), 61);
        assert_eq!(udp_socket_datagrams(1472, None), 61, "Linux's default");
        assert_eq!(udp_socket_datagrams(1472, Some("junk".into())), 61);
        assert_eq!(udp_socket_datagrams(1472, Some("4194304".into())), 1213);
        assert_eq!(udp_socket_datagrams(65_000, Some("212992".into())), 8);
        let options = FabricOptions::default();
        let udp = receive_depth(EpKind::Dgram, "udp", &options, 1472);
        assert!((8..=options.rx_depth).contains(&udp), "{udp}");
        for (kind, provider) in [(EpKind::Dgram, "efa"), (EpKind::Rdm, "udp;ofi_rxd")] {
            assert_eq!(
                receive_depth(kind, provider, &options, 1472),
                options.rx_depth
            );
        }
    }

    #[test]
    fn hex_round_trips_and_rejects_junk() {
        let addr = [0u8, 1, 0xab, 0xff, 0x10];
        let hex = addr_to_hex(&addr);
        assert_eq!(hex, "0001abff10");
        assert_eq!(addr_from_hex(&hex).unwrap(), addr);
        assert_eq!(addr_from_hex("0x0A0b").unwrap(), vec![10, 11]);
        assert_eq!(addr_from_hex("abc"), None);
        assert_eq!(addr_from_hex(""), None);
        assert_eq!(addr_from_hex("zz"), None);
        assert_eq!(addr_from_hex("é1"), None);
    }
}
