//! Defaults for the providers' own tunables, which libfabric reads only from
//! the environment, once, when it first loads its providers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Variables efabus sets, with their values, where the environment does
/// not set them already (`scripts/test` exports the same for the test
/// processes, which do not call [`apply_provider_env_defaults`]).
///
/// - `FI_OFI_RXM_MSG_RX_SIZE`: `ofi_rxm` over `tcp` posts this many receive
///   buffers of 16 KiB to each endpoint's shared receive context, allocated
///   and zeroed when the endpoint opens: 4,096 by default, 65 MiB resident
///   per endpoint before any traffic (its pool grows by 1,024 buffers, 16
///   MiB, at a time). 128 fit in one pool chunk: a buffer taken is posted
///   again as soon as the provider hands its message to one of the
///   receives efabus keeps posted (`fabric.rx_depth`, 256), and while none
///   is posted the peer's bytes wait in its TCP connection, so nothing is
///   lost. Where `ofi_rxm` has no shared receive context (over `verbs`, or
///   with `FI_OFI_RXM_USE_SRX=0`) the count is per connection, and 128 is
///   the provider's own default there.
pub const PROVIDER_ENV_DEFAULTS: &[(&str, &str)] = &[RXM_RX_SIZE];

/// `ofi_rxm`'s receive buffer count (see [`PROVIDER_ENV_DEFAULTS`]).
const RXM_RX_SIZE: (&str, &str) = ("FI_OFI_RXM_MSG_RX_SIZE", "128");

/// Sets each of [`PROVIDER_ENV_DEFAULTS`] that the environment leaves
/// unset.
///
/// Call it first in `main`, before anything starts a thread (an async
/// runtime's `main` attribute included: its threads exist by the time the
/// body runs) or opens a fabric endpoint. The environment is shared by the
/// whole process and C code (libfabric among it) reads it without a lock;
/// libfabric reads these variables only when it first loads its providers.
/// The `efabus` command does; a service embedding a broker should too, or
/// set the variables itself.
pub fn apply_provider_env_defaults() {
    for (name, value) in defaults_unset(|name| std::env::var_os(name).is_some()) {
        std::env::set_var(name, value);
    }
}

/// Says once per process, when a `tcp;ofi_rxm` endpoint opens while the
/// environment leaves its receive buffers to the provider, what that costs
/// and what to do about it.
#[cfg_attr(not(efabus_libfabric), allow(dead_code))]
pub(crate) fn note_unset_defaults(provider: &str) {
    static NOTED: AtomicBool = AtomicBool::new(false);
    let (name, value) = RXM_RX_SIZE;
    if rxm_over_tcp(provider)
        && std::env::var_os(name).is_none()
        && !NOTED.swap(true, Ordering::Relaxed)
    {
        tracing::info!(
            "{provider} posts 4,096 receive buffers of 16 KiB (65 MiB) per endpoint by default: \
             call apply_provider_env_defaults() (efabus::transports::fabric) first in main, \
             or set {name}={value}"
        );
    }
}

/// The eager limit `provider` keeps of its own, where it has one that
/// matters to efabus: `ofi_rxm` refuses connections between endpoints
/// whose limits differ (`rxm_verify_connreq`, whatever the core provider),
/// so each offer carries it and negotiation pairs only equal ones; and over
/// `tcp` it sends a message above it by a rendezvous of its own (a request,
/// a read and a reply per message), so efabus's default RDM eager buffers
/// stay within it there and larger frames take efabus's rendezvous. The
/// limit is the environment's (see [`rxm_eager_limit`]), never set by
/// efabus, and read once, as libfabric reads it once.
pub fn provider_eager_limit(provider: &str) -> Option<usize> {
    static OVER_TCP: OnceLock<usize> = OnceLock::new();
    static OVER_OTHER: OnceLock<usize> = OnceLock::new();
    if !provider.contains("ofi_rxm") {
        return None;
    }
    let over_tcp = rxm_over_tcp(provider);
    let limit = if over_tcp { &OVER_TCP } else { &OVER_OTHER };
    Some(*limit.get_or_init(|| rxm_eager_limit(over_tcp, |name| std::env::var(name).ok())))
}

/// Whether `provider` is `ofi_rxm` over libfabric's `tcp`.
pub(crate) fn rxm_over_tcp(provider: &str) -> bool {
    provider.starts_with("tcp") && provider.contains("ofi_rxm")
}

