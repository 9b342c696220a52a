//! White-box tests: internal invariants of the trie, groups and cache.
//! Behaviour against the reference matcher lives in `core/tests/index_*.rs`.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeSet;

impl SubscriptionIndex {
    /// Every stored position points back at its key, every list entry has an
    /// entry, every node and group in use is reachable and non-empty.
    fn check_invariants(&self) {
        let mut seen = BTreeSet::new();
        for (&key, e) in &self.subs {
            let node = &self.nodes[e.node];
            let list = if e.tail { &node.tail } else { &node.exact };
            match e.group {
                None => assert_eq!(list.plain[e.pos], key),
                Some(gid) => {
                    assert!(list.groups.contains(&gid));
                    let g = self.groups[gid].as_ref().expect("live group");
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
            let n = &self.nodes[id];
            if id != ROOT {
                assert!(!n.is_bare(), "bare node {id} left in the trie");
            }
            for list in [&n.exact, &n.tail] {
                held += list.plain.len();
                for &gid in &list.groups {
                    let g = self.groups[gid].as_ref().expect("live group");
                    assert!(!g.members.is_empty());
                    held += g.members.len();
                }
            }
            match &n.children {
                Children::Small(v) => stack.extend(v.iter().map(|&(_, c)| c)),
                Children::Map(m) => stack.extend(m.values().copied()),
            }
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
    assert!(idx.nodes[ROOT].is_bare());
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
    for sid in 0..(MAX_CACHED_RESULT as u64 + 1) {
        idx.insert("big.>", None, key(0, sid)).unwrap();
    }
    assert_eq!(matched(&idx, "big.x").len(), MAX_CACHED_RESULT + 1);
    assert_eq!(idx.cached_subjects(), 0);
    assert!(idx.remove(key(0, 0)));
    assert_eq!(matched(&idx, "big.x").len(), MAX_CACHED_RESULT);
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
        let mut idx = SubscriptionIndex::new(IndexConfig { cache_capacity: cache, ..IndexConfig::default() });
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
