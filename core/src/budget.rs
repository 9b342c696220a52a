//! Memory that several holders draw from together.
//!
//! A [`MemoryBudget`] is a byte count shared by clones, with a limit: the
//! link receivers of one broker (or one client) hold one between them, so
//! that what peers make them buffer for reordering and reassembly stays
//! within one bound however many links there are. Holders reserve before
//! they hold and release what they let go; a holder that is dropped
//! releases what it still holds.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A byte budget shared by its clones. See the module docs.
#[derive(Clone)]
pub struct MemoryBudget {
    /// Bytes reserved by all clones; `None` for an unlimited budget, which
    /// counts nothing.
    used: Option<Arc<AtomicUsize>>,
    limit: usize,
}

/// Why [`MemoryBudget::try_reserve`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetRefusal {
    /// Bytes asked for.
    pub needed: usize,
    /// Bytes reserved by all holders at the time.
    pub used: usize,
    /// The budget's limit.
    pub limit: usize,
}

impl MemoryBudget {
    /// A budget of `limit` bytes, none reserved.
    pub fn new(limit: usize) -> MemoryBudget {
        MemoryBudget {
            used: Some(Arc::new(AtomicUsize::new(0))),
            limit,
        }
    }

    /// A budget that refuses nothing and counts nothing.
    pub fn unlimited() -> MemoryBudget {
        MemoryBudget {
            used: None,
            limit: usize::MAX,
        }
    }

    /// The limit in bytes (`usize::MAX` when unlimited).
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes reserved by all holders now (0 when unlimited).
    pub fn used(&self) -> usize {
        self.used
            .as_ref()
            .map_or(0, |used| used.load(Ordering::Acquire))
    }

    /// Reserve `bytes` if the total stays within the limit.
    pub fn try_reserve(&self, bytes: usize) -> Result<(), BudgetRefusal> {
        let Some(used) = &self.used else {
            return Ok(());
        };
        let limit = self.limit;
        used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
            now.checked_add(bytes).filter(|&total| total <= limit)
        })
        .map(|_| ())
        .map_err(|now| BudgetRefusal {
            needed: bytes,
            used: now,
            limit,
        })
    }

    /// Give back `bytes` reserved earlier.
    pub fn release(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        if let Some(used) = &self.used {
            // Saturating: a release without its reservation must not make
            // the budget look almost full.
            let _ = used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                Some(now.saturating_sub(bytes))
            });
        }
    }
}

impl Default for MemoryBudget {
    /// [`MemoryBudget::unlimited`].
    fn default() -> Self {
        MemoryBudget::unlimited()
    }
}

impl PartialEq for MemoryBudget {
    /// The same budget: clones of one, or both unlimited.
    fn eq(&self, other: &Self) -> bool {
        self.limit == other.limit
            && match (&self.used, &other.used) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

impl Eq for MemoryBudget {}

impl fmt::Debug for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.used {
            None => f.write_str("MemoryBudget(unlimited)"),
            Some(_) => write!(f, "MemoryBudget({} of {} bytes)", self.used(), self.limit),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_one_limit() {
        let a = MemoryBudget::new(100);
        let b = a.clone();
        assert_eq!(a, b);
        assert_ne!(a, MemoryBudget::new(100));
        a.try_reserve(60).unwrap();
        assert_eq!(
            b.try_reserve(41),
            Err(BudgetRefusal {
                needed: 41,
                used: 60,
                limit: 100
            })
        );
        b.try_reserve(40).unwrap();
        assert_eq!(a.used(), 100);
        a.release(60);
        assert_eq!(b.used(), 40);
        b.release(1000);
        assert_eq!(a.used(), 0);
    }

    #[test]
    fn unlimited_refuses_nothing() {
        let budget = MemoryBudget::unlimited();
        budget.try_reserve(usize::MAX).unwrap();
        budget.try_reserve(usize::MAX).unwrap();
        assert_eq!(budget.used(), 0);
        assert_eq!(budget, MemoryBudget::default());
    }
}
