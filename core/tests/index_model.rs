//! The subscription index checked against a naive model built on the
//! reference matcher, over random sequences of inserts, removes,
//! owner removals and matches. Small token alphabets make matches common.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};

use efabus_core::index::{IndexConfig, IndexError, SubRef, SubscriptionIndex};
use efabus_core::subject::pattern_matches;
use proptest::prelude::*;

/// The model: a plain list of subscriptions.
#[derive(Default)]
struct Model {
    subs: BTreeMap<SubRef, (String, Option<String>)>,
}

impl Model {
    /// Checks one match result: every matching plain subscription exactly
    /// once, exactly one member of every matching group, nothing else.
    fn check(&self, subject: &str, out: &[SubRef]) -> Result<(), TestCaseError> {
        let got: BTreeSet<SubRef> = out.iter().copied().collect();
        prop_assert_eq!(got.len(), out.len(), "duplicates in {:?}", out);
        let mut plain = BTreeSet::new();
        let mut groups: BTreeMap<(&str, &str), BTreeSet<SubRef>> = BTreeMap::new();
        for (&k, (p, q)) in &self.subs {
            if !pattern_matches(p, subject) {
                continue;
            }
            match q {
                None => {
                    plain.insert(k);
                }
                Some(q) => {
                    groups.entry((p, q)).or_default().insert(k);
                }
            }
        }
        let mut rest: BTreeSet<SubRef> = got.difference(&plain).copied().collect();
        prop_assert_eq!(
            rest.len() + plain.len(),
            got.len(),
            "plain subscribers missing for {}: want {:?} got {:?}",
            subject,
            plain,
            got
        );
        for (g, members) in &groups {
            let picked: Vec<SubRef> = rest.intersection(members).copied().collect();
            prop_assert_eq!(
                picked.len(),
                1,
                "group {:?} on {}: picked {:?}",
                g,
                subject,
                picked
            );
            rest.remove(&picked[0]);
        }
        prop_assert!(
            rest.is_empty(),
            "unexpected receivers for {}: {:?}",
            subject,
            rest
        );
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum Op {
    Insert(String, Option<&'static str>, SubRef),
    Remove(SubRef),
    RemoveOwner(u64),
    Match(String),
}

fn pattern() -> impl Strategy<Value = String> {
    let token = prop_oneof![3 => Just("a"), 3 => Just("b"), 1 => Just("c"), 3 => Just("*")];
    (
        prop::collection::vec(token, 0..5),
        prop::bool::weighted(0.3),
    )
        .prop_filter_map("non-empty", |(mut toks, full)| {
            if full {
                toks.push(">");
            }
            (!toks.is_empty()).then(|| toks.join("."))
        })
}

fn subject() -> impl Strategy<Value = String> {
    prop::collection::vec(prop_oneof![Just("a"), Just("b"), Just("c")], 1..6)
        .prop_map(|t| t.join("."))
}

fn key() -> impl Strategy<Value = SubRef> {
    (0u64..4, 0u64..10).prop_map(|(o, s)| SubRef::new(o, s))
}

fn op() -> impl Strategy<Value = Op> {
    let queue = prop::option::weighted(0.4, prop_oneof![Just("q"), Just("r")]);
    prop_oneof![
        5 => (pattern(), queue, key()).prop_map(|(p, q, k)| Op::Insert(p, q, k)),
        2 => key().prop_map(Op::Remove),
        1 => (0u64..4).prop_map(Op::RemoveOwner),
        6 => subject().prop_map(Op::Match),
    ]
}

fn run(ops: Vec<Op>, cache_capacity: usize) -> Result<(), TestCaseError> {
    let mut idx = SubscriptionIndex::new(IndexConfig {
        cache_capacity,
        ..IndexConfig::default()
    });
    let mut model = Model::default();
    let mut out = Vec::new();
    for op in ops {
        match op {
            Op::Insert(p, q, k) => {
                let r = idx.insert(&p, q, k);
                match model.subs.entry(k) {
                    Entry::Occupied(_) => prop_assert_eq!(r, Err(IndexError::DuplicateKey(k))),
                    Entry::Vacant(slot) => {
                        prop_assert_eq!(r, Ok(()));
                        slot.insert((p, q.map(String::from)));
                    }
                }
            }
            Op::Remove(k) => {
                prop_assert_eq!(idx.remove(k), model.subs.remove(&k).is_some());
            }
            Op::RemoveOwner(o) => {
                let before = model.subs.len();
                model.subs.retain(|k, _| k.owner != o);
                prop_assert_eq!(idx.remove_owner(o), before - model.subs.len());
            }
            Op::Match(s) => {
                idx.match_subject(&s, &mut out).unwrap();
                model.check(&s, &out)?;
                // The cached answer (second lookup) and the trie agree too.
                idx.match_subject(&s, &mut out).unwrap();
                model.check(&s, &out)?;
                idx.match_uncached(&s, &mut out).unwrap();
                model.check(&s, &out)?;
            }
        }
        prop_assert_eq!(idx.len(), model.subs.len());
    }
    // Stored subscriptions read back as inserted.
    let stored: Vec<_> = idx
        .iter()
        .map(|i| (i.key, i.pattern.to_owned(), i.queue.map(String::from)))
        .collect();
    let want: Vec<_> = model
        .subs
        .iter()
        .map(|(&k, (p, q))| (k, p.clone(), q.clone()))
        .collect();
    prop_assert_eq!(stored, want);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(150))]

    #[test]
    fn index_agrees_with_reference(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, IndexConfig::DEFAULT_CACHE_CAPACITY)?;
    }

    #[test]
    fn index_agrees_with_reference_tiny_cache(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, 2)?;
    }

    #[test]
    fn index_agrees_with_reference_no_cache(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, 0)?;
    }

    /// A single pattern against a single subject: the index answers exactly
    /// as the reference matcher.
    #[test]
    fn single_pattern(p in pattern(), s in subject()) {
        let mut idx = SubscriptionIndex::default();
        let k = SubRef::new(1, 1);
        idx.insert(&p, None, k).unwrap();
        let mut out = Vec::new();
        idx.match_subject(&s, &mut out).unwrap();
        prop_assert_eq!(out == [k], pattern_matches(&p, &s));
    }
}
