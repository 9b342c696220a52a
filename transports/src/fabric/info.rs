//! `fi_getinfo` results: hints in, an owned list out, each entry readable as
//! [`InfoAttrs`] or as `fi_tostr` text.

use std::ffi::{c_char, c_void, CStr, CString};
use std::marker::PhantomData;
use std::ptr::{self, NonNull};

use super::attrs::*;
use super::consts::*;
use super::error::{FabricError, FiCode};
use super::sys;

/// What to ask `fi_getinfo` for. Zero fields are "unspecified".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hints {
    pub caps: u64,
    pub mode: u64,
    pub mr_mode: u64,
    pub domain_mode: u64,
    pub ep_type: u64,
    pub addr_format: u64,
    pub tx_msg_order: u64,
    pub rx_msg_order: u64,
    pub threading: u64,
    pub av_type: u64,
    pub provider: Option<String>,
    pub domain: Option<String>,
    pub fabric: Option<String>,
    /// `node` argument; with [`Hints::source`] it names the local address.
    pub node: Option<String>,
    pub service: Option<String>,
    /// Pass `FI_SOURCE` in fi_getinfo's flags: node/service are local.
    pub source: bool,
}

impl Hints {
    /// The hints `fi_info -p <provider> -t <ep_type>` passes: every mode
    /// and every mr_mode bit but the obsolete basic/scalable ones accepted.
    pub fn like_fi_info_tool(provider: &str, ep_type: u64) -> Hints {
        Hints {
            mode: u64::MAX,
            domain_mode: u64::MAX,
            // ~(FI_MR_BASIC | FI_MR_SCALABLE) as the int mr_mode holds it:
            // the 1.0 enum values 1 and 2, gone from newer headers.
            mr_mode: u64::from(!3u32),
            ep_type,
            provider: Some(provider.to_string()),
            ..Hints::default()
        }
    }
}

fn cstring(value: &Option<String>, what: &str) -> Result<Option<CString>, FabricError> {
    value
        .as_deref()
        .map(|v| {
            CString::new(v).map_err(|_| FabricError::Option {
                key: what.to_string(),
                value: v.to_string(),
                reason: "contains a NUL byte".to_string(),
            })
        })
        .transpose()
}

fn opt_ptr(value: &Option<CString>) -> *const c_char {
    value.as_ref().map_or(ptr::null(), |v| v.as_ptr())
}

/// Loads libfabric if it is not loaded yet (once per process; it is not
/// loaded with the program, see the shim).
pub fn load() -> Result<(), FabricError> {
    // SAFETY: the shim loads the library once (pthread_once), which runs
    // the constructors of libfabric and what it pulls in, and puts back the
    // process's signal dispositions they changed; it touches no memory of
    // ours and takes no arguments.
    let failure = unsafe { sys::efabus_fi_load() };
    if failure == 0 {
        return Ok(());
    }
    // SAFETY: the shim returns a pointer to its own static NUL-terminated
    // buffer, written once before the load reported failure.
    let why = unsafe { CStr::from_ptr(sys::efabus_fi_load_error()) };
    let why = why.to_string_lossy().into_owned();
    Err(match failure {
        sys::EFABUS_FI_TOO_OLD => FabricError::TooOld(why),
        _ => FabricError::NotLoaded(why),
    })
}

/// The libfabric this process uses, loading it if it is not loaded yet.
pub fn loaded() -> Result<super::LoadedLibfabric, FabricError> {
    load()?;
    // SAFETY: the library is loaded; the shim returns NULL or the loader's
    // own NUL-terminated name of the file, which lives as long as the
    // library, which is never unloaded.
    let from = unsafe { sys::efabus_fi_loaded_from() };
    let path = if from.is_null() {
        "this program (linked into it)".to_string()
    } else {
        // SAFETY: non-NULL, NUL-terminated (above).
        unsafe { CStr::from_ptr(from) }
            .to_string_lossy()
            .into_owned()
    };
    // SAFETY: a number compiled into the shim.
    let headers = unsafe { sys::efabus_header_version() };
    Ok(super::LoadedLibfabric {
        path,
        version: runtime_version(),
        built_with: (headers >> 16, headers & 0xffff),
    })
}

