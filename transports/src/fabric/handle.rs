//! Owned libfabric objects. Each type closes its handle in `Drop`, and each
//! child holds an `Rc` of its parent (domain → fabric; AV, CQ, MR,
//! endpoint → domain; endpoint → the AV and CQs bound to it), so a parent is
//! always closed after its children, as libfabric requires.
//!
//! None of these types is `Send` or `Sync`, and the parent links are `Rc`
//! rather than `Arc` to match: efabus opens domains with
//! `FI_THREAD_DOMAIN`, under which the application serializes every call on
//! all objects of a domain, so no object may be reachable from two threads.
//! A single owner that keeps every object of one domain together (the
//! fabric endpoint) may be moved between threads as a whole; that owner
//! states why it is `Send`.

use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::rc::Rc;

use super::consts::*;
use super::error::{FabricError, FiCode};
use super::info::Info;
use super::layout::MAX_ADDR_LEN;
use super::sys;

fn check(ret: i32, err: impl FnOnce(FiCode) -> FabricError) -> Result<(), FabricError> {
    if ret == 0 {
        Ok(())
    } else {
        Err(err(FiCode::from_ret(ret.into())))
    }
}

fn report_close(what: &'static str, ret: i32) {
    if ret != 0 {
        let err = FabricError::Close {
            what,
            code: FiCode::from_ret(ret.into()),
        };
        tracing::warn!("{err}");
    }
}

/// An open fabric (`fi_fabric`).
pub struct Fabric {
    ptr: NonNull<sys::fid_fabric>,
}

impl Fabric {
    pub fn open(info: &Info) -> Result<Rc<Fabric>, FabricError> {
        let mut ptr = ptr::null_mut();
        // SAFETY: `info` is a live fi_info with fabric attributes (from
        // fi_getinfo); the shim writes the new handle to `ptr`.
        let ret = unsafe { sys::efabus_fabric(info.as_ptr(), &mut ptr) };
        let name = || info.attrs().fabric.and_then(|f| f.name).unwrap_or_default();
        check(ret, |code| FabricError::Fabric { name: name(), code })?;
        let ptr = NonNull::new(ptr).ok_or_else(|| FabricError::Fabric {
            name: name(),
            code: FiCode::from_ret(FI_EINVAL.into()),
        })?;
        Ok(Rc::new(Fabric { ptr }))
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // SAFETY: the handle is open and every child (which holds an Rc of
        // this fabric) has been closed, so this is the last use.
        report_close("fabric", unsafe {
            sys::efabus_fabric_close(self.ptr.as_ptr())
        });
    }
}

/// An open access domain (`fi_domain`).
pub struct Domain {
    ptr: NonNull<sys::fid_domain>,
    _fabric: Rc<Fabric>,
}

impl Domain {
    pub fn open(fabric: &Rc<Fabric>, info: &Info) -> Result<Rc<Domain>, FabricError> {
        let mut ptr = ptr::null_mut();
        // SAFETY: the fabric is open (we hold it) and `info` is live; the
        // shim writes the new handle to `ptr`.
        let ret = unsafe { sys::efabus_domain(fabric.ptr.as_ptr(), info.as_ptr(), &mut ptr) };
        let name = || info.attrs().domain.and_then(|d| d.name).unwrap_or_default();
        check(ret, |code| FabricError::Domain { name: name(), code })?;
        let ptr = NonNull::new(ptr).ok_or_else(|| FabricError::Domain {
            name: name(),
            code: FiCode::from_ret(FI_EINVAL.into()),
        })?;
        Ok(Rc::new(Domain {
            ptr,
            _fabric: fabric.clone(),
        }))
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: open handle, children already closed (they hold Rcs).
        report_close("domain", unsafe {
            sys::efabus_domain_close(self.ptr.as_ptr())
        });
    }
}

/// A text address libfabric may read: at most [`MAX_ADDR_LEN`] bytes,
/// printable ASCII up to a NUL inside them.
fn is_text_address(addr: &[u8]) -> bool {
    addr.len() <= MAX_ADDR_LEN
        && addr
            .iter()
            .position(|&b| b == 0)
            .is_some_and(|end| end > 0 && addr[..end].iter().all(u8::is_ascii_graphic))
}

