//! The subscription index: which subscriptions want a message on a subject.
//!
//! This module owns the routing data structure of the broker: every
//! subscription (local client or remote peer) with its pattern and optional
//! queue group, and the lookup from a literal subject to the set of receivers.
//!
//! # Structure
//!
//! - A token trie. Each node has literal children, a `*` child, and two lists
//!   of subscriptions: those whose pattern ends at this node, and those whose
//!   pattern ends with `>` right after this node.
//! - A cache from literal subjects to the trie's answer, bounded in size and
//!   invalidated precisely: a change on pattern `p` drops the cached subjects
//!   `p` matches (one lookup for a literal `p`, a scan for a wildcard `p`).
//!
//! # Queue groups
//!
//! As in NATS, a queue group is identified by its pattern *and* its queue
//! name: subscriptions on `work.*` with queue `q` form one group, those on
//! `work.>` with queue `q` another. Every message goes to every plain
//! subscription that matches, plus exactly one member of every group that
//! matches. Members are picked round-robin per group: each group has an atomic
//! cursor advanced once per matched message, so over `n` messages the members
//! of a stable group receive `n / members` messages each, within one.
//!
//! # Concurrency
//!
//! Matching takes `&self` (the rotation is atomic and the cache is sharded
//! behind mutexes), changes take `&mut self`. A broker can therefore keep the
//! index in a `RwLock` and match under the read lock from many threads.
//!
//! # Cost
//!
//! A cache hit costs one keyed hash of the subject, one short lock and a copy
//! of the result into the caller's vector; it allocates nothing once the
//! vector has grown. A miss validates and splits the subject in one pass (on
//! the stack), walks the trie (at most one literal and one `*` branch per
//! token and node), and stores the result in the cache. Nodes are one cache
//! line each; short tokens are stored inline; tables use a fast keyed hash.

mod cache;
mod children;
mod hash;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use thiserror::Error;

use crate::subject::{
    is_inbox, tokens, validate_pattern, validate_queue_name, validate_subject, QueueNameError,
    SubjectError, SubjectLimits, Token,
};
use cache::Cache;
use children::Children;
use hash::FoldState;

/// Identifies one subscription: who owns it and its id there.
///
/// `owner` is a peer or local client id chosen by the broker; `sid` is the
/// subscription id, unique per owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubRef {
    /// The peer or local client holding the subscription.
    pub owner: u64,
    /// The subscription id, chosen by the owner.
    pub sid: u64,
}

impl SubRef {
    /// Shorthand constructor.
    pub const fn new(owner: u64, sid: u64) -> Self {
        Self { owner, sid }
    }
}

/// Settings of a [`SubscriptionIndex`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Limits applied to patterns, queue names and matched subjects.
    pub limits: SubjectLimits,
    /// Largest number of subjects kept in the match cache; 0 disables it.
    pub cache_capacity: usize,
}

impl IndexConfig {
    /// Default [`cache_capacity`](Self::cache_capacity).
    pub const DEFAULT_CACHE_CAPACITY: usize = 4096;
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            limits: SubjectLimits::default(),
            cache_capacity: Self::DEFAULT_CACHE_CAPACITY,
        }
    }
}

/// Why a subscription could not be added.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum IndexError {
    /// The pattern is invalid.
    #[error("invalid pattern: {0}")]
    Pattern(#[from] SubjectError),
    /// The queue group name is invalid.
    #[error("invalid queue name: {0}")]
    QueueName(#[from] QueueNameError),
    /// A subscription with this key is already present.
    #[error("subscription {} of owner {} already exists", .0.sid, .0.owner)]
    DuplicateKey(SubRef),
    /// The index ran out of node or group ids (over 4 billion of them).
    #[error("subscription index is full")]
    Full,
}

/// A subscription as stored in the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubInfo<'a> {
    /// The subscription's key.
    pub key: SubRef,
    /// Its pattern, as inserted.
    pub pattern: &'a str,
    /// Its queue group name, if any.
    pub queue: Option<&'a str>,
}

