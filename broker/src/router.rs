//! The routing table shared by the embedded API and the event loop: the
//! subscription index plus the in-process queues of local subscriptions.
//!
//! In-process publishers route on their own thread (no hop through the event
//! loop); only deliveries to remote peers are handed to the loop.
//!
//! Every change to the table sets a new generation number, readable without
//! the lock: a publisher may keep the route of a subject and reuse it while
//! the generation stays the same.

use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) use efabus_core::index::SubRef;
use efabus_core::index::{IndexConfig, IndexError, SubscriptionIndex};
use efabus_core::subject::SubjectLimits;

use crate::delivery::LocalSink;

/// Owner id of subscriptions made through the embedded API; remote
/// sessions use their session id, which starts at 1.
pub(crate) const LOCAL_OWNER: u64 = 0;

/// Where one published message goes.
#[derive(Default)]
pub(crate) struct Targets {
    /// In-process subscriptions: (sid, queue).
    pub local: Vec<(u64, Arc<LocalSink>)>,
    pub remote: Vec<SubRef>,
    /// Scratch space for the index's answer.
    matches: Vec<SubRef>,
}

impl Targets {
    pub const fn new() -> Targets {
        Targets {
            local: Vec::new(),
            remote: Vec::new(),
            matches: Vec::new(),
        }
    }

    pub fn clear(&mut self) {
        self.local.clear();
        self.remote.clear();
        self.matches.clear();
    }

    pub fn len(&self) -> usize {
        self.local.len() + self.remote.len()
    }
}

/// Generation numbers are unique across every router of the process, so a
/// route kept for one broker is never taken for another's.
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

fn next_generation() -> u64 {
    NEXT_GENERATION.fetch_add(1, Ordering::Relaxed)
}

pub(crate) struct Router {
    index: SubscriptionIndex,
    locals: HashMap<u64, Arc<LocalSink>>,
    generation: Arc<AtomicU64>,
}

impl Router {
    pub fn new(limits: SubjectLimits) -> Router {
        Router {
            index: SubscriptionIndex::new(IndexConfig {
                limits,
                ..IndexConfig::default()
            }),
            locals: HashMap::default(),
            generation: Arc::new(AtomicU64::new(next_generation())),
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

    /// Add a subscription; `sink` is set for in-process subscriptions.
    pub fn insert(
        &mut self,
        pattern: &str,
        queue: Option<&str>,
        key: SubRef,
        sink: Option<Arc<LocalSink>>,
    ) -> Result<(), IndexError> {
        self.index.insert(pattern, queue, key)?;
        if let Some(sink) = sink {
            self.locals.insert(key.sid, sink);
        }
        self.changed();
        Ok(())
    }

    pub fn remove(&mut self, key: SubRef) -> bool {
        if key.owner == LOCAL_OWNER {
            if let Some(sink) = self.locals.remove(&key.sid) {
                sink.close();
            }
        }
        let removed = self.index.remove(key);
        self.changed();
        removed
    }

    /// Remove every subscription of a remote session.
    pub fn remove_owner(&mut self, owner: u64) -> usize {
        let removed = self.index.remove_owner(owner);
        self.changed();
        removed
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
    pub fn route(
        &self,
        subject: &str,
        targets: &mut Targets,
    ) -> Result<(), efabus_core::subject::SubjectError> {
        self.route_stable(subject, targets).map(|_| ())
    }

    /// Like [`route`](Self::route), and tells whether the answer holds for
    /// every message on this subject until the generation changes: true
    /// unless a queue group took part (its member is picked per message).
    pub fn route_stable(
        &self,
        subject: &str,
        targets: &mut Targets,
    ) -> Result<bool, efabus_core::subject::SubjectError> {
        targets.clear();
        let stable = self
            .index
            .match_subject_stable(subject, &mut targets.matches)?;
        for key in &targets.matches {
            if key.owner == LOCAL_OWNER {
                if let Some(sink) = self.locals.get(&key.sid) {
                    targets.local.push((key.sid, sink.clone()));
                }
            } else {
                targets.remote.push(*key);
            }
        }
        Ok(stable)
    }
}
