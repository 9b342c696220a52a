//! Defaults for the providers' own tunables, which libfabric reads only from
//! the environment, once, when it first loads its providers.

use std::sync::atomic::{AtomicBool, Ordering};

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
/// - `FI_OFI_RXM_EAGER_LIMIT`: `ofi_rxm` sends a message above its eager
///   limit (16 KiB by default) by a rendezvous of its own, a request and a
///   read and a reply per message, where efabus's eager buffers are up to
///   32 KiB (`fabric.eager_size`): packed runs of small frames took that
///   round trip. Over `tcp` the eager limit may exceed the provider's own
///   16 KiB buffers: an eager message is read straight into the receive
///   efabus posted, and one that finds none (a receive between its
///   completion and its reposting) is held in memory `ofi_rxm` allocates,
///   which the credit window bounds (at most `fabric.rx_depth` messages
///   beyond what the receiver reposted). Other providers ignore it.
pub const PROVIDER_ENV_DEFAULTS: &[(&str, &str)] = &[RXM_RX_SIZE, RXM_EAGER_LIMIT];

/// `ofi_rxm`'s receive buffer count (see [`PROVIDER_ENV_DEFAULTS`]).
const RXM_RX_SIZE: (&str, &str) = ("FI_OFI_RXM_MSG_RX_SIZE", "128");
/// `ofi_rxm`'s eager limit (see [`PROVIDER_ENV_DEFAULTS`]): the default
/// eager buffer, 32 KiB less 256 bytes, fits.
const RXM_EAGER_LIMIT: (&str, &str) = ("FI_OFI_RXM_EAGER_LIMIT", "32768");
/// `ofi_rxm`'s own buffer size, which its eager limit never falls below.
const RXM_BUFFER_SIZE: &str = "FI_OFI_RXM_BUFFER_SIZE";
/// `ofi_rxm`'s buffer size and eager limit when the environment sets
/// neither.
const RXM_DEFAULT_EAGER: u64 = 16 << 10;

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
/// and what to do about it; and, once, when its eager limit is below the
/// longest message the endpoint posts (`longest_message`: a larger
/// `fabric.eager_size`, or the limit set lower), that such messages take a
/// round trip each.
#[cfg_attr(not(efabus_libfabric), allow(dead_code))]
pub(crate) fn note_unset_defaults(provider: &str, longest_message: usize) {
    static NOTED_RX_SIZE: AtomicBool = AtomicBool::new(false);
    static NOTED_EAGER: AtomicBool = AtomicBool::new(false);
    let rxm_over_tcp = provider.starts_with("tcp") && provider.contains("ofi_rxm");
    if !rxm_over_tcp {
        return;
    }
    let (name, value) = RXM_RX_SIZE;
    if std::env::var_os(name).is_none() && !NOTED_RX_SIZE.swap(true, Ordering::Relaxed) {
        tracing::info!(
            "{provider} posts 4,096 receive buffers of 16 KiB (65 MiB) per endpoint by default: \
             call apply_provider_env_defaults() (efabus::transports::fabric) first in main, \
             or set {name}={value}"
        );
    }
    let limit = rxm_eager_limit(|name| std::env::var(name).ok());
    if (limit as u128) < longest_message as u128 && !NOTED_EAGER.swap(true, Ordering::Relaxed) {
        tracing::info!(
            "{provider} sends messages above {limit} bytes (its eager limit) by a rendezvous \
             of its own, a round trip each, and this endpoint's eager buffers take up to \
             {longest_message}: set {}={longest_message} or more, or call \
             apply_provider_env_defaults() (efabus::transports::fabric) first in main",
            RXM_EAGER_LIMIT.0
        );
    }
}

/// The eager limit `ofi_rxm` over `tcp` works with, given the environment
/// (`var`): the larger of `FI_OFI_RXM_EAGER_LIMIT` and
/// `FI_OFI_RXM_BUFFER_SIZE`, each 16 KiB when unset (as libfabric 1.17
/// reads them; an unreadable value counts as unset).
fn rxm_eager_limit(var: impl Fn(&str) -> Option<String>) -> u64 {
    let read = |name: &str| var(name).and_then(|value| value.trim().parse::<u64>().ok());
    let buffer = read(RXM_BUFFER_SIZE).unwrap_or(RXM_DEFAULT_EAGER);
    read(RXM_EAGER_LIMIT.0).unwrap_or(buffer).max(buffer)
}

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
    fn the_rxm_eager_limit_is_the_larger_of_its_two_variables() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(rxm_eager_limit(env(&[])), 16384);
        assert_eq!(
            rxm_eager_limit(env(&[("FI_OFI_RXM_EAGER_LIMIT", "32768")])),
            32768
        );
        assert_eq!(
            rxm_eager_limit(env(&[("FI_OFI_RXM_BUFFER_SIZE", "65536")])),
            65536
        );
        assert_eq!(
            rxm_eager_limit(env(&[
                ("FI_OFI_RXM_EAGER_LIMIT", "8192"),
                ("FI_OFI_RXM_BUFFER_SIZE", "20000")
            ])),
            20000,
            "never below the buffer size"
        );
        assert_eq!(
            rxm_eager_limit(env(&[("FI_OFI_RXM_EAGER_LIMIT", "lots")])),
            16384
        );
        // The default set here carries the default eager buffer whole.
        let default: u64 = RXM_EAGER_LIMIT.1.parse().unwrap();
        assert!(default >= crate::fabric::config::DEFAULT_RDM_MSG_SIZE as u64);
    }
}