/// An address vector of type `FI_AV_TABLE`.
pub struct AddressVector {
    ptr: NonNull<sys::fid_av>,
    /// The provider's address size; 0 (inserts refused) until known.
    addr_len: Cell<usize>,
    /// Addresses are NUL-terminated text (`FI_ADDR_STR`).
    text: Cell<bool>,
    _domain: Rc<Domain>,
}

impl AddressVector {
    /// Opens a table AV. Inserts are refused until
    /// [`set_addr_len`](Self::set_addr_len) gives the address size, which
    /// is only known for sure once an endpoint is enabled (`fi_getname`).
    pub fn open_table(domain: &Rc<Domain>, count: usize) -> Result<Rc<AddressVector>, FabricError> {
        let mut ptr = ptr::null_mut();
        // SAFETY: the domain is open; the shim fills a zeroed fi_av_attr and
        // writes the new handle to `ptr`.
        let ret = unsafe {
            sys::efabus_av_open(domain.ptr.as_ptr(), FI_AV_TABLE, count as u64, &mut ptr)
        };
        check(ret, |code| FabricError::AvOpen { code })?;
        let ptr = NonNull::new(ptr).ok_or_else(|| FabricError::AvOpen {
            code: FiCode::from_ret(FI_EINVAL.into()),
        })?;
        Ok(Rc::new(AddressVector {
            ptr,
            addr_len: Cell::new(0),
            text: Cell::new(false),
            _domain: domain.clone(),
        }))
    }

    /// Sets the address size inserts must have, and whether addresses are
    /// text (`FI_ADDR_STR`, as `shm` uses; text addresses may be of any
    /// length up to [`MAX_ADDR_LEN`], as names differ in length).
    ///
    /// # Safety
    /// `len` is the provider's address size for this domain's format (the
    /// length `fi_getname` returned): fi_av_insert reads that many bytes.
    /// `text` must be true when the format is `FI_ADDR_STR`, whose
    /// addresses fi_av_insert reads up to their NUL, whatever `len` says.
    pub unsafe fn set_addr_len(&self, len: usize, text: bool) {
        self.addr_len.set(len);
        self.text.set(text);
    }

    /// Inserts one address and returns its `fi_addr_t`. The address must
    /// have the provider's size (it goes in zero-padded, so a provider
    /// that sizes it by its family field reads no further than the
    /// padding) or, when addresses are text, be printable text ended by a
    /// NUL within it (libfabric reads a text address up to its NUL,
    /// wherever that is).
    pub fn insert(&self, addr: &[u8]) -> Result<u64, FabricError> {
        let text = self.text.get();
        let usable = if text {
            is_text_address(addr)
        } else {
            !addr.is_empty() && addr.len() == self.addr_len.get() && addr.len() <= MAX_ADDR_LEN
        };
        if !usable || self.addr_len.get() == 0 {
            return Err(FabricError::AvInsert {
                len: addr.len(),
                code: FiCode::from_ret(FI_EINVAL.into()),
            });
        }
        // A binary address goes in zero-padded to MAX_ADDR_LEN + 1 bytes:
        // providers whose addresses are socket addresses (`tcp`, `udp`,
        // `sockets`, `ofi_rxm` above them) size one by its family field,
        // which is the peer's to write, so a 16-byte address naming
        // AF_INET6 is read as the 28 bytes of a `sockaddr_in6`.
        let mut padded = [0u8; MAX_ADDR_LEN + 1];
        let given = if text {
            addr
        } else {
            padded[..addr.len()].copy_from_slice(addr);
            &padded[..]
        };
        let mut fi_addr = FI_ADDR_NOTAVAIL;
        // SAFETY: the AV is open. A binary address is the provider's
        // address size followed by zeros up to 256 bytes, more than any
        // socket address (`sockaddr_storage` is 128) or fabric address
        // libfabric reads for one entry, whatever its family field says;
        // a text address ends at a NUL inside it, where libfabric stops
        // reading (both checked above).
        let ret = unsafe {
            sys::efabus_av_insert(self.ptr.as_ptr(), given.as_ptr().cast(), &mut fi_addr)
        };
        if ret == 1 && fi_addr != FI_ADDR_NOTAVAIL {
            Ok(fi_addr)
        } else {
            let code = if ret < 0 { ret } else { -FI_EINVAL };
            Err(FabricError::AvInsert {
                len: addr.len(),
                code: FiCode::from_ret(code.into()),
            })
        }
    }

