//! The keys of a session's data links, agreed in its handshake.
//!
//! Each side puts a fresh X25519 public key and the id it gives the links
//! in its `Hello` or `Welcome` ([`LinkAuth`]), on the control link only.
//! Both derive the same X25519 secret, and from it, with BLAKE3's key
//! derivation, one 256-bit key per direction and per link, bound to both
//! shares, both ids and the link's scheme: a key is never used for two
//! directions or two links, and an observer of the control link (without
//! TLS) learns only public keys. What the fabric endpoint does with the
//! keys is in `efabus_transports::fabric::layout`.
//!
//! A datagram link given up may open again later in the session
//! (`Frame::BestEffortReopen`), under fresh keys: its sequences start over,
//! so its old keys must not be used again. Each side keeps a root derived
//! from the same shared secret ([`ReopenRoot`]) for that, not the secret.

use efabus_core::frame::LinkAuth;
use efabus_core::transport::LinkKeys;
use thiserror::Error;
use x25519_dalek::{PublicKey, StaticSecret};

/// Why link keys could not be agreed.
#[derive(Debug, Error)]
pub enum LinkAuthError {
    #[error("no randomness from the operating system: {0}")]
    Random(String),
    /// The peer's key share is a low-order point: every secret it gives is
    /// known in advance.
    #[error("the peer's link key share is not usable")]
    WeakShare,
}

/// Which end of the handshake this side is: the keys of each direction
/// follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeRole {
    /// Sent the `Hello`.
    Dialer,
    /// Answered with the `Welcome`.
    Acceptor,
}

/// This side's secret for one handshake, and what it tells the peer.
pub struct LinkSecret {
    secret: StaticSecret,
    auth: LinkAuth,
}

impl std::fmt::Debug for LinkSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkSecret")
            .field("link_id", &self.auth.link_id)
            .finish_non_exhaustive()
    }
}

/// Random bytes from the operating system.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], LinkAuthError> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|err| LinkAuthError::Random(err.to_string()))?;
    Ok(bytes)
}

/// A random nonzero 64-bit value.
pub fn random_u64() -> Result<u64, LinkAuthError> {
    Ok(u64::from_le_bytes(random_bytes()?).max(1))
}

impl LinkSecret {
    /// A fresh secret and a random link id.
    pub fn new() -> Result<LinkSecret, LinkAuthError> {
        let secret = StaticSecret::from(random_bytes::<32>()?);
        let key_share = PublicKey::from(&secret).to_bytes();
        Ok(LinkSecret {
            secret,
            auth: LinkAuth {
                key_share,
                link_id: random_u64()?,
            },
        })
    }

    /// What goes in this side's `Hello` or `Welcome`.
    pub fn auth(&self) -> &LinkAuth {
        &self.auth
    }

    /// The keys of the link on `scheme`, given the peer's part.
    pub fn keys(
        &self,
        role: HandshakeRole,
        peer: &LinkAuth,
        scheme: &str,
    ) -> Result<LinkKeys, LinkAuthError> {
        let key = self.deriver(role, peer, scheme.as_bytes())?;
        let to_acceptor = key("efabus 2026-12 fabric link key, dialer to acceptor");
        let to_dialer = key("efabus 2026-12 fabric link key, acceptor to dialer");
        let (send_key, receive_key) = match role {
            HandshakeRole::Dialer => (to_acceptor, to_dialer),
            HandshakeRole::Acceptor => (to_dialer, to_acceptor),
        };
        Ok(LinkKeys {
            send_key,
            receive_key,
            local_id: self.auth.link_id,
            remote_id: peer.link_id,
        })
    }

    /// The root this side keeps to key its links again later.
    pub fn reopen_root(
        &self,
        role: HandshakeRole,
        peer: &LinkAuth,
    ) -> Result<ReopenRoot, LinkAuthError> {
        let key = self.deriver(role, peer, &[])?;
        Ok(ReopenRoot {
            root: key("efabus 2026-12 fabric link reopening root"),
            role,
            local_link_id: self.auth.link_id,
            remote_link_id: peer.link_id,
        })
    }

    /// Derives 256-bit keys for a context from the secret agreed with the
    /// peer, bound to both shares, both ids and `label`.
    fn deriver<'a>(
        &'a self,
        role: HandshakeRole,
        peer: &'a LinkAuth,
        label: &'a [u8],
    ) -> Result<impl Fn(&str) -> [u8; 32] + 'a, LinkAuthError> {
        let shared = self.secret.diffie_hellman(&PublicKey::from(peer.key_share));
        if !shared.was_contributory() {
            return Err(LinkAuthError::WeakShare);
        }
        let (dialer, acceptor) = match role {
            HandshakeRole::Dialer => (&self.auth, peer),
            HandshakeRole::Acceptor => (peer, &self.auth),
        };
        Ok(move |context: &str| {
            let mut hasher = blake3::Hasher::new_derive_key(context);
            hasher.update(shared.as_bytes());
            hasher.update(&dialer.key_share);
            hasher.update(&acceptor.key_share);
            hasher.update(&dialer.link_id.to_le_bytes());
            hasher.update(&acceptor.link_id.to_le_bytes());
            hasher.update(label);
            *hasher.finalize().as_bytes()
        })
    }
}

/// The root of a session's later link keys ([`LinkSecret::reopen_root`]):
/// each epoch's keys and link ids follow from it, none of the handshake's
/// (epoch 0) is used again.
pub struct ReopenRoot {
    root: [u8; 32],
    role: HandshakeRole,
    local_link_id: u64,
    remote_link_id: u64,
}

