//! The options of the libfabric endpoints (`efa-rdm`, `efa-dgram`), as
//! typed values: [`FabricOptions`] travels in
//! [`EndpointConfig::fabric`](super::EndpointConfig::fabric) from whoever
//! opens an endpoint (the broker builds it from its `[fabric]` table) to
//! the fabric transport, which reads the fields. This module owns the
//! options, their defaults and bounds ([`FabricOptions::check`]), and their
//! textual form, for printing ([`FabricOptions::describe`], `Display`) and
//! for tools that take them as `key=value` text ([`FabricOptions::parse`]):
//!
//! | option | meaning | default |
//! |---|---|---|
//! | `provider` | libfabric provider name (`efa`, `tcp;ofi_rxm`, `udp;ofi_rxd`, `sockets`, `udp`) | `efa` |
//! | `domain` (alias `iface`) | domain name, e.g. `rdmap0s6-rdm` or `lo` | any |
//! | `fabric` | fabric name | any |
//! | `node` | source address or host name (the endpoint string's bind part also sets it) | none |
//! | `service` | source service (port) | none |
//! | `msg_size` | bytes per buffer after the provider prefix (RDM: the eager size; larger frames go by rendezvous or are fragmented); DGRAM uses the provider limit when unset | 32512 |
//! | `rendezvous` | RDM: move frames above the eager size by one-sided reads where the provider grants FI_RMA | true |
//! | `rx_depth` | receives kept posted, capped by the provider's rx size | 256 |
//! | `multi_recv` | RDM: post the receive memory as a few `FI_MULTI_RECV` buffers that many messages fill in turn, where the provider grants it and lets go of a buffer only once every message in it has landed (efa) | true |
//! | `tx_depth` | sends in flight, capped by the provider's tx size | 256 |
//! | `av_size` | address vector size hint | 1024 |
//! | `max_addresses` | most distinct peer addresses kept in the address vector (least recently used ones without a live peer are removed) | 65536 |
//! | `rnr_retry` | `FI_OPT_EFA_RNR_RETRY` for efa RDM (0-6: 7, retry without limit, is refused, as a send to a receiver that posts nothing must fail and free its slot) | 6 |
//! | `order` | `prefer` (ask for FI_ORDER_SAS, accept without), `require`, `none` | `prefer` |
//! | `wait_fd` | open a wait set where the provider offers one, so the owner may sleep on its descriptor | true |
//! | `huge_landing` | RDM over `shm`: land rendezvous frames of 1 MiB and more in transparent huge pages, which a peer's read of them (a `process_vm_readv` that pins their pages) takes about twice as fast; each such frame holds whole 2 MiB pages while it lives. For endpoints that pass on what they receive (a broker's) | false (a broker's: true) |
//! | `force_prefix` | test only: reserve this many prefix bytes as if the provider asked (multiple of 8) | 0 |
//! | `force_mr_local` | test only: register the pools and pass descriptors as if FI_MR_LOCAL were required | false |
//! | `force_multi_recv` | test only: post multi-receive buffers on any provider that grants `FI_MULTI_RECV` (see `multi_recv`) | false |

use std::fmt;

use thiserror::Error;

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

impl OrderWanted {
    /// The option value naming it (`prefer`, `require`, `none`).
    pub fn name(self) -> &'static str {
        match self {
            OrderWanted::Prefer => "prefer",
            OrderWanted::Require => "require",
            OrderWanted::None => "none",
        }
    }
}

