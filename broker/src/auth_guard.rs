//! Failed authentications, counted per remote address: after
//! [`MAX_FAILURES`] within [`WINDOW`], hellos from that address are refused
//! without being checked until the window ends, so guessing the secret
//! from one address goes at most that fast. Addresses behind one NAT share
//! the count. The table is bounded; when it is full of live windows, new
//! addresses go uncounted rather than growing it.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap as HashMap;

/// Failed hellos from one address before it is refused unchecked.
pub(crate) const MAX_FAILURES: u32 = 10;
/// How long failures count, from the first one.
pub(crate) const WINDOW: Duration = Duration::from_secs(10);
/// Most addresses tracked at once.
const MAX_TRACKED: usize = 4096;

struct Failures {
    count: u32,
    since: Instant,
}

#[derive(Default)]
pub(crate) struct AuthGuard {
    by_address: HashMap<IpAddr, Failures>,
}

/// The address part of a peer's remote text (`ip:port` for TCP); `None`
/// for transports without one (mem).
pub(crate) fn remote_ip(remote: &str) -> Option<IpAddr> {
    remote.parse::<SocketAddr>().ok().map(|addr| addr.ip())
}

impl AuthGuard {
    /// How much longer hellos from `ip` are refused unchecked, if they are.
    pub fn locked(&mut self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let failures = self.by_address.get(&ip)?;
        let end = failures.since + WINDOW;
        if now >= end {
            self.by_address.remove(&ip);
            return None;
        }
        (failures.count >= MAX_FAILURES).then(|| end - now)
    }

    /// A hello from `ip` failed authentication.
    pub fn failed(&mut self, ip: IpAddr, now: Instant) {
        if self.by_address.len() >= MAX_TRACKED && !self.by_address.contains_key(&ip) {
            self.by_address
                .retain(|_, failures| now < failures.since + WINDOW);
            if self.by_address.len() >= MAX_TRACKED {
                return;
            }
        }
        let failures = self.by_address.entry(ip).or_insert(Failures {
            count: 0,
            since: now,
        });
        if now >= failures.since + WINDOW {
            *failures = Failures {
                count: 0,
                since: now,
            };
        }
        failures.count += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_is_refused_after_its_failures_until_the_window_ends() {
        let start = Instant::now();
        let ip = remote_ip("10.0.0.7:40000").expect("an address");
        let other = remote_ip("[::1]:7420").expect("an address");
        let mut guard = AuthGuard::default();
        for _ in 0..MAX_FAILURES - 1 {
            guard.failed(ip, start);
        }
        assert_eq!(guard.locked(ip, start), None);
        guard.failed(ip, start);
        assert_eq!(
            guard.locked(ip, start + Duration::from_secs(4)),
            Some(WINDOW - Duration::from_secs(4))
        );
        assert_eq!(
            guard.locked(other, start),
            None,
            "other addresses are not affected"
        );
        assert_eq!(guard.locked(ip, start + WINDOW), None, "the window ended");
        guard.failed(ip, start + WINDOW);
        assert_eq!(
            guard.locked(ip, start + WINDOW),
            None,
            "counting starts afresh"
        );
        assert_eq!(remote_ip("mem-peer-3"), None);
    }

    #[test]
    fn the_table_stays_bounded() {
        let now = Instant::now();
        let mut guard = AuthGuard::default();
        for n in 0..(MAX_TRACKED as u32 + 100) {
            guard.failed(IpAddr::from(n.to_be_bytes()), now);
        }
        assert_eq!(guard.by_address.len(), MAX_TRACKED);
    }
}
