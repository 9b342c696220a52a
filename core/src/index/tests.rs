//! White-box tests: internal invariants of the trie, groups and cache.
//! Behaviour against the reference matcher lives in `core/tests/index_*.rs`.

use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

impl SubscriptionIndex {
    /// Every stored position points back at its key, every list entry has an
    /// entry, every node and group in use is reachable and non-empty.
    fn check_invariants(&self) {
        let mut seen = BTreeSet::new();
        for (&key, e) in &self.subs {
            let term = self.node(e.node).term.as_ref().expect("terminal");
            let list = if e.tail { &term.tail } else { &term.exact };
            match e.group {
                None => assert_eq!(list.plain[e.pos], key),
                Some(gid) => {
                    assert!(list.groups.contains(&gid));
                    let g = self.groups[gid as usize].as_ref().expect("live group");
                    assert_eq!(g.members[e.pos], key);
                    assert_eq!(Some(&*g.name), e.queue.as_deref());
                }
            }
            assert!(seen.insert(key));
        }
        // Count what the trie holds, walking from the root.
        let mut reachable = 0;
        let mut held = 0;
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            reachable += 1;
            let n = self.node(id);
            if id != ROOT {
                assert!(!n.is_bare(), "bare node {id} left in the trie");
            }
            if let Some(term) = &n.term {
                assert!(
                    !term.exact.is_empty() || !term.tail.is_empty(),
                    "empty terminal"
                );
                for list in [&term.exact, &term.tail] {
                    held += list.plain.len();
                    for &gid in &list.groups {
                        let g = self.groups[gid as usize].as_ref().expect("live group");
                        assert!(!g.members.is_empty());
                        held += g.members.len();
                    }
                }
            }
            stack.extend(n.children.ids());
            stack.extend(n.star);
        }
        assert_eq!(held, self.subs.len());
        assert_eq!(reachable, self.node_count());
        let live_groups = self.groups.iter().filter(|g| g.is_some()).count();
        assert_eq!(live_groups + self.free_groups.len(), self.groups.len());
    }
}

fn key(owner: u64, sid: u64) -> SubRef {
    SubRef::new(owner, sid)
}

fn matched(index: &SubscriptionIndex, subject: &str) -> BTreeSet<SubRef> {
    let mut out = Vec::new();
    index
        .match_subject(subject, &mut out)
        .expect("valid subject");
    let set: BTreeSet<_> = out.iter().copied().collect();
    assert_eq!(set.len(), out.len(), "duplicate receivers for {subject}");
    set
}

#[test]
fn removing_everything_prunes_the_trie() {
    let mut idx = SubscriptionIndex::default();
    let patterns = ["a.b.c", "a.*.c", "a.>", ">", "*", "a.b.*.d.>", "x.y", "a.b"];
    let mut sid = 0;
    for p in patterns {
        for q in [None, Some("q"), Some("r")] {
            sid += 1;
            idx.insert(p, q, key(sid % 3, sid)).unwrap();
        }
    }
    idx.check_invariants();
    assert!(idx.node_count() > 1);
    let mut n = idx.len();
    for sid in (1..=sid).rev() {
        assert!(idx.remove(key(sid % 3, sid)));
        n -= 1;
        assert_eq!(idx.len(), n);
        idx.check_invariants();
    }
    assert_eq!(idx.node_count(), 1);
    assert!(idx.node(ROOT).is_bare());
    assert!(idx.groups.iter().all(Option::is_none));
}

#[test]
fn freed_nodes_and_groups_are_reused() {
    let mut idx = SubscriptionIndex::default();
    idx.insert("a.b.c", Some("q"), key(1, 1)).unwrap();
    let nodes = idx.nodes.len();
    let groups = idx.groups.len();
    assert!(idx.remove(key(1, 1)));
    idx.insert("x.y.z", Some("g"), key(1, 2)).unwrap();
    assert_eq!(idx.nodes.len(), nodes);
    assert_eq!(idx.groups.len(), groups);
    idx.check_invariants();
}