    /// Removes an address [`insert`](Self::insert) returned, so its entry
    /// can be used again. The caller sends nothing more to it.
    pub fn remove(&self, fi_addr: u64) -> Result<(), FabricError> {
        // SAFETY: the AV is open; libfabric checks the address itself and
        // reports one it does not hold as an error.
        let ret = unsafe { sys::efabus_av_remove(self.ptr.as_ptr(), fi_addr) };
        check(ret, |code| FabricError::AvRemove { code })
    }

    pub fn addr_len(&self) -> usize {
        self.addr_len.get()
    }
}

impl Drop for AddressVector {
    fn drop(&mut self) {
        // SAFETY: open handle; endpoints bound to it hold Rcs, so they are
        // closed already.
        report_close("av", unsafe { sys::efabus_av_close(self.ptr.as_ptr()) });
    }
}

/// A completion read from a queue.
pub type Completion = sys::efabus_completion;

/// What one `fi_cq_read` gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqRead {
    /// This many entries were written to the buffer (0: none ready).
    Entries(usize),
    /// An error entry is at the head of the queue: read it with
    /// [`CompletionQueue::read_error`].
    ErrorAvailable,
}

/// What `fi_cq_read` or `fi_cq_readfrom` returned, as a [`CqRead`].
fn cq_read_result(ret: i64) -> Result<CqRead, FabricError> {
    if ret >= 0 {
        return Ok(CqRead::Entries(ret as usize));
    }
    let code = FiCode::from_ret(ret);
    if code.is_again() {
        Ok(CqRead::Entries(0))
    } else if code.code == FI_EAVAIL {
        Ok(CqRead::ErrorAvailable)
    } else {
        Err(FabricError::CqRead { code })
    }
}

/// A completion that failed, with the provider's explanation.
#[derive(Debug, Clone)]
pub struct CqError {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: u64,
    pub code: FiCode,
    pub prov_errno: i64,
    pub provider_text: String,
}

/// A wait set with a file descriptor (`fi_wait_open`, FI_WAIT_FD): the CQs
/// opened on it make the descriptor readable when they have work, so a
/// loop can sleep in epoll instead of polling. Providers without wait
/// objects (efa on libfabric 1.17) refuse it, and their CQs are polled.
pub struct WaitSet {
    ptr: NonNull<sys::fid_wait>,
    fd: i32,
    fabric: Rc<Fabric>,
}

impl WaitSet {
    /// The provider's refusal comes back as the error code.
    pub fn open(fabric: &Rc<Fabric>) -> Result<Rc<WaitSet>, FiCode> {
        let mut ptr = ptr::null_mut();
        // SAFETY: the fabric is open; the shim fills a zeroed fi_wait_attr
        // (FI_WAIT_FD) and writes the handle to `ptr`.
        let ret = unsafe { sys::efabus_wait_open(fabric.ptr.as_ptr(), &mut ptr) };
        if ret != 0 {
            return Err(FiCode::from_ret(ret.into()));
        }
        let ptr = NonNull::new(ptr).ok_or_else(|| FiCode::from_ret(FI_EINVAL.into()))?;
        let mut fd = -1;
        // SAFETY: the wait set was just opened; FI_GETWAIT on an FI_WAIT_FD
        // set writes one int.
        let ret = unsafe { sys::efabus_wait_fd(ptr.as_ptr(), &mut fd) };
        // Owned before the checks, so an error closes the set on drop.
        let wait = WaitSet {
            ptr,
            fd,
            fabric: fabric.clone(),
        };
        match (ret, fd) {
            (0, fd) if fd >= 0 => Ok(Rc::new(wait)),
            (0, _) => Err(FiCode::from_ret(FI_EINVAL.into())),
            (ret, _) => Err(FiCode::from_ret(ret.into())),
        }
    }

    /// The descriptor that becomes readable when a CQ of the set has work.
    pub fn fd(&self) -> i32 {
        self.fd
    }

    /// `fi_trywait`: true when nothing is pending, so the caller may block
    /// on [`WaitSet::fd`]; false when the CQs must be read first.
    pub fn try_wait(&self) -> bool {
        // SAFETY: the fabric and the wait set are open, and the set belongs
        // to that fabric.
        unsafe { sys::efabus_trywait(self.fabric.ptr.as_ptr(), self.ptr.as_ptr()) == 0 }
    }
}

