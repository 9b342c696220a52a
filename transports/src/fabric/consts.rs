//! libfabric's ABI constants used by efabus (values from `rdma/fabric.h`,
//! `fi_eq.h`, `fi_errno.h` and `fi_ext.h` of libfabric 1.17). They are plain
//! numbers so configuration and layout code compiles without libfabric; a
//! test checks every one against the shim compiled with the real headers.

#![allow(dead_code)]

macro_rules! constants {
    ($($name:ident : $ty:ty = $value:expr;)*) => {
        $(pub const $name: $ty = $value;)*
        /// Every constant by name, as the shim's `efabus_constants` lists them.
        pub const TABLE: &[(&str, u64)] = &[$((stringify!($name), $name as u64)),*];
    };
}

constants! {
FI_MSG: u64 = 1 << 1;
    FI_RMA: u64 = 1 << 2;
    FI_READ: u64 = 1 << 8;
    FI_REMOTE_READ: u64 = 1 << 12;
    FI_RECV: u64 = 1 << 10;
    FI_SEND: u64 = 1 << 11;
    FI_TRANSMIT: u64 = 1 << 11;
    FI_MULTI_RECV: u64 = 1 << 16;
    FI_SOURCE: u64 = 1 << 57;
    FI_CONTEXT: u64 = 1 << 59;
    FI_MSG_PREFIX: u64 = 1 << 58;
    FI_CONTEXT2: u64 = 1 << 52;
    FI_MR_LOCAL: u64 = 1 << 2;
    FI_MR_VIRT_ADDR: u64 = 1 << 4;
    FI_MR_ALLOCATED: u64 = 1 << 5;
    FI_MR_PROV_KEY: u64 = 1 << 6;
    FI_MR_ENDPOINT: u64 = 1 << 9;
    FI_MR_HMEM: u64 = 1 << 10;
    FI_ORDER_SAS: u64 = 1 << 8;
    FI_EP_UNSPEC: u64 = 0;
    FI_EP_MSG: u64 = 1;
    FI_EP_DGRAM: u64 = 2;
    FI_EP_RDM: u64 = 3;
    FI_EP_SOCK_STREAM: u64 = 4;
    FI_EP_SOCK_DGRAM: u64 = 5;
    FI_FORMAT_UNSPEC: u64 = 0;
    FI_SOCKADDR: u64 = 1;
    FI_SOCKADDR_IN: u64 = 2;
    FI_SOCKADDR_IN6: u64 = 3;
    FI_ADDR_STR: u64 = 9;
    FI_ADDR_EFA: u64 = 12;
    FI_THREAD_DOMAIN: u64 = 3;
    FI_AV_TABLE: u64 = 2;
    FI_ADDR_UNSPEC: u64 = u64::MAX;
    FI_ADDR_NOTAVAIL: u64 = u64::MAX;
    FI_SUCCESS: i32 = 0;
    FI_EAGAIN: i32 = 11;
    FI_EAVAIL: i32 = 259;
    FI_ENODATA: i32 = 61;
    FI_ENOSYS: i32 = 38;
    FI_EOPNOTSUPP: i32 = 95;
    FI_ECANCELED: i32 = 125;
    FI_ETRUNC: i32 = 265;
    FI_ENOMEM: i32 = 12;
    FI_EINVAL: i32 = 22;
    FI_ENOPROTOOPT: i32 = 92;
    FI_EBUSY: i32 = 16;
    FI_ENORX: i32 = 269;
    FI_ENOKEY: i32 = 266;
    FI_OPT_EFA_RNR_RETRY: i64 = -(0xefa << 16);
    EFABUS_FI_VERSION: u64 = (1 << 16) | 17;
}
