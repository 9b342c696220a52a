//! Memory in transparent huge pages, for the landing buffers of large
//! rendezvous frames over `shm`.
//!
//! `shm` moves a rendezvous body with `process_vm_readv`, which pins the
//! source's pages anew for every read. With the source in 2 MiB pages the
//! kernel pins one huge page where it pinned 256 small ones per MiB, and a
//! 1 MiB read between two processes took 40 us instead of 79 here. A
//! broker's landing buffers are what its subscribers read from, so they
//! are worth mapping this way; a publisher's own payload is not efabus's
//! to place.

use std::ffi::c_void;
use std::ptr::{self, NonNull};

use super::config::huge_page_size as page_size;

/// A private anonymous mapping of whole huge pages, aligned to one and
/// advised (`MADV_HUGEPAGE`) to be backed by them as it is touched,
/// whatever the system's default (`madvise` on this machine). Where the
/// kernel finds no free huge page at a fault, that part is ordinary
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
    /// the system has no huge pages ([`page_size`](super::config::huge_page_size)) or the mapping cannot
    /// be made.
    pub fn new(len: usize) -> Option<HugePages> {
        let page = page_size()?;
        let len = len.max(1).checked_next_multiple_of(page)?;
        // One huge page more than needed, so that an aligned run of `len`
        // bytes lies inside wherever the kernel puts it.
        let span = len.checked_add(page)?;
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
        let aligned = start.next_multiple_of(page);
        let Some(ptr) = NonNull::new(aligned as *mut u8) else {
            // SAFETY: the mapping just made, which nothing refers to.
            unsafe { libc::munmap(raw, span) };
            return None;
        };
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
        let pages = HugePages { ptr, len };
        // SAFETY: advice on memory this value owns; it changes how faults
        // back the pages, never their contents.
        #[cfg(target_os = "linux")]
        if unsafe { libc::madvise(aligned as *mut c_void, len, libc::MADV_HUGEPAGE) } != 0 {
            // Refused, it would be ordinary memory charged as huge pages:
            // unmapped (by `pages`' drop), the caller takes a heap buffer.
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "madvise(MADV_HUGEPAGE) refused"
            );
            return None;
        }
        Some(pages)
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

    /// The lines `/proc/self/smaps` gives for the mapping that holds
    /// `addr`.
    fn smaps_of(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut lines = Vec::new();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line
                .split_once(' ')
                .and_then(|(range, _)| range.split_once('-'));
            if let Some((Ok(lo), Ok(hi))) =
                range.map(|(lo, hi)| (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)))
            {
                inside = (lo..hi).contains(&addr);
            }
            if inside {
                lines.push(line.to_string());
            }
        }
        lines
    }

    #[test]
    fn a_mapping_is_whole_aligned_huge_pages_zeroed_and_writable() {
        let Some(page) = page_size() else {
            assert!(HugePages::new(1).is_none(), "no huge pages, no mapping");
            return;
        };
        for len in [0, 1, page - 1, page, page + 1, (1 << 20) + 8192] {
            let mut pages = HugePages::new(len).expect("map");
            assert!(pages.capacity() >= len.max(1));
            assert_eq!(pages.capacity() % page, 0);
            assert_eq!(pages.as_slice().as_ptr() as usize % page, 0);
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
    fn a_mapping_is_advised_for_huge_pages() {
        let Some(page) = page_size() else {
            return;
        };
        let mut pages = HugePages::new(page).expect("map");
        pages.as_mut_slice().fill(1);
        let lines = smaps_of(pages.as_slice().as_ptr() as usize);
        let flags = lines
            .iter()
            .find_map(|line| line.strip_prefix("VmFlags:"))
            .expect("VmFlags");
        assert!(
            flags.split_whitespace().any(|flag| flag == "hg"),
            "not advised MADV_HUGEPAGE: {flags}"
        );
        // Whether a free huge page was found at the fault is the kernel's
        // to say; the mapping is eligible either way.
        assert!(
            lines
                .iter()
                .any(|line| line.starts_with("THPeligible:") && line.ends_with('1')),
            "{lines:?}"
        );
    }
}
