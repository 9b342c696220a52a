//! The subscription table shared by the embedded API and the event loop:
//! the subscription index, the in-process queues of local subscriptions,
//! and the interest of route peers (see [`crate::interest`]).
//!
//! In-process publishers look up targets on their own thread (no hop
//! through the event loop); only deliveries to remote peers are handed to
//! the loop.
//!
//! Every change to the table sets a new generation number, readable without
//! the lock: a publisher may keep the targets of a subject and reuse them
//! while the generation stays the same.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) use efabus_core::index::SubRef;
use efabus_core::index::{IndexConfig, IndexError, SubscriptionIndex};
use efabus_core::subject::SubjectLimits;

use crate::delivery::LocalSink;
use crate::interest::{InterestChange, LocalInterest, RemoteInterest};
use efabus_core::frame::DeliveryClass;

/// Owner id of subscriptions made through the embedded API; remote
/// sessions use their session id, which starts at 1.
pub(crate) const LOCAL_OWNER: u64 = 0;

/// Where one published message goes.
#[derive(Default)]
pub(crate) struct Targets {
    /// In-process subscriptions: (sid, queue).
    pub local: Vec<(u64, Arc<LocalSink>)>,
    /// Remote sessions: clients, and routes to other brokers (whose `sid`
    /// is the interest id the peer announced).
    pub remote: Vec<SubRef>,
    /// Scratch space for the index's answer.
    matches: Vec<SubRef>,
    /// Scratch space for the route peers' answer.
    route_matches: Vec<SubRef>,
}

impl Targets {
    pub const fn new() -> Targets {
        Targets {
            local: Vec::new(),
            remote: Vec::new(),
            matches: Vec::new(),
            route_matches: Vec::new(),
        }
    }

    pub fn clear(&mut self) {
        self.local.clear();
        self.remote.clear();
        self.matches.clear();
    }
}

/// Generation numbers are unique across every table of the process, so a
/// lookup kept for one broker is never taken for another's.
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

fn next_generation() -> u64 {
    NEXT_GENERATION.fetch_add(1, Ordering::Relaxed)
}

pub(crate) struct SubscriptionTable {
    /// This broker's subscriptions: in-process and client sessions.
    index: SubscriptionIndex,
    locals: HashMap<u64, Arc<LocalSink>>,
    generation: Arc<AtomicU64>,
    /// The distinct interest of `index`, as announced to route peers.
    interest: LocalInterest,
    /// Subscriptions of `index` that take best-effort delivery.
    best_effort: HashSet<SubRef>,
    /// What route peers announced.
    routes: RemoteInterest,
}

impl SubscriptionTable {
    pub fn new(limits: SubjectLimits) -> SubscriptionTable {
        let config = IndexConfig {
            limits,
            ..IndexConfig::default()
        };
        SubscriptionTable {
            index: SubscriptionIndex::new(config),
            locals: HashMap::default(),
            generation: Arc::new(AtomicU64::new(next_generation())),
            interest: LocalInterest::default(),
            best_effort: HashSet::default(),
            routes: RemoteInterest::new(config),
        }
    }

    /// The table's generation, for reading without the lock. It changes
    /// (under the write lock) with every change to the table; read under the
    /// read lock, it names exactly the state being read.
    pub fn generation(&self) -> Arc<AtomicU64> {
        self.generation.clone()
    }

    fn changed(&self) {
        self.generation.store(next_generation(), Ordering::Release);
    }

    /// Add a subscription that takes `class` delivery; `sink` is set for
    /// in-process subscriptions.
    pub fn insert(
        &mut self,
        pattern: &str,
        queue: Option<&str>,
        key: SubRef,
        sink: Option<Arc<LocalSink>>,
        class: DeliveryClass,
    ) -> Result<(), IndexError> {
        self.index.insert(pattern, queue, key)?;
        self.interest.add(pattern, queue, class);
        if class == DeliveryClass::BestEffort {
            self.best_effort.insert(key);
        }
        if let Some(sink) = sink {
            self.locals.insert(key.sid, sink);
        }
        self.changed();
        Ok(())
    }

    /// The class `key` was inserted with (one of `best_effort`, or
    /// reliable), forgotten there: it is being removed.
    fn take_class(best_effort: &mut HashSet<SubRef>, key: SubRef) -> DeliveryClass {
        if best_effort.remove(&key) {
            DeliveryClass::BestEffort
        } else {
            DeliveryClass::Reliable
        }
    }

    pub fn remove(&mut self, key: SubRef) -> bool {
        if key.owner == LOCAL_OWNER {
            if let Some(sink) = self.locals.remove(&key.sid) {
                sink.close();
            }
        }
        let class = Self::take_class(&mut self.best_effort, key);
        if let Some(info) = self.index.get(key) {
            self.interest.remove(info.pattern, info.queue, class);
        }
        let removed = self.index.remove(key);
        self.changed();
        removed
    }

