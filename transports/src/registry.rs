//! Endpoint strings and the map from scheme to transport.
//!
//! An endpoint string names a transport by scheme and, optionally, an
//! address after a slash: `mem/orders`, `tcp/127.0.0.1:7420`, `efa-rdm`,
//! `efa-dgram`. It is parsed once into an [`EndpointSpec`]; the
//! [`Registry`] then finds the transport for the scheme. Applications add
//! their own transports (or replace a built-in one) with
//! [`Registry::register`].

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use efabus_core::transport::{Endpoint, EndpointConfig, PeerId, Transport, TransportError};
use thiserror::Error;

use crate::fabric::FabricTransport;
use crate::mem::MemTransport;
use crate::nats::NatsTransport;
use crate::tcp::TcpTransport;

/// Why an endpoint string does not parse.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SpecError {
    #[error("empty endpoint string; expected scheme or scheme/address (e.g. tcp/127.0.0.1:7420)")]
    Empty,
    #[error("endpoint {spec:?} contains whitespace")]
    Whitespace { spec: String },
    #[error("endpoint {spec:?} has no scheme before '/'")]
    MissingScheme { spec: String },
    #[error(
        "endpoint {spec:?} has an invalid scheme {scheme:?}: a scheme starts with a letter \
         and holds letters, digits, '-', '_', '+' or '.'"
    )]
    BadScheme { spec: String, scheme: String },
    #[error("endpoint {spec:?} has an empty address after '/'")]
    EmptyAddress { spec: String },
    #[error("endpoint {spec:?} looks like a URL; write {scheme}/{rest} instead")]
    UrlForm {
        spec: String,
        scheme: String,
        rest: String,
    },
}

/// A parsed endpoint string: a scheme and an optional address.
///
/// The scheme is stored in lower case; the address is kept as written.
/// `Display` gives the canonical form back (`scheme` or `scheme/address`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointSpec {
    scheme: String,
    address: Option<String>,
}

impl EndpointSpec {
    /// Parse `scheme` or `scheme/address`.
    pub fn parse(text: &str) -> Result<Self, SpecError> {
        if text.is_empty() {
            return Err(SpecError::Empty);
        }
        if text.chars().any(char::is_whitespace) {
            return Err(SpecError::Whitespace { spec: text.into() });
        }
        let (scheme, address) = match text.split_once('/') {
            Some((scheme, rest)) => (scheme, Some(rest)),
            None => (text, None),
        };
        if scheme.is_empty() {
            return Err(SpecError::MissingScheme { spec: text.into() });
        }
        let scheme_ok = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '+' | '.'));
        if let Some(url) = scheme.strip_suffix(':') {
            if let Some(rest) = address.and_then(|a| a.strip_prefix('/')) {
                // A web URL names a host and port: efabus speaks TCP there.
                let scheme = match url.to_ascii_lowercase() {
                    web if web == "http" || web == "https" => "tcp".to_string(),
                    other => other,
                };
                return Err(SpecError::UrlForm {
                    spec: text.into(),
                    scheme,
                    rest: rest.into(),
                });
            }
        }
        if !scheme_ok {
            return Err(SpecError::BadScheme {
                spec: text.into(),
                scheme: scheme.into(),
            });
        }
        if address == Some("") {
            return Err(SpecError::EmptyAddress { spec: text.into() });
        }
        Ok(EndpointSpec {
            scheme: scheme.to_ascii_lowercase(),
            address: address.map(str::to_string),
        })
    }

    /// Build from parts that are already known to be valid.
    pub fn new(scheme: &str, address: Option<&str>) -> Result<Self, SpecError> {
        match address {
            Some(address) => Self::parse(&format!("{scheme}/{address}")),
            None => Self::parse(scheme),
        }
    }

    /// The scheme, in lower case (`tcp`).
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// What follows the first '/', if anything (`127.0.0.1:7420`).
    pub fn address(&self) -> Option<&str> {
        self.address.as_deref()
    }
}

impl FromStr for EndpointSpec {
    type Err = SpecError;

    fn from_str(text: &str) -> Result<Self, SpecError> {
        Self::parse(text)
    }
}

impl fmt::Display for EndpointSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.address {
            Some(address) => write!(f, "{}/{}", self.scheme, address),
            None => f.write_str(&self.scheme),
        }
    }
}

/// Errors from looking up transports and opening endpoints by spec.
#[derive(Debug, Error)]
pub enum RegistryError {
    #[error("unknown transport scheme {scheme:?}; known schemes: {known}")]
    UnknownScheme { scheme: String, known: String },
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("endpoint {spec} names no address to connect to")]
    MissingAddress { spec: String },
    #[error("{spec}: {source}")]
    Transport {
        spec: String,
        #[source]
        source: TransportError,
    },
}