/// Options of one fabric endpoint (see the module docs for each). Build it
/// with struct update syntax over [`FabricOptions::default`]; the fabric
/// transport checks it ([`FabricOptions::check`]) when it opens an
/// endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricOptions {
    /// libfabric provider name.
    pub provider: String,
    /// Domain name; `None` takes the provider's first.
    pub domain: Option<String>,
    /// Fabric name; `None` takes any.
    pub fabric: Option<String>,
    /// Source address or host name; `None` takes the endpoint's bind
    /// address, if it has one (see [`FabricOptions::bound_at`]).
    pub node: Option<String>,
    /// Source service (port).
    pub service: Option<String>,
    /// Bytes per buffer after the provider prefix; `None` is
    /// [`DEFAULT_RDM_MSG_SIZE`] on RDM (over `tcp;ofi_rxm` at most that
    /// provider's eager limit) and the provider's limit on DGRAM.
    pub msg_size: Option<usize>,
    /// Receives kept posted, capped by the provider's rx size.
    pub rx_depth: usize,
    /// RDM: post the receive memory (`rx_depth` buffers' worth) as a few
    /// large `FI_MULTI_RECV` buffers, so a message takes only the bytes it
    /// needs, where the provider grants it and lets go of a buffer only
    /// once every message in it has landed (efa; libfabric 1.17's
    /// `ofi_rxm` may report a buffer released while a message matched
    /// earlier is still being written into it).
    pub multi_recv: bool,
    /// Sends in flight, capped by the provider's tx size.
    pub tx_depth: usize,
    /// Address vector size hint.
    pub av_size: usize,
    /// Most distinct peer addresses the endpoint keeps in its address
    /// vector; when full, the least recently used one no live peer needs
    /// is removed.
    pub max_addresses: usize,
    /// `FI_OPT_EFA_RNR_RETRY` for efa RDM endpoints (0-7).
    pub rnr_retry: u64,
    /// Whether to ask for FI_ORDER_SAS.
    pub order: OrderWanted,
    /// RDM: ask for FI_RMA and move frames above the eager size by
    /// rendezvous (a descriptor sent eagerly, a one-sided read by the
    /// receiver) with peers that offer it too.
    pub rendezvous: bool,
    /// Testing aid: prefix bytes reserved as if the provider asked for them
    /// (a multiple of 8; 0 leaves it to the provider).
    pub force_prefix: usize,
    /// Testing aid: register the pools and pass descriptors as if the
    /// provider required FI_MR_LOCAL.
    pub force_mr_local: bool,
    /// Testing aid: post multi-receive buffers on any provider that grants
    /// `FI_MULTI_RECV` (with `multi_recv`), for tests whose messages land
    /// one at a time.
    pub force_multi_recv: bool,
    /// Ask the provider for a wait set so an idle owner can sleep on a
    /// descriptor (`Readiness::PollOrWait`); providers without one are
    /// polled as before.
    pub wait_fd: bool,
    /// RDM over `shm`: land rendezvous frames of 1 MiB and more in
    /// transparent huge pages, for endpoints whose frames peers read again
    /// (a broker forwarding them); see the module docs.
    pub huge_landing: bool,
}

/// Default bytes per RDM buffer (the eager size): 256 receive and 256 send
/// buffers of 32 KiB (256 bytes left for a provider prefix) make 16 MiB per
/// endpoint. Larger frames go by rendezvous, or are fragmented by the
/// session layer where a peer has no RMA.
pub const DEFAULT_RDM_MSG_SIZE: usize = (32 << 10) - 256;
/// Largest `msg_size` accepted, to bound registered memory per buffer.
pub const MAX_MSG_SIZE: usize = 16 << 20;
const MIN_MSG_SIZE: usize = 64;
const DEFAULT_DEPTH: usize = 256;
const MAX_DEPTH: usize = 1 << 16;
const MAX_AV_SIZE: usize = 1 << 24;
/// 7 means "retry without limit" to efa: a send to a receiver that posts
/// nothing would then hold its slot for good, so it is refused.
const MAX_RNR_RETRY: u64 = 6;
const MAX_FORCE_PREFIX: usize = 4096;

/// The option names [`FabricOptions::parse`] reads (besides `iface`, an
/// alias of `domain`), in the order [`FabricOptions::describe`] lists them.
pub const FABRIC_OPTION_KEYS: [&str; 19] = [
    "provider",
    "domain",
    "fabric",
    "node",
    "service",
    "msg_size",
    "rendezvous",
    "rx_depth",
    "multi_recv",
    "tx_depth",
    "av_size",
    "max_addresses",
    "rnr_retry",
    "order",
    "wait_fd",
    "huge_landing",
    "force_prefix",
    "force_mr_local",
    "force_multi_recv",
];

