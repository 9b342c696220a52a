//! The literal-subject cache of the subscription index.
//!
//! Maps a subject that was matched before to the trie's answer for it: the
//! plain subscribers and the queue groups (by id, so that the member pick
//! still happens per message). Lookups take `&self`, so the cache is split in
//! shards behind their own mutex; many readers of the index then rarely meet
//! on the same lock. Changes to the index hold `&mut` and reach the shards
//! without locking.
//!
//! Memory is bounded: each shard holds at most a fixed number of entries and
//! evicts a quarter of them (in hash order, which is keyed and so effectively
//! random) when full; results with very large fan-out are not cached at all.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::{GroupId, SubRef};
use crate::subject::{is_literal, pattern_matches};

/// Results with more entries than this are not cached: their matching cost is
/// dominated by copying them out anyway, and they would dominate memory.
pub(super) const MAX_CACHED_RESULT: usize = 1024;

/// Upper bound on the number of shards.
const MAX_SHARDS: usize = 16;
/// Shards are only split off once each can hold at least this many entries.
const MIN_SHARD_CAPACITY: usize = 64;
/// Above this many wildcard patterns in one batch change, the whole cache is
/// dropped instead of scanned once per pattern.
const SCAN_LIMIT: usize = 16;

/// The trie's answer for one subject.
#[derive(Debug, Default)]
pub(super) struct Cached {
    pub(super) plain: Box<[SubRef]>,
    pub(super) groups: Box<[GroupId]>,
}

#[derive(Debug)]
struct Entry {
    subject: Box<str>,
    result: Arc<Cached>,
}

/// The key is already a keyed SipHash of the subject, so the maps use it as is.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `u64` keys; this keeps the trait total.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type ShardMap = HashMap<u64, Entry, BuildHasherDefault<PassThrough>>;

#[derive(Debug)]
pub(super) struct Cache {
    shards: Box<[Mutex<ShardMap>]>,
    shard_capacity: usize,
    hasher: RandomState,
}

fn relock<T>(guard: Result<T, PoisonError<T>>) -> T {
    // Nothing panics while a shard is held, and a shard is consistent after
    // every single map operation, so a poisoned lock is still usable.
    guard.unwrap_or_else(PoisonError::into_inner)
}

impl Cache {
    /// A cache holding at most about `capacity` subjects; 0 disables it.
    pub(super) fn new(capacity: usize) -> Self {
        let mut shards = 1;
        while shards < MAX_SHARDS && capacity / (shards * 2) >= MIN_SHARD_CAPACITY {
            shards *= 2;
        }
        let count = if capacity == 0 { 0 } else { shards };
        Self {
            shards: (0..count)
                .map(|_| Mutex::new(ShardMap::default()))
                .collect(),
            shard_capacity: capacity.div_ceil(shards),
            hasher: RandomState::new(),
        }
    }

    pub(super) fn enabled(&self) -> bool {
        !self.shards.is_empty()
    }

    pub(super) fn hash(&self, subject: &str) -> u64 {
        self.hasher.hash_one(subject)
    }

    fn shard_of(&self, hash: u64) -> usize {
        // The maps use the low bits for buckets and the top 7 as tags; take
        // the shard from bits in between.
        ((hash >> 32) as usize) & (self.shards.len() - 1)
    }