impl Drop for WaitSet {
    fn drop(&mut self) {
        // SAFETY: open handle; the CQs that signal it hold Rcs of it and
        // are closed.
        report_close("wait set", unsafe {
            sys::efabus_wait_close(self.ptr.as_ptr())
        });
    }
}

/// A completion queue (`FI_CQ_FORMAT_DATA`), polled, and signalling a
/// [`WaitSet`] when it was opened with one.
pub struct CompletionQueue {
    ptr: NonNull<sys::fid_cq>,
    _wait: Option<Rc<WaitSet>>,
    _domain: Rc<Domain>,
}

impl CompletionQueue {
    pub fn open(
        domain: &Rc<Domain>,
        size: usize,
        wait: Option<&Rc<WaitSet>>,
    ) -> Result<Rc<CompletionQueue>, FabricError> {
        let mut ptr = ptr::null_mut();
        let wait_ptr = wait.map_or(ptr::null_mut(), |w| w.ptr.as_ptr());
        // SAFETY: the domain is open and the wait set, when given, is open
        // on the same fabric; the shim fills a zeroed fi_cq_attr (format
        // MSG, FI_WAIT_SET or FI_WAIT_NONE) and writes the handle to `ptr`.
        let ret =
            unsafe { sys::efabus_cq_open(domain.ptr.as_ptr(), size as u64, wait_ptr, &mut ptr) };
        check(ret, |code| FabricError::CqOpen { code })?;
        let ptr = NonNull::new(ptr).ok_or_else(|| FabricError::CqOpen {
            code: FiCode::from_ret(FI_EINVAL.into()),
        })?;
        Ok(Rc::new(CompletionQueue {
            ptr,
            _wait: wait.cloned(),
            _domain: domain.clone(),
        }))
    }

    /// Reads up to `buf.len()` completions; also drives manual progress.
    pub fn read(&self, buf: &mut [Completion]) -> Result<CqRead, FabricError> {
        // SAFETY: the CQ is open and `buf` has room for buf.len() entries of
        // fi_cq_data_entry layout (the shim opens CQs in FI_CQ_FORMAT_DATA
        // and checks the layout with static asserts).
        let ret =
            unsafe { sys::efabus_cq_read(self.ptr.as_ptr(), buf.as_mut_ptr(), buf.len() as u64) };
        cq_read_result(ret)
    }

    /// [`read`](Self::read), with each completion's source address in
    /// `sources` (`FI_ADDR_NOTAVAIL` for a sender not in the address
    /// vector). Only for endpoints opened with `FI_SOURCE`.
    pub fn read_from(
        &self,
        buf: &mut [Completion],
        sources: &mut [u64],
    ) -> Result<CqRead, FabricError> {
        let count = buf.len().min(sources.len());
        // SAFETY: the CQ is open; `buf` has room for `count` entries of
        // fi_cq_data_entry layout (FI_CQ_FORMAT_DATA, checked by static
        // asserts in the shim)
        // and `sources` for `count` fi_addr_t values.
        let ret = unsafe {
            sys::efabus_cq_readfrom(
                self.ptr.as_ptr(),
                buf.as_mut_ptr(),
                count as u64,
                sources.as_mut_ptr(),
            )
        };
        cq_read_result(ret)
    }

    /// Reads the error entry at the head of the queue, if any, with the
    /// provider's text from `fi_cq_strerror`.
    pub fn read_error(&self) -> Result<Option<CqError>, FabricError> {
        // SAFETY: plain struct of integers, pointers and a char array; all
        // zero is valid.
        let mut raw: sys::efabus_cq_error = unsafe { std::mem::zeroed() };
        // SAFETY: the CQ is open; the shim reads into its own oversized
        // buffer and copies fields and the NUL-terminated text into `raw`.
        let ret = unsafe { sys::efabus_cq_readerr(self.ptr.as_ptr(), &mut raw) };
        if ret <= 0 {
            let code = FiCode::from_ret(ret);
            return if ret == 0 || code.is_again() {
                Ok(None)
            } else {
                Err(FabricError::CqReadErr { code })
            };
        }
        let text_bytes: Vec<u8> = raw
            .prov_text
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(Some(CqError {
            op_context: raw.op_context,
            flags: raw.flags,
            len: raw.len,
            code: FiCode::from_ret(raw.err),
            prov_errno: raw.prov_errno,
            provider_text: String::from_utf8_lossy(&text_bytes).into_owned(),
        }))
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: open handle; bound endpoints hold Rcs and are closed.
        report_close("cq", unsafe { sys::efabus_cq_close(self.ptr.as_ptr()) });
    }
}