#[test]
fn cache_is_filled_and_invalidated() {
    let mut idx = SubscriptionIndex::default();
    idx.insert("a.b", None, key(1, 1)).unwrap();
    assert_eq!(matched(&idx, "a.b"), BTreeSet::from([key(1, 1)]));
    assert_eq!(matched(&idx, "a.c"), BTreeSet::new());
    assert_eq!(idx.cached_subjects(), 2);
    // A wildcard insert drops exactly the cached subjects it matches.
    idx.insert("a.*", None, key(1, 2)).unwrap();
    assert_eq!(idx.cached_subjects(), 0);
    assert_eq!(matched(&idx, "a.b"), BTreeSet::from([key(1, 1), key(1, 2)]));
    assert_eq!(matched(&idx, "z"), BTreeSet::new());
    assert_eq!(idx.cached_subjects(), 2);
    // A literal insert drops only its own subject.
    idx.insert("a.b", None, key(2, 1)).unwrap();
    assert_eq!(idx.cached_subjects(), 1);
    assert_eq!(
        matched(&idx, "a.b"),
        BTreeSet::from([key(1, 1), key(1, 2), key(2, 1)])
    );
    assert!(idx.remove(key(1, 2)));
    assert_eq!(matched(&idx, "a.b"), BTreeSet::from([key(1, 1), key(2, 1)]));
    assert_eq!(idx.remove_owner(2), 1);
    assert_eq!(matched(&idx, "a.b"), BTreeSet::from([key(1, 1)]));
    assert_eq!(matched(&idx, "z"), BTreeSet::new());
}

/// An index whose match cache holds `capacity` subjects (0: none).
fn index_with_cache(capacity: usize) -> SubscriptionIndex {
    SubscriptionIndex::new(IndexConfig {
        cache_capacity: capacity,
        ..IndexConfig::default()
    })
}

#[test]
fn stability_reports_whether_a_queue_group_matched() {
    for capacity in [0, IndexConfig::DEFAULT_CACHE_CAPACITY] {
        let mut idx = index_with_cache(capacity);
        idx.insert("a.b", None, key(1, 1)).unwrap();
        idx.insert("a.*", Some("q"), key(1, 2)).unwrap();
        idx.insert("a.*", Some("q"), key(1, 3)).unwrap();
        let mut out = Vec::new();
        // Twice each: once filling the cache, once from it.
        for _ in 0..2 {
            assert_eq!(idx.match_subject_stable("x.y", &mut out), Ok(true));
            assert!(out.is_empty());
            assert_eq!(idx.match_subject_stable("a.c", &mut out), Ok(false));
            assert_eq!(out.len(), 1);
            assert_eq!(idx.match_subject_stable("a.b", &mut out), Ok(false));
            assert_eq!(out.len(), 2);
        }
        assert!(idx.remove(key(1, 2)));
        assert!(idx.remove(key(1, 3)));
        for _ in 0..2 {
            assert_eq!(idx.match_subject_stable("a.b", &mut out), Ok(true));
            assert_eq!(out, [key(1, 1)]);
        }
        assert!(idx.match_subject_stable("a.*", &mut out).is_err());
    }
}

/// A message for one group (or for the plain subscriptions) moves no
/// other group's rotation: two groups on one subject, and plain matches
/// between, each member of each group takes every other pick.
#[test]
fn a_match_for_one_group_leaves_the_others_rotations_alone() {
    for capacity in [0, IndexConfig::DEFAULT_CACHE_CAPACITY] {
        let mut idx = index_with_cache(capacity);
        idx.insert(">", None, key(1, 1)).unwrap();
        idx.insert("work", Some("q1"), key(2, 1)).unwrap();
        idx.insert("work", Some("q1"), key(3, 1)).unwrap();
        idx.insert("work.*", Some("q1"), key(4, 1)).unwrap();
        idx.insert("work", Some("q2"), key(5, 1)).unwrap();
        idx.insert("work", Some("q2"), key(6, 1)).unwrap();
        let mut out = Vec::new();
        let mut picked = BTreeMap::<SubRef, usize>::new();
        for _ in 0..10 {
            idx.match_plain("work", &mut out).unwrap();
            assert_eq!(out, [key(1, 1)]);
            for queue in ["q1", "q2"] {
                idx.pick_from_group("work", "work", queue, &mut out)
                    .unwrap();
                assert_eq!(out.len(), 1, "{queue}: {out:?}");
                *picked.entry(out[0]).or_default() += 1;
            }
        }
        let expected = [
            (key(2, 1), 5),
            (key(3, 1), 5),
            (key(5, 1), 5),
            (key(6, 1), 5),
        ];
        assert_eq!(picked, BTreeMap::from(expected));
        // A group of another pattern, or a subject its pattern does not
        // match, gives none.
        idx.pick_from_group("work", "work.*", "q1", &mut out)
            .unwrap();
        assert!(out.is_empty());
        idx.pick_from_group("rest", "work", "q1", &mut out).unwrap();
        assert!(out.is_empty());
        assert!(idx
            .pick_from_group("work.*", "work", "q1", &mut out)
            .is_err());
    }
}

