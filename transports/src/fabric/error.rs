//! The one error type of the libfabric binding: a variant per C call, each
//! carrying libfabric's error code and its `fi_strerror` text, plus the
//! provider's own text for completion-queue errors.

use std::fmt;

use thiserror::Error;

/// A libfabric return code; it renders with its `fi_strerror` text.
///
/// The text is looked up only when shown: the data path meets
/// `-FI_EAGAIN` on most polls, and `fi_strerror` goes through gettext.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FiCode {
    /// The positive error number (`FI_ENODATA` = 61); calls return it negated.
    pub code: i32,
}

impl FiCode {
    /// The code from a negative (or positive) return value.
    pub fn from_ret(ret: i64) -> FiCode {
        FiCode {
            code: i32::try_from(ret.unsigned_abs()).unwrap_or(i32::MAX),
        }
    }

    /// `fi_strerror(code)`.
    pub fn text(&self) -> String {
        strerror(self.code)
    }

    /// Whether this is `-FI_EAGAIN`.
    pub fn is_again(&self) -> bool {
        self.code == super::consts::FI_EAGAIN
    }
}

impl fmt::Display for FiCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match errno_name(self.code) {
            Some(name) => write!(f, "-{name}: {}", self.text()),
            None => write!(f, "-{}: {}", self.code, self.text()),
        }
    }
}

/// `fi_strerror`, or the OS text where libfabric is not linked.
pub fn strerror(code: i32) -> String {
    #[cfg(efabus_libfabric)]
    {
        super::info::strerror(code)
    }
    #[cfg(not(efabus_libfabric))]
    {
        std::io::Error::from_raw_os_error(code).to_string()
    }
}

/// The `FI_E*` name of the codes efabus meets most, for readable messages.
fn errno_name(code: i32) -> Option<&'static str> {
    use super::consts::*;
    Some(match code {
        FI_EAGAIN => "FI_EAGAIN",
        FI_EAVAIL => "FI_EAVAIL",
        FI_ENODATA => "FI_ENODATA",
        FI_ENOSYS => "FI_ENOSYS",
        FI_EOPNOTSUPP => "FI_EOPNOTSUPP",
        FI_ECANCELED => "FI_ECANCELED",
        FI_ETRUNC => "FI_ETRUNC",
        FI_ENOMEM => "FI_ENOMEM",
        FI_EINVAL => "FI_EINVAL",
        FI_ENOPROTOOPT => "FI_ENOPROTOOPT",
        FI_EBUSY => "FI_EBUSY",
        FI_ENORX => "FI_ENORX",
        _ => return None,
    })
}

/// Memory registration and endpoint creation on EFA pin pages; the usual
/// cause of their ENOMEM is the locked-memory limit.
const MEMLOCK_HINT: &str = "on EFA hosts run with `ulimit -l unlimited`";