    fn lock(&self, hash: u64) -> MutexGuard<'_, ShardMap> {
        relock(self.shards[self.shard_of(hash)].lock())
    }

    pub(super) fn get(&self, hash: u64, subject: &str) -> Option<Arc<Cached>> {
        if !self.enabled() {
            return None;
        }
        let shard = self.lock(hash);
        match shard.get(&hash) {
            Some(entry) if *entry.subject == *subject => Some(Arc::clone(&entry.result)),
            _ => None,
        }
    }

    pub(super) fn insert(&self, hash: u64, subject: &str, result: Arc<Cached>) {
        if !self.enabled() {
            return;
        }
        let cap = self.shard_capacity;
        let mut shard = self.lock(hash);
        if shard.len() >= cap && !shard.contains_key(&hash) {
            let mut evict = (cap / 4).max(1);
            shard.retain(|_, _| {
                if evict > 0 {
                    evict -= 1;
                    false
                } else {
                    true
                }
            });
        }
        // A different subject with the same 64-bit keyed hash is replaced.
        shard.insert(
            hash,
            Entry {
                subject: subject.into(),
                result,
            },
        );
    }

    /// Drops every entry `pattern` matches (the entries a change on that
    /// pattern can alter).
    pub(super) fn invalidate(&mut self, pattern: &str) {
        if !self.enabled() {
            return;
        }
        if is_literal(pattern) {
            let hash = self.hash(pattern);
            let index = self.shard_of(hash);
            relock(self.shards[index].get_mut()).remove(&hash);
        } else {
            for shard in self.shards.iter_mut() {
                let shard = relock(shard.get_mut());
                if !shard.is_empty() {
                    shard.retain(|_, e| !pattern_matches(pattern, &e.subject));
                }
            }
        }
    }

    /// Invalidation for a batch of changed patterns.
    pub(super) fn invalidate_many<'a>(&mut self, patterns: impl Iterator<Item = &'a str> + Clone) {
        if patterns.clone().filter(|p| !is_literal(p)).count() > SCAN_LIMIT {
            self.clear();
        } else {
            for pattern in patterns {
                self.invalidate(pattern);
            }
        }
    }

    pub(super) fn clear(&mut self) {
        for shard in self.shards.iter_mut() {
            relock(shard.get_mut()).clear();
        }
    }

    pub(super) fn len(&self) -> usize {
        self.shards.iter().map(|s| relock(s.lock()).len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(n: u64) -> Arc<Cached> {
        Arc::new(Cached {
            plain: vec![SubRef { owner: n, sid: n }].into(),
            groups: Box::new([]),
        })
    }

    #[test]
    fn disabled_cache_stores_nothing() {
        let c = Cache::new(0);
        let h = c.hash("a");
        c.insert(h, "a", result(1));
        assert!(c.get(h, "a").is_none());
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn size_stays_bounded() {
        let c = Cache::new(100);
        for i in 0..1000 {
            let s = format!("s.{i}");
            c.insert(c.hash(&s), &s, result(i));
        }
        assert!(c.len() <= 100, "len {}", c.len());
        assert!(c.len() > 0);
        // The last insert is always kept.
        let s = "s.999";
        assert_eq!(c.get(c.hash(s), s).map(|r| r.plain[0].sid), Some(999));
    }

    #[test]
    fn shard_count_and_capacity() {
        let c = Cache::new(4096);
        assert_eq!(c.shards.len(), 16);
        assert_eq!(c.shard_capacity, 256);
        let c = Cache::new(10);
        assert_eq!(c.shards.len(), 1);
        assert_eq!(c.shard_capacity, 10);
    }

    #[test]
    fn invalidation_is_precise() {
        let mut c = Cache::new(1024);
        for s in ["a.b", "a.c", "x.y", "a.b.c"] {
            c.insert(c.hash(s), s, result(0));
        }
        c.invalidate("a.*");
        assert!(c.get(c.hash("a.b"), "a.b").is_none());
        assert!(c.get(c.hash("a.c"), "a.c").is_none());
        assert!(c.get(c.hash("x.y"), "x.y").is_some());
        assert!(c.get(c.hash("a.b.c"), "a.b.c").is_some());
        c.invalidate("x.y");
        assert!(c.get(c.hash("x.y"), "x.y").is_none());
        assert!(c.get(c.hash("a.b.c"), "a.b.c").is_some());
        c.invalidate_many(["q", "a.>"].into_iter());
        assert_eq!(c.len(), 0);
    }
}
