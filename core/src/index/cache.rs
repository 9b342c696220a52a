//! The literal-subject cache of the subscription index.
//!
//! Maps a subject that was matched before to the trie's answer for it: the
//! plain subscribers and the queue groups (by id, so that the member pick
//! still happens per message). Lookups take `&self`, so the cache is split in
//! shards behind their own mutex; many readers of the index then rarely meet
//! on the same lock. A hit copies the result out while holding the lock,
//! which is cheaper than sharing it through reference counts. Changes to the
//! index hold `&mut` and reach the shards without locking.
//!
//! Memory is bounded: each shard holds at most a fixed number of entries and
//! evicts a quarter of them (in hash order, which is keyed and so effectively
//! random) when full; results with very large fan-out are not cached at all,
//! nor are reply inboxes (`_INBOX.`), which are each matched once or twice.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::hash::FoldState;
use super::{GroupId, SubRef};
use crate::subject::{is_literal, pattern_matches};

/// Results with more entries than this are not cached: their matching cost is
/// dominated by copying them out anyway, and they would dominate memory (at
/// 16 bytes an entry, a full cache of the default 4,096 subjects holds at
/// most 16 MiB).
pub(super) const MAX_CACHED_RESULT: usize = 256;

/// Upper bound on the number of shards.
const MAX_SHARDS: usize = 16;
/// Shards are only split off once each can hold at least this many entries.
const MIN_SHARD_CAPACITY: usize = 64;
/// Above this many wildcard patterns in one batch change, the whole cache is
/// dropped instead of scanned once per pattern.
const SCAN_LIMIT: usize = 16;

/// The trie's answer for one subject.
#[derive(Debug)]
struct Entry {
    subject: Box<str>,
    plain: Box<[SubRef]>,
    groups: Box<[GroupId]>,
}

/// The key is already a keyed hash of the subject, so the maps use it as is.
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
    hasher: FoldState,
}

fn relock<T>(guard: Result<T, PoisonError<T>>) -> T {
    // Nothing panics while a shard is held, and a shard is consistent after
    // every single map operation, so a poisoned lock is still usable.
    guard.unwrap_or_else(PoisonError::into_inner)
}

