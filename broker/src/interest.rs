//! Broker-to-broker routes: the interest tables the subscription table keeps for them.
//!
//! A cluster is a full mesh of brokers joined by routes (see `peers` in the
//! configuration). Over each route a broker tells the other which patterns
//! (and queue groups) its own subscribers want, and receives the other's.
//! This module owns both tables:
//!
//! - [`LocalInterest`]: the distinct (pattern, queue group, class) entries
//!   of this broker's subscriptions (in-process and client sessions),
//!   counted, each with the id under which it is announced to every route,
//!   and the log of announcements still to send. Plain subscriptions that
//!   take best-effort delivery are announced apart from reliable ones, so a
//!   route can carry what only they want on its datagram link.
//! - [`RemoteInterest`]: what each route peer announced, and the choice of
//!   which routes a locally published message goes to.
//!
//! Forwarding is one hop: a message published by a local client goes to
//! local subscribers and to routes; a message that arrived over a route goes
//! to local subscribers only. Each route gets a message once for all its
//! plain interest (reliably if any of the matching entries is reliable,
//! else best effort), and once more per queue group picked on it: a queue group
//! is served by a local member when this broker has one, else by one route
//! whose interest has that group (picked in turn).

use efabus_core::frame::DeliveryClass;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use efabus_core::index::{IndexConfig, IndexError, SubRef, SubscriptionIndex};
use efabus_core::subject::SubjectError;

/// One announcement to route peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum InterestChange {
    /// This broker now has subscribers on (pattern, queue) that take
    /// `class` delivery, announced as `sid`.
    Add {
        sid: u64,
        pattern: Arc<str>,
        queue: Option<Arc<str>>,
        class: DeliveryClass,
    },
    /// The last subscriber of the entry announced as `sid` is gone.
    Remove { sid: u64 },
}

/// Withdrawn queue groups remembered (see `LocalInterest::retired`): a
/// few seconds of member churn on a busy broker.
const RETIRED_GROUPS: usize = 1024;

struct Counted {
    sid: u64,
    count: usize,
}

/// This broker's own interest, deduplicated per (pattern, queue, class)
/// with reference counts, as route peers are told it.
#[derive(Default)]
pub(crate) struct LocalInterest {
    /// Each pattern's entries, by queue group and class: a pattern has
    /// few, so a list, searched without allocating (a group's message asks,
    /// per route target, whether this broker serves the group).
    entries: HashMap<String, Vec<Kept>>,
    by_sid: HashMap<u64, Entry>,
    /// Queue groups withdrawn lately, by the id they were announced as: a
    /// message a route sent before it heard of the withdrawal still names
    /// it, and reaches the group if it has members here again (under a
    /// new id). The oldest are forgotten beyond [`RETIRED_GROUPS`].
    retired: VecDeque<(u64, Arc<str>, Arc<str>)>,
    next_sid: u64,
    /// Announcements not yet sent; only kept while a route is up (a route
    /// that comes up is sent the whole table instead).
    changes: Vec<InterestChange>,
    /// Routes currently up.
    listeners: usize,
    /// Set whenever an announcement is logged, readable without the
    /// subscription table's lock (see [`LocalInterest::flag`]).
    flag: Arc<AtomicBool>,
}

/// What one announced id stands for.
struct Entry {
    pattern: Arc<str>,
    queue: Option<Arc<str>>,
    class: DeliveryClass,
}

/// How interest in (pattern, `queue`) that asked for `class` crosses a
/// route: a queue group's messages always reliably, plain ones as asked.
pub(crate) fn route_class(queue: Option<&str>, class: DeliveryClass) -> DeliveryClass {
    match queue {
        Some(_) => DeliveryClass::Reliable,
        None => class,
    }
}

/// One of a pattern's entries: its queue group, the class it crosses a
/// route in, and its subscriptions.
type Kept = (Option<String>, DeliveryClass, Counted);