/// The deepest subjects a broker may allow (8,192 one-byte tokens in the
/// largest `limits.max_subject_len`, 16 KiB, `max_subject_tokens` raised
/// to match) match on a thread of the default stack size: the walk
/// recurses a level per token, and wildcards at every level make it take
/// every branch.
#[test]
fn the_deepest_subjects_allowed_match_on_a_default_stack() {
    let tokens = 8192;
    let handle = std::thread::spawn(move || {
        let mut idx = SubscriptionIndex::new(IndexConfig {
            limits: SubjectLimits {
                max_len: 16 << 10,
                max_tokens: tokens,
            },
            ..IndexConfig::default()
        });
        let pattern = vec!["*"; tokens].join(".");
        let subject = vec!["t"; tokens].join(".");
        idx.insert(&pattern, None, key(1, 1)).unwrap();
        idx.insert(&subject, None, key(1, 2)).unwrap();
        idx.insert(">", None, key(1, 3)).unwrap();
        let mut out = Vec::new();
        idx.match_subject(&subject, &mut out).unwrap();
        out.len()
    });
    assert_eq!(handle.join().unwrap(), 3);
}

#[test]
fn reply_inboxes_are_matched_but_not_cached() {
    let mut idx = SubscriptionIndex::default();
    idx.insert("_INBOX.a1.*", None, key(1, 1)).unwrap();
    idx.insert("_INBOX.>", None, key(1, 2)).unwrap();
    for token in 0..10 {
        assert_eq!(
            matched(&idx, &format!("_INBOX.a1.{token}")),
            BTreeSet::from([key(1, 1), key(1, 2)])
        );
    }
    assert_eq!(idx.cached_subjects(), 0);
    // A subject that only looks alike is cached as any other.
    assert_eq!(matched(&idx, "_INBOXES.a1"), BTreeSet::new());
    assert_eq!(idx.cached_subjects(), 1);
}

#[test]
fn invalid_subjects_are_not_cached() {
    let idx = SubscriptionIndex::default();
    let mut out = vec![key(9, 9)];
    assert_eq!(
        idx.match_subject("a.*", &mut out),
        Err(SubjectError::WildcardInSubject { index: 1 })
    );
    assert!(out.is_empty());
    assert_eq!(idx.cached_subjects(), 0);
}

#[test]
fn huge_results_bypass_the_cache() {
    let mut idx = SubscriptionIndex::default();
    for sid in 0..(cache::MAX_CACHED_RESULT as u64 + 1) {
        idx.insert("big.>", None, key(0, sid)).unwrap();
    }
    assert_eq!(matched(&idx, "big.x").len(), cache::MAX_CACHED_RESULT + 1);
    assert_eq!(idx.cached_subjects(), 0);
    assert!(idx.remove(key(0, 0)));
    assert_eq!(matched(&idx, "big.x").len(), cache::MAX_CACHED_RESULT);
    assert_eq!(idx.cached_subjects(), 1);
}

#[test]
fn clear_empties_the_index() {
    let mut idx = SubscriptionIndex::default();
    idx.insert("a.>", Some("q"), key(1, 1)).unwrap();
    assert_eq!(matched(&idx, "a.b").len(), 1);
    idx.clear();
    assert!(idx.is_empty());
    assert_eq!(idx.node_count(), 1);
    assert_eq!(idx.cached_subjects(), 0);
    assert!(matched(&idx, "a.b").is_empty());
}