/// A registered memory region (`fi_mr_reg`).
pub struct MemoryRegion {
    ptr: NonNull<sys::fid_mr>,
    len: usize,
    _domain: Rc<Domain>,
}

impl MemoryRegion {
    /// Registers `len` bytes at `buf` for `access` (FI_SEND, FI_RECV, ...).
    /// `requested_key` matters only without FI_MR_PROV_KEY.
    ///
    /// # Safety
    /// The memory must stay allocated (and backed, for FI_MR_ALLOCATED)
    /// until the returned region is dropped.
    pub unsafe fn register(
        domain: &Rc<Domain>,
        buf: *const u8,
        len: usize,
        access: u64,
        requested_key: u64,
    ) -> Result<MemoryRegion, FabricError> {
        let mut ptr = ptr::null_mut();
        // SAFETY: the domain is open; the caller keeps the memory valid for
        // the region's lifetime.
        let ret = unsafe {
            sys::efabus_mr_reg(
                domain.ptr.as_ptr(),
                buf.cast(),
                len as u64,
                access,
                requested_key,
                &mut ptr,
            )
        };
        check(ret, |code| FabricError::MrReg { len, code })?;
        let ptr = NonNull::new(ptr).ok_or_else(|| FabricError::MrReg {
            len,
            code: FiCode::from_ret(FI_EINVAL.into()),
        })?;
        Ok(MemoryRegion {
            ptr,
            len,
            _domain: domain.clone(),
        })
    }

    /// The local descriptor to pass with every post (`fi_mr_desc`).
    pub fn desc(&self) -> *mut c_void {
        // SAFETY: the region is open.
        unsafe { sys::efabus_mr_desc(self.ptr.as_ptr()) }
    }

    /// Bytes registered.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// The remote key (`fi_mr_key`), provider-chosen under FI_MR_PROV_KEY.
    pub fn key(&self) -> u64 {
        // SAFETY: the region is open.
        unsafe { sys::efabus_mr_key(self.ptr.as_ptr()) }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: open handle, closed once.
        report_close("mr", unsafe { sys::efabus_mr_close(self.ptr.as_ptr()) });
    }
}

/// An active endpoint (`fi_endpoint`).
pub struct FiEndpoint {
    ptr: NonNull<sys::fid_ep>,
    /// Left open when dropped (see [`FiEndpoint::leave_open`]).
    left_open: bool,
    // Bound objects: kept alive until the endpoint is closed.
    _av: Option<Rc<AddressVector>>,
    _cqs: Vec<Rc<CompletionQueue>>,
    _domain: Rc<Domain>,
}

impl FiEndpoint {
    pub fn open(domain: &Rc<Domain>, info: &Info) -> Result<FiEndpoint, FabricError> {
        let mut ptr = ptr::null_mut();
        // SAFETY: the domain is open and `info` live; the shim writes the
        // new handle to `ptr`.
        let ret = unsafe { sys::efabus_endpoint(domain.ptr.as_ptr(), info.as_ptr(), &mut ptr) };
        check(ret, |code| FabricError::Endpoint { code })?;
        let ptr = NonNull::new(ptr).ok_or_else(|| FabricError::Endpoint {
            code: FiCode::from_ret(FI_EINVAL.into()),
        })?;
        Ok(FiEndpoint {
            ptr,
            left_open: false,
            _av: None,
            _cqs: Vec::new(),
            _domain: domain.clone(),
        })
    }

    pub fn bind_av(&mut self, av: &Rc<AddressVector>) -> Result<(), FabricError> {
        // SAFETY: both objects are open and from the same domain.
        let ret = unsafe { sys::efabus_ep_bind_av(self.ptr.as_ptr(), av.ptr.as_ptr()) };
        check(ret, |code| FabricError::EpBind { what: "av", code })?;
        self._av = Some(av.clone());
        Ok(())
    }

    /// Binds a CQ for `flags` (FI_TRANSMIT and/or FI_RECV).
    pub fn bind_cq(&mut self, cq: &Rc<CompletionQueue>, flags: u64) -> Result<(), FabricError> {
        // SAFETY: both objects are open and from the same domain.
        let ret = unsafe { sys::efabus_ep_bind_cq(self.ptr.as_ptr(), cq.ptr.as_ptr(), flags) };
        let what = if flags & FI_RECV != 0 {
            "rx cq"
        } else {
            "tx cq"
        };
        check(ret, |code| FabricError::EpBind { what, code })?;
        self._cqs.push(cq.clone());
        Ok(())
    }

