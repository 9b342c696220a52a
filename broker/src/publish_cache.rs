//! The publish-side cache of an in-process publishing thread: the targets
//! (subscriptions) of the few subjects it published on last. While the
//! subscription table's generation is unchanged, publishing again on one of
//! these subjects takes no lock and looks nothing up, and the subject
//! string is shared rather than allocated.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;

use crate::broker::{deliver_in_process, Shared};
use crate::error::Error;
use crate::subscriptions::{SubRef, Targets};

/// Publish on this thread's cache: look up `subject` (from the cache when
/// current), deliver, and return how many subscriptions matched.
pub(crate) fn publish(
    shared: &Shared,
    subject: &str,
    reply: Option<Arc<str>>,
    headers: Option<Bytes>,
    payload: Bytes,
) -> Result<usize, Error> {
    let generation = shared.generation.load(Ordering::Acquire);
    CACHE.with(|cell| match cell.try_borrow_mut() {
        Ok(mut cache) => cache.publish(shared, generation, subject, reply, headers, payload),
        // Only a re-entrant publish (a responder's handler publishing
        // while its request is delivered) finds the cell taken; it routes
        // with a cache of its own.
        Err(_) => {
            let mut own = PublishCache::EMPTY;
            own.publish(shared, generation, subject, reply, headers, payload)
        }
    })
}

thread_local! {
    static CACHE: std::cell::RefCell<PublishCache> = const { std::cell::RefCell::new(PublishCache::EMPTY) };
}

/// Subjects a thread keeps the targets of.
const CACHED_SUBJECTS: usize = 4;

/// The targets of the subjects a thread last published on.
struct PublishCache {
    entries: [CachedTargets; CACHED_SUBJECTS],
    /// The entry used last, looked at first.
    last: usize,
    /// The entry to replace next when none is stale.
    victim: usize,
}

impl PublishCache {
    const EMPTY: PublishCache = PublishCache {
        entries: [CachedTargets::EMPTY; CACHED_SUBJECTS],
        last: 0,
        victim: 0,
    };

    #[inline(always)]
    fn publish(
        &mut self,
        shared: &Shared,
        generation: u64,
        subject: &str,
        reply: Option<Arc<str>>,
        headers: Option<Bytes>,
        payload: Bytes,
    ) -> Result<usize, Error> {
        let last = self.last % CACHED_SUBJECTS;
        let index = if self.entries[last].serves(generation, subject) {
            last
        } else {
            self.find(shared, generation, subject)?
        };
        let entry = &self.entries[index];
        match &entry.subject {
            Some(kept) => deliver_in_process(
                shared,
                kept,
                &entry.targets.local,
                entry.remote.as_ref(),
                reply,
                headers,
                payload,
            ),
            None => Ok(0),
        }
    }

    /// The index of an entry for `subject`, looking it up afresh if no kept one
    /// serves.
    #[cold]
    #[inline(never)]
    fn find(&mut self, shared: &Shared, generation: u64, subject: &str) -> Result<usize, Error> {
        let index =
            match (0..CACHED_SUBJECTS).find(|&i| self.entries[i].serves(generation, subject)) {
                Some(index) => index,
                None => {
                    let index = match (0..CACHED_SUBJECTS)
                        .find(|&i| self.entries[i].generation != generation)
                    {
                        Some(stale) => stale,
                        None => {
                            self.victim = (self.victim + 1) % CACHED_SUBJECTS;
                            self.victim
                        }
                    };
                    self.entries[index].refresh(shared, subject)?;
                    index
                }
            };
        self.last = index;
        Ok(index)
    }
}

/// An entry kept by a publishing thread.
struct CachedTargets {
    /// The subscription table generation `targets` was computed at; 0 when they may not
    /// be reused (generations start at 1).
    generation: u64,
    subject: Option<Arc<str>>,
    targets: Targets,
    /// `targets.remote`, shared (`None` when empty), which deliveries use
    /// instead of it: each message to remote peers hands the event loop a
    /// reference rather than a copy (an allocation per message, freed on
    /// the loop's thread).
    remote: Option<Arc<[SubRef]>>,
}

impl CachedTargets {
    const EMPTY: CachedTargets = CachedTargets {
        generation: 0,
        subject: None,
        targets: Targets::new(),
        remote: None,
    };

    /// Whether this entry is current and for `subject`.
    #[inline(always)]
    fn serves(&self, generation: u64, subject: &str) -> bool {
        self.generation == generation && self.subject.as_deref().is_some_and(|kept| kept == subject)
    }

    /// Look `subject` up afresh under the read lock. An entry with a queue
    /// group is used for this message only (its member is picked per
    /// message), and so is not kept.
    fn refresh(&mut self, shared: &Shared, subject: &str) -> Result<(), Error> {
        self.generation = 0;
        let table = shared.subscriptions.read();
        // Read under the lock: no change can happen before routing below.
        let generation = shared.generation.load(Ordering::Acquire);
        let stable = table
            .lookup_stable(subject, &mut self.targets)
            .map_err(|source| Error::Subject {
                subject: subject.to_string(),
                source,
            })?;
        drop(table);
        let remote = &self.targets.remote;
        self.remote = (!remote.is_empty()).then(|| Arc::from(remote.as_slice()));
        if self.subject.as_deref() != Some(subject) {
            self.subject = Some(Arc::from(subject));
        }
        if stable {
            self.generation = generation;
        }
        Ok(())
    }
}