impl Cache {
    /// A cache holding at most about `capacity` subjects; 0 disables it.
    pub(super) fn new(capacity: usize, hasher: FoldState) -> Self {
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
            hasher,
        }
    }

    pub(super) fn enabled(&self) -> bool {
        !self.shards.is_empty()
    }

    #[inline]
    pub(super) fn hash(&self, subject: &str) -> u64 {
        self.hasher.hash_one(subject.as_bytes())
    }

    fn shard_of(&self, hash: u64) -> usize {
        // The maps use the low bits for buckets and the top 7 as tags; take
        // the shard from bits in between.
        ((hash >> 32) as usize) & (self.shards.len() - 1)
    }

    fn lock(&self, hash: u64) -> MutexGuard<'_, ShardMap> {
        relock(self.shards[self.shard_of(hash)].lock())
    }

    /// On a hit, hands the cached plain subscribers and groups to `emit`
    /// (under the shard's lock, so it must be short) and returns true.
    #[inline]
    pub(super) fn with<F: FnOnce(&[SubRef], &[GroupId])>(
        &self,
        hash: u64,
        subject: &str,
        emit: F,
    ) -> bool {
        if !self.enabled() {
            return false;
        }
        let shard = self.lock(hash);
        match shard.get(&hash) {
            Some(entry) if *entry.subject == *subject => {
                emit(&entry.plain, &entry.groups);
                true
            }
            _ => false,
        }
    }

    pub(super) fn insert(&self, hash: u64, subject: &str, plain: &[SubRef], groups: &[GroupId]) {
        if !self.enabled() || plain.len() + groups.len() > MAX_CACHED_RESULT {
            return;
        }
        let cap = self.shard_capacity;
        let entry = Entry {
            subject: subject.into(),
            plain: plain.into(),
            groups: groups.into(),
        };
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
        shard.insert(hash, entry);
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
            let (prefix, suffix) = literal_ends(pattern);
            let hit = |subject: &str| {
                subject.starts_with(prefix)
                    && subject.ends_with(suffix)
                    && pattern_matches(pattern, subject)
            };
            for shard in self.shards.iter_mut() {
                let shard = relock(shard.get_mut());
                if !shard.is_empty() {
                    shard.retain(|_, e| !hit(&e.subject));
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

/// The literal text a subject matching the wildcard `pattern` must start
/// and end with: the tokens before the first wildcard (with their dots) and
/// those after the last one, unless it is `>`. A cheap filter before the
/// reference matcher when scanning the cache.
fn literal_ends(pattern: &str) -> (&str, &str) {
    let mut first = None;
    let mut last_end = 0;
    let mut offset = 0;
    for token in pattern.split('.') {
        let end = offset + token.len();
        if token == "*" || token == ">" {
            first.get_or_insert(offset);
            last_end = end;
        }
        offset = end + 1;
    }
    let prefix = first.and_then(|f| pattern.get(..f)).unwrap_or("");
    let suffix = if pattern.ends_with('>') && last_end == pattern.len() {
        ""
    } else {
        pattern.get(last_end..).unwrap_or("")
    };
    (prefix, suffix)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn insert(c: &Cache, s: &str, n: u64) {
        c.insert(c.hash(s), s, &[SubRef::new(n, n)], &[]);
    }

    fn get(c: &Cache, s: &str) -> Option<u64> {
        let mut got = None;
        c.with(c.hash(s), s, |plain, _| got = Some(plain[0].sid));
        got
    }

    #[test]
    fn disabled_cache_stores_nothing() {
        let c = Cache::new(0, FoldState);
        insert(&c, "a", 1);
        assert_eq!(get(&c, "a"), None);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn size_stays_bounded() {
        let c = Cache::new(100, FoldState);
        for i in 0..1000 {
            insert(&c, &format!("s.{i}"), i);
        }
        assert!(c.len() <= 100, "len {}", c.len());
        assert!(c.len() > 0);
        // The last insert is always kept.
        assert_eq!(get(&c, "s.999"), Some(999));
    }

    #[test]
    fn shard_count_and_capacity() {
        let c = Cache::new(4096, FoldState);
        assert_eq!(c.shards.len(), 16);
        assert_eq!(c.shard_capacity, 256);
        let c = Cache::new(10, FoldState);
        assert_eq!(c.shards.len(), 1);
        assert_eq!(c.shard_capacity, 10);
    }

    #[test]
    fn oversized_results_are_skipped() {
        let c = Cache::new(10, FoldState);
        let big = vec![SubRef::new(0, 0); MAX_CACHED_RESULT + 1];
        c.insert(c.hash("a"), "a", &big, &[]);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn literal_ends_of_patterns() {
        assert_eq!(literal_ends("*"), ("", ""));
        assert_eq!(literal_ends(">"), ("", ""));
        assert_eq!(literal_ends("a.*"), ("a.", ""));
        assert_eq!(literal_ends("a.b.>"), ("a.b.", ""));
        assert_eq!(literal_ends("*.b"), ("", ".b"));
        assert_eq!(literal_ends("a.*.c.*.e"), ("a.", ".e"));
        assert_eq!(literal_ends("metrics.*.cpu1"), ("metrics.", ".cpu1"));
        assert_eq!(literal_ends("a>.*.b>"), ("a>.", ".b>"));
    }

    #[test]
    fn invalidation_is_precise() {
        let mut c = Cache::new(1024, FoldState);
        for s in ["a.b", "a.c", "x.y", "a.b.c"] {
            insert(&c, s, 0);
        }
        c.invalidate("a.*");
        assert_eq!(get(&c, "a.b"), None);
        assert_eq!(get(&c, "a.c"), None);
        assert_eq!(get(&c, "x.y"), Some(0));
        assert_eq!(get(&c, "a.b.c"), Some(0));
        c.invalidate("x.y");
        assert_eq!(get(&c, "x.y"), None);
        assert_eq!(get(&c, "a.b.c"), Some(0));
        c.invalidate_many(["q", "a.>"].into_iter());
        assert_eq!(c.len(), 0);
    }
}
