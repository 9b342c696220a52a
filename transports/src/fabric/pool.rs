//! Buffer pools: one page-aligned, zero-filled allocation cut into equal
//! slots, registered once as a single memory region when the provider
//! needs descriptors (FI_MR_LOCAL), plus one operation context per slot.
//!
//! Registration first writes every page, so it only ever sees backed
//! memory (FI_MR_ALLOCATED); an unregistered pool's untouched pages cost
//! address space, not memory. The per-slot contexts are `struct fi_context2`
//! sized, which satisfies providers asking for FI_CONTEXT or FI_CONTEXT2,
//! and double as the slot index when a completion comes back.
//!
//! Parts of a slot may be lent out as [`Bytes`] instead of copied: the
//! bytes point into the pool, and the slot comes back (see
//! [`BufferPool::take_returned`]) once its owner has released it
//! ([`BufferPool::release`]: the provider is done with it) and every clone
//! of every part lent from it is dropped, on whatever thread. A slot
//! posted as a multi-receive buffer lends each message as it lands, while
//! the provider still fills the rest. The memory lives as long as the pool
//! or any lent bytes, whichever is longer; the region over it closes with
//! the pool.

use std::alloc::{self, Layout};
use std::ffi::c_void;
use std::ops::Range;
use std::ptr::{self, NonNull};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

use super::error::FabricError;
use super::handle::{Domain, MemoryRegion};

const PAGE: usize = 4096;

/// Writes one byte of each page of `buf`, so that every page has a frame
/// of its own (a fresh zeroed allocation may map all of them to the shared
/// zero page) before the memory is registered where the provider requires
/// backed memory (FI_MR_ALLOCATED).
pub fn touch_pages(buf: &mut [u8]) {
    let start = buf.as_ptr() as usize;
    // The first byte, then the first of every page after it: one in each
    // page the slice spans, wherever in its first page it begins.
    let mut offset = 0;
    while offset < buf.len() {
        // Not a store the compiler may drop as writing what is there.
        buf[offset] = std::hint::black_box(0);
        offset = ((start + offset) / PAGE + 1) * PAGE - start;
    }
}

/// Storage the provider may use per operation (`struct fi_context2`).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct OpContext([*mut c_void; 8]);

/// The pool's one allocation, freed when the pool and every lent slot are
/// gone.
struct PoolMemory {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the allocation is plain memory owned by this value; which bytes
// may be read or written when is ruled by the pool (slots posted to the
// provider, lent read-only), not by the thread that holds it.
unsafe impl Send for PoolMemory {}
// SAFETY: as above; shared references only read the pointer and layout.
unsafe impl Sync for PoolMemory {}

impl Drop for PoolMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `BufferPool::new` with this layout, freed
        // once; the pool closed its region before dropping its share.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Who holds each slot, and the slots whose last holder let go.
struct Returns {
    /// `slots.len()`, readable without the lock.
    count: AtomicUsize,
    /// Slots released and no longer lent, waiting to be posted again.
    slots: Mutex<Vec<usize>>,
    /// Per slot: one for each lent part still alive, plus one while its
    /// owner holds it ([`BufferPool::hold`] to [`BufferPool::release`]).
    holds: Box<[AtomicUsize]>,
}

impl Returns {
    /// Drops one hold on `slot`; true when it was the last.
    fn let_go(&self, slot: usize) -> bool {
        let before = self.holds[slot].fetch_sub(1, Ordering::AcqRel);
        debug_assert_ne!(before, 0, "slot {slot} let go of more often than held");
        before == 1
    }
}

/// Read-only bytes of one lent slot; gives the slot back when dropped.
struct LentSlot {
    /// Keeps the bytes valid after the pool is gone.
    _memory: Arc<PoolMemory>,
    start: *const u8,
    len: usize,
    slot: usize,
    returns: Arc<Returns>,
}

// SAFETY: the bytes are only read, and nothing writes them while they are
// lent: an ordinary slot is not posted again until every part is returned,
// and a multi-receive slot, still posted while it lends, lends only the
// messages the provider has completed, which it does not write again
// (later messages land after them), so any thread may hold them.
unsafe impl Send for LentSlot {}

impl AsRef<[u8]> for LentSlot {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `start..start+len` lies in `memory`, kept alive by the
        // Arc, and is not written while lent (see `BufferPool::lend`).
        unsafe { std::slice::from_raw_parts(self.start, self.len) }
    }
}