/// A fabric option value that cannot be used, by the option's name.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("fabric option {key}={value:?}: {reason}")]
pub struct FabricOptionError {
    /// The option's name (as in the module docs' table).
    pub key: String,
    /// The value, as given or as text.
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

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
            multi_recv: true,
            tx_depth: DEFAULT_DEPTH,
            av_size: 1024,
            max_addresses: 1 << 16,
            rnr_retry: 6,
            order: OrderWanted::Prefer,
            rendezvous: true,
            force_prefix: 0,
            force_mr_local: false,
            force_multi_recv: false,
            wait_fd: true,
            huge_landing: false,
        }
    }
}

impl FabricOptions {
    /// Parses textual options in order (later ones win), with `bind` (the
    /// part of the endpoint string after the scheme) as the node when no
    /// `node` option names one. Unknown keys are errors; each value is
    /// checked as [`FabricOptions::check`] does.
    pub fn parse<'a>(
        options: impl IntoIterator<Item = (&'a str, &'a str)>,
        bind: Option<&str>,
    ) -> Result<Self, FabricOptionError> {
        let mut parsed = FabricOptions::default();
        let mut node_set = false;
        for (key, value) in options {
            parsed.set(key, value)?;
            node_set |= key == "node";
        }
        if !node_set {
            parsed = parsed.bound_at(bind);
        }
        Ok(parsed)
    }

    /// Sets one option from text and checks it.
    fn set(&mut self, key: &str, value: &str) -> Result<(), FabricOptionError> {
        let bad = |reason: &str| FabricOptionError {
            key: key.to_string(),
            value: value.to_string(),
            reason: reason.to_string(),
        };
        let text = || -> Option<String> {
            let v = value.trim();
            (!v.is_empty()).then(|| v.to_string())
        };
        let number = || -> Result<usize, FabricOptionError> {
            value
                .trim()
                .parse()
                .map_err(|_| bad("not a non-negative integer"))
        };
        let flag = || match value.trim() {
            "true" | "1" | "yes" => Ok(true),
            "false" | "0" | "no" => Ok(false),
            _ => Err(bad("expected true or false")),
        };
        let field = match key {
            "provider" => {
                self.provider = text().ok_or_else(|| bad("must not be empty"))?;
                key
            }
            "domain" | "iface" => {
                self.domain = text();
                "domain"
            }
            "fabric" => {
                self.fabric = text();
                key
            }
            "node" => {
                self.node = text();
                key
            }
            "service" => {
                self.service = text();
                key
            }
            "msg_size" => {
                self.msg_size = Some(number()?);
                key
            }
            "rendezvous" => {
                self.rendezvous = flag()?;
                key
            }
            "rx_depth" => {
                self.rx_depth = number()?;
                key
            }
            "multi_recv" => {
                self.multi_recv = flag()?;
                key
            }
            "tx_depth" => {
                self.tx_depth = number()?;
                key
            }
            "av_size" => {
                self.av_size = number()?;
                key
            }
            "max_addresses" => {
                self.max_addresses = number()?;
                key
            }
            "rnr_retry" => {
                self.rnr_retry = number()? as u64;
                key
            }
            "order" => {
                self.order = match value.trim() {
                    "prefer" => OrderWanted::Prefer,
                    "require" => OrderWanted::Require,
                    "none" => OrderWanted::None,
                    _ => return Err(bad("expected prefer, require or none")),
                };
                key
            }
            "force_prefix" => {
                self.force_prefix = number()?;
                key
            }
            "force_mr_local" => {
                self.force_mr_local = flag()?;
                key
            }
            "force_multi_recv" => {
                self.force_multi_recv = flag()?;
                key
            }
            "wait_fd" => {
                self.wait_fd = flag()?;
                key
            }
            "huge_landing" => {
                self.huge_landing = flag()?;
                key
            }
            _ => {
                return Err(bad(&format!(
                    "unknown fabric option (known: {}, iface)",
                    FABRIC_OPTION_KEYS.join(", ")
                )))
            }
        };
        self.check_one(field).map_err(|err| FabricOptionError {
            key: key.to_string(),
            value: value.to_string(),
            reason: err.reason,
        })
    }

    /// Checks every value against its bounds (the module docs' table):
    /// names without NUL bytes and not empty, depths and sizes within
    /// range, `force_prefix` a multiple of 8.
    pub fn check(&self) -> Result<(), FabricOptionError> {
        FABRIC_OPTION_KEYS
            .iter()
            .try_for_each(|key| self.check_one(key))
    }

    fn check_one(&self, key: &str) -> Result<(), FabricOptionError> {
        let bad = |value: String, reason: String| {
            Err(FabricOptionError {
                key: key.to_string(),
                value,
                reason,
            })
        };
        let name = |value: Option<&str>| match value {
            Some("") => bad(String::new(), "must not be empty".into()),
            Some(text) if text.contains('\0') => {
                bad(text.to_string(), "contains a NUL byte".into())
            }
            _ => Ok(()),
        };
        let range = |value: u64, min: u64, max: u64| {
            if value < min || value > max {
                return bad(
                    value.to_string(),
                    format!("must be between {min} and {max}"),
                );
            }
            Ok(())
        };
        let wide = |value: usize| value as u64;
        match key {
            "provider" => name(Some(&self.provider)),
            "domain" => name(self.domain.as_deref()),
            "fabric" => name(self.fabric.as_deref()),
            "node" => name(self.node.as_deref()),
            "service" => name(self.service.as_deref()),
            "msg_size" => match self.msg_size {
                Some(size) => range(wide(size), MIN_MSG_SIZE as u64, MAX_MSG_SIZE as u64),
                None => Ok(()),
            },
            "rx_depth" => range(wide(self.rx_depth), 1, MAX_DEPTH as u64),
            "tx_depth" => range(wide(self.tx_depth), 1, MAX_DEPTH as u64),
            "av_size" => range(wide(self.av_size), 1, MAX_AV_SIZE as u64),
            "max_addresses" => range(wide(self.max_addresses), 1, MAX_AV_SIZE as u64),
            "rnr_retry" => range(self.rnr_retry, 0, MAX_RNR_RETRY),
            "force_prefix" => {
                range(wide(self.force_prefix), 0, MAX_FORCE_PREFIX as u64)?;
                if self.force_prefix % 8 != 0 {
                    return bad(
                        self.force_prefix.to_string(),
                        "must be a multiple of 8, as libfabric's prefixes are".into(),
                    );
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// These options for an endpoint bound at `bind` (the part of the
    /// endpoint string after the scheme: `host`, `host:port` or
    /// `[v6]:port`): when no `node` is set, the bind address gives the
    /// node, and its port the service unless one is set.
    pub fn bound_at(mut self, bind: Option<&str>) -> Self {
        if self.node.is_none() {
            if let Some(bind) = bind {
                let (node, service) = split_bind(bind);
                self.node = node;
                if self.service.is_none() {
                    self.service = service;
                }
            }
        }
        self
    }

    /// Whether this is the EFA provider (which has its own rules and options).
    pub fn is_efa(&self) -> bool {
        self.provider == "efa" || self.provider.starts_with("efa;")
    }

    /// The options as `(name, value)` text, for printing: every option in
    /// the order of [`FABRIC_OPTION_KEYS`], the unset optional ones left
    /// out. [`FabricOptions::parse`] reads them back to the same value.
    pub fn describe(&self) -> Vec<(&'static str, String)> {
        let mut pairs = vec![("provider", self.provider.clone())];
        for (key, value) in [
            ("domain", &self.domain),
            ("fabric", &self.fabric),
            ("node", &self.node),
            ("service", &self.service),
        ] {
            if let Some(value) = value {
                pairs.push((key, value.clone()));
            }
        }
        if let Some(size) = self.msg_size {
            pairs.push(("msg_size", size.to_string()));
        }
        pairs.extend([
            ("rendezvous", self.rendezvous.to_string()),
            ("rx_depth", self.rx_depth.to_string()),
            ("multi_recv", self.multi_recv.to_string()),
            ("tx_depth", self.tx_depth.to_string()),
            ("av_size", self.av_size.to_string()),
            ("max_addresses", self.max_addresses.to_string()),
            ("rnr_retry", self.rnr_retry.to_string()),
            ("order", self.order.name().to_string()),
            ("wait_fd", self.wait_fd.to_string()),
            ("huge_landing", self.huge_landing.to_string()),
            ("force_prefix", self.force_prefix.to_string()),
            ("force_mr_local", self.force_mr_local.to_string()),
            ("force_multi_recv", self.force_multi_recv.to_string()),
        ]);
        pairs
    }
}

/// `key=value` pairs separated by spaces, as [`FabricOptions::describe`]
/// lists them.
impl fmt::Display for FabricOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (key, value)) in self.describe().iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{key}={value}")?;
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_efa_with_sas_preferred() {
        let o = FabricOptions::parse([], None).unwrap();
        assert_eq!(o, FabricOptions::default());
        assert_eq!(o.provider, "efa");
        assert!(o.is_efa());
        assert_eq!(o.order, OrderWanted::Prefer);
        assert_eq!(o.rnr_retry, 6);
        assert_eq!((o.force_prefix, o.force_mr_local), (0, false));
        assert_eq!(o.check(), Ok(()));
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
            ("rnr_retry", "7"),
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
    fn check_bounds_typed_values_and_names_the_key() {
        let bad = [
            FabricOptions {
                rx_depth: 0,
                ..FabricOptions::default()
            },
            FabricOptions {
                msg_size: Some(MAX_MSG_SIZE + 1),
                ..FabricOptions::default()
            },
            FabricOptions {
                force_prefix: 12,
                ..FabricOptions::default()
            },
            FabricOptions {
                rnr_retry: 8,
                ..FabricOptions::default()
            },
            FabricOptions {
                provider: String::new(),
                ..FabricOptions::default()
            },
            FabricOptions {
                node: Some("a\0b".into()),
                ..FabricOptions::default()
            },
        ];
        for (options, key) in bad.iter().zip([
            "rx_depth",
            "msg_size",
            "force_prefix",
            "rnr_retry",
            "provider",
            "node",
        ]) {
            let err = options.check().unwrap_err();
            assert_eq!(err.key, key, "{err}");
            assert!(err.to_string().contains(key), "{err}");
        }
        let err = bad[1].check().unwrap_err().to_string();
        assert!(
            err.contains(&format!("must be between 64 and {MAX_MSG_SIZE}")),
            "{err}"
        );
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

        let typed = FabricOptions {
            node: Some("10.0.0.1".into()),
            ..FabricOptions::default()
        };
        assert_eq!(typed.clone().bound_at(Some("127.0.0.1:7000")), typed);
        let o = FabricOptions::default().bound_at(Some("127.0.0.1:7000"));
        assert_eq!(o.node.as_deref(), Some("127.0.0.1"));
        assert_eq!(o.service.as_deref(), Some("7000"));
    }

    #[test]
    fn describe_prints_every_set_option_and_parses_back() {
        let o = FabricOptions {
            provider: "tcp;ofi_rxm".into(),
            domain: Some("lo".into()),
            msg_size: Some(16384),
            rx_depth: 64,
            order: OrderWanted::Require,
            rendezvous: false,
            force_prefix: 64,
            wait_fd: false,
            huge_landing: true,
            ..FabricOptions::default()
        };
        let pairs = o.describe();
        let keys: Vec<&str> = pairs.iter().map(|(key, _)| *key).collect();
        assert_eq!(
            keys,
            [
                "provider",
                "domain",
                "msg_size",
                "rendezvous",
                "rx_depth",
                "multi_recv",
                "tx_depth",
                "av_size",
                "max_addresses",
                "rnr_retry",
                "order",
                "wait_fd",
                "huge_landing",
                "force_prefix",
                "force_mr_local",
                "force_multi_recv"
            ]
        );
        let back = FabricOptions::parse(pairs.iter().map(|(k, v)| (*k, v.as_str())), None).unwrap();
        assert_eq!(back, o);
        assert!(
            o.to_string().starts_with(
                "provider=tcp;ofi_rxm domain=lo msg_size=16384 rendezvous=false rx_depth=64 multi_recv=true tx_depth=256"
            ),
            "{o}"
        );
        assert!(o.to_string().ends_with("force_multi_recv=false"), "{o}");
    }
}