impl LocalInterest {
    /// The list holding (pattern, queue) with `class` (as it crosses a
    /// route), and where in it.
    fn find_mut(
        &mut self,
        pattern: &str,
        queue: Option<&str>,
        class: DeliveryClass,
    ) -> Option<(&mut Vec<Kept>, usize)> {
        let list = self.entries.get_mut(pattern)?;
        let at = list
            .iter()
            .position(|(q, c, _)| q.as_deref() == queue && *c == class)?;
        Some((list, at))
    }

    /// Count one more subscription on (pattern, queue) that takes `class`
    /// delivery.
    pub fn add(&mut self, pattern: &str, queue: Option<&str>, class: DeliveryClass) {
        let class = route_class(queue, class);
        if let Some((list, at)) = self.find_mut(pattern, queue, class) {
            list[at].2.count += 1;
            return;
        }
        // Group entries get odd ids, plain ones even: a message for an id
        // just withdrawn still says which kind of interest it was for.
        self.next_sid += 1;
        let sid = self.next_sid * 2 + u64::from(queue.is_some());
        self.entries.entry(pattern.to_string()).or_default().push((
            queue.map(str::to_string),
            class,
            Counted { sid, count: 1 },
        ));
        let pattern: Arc<str> = Arc::from(pattern);
        let queue: Option<Arc<str>> = queue.map(Arc::from);
        self.by_sid.insert(
            sid,
            Entry {
                pattern: pattern.clone(),
                queue: queue.clone(),
                class,
            },
        );
        if self.listeners > 0 {
            self.changes.push(InterestChange::Add {
                sid,
                pattern,
                queue,
                class,
            });
            self.flag.store(true, Ordering::Release);
        }
    }

    /// Count one subscription on (pattern, queue) less, of the class it
    /// was added with.
    pub fn remove(&mut self, pattern: &str, queue: Option<&str>, class: DeliveryClass) {
        let class = route_class(queue, class);
        let Some((list, at)) = self.find_mut(pattern, queue, class) else {
            return;
        };
        list[at].2.count -= 1;
        if list[at].2.count > 0 {
            return;
        }
        let sid = list.swap_remove(at).2.sid;
        if list.is_empty() {
            self.entries.remove(pattern);
        }
        if let Some(Entry {
            pattern,
            queue: Some(queue),
            ..
        }) = self.by_sid.remove(&sid)
        {
            if self.retired.len() == RETIRED_GROUPS {
                self.retired.pop_front();
            }
            self.retired.push_back((sid, pattern, queue));
        }
        if self.listeners > 0 {
            self.changes.push(InterestChange::Remove { sid });
            self.flag.store(true, Ordering::Release);
        }
    }

    /// Whether this broker has a subscriber in the queue group.
    pub fn has_group(&self, pattern: &str, queue: &str) -> bool {
        // A group's entry always crosses reliably (`route_class`).
        self.entries
            .get(pattern)
            .is_some_and(|list| list.iter().any(|(q, ..)| q.as_deref() == Some(queue)))
    }

    /// Whether `sid` was (or would be) announced for a queue group.
    pub fn is_group_sid(sid: u64) -> bool {
        sid % 2 == 1
    }

    /// The (pattern, queue) announced as `sid`.
    pub fn get(&self, sid: u64) -> Option<(&str, Option<&str>)> {
        self.by_sid
            .get(&sid)
            .map(|entry| (&*entry.pattern, entry.queue.as_deref()))
    }

    /// The (pattern, queue) of the group announced as `sid`, withdrawn
    /// since or not.
    pub fn group(&self, sid: u64) -> Option<(&str, &str)> {
        match self.get(sid) {
            Some((pattern, Some(queue))) => Some((pattern, queue)),
            Some((_, None)) => None,
            None => self
                .retired
                .iter()
                .rev()
                .find(|(retired, _, _)| *retired == sid)
                .map(|(_, pattern, queue)| (&**pattern, &**queue)),
        }
    }

    /// A flag set with every announcement logged: whoever sends them clears
    /// it, then takes the announcements.
    pub fn flag(&self) -> Arc<AtomicBool> {
        self.flag.clone()
    }

    /// Whether announcements wait to be sent.
    pub fn has_changes(&self) -> bool {
        !self.changes.is_empty()
    }