/// `fi_strerror` text for a positive error code.
pub fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror accepts any int and returns a pointer to a static
    // NUL-terminated string (or NULL: unknown code, or no libfabric).
    let text = unsafe { sys::efabus_strerror(code) };
    if text.is_null() {
        return format!("error {code}");
    }
    // SAFETY: non-NULL results of fi_strerror are static C strings.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

/// The libfabric version the program runs against, as (major, minor);
/// (0, 0) when it cannot be loaded.
pub fn runtime_version() -> (u32, u32) {
    // SAFETY: fi_version takes no arguments and only returns a number (the
    // shim loads the library first).
    let v = unsafe { sys::efabus_runtime_version() };
    (v >> 16, v & 0xffff)
}

/// An owned `fi_getinfo` result list (freed with `fi_freeinfo`).
pub struct InfoList {
    head: Option<NonNull<sys::fi_info>>,
}

// SAFETY: an fi_info list is plain heap memory owned by this value alone;
// libfabric keeps no reference to it and has no thread affinity for it, so
// it may be moved and read from any thread.
unsafe impl Send for InfoList {}
// SAFETY: shared access only reads the list (view/tostr), which libfabric
// permits concurrently.
unsafe impl Sync for InfoList {}

impl InfoList {
    /// Calls `fi_getinfo` with efabus's API version (1.17).
    pub fn get(hints: &Hints) -> Result<InfoList, FabricError> {
        load()?;
        let provider = cstring(&hints.provider, "provider")?;
        let domain = cstring(&hints.domain, "domain")?;
        let fabric = cstring(&hints.fabric, "fabric")?;
        let node = cstring(&hints.node, "node")?;
        let service = cstring(&hints.service, "service")?;
        let raw = sys::efabus_hints {
            caps: hints.caps,
            mode: hints.mode,
            mr_mode: hints.mr_mode,
            domain_mode: hints.domain_mode,
            ep_type: hints.ep_type,
            addr_format: hints.addr_format,
            tx_msg_order: hints.tx_msg_order,
            rx_msg_order: hints.rx_msg_order,
            threading: hints.threading,
            av_type: hints.av_type,
            prov_name: opt_ptr(&provider),
            domain_name: opt_ptr(&domain),
            fabric_name: opt_ptr(&fabric),
        };
        let flags = if hints.source { FI_SOURCE } else { 0 };
        let mut head: *mut sys::fi_info = ptr::null_mut();
        // SAFETY: every pointer is valid for the call (CStrings and `raw`
        // outlive it); the shim copies the hints into its own fi_info and
        // writes the result list to `head`, which we then own.
        let ret = unsafe {
            sys::efabus_getinfo(opt_ptr(&node), opt_ptr(&service), flags, &raw, &mut head)
        };
        let list = InfoList {
            head: NonNull::new(head),
        };
        if ret != 0 {
            return Err(FabricError::GetInfo {
                provider: hints.provider.clone().unwrap_or_default(),
                ep_type: ep_type_name(hints.ep_type),
                code: FiCode::from_ret(ret.into()),
            });
        }
        Ok(list)
    }

    /// The entries in libfabric's order.
    pub fn iter(&self) -> InfoIter<'_> {
        InfoIter {
            next: self.head.map_or(ptr::null(), |p| p.as_ptr() as *const _),
            _list: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.iter().count()
    }

    pub fn is_empty(&self) -> bool {
        self.head.is_none()
    }
}

impl Drop for InfoList {
    fn drop(&mut self) {
        if let Some(head) = self.head.take() {
            // SAFETY: the list came from fi_getinfo, is owned by us and is
            // freed exactly once here.
            unsafe { sys::efabus_freeinfo(head.as_ptr()) };
        }
    }
}

/// Iterator over an [`InfoList`].
pub struct InfoIter<'a> {
    next: *const sys::fi_info,
    _list: PhantomData<&'a InfoList>,
}

impl<'a> Iterator for InfoIter<'a> {
    type Item = InfoRef<'a>;

    fn next(&mut self) -> Option<InfoRef<'a>> {
        if self.next.is_null() {
            return None;
        }
        let current = self.next;
        // SAFETY: `current` is an entry of the list borrowed for 'a.
        self.next = unsafe { sys::efabus_info_next(current) };
        Some(InfoRef {
            ptr: current,
            _list: PhantomData,
        })
    }
}