/// Errors from the libfabric binding and the fabric endpoints.
#[derive(Debug, Error)]
pub enum FabricError {
    /// The crate was built without libfabric.
    #[error("{0}")]
    NotBuilt(String),
    /// No libfabric could be loaded when first needed.
    #[error(
        "libfabric could not be loaded: {0}; install it (Debian and Ubuntu: libfabric1), \
         put its directory in LD_LIBRARY_PATH, or name the file in EFABUS_LIBFABRIC"
    )]
    NotLoaded(String),
    /// The libfabric found lacks a function at the version efabus needs.
    #[error(
        "libfabric cannot be used: {0}; name a newer one in EFABUS_LIBFABRIC (unless the \
         program has loaded its own) or rebuild efabus against this one"
    )]
    TooOld(String),
    #[error("fi_getinfo found nothing for provider {provider:?} ({ep_type}): {code}{}",
        if code.code == super::consts::FI_ENODATA { " (no matching device or provider)" } else { "" })]
    GetInfo {
        provider: String,
        ep_type: &'static str,
        code: FiCode,
    },
    #[error("cannot draw random memory keys: {0}")]
    Random(String),
    #[error("fi_dupinfo failed: out of memory")]
    DupInfo,
    #[error("fi_fabric({name}) failed: {code}")]
    Fabric { name: String, code: FiCode },
    #[error("fi_domain({name}) failed: {code}")]
    Domain { name: String, code: FiCode },
    #[error("fi_av_open failed: {code}")]
    AvOpen { code: FiCode },
    #[error("fi_av_insert of a {len}-byte address failed: {code}")]
    AvInsert { len: usize, code: FiCode },
    #[error("fi_av_remove failed: {code}")]
    AvRemove { code: FiCode },
    #[error("the address vector holds {limit} addresses of live peers already")]
    AddressesFull { limit: usize },
    #[error("link id {0} is in use on this endpoint")]
    LinkIdInUse(u64),
    #[error(
        "the link's send key served an earlier link of this endpoint; keys serve one link only"
    )]
    SendKeyReused,
    #[error("not a name the shm provider gives its endpoints (fi_shm://, then digits and colons)")]
    NotAnShmName,
    #[error(
        "the provider gave this address the entry of another address, in use by a live peer \
         (shm maps a name whose region does not exist to the slot the next name takes)"
    )]
    AddressAliased,
    #[error("no shared-memory region of that shm name exists on this host")]
    NoShmRegion,
    #[error("fi_cq_open failed: {code}")]
    CqOpen { code: FiCode },
    #[error("fi_cq_read failed: {code}")]
    CqRead { code: FiCode },
    #[error("fi_cq_readerr failed: {code}")]
    CqReadErr { code: FiCode },
    /// An operation completed in error; `provider_text` is `fi_cq_strerror`.
    #[error("{op} completed with {code} (provider error {prov_errno}: {provider_text})")]
    Completion {
        op: &'static str,
        code: FiCode,
        prov_errno: i64,
        provider_text: String,
    },
    #[error("fi_endpoint failed: {code} ({MEMLOCK_HINT})")]
    Endpoint { code: FiCode },
    #[error("fi_ep_bind({what}) failed: {code}")]
    EpBind { what: &'static str, code: FiCode },
    #[error("fi_setopt({option}) failed: {code}")]
    SetOpt { option: &'static str, code: FiCode },
    #[error("fi_enable failed: {code}")]
    Enable { code: FiCode },
    #[error("fi_getname failed: {code}")]
    GetName { code: FiCode },
    #[error("fi_mr_reg of {len} bytes failed: {code} ({MEMLOCK_HINT})")]
    MrReg { len: usize, code: FiCode },
    #[error("fi_recv failed: {code}")]
    Recv { code: FiCode },
    #[error("fi_send failed: {code}")]
    Send { code: FiCode },
    #[error("fi_read (rendezvous) failed: {code}")]
    Read { code: FiCode },
    #[error("fi_inject failed: {code}")]
    Inject { code: FiCode },
    #[error("fi_close({what}) failed: {code}")]
    Close { what: &'static str, code: FiCode },
    /// A configuration value efabus cannot use.
    #[error("fabric option {key}={value:?}: {reason}")]
    Option {
        key: String,
        value: String,
        reason: String,
    },
    /// The provider granted something efabus cannot work with.
    #[error("provider {provider:?} is unusable: {reason}")]
    Unusable { provider: String, reason: String },
    /// Memory for the buffer pools could not be allocated.
    #[error("cannot allocate {bytes} bytes of buffers")]
    Alloc { bytes: usize },
}

impl From<efabus_core::transport::FabricOptionError> for FabricError {
    fn from(err: efabus_core::transport::FabricOptionError) -> Self {
        FabricError::Option {
            key: err.key,
            value: err.value,
            reason: err.reason,
        }
    }
}

impl FabricError {
    /// The libfabric code, for variants that carry one.
    pub fn code(&self) -> Option<&FiCode> {
        use FabricError::*;
        match self {
            GetInfo { code, .. }
            | Fabric { code, .. }
            | Domain { code, .. }
            | AvOpen { code }
            | AvInsert { code, .. }
            | AvRemove { code }
            | CqOpen { code }
            | CqRead { code }
            | CqReadErr { code }
            | Completion { code, .. }
            | Endpoint { code }
            | EpBind { code, .. }
            | SetOpt { code, .. }
            | Enable { code }
            | GetName { code }
            | MrReg { code, .. }
            | Recv { code }
            | Send { code }
            | Read { code }
            | Inject { code }
            | Close { code, .. } => Some(code),
            NotBuilt(_)
            | NotLoaded(_)
            | TooOld(_)
            | Random(_)
            | DupInfo
            | Option { .. }
            | Unusable { .. }
            | Alloc { .. }
            | AddressesFull { .. }
            | LinkIdInUse(_)
            | SendKeyReused
            | NotAnShmName
            | AddressAliased
            | NoShmRegion => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_render_with_their_names() {
        let code = FiCode { code: 61 };
        assert_eq!(code.to_string(), format!("-FI_ENODATA: {}", strerror(61)));
        let err = FabricError::GetInfo {
            provider: "efa".into(),
            ep_type: "FI_EP_RDM",
            code,
        };
        let text = err.to_string();
        assert!(text.contains("\"efa\""), "{text}");
        assert!(text.contains("-FI_ENODATA"), "{text}");
        assert!(text.contains("no matching device"), "{text}");
    }

    #[test]
    fn from_ret_takes_either_sign() {
        assert_eq!(FiCode::from_ret(-11).code, 11);
        assert!(FiCode::from_ret(-11).is_again());
        assert_eq!(FiCode::from_ret(22).code, 22);
        assert!(!FiCode::from_ret(-22).is_again());
    }

    #[test]
    fn memory_errors_name_the_memlock_limit() {
        let err = FabricError::MrReg {
            len: 4096,
            code: FiCode::from_ret(-12),
        };
        assert!(err.to_string().contains("ulimit -l unlimited"));
    }
}