impl Drop for LentSlot {
    fn drop(&mut self) {
        if self.returns.let_go(self.slot) {
            let mut slots = self.returns.slots.lock();
            slots.push(self.slot);
            self.returns.count.store(slots.len(), Ordering::Release);
        }
    }
}

/// Equal slots in one registered allocation.
pub struct BufferPool {
    // Dropped first (declaration order): the region must close before the
    // memory may go.
    mr: Option<MemoryRegion>,
    mem: Arc<PoolMemory>,
    stride: usize,
    count: usize,
    contexts: Box<[OpContext]>,
    returns: Arc<Returns>,
}

impl BufferPool {
    /// `count` slots of `stride` bytes each.
    pub fn new(count: usize, stride: usize) -> Result<BufferPool, FabricError> {
        let bytes = count
            .checked_mul(stride)
            .filter(|&b| b > 0)
            .ok_or(FabricError::Alloc { bytes: usize::MAX })?;
        let layout =
            Layout::from_size_align(bytes, PAGE).map_err(|_| FabricError::Alloc { bytes })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(FabricError::Alloc { bytes })?;
        Ok(BufferPool {
            mr: None,
            mem: Arc::new(PoolMemory { ptr, layout }),
            stride,
            count,
            contexts: vec![OpContext([ptr::null_mut(); 8]); count].into_boxed_slice(),
            returns: Arc::new(Returns {
                count: AtomicUsize::new(0),
                slots: Mutex::new(Vec::new()),
                holds: (0..count).map(|_| AtomicUsize::new(0)).collect(),
            }),
        })
    }

    /// Keeps the pool's memory, its registration and its operation
    /// contexts for the rest of the process, for an endpoint left open
    /// (see `FiEndpoint::leave_open`) that may still refer to them.
    pub fn leave_allocated(&mut self) {
        std::mem::forget(Arc::clone(&self.mem));
        std::mem::forget(self.mr.take());
        Box::leak(std::mem::take(&mut self.contexts));
    }

    fn base(&self) -> *mut u8 {
        self.mem.ptr.as_ptr()
    }

    fn size(&self) -> usize {
        self.mem.layout.size()
    }

    /// Registers the whole pool once for `access` (FI_SEND or FI_RECV).
    pub fn register(
        &mut self,
        domain: &Rc<Domain>,
        access: u64,
        requested_key: u64,
    ) -> Result<(), FabricError> {
        // A fresh zeroed allocation may map every page to the shared zero
        // page; writing one byte per page gives each its own frame first.
        for offset in (0..self.size()).step_by(PAGE) {
            // SAFETY: `offset` is inside the allocation this pool owns, and
            // no operation is posted on the pool before it is registered.
            unsafe { ptr::write_volatile(self.base().add(offset), 0) };
        }
        // SAFETY: the memory is shared by this pool and its lent slots and
        // freed only after the region is closed (Drop closes `mr` first).
        let mr = unsafe {
            MemoryRegion::register(domain, self.base(), self.size(), access, requested_key)?
        };
        self.mr = Some(mr);
        Ok(())
    }

    /// The descriptor to pass with posts: the region's, or NULL when the
    /// pool is not registered.
    pub fn desc(&self) -> *mut c_void {
        self.mr.as_ref().map_or(ptr::null_mut(), MemoryRegion::desc)
    }

    pub fn is_registered(&self) -> bool {
        self.mr.is_some()
    }

    pub fn count(&self) -> usize {
        self.count
    }

