//! Restoring sender order on links that do not keep it.
//!
//! A link without `FI_ORDER_SAS` (EFA RDM without it granted, EFA DGRAM) may
//! deliver a sender's frames out of order. The sender numbers them, and a
//! [`ReorderBuffer`] per sender releases them in order, once each. It owns
//! the window bound and the policy for gaps; it does no I/O and reads no
//! clock (time comes in as `now`).
//!
//! # Sequence numbers
//!
//! Sequences are `u64`, start at 1 (0 means "not sequenced" on the wire and
//! is rejected here) and increase by one per frame. The buffer holds items
//! with sequence numbers in `[expected, expected + capacity)`.
//!
//! # Gaps
//!
//! [`GapPolicy::Wait`] waits for a gap for ever, and an item beyond the
//! window is a protocol error ([`ReorderError::WindowExceeded`]): the
//! sender's credit window must keep it within `capacity`.
//!
//! [`GapPolicy::FailAfter`] is for reliable links, where a gap should fill
//! but a lost message must not stall the link for ever: it waits and
//! refuses beyond the window like `Wait`, but once an item has waited the
//! given time behind a gap with no progress on it (a release, or
//! [`ReorderBuffer::note_progress`] for a piece of a missing item),
//! [`ReorderBuffer::check_gap`] reports [`ReorderError::GapTimeout`].
//! Nothing is skipped: the owner gives the link up.
//!
//! [`GapPolicy::SkipAfter`] is for best-effort links: no item is held longer
//! than the given time. Once the oldest held item has waited that long, every
//! missing sequence before it is declared lost and skipped. An item beyond
//! the window likewise skips ahead at once, releasing what it pushes out of
//! the window in order. Items that arrive after their sequence was skipped
//! are dropped and counted as duplicates.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use thiserror::Error;

/// What to do about a missing sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GapPolicy {
    /// Wait for it for ever.
    Wait,
    /// Give it up once an item behind it has waited this long (best effort).
    SkipAfter(Duration),
    /// Report it once an item has waited this long behind it with no
    /// progress on the gap (reliable links).
    FailAfter(Duration),
}

/// Bounds and policy of a [`ReorderBuffer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReorderConfig {
    /// Width of the window: sequences `expected .. expected + capacity` are
    /// accepted; at most `capacity - 1` items are held.
    pub capacity: usize,
    /// What to do about a missing sequence.
    pub gap_policy: GapPolicy,
}

impl Default for ReorderConfig {
    /// A window of 4096 and [`GapPolicy::Wait`].
    fn default() -> Self {
        ReorderConfig {
            capacity: 4096,
            gap_policy: GapPolicy::Wait,
        }
    }
}

/// Counters of a [`ReorderBuffer`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReorderStats {
    /// Items released in order.
    pub released: u64,
    /// Items dropped because their sequence was already released, held or
    /// skipped.
    pub duplicates: u64,
    /// Items refused beyond the window ([`GapPolicy::Wait`]).
    pub window_exceeded: u64,
    /// Sequences declared lost ([`GapPolicy::SkipAfter`]).
    pub lost: u64,
    /// Times the gap timeout skipped ahead.
    pub gap_timeouts: u64,
    /// Times an item beyond the window skipped ahead.
    pub window_skips: u64,
    /// Times the owner gave a gap up early ([`ReorderBuffer::skip_first_gap`]).
    pub early_skips: u64,
    /// Times [`ReorderBuffer::check_gap`] found a gap overdue
    /// ([`GapPolicy::FailAfter`]).
    pub gap_failures: u64,
}

/// Why an item was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ReorderError {
    /// Sequence 0 was pushed; sequences start at 1.
    #[error("sequence number 0 is not a sequence (sequences start at 1)")]
    ZeroSeq,
    /// Under [`GapPolicy::Wait`] or [`GapPolicy::FailAfter`], the sender
    /// ran ahead of the window.
    #[error("sequence {seq} is beyond the reorder window ({expected} + {capacity})")]
    WindowExceeded {
        /// The sequence refused.
        seq: u64,
        /// The next sequence to be released.
        expected: u64,
        /// Width of the window.
        capacity: usize,
    },
    /// Under [`GapPolicy::FailAfter`], items waited too long behind a gap.
    #[error("sequence {missing} still missing after {waited:?}, {held} items waiting behind it")]
    GapTimeout {
        /// The first missing sequence.
        missing: u64,
        /// Items waiting behind it.
        held: usize,
        /// How long without progress.
        waited: Duration,
    },
}