/// One entry of a list, borrowed.
#[derive(Clone, Copy)]
pub struct InfoRef<'a> {
    ptr: *const sys::fi_info,
    _list: PhantomData<&'a InfoList>,
}

impl InfoRef<'_> {
    /// A standalone copy of this entry (`fi_dupinfo`), for opening objects.
    pub fn dup(&self) -> Result<Info, FabricError> {
        // SAFETY: `ptr` is a live entry; fi_dupinfo copies only that entry
        // (next = NULL) into memory the returned Info owns.
        let copy = unsafe { sys::efabus_dupinfo(self.ptr) };
        NonNull::new(copy)
            .map(|ptr| Info { ptr })
            .ok_or(FabricError::DupInfo)
    }

    /// The entry's attributes as owned values.
    pub fn attrs(&self) -> InfoAttrs {
        view_attrs(self.ptr)
    }

    /// The entry converted to efabus's capability model.
    pub fn fabric_info(&self) -> efabus_core::caps::FabricInfo {
        super::convert::to_fabric_info(&self.attrs())
    }

    /// `fi_tostr(FI_TYPE_INFO)`: the layout `fi_info -v` prints.
    pub fn to_text(&self) -> String {
        tostr(self.ptr)
    }
}

/// One owned `fi_info` entry, the one endpoints are opened from.
pub struct Info {
    ptr: NonNull<sys::fi_info>,
}

// SAFETY: as for InfoList: owned plain memory without thread affinity.
unsafe impl Send for Info {}
// SAFETY: shared access only reads.
unsafe impl Sync for Info {}

impl Info {
    pub fn attrs(&self) -> InfoAttrs {
        view_attrs(self.ptr.as_ptr())
    }

    pub fn fabric_info(&self) -> efabus_core::caps::FabricInfo {
        super::convert::to_fabric_info(&self.attrs())
    }

    pub fn to_text(&self) -> String {
        tostr(self.ptr.as_ptr())
    }

    /// The raw pointer, for fi_fabric/fi_domain/fi_endpoint, which take the
    /// info by (non-const) pointer but only read it.
    pub(super) fn as_ptr(&self) -> *mut sys::fi_info {
        self.ptr.as_ptr()
    }
}

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: from fi_dupinfo, owned, freed once.
        unsafe { sys::efabus_freeinfo(self.ptr.as_ptr()) };
    }
}

fn tostr(info: *const sys::fi_info) -> String {
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: `info` is live; the shim writes at most buf.len() bytes,
    // NUL-terminated, and returns the length written.
    let len = unsafe { sys::efabus_info_tostr(info, buf.as_mut_ptr().cast(), buf.len()) };
    buf.truncate(len.min(buf.len()));
    String::from_utf8_lossy(&buf).into_owned()
}

/// Copies a NUL-terminated string owned by an fi_info.
///
/// # Safety
/// `p` is NULL or a valid C string that lives for the call.
unsafe fn string(p: *const c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        // SAFETY: guaranteed by the caller.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}

/// Copies `len` bytes owned by an fi_info.
///
/// # Safety
/// `p` is NULL or valid for `len` bytes for the call.
unsafe fn bytes(p: *const c_void, len: u64) -> Option<Vec<u8>> {
    let len = usize::try_from(len).ok()?;
    if p.is_null() {
        None
    } else {
        // SAFETY: guaranteed by the caller.
        Some(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) }.to_vec())
    }
}

/// The value `fi_tostr` printed for a top-level `key` of an info.
fn printed_field(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix("    ")?;
        if rest.starts_with(' ') {
            return None;
        }
        rest.strip_prefix(key)?
            .strip_prefix(": ")
            .map(|v| v.trim_end().to_string())
    })
}

fn view_attrs(info: *const sys::fi_info) -> InfoAttrs {
    let mut attrs = view_values(info);
    // Addresses in formats efabus does not render: take libfabric's text.
    let unrendered = |bytes: &Option<Vec<u8>>| {
        bytes
            .as_ref()
            .is_some_and(|b| super::convert::format_addr(attrs.addr_format, b).is_none())
    };
    if unrendered(&attrs.src_addr) || unrendered(&attrs.dest_addr) {
        let text = tostr(info);
        attrs.src_addr_text = printed_field(&text, "src_addr");
        attrs.dest_addr_text = printed_field(&text, "dest_addr");
    }
    attrs
}