    /// Start of slot `i` (the provider prefix comes first).
    pub fn slot_ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.count, "slot {i} of {}", self.count);
        // SAFETY: i < count, so the offset stays inside the allocation.
        unsafe { self.base().add(i * self.stride) }
    }

    /// Whether `bytes` lie wholly inside this pool's memory (e.g. a frame
    /// lent from it), so the pool's descriptor covers them.
    pub fn contains(&self, bytes: &[u8]) -> bool {
        let start = bytes.as_ptr() as usize;
        let base = self.base() as usize;
        start >= base && start + bytes.len() <= base + self.size()
    }

    /// The owner takes slot `i` (to post it); it comes back to the owner
    /// when [`release`](Self::release) says so, or else through
    /// [`take_returned`](Self::take_returned).
    pub fn hold(&self, i: usize) {
        let before = self.returns.holds[i].fetch_add(1, Ordering::AcqRel);
        debug_assert_eq!(before, 0, "slot {i} taken while held");
    }

    /// The owner lets go of slot `i` (the provider is done with it): true
    /// when nothing lent from it is alive, so it may be posted again now;
    /// false when the last lent part to be dropped hands it back.
    pub fn release(&self, i: usize) -> bool {
        self.returns.let_go(i)
    }

    /// Bytes `range` of slot `i`, without copying.
    ///
    /// # Safety
    /// The owner holds the slot ([`hold`](Self::hold), not yet
    /// [`release`](Self::release)d); no operation writes `range` any more
    /// (its completion was read); and nothing writes it again before
    /// [`take_returned`](Self::take_returned) hands the slot back.
    pub unsafe fn lend(&self, i: usize, range: Range<usize>) -> Bytes {
        assert!(
            range.start <= range.end && range.end <= self.stride,
            "range {range:?} of a {}-byte slot",
            self.stride
        );
        // SAFETY: slot_ptr checks i; the range is inside the slot.
        let start = unsafe { self.slot_ptr(i).add(range.start) };
        let before = self.returns.holds[i].fetch_add(1, Ordering::AcqRel);
        debug_assert_ne!(before, 0, "slot {i} lent while not held");
        Bytes::from_owner(LentSlot {
            _memory: self.mem.clone(),
            start,
            len: range.len(),
            slot: i,
            returns: self.returns.clone(),
        })
    }

    /// Moves the slots released whose last lent bytes were dropped since
    /// the last call into `into`; returns how many.
    pub fn take_returned(&self, into: &mut Vec<usize>) -> usize {
        if self.returns.count.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut slots = self.returns.slots.lock();
        let n = slots.len();
        into.append(&mut slots);
        self.returns.count.store(0, Ordering::Release);
        n
    }

    /// `len` bytes of slot `i` from `at`, a pointer a completion reported
    /// (where a message landed in a multi-receive buffer), or `None` when
    /// they do not lie wholly in the slot.
    ///
    /// # Safety
    /// No operation writes those bytes any more (their completion was
    /// read).
    pub unsafe fn landed(&self, i: usize, at: *const u8, len: usize) -> Option<(usize, &[u8])> {
        let offset = (at as usize).checked_sub(self.slot_ptr(i) as usize)?;
        if offset.checked_add(len)? > self.stride {
            return None;
        }
        // SAFETY: inside slot i (checked above), and the caller guarantees
        // the provider no longer writes them.
        let bytes = unsafe { std::slice::from_raw_parts(at, len) };
        Some((offset, bytes))
    }

    /// Bytes `range` of slot `i` for reading.
    ///
    /// # Safety
    /// No operation writes those bytes any more (their completion was
    /// read).
    pub unsafe fn part(&self, i: usize, range: Range<usize>) -> &[u8] {
        assert!(
            range.start <= range.end && range.end <= self.stride,
            "range {range:?} of a {}-byte slot",
            self.stride
        );
        // SAFETY: inside slot i (slot_ptr checks i), and the caller
        // guarantees the provider no longer writes them.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(i).add(range.start), range.len()) }
    }

    /// Slot `i` for reading.
    ///
    /// # Safety
    /// No operation using the slot may be posted (its completion was read,
    /// or it was never posted).
    pub unsafe fn slot(&self, i: usize) -> &[u8] {
        // SAFETY: in bounds (slot_ptr checks i), and the caller guarantees
        // the provider is not writing it.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(i), self.stride) }
    }

    /// Slot `i` for writing.
    ///
    /// # Safety
    /// As for [`slot`](Self::slot), and the slot is not lent (bytes from
    /// [`lend`](Self::lend) may still point into it).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: as above; `&mut self` excludes other Rust borrows, and the
        // caller guarantees no lent bytes point into the slot.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(i), self.stride) }
    }

    /// The operation context to post with slot `i`.
    pub fn context(&mut self, i: usize) -> *mut c_void {
        ptr::addr_of_mut!(self.contexts[i]).cast()
    }

    /// Which slot a completion's `op_context` belongs to, if any.
    pub fn slot_of(&self, context: *mut c_void) -> Option<usize> {
        let base = self.contexts.as_ptr() as usize;
        let size = std::mem::size_of::<OpContext>();
        let offset = (context as usize).checked_sub(base)?;
        let i = offset / size;
        (offset % size == 0 && i < self.count).then_some(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which of the pages from the one holding `from` on, `count` of
    /// them, are resident (`mincore`).
    fn resident_pages(from: *const u8, count: usize) -> Vec<bool> {
        let first = from as usize / PAGE * PAGE;
        let mut resident = vec![0u8; count];
        // SAFETY: the range starts at a page boundary and lies within one
        // live allocation (the caller's); `resident` has a byte per page.
        let done = unsafe {
            libc::mincore(
                first as *mut libc::c_void,
                count * PAGE,
                resident.as_mut_ptr(),
            )
        };
        assert_eq!(done, 0, "mincore");
        resident.iter().map(|page| page & 1 == 1).collect()
    }

    #[test]
    fn every_page_a_slice_spans_is_touched() {
        // Large enough to be a mapping of its own, untouched until here.
        let mut buf = vec![0u8; 8 << 20];
        let first = (buf.as_ptr() as usize).div_ceil(PAGE) * PAGE;
        // SAFETY: advice on whole pages inside the allocation: where
        // transparent huge pages are always on, a write would make its
        // untouched neighbours resident too.
        let advised =
            unsafe { libc::madvise(first as *mut libc::c_void, 64 * PAGE, libc::MADV_NOHUGEPAGE) };
        assert_eq!(advised, 0, "madvise");
        // Two pages' worth starting 64 bytes into page 10: it spans three.
        let at = first - buf.as_ptr() as usize + 10 * PAGE + 64;
        let slice = &mut buf[at..at + 2 * PAGE];
        touch_pages(slice);
        let page_before = slice.as_ptr().wrapping_sub(PAGE);
        assert_eq!(
            resident_pages(page_before, 5),
            [false, true, true, true, false],
            "the pages before, of and after the slice"
        );
    }

    #[test]
    fn slots_and_contexts_map_back_to_indices() {
        let mut pool = BufferPool::new(4, 128).unwrap();
        assert_eq!(pool.count(), 4);
        assert!(!pool.is_registered());
        assert!(pool.desc().is_null());
        assert_eq!(pool.slot_ptr(0) as usize % PAGE, 0);
        assert_eq!(
            pool.slot_ptr(3) as usize - pool.slot_ptr(0) as usize,
            3 * 128
        );
        for i in 0..4 {
            let ctx = pool.context(i);
            assert_eq!(pool.slot_of(ctx), Some(i));
        }
        let inside = (pool.context(1) as usize + 8) as *mut c_void;
        assert_eq!(pool.slot_of(inside), None);
        assert_eq!(pool.slot_of(ptr::null_mut()), None);
        let past = (pool.context(3) as usize + 64) as *mut c_void;
        assert_eq!(pool.slot_of(past), None);
        // SAFETY: nothing is posted on this pool.
        unsafe {
            pool.slot_mut(2)[..3].copy_from_slice(b"abc");
            assert_eq!(&pool.slot(2)[..3], b"abc");
            assert!(pool.slot(1).iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn contains_covers_exactly_the_pool() {
        let pool = BufferPool::new(2, 128).unwrap();
        // SAFETY: nothing is posted on this pool; the slices are only
        // compared by address.
        let (first, last) = unsafe { (pool.slot(0), pool.slot(1)) };
        assert!(pool.contains(first));
        assert!(pool.contains(&last[127..]));
        assert!(pool.contains(&last[128..]), "an empty slice at the end");
        let outside = [0u8; 4];
        assert!(!pool.contains(&outside));
        // One byte past the end: a slice that starts inside and overruns.
        // SAFETY: the pointer is only compared, never read.
        let overrun = unsafe { std::slice::from_raw_parts(last.as_ptr().add(1), 128) };
        assert!(!pool.contains(overrun));
    }

    #[test]
    fn lent_bytes_come_back_once_dropped() {
        let mut pool = BufferPool::new(3, 64).unwrap();
        // SAFETY: nothing is posted on this pool.
        unsafe { pool.slot_mut(1)[..4].copy_from_slice(b"lend") };
        pool.hold(1);
        // SAFETY: slot 1 is held and not posted, and not touched until it
        // is back.
        let lent = unsafe { pool.lend(1, 0..4) };
        let clone = lent.slice(1..);
        let mut back = Vec::new();
        assert!(!pool.release(1), "lent bytes still hold it");
        assert_eq!(pool.take_returned(&mut back), 0);
        drop(lent);
        assert_eq!(pool.take_returned(&mut back), 0, "a clone still holds it");
        drop(clone);
        assert_eq!(pool.take_returned(&mut back), 1);
        assert_eq!(back, [1]);

        pool.hold(2);
        // SAFETY: slot 2 is held and not posted, and not touched until it
        // is back.
        let kept = unsafe { pool.lend(2, 0..4) };
        drop(pool);
        assert_eq!(&kept[..], &[0; 4], "the memory outlives the pool");
    }

    #[test]
    fn a_slot_comes_back_once_released_and_every_part_is_dropped() {
        let pool = BufferPool::new(2, 64).unwrap();
        let mut back = Vec::new();
        pool.hold(0);
        // SAFETY: slot 0 is held and not posted; the parts do not overlap.
        let (first, second) = unsafe { (pool.lend(0, 0..8), pool.lend(0, 8..24)) };
        drop(first);
        drop(second);
        assert_eq!(pool.take_returned(&mut back), 0, "its owner still holds it");
        assert!(pool.release(0), "nothing lent is alive: back to the owner");
        assert_eq!(pool.take_returned(&mut back), 0);

        pool.hold(0);
        // SAFETY: as above.
        let part = unsafe { pool.lend(0, 24..32) };
        assert!(!pool.release(0));
        drop(part);
        assert_eq!(pool.take_returned(&mut back), 1);
        assert_eq!(back, [0]);
    }

    #[test]
    fn landed_bytes_must_lie_in_their_slot() {
        let pool = BufferPool::new(2, 64).unwrap();
        let base = pool.slot_ptr(1).cast_const();
        // SAFETY: nothing is posted on this pool.
        unsafe {
            let (offset, bytes) = pool.landed(1, base.add(16), 48).unwrap();
            assert_eq!((offset, bytes.len()), (16, 48));
            assert!(pool.landed(1, base.add(16), 49).is_none(), "past the slot");
            assert!(pool.landed(1, pool.slot_ptr(0), 8).is_none(), "before it");
            assert!(pool.landed(1, base.add(8), usize::MAX).is_none());
        }
    }

    #[test]
    fn empty_pools_are_refused() {
        assert!(BufferPool::new(0, 64).is_err());
        assert!(BufferPool::new(usize::MAX, 2).is_err());
    }
}