/// What [`ReorderBuffer::push`] did with an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Taken; `released` items (this one possibly among them) were appended
    /// to the output.
    Accepted {
        /// Items appended to the output by this push.
        released: usize,
    },
    /// Dropped as a duplicate (or as late, after its sequence was skipped);
    /// the gap timeout may still have released `released` items.
    Duplicate {
        /// Items appended to the output by this push.
        released: usize,
    },
}

/// Releases one sender's items in sequence order. See the module docs.
#[derive(Debug)]
pub struct ReorderBuffer<T> {
    config: ReorderConfig,
    /// Next sequence to release; slot 0 of `slots` is for it.
    expected: u64,
    slots: VecDeque<Option<T>>,
    held: usize,
    /// Arrival time and sequence of held items, oldest first (not under
    /// `Wait`); entries for released items are dropped lazily.
    arrivals: VecDeque<(Instant, u64)>,
    /// Under `FailAfter`: the last release or piece of the first gap.
    progress: Option<Instant>,
    stats: ReorderStats,
}

impl<T> ReorderBuffer<T> {
    /// A buffer expecting sequence 1. A capacity of 0 is taken as 1.
    pub fn new(config: ReorderConfig) -> Self {
        let config = ReorderConfig {
            capacity: config.capacity.max(1),
            ..config
        };
        ReorderBuffer {
            config,
            expected: 1,
            slots: VecDeque::new(),
            held: 0,
            arrivals: VecDeque::new(),
            progress: None,
            stats: ReorderStats::default(),
        }
    }

    /// The window and policy in force (capacity at least 1).
    pub fn config(&self) -> &ReorderConfig {
        &self.config
    }

    /// Counters since creation.
    pub fn stats(&self) -> &ReorderStats {
        &self.stats
    }

    /// The next sequence to be released.
    pub fn expected(&self) -> u64 {
        self.expected
    }

    /// Items held waiting for a gap to fill.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Take item `seq`, appending to `out` every item that is now in order.
    /// Under [`GapPolicy::SkipAfter`] this also applies the gap timeout at
    /// `now`, as [`poll`](ReorderBuffer::poll) does.
    pub fn push(
        &mut self,
        now: Instant,
        seq: u64,
        item: T,
        out: &mut Vec<T>,
    ) -> Result<Pushed, ReorderError> {
        if seq == 0 {
            return Err(ReorderError::ZeroSeq);
        }
        let before = out.len();
        // Give up what is already due first, so the item meets the window
        // as it stands now.
        self.poll(now, out);
        let accepted = self.insert(now, seq, item, out)?;
        self.poll(now, out);
        let released = out.len() - before;
        Ok(if accepted {
            Pushed::Accepted { released }
        } else {
            self.stats.duplicates += 1;
            Pushed::Duplicate { released }
        })
    }

    /// Places one item; `Ok(false)` for a duplicate.
    fn insert(
        &mut self,
        now: Instant,
        seq: u64,
        item: T,
        out: &mut Vec<T>,
    ) -> Result<bool, ReorderError> {
        if seq < self.expected {
            return Ok(false);
        }
        let capacity = self.config.capacity as u64;
        // Sequences count up from 1: skipping towards one within a window
        // of the end of the range would carry `expected` past `u64::MAX`.
        if seq > u64::MAX - capacity {
            self.stats.window_exceeded += 1;
            return Err(ReorderError::WindowExceeded {
                seq,
                expected: self.expected,
                capacity: self.config.capacity,
            });
        }
        if seq - self.expected >= capacity {
            match self.config.gap_policy {
                GapPolicy::Wait | GapPolicy::FailAfter(_) => {
                    self.stats.window_exceeded += 1;
                    return Err(ReorderError::WindowExceeded {
                        seq,
                        expected: self.expected,
                        capacity: self.config.capacity,
                    });
                }
                GapPolicy::SkipAfter(_) => {
                    self.stats.window_skips += 1;
                    self.skip_to(seq - capacity + 1, out);
                }
            }
        }
        // Skipping never passes `seq` (everything held is below it), so
        // this only guards the arithmetic.
        if seq < self.expected {
            return Ok(false);
        }
        // seq - expected < capacity, a usize.
        let offset = (seq - self.expected) as usize;
        if offset < self.slots.len() && self.slots[offset].is_some() {
            return Ok(false);
        }
        if offset >= self.slots.len() {
            self.slots.resize_with(offset + 1, || None);
        }
        self.slots[offset] = Some(item);
        self.held += 1;
        if offset == 0 {
            self.release_run(out);
            self.progress = Some(now);
        } else if !matches!(self.config.gap_policy, GapPolicy::Wait) {
            self.arrivals.push_back((now, seq));
        }
        Ok(true)
    }