fn view_values(info: *const sys::fi_info) -> InfoAttrs {
    // SAFETY: efabus_info_view is a plain struct of integers and pointers;
    // all-zero is a valid value for it.
    let mut v: sys::efabus_info_view = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a live entry; the shim fills `v` from it, with
    // pointers into the entry that stay valid while we copy below.
    unsafe { sys::efabus_info_view(info, &mut v) };
    // SAFETY (for the string/bytes calls below): the pointers in `v` are
    // NULL or point into `info`, which outlives this function, and the
    // address lengths are the entry's own.
    unsafe {
        InfoAttrs {
            caps: v.caps,
            mode: v.mode,
            addr_format: v.addr_format,
            src_addr: bytes(v.src_addr, v.src_addrlen),
            dest_addr: bytes(v.dest_addr, v.dest_addrlen),
            src_addr_text: None,
            dest_addr_text: None,
            src_addrlen: v.src_addrlen,
            dest_addrlen: v.dest_addrlen,
            handle: v.handle as usize,
            tx: (v.has_tx != 0).then_some(TxAttrs {
                caps: v.tx_caps,
                mode: v.tx_mode,
                op_flags: v.tx_op_flags,
                msg_order: v.tx_msg_order,
                comp_order: v.tx_comp_order,
                inject_size: v.tx_inject_size,
                size: v.tx_size,
                iov_limit: v.tx_iov_limit,
                rma_iov_limit: v.tx_rma_iov_limit,
                tclass: v.tx_tclass,
            }),
            rx: (v.has_rx != 0).then_some(RxAttrs {
                caps: v.rx_caps,
                mode: v.rx_mode,
                op_flags: v.rx_op_flags,
                msg_order: v.rx_msg_order,
                comp_order: v.rx_comp_order,
                total_buffered_recv: v.rx_total_buffered_recv,
                size: v.rx_size,
                iov_limit: v.rx_iov_limit,
            }),
            ep: (v.has_ep != 0).then_some(EpAttrs {
                ep_type: v.ep_type,
                protocol: v.ep_protocol,
                protocol_version: v.ep_protocol_version,
                max_msg_size: v.ep_max_msg_size,
                msg_prefix_size: v.ep_msg_prefix_size,
                max_order_raw_size: v.ep_max_order_raw_size,
                max_order_war_size: v.ep_max_order_war_size,
                max_order_waw_size: v.ep_max_order_waw_size,
                mem_tag_format: v.ep_mem_tag_format,
                tx_ctx_cnt: v.ep_tx_ctx_cnt,
                rx_ctx_cnt: v.ep_rx_ctx_cnt,
                auth_key_size: v.ep_auth_key_size,
            }),
            domain: (v.has_domain != 0).then(|| DomainAttrs {
                domain: v.dom_domain as usize,
                name: string(v.dom_name),
                threading: v.dom_threading,
                control_progress: v.dom_control_progress,
                data_progress: v.dom_data_progress,
                resource_mgmt: v.dom_resource_mgmt,
                av_type: v.dom_av_type,
                mr_mode: v.dom_mr_mode,
                mr_key_size: v.dom_mr_key_size,
                cq_data_size: v.dom_cq_data_size,
                cq_cnt: v.dom_cq_cnt,
                ep_cnt: v.dom_ep_cnt,
                tx_ctx_cnt: v.dom_tx_ctx_cnt,
                rx_ctx_cnt: v.dom_rx_ctx_cnt,
                max_ep_tx_ctx: v.dom_max_ep_tx_ctx,
                max_ep_rx_ctx: v.dom_max_ep_rx_ctx,
                max_ep_stx_ctx: v.dom_max_ep_stx_ctx,
                max_ep_srx_ctx: v.dom_max_ep_srx_ctx,
                cntr_cnt: v.dom_cntr_cnt,
                mr_iov_limit: v.dom_mr_iov_limit,
                caps: v.dom_caps,
                mode: v.dom_mode,
                auth_key_size: v.dom_auth_key_size,
                max_err_data: v.dom_max_err_data,
                mr_cnt: v.dom_mr_cnt,
                tclass: v.dom_tclass,
            }),
            fabric: (v.has_fabric != 0).then(|| FabricAttrs {
                name: string(v.fab_name),
                prov_name: string(v.fab_prov_name),
                prov_version: v.fab_prov_version as u32,
                api_version: v.fab_api_version as u32,
            }),
            nic: (v.has_nic != 0).then(|| NicAttrs {
                device: (v.has_device != 0).then(|| DeviceAttrs {
                    name: string(v.dev_name),
                    device_id: string(v.dev_device_id),
                    device_version: string(v.dev_device_version),
                    vendor_id: string(v.dev_vendor_id),
                    driver: string(v.dev_driver),
                    firmware: string(v.dev_firmware),
                }),
                bus: (v.has_bus != 0).then_some(BusAttrs {
                    bus_type: v.bus_type,
                    pci_domain_id: v.pci_domain_id,
                    pci_bus_id: v.pci_bus_id,
                    pci_device_id: v.pci_device_id,
                    pci_function_id: v.pci_function_id,
                }),
                link: (v.has_link != 0).then(|| LinkAttrs {
                    address: string(v.link_address),
                    mtu: v.link_mtu,
                    speed: v.link_speed,
                    state: v.link_state,
                    network_type: string(v.link_network_type),
                }),
            }),
        }
    }
}