    /// The announcements to send to the routes that are up.
    pub fn take_changes(&mut self) -> Vec<InterestChange> {
        std::mem::take(&mut self.changes)
    }

    /// The whole table, as announcements for a route that just came up.
    pub fn snapshot(&self) -> Vec<InterestChange> {
        let mut all: Vec<InterestChange> = self
            .by_sid
            .iter()
            .map(|(&sid, entry)| InterestChange::Add {
                sid,
                pattern: entry.pattern.clone(),
                queue: entry.queue.clone(),
                class: entry.class,
            })
            .collect();
        all.sort_by_key(|change| match change {
            InterestChange::Add { sid, .. } | InterestChange::Remove { sid } => *sid,
        });
        all
    }

    /// A route came up (true) or went down (false): changes are logged
    /// only while a route is up.
    pub fn set_listening(&mut self, up: bool) {
        if up {
            self.listeners += 1;
        } else {
            self.listeners = self.listeners.saturating_sub(1);
            if self.listeners == 0 {
                self.changes.clear();
            }
        }
    }

    /// Distinct entries.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_sid.len()
    }
}

/// A route's queue group entry: its pattern, its queue and the group's
/// turn (shared by the group's entries on every route).
type GroupEntry = (Arc<str>, Arc<str>, Arc<AtomicUsize>);

/// What route peers announced: a subscription index keyed by (route
/// session, announced sid), with the queue group of each group entry kept
/// aside (the index holds every entry as plain, so this side picks the
/// routes for groups itself).
pub(crate) struct RemoteInterest {
    index: SubscriptionIndex,
    /// Each group entry's (pattern, queue), and the turn of that group.
    groups: HashMap<SubRef, GroupEntry>,
    /// The turn for picking among the routes that announced a (pattern,
    /// queue), one per group: with one for all, a message matching two
    /// groups on two routes advanced it by two, so each group always got
    /// the same route.
    turns: HashMap<(Arc<str>, Arc<str>), Arc<AtomicUsize>>,
    /// Plain entries that want best-effort delivery.
    best_effort: HashSet<SubRef>,
}

impl RemoteInterest {
    pub fn new(config: IndexConfig) -> RemoteInterest {
        RemoteInterest {
            index: SubscriptionIndex::new(config),
            groups: HashMap::default(),
            turns: HashMap::default(),
            best_effort: HashSet::default(),
        }
    }

    /// Record a route's announcement, replacing an earlier one with the
    /// same id; `class` counts for plain entries only.
    pub fn insert(
        &mut self,
        key: SubRef,
        pattern: &str,
        queue: Option<&str>,
        class: DeliveryClass,
    ) -> Result<(), IndexError> {
        self.remove(key);
        // Validates the queue name too, though the index keeps it plain.
        if let Some(queue) = queue {
            efabus_core::subject::validate_queue_name(queue, &self.index.config().limits)?;
        }
        self.index.insert(pattern, None, key)?;
        match (queue, class) {
            (Some(queue), _) => {
                let group = (Arc::<str>::from(pattern), Arc::<str>::from(queue));
                let turn = Arc::clone(self.turns.entry(group.clone()).or_default());
                self.groups.insert(key, (group.0, group.1, turn));
            }
            (None, DeliveryClass::BestEffort) => {
                self.best_effort.insert(key);
            }
            (None, DeliveryClass::Reliable) => {}
        }
        Ok(())
    }

    pub fn remove(&mut self, key: SubRef) -> bool {
        if let Some((pattern, queue, turn)) = self.groups.remove(&key) {
            // The group's last entry: its turn goes with it.
            if Arc::strong_count(&turn) == 2 {
                self.turns.remove(&(pattern, queue));
            }
        }
        self.best_effort.remove(&key);
        self.index.remove(key)
    }

    /// The (pattern, queue) a route announced as `key`.
    pub fn describe(&self, key: SubRef) -> Option<(String, Option<String>)> {
        let info = self.index.get(key)?;
        let queue = self.groups.get(&key).map(|(_, queue, _)| queue.to_string());
        Some((info.pattern.to_string(), queue))
    }

