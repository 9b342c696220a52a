//! Comparing secrets and authenticators without telling, by the time it
//! takes, where they differ; and proving a shared secret without sending
//! it.
//!
//! A proof is a BLAKE3 keyed hash, under a key derived from the secret,
//! of the side's role, the acceptor's challenge and the dialer's nonce:
//! fresh values from both sides, so a proof is never valid twice, and the
//! two sides' proofs differ. An eavesdropper learns no reusable secret;
//! it could still test guesses of a weak secret against what it saw, so
//! secrets should be long and random (or the connection on TLS).

/// Which side of a handshake a proof is from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProofRole {
    /// The side that sent the hello.
    Dialer,
    /// The side that sent the challenge and the welcome.
    Acceptor,
}

/// The proof that the `role` side holds `secret`, for this handshake's
/// `challenge` (the acceptor's) and `nonce` (the dialer's).
pub fn prove(secret: &str, role: ProofRole, challenge: &[u8; 32], nonce: &[u8; 32]) -> [u8; 32] {
    let key = blake3::derive_key("efabus 2026-12 shared secret proof", secret.as_bytes());
    let mut hasher = blake3::Hasher::new_keyed(&key);
    hasher.update(match role {
        ProofRole::Dialer => b"dialer",
        ProofRole::Acceptor => b"acceptor",
    });
    hasher.update(challenge);
    hasher.update(nonce);
    hasher.finalize().into()
}

/// Whether `a` and `b` are equal, every byte compared whatever differs
/// first (lengths included).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_the_secret_the_role_and_both_values() {
        let (challenge, nonce) = ([1u8; 32], [2u8; 32]);
        let proof = prove("s3cret", ProofRole::Dialer, &challenge, &nonce);
        assert_eq!(
            proof,
            prove("s3cret", ProofRole::Dialer, &challenge, &nonce)
        );
        for other in [
            prove("s3creT", ProofRole::Dialer, &challenge, &nonce),
            prove("s3cret", ProofRole::Acceptor, &challenge, &nonce),
            prove("s3cret", ProofRole::Dialer, &[3; 32], &nonce),
            prove("s3cret", ProofRole::Dialer, &challenge, &[3; 32]),
        ] {
            assert_ne!(proof, other);
        }
    }

    #[test]
    fn constant_time_eq_compares_contents_and_lengths() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }
}
