//! Raw declarations of the C shim (`csrc/shim.h`) and the libfabric
//! constants efabus uses. Nothing here is safe to call directly: the safe
//! wrappers in [`super::handle`] and [`super::info`] own every pointer.
//!
//! The constants are the ABI values from libfabric's headers; a unit test
//! checks each against the value the shim was compiled with.

#![allow(non_camel_case_types, dead_code)]

use std::ffi::{c_char, c_int, c_void};
use std::marker::{PhantomData, PhantomPinned};

macro_rules! opaque {
    ($($name:ident),*) => {$(
        /// An opaque libfabric object, only ever behind a pointer.
        #[repr(C)]
        pub struct $name {
            _data: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
    )*};
}
opaque!(fi_info, fid_fabric, fid_domain, fid_av, fid_cq, fid_ep, fid_mr, fid_wait);

/// Mirror of `struct efabus_hints`.
#[repr(C)]
#[derive(Debug)]
pub struct efabus_hints {
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
    pub prov_name: *const c_char,
    pub domain_name: *const c_char,
    pub fabric_name: *const c_char,
}

/// Mirror of `struct efabus_info_view`: every field 8 bytes wide.
#[repr(C)]
#[derive(Debug)]
pub struct efabus_info_view {
    pub caps: u64,
    pub mode: u64,
    pub addr_format: u64,
    pub src_addrlen: u64,
    pub dest_addrlen: u64,
    pub src_addr: *const c_void,
    pub dest_addr: *const c_void,
    pub handle: *const c_void,
    pub has_tx: u64,
    pub tx_caps: u64,
    pub tx_mode: u64,
    pub tx_op_flags: u64,
    pub tx_msg_order: u64,
    pub tx_comp_order: u64,
    pub tx_inject_size: u64,
    pub tx_size: u64,
    pub tx_iov_limit: u64,
    pub tx_rma_iov_limit: u64,
    pub tx_tclass: u64,
    pub has_rx: u64,
    pub rx_caps: u64,
    pub rx_mode: u64,
    pub rx_op_flags: u64,
    pub rx_msg_order: u64,
    pub rx_comp_order: u64,
    pub rx_total_buffered_recv: u64,
    pub rx_size: u64,
    pub rx_iov_limit: u64,
    pub has_ep: u64,
    pub ep_type: u64,
    pub ep_protocol: u64,
    pub ep_protocol_version: u64,
    pub ep_max_msg_size: u64,
    pub ep_msg_prefix_size: u64,
    pub ep_max_order_raw_size: u64,
    pub ep_max_order_war_size: u64,
    pub ep_max_order_waw_size: u64,
    pub ep_mem_tag_format: u64,
    pub ep_tx_ctx_cnt: u64,
    pub ep_rx_ctx_cnt: u64,
    pub ep_auth_key_size: u64,
    pub has_domain: u64,
    pub dom_domain: *const c_void,
    pub dom_name: *const c_char,
    pub dom_threading: u64,
    pub dom_control_progress: u64,
    pub dom_data_progress: u64,
    pub dom_resource_mgmt: u64,
    pub dom_av_type: u64,
    pub dom_mr_mode: u64,
    pub dom_mr_key_size: u64,
    pub dom_cq_data_size: u64,
    pub dom_cq_cnt: u64,
    pub dom_ep_cnt: u64,
    pub dom_tx_ctx_cnt: u64,
    pub dom_rx_ctx_cnt: u64,
    pub dom_max_ep_tx_ctx: u64,
    pub dom_max_ep_rx_ctx: u64,
    pub dom_max_ep_stx_ctx: u64,
    pub dom_max_ep_srx_ctx: u64,
    pub dom_cntr_cnt: u64,
    pub dom_mr_iov_limit: u64,
    pub dom_caps: u64,
    pub dom_mode: u64,
    pub dom_auth_key_size: u64,
    pub dom_max_err_data: u64,
    pub dom_mr_cnt: u64,
    pub dom_tclass: u64,
    pub has_fabric: u64,
    pub fab_name: *const c_char,
    pub fab_prov_name: *const c_char,
    pub fab_prov_version: u64,
    pub fab_api_version: u64,
    pub has_nic: u64,
    pub has_device: u64,
    pub dev_name: *const c_char,
    pub dev_device_id: *const c_char,
    pub dev_device_version: *const c_char,
    pub dev_vendor_id: *const c_char,
    pub dev_driver: *const c_char,
    pub dev_firmware: *const c_char,
    pub has_bus: u64,
    pub bus_type: u64,
    pub pci_domain_id: u64,
    pub pci_bus_id: u64,
    pub pci_device_id: u64,
    pub pci_function_id: u64,
    pub has_link: u64,
    pub link_address: *const c_char,
    pub link_mtu: u64,
    pub link_speed: u64,
    pub link_state: u64,
    pub link_network_type: *const c_char,
}

/// Mirror of `struct efabus_completion` (= `struct fi_cq_data_entry`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct efabus_completion {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: u64,
    pub buf: *mut c_void,
    pub data: u64,
}

