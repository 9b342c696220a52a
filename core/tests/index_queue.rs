//! Queue groups, rotation fairness and the public edges of the index API.

use std::collections::{BTreeMap, BTreeSet};

use efabus_core::index::{IndexConfig, IndexError, SubInfo, SubRef, SubscriptionIndex};
use efabus_core::subject::{QueueNameError, SubjectError};
use proptest::prelude::*;

fn k(owner: u64, sid: u64) -> SubRef {
    SubRef::new(owner, sid)
}

fn counts(
    idx: &SubscriptionIndex,
    subject: &str,
    n: usize,
    cached: bool,
) -> BTreeMap<SubRef, usize> {
    let mut out = Vec::new();
    let mut counts = BTreeMap::new();
    for _ in 0..n {
        if cached {
            idx.match_subject(subject, &mut out).unwrap();
        } else {
            idx.match_uncached(subject, &mut out).unwrap();
        }
        for &r in &out {
            *counts.entry(r).or_insert(0) += 1;
        }
    }
    counts
}

fn assert_fair(counts: &BTreeMap<SubRef, usize>, members: &[SubRef], n: usize) {
    let got: Vec<usize> = members
        .iter()
        .map(|m| counts.get(m).copied().unwrap_or(0))
        .collect();
    assert_eq!(
        got.iter().sum::<usize>(),
        n,
        "one member per message: {got:?}"
    );
    let (lo, hi) = (got.iter().min().unwrap(), got.iter().max().unwrap());
    assert!(hi - lo <= 1, "unfair rotation: {got:?}");
}

#[test]
fn groups_are_per_pattern_and_name() {
    let mut idx = SubscriptionIndex::default();
    // Same name on two patterns: two groups. Two names on one pattern: two groups.
    let a = [k(1, 1), k(2, 1), k(3, 1)];
    let b = [k(1, 2), k(2, 2)];
    let c = [k(1, 3), k(4, 3)];
    for &m in &a {
        idx.insert("work.*", Some("q"), m).unwrap();
    }
    for &m in &b {
        idx.insert("work.>", Some("q"), m).unwrap();
    }
    for &m in &c {
        idx.insert("work.*", Some("other"), m).unwrap();
    }
    let plain = k(9, 9);
    idx.insert("work.job", None, plain).unwrap();

    for cached in [true, false] {
        let n = 61;
        let counts = counts(&idx, "work.job", n, cached);
        assert_eq!(counts.get(&plain), Some(&n));
        assert_fair(&counts, &a, n);
        assert_fair(&counts, &b, n);
        assert_fair(&counts, &c, n);
        assert_eq!(counts.len(), 1 + a.len() + b.len() + c.len());
    }

    // Only the `>` group matches a deeper subject.
    let counts = counts(&idx, "work.job.x", 10, true);
    assert_fair(&counts, &b, 10);
    assert_eq!(counts.len(), b.len());
}

#[test]
fn rotation_follows_membership_changes() {
    let mut idx = SubscriptionIndex::default();
    for sid in 0..4 {
        idx.insert("s", Some("q"), k(0, sid)).unwrap();
    }
    let mut out = Vec::new();
    idx.match_subject("s", &mut out).unwrap(); // cached now
    assert!(idx.remove(k(0, 1)));
    let members = [k(0, 0), k(0, 2), k(0, 3)];
    let c = counts(&idx, "s", 30, true);
    assert_fair(&c, &members, 30);
    assert!(!c.contains_key(&k(0, 1)));
    // Removing the last members drops the group: nothing matches.
    for m in members {
        assert!(idx.remove(m));
    }
    idx.match_subject("s", &mut out).unwrap();
    assert!(out.is_empty());
    // A new member after the group vanished forms a fresh group.
    idx.insert("s", Some("q"), k(5, 5)).unwrap();
    idx.match_subject("s", &mut out).unwrap();
    assert_eq!(out, [k(5, 5)]);
}

#[test]
fn concurrent_matching_shares_the_rotation() {
    let mut idx = SubscriptionIndex::default();
    let members: Vec<SubRef> = (0..5).map(|i| k(i, 0)).collect();
    for &m in &members {
        idx.insert("jobs.*", Some("workers"), m).unwrap();
    }
    let threads = 4;
    let per_thread = 500;
    let idx = &idx;
    let total: BTreeMap<SubRef, usize> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| s.spawn(move || counts(idx, &format!("jobs.{}", t % 2), per_thread, true)))
            .collect();
        let mut total = BTreeMap::new();
        for h in handles {
            for (r, c) in h.join().unwrap() {
                *total.entry(r).or_insert(0) += c;
            }
        }
        total
    });
    // Every turn of the shared cursor went to exactly one member.
    assert_fair(&total, &members, threads * per_thread);
}

#[test]
fn index_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<SubscriptionIndex>();
}