impl RegistryError {
    /// What went wrong, without the endpoint's name: for messages that
    /// name the endpoint already.
    pub fn cause(&self) -> &dyn std::fmt::Display {
        match self {
            RegistryError::Transport { source, .. } => source,
            other => other,
        }
    }
}

/// Transports by scheme.
#[derive(Clone, Default)]
pub struct Registry {
    transports: BTreeMap<String, Arc<dyn Transport>>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("schemes", &self.schemes())
            .finish()
    }
}

impl Registry {
    /// A registry with no transports.
    pub fn new() -> Self {
        Registry::default()
    }

    /// A registry with the transports built into this crate: `mem`, `tcp`,
    /// `efa-rdm`, `efa-dgram` and `shm` (the fabric ones report themselves
    /// unavailable, with the reason, where libfabric or the provider is missing).
    pub fn with_builtins() -> Self {
        let mut registry = Registry::new();
        registry.register(Arc::new(MemTransport));
        registry.register(Arc::new(TcpTransport));
        registry.register(Arc::new(NatsTransport));
        registry.register(Arc::new(FabricTransport::rdm()));
        registry.register(Arc::new(FabricTransport::dgram()));
        registry.register(Arc::new(FabricTransport::shm()));
        registry
    }

    /// Add a transport under its scheme (lower-cased), replacing and
    /// returning any transport registered for that scheme before.
    pub fn register(&mut self, transport: Arc<dyn Transport>) -> Option<Arc<dyn Transport>> {
        let scheme = transport.scheme().to_ascii_lowercase();
        self.transports.insert(scheme, transport)
    }

    /// The transport for a scheme (case-insensitive).
    pub fn get(&self, scheme: &str) -> Result<Arc<dyn Transport>, RegistryError> {
        self.transports
            .get(&scheme.to_ascii_lowercase())
            .cloned()
            .ok_or_else(|| RegistryError::UnknownScheme {
                scheme: scheme.to_string(),
                known: self.schemes().join(", "),
            })
    }

    /// The registered schemes, sorted.
    pub fn schemes(&self) -> Vec<&str> {
        self.transports.keys().map(String::as_str).collect()
    }

    /// Open an endpoint for a spec. The spec's address, when it has one,
    /// becomes `config.bind` (the endpoint listens there); without one the
    /// config is used as given.
    pub fn open(
        &self,
        spec: &EndpointSpec,
        config: &EndpointConfig,
    ) -> Result<Box<dyn Endpoint>, RegistryError> {
        let transport = self.get(spec.scheme())?;
        let mut config = config.clone();
        if let Some(address) = spec.address() {
            config.bind = Some(address.to_string());
        }
        transport
            .open(&config)
            .map_err(|source| RegistryError::Transport {
                spec: spec.to_string(),
                source,
            })
    }

