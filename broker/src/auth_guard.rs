//! Failed authentications, counted per remote address: failed hellos, and
//! route hellos refused for want of the route credential. After
//! [`MAX_FAILURES`] within [`WINDOW`], hellos from that address are refused
//! without being checked until the window ends, so guessing a secret from
//! one address goes at most that fast. An IPv6 address counts with
//! its /64 (one host's share of a network), and addresses behind one NAT
//! share the count. The table is bounded: when it is full, the address
//! whose window started first is forgotten.

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

/// What failures of a peer count against, from its remote text (`ip:port`
/// for TCP): its IPv4 address, or the /64 of its IPv6 address; `None` for
/// transports without an address (mem).
pub(crate) fn remote_ip(remote: &str) -> Option<IpAddr> {
    let address = remote.parse::<SocketAddr>().ok()?;
    Some(efabus_transports::address_key(address.ip()))
}

impl AuthGuard {
    /// Why a peer from `ip` is refused unchecked, if it is: the text of
    /// its `RateLimited` error (not `Auth`: a client refused for its
    /// credentials gives up, and one with the right secret behind a shared
    /// address must not).
    pub fn lockout(&mut self, ip: IpAddr, now: Instant) -> Option<String> {
        self.locked(ip, now).map(|wait| {
            format!(
                "too many failed authentications from this address; retry in {} s",
                wait.as_secs() + 1
            )
        })
    }

    /// How much longer hellos from `ip` are refused unchecked, if they are.
    fn locked(&mut self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let failures = self.by_address.get(&ip)?;
        let end = failures.since + WINDOW;
        if now >= end {
            self.by_address.remove(&ip);
            return None;
        }
        (failures.count >= MAX_FAILURES).then(|| end - now)
    }

    /// A hello from `ip` failed authentication (or its route hello was
    /// refused).
    pub fn failed(&mut self, ip: IpAddr, now: Instant) {
        if self.by_address.len() >= MAX_TRACKED && !self.by_address.contains_key(&ip) {
            self.by_address
                .retain(|_, failures| now < failures.since + WINDOW);
            if self.by_address.len() >= MAX_TRACKED {
                let oldest = self
                    .by_address
                    .iter()
                    .min_by_key(|(_, failures)| failures.since)
                    .map(|(&address, _)| address);
                if let Some(oldest) = oldest {
                    self.by_address.remove(&oldest);
                }
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
        assert_eq!(
            remote_ip("[2001:db8::1]:1").unwrap(),
            remote_ip("[2001:db8::ffff:2]:2").unwrap(),
            "one /64 counts as one address"
        );
        assert_eq!(
            remote_ip("[::ffff:10.0.0.7]:3").unwrap(),
            remote_ip("10.0.0.7:4").unwrap()
        );
    }

    #[test]
    fn a_full_table_forgets_the_oldest_and_keeps_counting() {
        let start = Instant::now();
        let mut guard = AuthGuard::default();
        for n in 0..MAX_TRACKED as u32 {
            guard.failed(IpAddr::from(n.to_be_bytes()), start);
        }
        let late = start + Duration::from_secs(1);
        let fresh = IpAddr::from([203, 0, 113, 9]);
        for _ in 0..MAX_FAILURES {
            guard.failed(fresh, late);
        }
        assert_eq!(guard.by_address.len(), MAX_TRACKED, "bounded");
        assert!(
            guard.locked(fresh, late).is_some(),
            "new addresses still count"
        );
    }
}
