//! A fast keyed hash for the index's tables, and compact token keys.
//!
//! Lookups hash short tokens and subjects on every match, where SipHash is a
//! large share of the cost. This hash folds 8-byte words through 64x64->128
//! bit multiplications with random per-process seeds: a few cycles per word,
//! and, being keyed, hard for a peer to aim collisions at without knowing
//! the seeds. It is not a cryptographic hash; nothing relies on that.

use std::borrow::Borrow;
use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::sync::OnceLock;

const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let full = u128::from(a) * u128::from(b);
    (full as u64) ^ ((full >> 64) as u64)
}

/// Builds [`FoldHasher`]s. The seeds are drawn once per process, so the
/// builder takes no space in the many per-node tables.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct FoldState;

#[derive(Debug, Clone, Copy)]
struct Seeds {
    seed: u64,
    key: u64,
}

static SEEDS: OnceLock<Seeds> = OnceLock::new();

fn seeds() -> Seeds {
    *SEEDS.get_or_init(|| {
        let rs = RandomState::new();
        Seeds {
            seed: rs.hash_one(1u64),
            // An odd multiplier keeps the multiplication invertible.
            key: rs.hash_one(2u64) | 1,
        }
    })
}

impl BuildHasher for FoldState {
    type Hasher = FoldHasher;

    #[inline]
    fn build_hasher(&self) -> FoldHasher {
        let Seeds { seed, key } = seeds();
        FoldHasher { acc: seed, key }
    }
}

pub(super) struct FoldHasher {
    acc: u64,
    key: u64,
}

impl FoldHasher {
    #[inline]
    fn word(&mut self, w: u64) {
        self.acc = fold(self.acc ^ w, self.key ^ MIX);
    }
}

impl Hasher for FoldHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.word(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            // The length byte keeps "a" and "a\0" apart.
            self.word(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }

    #[inline]
    fn write_u8(&mut self, n: u8) {
        self.word(u64::from(n) | 0x100);
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.word(n);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.word(n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        fold(self.acc, self.key.rotate_left(32) ^ MIX)
    }
}

/// Bytes kept inline in a [`TokenKey`]; longer tokens go to the heap.
const INLINE: usize = 22;

/// A token as stored in the trie: short tokens inline, so comparing one
/// during a lookup does not chase a pointer.
#[derive(Debug, Clone)]
pub(super) enum TokenKey {
    Inline { len: u8, buf: [u8; INLINE] },
    Heap(Box<[u8]>),
}

impl TokenKey {
    pub(super) fn new(token: &str) -> Self {
        let bytes = token.as_bytes();
        if bytes.len() <= INLINE {
            let mut buf = [0u8; INLINE];
            buf[..bytes.len()].copy_from_slice(bytes);
            TokenKey::Inline {
                len: bytes.len() as u8,
                buf,
            }
        } else {
            TokenKey::Heap(bytes.into())
        }
    }

    #[inline]
    pub(super) fn as_bytes(&self) -> &[u8] {
        match self {
            TokenKey::Inline { len, buf } => &buf[..usize::from(*len)],
            TokenKey::Heap(b) => b,
        }
    }
}

impl PartialEq for TokenKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for TokenKey {}

impl Hash for TokenKey {
    // Must hash exactly as `[u8]` does, for lookups through `Borrow<[u8]>`.
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl Borrow<[u8]> for TokenKey {
    fn borrow(&self) -> &[u8] {
        self.as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn keys_round_trip_and_compare_by_content() {
        for t in [
            "",
            "a",
            "cpu7",
            &"x".repeat(INLINE),
            &"y".repeat(INLINE + 1),
        ] {
            let k = TokenKey::new(t);
            assert_eq!(k.as_bytes(), t.as_bytes());
            assert_eq!(k, TokenKey::new(t));
            assert_eq!(FoldState.hash_one(&k), FoldState.hash_one(t.as_bytes()));
        }
        assert!(matches!(TokenKey::new("abc"), TokenKey::Inline { .. }));
        assert!(matches!(TokenKey::new(&"z".repeat(40)), TokenKey::Heap(_)));
        assert_ne!(TokenKey::new("ab"), TokenKey::new("abc"));
    }

    #[test]
    fn hash_separates_similar_inputs() {
        let s = FoldState;
        let mut seen = HashSet::new();
        let mut inputs = vec![String::new(), "\0".into(), "\0\0".into()];
        for i in 0..5000 {
            inputs.push(format!("host{i}"));
            inputs.push(format!("metrics.host{i}.cpu{}", i % 97));
        }
        for i in &inputs {
            assert!(seen.insert(s.hash_one(i.as_bytes())), "collision on {i:?}");
        }
        // Seeded: not the unseeded fold of the same input.
        let plain = FoldHasher { acc: 0, key: 1 };
        assert_ne!(s.hash_one(0u64), {
            let mut p = plain;
            p.write_u64(0);
            p.finish()
        });
    }
}