type NodeId = u32;
type GroupId = u32;

const ROOT: NodeId = 0;

/// Subscriptions that end at one place of the trie.
#[derive(Debug, Default)]
struct SubList {
    plain: Vec<SubRef>,
    groups: Vec<GroupId>,
}

impl SubList {
    fn is_empty(&self) -> bool {
        self.plain.is_empty() && self.groups.is_empty()
    }
}

/// The subscriptions held at a node; boxed because most nodes hold none, and
/// small nodes keep the walk within few cache lines.
#[derive(Debug, Default)]
struct Terminal {
    /// Patterns ending at this node.
    exact: SubList,
    /// Patterns ending with `>` right after this node.
    tail: SubList,
}

/// Aligned to a cache line: the walk reads one node per step.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Node {
    children: Children,
    star: Option<NodeId>,
    term: Option<Box<Terminal>>,
}

impl Node {
    fn is_bare(&self) -> bool {
        self.children.is_empty() && self.star.is_none() && self.term.is_none()
    }
}

#[derive(Debug)]
struct Group {
    name: Box<str>,
    members: Vec<SubRef>,
    cursor: AtomicUsize,
}

/// Where a subscription sits: which node, which list, which slot.
#[derive(Debug)]
struct Entry {
    pattern: Box<str>,
    queue: Option<Box<str>>,
    node: NodeId,
    tail: bool,
    group: Option<GroupId>,
    /// Index in the list's `plain` vector, or in the group's `members`.
    pos: usize,
}

/// The subscription index. See the [module documentation](self).
#[derive(Debug)]
pub struct SubscriptionIndex {
    config: IndexConfig,
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    groups: Vec<Option<Group>>,
    free_groups: Vec<GroupId>,
    /// Ordered by (owner, sid), so one owner's subscriptions are a range.
    subs: BTreeMap<SubRef, Entry>,
    cache: Cache,
}