    /// Apply the gap timeout at `now` (nothing under [`GapPolicy::Wait`]),
    /// appending released items to `out`. Returns how many were released.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<T>) -> usize {
        let GapPolicy::SkipAfter(limit) = self.config.gap_policy else {
            return 0;
        };
        let before = out.len();
        while let Some((arrived, seq)) = self.oldest_held() {
            if now.saturating_duration_since(arrived) < limit {
                break;
            }
            self.stats.gap_timeouts += 1;
            self.skip_to(seq, out);
        }
        out.len() - before
    }

    /// Under [`GapPolicy::SkipAfter`]: gives up the missing sequences
    /// before the first held item now, as the gap timeout would later (the
    /// owner judged they will not come), appending what is released to
    /// `out`. Returns how many were released.
    pub fn skip_first_gap(&mut self, out: &mut Vec<T>) -> usize {
        if !matches!(self.config.gap_policy, GapPolicy::SkipAfter(_)) {
            return 0;
        }
        let Some(offset) = self.slots.iter().position(Option::is_some) else {
            return 0;
        };
        let before = out.len();
        self.stats.early_skips += 1;
        self.skip_to(self.expected + offset as u64, out);
        out.len() - before
    }

    /// Under [`GapPolicy::SkipAfter`], with nothing held: gives up the
    /// expected sequence alone (the owner judged it will not come, though
    /// no later one is whole yet). Returns whether it did.
    pub fn skip_expected(&mut self, out: &mut Vec<T>) -> bool {
        if !matches!(self.config.gap_policy, GapPolicy::SkipAfter(_)) || self.held > 0 {
            return false;
        }
        self.stats.early_skips += 1;
        self.skip_to(self.expected + 1, out);
        true
    }

    /// When [`poll`](ReorderBuffer::poll) will next skip a gap
    /// (`SkipAfter`), or [`check_gap`](ReorderBuffer::check_gap) report
    /// one (`FailAfter`), if ever.
    pub fn next_deadline(&self) -> Option<Instant> {
        let oldest = self
            .arrivals
            .iter()
            .find(|(_, seq)| *seq >= self.expected)
            .map(|(arrived, _)| *arrived);
        match self.config.gap_policy {
            GapPolicy::Wait => None,
            GapPolicy::SkipAfter(limit) => oldest.map(|arrived| arrived + limit),
            GapPolicy::FailAfter(limit) => oldest.map(|arrived| self.gap_since(arrived) + limit),
        }
    }

    /// Under [`GapPolicy::FailAfter`]: a piece of item `seq` arrived that
    /// does not complete it. If `seq` lies in the first gap, the gap is
    /// being filled (a large item arriving in many pieces), and its clock
    /// starts again.
    pub fn note_progress(&mut self, now: Instant, seq: u64) {
        if !matches!(self.config.gap_policy, GapPolicy::FailAfter(_))
            || self.held == 0
            || seq < self.expected
        {
            return;
        }
        // Held items lie within the window, so the offset fits.
        let offset = (seq - self.expected) as usize;
        if offset < self.slots.len() && self.slots.iter().take(offset + 1).all(Option::is_none) {
            self.progress = Some(now);
        }
    }

    /// Under [`GapPolicy::FailAfter`]: start the first gap's clock again at
    /// `now`, as after progress on it (the owner could not watch it for a
    /// while).
    pub fn restart_gap_clock(&mut self, now: Instant) {
        if matches!(self.config.gap_policy, GapPolicy::FailAfter(_)) && self.held > 0 {
            self.progress = Some(now);
        }
    }

    /// Under [`GapPolicy::FailAfter`]: the gap before the held items, if it
    /// has gone without progress for the limit at `now`
    /// ([`ReorderError::GapTimeout`]). Nothing changes either way: the
    /// owner gives the link up.
    pub fn check_gap(&mut self, now: Instant) -> Result<(), ReorderError> {
        let GapPolicy::FailAfter(limit) = self.config.gap_policy else {
            return Ok(());
        };
        let Some((arrived, _)) = self.oldest_held() else {
            return Ok(());
        };
        let waited = now.saturating_duration_since(self.gap_since(arrived));
        if waited < limit {
            return Ok(());
        }
        self.stats.gap_failures += 1;
        Err(ReorderError::GapTimeout {
            missing: self.expected,
            held: self.held,
            waited,
        })
    }

    /// Since when the first gap has gone without progress, given when the
    /// oldest item behind it arrived.
    fn gap_since(&self, arrived: Instant) -> Instant {
        self.progress
            .map_or(arrived, |progress| progress.max(arrived))
    }

    /// Drops arrival records of released items; returns the oldest left.
    fn oldest_held(&mut self) -> Option<(Instant, u64)> {
        self.prune_arrivals();
        self.arrivals.front().copied()
    }

    /// Drops the arrival records of released items from the front: the
    /// records of items released behind one still held go with it (the
    /// window bounds how long that is held).
    fn prune_arrivals(&mut self) {
        while self
            .arrivals
            .front()
            .is_some_and(|&(_, seq)| seq < self.expected)
        {
            self.arrivals.pop_front();
        }
    }

    /// Release everything before `target` (counting holes as lost), then the
    /// in-order run from `target`.
    fn skip_to(&mut self, target: u64, out: &mut Vec<T>) {
        while self.expected < target {
            match self.slots.pop_front() {
                Some(Some(item)) => {
                    self.held -= 1;
                    self.stats.released += 1;
                    out.push(item);
                }
                Some(None) => self.stats.lost += 1,
                None => {
                    self.stats.lost += target - self.expected;
                    self.expected = target;
                    break;
                }
            }
            self.expected += 1;
        }
        self.release_run(out);
    }

    fn release_run(&mut self, out: &mut Vec<T>) {
        while let Some(Some(_)) = self.slots.front() {
            if let Some(Some(item)) = self.slots.pop_front() {
                self.held -= 1;
                self.stats.released += 1;
                self.expected += 1;
                out.push(item);
            }
        }
        // Keep no trailing empty slots at the front of an empty buffer,
        // nor arrival records of items all released: under `FailAfter`
        // nothing else drops them while gaps keep filling in time.
        if self.held == 0 {
            self.slots.clear();
            self.arrivals.clear();
        } else {
            self.prune_arrivals();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_at_the_end_of_the_range_are_refused() {
        let now = Instant::now();
        let mut buf = ReorderBuffer::new(ReorderConfig {
            capacity: 8,
            gap_policy: GapPolicy::SkipAfter(Duration::from_millis(10)),
        });
        let mut out = Vec::new();
        assert!(buf.push(now, u64::MAX, 1, &mut out).is_err());
        assert!(buf.push(now, u64::MAX - 7, 1, &mut out).is_err());
        buf.poll(now + Duration::from_millis(20), &mut out);
        assert!(out.is_empty());
        assert_eq!(buf.stats().lost, 0);
        buf.push(now, u64::MAX - 8, 1, &mut out)
            .expect("the last usable");
    }

    #[test]
    fn arrival_records_stay_bounded_while_gaps_keep_filling() {
        // 2, 4, 1, 6, 3, 8, 5, ...: something is held at every moment,
        // and every gap fills at once.
        let now = Instant::now();
        let mut buf = ReorderBuffer::new(ReorderConfig {
            capacity: 64,
            gap_policy: GapPolicy::FailAfter(Duration::from_secs(3600)),
        });
        let mut out = Vec::new();
        buf.push(now, 2, 2, &mut out).unwrap();
        for k in 1..=10_000u64 {
            buf.push(now, 2 * k + 2, 2 * k + 2, &mut out).unwrap();
            buf.push(now, 2 * k - 1, 2 * k - 1, &mut out).unwrap();
            assert_eq!(buf.held(), 1);
            assert!(buf.arrivals.len() <= 2, "{} records", buf.arrivals.len());
        }
        assert_eq!(out.len(), 20_000);
    }

    #[test]
    fn skip_first_gap_gives_up_only_the_first_gap() {
        let now = Instant::now();
        let mut buf = ReorderBuffer::new(ReorderConfig {
            capacity: 64,
            gap_policy: GapPolicy::SkipAfter(Duration::from_secs(3600)),
        });
        let mut out = Vec::new();
        for seq in [3, 4, 7] {
            buf.push(now, seq, seq, &mut out).unwrap();
        }
        assert!(out.is_empty());
        assert_eq!(buf.skip_first_gap(&mut out), 2);
        assert_eq!(out, vec![3, 4]);
        assert_eq!((buf.expected(), buf.stats().lost), (5, 2));
        assert_eq!(buf.skip_first_gap(&mut out), 1);
        assert_eq!(out, vec![3, 4, 7]);
        assert_eq!(buf.skip_first_gap(&mut out), 0, "nothing held");
        assert_eq!(buf.stats().early_skips, 2);
        // With nothing held, the expected sequence alone can be given up.
        assert!(buf.skip_expected(&mut out));
        assert_eq!((buf.expected(), buf.stats().lost), (9, 5));
        assert_eq!(buf.stats().early_skips, 3);
        buf.push(now, 9, 9, &mut out).unwrap();
        assert_eq!(out, vec![3, 4, 7, 9]);
        // Late ones are duplicates now.
        assert_eq!(
            buf.push(now, 6, 6, &mut out),
            Ok(Pushed::Duplicate { released: 0 })
        );
    }

    #[test]
    fn releases_in_order() {
        let now = Instant::now();
        let mut buf = ReorderBuffer::new(ReorderConfig::default());
        let mut out = Vec::new();
        assert_eq!(
            buf.push(now, 2, 'b', &mut out),
            Ok(Pushed::Accepted { released: 0 })
        );
        assert_eq!(
            buf.push(now, 1, 'a', &mut out),
            Ok(Pushed::Accepted { released: 2 })
        );
        assert_eq!(
            buf.push(now, 1, 'a', &mut out),
            Ok(Pushed::Duplicate { released: 0 })
        );
        assert_eq!(out, vec!['a', 'b']);
        assert_eq!(buf.expected(), 3);
        assert_eq!(buf.push(now, 0, 'z', &mut out), Err(ReorderError::ZeroSeq));
    }

    #[test]
    fn fail_after_reports_a_gap_without_progress_and_skips_nothing() {
        let t0 = Instant::now();
        let limit = Duration::from_millis(10);
        let mut buf = ReorderBuffer::new(ReorderConfig {
            capacity: 8,
            gap_policy: GapPolicy::FailAfter(limit),
        });
        let mut out = Vec::new();
        buf.push(t0, 4, 4, &mut out).unwrap();
        assert_eq!(buf.next_deadline(), Some(t0 + limit));
        // Progress only counts for the first gap (1 to 3).
        buf.note_progress(t0 + limit / 2, 5);
        assert_eq!(buf.next_deadline(), Some(t0 + limit));
        buf.note_progress(t0 + limit / 2, 2);
        assert_eq!(buf.next_deadline(), Some(t0 + limit + limit / 2));
        assert_eq!(buf.check_gap(t0 + limit), Ok(()));
        assert_eq!(
            buf.check_gap(t0 + 2 * limit),
            Err(ReorderError::GapTimeout {
                missing: 1,
                held: 1,
                waited: limit + limit / 2
            })
        );
        assert_eq!(buf.stats().gap_failures, 1);
        // Nothing was skipped; beyond the window is refused as under Wait.
        assert_eq!(buf.poll(t0 + 3 * limit, &mut out), 0);
        assert!(buf.push(t0, 9, 9, &mut out).is_err());
        // Filling the gap releases in order and clears the deadline.
        for seq in 1..=3 {
            buf.push(t0 + 3 * limit, seq, seq, &mut out).unwrap();
        }
        assert_eq!(out, vec![1, 2, 3, 4]);
        assert_eq!(buf.next_deadline(), None);
        assert_eq!(buf.check_gap(t0 + 9 * limit), Ok(()));
        // A later gap is timed from the release that left it.
        buf.push(t0 + 3 * limit, 6, 6, &mut out).unwrap();
        buf.push(t0 + 4 * limit, 5, 5, &mut out).unwrap();
        buf.push(t0 + 2 * limit, 8, 8, &mut out).unwrap();
        assert_eq!(buf.next_deadline(), Some(t0 + 5 * limit));
    }

    #[test]
    fn gap_timeout_skips_only_after_the_limit() {
        let t0 = Instant::now();
        let limit = Duration::from_millis(10);
        let mut buf = ReorderBuffer::new(ReorderConfig {
            capacity: 8,
            gap_policy: GapPolicy::SkipAfter(limit),
        });
        let mut out = Vec::new();
        buf.push(t0, 3, 3, &mut out).unwrap();
        assert_eq!(buf.next_deadline(), Some(t0 + limit));
        assert_eq!(buf.poll(t0 + limit / 2, &mut out), 0);
        assert_eq!(buf.poll(t0 + limit, &mut out), 1);
        assert_eq!(out, vec![3]);
        assert_eq!(buf.stats().lost, 2);
        assert_eq!(
            buf.push(t0, 1, 1, &mut out),
            Ok(Pushed::Duplicate { released: 0 })
        );
    }
}
