//! Memory in transparent huge pages, for the landing buffers of large
//! rendezvous frames over `shm`.
//!
//! `shm` moves a rendezvous body with `process_vm_readv`, which pins the
//! source's pages anew for every read. With the source in 2 MiB pages the
//! kernel pins it a huge page at a time instead of 512 small pages, and a
//! 1 MiB read between two processes took 40 us instead of 79 here. A
//! broker's landing buffers are what its subscribers read from, so they
//! are worth mapping this way; a publisher's own payload is not efabus's
//! to place.

use std::ffi::c_void;
use std::ptr::{self, NonNull};

/// The size of a transparent huge page on x86-64 and on arm64 with 4 KiB
/// pages, the platforms EFA instances run.
pub const HUGE_PAGE: usize = 2 << 20;

/// A private anonymous mapping of whole huge pages, aligned to one and
/// advised (`MADV_HUGEPAGE`) to be backed by them as it is touched,
/// whatever the system's default (`madvise` on this machine). Where the
/// kernel has no huge pages to give, or they are disabled, it is ordinary
/// memory. Zero-filled when made; unmapped when dropped.
pub struct HugePages {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value alone; access to
// its bytes goes through `&self`/`&mut self`.
unsafe impl Send for HugePages {}
// SAFETY: as above; `&HugePages` only reads.
unsafe impl Sync for HugePages {}

impl HugePages {
    /// At least `len` bytes (a whole number of huge pages), or `None` when
    /// the mapping cannot be made.
    pub fn new(len: usize) -> Option<HugePages> {
        let len = len.max(1).checked_next_multiple_of(HUGE_PAGE)?;
        // One huge page more than needed, so that an aligned run of `len`
        // bytes lies inside wherever the kernel puts it.
        let span = len.checked_add(HUGE_PAGE)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // touched, and the result is checked before use.
        let raw = unsafe {
            libc::mmap(
                ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HUGE_PAGE);
        let before = aligned - start;
        let after = span - before - len;
        // SAFETY: both ranges lie in the mapping just made and outside
        // `aligned..aligned + len`, which is all that is kept; nothing
        // refers to them. A failed unmap only leaves address space mapped.
        unsafe {
            if before > 0 {
                libc::munmap(raw, before);
            }
            if after > 0 {
                libc::munmap((aligned + len) as *mut c_void, after);
            }
        }
        // SAFETY: advice on memory this value owns; it changes how faults
        // back the pages, never their contents. Refused (a kernel without
        // transparent huge pages), the memory stays ordinary.
        #[cfg(target_os = "linux")]
        unsafe {
            libc::madvise(aligned as *mut c_void, len, libc::MADV_HUGEPAGE);
        }
        Some(HugePages {
            ptr: NonNull::new(aligned as *mut u8)?,
            len,
        })
    }

    /// Bytes mapped.
    pub fn capacity(&self) -> usize {
        self.len
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped readable at `ptr` for as long as self
        // lives; mapped memory is always initialized (zeros or bytes
        // written since).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only
        // reference to the bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; no slice of it
        // outlives `self`.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kibibytes of anonymous huge pages backing the mapping at `addr`, as
    /// `/proc/self/smaps` reports them.
    fn huge_kib_at(addr: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) =
                        (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                    {
                        inside = (lo..hi).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(rest) = line.strip_prefix("AnonHugePages:") {
                    return rest.trim().trim_end_matches("kB").trim().parse().ok();
                }
            }
        }
        None
    }

    /// Whether the system gives huge pages to memory that asks
    /// (`[always]` or `[madvise]`, not `[never]`).
    fn huge_pages_on_request() -> bool {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|mode| !mode.contains("[never]"))
    }

    #[test]
    fn a_mapping_is_whole_aligned_huge_pages_zeroed_and_writable() {
        for len in [
            0,
            1,
            HUGE_PAGE - 1,
            HUGE_PAGE,
            HUGE_PAGE + 1,
            (1 << 20) + 8192,
        ] {
            let mut pages = HugePages::new(len).expect("map");
            assert!(pages.capacity() >= len.max(1));
            assert_eq!(pages.capacity() % HUGE_PAGE, 0);
            assert_eq!(pages.as_slice().as_ptr() as usize % HUGE_PAGE, 0);
            assert!(pages.as_slice().iter().all(|&b| b == 0));
            let last = pages.capacity() - 1;
            pages.as_mut_slice()[last] = 9;
            assert_eq!(pages.as_slice()[last], 9);
        }
        assert!(
            HugePages::new(usize::MAX).is_none(),
            "too large to round up"
        );
    }

    #[test]
    fn touched_pages_are_huge_where_the_system_gives_them() {
        let mut pages = HugePages::new(HUGE_PAGE).expect("map");
        pages.as_mut_slice().fill(1);
        let huge = huge_kib_at(pages.as_slice().as_ptr() as usize);
        if huge_pages_on_request() {
            // Compaction may find no free 2 MiB run on a fragmented host;
            // this one has them, so a miss here is a fault of the mapping.
            assert_eq!(huge, Some(2048), "the mapping is not backed by a huge page");
        } else {
            assert_eq!(huge, Some(0));
        }
    }
}