impl Default for SubscriptionIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl SubscriptionIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        Self {
            config,
            nodes: vec![Node::default()],
            free_nodes: Vec::new(),
            groups: Vec::new(),
            free_groups: Vec::new(),
            subs: BTreeMap::new(),
            cache: Cache::new(config.cache_capacity, FoldState),
        }
    }

    /// The settings this index was built with.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Number of subscriptions.
    pub fn len(&self) -> usize {
        self.subs.len()
    }

    /// True when there is no subscription.
    pub fn is_empty(&self) -> bool {
        self.subs.is_empty()
    }

    /// True when a subscription with this key is present.
    pub fn contains(&self, key: SubRef) -> bool {
        self.subs.contains_key(&key)
    }

    /// The stored pattern and queue of one subscription.
    pub fn get(&self, key: SubRef) -> Option<SubInfo<'_>> {
        self.subs.get(&key).map(|e| info(key, e))
    }

    /// Every subscription, ordered by (owner, sid).
    pub fn iter(&self) -> impl Iterator<Item = SubInfo<'_>> + '_ {
        self.subs.iter().map(|(&k, e)| info(k, e))
    }

    /// The subscriptions of one owner, ordered by sid.
    pub fn iter_owner(&self, owner: u64) -> impl Iterator<Item = SubInfo<'_>> + '_ {
        self.subs
            .range(SubRef::new(owner, 0)..=SubRef::new(owner, u64::MAX))
            .map(|(&k, e)| info(k, e))
    }

    /// Number of subjects currently cached.
    pub fn cached_subjects(&self) -> usize {
        self.cache.len()
    }

    /// Adds a subscription on `pattern`, in queue group `queue` if given.
    pub fn insert(
        &mut self,
        pattern: &str,
        queue: Option<&str>,
        key: SubRef,
    ) -> Result<(), IndexError> {
        validate_pattern(pattern, &self.config.limits)?;
        if let Some(q) = queue {
            validate_queue_name(q, &self.config.limits)?;
        }
        if self.subs.contains_key(&key) {
            return Err(IndexError::DuplicateKey(key));
        }
        // Ids are u32 to keep nodes small; check before changing anything.
        let new_nodes = self.nodes.len() + pattern.len() / 2 + 1;
        if new_nodes > NodeId::MAX as usize || self.groups.len() >= GroupId::MAX as usize {
            return Err(IndexError::Full);
        }

        let mut node = ROOT;
        let mut tail = false;
        for token in tokens(pattern) {
            node = match token {
                Token::Full => {
                    tail = true;
                    break;
                }
                Token::Single => match self.node(node).star {
                    Some(next) => next,
                    None => {
                        let next = self.alloc_node();
                        self.node_mut(node).star = Some(next);
                        next
                    }
                },
                Token::Literal(lit) => match self.node(node).children.get(lit.as_bytes()) {
                    Some(next) => next,
                    None => {
                        let next = self.alloc_node();
                        self.node_mut(node).children.insert(lit, next);
                        next
                    }
                },
            };
        }

        let list = list_mut(&mut self.nodes[node as usize], tail);
        let (group, pos) = match queue {
            None => {
                list.plain.push(key);
                (None, list.plain.len() - 1)
            }
            Some(name) => {
                let groups = &mut self.groups;
                let found = list.groups.iter().copied().find(|&g| {
                    groups[g as usize]
                        .as_ref()
                        .is_some_and(|group| *group.name == *name)
                });
                let gid = match found {
                    Some(gid) => gid,
                    None => {
                        let group = Group {
                            name: name.into(),
                            members: Vec::new(),
                            cursor: AtomicUsize::new(0),
                        };
                        let gid = match self.free_groups.pop() {
                            Some(gid) => {
                                groups[gid as usize] = Some(group);
                                gid
                            }
                            None => {
                                groups.push(Some(group));
                                // Bounded by the `Full` check above.
                                (groups.len() - 1) as GroupId
                            }
                        };
                        list.groups.push(gid);
                        gid
                    }
                };
                // The slot was filled just above or found occupied.
                let pos = match groups[gid as usize].as_mut() {
                    Some(group) => {
                        group.members.push(key);
                        group.members.len() - 1
                    }
                    None => 0,
                };
                (Some(gid), pos)
            }
        };

        self.subs.insert(
            key,
            Entry {
                pattern: pattern.into(),
                queue: queue.map(Into::into),
                node,
                tail,
                group,
                pos,
            },
        );
        self.cache.invalidate(pattern);
        Ok(())
    }

    /// Removes one subscription; false if the key was not present.
    pub fn remove(&mut self, key: SubRef) -> bool {
        match self.detach(key) {
            Some(pattern) => {
                self.cache.invalidate(&pattern);
                true
            }
            None => false,
        }
    }

    /// Removes every subscription of `owner` (e.g. a peer that went away);
    /// returns how many there were.
    pub fn remove_owner(&mut self, owner: u64) -> usize {
        let keys: Vec<SubRef> = self
            .subs
            .range(SubRef::new(owner, 0)..=SubRef::new(owner, u64::MAX))
            .map(|(&k, _)| k)
            .collect();
        let patterns: Vec<Box<str>> = keys.iter().filter_map(|&k| self.detach(k)).collect();
        self.cache.invalidate_many(patterns.iter().map(|p| &**p));
        patterns.len()
    }

    /// Removes every subscription.
    pub fn clear(&mut self) {
        *self = Self::new(self.config);
    }

    /// Finds the receivers of a message on `subject`.
    ///
    /// `out` is cleared, then receives every plain subscription whose pattern
    /// matches and one member of every matching queue group (advancing that
    /// group's rotation). Each subscription appears at most once; the order is
    /// unspecified. Fails only if `subject` is not a valid literal subject
    /// under the index's limits.
    pub fn match_subject(&self, subject: &str, out: &mut Vec<SubRef>) -> Result<(), SubjectError> {
        self.match_cached(subject, out).map(|_| ())
    }

    /// Like [`match_subject`](Self::match_subject), and tells whether the
    /// answer is stable: true when no queue group matched, so the same
    /// subject has exactly these receivers until the index next changes.
    /// (With a group, a member is picked anew for every message.) Callers
    /// may then keep the answer as long as they can tell the index did not
    /// change.
    pub fn match_subject_stable(
        &self,
        subject: &str,
        out: &mut Vec<SubRef>,
    ) -> Result<bool, SubjectError> {
        self.match_cached(subject, out)
    }

    /// The cached match; true when no queue group matched.
    #[inline]
    fn match_cached(&self, subject: &str, out: &mut Vec<SubRef>) -> Result<bool, SubjectError> {
        if !self.cache.enabled() || is_inbox(subject) {
            // Picked as the walk goes: nothing to keep unpicked.
            out.clear();
            return self.match_walk(subject, out);
        }
        self.match_groups_with(subject, true, out, |groups, out| {
            self.pick_each(groups, out)
        })
    }

    /// Like [`match_subject`](Self::match_subject) for the plain
    /// subscriptions alone: no queue group takes part, and none's rotation
    /// moves.
    pub fn match_plain(&self, subject: &str, out: &mut Vec<SubRef>) -> Result<(), SubjectError> {
        self.match_groups_with(subject, true, out, |_, _| {})
            .map(|_| ())
    }

    /// One member, in its rotation, of the queue group `queue` of
    /// `pattern`, into the cleared `out`, when `subject` matches `pattern`
    /// and the group has members; no other group's rotation moves (a
    /// message meant for one group must not take the others' turns).
    pub fn pick_from_group(
        &self,
        subject: &str,
        pattern: &str,
        queue: &str,
        out: &mut Vec<SubRef>,
    ) -> Result<(), SubjectError> {
        self.match_groups_with(subject, false, out, |groups, out| {
            let named = groups
                .iter()
                .copied()
                .find(|&gid| self.group_is(gid, pattern, queue));
            out.extend(named.and_then(|gid| self.pick(gid)));
        })
        .map(|_| ())
    }

    /// Whether group `gid` is the queue group `queue` of `pattern`.
    fn group_is(&self, gid: GroupId, pattern: &str, queue: &str) -> bool {
        let Some(group) = self.groups.get(gid as usize).and_then(Option::as_ref) else {
            return false;
        };
        *group.name == *queue
            && group
                .members
                .first()
                .and_then(|first| self.subs.get(first))
                .is_some_and(|entry| *entry.pattern == *pattern)
    }

    /// The cached match: the plain subscriptions into the cleared `out`
    /// (if `plain`), then the matching groups (not picked) handed to
    /// `groups_found` with it; true when no queue group matched.
    #[inline]
    fn match_groups_with<F: FnOnce(&[GroupId], &mut Vec<SubRef>)>(
        &self,
        subject: &str,
        plain: bool,
        out: &mut Vec<SubRef>,
        groups_found: F,
    ) -> Result<bool, SubjectError> {
        out.clear();
        // A reply inbox kept would cost an insert and evict a subject that
        // recurs.
        let hash = (self.cache.enabled() && !is_inbox(subject)).then(|| self.cache.hash(subject));
        let mut groups_found = Some(groups_found);
        if let Some(hash) = hash {
            // Cached subjects were validated when first matched.
            let mut stable = true;
            let hit = self.cache.with(hash, subject, |subs, groups| {
                if plain {
                    out.extend_from_slice(subs);
                }
                stable = groups.is_empty();
                if let Some(found) = groups_found.take() {
                    found(groups, out);
                }
            });
            if hit {
                return Ok(stable);
            }
        }
        // Plain subscribers go straight to `out`; groups are collected so
        // the cache can keep them unpicked.
        let mut groups = Vec::new();
        self.with_tokens(subject, |toks| {
            self.walk(ROOT, toks, &mut |list: &SubList| {
                out.extend_from_slice(&list.plain);
                groups.extend_from_slice(&list.groups);
            })
        })?;
        if let Some(hash) = hash {
            self.cache.insert(hash, subject, out, &groups);
        }
        if !plain {
            out.clear();
        }
        if let Some(found) = groups_found.take() {
            found(&groups, out);
        }
        Ok(groups.is_empty())
    }

    /// Like [`match_subject`](Self::match_subject) but always walks the trie,
    /// neither reading nor filling the cache (as `match_subject` does for
    /// reply inboxes). Allocates nothing once `out` has grown; meant for
    /// one-off subjects and for measuring the trie itself.
    pub fn match_uncached(&self, subject: &str, out: &mut Vec<SubRef>) -> Result<(), SubjectError> {
        out.clear();
        self.match_walk(subject, out).map(|_| ())
    }

    /// The trie walk alone; true when no queue group matched.
    fn match_walk(&self, subject: &str, out: &mut Vec<SubRef>) -> Result<bool, SubjectError> {
        let mut stable = true;
        self.with_tokens(subject, |toks| {
            self.walk(ROOT, toks, &mut |list: &SubList| {
                out.extend_from_slice(&list.plain);
                stable &= list.groups.is_empty();
                for &gid in &list.groups {
                    if let Some(member) = self.pick(gid) {
                        out.push(member);
                    }
                }
            })
        })?;
        Ok(stable)
    }

    /// Validates `subject` and hands its tokens to `f`, without allocating
    /// unless the subject has more than [`STACK_TOKENS`] tokens.
    #[inline]
    fn with_tokens<F: FnOnce(&[&str])>(&self, subject: &str, f: F) -> Result<(), SubjectError> {
        let mut buf = [""; STACK_TOKENS];
        match split_valid(subject, &self.config.limits, &mut buf) {
            Some(n) => f(&buf[..n]),
            None => {
                // Invalid, or valid but deeper than the stack buffer (only
                // possible when the limits allow it): the full check decides.
                validate_subject(subject, &self.config.limits)?;
                let toks: Vec<&str> = subject.split('.').collect();
                f(&toks);
            }
        }
        Ok(())
    }

    /// One member of each group, in its rotation, into `out`.
    #[inline]
    fn pick_each(&self, groups: &[GroupId], out: &mut Vec<SubRef>) {
        for &gid in groups {
            if let Some(member) = self.pick(gid) {
                out.push(member);
            }
        }
    }

    /// Like [`match_subject`](Self::match_subject), leaving out the
    /// subscriptions of `owner`: a queue group picks among its other
    /// members; a group all of whose members are `owner`'s is skipped and
    /// its (pattern, queue) added to `unserved`, so that members elsewhere
    /// (on other brokers) may be asked instead. For a publisher that does
    /// not receive its own messages; walks the trie.
    pub fn match_subject_excluding(
        &self,
        subject: &str,
        owner: u64,
        out: &mut Vec<SubRef>,
        unserved: &mut Vec<(String, String)>,
    ) -> Result<(), SubjectError> {
        out.clear();
        let mut groups = Vec::new();
        self.with_tokens(subject, |toks| {
            self.walk(ROOT, toks, &mut |list: &SubList| {
                out.extend(list.plain.iter().filter(|sub| sub.owner != owner));
                groups.extend_from_slice(&list.groups);
            })
        })?;
        for gid in groups {
            match self.pick_excluding(gid, owner) {
                Some(member) => out.push(member),
                None => unserved.extend(self.group_key(gid)),
            }
        }
        Ok(())
    }

    /// The pattern and queue name of a group, from its first member.
    fn group_key(&self, gid: GroupId) -> Option<(String, String)> {
        let group = self.groups.get(gid as usize)?.as_ref()?;
        let entry = self.subs.get(group.members.first()?)?;
        Some((entry.pattern.to_string(), group.name.to_string()))
    }

    /// The next member of a group in its rotation that is not `owner`'s.
    fn pick_excluding(&self, gid: GroupId, owner: u64) -> Option<SubRef> {
        let group = self.groups.get(gid as usize)?.as_ref()?;
        let len = group.members.len();
        // One turn of the rotation, then the next eligible member from
        // there: other threads picking meanwhile cannot make it miss one.
        let start = group.cursor.fetch_add(1, Ordering::Relaxed);
        (0..len).find_map(|i| {
            let member = group.members.get(start.wrapping_add(i) % len).copied();
            member.filter(|m| m.owner != owner)
        })
    }

    /// Like [`match_subject`](Self::match_subject), each group's member
    /// the one its next message goes to, its rotation not moved: for
    /// reports, which must not change where messages go.
    pub fn match_subject_peek(
        &self,
        subject: &str,
        out: &mut Vec<SubRef>,
    ) -> Result<(), SubjectError> {
        self.match_groups_with(subject, true, out, |groups, out| {
            out.extend(groups.iter().filter_map(|&gid| self.peek(gid)));
        })
        .map(|_| ())
    }

    /// The member of a group its next message goes to.
    fn peek(&self, gid: GroupId) -> Option<SubRef> {
        let group = self.groups.get(gid as usize)?.as_ref()?;
        let len = group.members.len();
        let turn = group.cursor.load(Ordering::Relaxed);
        group.members.get(turn.checked_rem(len)?).copied()
    }

    /// The next member of a group in its rotation.
    #[inline]
    fn pick(&self, gid: GroupId) -> Option<SubRef> {
        // Groups referenced by the trie or a valid cache entry always exist
        // and are never empty; the checks only keep this total.
        let group = self.groups.get(gid as usize)?.as_ref()?;
        let len = group.members.len();
        if len == 0 {
            return None;
        }
        let turn = group.cursor.fetch_add(1, Ordering::Relaxed);
        group.members.get(turn % len).copied()
    }

    #[inline]
    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    #[inline]
    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    /// Visits the lists of every pattern matching `toks` (the remaining,
    /// non-empty tokens of a valid subject) from `node`. Recursion depth is
    /// bounded by the number of tokens, itself bounded by the limits.
    fn walk<F: FnMut(&SubList)>(&self, node: NodeId, toks: &[&str], visit: &mut F) {
        let Some((token, rest)) = toks.split_first() else {
            return;
        };
        let n = self.node(node);
        if let Some(term) = &n.term {
            if !term.tail.is_empty() {
                visit(&term.tail);
            }
        }
        if let Some(child) = n.children.get(token.as_bytes()) {
            self.step(child, rest, visit);
        }
        if let Some(child) = n.star {
            self.step(child, rest, visit);
        }
    }

    #[inline]
    fn step<F: FnMut(&SubList)>(&self, node: NodeId, rest: &[&str], visit: &mut F) {
        if rest.is_empty() {
            if let Some(term) = &self.node(node).term {
                if !term.exact.is_empty() {
                    visit(&term.exact);
                }
            }
        } else {
            self.walk(node, rest, visit);
        }
    }

    /// Takes a subscription out of the trie, pruning emptied nodes and
    /// groups; returns its pattern for cache invalidation.
    fn detach(&mut self, key: SubRef) -> Option<Box<str>> {
        let entry = self.subs.remove(&key)?;
        let node = &mut self.nodes[entry.node as usize];
        let list = list_mut(node, entry.tail);
        let moved = match entry.group {
            None => {
                list.plain.swap_remove(entry.pos);
                list.plain.get(entry.pos).copied()
            }
            Some(gid) => {
                let mut moved = None;
                let mut emptied = false;
                if let Some(group) = self.groups[gid as usize].as_mut() {
                    group.members.swap_remove(entry.pos);
                    moved = group.members.get(entry.pos).copied();
                    emptied = group.members.is_empty();
                }
                if emptied {
                    if let Some(i) = list.groups.iter().position(|&g| g == gid) {
                        list.groups.swap_remove(i);
                    }
                    self.groups[gid as usize] = None;
                    self.free_groups.push(gid);
                }
                moved
            }
        };
        if node
            .term
            .as_ref()
            .is_some_and(|t| t.exact.is_empty() && t.tail.is_empty())
        {
            node.term = None;
        }
        // The last element took the removed one's slot: record its new place.
        if let Some(moved) = moved {
            if let Some(e) = self.subs.get_mut(&moved) {
                e.pos = entry.pos;
            }
        }
        self.prune(&entry.pattern);
        Some(entry.pattern)
    }

    /// Frees the nodes on `pattern`'s path that no longer hold anything.
    fn prune(&mut self, pattern: &str) {
        let mut path: Vec<(NodeId, Token<'_>)> = Vec::new();
        let mut node = ROOT;
        for token in tokens(pattern) {
            let next = match token {
                Token::Full => break,
                Token::Single => self.node(node).star,
                Token::Literal(lit) => self.node(node).children.get(lit.as_bytes()),
            };
            let Some(next) = next else { return };
            path.push((node, token));
            node = next;
        }
        while let Some((parent, token)) = path.pop() {
            if !self.node(node).is_bare() {
                break;
            }
            match token {
                Token::Literal(lit) => {
                    self.node_mut(parent).children.remove(lit.as_bytes());
                }
                _ => self.node_mut(parent).star = None,
            }
            *self.node_mut(node) = Node::default();
            self.free_nodes.push(node);
            node = parent;
        }
    }

    fn alloc_node(&mut self) -> NodeId {
        match self.free_nodes.pop() {
            Some(id) => id,
            None => {
                self.nodes.push(Node::default());
                // Bounded by the `Full` check in `insert`.
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    /// Number of trie nodes in use (root included); for tests and metrics.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
    }
}

fn list_mut(node: &mut Node, tail: bool) -> &mut SubList {
    let term = node.term.get_or_insert_with(Box::default);
    if tail {
        &mut term.tail
    } else {
        &mut term.exact
    }
}

/// Tokens a matched subject may have before splitting falls back to the heap.
const STACK_TOKENS: usize = 32;

/// One pass over `s`: its tokens into `buf` if `s` is a valid subject under
/// `limits` with at most `buf.len()` tokens, `None` otherwise. Agrees with
/// [`validate_subject`] on validity (tested), which reports the reason.
#[inline]
fn split_valid<'a>(s: &'a str, limits: &SubjectLimits, buf: &mut [&'a str]) -> Option<usize> {
    if s.is_empty() || s.len() > limits.max_len {
        return None;
    }
    let cap = limits.max_tokens.min(buf.len());
    let mut n = 0;
    let mut start = 0;
    // Set when the current token holds a byte the fast check cannot clear.
    let mut odd = false;
    for (i, &b) in s.as_bytes().iter().enumerate() {
        if b == b'.' {
            n = push_token(s, start, i, odd, n, cap, buf)?;
            start = i + 1;
            odd = false;
        } else {
            odd |= !b.is_ascii_graphic();
        }
    }
    push_token(s, start, s.len(), odd, n, cap, buf)
}

#[inline(always)]
fn push_token<'a>(
    s: &'a str,
    start: usize,
    end: usize,
    odd: bool,
    n: usize,
    cap: usize,
    buf: &mut [&'a str],
) -> Option<usize> {
    let token = s.get(start..end)?;
    let wildcard = token.len() == 1 && (token == "*" || token == ">");
    if token.is_empty() || wildcard || n >= cap {
        return None;
    }
    if odd && token.chars().any(|c| c == '\0' || c.is_whitespace()) {
        return None;
    }
    *buf.get_mut(n)? = token;
    Some(n + 1)
}

fn info(key: SubRef, e: &Entry) -> SubInfo<'_> {
    SubInfo {
        key,
        pattern: &e.pattern,
        queue: e.queue.as_deref(),
    }
}

#[cfg(test)]
mod tests;