    /// Open an endpoint with `config` as given (usually without `bind`) and
    /// start a link to the spec's address: the client side of
    /// `tcp/10.0.0.7:7420`.
    pub fn connect(
        &self,
        spec: &EndpointSpec,
        config: &EndpointConfig,
    ) -> Result<(Box<dyn Endpoint>, PeerId), RegistryError> {
        let transport = self.get(spec.scheme())?;
        let address = spec
            .address()
            .ok_or_else(|| RegistryError::MissingAddress {
                spec: spec.to_string(),
            })?;
        let wrap = |source| RegistryError::Transport {
            spec: spec.to_string(),
            source,
        };
        let mut endpoint = transport.open(config).map_err(wrap)?;
        let peer = endpoint.connect(address).map_err(wrap)?;
        Ok((endpoint, peer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use efabus_core::caps::FabricInfo;

    #[test]
    fn parses_the_documented_forms() {
        let tcp: EndpointSpec = "tcp/127.0.0.1:7420".parse().unwrap();
        assert_eq!(tcp.scheme(), "tcp");
        assert_eq!(tcp.address(), Some("127.0.0.1:7420"));
        assert_eq!(tcp.to_string(), "tcp/127.0.0.1:7420");

        let mem = EndpointSpec::parse("mem/orders/eu").unwrap();
        assert_eq!(mem.address(), Some("orders/eu"));

        let rdm = EndpointSpec::parse("EFA-RDM").unwrap();
        assert_eq!(rdm.scheme(), "efa-rdm");
        assert_eq!(rdm.address(), None);
        assert_eq!(rdm.to_string(), "efa-rdm");

        let ipv6 = EndpointSpec::parse("tcp/[::1]:7420").unwrap();
        assert_eq!(ipv6.address(), Some("[::1]:7420"));
        assert_eq!(EndpointSpec::new("tcp", Some("[::1]:7420")).unwrap(), ipv6);
    }

    #[test]
    fn rejects_malformed_strings_with_the_reason() {
        assert_eq!(EndpointSpec::parse(""), Err(SpecError::Empty));
        assert!(matches!(
            EndpointSpec::parse("tcp/ 1.2.3.4:5"),
            Err(SpecError::Whitespace { .. })
        ));
        assert!(matches!(
            EndpointSpec::parse("/x"),
            Err(SpecError::MissingScheme { .. })
        ));
        assert!(matches!(
            EndpointSpec::parse("tcp/"),
            Err(SpecError::EmptyAddress { .. })
        ));
        assert!(matches!(
            EndpointSpec::parse("9p/x"),
            Err(SpecError::BadScheme { .. })
        ));
        let url = EndpointSpec::parse("tcp://127.0.0.1:7420").unwrap_err();
        assert_eq!(
            url,
            SpecError::UrlForm {
                spec: "tcp://127.0.0.1:7420".into(),
                scheme: "tcp".into(),
                rest: "127.0.0.1:7420".into()
            }
        );
        assert!(url.to_string().contains("tcp/127.0.0.1:7420"));
        let web = EndpointSpec::parse("http://127.0.0.1:7420").unwrap_err();
        assert!(
            web.to_string().contains("write tcp/127.0.0.1:7420"),
            "{web}"
        );
    }

    #[test]
    fn unknown_scheme_lists_the_known_ones() {
        let registry = Registry::with_builtins();
        assert_eq!(
            registry.schemes(),
            vec!["efa-dgram", "efa-rdm", "mem", "nats", "shm", "tcp"]
        );
        let err = registry.get("carrier-pigeon").err().unwrap();
        assert!(matches!(err, RegistryError::UnknownScheme { .. }));
        assert!(
            err.to_string()
                .contains("efa-dgram, efa-rdm, mem, nats, shm, tcp"),
            "{err}"
        );
        assert_eq!(registry.get("TCP").unwrap().scheme(), "tcp");
    }

    struct Fake(&'static str);

    impl Transport for Fake {
        fn scheme(&self) -> &str {
            self.0
        }
        fn infos(&self) -> Result<Vec<FabricInfo>, TransportError> {
            Err(TransportError::Unavailable {
                scheme: self.0.into(),
                reason: "test double".into(),
            })
        }
        fn open(&self, _: &EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
            Err(TransportError::Unavailable {
                scheme: self.0.into(),
                reason: "test double".into(),
            })
        }
    }

    #[test]
    fn register_adds_and_replaces() {
        let mut registry = Registry::with_builtins();
        assert!(registry.register(Arc::new(Fake("ucx"))).is_none());
        assert_eq!(
            registry.schemes(),
            vec!["efa-dgram", "efa-rdm", "mem", "nats", "shm", "tcp", "ucx"]
        );
        let replaced = registry.register(Arc::new(Fake("tcp"))).unwrap();
        assert_eq!(replaced.scheme(), "tcp");
        let spec = EndpointSpec::parse("tcp/127.0.0.1:0").unwrap();
        let err = registry
            .open(&spec, &EndpointConfig::default())
            .err()
            .unwrap();
        assert!(
            matches!(
                err,
                RegistryError::Transport {
                    source: TransportError::Unavailable { .. },
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn open_binds_at_the_spec_address_and_connect_needs_one() {
        let registry = Registry::with_builtins();
        let spec = EndpointSpec::parse("tcp/127.0.0.1:0").unwrap();
        let listener = registry.open(&spec, &EndpointConfig::default()).unwrap();
        let addr = String::from_utf8(listener.local_addr()).unwrap();
        assert!(
            addr.starts_with("127.0.0.1:") && !addr.ends_with(":0"),
            "{addr}"
        );

        let target = EndpointSpec::new("tcp", Some(&addr)).unwrap();
        let (client, _peer) = registry
            .connect(&target, &EndpointConfig::default())
            .unwrap();
        assert_eq!(client.scheme(), "tcp");

        let bare = EndpointSpec::parse("mem").unwrap();
        assert!(matches!(
            registry.connect(&bare, &EndpointConfig::default()),
            Err(RegistryError::MissingAddress { .. })
        ));
    }
}