    /// Sets `FI_OPT_EFA_RNR_RETRY`; only for efa RDM endpoints, before
    /// [`enable`](Self::enable).
    pub fn set_efa_rnr_retry(&mut self, retry: u64) -> Result<(), FabricError> {
        // SAFETY: the endpoint is open; the option takes a size_t, which the
        // shim passes by pointer with its size.
        let ret = unsafe { sys::efabus_ep_set_efa_rnr_retry(self.ptr.as_ptr(), retry) };
        check(ret, |code| FabricError::SetOpt {
            option: "FI_OPT_EFA_RNR_RETRY",
            code,
        })
    }

    /// Sets `FI_OPT_MIN_MULTI_RECV`: the provider releases a multi-receive
    /// buffer once less than `min` bytes of it are left. After `enable`
    /// (libfabric 1.17's `shm` crashes when it is set before), before any
    /// receive is posted.
    pub fn set_min_multi_recv(&mut self, min: usize) -> Result<(), FabricError> {
        // SAFETY: the endpoint is open; the option takes a size_t, which the
        // shim passes by pointer with its size.
        let ret = unsafe { sys::efabus_ep_set_min_multi_recv(self.ptr.as_ptr(), min as u64) };
        check(ret, |code| FabricError::SetOpt {
            option: "FI_OPT_MIN_MULTI_RECV",
            code,
        })
    }

    pub fn enable(&mut self) -> Result<(), FabricError> {
        // SAFETY: the endpoint is open and bound.
        let ret = unsafe { sys::efabus_enable(self.ptr.as_ptr()) };
        check(ret, |code| FabricError::Enable { code })
    }

    /// The endpoint's address (`fi_getname`).
    pub fn name(&self) -> Result<Vec<u8>, FabricError> {
        let mut buf = vec![0u8; 256];
        loop {
            let mut len = buf.len() as u64;
            // SAFETY: `buf` has `len` writable bytes; the shim passes the
            // length in and the needed or written length out.
            let ret = unsafe {
                sys::efabus_getname(self.ptr.as_ptr(), buf.as_mut_ptr().cast(), &mut len)
            };
            let needed = usize::try_from(len).unwrap_or(usize::MAX);
            if ret == 0 {
                buf.truncate(needed.min(buf.len()));
                return Ok(buf);
            }
            // -FI_ETOOSMALL reports the size needed; grow once and retry.
            if needed > buf.len() && needed <= 1 << 16 {
                buf.resize(needed, 0);
                continue;
            }
            return Err(FabricError::GetName {
                code: FiCode::from_ret(ret.into()),
            });
        }
    }

    /// Posts a receive of `len` bytes at `buf`; with `multi` (FI_MULTI_RECV
    /// granted, `FI_OPT_MIN_MULTI_RECV` set), as one multi-receive buffer:
    /// messages land in it one after another, each with a completion
    /// carrying `context` and where it landed, and a completion flagged
    /// `FI_MULTI_RECV` (the last message's, or one of its own) or an
    /// `FI_ECANCELED` error says the provider is done with it.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and untouched by Rust code until the
    /// completion carrying `context` (with `multi`, the one flagged
    /// `FI_MULTI_RECV`) is read or the endpoint is closed; with `multi`,
    /// Rust code may read what a completion reported landed before then,
    /// and must not write any of it. `desc` is NULL or the descriptor of a
    /// region covering the buffer.
    pub unsafe fn recv(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        context: *mut c_void,
        multi: bool,
    ) -> Result<(), FiCode> {
        let post = if multi {
            sys::efabus_recv_multi
        } else {
            sys::efabus_recv
        };
        // SAFETY: the endpoint is open; the caller upholds the buffer rules.
        let ret = unsafe { post(self.ptr.as_ptr(), buf.cast(), len as u64, desc, context) };
        if ret == 0 {
            Ok(())
        } else {
            Err(FiCode::from_ret(ret))
        }
    }