    /// Remove every subscription of a remote session.
    pub fn remove_owner(&mut self, owner: u64) -> usize {
        for info in self.index.iter_owner(owner) {
            let class = Self::take_class(&mut self.best_effort, info.key);
            self.interest.remove(info.pattern, info.queue, class);
        }
        let removed = self.index.remove_owner(owner);
        self.changed();
        removed
    }

    /// Record interest a route peer announced (`key`: the route's session
    /// and the peer's id for the entry).
    pub fn insert_route(
        &mut self,
        key: SubRef,
        pattern: &str,
        queue: Option<&str>,
        class: DeliveryClass,
    ) -> Result<(), IndexError> {
        let result = self.routes.insert(key, pattern, queue, class);
        self.changed();
        result
    }

    pub fn remove_route(&mut self, key: SubRef) -> bool {
        let removed = self.routes.remove(key);
        self.changed();
        removed
    }

    /// Forget what a route announced (it went down).
    pub fn remove_route_owner(&mut self, owner: u64) -> usize {
        let removed = self.routes.remove_owner(owner);
        self.changed();
        removed
    }

    /// Interest entries announced by route peers.
    pub fn route_interest_len(&self) -> usize {
        self.routes.len()
    }

    /// Set whenever an announcement to route peers is logged; readable
    /// without the lock.
    pub fn interest_flag(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.interest.flag()
    }

    /// Whether announcements to route peers wait to be sent.
    pub fn interest_changed(&self) -> bool {
        self.interest.has_changes()
    }

    /// The announcements for the routes that are up.
    pub fn take_interest_changes(&mut self) -> Vec<InterestChange> {
        self.interest.take_changes()
    }

    /// A route comes up: the announcements still due to the routes already
    /// up, and the whole interest for the new one (taken together, so no
    /// change is missed or sent twice).
    pub fn route_up(&mut self) -> (Vec<InterestChange>, Vec<InterestChange>) {
        let changes = self.interest.take_changes();
        self.interest.set_listening(true);
        (changes, self.interest.snapshot())
    }

    /// The (pattern, queue) of a subscription or route interest entry.
    pub fn describe(&self, key: SubRef) -> Option<(String, Option<String>)> {
        match self.index.get(key) {
            Some(info) => Some((info.pattern.to_string(), info.queue.map(str::to_string))),
            None => self.routes.describe(key),
        }
    }

    pub fn route_down(&mut self) {
        self.interest.set_listening(false);
    }