impl std::fmt::Debug for ReopenRoot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReopenRoot")
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

impl ReopenRoot {
    /// The keys, and link ids, of the link on `scheme` opened again in
    /// `epoch`: frames its earlier links left in flight name ids the
    /// endpoint no longer knows, and are dropped as such.
    pub fn keys(&self, scheme: &str, epoch: u32) -> LinkKeys {
        let key = |context: &str| {
            let mut hasher = blake3::Hasher::new_derive_key(context);
            hasher.update(&self.root);
            hasher.update(&epoch.to_le_bytes());
            hasher.update(scheme.as_bytes());
            *hasher.finalize().as_bytes()
        };
        let to_acceptor = key("efabus 2026-12 reopened link key, dialer to acceptor");
        let to_dialer = key("efabus 2026-12 reopened link key, acceptor to dialer");
        let (send_key, receive_key) = match self.role {
            HandshakeRole::Dialer => (to_acceptor, to_dialer),
            HandshakeRole::Acceptor => (to_dialer, to_acceptor),
        };
        let id = |link_id: u64| {
            let mut hasher = blake3::Hasher::new_derive_key("efabus 2026-12 reopened link id");
            hasher.update(&link_id.to_le_bytes());
            hasher.update(&epoch.to_le_bytes());
            let mut first = [0u8; 8];
            first.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
            u64::from_le_bytes(first).max(1)
        };
        LinkKeys {
            send_key,
            receive_key,
            local_id: id(self.local_link_id),
            remote_id: id(self.remote_link_id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_agree_and_directions_differ() {
        let dialer = LinkSecret::new().unwrap();
        let acceptor = LinkSecret::new().unwrap();
        let d = dialer
            .keys(HandshakeRole::Dialer, acceptor.auth(), "efa-rdm")
            .unwrap();
        let a = acceptor
            .keys(HandshakeRole::Acceptor, dialer.auth(), "efa-rdm")
            .unwrap();
        assert_eq!(d.send_key, a.receive_key);
        assert_eq!(d.receive_key, a.send_key);
        assert_ne!(d.send_key, d.receive_key);
        assert_eq!((d.local_id, d.remote_id), (a.remote_id, a.local_id));
        // Another link of the same handshake has other keys.
        let dgram = dialer
            .keys(HandshakeRole::Dialer, acceptor.auth(), "efa-dgram")
            .unwrap();
        assert_ne!(dgram.send_key, d.send_key);
        // A third party with its own secret agrees nothing with either.
        let other = LinkSecret::new().unwrap();
        let o = other
            .keys(HandshakeRole::Acceptor, dialer.auth(), "efa-rdm")
            .unwrap();
        assert_ne!(o.receive_key, d.send_key);
    }

    #[test]
    fn reopened_links_agree_on_keys_of_their_own() {
        let dialer = LinkSecret::new().unwrap();
        let acceptor = LinkSecret::new().unwrap();
        let d = dialer
            .reopen_root(HandshakeRole::Dialer, acceptor.auth())
            .unwrap();
        let a = acceptor
            .reopen_root(HandshakeRole::Acceptor, dialer.auth())
            .unwrap();
        let first = dialer
            .keys(HandshakeRole::Dialer, acceptor.auth(), "efa-dgram")
            .unwrap();
        let (d1, a1) = (d.keys("efa-dgram", 1), a.keys("efa-dgram", 1));
        assert_eq!((d1.send_key, d1.receive_key), (a1.receive_key, a1.send_key));
        assert_eq!((d1.local_id, d1.remote_id), (a1.remote_id, a1.local_id));
        assert_ne!(d1.send_key, d1.receive_key);
        let d2 = d.keys("efa-dgram", 2);
        for (earlier, what) in [(&first, "the handshake's"), (&d1, "epoch 1's")] {
            assert_ne!(d2.send_key, earlier.send_key, "{what} key used again");
            assert_ne!(d2.receive_key, earlier.receive_key, "{what} key used again");
            assert_ne!(d2.local_id, earlier.local_id, "{what} link id used again");
            assert_ne!(d2.remote_id, earlier.remote_id, "{what} link id used again");
        }
        assert_ne!(d.keys("efa-rdm", 1).send_key, d1.send_key);
        // Another session's root gives other keys for the same epoch.
        let other = LinkSecret::new()
            .unwrap()
            .reopen_root(HandshakeRole::Acceptor, dialer.auth())
            .unwrap();
        assert_ne!(other.keys("efa-dgram", 1).receive_key, d1.send_key);
        assert!(!format!("{d:?}").contains(&format!("{:?}", d.root)));
    }

    #[test]
    fn a_low_order_share_is_refused() {
        let dialer = LinkSecret::new().unwrap();
        let zero = LinkAuth {
            key_share: [0; 32],
            link_id: 1,
        };
        assert!(matches!(
            dialer.keys(HandshakeRole::Dialer, &zero, "efa-rdm"),
            Err(LinkAuthError::WeakShare)
        ));
    }

    #[test]
    fn keys_stay_out_of_debug_output() {
        let secret = LinkSecret::new().unwrap();
        let keys = secret
            .keys(
                HandshakeRole::Dialer,
                LinkSecret::new().unwrap().auth(),
                "x",
            )
            .unwrap();
        let shown = format!("{keys:?} {secret:?}");
        assert!(!shown.contains(&format!("{:?}", keys.send_key)), "{shown}");
    }
}