#[derive(Debug, Clone)]
enum Op {
    Insert(String, Option<&'static str>, SubRef),
    Remove(SubRef),
    RemoveOwner(u64),
    Match(String),
}

fn token() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("a"), Just("b"), Just("*")]
}

fn pattern() -> impl Strategy<Value = String> {
    (prop::collection::vec(token(), 0..4), any::<bool>()).prop_filter_map(
        "non-empty pattern",
        |(mut toks, full)| {
            if full {
                toks.push(">");
            }
            (!toks.is_empty()).then(|| toks.join("."))
        },
    )
}

fn op() -> impl Strategy<Value = Op> {
    let k = (0u64..3, 0u64..6).prop_map(|(o, s)| key(o, s));
    prop_oneof![
        4 => (pattern(), prop::option::of(prop_oneof![Just("q"), Just("r")]), k.clone())
            .prop_map(|(p, q, k)| Op::Insert(p, q, k)),
        2 => k.prop_map(Op::Remove),
        1 => (0u64..3).prop_map(Op::RemoveOwner),
        2 => prop::collection::vec(prop_oneof![Just("a"), Just("b")], 1..4)
            .prop_map(|t| Op::Match(t.join("."))),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn invariants_hold_under_random_changes(
        ops in prop::collection::vec(op(), 1..60),
        cache in prop_oneof![Just(0usize), Just(3), Just(4096)],
    ) {
        let mut idx = index_with_cache(cache);
        let mut out = Vec::new();
        for op in ops {
            match op {
                Op::Insert(p, q, k) => {
                    let existed = idx.contains(k);
                    let r = idx.insert(&p, q, k);
                    prop_assert_eq!(r.is_err(), existed);
                }
                Op::Remove(k) => { idx.remove(k); }
                Op::RemoveOwner(o) => { idx.remove_owner(o); }
                Op::Match(s) => { idx.match_subject(&s, &mut out).unwrap(); }
            }
            idx.check_invariants();
            prop_assert!(idx.cached_subjects() <= cache);
        }
    }
}

#[test]
fn nodes_stay_small() {
    // The walk touches one node per step; keep each within a cache line.
    assert!(
        std::mem::size_of::<Node>() <= 64,
        "{}",
        std::mem::size_of::<Node>()
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// The one-pass splitter used by matching accepts exactly what
    /// `validate_subject` accepts (when the tokens fit its buffer), and
    /// splits like `str::split`.
    #[test]
    fn fast_split_agrees_with_validation(
        s in "[ab.*>é \u{a0}\t\u{0}\u{1}]{0,12}",
        max_len in 0usize..14,
        max_tokens in 0usize..8,
        buf_len in 0usize..8,
    ) {
        let limits = SubjectLimits { max_len, max_tokens };
        let mut buf = vec![""; buf_len];
        let fast = split_valid(&s, &limits, &mut buf);
        let valid = validate_subject(&s, &limits).is_ok();
        let count = s.split('.').count();
        match fast {
            Some(n) => {
                prop_assert!(valid);
                prop_assert_eq!(&buf[..n], &s.split('.').collect::<Vec<_>>()[..]);
            }
            None => prop_assert!(!valid || count > buf_len),
        }
    }
}

#[test]
fn deep_subjects_beyond_the_stack_buffer() {
    let limits = SubjectLimits {
        max_len: 1024,
        max_tokens: 100,
    };
    let mut idx = SubscriptionIndex::new(IndexConfig {
        limits,
        ..IndexConfig::default()
    });
    let deep: Vec<String> = (0..STACK_TOKENS + 10).map(|i| format!("t{i}")).collect();
    let subject = deep.join(".");
    let pattern = format!("{}.*.>", deep[..STACK_TOKENS].join("."));
    idx.insert(&pattern, None, key(1, 1)).unwrap();
    idx.insert("t0.>", None, key(1, 2)).unwrap();
    let mut out = Vec::new();
    for _ in 0..2 {
        idx.match_subject(&subject, &mut out).unwrap();
        out.sort();
        assert_eq!(out, [key(1, 1), key(1, 2)]);
    }
    idx.match_uncached(&subject, &mut out).unwrap();
    assert_eq!(out.len(), 2);
}