#[test]
fn insert_errors() {
    let mut idx = SubscriptionIndex::default();
    assert_eq!(
        idx.insert("a..b", None, k(1, 1)),
        Err(IndexError::Pattern(SubjectError::EmptyToken { index: 1 }))
    );
    assert_eq!(
        idx.insert("a.>.b", None, k(1, 1)),
        Err(IndexError::Pattern(SubjectError::FullWildcardNotLast {
            index: 1
        }))
    );
    assert_eq!(
        idx.insert("a", Some(""), k(1, 1)),
        Err(IndexError::QueueName(QueueNameError::Empty))
    );
    assert_eq!(
        idx.insert("a", Some("x y"), k(1, 1)),
        Err(IndexError::QueueName(QueueNameError::Whitespace {
            offset: 1,
            ch: ' '
        }))
    );
    assert!(idx.is_empty());
    idx.insert("a", None, k(1, 1)).unwrap();
    assert_eq!(
        idx.insert("b", Some("q"), k(1, 1)),
        Err(IndexError::DuplicateKey(k(1, 1)))
    );
    assert_eq!(idx.len(), 1);
    // The failed duplicate left the first subscription untouched.
    assert_eq!(
        idx.get(k(1, 1)),
        Some(SubInfo {
            key: k(1, 1),
            pattern: "a",
            queue: None
        })
    );
}

#[test]
fn limits_apply_to_patterns_and_subjects() {
    let cfg = IndexConfig {
        limits: efabus_core::subject::SubjectLimits {
            max_len: 16,
            max_tokens: 3,
        },
        ..IndexConfig::default()
    };
    let mut idx = SubscriptionIndex::new(cfg);
    assert_eq!(
        idx.insert("a.b.c.d", None, k(1, 1)),
        Err(IndexError::Pattern(SubjectError::TooDeep {
            tokens: 4,
            max: 3
        }))
    );
    idx.insert("a.>", None, k(1, 1)).unwrap();
    let mut out = Vec::new();
    assert_eq!(
        idx.match_subject("a.b.c.d", &mut out),
        Err(SubjectError::TooDeep { tokens: 4, max: 3 })
    );
    assert_eq!(
        idx.match_uncached("a.bbbbbbbbbbbbbbbbbbbb", &mut out),
        Err(SubjectError::TooLong { len: 22, max: 16 })
    );
    idx.match_subject("a.b.c", &mut out).unwrap();
    assert_eq!(out, [k(1, 1)]);
}

#[test]
fn remove_and_remove_owner() {
    let mut idx = SubscriptionIndex::default();
    for owner in 0..3 {
        for sid in 0..4 {
            let q = (sid % 2 == 0).then_some("q");
            idx.insert("x.*", q, k(owner, sid)).unwrap();
        }
    }
    assert_eq!(idx.len(), 12);
    assert!(!idx.remove(k(7, 7)));
    assert!(idx.remove(k(1, 3)));
    assert!(!idx.remove(k(1, 3)));
    let owned: Vec<u64> = idx.iter_owner(1).map(|i| i.key.sid).collect();
    assert_eq!(owned, [0, 1, 2]);
    assert_eq!(idx.remove_owner(1), 3);
    assert_eq!(idx.remove_owner(1), 0);
    assert_eq!(idx.len(), 8);
    assert!(idx.iter().all(|i| i.key.owner != 1));
    let mut out = Vec::new();
    idx.match_subject("x.y", &mut out).unwrap();
    let got: BTreeSet<SubRef> = out.iter().copied().collect();
    // Plain: sids 1, 3 of owners 0 and 2; one pick from the group.
    assert_eq!(got.len(), 5);
    for p in [k(0, 1), k(0, 3), k(2, 1), k(2, 3)] {
        assert!(got.contains(&p));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Over n messages each member of a stable group gets n / size, within one,
    /// whether the result comes from the cache or from the trie.
    #[test]
    fn rotation_is_fair(size in 1usize..9, n in 1usize..200, cached in any::<bool>(), wild in any::<bool>()) {
        let mut idx = SubscriptionIndex::default();
        let members: Vec<SubRef> = (0..size as u64).map(|i| k(i % 3, i)).collect();
        let pattern = if wild { "a.*.>" } else { "a.b.c" };
        for &m in &members {
            idx.insert(pattern, Some("g"), m).unwrap();
        }
        idx.insert("a.b.c", None, k(100, 0)).unwrap();
        let c = counts(&idx, "a.b.c", n, cached);
        let got: Vec<usize> = members.iter().map(|m| c.get(m).copied().unwrap_or(0)).collect();
        prop_assert_eq!(got.iter().sum::<usize>(), n);
        prop_assert!(got.iter().max().unwrap() - got.iter().min().unwrap() <= 1, "{:?}", got);
        prop_assert_eq!(c.get(&k(100, 0)), Some(&n));
    }
}