    /// Posts a send of `len` bytes at `buf` to `dest`.
    ///
    /// # Safety
    /// As for [`recv`](Self::recv): the buffer stays valid and unmodified
    /// until the completion carrying `context` is read or the endpoint is
    /// closed; `desc` is NULL or covers the buffer.
    pub unsafe fn send(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        context: *mut c_void,
    ) -> Result<(), FiCode> {
        // SAFETY: the endpoint is open; the caller upholds the buffer rules.
        let ret = unsafe {
            sys::efabus_send(
                self.ptr.as_ptr(),
                buf.cast(),
                len as u64,
                desc,
                dest,
                context,
            )
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(FiCode::from_ret(ret))
        }
    }

    /// Posts one message made of two buffers (`fi_sendv`): `head` then
    /// `tail`, each with its region's descriptor (NULL when none is needed).
    ///
    /// # Safety
    /// As for [`send`](Self::send), for both buffers.
    pub unsafe fn send2(
        &self,
        head: (*const u8, usize, *mut c_void),
        tail: (*const u8, usize, *mut c_void),
        dest: u64,
        context: *mut c_void,
    ) -> Result<(), FiCode> {
        // SAFETY: the endpoint is open; the caller upholds the buffer rules.
        let ret = unsafe {
            sys::efabus_send2(
                self.ptr.as_ptr(),
                head.0.cast(),
                head.1 as u64,
                head.2,
                tail.0.cast(),
                tail.1 as u64,
                tail.2,
                dest,
                context,
            )
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(FiCode::from_ret(ret))
        }
    }

    /// Reads `len` bytes of the peer `src`'s region (`addr`, `key`) into
    /// `buf` (`fi_read`); the completion arrives on the tx CQ with
    /// `context`.
    ///
    /// # Safety
    /// `buf` must stay valid and untouched, and `desc` (NULL when none is
    /// needed) registered, until the completion for `context` is read.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn read(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        src: u64,
        remote: (u64, u64),
        context: *mut c_void,
    ) -> Result<(), FiCode> {
        // SAFETY: the endpoint is open; the caller upholds the buffer rules.
        let ret = unsafe {
            sys::efabus_read(
                self.ptr.as_ptr(),
                buf.cast(),
                len as u64,
                desc,
                src,
                remote.0,
                remote.1,
                context,
            )
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(FiCode::from_ret(ret))
        }
    }

    /// Sends `data` with `fi_inject`: the bytes are copied before return and
    /// no completion is generated.
    pub fn inject(&self, data: &[u8], dest: u64) -> Result<(), FiCode> {
        // SAFETY: the endpoint is open; `data` is valid for the call, and
        // fi_inject is done with it on return.
        let ret = unsafe {
            sys::efabus_inject(
                self.ptr.as_ptr(),
                data.as_ptr().cast(),
                data.len() as u64,
                dest,
            )
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(FiCode::from_ret(ret))
        }
    }
}

impl FiEndpoint {
    /// Never closes the endpoint, nor (through the references it holds)
    /// what it is bound to: for an endpoint whose close would crash the
    /// provider. Nothing calls into it again, so what it still refers to
    /// is never touched; its owner must leave that memory allocated too.
    pub fn leave_open(&mut self) {
        self.left_open = true;
        std::mem::forget(self._av.clone());
        std::mem::forget(self._cqs.clone());
        std::mem::forget(self._domain.clone());
    }
}

impl Drop for FiEndpoint {
    fn drop(&mut self) {
        if self.left_open {
            return;
        }
        // SAFETY: open handle, closed once, before the AV/CQs/domain it
        // holds (fields drop after this body runs).
        report_close("endpoint", unsafe {
            sys::efabus_ep_close(self.ptr.as_ptr())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_addresses_end_in_a_nul_after_printable_text() {
        assert!(is_text_address(b"fi_shm://1234\0"));
        assert!(is_text_address(b"fi_shm://1234\0\0\0padding"));
        assert!(!is_text_address(b"fi_shm://1234"), "no NUL");
        assert!(!is_text_address(b"\0"), "empty");
        assert!(!is_text_address(b"fi_shm://12 34\0"), "a space");
        assert!(!is_text_address(b"fi_shm://\x01\0"), "a control byte");
        let mut long = vec![b'a'; MAX_ADDR_LEN];
        long.push(0);
        assert!(!is_text_address(&long), "too long");
        long.truncate(MAX_ADDR_LEN - 1);
        long.push(0);
        assert!(is_text_address(&long));
    }
}