/// libfabric's name for an endpoint type value.
pub fn ep_type_name(ep_type: u64) -> &'static str {
    match ep_type {
        FI_EP_MSG => "FI_EP_MSG",
        FI_EP_DGRAM => "FI_EP_DGRAM",
        FI_EP_RDM => "FI_EP_RDM",
        FI_EP_SOCK_STREAM => "FI_EP_SOCK_STREAM",
        FI_EP_SOCK_DGRAM => "FI_EP_SOCK_DGRAM",
        _ => "FI_EP_UNSPEC",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_constants_match_the_headers() {
        let mut count = 0usize;
        // SAFETY: returns a pointer to a static array of `count` entries.
        let table = unsafe { sys::efabus_constants(&mut count) };
        // SAFETY: as above; the array is static.
        let table = unsafe { std::slice::from_raw_parts(table, count) };
        let mut seen = 0;
        for entry in table {
            // SAFETY: the names are static C string literals.
            let name = unsafe { CStr::from_ptr(entry.name) }.to_str().unwrap();
            let ours = TABLE
                .iter()
                .find(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("{name} missing on the Rust side"));
            assert_eq!(ours.1, entry.value, "{name}");
            seen += 1;
        }
        assert_eq!(
            seen,
            TABLE.len(),
            "Rust has constants the shim does not check"
        );
    }

    #[test]
    fn runtime_is_at_least_the_requested_api() {
        let (major, minor) = runtime_version();
        assert!((major, minor) >= (1, 17), "{major}.{minor}");
        // SAFETY: returns a constant.
        assert_eq!(unsafe { sys::efabus_requested_version() }, (1 << 16) | 17);
    }

    #[test]
    fn strerror_names_codes() {
        assert!(!strerror(FI_ENODATA).is_empty());
        assert_ne!(strerror(FI_EAGAIN), strerror(FI_ENODATA));
    }

    #[test]
    fn unknown_provider_is_enodata() {
        let hints = Hints {
            ep_type: FI_EP_RDM,
            provider: Some("no-such-provider".into()),
            ..Hints::default()
        };
        match InfoList::get(&hints) {
            Err(FabricError::GetInfo { code, provider, .. }) => {
                assert_eq!(code.code, FI_ENODATA);
                assert_eq!(provider, "no-such-provider");
            }
            Err(other) => panic!("unexpected {other}"),
            Ok(list) => panic!("{} infos for a made-up provider", list.len()),
        }
    }

    #[test]
    fn printed_fields_are_found_at_the_top_level_only() {
        let text = "fi_info:\n    caps: [ FI_MSG ]\n    src_addr: fi_addr_x://1\n    fi_tx_attr:\n        src_addr: nested\n";
        assert_eq!(
            printed_field(text, "src_addr").as_deref(),
            Some("fi_addr_x://1")
        );
        assert_eq!(printed_field(text, "dest_addr"), None);
    }

    #[test]
    fn nul_in_hints_is_an_option_error() {
        let hints = Hints {
            provider: Some("a\0b".into()),
            ..Hints::default()
        };
        assert!(matches!(
            InfoList::get(&hints),
            Err(FabricError::Option { .. })
        ));
    }
}
