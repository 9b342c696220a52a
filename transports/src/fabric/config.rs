//! Fabric endpoint options, parsed once from `EndpointConfig` strings.
//!
//! | option | meaning | default |
//! |---|---|---|
//! | `provider` | libfabric provider name (`efa`, `tcp;ofi_rxm`, `udp;ofi_rxd`, `sockets`, `udp`) | `efa` |
//! | `domain` (alias `iface`) | domain name, e.g. `rdmap0s6-rdm` or `lo` | any |
//! | `fabric` | fabric name | any |
//! | `node` | source address or host name (the endpoint string's bind part also sets it) | none |
//! | `service` | source service (port) | none |
//! | `msg_size` | bytes per buffer after the provider prefix (RDM); DGRAM uses the provider limit when unset | 65536 |
//! | `rx_depth` | receives kept posted, capped by the provider's rx size | 256 |
//! | `tx_depth` | sends in flight, capped by the provider's tx size | 256 |
//! | `av_size` | address vector size hint | 1024 |
//! | `max_addresses` | most distinct peer addresses inserted (senders name themselves in band) | 65536 |
//! | `rnr_retry` | `FI_OPT_EFA_RNR_RETRY` for efa RDM (0-7, 7 = retry without limit) | 7 |
//! | `order` | `prefer` (ask for FI_ORDER_SAS, accept without), `require`, `none` | `prefer` |
//! | `wait_fd` | open a wait set where the provider offers one, so the owner may sleep on its descriptor | true |
//! | `force_prefix` | test only: reserve this many prefix bytes as if the provider asked (multiple of 8) | 0 |
//! | `force_mr_local` | test only: register the pools and pass descriptors as if FI_MR_LOCAL were required | false |

use super::FabricError;

/// The scheme of the reliable-datagram endpoints ([`EpKind::Rdm`]).
pub const RDM_SCHEME: &str = "efa-rdm";
/// The scheme of the unreliable-datagram endpoints ([`EpKind::Dgram`]).
pub const DGRAM_SCHEME: &str = "efa-dgram";

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

/// How much efabus wants send-after-send ordering from the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderWanted {
    /// Ask for FI_ORDER_SAS; if no provider grants it, open without and let
    /// the session layer sequence and reorder.
    Prefer,
    /// Fail unless FI_ORDER_SAS is granted.
    Require,
    /// Do not ask.
    None,
}

/// Parsed fabric options (see the module docs for each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricOptions {
    pub provider: String,
    pub domain: Option<String>,
    pub fabric: Option<String>,
    pub node: Option<String>,
    pub service: Option<String>,
    pub msg_size: Option<usize>,
    pub rx_depth: usize,
    pub tx_depth: usize,
    pub av_size: usize,
    /// Most distinct peer addresses the endpoint inserts; messages from
    /// further new senders are dropped and counted.
    pub max_addresses: usize,
    pub rnr_retry: u64,
    pub order: OrderWanted,
    pub force_prefix: usize,
    pub force_mr_local: bool,
    /// Ask the provider for a wait set so an idle owner can sleep on a
    /// descriptor (`Readiness::PollOrWait`); providers without one are
    /// polled as before.
    pub wait_fd: bool,
}

/// Default bytes per RDM buffer: frames above it are fragmented by the
/// session layer, which keeps registered memory per endpoint bounded.
pub const DEFAULT_RDM_MSG_SIZE: usize = 64 * 1024;
/// Largest `msg_size` accepted, to bound registered memory per buffer.
pub const MAX_MSG_SIZE: usize = 16 << 20;
const DEFAULT_DEPTH: usize = 256;
const MAX_DEPTH: usize = 1 << 16;

impl Default for FabricOptions {
    fn default() -> Self {
        FabricOptions {
            provider: "efa".to_string(),
            domain: None,
            fabric: None,
            node: None,
            service: None,
            msg_size: None,
            rx_depth: DEFAULT_DEPTH,
            tx_depth: DEFAULT_DEPTH,
            av_size: 1024,
            max_addresses: 1 << 16,
            rnr_retry: 7,
            order: OrderWanted::Prefer,
            force_prefix: 0,
            force_mr_local: false,
            wait_fd: true,
        }
    }
}

