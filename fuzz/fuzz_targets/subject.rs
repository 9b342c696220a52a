//! The subject parser and the subscription index against the reference
//! matcher. Input: lines `pattern` or `pattern queue`, the last line being
//! the subject to match. Nothing panics; validation agrees with insertion;
//! the index (cached, uncached, and after removals) finds exactly the
//! subscriptions the reference matcher says, one member per queue group
//! (a group being a pattern and a queue name).

#![no_main]

use std::collections::{BTreeMap, BTreeSet};

use efabus_core::index::{IndexConfig, SubRef, SubscriptionIndex};
use efabus_core::subject::{
    pattern_matches, validate_pattern, validate_queue_name, validate_subject, Pattern,
    SubjectLimits,
};
use libfuzzer_sys::fuzz_target;

const LIMITS: SubjectLimits = SubjectLimits {
    max_len: 64,
    max_tokens: 8,
};

fn expected(subs: &BTreeMap<SubRef, (String, Option<String>)>, subject: &str) -> Expect {
    let mut plain = BTreeSet::new();
    // A group is its pattern and its queue name (see the index docs).
    let mut groups: BTreeMap<(&str, &str), BTreeSet<SubRef>> = BTreeMap::new();
    for (key, (pattern, queue)) in subs {
        if !pattern_matches(pattern, subject) {
            continue;
        }
        match queue {
            Some(queue) => {
                groups
                    .entry((pattern.as_str(), queue.as_str()))
                    .or_default()
                    .insert(*key);
            }
            None => {
                plain.insert(*key);
            }
        }
    }
    Expect {
        plain,
        groups: groups.into_values().collect(),
    }
}

struct Expect {
    plain: BTreeSet<SubRef>,
    groups: Vec<BTreeSet<SubRef>>,
}

impl Expect {
    fn check(&self, got: &[SubRef], what: &str) {
        let set: BTreeSet<SubRef> = got.iter().copied().collect();
        assert_eq!(set.len(), got.len(), "{what}: a subscription twice");
        let mut rest = set.clone();
        for key in &self.plain {
            assert!(rest.remove(key), "{what}: missing plain {key:?}");
        }
        for group in &self.groups {
            let picked: Vec<&SubRef> = group.iter().filter(|k| rest.contains(k)).collect();
            assert_eq!(picked.len(), 1, "{what}: one member per group");
            rest.remove(picked[0]);
        }
        assert!(rest.is_empty(), "{what}: extra matches {rest:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines: Vec<&str> = text.split('\n').collect();
    let Some(subject) = lines.pop() else {
        return;
    };
    lines.truncate(32);
    let subject_ok = validate_subject(subject, &LIMITS).is_ok();

    for cache_capacity in [0, 4] {
        let mut index = SubscriptionIndex::new(IndexConfig {
            limits: LIMITS,
            cache_capacity,
        });
        let mut subs = BTreeMap::new();
        for (i, line) in lines.iter().enumerate() {
            let (pattern, queue) = match line.split_once(' ') {
                Some((pattern, queue)) => (pattern, Some(queue)),
                None => (*line, None),
            };
            let valid = validate_pattern(pattern, &LIMITS).is_ok()
                && queue.is_none_or(|q| validate_queue_name(q, &LIMITS).is_ok());
            assert_eq!(
                Pattern::parse(pattern, &LIMITS).is_ok(),
                validate_pattern(pattern, &LIMITS).is_ok()
            );
            let key = SubRef::new(i as u64 % 3, i as u64);
            let inserted = index.insert(pattern, queue, key);
            assert_eq!(
                inserted.is_ok(),
                valid,
                "{pattern:?} {queue:?}: {inserted:?}"
            );
            if valid {
                subs.insert(key, (pattern.to_string(), queue.map(str::to_string)));
            }
        }
        assert_eq!(index.len(), subs.len());

        let mut out = Vec::new();
        let matched = index.match_subject(subject, &mut out);
        assert_eq!(matched.is_ok(), subject_ok, "{subject:?}: {matched:?}");
        if !subject_ok {
            continue;
        }
        let expect = expected(&subs, subject);
        expect.check(&out, "match_subject");
        // Again, now possibly from the cache, and without it.
        index
            .match_subject(subject, &mut out)
            .expect("valid subject");
        expect.check(&out, "match_subject again");
        index
            .match_uncached(subject, &mut out)
            .expect("valid subject");
        expect.check(&out, "match_uncached");

        // Remove one owner's subscriptions; the rest still match exactly.
        let removed = index.remove_owner(1);
        subs.retain(|key, _| key.owner != 1);
        assert_eq!(index.len(), subs.len(), "removed {removed}");
        let expect = expected(&subs, subject);
        index
            .match_subject(subject, &mut out)
            .expect("valid subject");
        expect.check(&out, "after remove_owner");
        let keys: Vec<SubRef> = subs.keys().copied().collect();
        for key in keys {
            assert!(index.remove(key));
        }
        index
            .match_subject(subject, &mut out)
            .expect("valid subject");
        assert!(out.is_empty(), "matches in an empty index");
        assert!(index.is_empty());
    }
});