// The shim asserts the C side against `fi_cq_data_entry` (40 bytes on
// 64-bit targets); this holds the Rust side to the same size.
const _: () = assert!(std::mem::size_of::<efabus_completion>() == 40);

impl Default for efabus_completion {
    fn default() -> Self {
        efabus_completion {
            op_context: std::ptr::null_mut(),
            flags: 0,
            len: 0,
            buf: std::ptr::null_mut(),
            data: 0,
        }
    }
}

/// Mirror of `struct efabus_cq_error`.
#[repr(C)]
pub struct efabus_cq_error {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: u64,
    pub olen: u64,
    pub err: i64,
    pub prov_errno: i64,
    pub prov_text: [c_char; 256],
}

/// Mirror of `struct efabus_constant`.
#[repr(C)]
pub struct efabus_constant {
    pub name: *const c_char,
    pub value: u64,
}

/// What `efabus_fi_load` returns when libfabric cannot be used (shim.h).
pub const EFABUS_FI_TOO_OLD: c_int = 2;

extern "C" {
    pub fn efabus_constants(count: *mut usize) -> *const efabus_constant;
    pub fn efabus_fi_load() -> c_int;
    pub fn efabus_fi_load_error() -> *const c_char;
    pub fn efabus_fi_is_loaded() -> c_int;
    pub fn efabus_runtime_version() -> u32;
    pub fn efabus_header_version() -> u32;
    pub fn efabus_fi_loaded_from() -> *const c_char;
    pub fn efabus_reset_termination_signals() -> c_int;
    pub fn efabus_exit_at_once(status: c_int) -> !;
    pub fn efabus_requested_version() -> u32;
    pub fn efabus_strerror(err: c_int) -> *const c_char;

    pub fn efabus_getinfo(
        node: *const c_char,
        service: *const c_char,
        flags: u64,
        hints: *const efabus_hints,
        info: *mut *mut fi_info,
    ) -> c_int;
    pub fn efabus_freeinfo(info: *mut fi_info);
    pub fn efabus_info_next(info: *const fi_info) -> *mut fi_info;
    pub fn efabus_dupinfo(info: *const fi_info) -> *mut fi_info;
    pub fn efabus_info_view(info: *const fi_info, view: *mut efabus_info_view);
    pub fn efabus_info_tostr(info: *const fi_info, buf: *mut c_char, len: usize) -> usize;

    pub fn efabus_fabric(info: *const fi_info, fabric: *mut *mut fid_fabric) -> c_int;
    pub fn efabus_fabric_close(fabric: *mut fid_fabric) -> c_int;
    pub fn efabus_domain(
        fabric: *mut fid_fabric,
        info: *mut fi_info,
        domain: *mut *mut fid_domain,
    ) -> c_int;
    pub fn efabus_domain_close(domain: *mut fid_domain) -> c_int;

    pub fn efabus_av_open(
        domain: *mut fid_domain,
        av_type: u64,
        count: u64,
        av: *mut *mut fid_av,
    ) -> c_int;
    pub fn efabus_av_close(av: *mut fid_av) -> c_int;
    pub fn efabus_av_insert(av: *mut fid_av, addr: *const c_void, fi_addr: *mut u64) -> c_int;
    pub fn efabus_av_remove(av: *mut fid_av, fi_addr: u64) -> c_int;

    pub fn efabus_wait_open(fabric: *mut fid_fabric, wait: *mut *mut fid_wait) -> c_int;
    pub fn efabus_wait_fd(wait: *mut fid_wait, fd: *mut c_int) -> c_int;
    pub fn efabus_wait_close(wait: *mut fid_wait) -> c_int;
    pub fn efabus_trywait(fabric: *mut fid_fabric, wait: *mut fid_wait) -> c_int;

    pub fn efabus_cq_open(
        domain: *mut fid_domain,
        size: u64,
        wait: *mut fid_wait,
        cq: *mut *mut fid_cq,
    ) -> c_int;
    pub fn efabus_cq_close(cq: *mut fid_cq) -> c_int;
    pub fn efabus_cq_read(cq: *mut fid_cq, buf: *mut efabus_completion, count: u64) -> i64;
    pub fn efabus_cq_readfrom(
        cq: *mut fid_cq,
        buf: *mut efabus_completion,
        count: u64,
        src_addr: *mut u64,
    ) -> i64;
    pub fn efabus_cq_readerr(cq: *mut fid_cq, out: *mut efabus_cq_error) -> i64;

    pub fn efabus_endpoint(
        domain: *mut fid_domain,
        info: *mut fi_info,
        ep: *mut *mut fid_ep,
    ) -> c_int;
    pub fn efabus_ep_close(ep: *mut fid_ep) -> c_int;
    pub fn efabus_ep_bind_av(ep: *mut fid_ep, av: *mut fid_av) -> c_int;
    pub fn efabus_ep_bind_cq(ep: *mut fid_ep, cq: *mut fid_cq, flags: u64) -> c_int;
    pub fn efabus_ep_set_efa_rnr_retry(ep: *mut fid_ep, retry: u64) -> c_int;
    pub fn efabus_ep_set_min_multi_recv(ep: *mut fid_ep, min: u64) -> c_int;
    pub fn efabus_enable(ep: *mut fid_ep) -> c_int;
    pub fn efabus_getname(ep: *mut fid_ep, addr: *mut c_void, addrlen: *mut u64) -> c_int;

    pub fn efabus_mr_reg(
        domain: *mut fid_domain,
        buf: *const c_void,
        len: u64,
        access: u64,
        requested_key: u64,
        mr: *mut *mut fid_mr,
    ) -> c_int;
    pub fn efabus_mr_close(mr: *mut fid_mr) -> c_int;
    pub fn efabus_mr_desc(mr: *mut fid_mr) -> *mut c_void;
    pub fn efabus_mr_key(mr: *mut fid_mr) -> u64;

    pub fn efabus_recv(
        ep: *mut fid_ep,
        buf: *mut c_void,
        len: u64,
        desc: *mut c_void,
        context: *mut c_void,
    ) -> i64;
    pub fn efabus_recv_multi(
        ep: *mut fid_ep,
        buf: *mut c_void,
        len: u64,
        desc: *mut c_void,
        context: *mut c_void,
    ) -> i64;
    pub fn efabus_send(
        ep: *mut fid_ep,
        buf: *const c_void,
        len: u64,
        desc: *mut c_void,
        dest: u64,
        context: *mut c_void,
    ) -> i64;
    #[allow(clippy::too_many_arguments)]
    pub fn efabus_read(
        ep: *mut fid_ep,
        buf: *mut c_void,
        len: u64,
        desc: *mut c_void,
        src: u64,
        addr: u64,
        key: u64,
        context: *mut c_void,
    ) -> i64;
    pub fn efabus_inject(ep: *mut fid_ep, buf: *const c_void, len: u64, dest: u64) -> i64;
    #[allow(clippy::too_many_arguments)]
    pub fn efabus_send2(
        ep: *mut fid_ep,
        buf0: *const c_void,
        len0: u64,
        desc0: *mut c_void,
        buf1: *const c_void,
        len1: u64,
        desc1: *mut c_void,
        dest: u64,
        context: *mut c_void,
    ) -> i64;
}
