//! Buffer pools: one page-aligned, zero-filled allocation cut into equal
//! slots, registered once as a single memory region when the provider
//! needs descriptors (FI_MR_LOCAL), plus one operation context per slot.
//!
//! Registration first writes every page, so it only ever sees backed
//! memory (FI_MR_ALLOCATED); an unregistered pool's untouched pages cost
//! address space, not memory. The per-slot contexts are `struct fi_context2`
//! sized, which satisfies providers asking for FI_CONTEXT or FI_CONTEXT2,
//! and double as the slot index when a completion comes back.

use std::alloc::{self, Layout};
use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::rc::Rc;

use super::error::FabricError;
use super::handle::{Domain, MemoryRegion};

const PAGE: usize = 4096;

/// Storage the provider may use per operation (`struct fi_context2`).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct OpContext([*mut c_void; 8]);

/// Equal slots in one registered allocation.
pub struct BufferPool {
    // Dropped first (see Drop): the region must close before the memory goes.
    mr: Option<MemoryRegion>,
    mem: NonNull<u8>,
    alloc: Layout,
    stride: usize,
    count: usize,
    contexts: Box<[OpContext]>,
}

impl BufferPool {
    /// `count` slots of `stride` bytes each.
    pub fn new(count: usize, stride: usize) -> Result<BufferPool, FabricError> {
        let bytes = count
            .checked_mul(stride)
            .filter(|&b| b > 0)
            .ok_or(FabricError::Alloc { bytes: usize::MAX })?;
        let alloc =
            Layout::from_size_align(bytes, PAGE).map_err(|_| FabricError::Alloc { bytes })?;
        // SAFETY: the layout has a non-zero size.
        let mem = unsafe { alloc::alloc_zeroed(alloc) };
        let mem = NonNull::new(mem).ok_or(FabricError::Alloc { bytes })?;
        Ok(BufferPool {
            mr: None,
            mem,
            alloc,
            stride,
            count,
            contexts: vec![OpContext([ptr::null_mut(); 8]); count].into_boxed_slice(),
        })
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
        for offset in (0..self.alloc.size()).step_by(PAGE) {
            // SAFETY: `offset` is inside the allocation this pool owns, and
            // no operation is posted on the pool before it is registered.
            unsafe { ptr::write_volatile(self.mem.as_ptr().add(offset), 0) };
        }
        // SAFETY: the memory is owned by this pool and freed only after the
        // region is closed (Drop closes `mr` first).
        let mr = unsafe {
            MemoryRegion::register(
                domain,
                self.mem.as_ptr(),
                self.alloc.size(),
                access,
                requested_key,
            )?
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
        unsafe { self.mem.as_ptr().add(i * self.stride) }
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
    /// As for [`slot`](Self::slot).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` excludes other Rust borrows.
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

impl Drop for BufferPool {
    fn drop(&mut self) {
        drop(self.mr.take());
        // SAFETY: allocated in `new` with this layout, freed once, after
        // the memory region over it was closed.
        unsafe { alloc::dealloc(self.mem.as_ptr(), self.alloc) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn empty_pools_are_refused() {
        assert!(BufferPool::new(0, 64).is_err());
        assert!(BufferPool::new(usize::MAX, 2).is_err());
    }
}