    /// Forget everything a route announced.
    pub fn remove_owner(&mut self, owner: u64) -> usize {
        self.groups.retain(|key, _| key.owner != owner);
        self.turns.retain(|_, turn| Arc::strong_count(turn) > 1);
        self.best_effort.retain(|key| key.owner != owner);
        self.index.remove_owner(owner)
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// The routes a message published on this broker goes to, appended to
    /// `out` as (route session, announced sid): each route with matching
    /// plain interest once (under a reliable entry where one matches, so
    /// the message is carried reliably), and for each matching queue group
    /// that no local subscriber serves (`local_group`), one route with that
    /// group.
    /// Returns whether the answer holds for every message on the subject
    /// (no group took part). `scratch` is working space.
    /// Each group's turn moves on only when `turn` (a report's lookup
    /// leaves where messages go as it was).
    pub fn lookup(
        &self,
        subject: &str,
        local_group: impl Fn(&str, &str) -> bool,
        scratch: &mut Vec<SubRef>,
        out: &mut Vec<SubRef>,
        turn: bool,
    ) -> Result<bool, SubjectError> {
        self.index.match_subject(subject, scratch)?;
        if scratch.is_empty() {
            return Ok(true);
        }
        // One owner's entries together, plain reliable ones first within
        // it, then plain best-effort ones.
        scratch.sort_unstable_by_key(|key| {
            (
                key.owner,
                self.groups.contains_key(key),
                self.best_effort.contains(key),
            )
        });
        let mut stable = true;
        let mut last_owner = None;
        let mut wanted: Vec<(&str, &str, &AtomicUsize, Vec<SubRef>)> = Vec::new();
        for &key in scratch.iter() {
            match self.groups.get(&key) {
                None => {
                    if last_owner != Some(key.owner) {
                        out.push(key);
                        last_owner = Some(key.owner);
                    }
                }
                Some((pattern, queue, turn)) => {
                    stable = false;
                    if local_group(pattern, queue) {
                        continue;
                    }
                    match wanted
                        .iter_mut()
                        .find(|(p, q, _, _)| *p == &**pattern && *q == &**queue)
                    {
                        Some((_, _, _, routes)) => routes.push(key),
                        None => wanted.push((pattern, queue, turn, vec![key])),
                    }
                }
            }
        }
        for (_, _, next, routes) in wanted {
            let next = if turn {
                next.fetch_add(1, Ordering::Relaxed)
            } else {
                next.load(Ordering::Relaxed)
            };
            out.push(routes[next % routes.len()]);
        }
        Ok(stable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote() -> RemoteInterest {
        RemoteInterest::new(IndexConfig::default())
    }

    #[test]
    fn local_interest_counts_and_announces_first_and_last() {
        let mut local = LocalInterest::default();
        local.add("a.>", None, DeliveryClass::Reliable);
        // Nothing is logged while no route is up.
        assert!(!local.has_changes());
        local.set_listening(true);
        local.add("a.>", None, DeliveryClass::Reliable);
        local.add("b", Some("q"), DeliveryClass::Reliable);
        assert_eq!(local.len(), 2);
        let changes = local.take_changes();
        assert_eq!(changes.len(), 1, "{changes:?}");
        let InterestChange::Add { sid, .. } = changes[0].clone() else {
            panic!("{changes:?}");
        };
        assert_eq!(local.get(sid), Some(("b", Some("q"))));
        assert!(LocalInterest::is_group_sid(sid));
        assert!(local.has_group("b", "q"));
        assert!(!local.has_group("a.>", "q"));
        local.remove("a.>", None, DeliveryClass::Reliable);
        assert!(!local.has_changes(), "one subscriber is left");
        local.remove("a.>", None, DeliveryClass::Reliable);
        local.remove("a.>", None, DeliveryClass::Reliable);
        assert_eq!(local.take_changes(), [InterestChange::Remove { sid: 2 }]);
        assert_eq!(local.snapshot().len(), 1);
        local.set_listening(false);
        local.remove("b", Some("q"), DeliveryClass::Reliable);
        assert!(!local.has_changes());
        assert_eq!(local.len(), 0);
    }

    #[test]
    fn a_queue_group_is_never_taken_for_best_effort_interest() {
        let mut local = LocalInterest::default();
        local.set_listening(true);
        // Any name is a queue group's, "~" too: apart from best-effort
        // interest in the same subject.
        local.add("jobs", None, DeliveryClass::BestEffort);
        local.add("jobs", Some("~"), DeliveryClass::Reliable);
        assert_eq!(local.len(), 2);
        assert_eq!(local.take_changes().len(), 2, "both are announced");
        assert!(local.has_group("jobs", "~"));
        local.remove("jobs", Some("~"), DeliveryClass::Reliable);
        assert!(
            !local.has_group("jobs", "~"),
            "the best-effort subscriber is no member of the group"
        );
        assert_eq!(local.len(), 1);
    }

    #[test]
    fn a_route_gets_plain_interest_once() {
        let mut routes = remote();
        routes
            .insert(SubRef::new(7, 1), "a.>", None, DeliveryClass::Reliable)
            .unwrap();
        routes
            .insert(SubRef::new(7, 2), "a.b", None, DeliveryClass::Reliable)
            .unwrap();
        routes
            .insert(SubRef::new(8, 1), "*.b", None, DeliveryClass::Reliable)
            .unwrap();
        routes
            .insert(SubRef::new(9, 1), "c", None, DeliveryClass::Reliable)
            .unwrap();
        let (mut scratch, mut out) = (Vec::new(), Vec::new());
        let stable = routes
            .lookup("a.b", |_, _| false, &mut scratch, &mut out, true)
            .unwrap();
        assert!(stable);
        let owners: Vec<u64> = out.iter().map(|key| key.owner).collect();
        assert_eq!(owners, [7, 8]);
        assert_eq!(routes.remove_owner(7), 2);
        out.clear();
        routes
            .lookup("a.b", |_, _| false, &mut scratch, &mut out, true)
            .unwrap();
        assert_eq!(out, [SubRef::new(8, 1)]);
    }

    #[test]
    fn best_effort_interest_is_announced_apart_and_yields_to_reliable() {
        let mut local = LocalInterest::default();
        local.set_listening(true);
        local.add("a.>", None, DeliveryClass::BestEffort);
        local.add("a.>", None, DeliveryClass::BestEffort);
        local.add("a.>", None, DeliveryClass::Reliable);
        // A queue group's entry is reliable whatever its members asked.
        local.add("w", Some("q"), DeliveryClass::BestEffort);
        let changes = local.take_changes();
        let announced: Vec<bool> = changes
            .iter()
            .map(|change| match change {
                InterestChange::Add { class, .. } => *class == DeliveryClass::BestEffort,
                InterestChange::Remove { .. } => panic!("{changes:?}"),
            })
            .collect();
        assert_eq!(announced, [true, false, false]);
        local.remove("a.>", None, DeliveryClass::BestEffort);
        assert!(!local.has_changes(), "one best-effort subscriber is left");
        local.remove("a.>", None, DeliveryClass::Reliable);
        assert!(matches!(
            local.take_changes()[..],
            [InterestChange::Remove { .. }]
        ));
        // Removed with the class it was added with, the group entry goes,
        // and the last best-effort subscriber takes its entry along.
        local.remove("w", Some("q"), DeliveryClass::BestEffort);
        local.remove("a.>", None, DeliveryClass::BestEffort);
        assert!(matches!(
            local.take_changes()[..],
            [InterestChange::Remove { .. }, InterestChange::Remove { .. }]
        ));
        assert_eq!(local.len(), 0);

        let mut routes = remote();
        routes
            .insert(SubRef::new(7, 2), "a.>", None, DeliveryClass::BestEffort)
            .unwrap();
        let (mut scratch, mut out) = (Vec::new(), Vec::new());
        routes
            .lookup("a.b", |_, _| false, &mut scratch, &mut out, true)
            .unwrap();
        assert_eq!(out, [SubRef::new(7, 2)]);
        routes
            .insert(SubRef::new(7, 4), "a.b", None, DeliveryClass::Reliable)
            .unwrap();
        for _ in 0..3 {
            out.clear();
            routes
                .lookup("a.b", |_, _| false, &mut scratch, &mut out, true)
                .unwrap();
            assert_eq!(out, [SubRef::new(7, 4)], "the reliable entry carries it");
        }
        out.clear();
        routes
            .lookup("a.c", |_, _| false, &mut scratch, &mut out, true)
            .unwrap();
        assert_eq!(out, [SubRef::new(7, 2)]);
    }

    #[test]
    fn a_queue_group_goes_to_one_route_unless_served_locally() {
        let mut routes = remote();
        routes
            .insert(
                SubRef::new(7, 1),
                "work",
                Some("q"),
                DeliveryClass::Reliable,
            )
            .unwrap();
        routes
            .insert(
                SubRef::new(8, 4),
                "work",
                Some("q"),
                DeliveryClass::Reliable,
            )
            .unwrap();
        routes
            .insert(SubRef::new(8, 5), "work", None, DeliveryClass::Reliable)
            .unwrap();
        let (mut scratch, mut out) = (Vec::new(), Vec::new());
        let mut picked = Vec::new();
        for _ in 0..4 {
            out.clear();
            let stable = routes
                .lookup("work", |_, _| false, &mut scratch, &mut out, true)
                .unwrap();
            assert!(!stable);
            // Route 8's plain interest, and one route for the group.
            assert!(out.contains(&SubRef::new(8, 5)), "{out:?}");
            let group: Vec<_> = out.iter().filter(|k| **k != SubRef::new(8, 5)).collect();
            assert_eq!(group.len(), 1, "{out:?}");
            picked.push(*group[0]);
        }
        assert!(picked.contains(&SubRef::new(7, 1)) && picked.contains(&SubRef::new(8, 4)));
        // A report's lookup names the route the next message goes to, and
        // leaves the turn there.
        let group_route = |out: &Vec<SubRef>| out.iter().copied().find(|k| *k != SubRef::new(8, 5));
        let mut next = Vec::new();
        for turn in [false, false, true] {
            out.clear();
            routes
                .lookup("work", |_, _| false, &mut scratch, &mut out, turn)
                .unwrap();
            next.push(group_route(&out));
        }
        assert_eq!(next[0], next[1]);
        assert_eq!(next[1], next[2]);
        out.clear();
        routes
            .lookup(
                "work",
                |p, q| (p, q) == ("work", "q"),
                &mut scratch,
                &mut out,
                true,
            )
            .unwrap();
        assert_eq!(out, [SubRef::new(8, 5)]);
    }

    #[test]
    fn each_queue_group_takes_the_routes_in_turn() {
        // Two routes, each with members of two groups on one subject.
        let mut routes = remote();
        for (key, queue) in [
            (SubRef::new(7, 1), "q1"),
            (SubRef::new(7, 2), "q2"),
            (SubRef::new(8, 1), "q1"),
            (SubRef::new(8, 2), "q2"),
        ] {
            routes
                .insert(key, "work", Some(queue), DeliveryClass::Reliable)
                .unwrap();
        }
        let (mut scratch, mut out) = (Vec::new(), Vec::new());
        let mut owners_of = |queue_sid: u64| {
            let mut owners = HashSet::default();
            for _ in 0..4 {
                out.clear();
                routes
                    .lookup("work", |_, _| false, &mut scratch, &mut out, true)
                    .unwrap();
                assert_eq!(out.len(), 2, "one route per group: {out:?}");
                owners.extend(out.iter().filter(|k| k.sid == queue_sid).map(|k| k.owner));
            }
            owners
        };
        assert_eq!(owners_of(1).len(), 2, "q1 reaches both routes");
        assert_eq!(owners_of(2).len(), 2, "q2 reaches both routes");
        // A group's turn goes with its last entry.
        assert_eq!(routes.turns.len(), 2);
        routes.remove_owner(7);
        routes.remove(SubRef::new(8, 1));
        assert_eq!(routes.turns.len(), 1);
    }
}
