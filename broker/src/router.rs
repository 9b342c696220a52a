//! The routing table shared by the embedded API and the event loop: the
//! subscription index plus the in-process queues of local subscriptions.
//!
//! In-process publishers route on their own thread (no hop through the event
//! loop); only deliveries to remote peers are handed to the loop.

use rustc_hash::FxHashMap as HashMap;
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
    pub fn clear(&mut self) {
        self.local.clear();
        self.remote.clear();
        self.matches.clear();
    }

    pub fn len(&self) -> usize {
        self.local.len() + self.remote.len()
    }
}

pub(crate) struct Router {
    index: SubscriptionIndex,
    locals: HashMap<u64, Arc<LocalSink>>,
}

impl Router {
    pub fn new(limits: SubjectLimits) -> Router {
        Router {
            index: SubscriptionIndex::new(IndexConfig {
                limits,
                ..IndexConfig::default()
            }),
            locals: HashMap::default(),
        }
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
        Ok(())
    }

    pub fn remove(&mut self, key: SubRef) -> bool {
        if key.owner == LOCAL_OWNER {
            if let Some(sink) = self.locals.remove(&key.sid) {
                sink.close();
            }
        }
        self.index.remove(key)
    }

    /// Remove every subscription of a remote session.
    pub fn remove_owner(&mut self, owner: u64) -> usize {
        self.index.remove_owner(owner)
    }

    /// Close every in-process subscription (on shutdown).
    pub fn close_locals(&mut self) {
        for (_, sink) in self.locals.drain() {
            sink.close();
        }
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
        targets.clear();
        self.index.match_subject(subject, &mut targets.matches)?;
        for key in &targets.matches {
            if key.owner == LOCAL_OWNER {
                if let Some(sink) = self.locals.get(&key.sid) {
                    targets.local.push((key.sid, sink.clone()));
                }
            } else {
                targets.remote.push(*key);
            }
        }
        Ok(())
    }
}