impl FabricOptions {
    /// Parses options in order (later ones win), with `bind` (the part of
    /// the endpoint string after the scheme) as the node when no `node`
    /// option names one. Unknown keys are errors.
    pub fn parse<'a>(
        options: impl IntoIterator<Item = (&'a str, &'a str)>,
        bind: Option<&str>,
    ) -> Result<Self, FabricError> {
        let mut parsed = FabricOptions::default();
        let mut node_set = false;
        for (key, value) in options {
            let bad = |reason: &str| FabricError::Option {
                key: key.to_string(),
                value: value.to_string(),
                reason: reason.to_string(),
            };
            let text = || -> Result<Option<String>, FabricError> {
                let v = value.trim();
                if v.is_empty() {
                    Ok(None)
                } else if v.contains('\0') {
                    Err(bad("contains a NUL byte"))
                } else {
                    Ok(Some(v.to_string()))
                }
            };
            let number = |min: usize, max: usize| -> Result<usize, FabricError> {
                let n: usize = value
                    .trim()
                    .parse()
                    .map_err(|_| bad("not a non-negative integer"))?;
                if n < min || n > max {
                    return Err(bad(&format!("must be between {min} and {max}")));
                }
                Ok(n)
            };
            let flag = || match value.trim() {
                "true" | "1" | "yes" => Ok(true),
                "false" | "0" | "no" => Ok(false),
                _ => Err(bad("expected true or false")),
            };
            match key {
                "provider" => {
                    parsed.provider = text()?.ok_or_else(|| bad("must not be empty"))?;
                }
                "domain" | "iface" => parsed.domain = text()?,
                "fabric" => parsed.fabric = text()?,
                "node" => {
                    parsed.node = text()?;
                    node_set = true;
                }
                "service" => parsed.service = text()?,
                "msg_size" => parsed.msg_size = Some(number(64, MAX_MSG_SIZE)?),
                "rx_depth" => parsed.rx_depth = number(1, MAX_DEPTH)?,
                "tx_depth" => parsed.tx_depth = number(1, MAX_DEPTH)?,
                "av_size" => parsed.av_size = number(1, 1 << 24)?,
                "max_addresses" => parsed.max_addresses = number(1, 1 << 24)?,
                "rnr_retry" => parsed.rnr_retry = number(0, 7)? as u64,
                "order" => {
                    parsed.order = match value.trim() {
                        "prefer" => OrderWanted::Prefer,
                        "require" => OrderWanted::Require,
                        "none" => OrderWanted::None,
                        _ => return Err(bad("expected prefer, require or none")),
                    }
                }
                "force_prefix" => {
                    let n = number(0, 4096)?;
                    if n % 8 != 0 {
                        return Err(bad("must be a multiple of 8, as libfabric's prefixes are"));
                    }
                    parsed.force_prefix = n;
                }
                "force_mr_local" => parsed.force_mr_local = flag()?,
                "wait_fd" => parsed.wait_fd = flag()?,
                _ => {
                    return Err(bad(
                        "unknown fabric option (known: provider, domain, iface, fabric, node, \
                         service, msg_size, rx_depth, tx_depth, av_size, max_addresses, rnr_retry, order, \
                         force_prefix, force_mr_local, wait_fd)",
                    ))
                }
            }
        }
        if !node_set {
            if let Some(bind) = bind {
                let (node, service) = split_bind(bind);
                parsed.node = node;
                if parsed.service.is_none() {
                    parsed.service = service;
                }
            }
        }
        Ok(parsed)
    }

    /// Whether this is the EFA provider (which has its own rules and options).
    pub fn is_efa(&self) -> bool {
        self.provider == "efa" || self.provider.starts_with("efa;")
    }
}

/// Splits `host`, `host:port` or `[v6]:port` into node and service.
fn split_bind(bind: &str) -> (Option<String>, Option<String>) {
    let bind = bind.trim();
    if bind.is_empty() {
        return (None, None);
    }
    if let Some(rest) = bind.strip_prefix('[') {
        if let Some((host, tail)) = rest.split_once(']') {
            let service = tail.strip_prefix(':').filter(|s| !s.is_empty());
            return (Some(host.to_string()), service.map(str::to_string));
        }
    }
    match bind.rsplit_once(':') {
        // One colon: host:port. More: a bare IPv6 address.
        Some((host, port)) if !host.contains(':') && !port.is_empty() => {
            (Some(host.to_string()), Some(port.to_string()))
        }
        _ => (Some(bind.to_string()), None),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_efa_with_sas_preferred() {
        let o = FabricOptions::parse([], None).unwrap();
        assert_eq!(o.provider, "efa");
        assert!(o.is_efa());
        assert_eq!(o.order, OrderWanted::Prefer);
        assert_eq!(o.rnr_retry, 7);
        assert_eq!((o.force_prefix, o.force_mr_local), (0, false));
    }

    #[test]
    fn options_parse_and_later_ones_win() {
        let o = FabricOptions::parse(
            [
                ("provider", "udp"),
                ("provider", "tcp;ofi_rxm"),
                ("iface", "lo"),
                ("rx_depth", "64"),
                ("msg_size", "4096"),
                ("force_prefix", "64"),
                ("force_mr_local", "true"),
                ("order", "none"),
            ],
            None,
        )
        .unwrap();
        assert_eq!(o.provider, "tcp;ofi_rxm");
        assert!(!o.is_efa());
        assert_eq!(o.domain.as_deref(), Some("lo"));
        assert_eq!(o.rx_depth, 64);
        assert_eq!(o.msg_size, Some(4096));
        assert_eq!(o.force_prefix, 64);
        assert!(o.force_mr_local);
        assert_eq!(o.order, OrderWanted::None);
    }

    #[test]
    fn bad_values_name_the_key() {
        for (key, value) in [
            ("rx_depth", "0"),
            ("rx_depth", "many"),
            ("force_prefix", "12"),
            ("rnr_retry", "8"),
            ("order", "sometimes"),
            ("force_mr_local", "maybe"),
            ("provider", ""),
            ("colour", "blue"),
        ] {
            let err = FabricOptions::parse([(key, value)], None).unwrap_err();
            assert!(err.to_string().contains(key), "{err}");
        }
    }

    #[test]
    fn bind_sets_node_and_service_unless_node_is_given() {
        let o = FabricOptions::parse([], Some("127.0.0.1")).unwrap();
        assert_eq!(o.node.as_deref(), Some("127.0.0.1"));
        assert_eq!(o.service, None);
        let o = FabricOptions::parse([], Some("127.0.0.1:7000")).unwrap();
        assert_eq!(o.service.as_deref(), Some("7000"));
        let o = FabricOptions::parse([], Some("[::1]:7000")).unwrap();
        assert_eq!(o.node.as_deref(), Some("::1"));
        assert_eq!(o.service.as_deref(), Some("7000"));
        let o = FabricOptions::parse([], Some("fe80::1")).unwrap();
        assert_eq!(o.node.as_deref(), Some("fe80::1"));
        let o = FabricOptions::parse([("node", "10.0.0.1")], Some("127.0.0.1")).unwrap();
        assert_eq!(o.node.as_deref(), Some("10.0.0.1"));
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