/// `ofi_rxm`'s eager limit given the environment (`var`), as libfabric
/// 1.17 sets it: its buffer size (`FI_OFI_RXM_BUFFER_SIZE`, 16 KiB unset);
/// over `tcp`, whose receive buffers it takes from the application, its
/// `FI_OFI_RXM_EAGER_LIMIT` instead, never below the buffer size. Values
/// are read as libfabric reads them (see [`leading_number`]). Turning its
/// direct sends or dynamic receive buffers off over `tcp` (which makes it
/// ignore the eager limit) is not followed: either leaves eager buffers
/// that take the provider's rendezvous, which costs speed, not messages.
fn rxm_eager_limit(over_tcp: bool, var: impl Fn(&str) -> Option<String>) -> usize {
    let read = |name: &str| var(name).and_then(|value| leading_number(&value));
    let buffer = read("FI_OFI_RXM_BUFFER_SIZE").unwrap_or(RXM_DEFAULT_EAGER);
    if !over_tcp {
        return buffer;
    }
    read("FI_OFI_RXM_EAGER_LIMIT").unwrap_or(buffer).max(buffer)
}

/// The number at the head of `text` as C's `strtoul` with base 0 reads it,
/// which is how libfabric reads a size from the environment: blanks
/// first, then hexadecimal after `0x`, octal after a leading `0`, decimal
/// otherwise, up to the first character that is not a digit. `None` where
/// no digit comes first, or for a sign (no sensible size has one).
fn leading_number(text: &str) -> Option<usize> {
    let text = text.trim_start();
    let (radix, digits) = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) if hex.starts_with(|c: char| c.is_ascii_hexdigit()) => (16, hex),
        _ if text.starts_with('0') => (8, text),
        _ => (10, text),
    };
    let end = digits
        .find(|c: char| !c.is_digit(radix))
        .unwrap_or(digits.len());
    usize::from_str_radix(&digits[..end], radix).ok()
}

/// `ofi_rxm`'s buffer size and eager limit when the environment sets
/// neither.
const RXM_DEFAULT_EAGER: usize = 16 << 10;

/// The defaults whose variables `is_set` says are unset.
fn defaults_unset(is_set: impl Fn(&str) -> bool) -> Vec<(&'static str, &'static str)> {
    PROVIDER_ENV_DEFAULTS
        .iter()
        .copied()
        .filter(|(name, _)| !is_set(name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variable_the_environment_sets_is_left_as_it_is() {
        assert_eq!(defaults_unset(|_| false), PROVIDER_ENV_DEFAULTS);
        assert!(defaults_unset(|_| true).is_empty());
    }

    #[test]
    fn sizes_from_the_environment_read_as_libfabric_reads_them() {
        for (text, expected) in [
            ("32768", Some(32768)),
            (" 32768 ", Some(32768)),
            ("0x8000", Some(32768)),
            ("0X8000", Some(32768)),
            ("0100000", Some(32768)),
            ("32768kb", Some(32768)),
            ("0", Some(0)),
            ("", None),
            ("big", None),
            ("-1", None),
        ] {
            assert_eq!(leading_number(text), expected, "{text:?}");
        }
    }

    #[test]
    fn the_rxm_eager_limit_over_tcp_is_its_variable_never_below_the_buffer_size() {
        const LIMIT: &str = "FI_OFI_RXM_EAGER_LIMIT";
        const BUFFER: &str = "FI_OFI_RXM_BUFFER_SIZE";
        // Over tcp, then over other cores (`verbs`), where the buffer size
        // is the limit.
        type Env = &'static [(&'static str, &'static str)];
        let cases: [(bool, Env, usize); 8] = [
            (true, &[], 16384),
            (true, &[(LIMIT, "32768")], 32768),
            (true, &[(BUFFER, "65536")], 65536),
            (true, &[(LIMIT, "65536"), (BUFFER, "20000")], 65536),
            (true, &[(LIMIT, "8192"), (BUFFER, "20000")], 20000),
            (false, &[], 16384),
            (false, &[(LIMIT, "32768")], 16384),
            (false, &[(BUFFER, "0x10000")], 65536),
        ];
        for (over_tcp, env, expected) in cases {
            let var = |name: &str| {
                env.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            };
            assert_eq!(
                rxm_eager_limit(over_tcp, var),
                expected,
                "over tcp: {over_tcp}, {env:?}"
            );
        }
    }

    #[test]
    fn every_rxm_core_has_an_eager_limit_and_other_providers_none() {
        for provider in ["tcp;ofi_rxm", "tcp", "verbs;ofi_rxm"] {
            assert_eq!(
                provider_eager_limit(provider).is_some(),
                provider.contains("ofi_rxm"),
                "{provider}"
            );
        }
        for provider in ["shm", "efa", "sockets", "udp;ofi_rxd"] {
            assert_eq!(provider_eager_limit(provider), None, "{provider}");
        }
    }
}