    /// Close every in-process subscription (on shutdown).
    pub fn close_locals(&mut self) {
        for (_, sink) in self.locals.drain() {
            sink.close();
        }
        self.changed();
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Fill `targets` with the subscriptions matching a subject. The index
    /// validates the subject (once per distinct subject, thanks to its cache).
    pub fn lookup(
        &self,
        subject: &str,
        targets: &mut Targets,
    ) -> Result<(), efabus_core::subject::SubjectError> {
        self.lookup_stable(subject, targets).map(|_| ())
    }

    /// Like [`lookup`](Self::lookup), and tells whether the answer holds for
    /// every message on this subject until the generation changes: true
    /// unless a queue group took part (its member is picked per message).
    pub fn lookup_stable(
        &self,
        subject: &str,
        targets: &mut Targets,
    ) -> Result<bool, efabus_core::subject::SubjectError> {
        targets.clear();
        let stable = self
            .index
            .match_subject_stable(subject, &mut targets.matches)?;
        let interest = &self.interest;
        let local_group = |pattern: &str, queue: &str| interest.has_group(pattern, queue);
        Ok(stable & self.add_routes_and_split(subject, targets, local_group, true)?)
    }

    /// Like [`lookup`](Self::lookup) for a report: each queue group's
    /// member (or route) is the one its next message goes to, and no
    /// group's rotation moves.
    pub fn lookup_peek(
        &self,
        subject: &str,
        targets: &mut Targets,
    ) -> Result<(), efabus_core::subject::SubjectError> {
        targets.clear();
        self.index
            .match_subject_peek(subject, &mut targets.matches)?;
        let interest = &self.interest;
        let local_group = |pattern: &str, queue: &str| interest.has_group(pattern, queue);
        self.add_routes_and_split(subject, targets, local_group, false)
            .map(|_| ())
    }

    /// Completes a lookup whose local matches are in `targets.matches`:
    /// adds the routes' interest (a queue group goes to a route only when
    /// `local_group` says this broker does not serve it) and sorts the
    /// matches into in-process and remote targets. True when no route's
    /// queue group took part.
    fn add_routes_and_split(
        &self,
        subject: &str,
        targets: &mut Targets,
        local_group: impl Fn(&str, &str) -> bool,
        turn: bool,
    ) -> Result<bool, efabus_core::subject::SubjectError> {
        let mut stable = true;
        if !self.routes.is_empty() {
            stable = self.routes.lookup(
                subject,
                local_group,
                &mut targets.route_matches,
                &mut targets.remote,
                turn,
            )?;
        }
        self.split_matches(targets);
        Ok(stable)
    }

    /// Like [`lookup`](Self::lookup), for a publisher that does not receive
    /// its own messages: `owner`'s subscriptions are left out, and a queue
    /// group picks among its other members.
    pub fn lookup_excluding(
        &self,
        subject: &str,
        owner: u64,
        targets: &mut Targets,
    ) -> Result<(), efabus_core::subject::SubjectError> {
        targets.clear();
        let mut unserved = Vec::new();
        self.index
            .match_subject_excluding(subject, owner, &mut targets.matches, &mut unserved)?;
        // A group served here only by the publisher's own members is
        // served by its members on other brokers instead.
        let local_group = |pattern: &str, queue: &str| {
            self.interest.has_group(pattern, queue)
                && !unserved.iter().any(|(p, q)| p == pattern && q == queue)
        };
        self.add_routes_and_split(subject, targets, local_group, true)
            .map(|_| ())
    }

    /// Fill `targets` for a message that arrived over a route for the
    /// interest this broker announced as `sid`: never other routes (one
    /// hop); for a plain entry every local plain subscription that matches,
    /// for a queue group one local member of that group (no other group's
    /// rotation moves: a message for one group must not take another's
    /// turn, nor a plain one any group's). True when the answer holds for
    /// every message on this subject and `sid` until the generation
    /// changes: a plain entry's.
    pub fn lookup_from_route(
        &self,
        subject: &str,
        sid: u64,
        targets: &mut Targets,
    ) -> Result<bool, efabus_core::subject::SubjectError> {
        targets.clear();
        let stable = if LocalInterest::is_group_sid(sid) {
            // Withdrawn meanwhile, it may have members here again under
            // another id; forgotten, none can be found.
            let Some((pattern, queue)) = self.interest.group(sid) else {
                return Ok(false);
            };
            self.index
                .pick_from_group(subject, pattern, queue, &mut targets.matches)?;
            false
        } else {
            self.index.match_plain(subject, &mut targets.matches)?;
            true
        };
        self.split_matches(targets);
        Ok(stable)
    }

    /// Fill `targets` with the next member of queue group `queue` on
    /// `pattern` that `subject` goes to (the group's turn moves), for a
    /// message picked for a member that has left since; with no member
    /// here, the route its next message would take (no turn moves).
    pub fn lookup_group(
        &self,
        subject: &str,
        pattern: &str,
        queue: &str,
        targets: &mut Targets,
    ) -> Result<(), efabus_core::subject::SubjectError> {
        targets.clear();
        self.index
            .pick_from_group(subject, pattern, queue, &mut targets.matches)?;
        self.split_matches(targets);
        if targets.local.is_empty() && targets.remote.is_empty() && !self.routes.is_empty() {
            self.lookup_peek(subject, targets)?;
            targets.local.clear();
            targets.remote.retain(|&key| {
                self.routes.describe(key).is_some_and(|(announced, group)| {
                    announced == pattern && group.as_deref() == Some(queue)
                })
            });
        }
        Ok(())
    }

    /// Sorts the local matches in `targets.matches` into in-process and
    /// remote targets.
    fn split_matches(&self, targets: &mut Targets) {
        for key in &targets.matches {
            if key.owner == LOCAL_OWNER {
                if let Some(sink) = self.locals.get(&key.sid) {
                    targets.local.push((key.sid, sink.clone()));
                }
            } else {
                targets.remote.push(*key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message a route sent for a queue group under the id it was
    /// announced as reaches the group's member here even after the group
    /// was withdrawn and announced again under another id (its only member
    /// left and a new one came, before the peer heard).
    #[test]
    fn a_group_message_for_a_withdrawn_id_reaches_the_group_s_new_member() {
        let mut table = SubscriptionTable::new(SubjectLimits::default());
        let (_, snapshot) = table.route_up();
        assert!(snapshot.is_empty());
        let member = |sid| SubRef { owner: 7, sid };
        let class = DeliveryClass::Reliable;
        table
            .insert("work.*", Some("workers"), member(1), None, class)
            .unwrap();
        let (changes, _) = table.route_up();
        let [InterestChange::Add { sid: first, .. }] = changes[..] else {
            panic!("{changes:?}");
        };
        table.remove(member(1));
        table
            .insert("work.*", Some("workers"), member(2), None, class)
            .unwrap();
        let (changes, _) = table.route_up();
        assert!(
            matches!(changes[..], [InterestChange::Remove { sid }, InterestChange::Add { sid: again, .. }] if sid == first && again != first),
            "{changes:?}"
        );
        let mut targets = Targets::new();
        table
            .lookup_from_route("work.1", first, &mut targets)
            .unwrap();
        assert_eq!(targets.remote, [member(2)]);
        // Without a member, nothing is found (and the broker counts it).
        table.remove(member(2));
        table
            .lookup_from_route("work.1", first, &mut targets)
            .unwrap();
        assert!(targets.remote.is_empty() && targets.local.is_empty());
    }
}
