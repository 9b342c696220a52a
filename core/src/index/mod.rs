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
//! vector has grown. A miss validates the subject, walks the trie (at most one
//! literal and one `*` branch per token), and stores the result.

mod cache;
mod children;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use thiserror::Error;

use crate::subject::{
    tokens, validate_pattern, validate_queue_name, validate_subject, QueueNameError, SubjectError,
    SubjectLimits, Token,
};
use cache::{Cache, Cached, MAX_CACHED_RESULT};
use children::Children;

/// Identifies one subscription: who owns it and its id there.
///
/// `owner` is a peer or local client id chosen by the broker; `sid` is the
/// subscription id, unique per owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubRef {
    pub owner: u64,
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
}

/// A subscription as stored in the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubInfo<'a> {
    pub key: SubRef,
    pub pattern: &'a str,
    pub queue: Option<&'a str>,
}

type NodeId = usize;
type GroupId = usize;

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

#[derive(Debug, Default)]
struct Node {
    children: Children,
    star: Option<NodeId>,
    /// Patterns ending at this node.
    exact: SubList,
    /// Patterns ending with `>` right after this node.
    tail: SubList,
}

impl Node {
    fn is_bare(&self) -> bool {
        self.children.is_empty()
            && self.star.is_none()
            && self.exact.is_empty()
            && self.tail.is_empty()
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
            cache: Cache::new(config.cache_capacity),
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

        let mut node = ROOT;
        let mut tail = false;
        for token in tokens(pattern) {
            match token {
                Token::Full => {
                    tail = true;
                    break;
                }
                Token::Single => {
                    node = match self.nodes[node].star {
                        Some(next) => next,
                        None => {
                            let next = self.alloc_node();
                            self.nodes[node].star = Some(next);
                            next
                        }
                    }
                }
                Token::Literal(lit) => {
                    node = match self.nodes[node].children.get(lit) {
                        Some(next) => next,
                        None => {
                            let next = self.alloc_node();
                            self.nodes[node].children.insert(lit, next);
                            next
                        }
                    }
                }
            }
        }

        let (group, pos) = match queue {
            None => {
                let list = list_mut(&mut self.nodes[node], tail);
                list.plain.push(key);
                (None, list.plain.len() - 1)
            }
            Some(name) => {
                let list = list_mut(&mut self.nodes[node], tail);
                let found = list.groups.iter().copied().find(|&g| {
                    self.groups[g]
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
                                self.groups[gid] = Some(group);
                                gid
                            }
                            None => {
                                self.groups.push(Some(group));
                                self.groups.len() - 1
                            }
                        };
                        list.groups.push(gid);
                        gid
                    }
                };
                // The slot was filled just above or found occupied.
                let pos = match self.groups[gid].as_mut() {
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
        out.clear();
        if !self.cache.enabled() {
            return self.match_walk(subject, out);
        }
        let hash = self.cache.hash(subject);
        if let Some(hit) = self.cache.get(hash, subject) {
            // Cached subjects were validated when first matched.
            self.emit(&hit, out);
            return Ok(());
        }
        validate_subject(subject, &self.config.limits)?;
        let mut plain = Vec::new();
        let mut groups = Vec::new();
        self.walk(ROOT, subject, &mut |list: &SubList| {
            plain.extend_from_slice(&list.plain);
            groups.extend_from_slice(&list.groups);
        });
        let result = Cached {
            plain: plain.into(),
            groups: groups.into(),
        };
        self.emit(&result, out);
        if result.plain.len() + result.groups.len() <= MAX_CACHED_RESULT {
            self.cache.insert(hash, subject, Arc::new(result));
        }
        Ok(())
    }

    /// Like [`match_subject`](Self::match_subject) but always walks the trie,
    /// neither reading nor filling the cache. Allocates nothing once `out`
    /// has grown; meant for one-off subjects (e.g. reply inboxes) and for
    /// measuring the trie itself.
    pub fn match_uncached(&self, subject: &str, out: &mut Vec<SubRef>) -> Result<(), SubjectError> {
        out.clear();
        self.match_walk(subject, out)
    }

    fn match_walk(&self, subject: &str, out: &mut Vec<SubRef>) -> Result<(), SubjectError> {
        validate_subject(subject, &self.config.limits)?;
        self.walk(ROOT, subject, &mut |list: &SubList| {
            out.extend_from_slice(&list.plain);
            for &gid in &list.groups {
                if let Some(member) = self.pick(gid) {
                    out.push(member);
                }
            }
        });
        Ok(())
    }

    fn emit(&self, result: &Cached, out: &mut Vec<SubRef>) {
        out.reserve(result.plain.len() + result.groups.len());
        out.extend_from_slice(&result.plain);
        for &gid in result.groups.iter() {
            if let Some(member) = self.pick(gid) {
                out.push(member);
            }
        }
    }

    /// The next member of a group in its rotation.
    #[inline]
    fn pick(&self, gid: GroupId) -> Option<SubRef> {
        // Groups referenced by the trie or a valid cache entry always exist
        // and are never empty; the checks only keep this total.
        let group = self.groups.get(gid)?.as_ref()?;
        let len = group.members.len();
        if len == 0 {
            return None;
        }
        let turn = group.cursor.fetch_add(1, Ordering::Relaxed);
        group.members.get(turn % len).copied()
    }

    /// Visits the lists of every pattern matching `rest`, the remainder of a
    /// valid subject starting at a token, from `node`. Recursion depth is
    /// bounded by the number of tokens, itself bounded by the limits.
    fn walk<F: FnMut(&SubList)>(&self, node: NodeId, rest: &str, visit: &mut F) {
        let n = &self.nodes[node];
        if !n.tail.is_empty() {
            visit(&n.tail);
        }
        let (token, next) = match rest.find('.') {
            Some(i) => (&rest[..i], Some(&rest[i + 1..])),
            None => (rest, None),
        };
        if let Some(child) = n.children.get(token) {
            self.step(child, next, visit);
        }
        if let Some(child) = n.star {
            self.step(child, next, visit);
        }
    }

    #[inline]
    fn step<F: FnMut(&SubList)>(&self, node: NodeId, next: Option<&str>, visit: &mut F) {
        match next {
            Some(rest) => self.walk(node, rest, visit),
            None => {
                let list = &self.nodes[node].exact;
                if !list.is_empty() {
                    visit(list);
                }
            }
        }
    }

    /// Takes a subscription out of the trie, pruning emptied nodes and
    /// groups; returns its pattern for cache invalidation.
    fn detach(&mut self, key: SubRef) -> Option<Box<str>> {
        let entry = self.subs.remove(&key)?;
        let list = list_mut(&mut self.nodes[entry.node], entry.tail);
        let moved = match entry.group {
            None => {
                list.plain.swap_remove(entry.pos);
                list.plain.get(entry.pos).copied()
            }
            Some(gid) => {
                let mut moved = None;
                let mut emptied = false;
                if let Some(group) = self.groups[gid].as_mut() {
                    group.members.swap_remove(entry.pos);
                    moved = group.members.get(entry.pos).copied();
                    emptied = group.members.is_empty();
                }
                if emptied {
                    if let Some(i) = list.groups.iter().position(|&g| g == gid) {
                        list.groups.swap_remove(i);
                    }
                    self.groups[gid] = None;
                    self.free_groups.push(gid);
                }
                moved
            }
        };
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
                Token::Single => self.nodes[node].star,
                Token::Literal(lit) => self.nodes[node].children.get(lit),
            };
            let Some(next) = next else { return };
            path.push((node, token));
            node = next;
        }
        while let Some((parent, token)) = path.pop() {
            if !self.nodes[node].is_bare() {
                break;
            }
            match token {
                Token::Literal(lit) => {
                    self.nodes[parent].children.remove(lit);
                }
                _ => self.nodes[parent].star = None,
            }
            self.nodes[node] = Node::default();
            self.free_nodes.push(node);
            node = parent;
        }
    }

    fn alloc_node(&mut self) -> NodeId {
        match self.free_nodes.pop() {
            Some(id) => id,
            None => {
                self.nodes.push(Node::default());
                self.nodes.len() - 1
            }
        }
    }

    /// Number of trie nodes in use (root included); for tests and metrics.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
    }
}

fn list_mut(node: &mut Node, tail: bool) -> &mut SubList {
    if tail {
        &mut node.tail
    } else {
        &mut node.exact
    }
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
