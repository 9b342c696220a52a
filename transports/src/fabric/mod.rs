//! The libfabric transport: EFA RDM (`efa-rdm`) and EFA DGRAM (`efa-dgram`)
//! endpoints, same-host RDM endpoints on the `shm` provider (`shm`), and
//! the safe binding they are built on.
//!
//! This module owns everything that touches libfabric:
//! - `csrc/shim.c` (built by `build.rs`) wraps libfabric's `static inline`
//!   API in plain functions and flattens `fi_info` into a struct of
//!   fixed-width fields, so the Rust side never mirrors libfabric's own
//!   structs (which differ between 1.x and 2.x). It loads libfabric at
//!   the first call that needs it ([`load_libfabric`]), not with the
//!   process (where [`LIBFABRIC_LOADED_AT_FIRST_USE`]; builds against
//!   releases it does not know link it).
//! - [`info`], [`handle`] and [`pool`] are the safe wrapper: `fi_getinfo`
//!   lists, one owning type per libfabric object (closed in `Drop`,
//!   parents kept alive by `Rc`), registered buffer pools. All `unsafe`
//!   code of the crate lives in these modules, [`endpoint`] and its
//!   rendezvous bookkeeping (`rendezvous`: registrations shared per body,
//!   transfers waiting for their done, reads queued and in flight, reused
//!   landing buffers, and `huge`: the huge-page mappings `shm`'s large
//!   frames land in).
//! - [`endpoint`] is the [`Endpoint`](efabus_core::transport::Endpoint)
//!   implementation; [`layout`] its buffer layout, testable without
//!   libfabric; [`config`] its kinds, schemes and address text. Its
//!   options are the typed [`FabricOptions`] an
//!   [`EndpointConfig`](efabus_core::transport::EndpointConfig) carries.
//! - [`apply_provider_env_defaults`] sets the providers' own tunables
//!   (read only from the environment) that efabus chooses differently.
//!
//! Built without libfabric (none found by `build.rs`), the transport still
//! exists and reports at run time why it is unavailable.
//!
//! # EFA rules honoured (values read at run time)
//!
//! - `FI_MSG_PREFIX`: accepted in the hints; `msg_prefix_size` bytes are
//!   reserved in front of every posted buffer, lengths include them.
//! - `FI_MR_LOCAL`: pools registered once, `fi_mr_desc` passed with every
//!   post, and each rendezvous landing buffer registered for its read;
//!   `FI_MR_PROV_KEY`/`ALLOCATED`/`VIRT_ADDR` honoured (keys come from the
//!   provider, else are drawn at random within `mr_key_size`, and travel
//!   as 8 bytes whatever `mr_key_size` is, 4 on EFA;
//!   registered memory is allocated first; descriptors name virtual
//!   addresses under `FI_MR_VIRT_ADDR`, else offsets).
//! - RDM asks for `FI_RMA | FI_READ | FI_REMOTE_READ` and falls back
//!   without: frames above the eager size then go by rendezvous (a
//!   descriptor sent eagerly, the body read one-sided by the receiver), see
//!   the README's "Large frames".
//! - `FI_ORDER_SAS` requested on RDM tx and rx; whether it was granted is
//!   [`FabricEndpoint::sas_granted`] so the session layer can reorder.
//! - `max_msg_size` bounds `max_frame` (prefix counted); `inject_size`
//!   bounds `fi_inject` (0: never).
//! - CQs are polled; a post refused with -FI_EAGAIN waits in its peer's
//!   backlog, and progress plus every later poll retries it. When
//!   the provider offers a wait set (`fi_wait_open` with FI_WAIT_FD; not
//!   efa on 1.17) both CQs signal it and the endpoint reports
//!   `Readiness::PollOrWait` with its descriptor, `fi_trywait` guarding
//!   every sleep; otherwise `Readiness::MustPoll`.
//! - Receives are kept posted (`rx_depth`, capped by the provider's rx
//!   size): on efa RDM, which grants `FI_MULTI_RECV`, as that many eager
//!   buffers' worth of multi-receive buffers (`FI_OPT_MIN_MULTI_RECV` set
//!   to the largest message, after `fi_enable`: libfabric 1.17's `shm`
//!   crashes when it is set before); `FI_OPT_EFA_RNR_RETRY` is set on efa
//!   RDM endpoints.
//! - `FI_AV_TABLE`; peers are inserted before traffic and addressed by the
//!   `fi_addr_t` the insert returned.
//! - Addresses are the raw `fi_getname` bytes (32 on EFA), exchanged out of
//!   band by the caller.
//!
//! Memory registration on EFA needs `ulimit -l unlimited`.

pub mod attrs;
pub mod config;
pub(crate) mod consts;
pub mod convert;
pub mod error;
pub mod layout;
mod provider_env;

#[cfg(not(efabus_libfabric))]
mod absent;
#[cfg(efabus_libfabric)]
pub mod endpoint;
#[cfg(efabus_libfabric)]
pub mod handle;
#[cfg(efabus_libfabric)]
mod huge;
#[cfg(efabus_libfabric)]
pub mod info;
#[cfg(efabus_libfabric)]
mod log_limit;
#[cfg(efabus_libfabric)]
pub mod pool;
#[cfg(efabus_libfabric)]
mod rendezvous;
#[cfg(efabus_libfabric)]
mod sys;

#[cfg(not(efabus_libfabric))]
pub use absent::FabricEndpoint;
pub use attrs::InfoAttrs;
pub use config::{
    addr_from_hex, addr_to_hex, buffer_size, huge_page_size, receive_depth, rendezvous_max, EpKind,
    FabricOptionError, FabricOptions, OrderWanted, DGRAM_SCHEME, RDM_SCHEME, RMA_READ_CAPS,
    SHM_PROVIDER, SHM_SCHEME,
};
#[cfg(efabus_libfabric)]
pub use endpoint::{FabricEndpoint, FabricStats, LinkInfo};
pub use error::{FabricError, FiCode};
pub use provider_env::{apply_provider_env_defaults, provider_eager_limit, PROVIDER_ENV_DEFAULTS};

use efabus_core::caps::FabricInfo;
use efabus_core::transport::{Endpoint, EndpointConfig, Transport, TransportError};

/// Whether this build has the fabric transport (libfabric was found when
/// it was built). Whether the library is linked into the program or loaded
/// at its first use is [`LIBFABRIC_LOADED_AT_FIRST_USE`].
pub const LIBFABRIC_LINKED: bool = cfg!(efabus_libfabric);

/// Whether libfabric is loaded at its first use ([`load_libfabric`])
/// rather than with the program: in builds against libfabric 1.17 to 2.6
/// (whose symbol versions the build knows) that found a `libfabric.so.1`;
/// later releases are linked.
pub const LIBFABRIC_LOADED_AT_FIRST_USE: bool = cfg!(efabus_libfabric_at_first_use);

/// Which libfabric a process uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedLibfabric {
    /// The file it was loaded from.
    pub path: String,
    /// Its version, (major, minor).
    pub version: (u32, u32),
    /// The version of the headers efabus was built with.
    pub built_with: (u32, u32),
}

impl std::fmt::Display for LoadedLibfabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "libfabric {}.{} from {} (efabus built with {}.{} headers)",
            self.version.0, self.version.1, self.path, self.built_with.0, self.built_with.1
        )
    }
}

/// Loads libfabric now rather than at the first fabric call and says which
/// one it is, or why it cannot be loaded. Where
/// [`LIBFABRIC_LOADED_AT_FIRST_USE`], a process that never opens a fabric
/// endpoint never loads it (with distribution builds of libfabric, loading
/// costs about 200 ms: a library it pulls in times the CPU as it loads),
/// and loading keeps the process's signal handlers as they were: a program
/// that installs its own from another thread should do so before the first
/// fabric call (or call this first), as a handler installed while the
/// library loads is put back. A libfabric the program loaded already (its
/// own) is the one used.
pub fn load_libfabric() -> Result<LoadedLibfabric, FabricError> {
    #[cfg(efabus_libfabric)]
    {
        info::loaded()
    }
    #[cfg(not(efabus_libfabric))]
    {
        Err(FabricError::NotBuilt(
            env!("EFABUS_LIBFABRIC_MISSING").to_string(),
        ))
    }
}

/// The libfabric this process uses, if it has loaded it (this does not
/// load it): for reports on a running process.
pub fn libfabric_in_use() -> Option<LoadedLibfabric> {
    #[cfg(efabus_libfabric)]
    {
        // SAFETY: reads a flag of the shim's; loads nothing.
        if unsafe { sys::efabus_fi_is_loaded() } == 0 {
            return None;
        }
        info::loaded().ok()
    }
    #[cfg(not(efabus_libfabric))]
    {
        None
    }
}

/// Why the fabric transport cannot work in this build, if it cannot.
pub fn build_unavailable_reason() -> Option<&'static str> {
    #[cfg(efabus_libfabric)]
    {
        None
    }
    #[cfg(not(efabus_libfabric))]
    {
        Some(env!("EFABUS_LIBFABRIC_MISSING"))
    }
}

/// Remove the SIGINT and SIGTERM handlers that libfabric's dependencies
/// (psm, infinipath) install when the library is loaded with the program
/// (where [`LIBFABRIC_LOADED_AT_FIRST_USE`] is false): they end the process
/// at once, which would defeat a graceful shutdown. It removes any handler
/// of the two, the application's own included: call it before installing
/// those. Returns how many handlers were removed. (Loaded at first use,
/// libfabric leaves the process's handlers as they were.)
pub fn reset_inherited_termination_handlers() -> Result<usize, std::io::Error> {
    #[cfg(efabus_libfabric)]
    {
        // SAFETY: the shim only calls sigaction(2) for SIGINT and SIGTERM,
        // reading the current action and, when a handler is set, putting
        // back the default; it touches no memory of ours.
        let removed = unsafe { sys::efabus_reset_termination_signals() };
        usize::try_from(removed).map_err(|_| std::io::Error::last_os_error())
    }
    #[cfg(not(efabus_libfabric))]
    {
        Ok(0)
    }
}

/// End the process with `status` at once, running no exit handlers: for a
/// process whose thread may be stuck inside libfabric, where libfabric's
/// own destructor (run by `std::process::exit`) would tear its providers
/// down under it.
pub fn exit_at_once(status: i32) -> ! {
    #[cfg(efabus_libfabric)]
    {
        // SAFETY: `_exit(2)` takes an integer and never returns; it reads
        // and writes no memory of ours.
        unsafe { sys::efabus_exit_at_once(status) }
    }
    #[cfg(not(efabus_libfabric))]
    {
        std::process::exit(status)
    }
}

/// What `fi_info -p <provider> -t <ep_type> [-s <source>] -v` lists, as
/// [`FabricInfo`]s: the same hints (every mode and mr_mode bit accepted,
/// no capability asked for), so the two can be compared entry by entry.
pub fn probe_like_fi_info(
    provider: &str,
    kind: EpKind,
    source: Option<&str>,
) -> Result<Vec<FabricInfo>, FabricError> {
    #[cfg(efabus_libfabric)]
    {
        let hints = info::Hints {
            node: source.map(str::to_string),
            source: source.is_some(),
            ..info::Hints::like_fi_info_tool(provider, kind.fi_value())
        };
        let list = info::InfoList::get(&hints)?;
        Ok(list.iter().map(|i| i.fabric_info()).collect())
    }
    #[cfg(not(efabus_libfabric))]
    {
        let _ = (provider, kind, source);
        Err(FabricError::NotBuilt(
            env!("EFABUS_LIBFABRIC_MISSING").to_string(),
        ))
    }
}

/// The factory for `efa-rdm`, `efa-dgram` and `shm` endpoints.
///
/// The options set here ([`FabricTransport::with_options`]) apply to
/// [`Transport::infos`] and to every endpoint it opens whose
/// `EndpointConfig` has no [`fabric`](EndpointConfig::fabric) options of
/// its own; a config's options replace them whole.
#[derive(Debug, Clone)]
pub struct FabricTransport {
    kind: EpKind,
    scheme: &'static str,
    options: FabricOptions,
}

impl FabricTransport {
    /// Reliable datagrams (`FI_EP_RDM`), scheme `efa-rdm`.
    pub fn rdm() -> Self {
        FabricTransport {
            kind: EpKind::Rdm,
            scheme: RDM_SCHEME,
            options: FabricOptions::default(),
        }
    }

    /// Reliable datagrams between processes of one host through
    /// libfabric's `shm` provider, scheme `shm`: whatever provider the
    /// options name, `shm` is used, with no source address (it has none).
    pub fn shm() -> Self {
        FabricTransport {
            kind: EpKind::Rdm,
            scheme: SHM_SCHEME,
            options: FabricOptions {
                provider: SHM_PROVIDER.to_string(),
                ..FabricOptions::default()
            },
        }
    }

    /// Unreliable datagrams (`FI_EP_DGRAM`), scheme `efa-dgram`.
    pub fn dgram() -> Self {
        FabricTransport {
            kind: EpKind::Dgram,
            scheme: DGRAM_SCHEME,
            options: FabricOptions::default(),
        }
    }

    /// Sets the options (e.g. the provider) this transport lists infos
    /// and opens endpoints with.
    pub fn with_options(mut self, options: FabricOptions) -> Self {
        self.options = options;
        self
    }

    /// The options set with [`FabricTransport::with_options`].
    pub fn options(&self) -> &FabricOptions {
        &self.options
    }

    pub fn kind(&self) -> EpKind {
        self.kind
    }

    /// The options an endpoint opens with: the config's, else this
    /// transport's, bound at the config's bind address and checked. The
    /// config's textual options are refused: the fabric takes typed ones.
    pub fn options_for(
        &self,
        config: Option<&EndpointConfig>,
    ) -> Result<FabricOptions, FabricError> {
        let Some(config) = config else {
            let options = self.for_scheme(self.options.clone());
            options.check()?;
            return Ok(options);
        };
        if let Some((key, value)) = config.options.first() {
            return Err(FabricError::Option {
                key: key.clone(),
                value: value.clone(),
                reason: "the fabric endpoints take no textual options; \
                         set EndpointConfig::fabric"
                    .into(),
            });
        }
        let options = config
            .fabric
            .clone()
            .unwrap_or_else(|| self.options.clone())
            .bound_at(config.bind.as_deref());
        let options = self.for_scheme(options);
        options.check()?;
        Ok(options)
    }

    /// `shm` endpoints are opened with the `shm` provider and a name of
    /// this process's own ([`shm_name`]), whatever the options say.
    fn for_scheme(&self, options: FabricOptions) -> FabricOptions {
        if self.scheme != SHM_SCHEME {
            return options;
        }
        FabricOptions {
            provider: SHM_PROVIDER.to_string(),
            node: Some(shm_name().to_string()),
            service: None,
            ..options
        }
    }

    fn unavailable(&self, err: &FabricError) -> TransportError {
        TransportError::Unavailable {
            scheme: self.scheme.to_string(),
            reason: err.to_string(),
        }
    }

    /// Without libfabric no endpoint opens: the reason is reported.
    #[cfg(not(efabus_libfabric))]
    pub fn open_fabric(&self, config: &EndpointConfig) -> Result<FabricEndpoint, TransportError> {
        let _ = config;
        Err(self.unavailable(&FabricError::NotBuilt(
            env!("EFABUS_LIBFABRIC_MISSING").to_string(),
        )))
    }

    /// Opens an endpoint with its concrete type, for callers that want
    /// [`FabricEndpoint::link`] (e.g. whether FI_ORDER_SAS was granted).
    #[cfg(efabus_libfabric)]
    pub fn open_fabric(&self, config: &EndpointConfig) -> Result<FabricEndpoint, TransportError> {
        let options = self
            .options_for(Some(config))
            .map_err(|e| TransportError::Other(e.to_string()))?;
        let mut endpoint =
            FabricEndpoint::open(self.kind, &options, config).map_err(|err| match err {
                FabricError::GetInfo { .. }
                | FabricError::NotLoaded(_)
                | FabricError::TooOld(_) => self.unavailable(&err),
                other => TransportError::Other(other.to_string()),
            })?;
        endpoint.scheme = self.scheme;
        // Which libfabric serves the process, once: hosts may have several.
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            if let Ok(loaded) = info::loaded() {
                tracing::info!("{loaded}");
            }
        });
        Ok(endpoint)
    }

    /// What `fi_getinfo` offers for this transport's hints, as values.
    pub fn raw_infos(&self) -> Result<Vec<InfoAttrs>, FabricError> {
        #[cfg(efabus_libfabric)]
        {
            let options = self.options_for(None)?;
            let (list, _) = endpoint::get_info(self.kind, &options)?;
            Ok(list.iter().map(|i| i.attrs()).collect())
        }
        #[cfg(not(efabus_libfabric))]
        {
            Err(FabricError::NotBuilt(
                env!("EFABUS_LIBFABRIC_MISSING").to_string(),
            ))
        }
    }

    /// The same infos in `fi_info -v` layout (`fi_tostr`), separated by
    /// `---` lines as `fi_info` prints them.
    pub fn info_text(&self) -> Result<String, FabricError> {
        #[cfg(efabus_libfabric)]
        {
            let options = self.options_for(None)?;
            let (list, _) = endpoint::get_info(self.kind, &options)?;
            let mut text = String::new();
            for info in list.iter() {
                text.push_str("---\n");
                text.push_str(&info.to_text());
            }
            Ok(text)
        }
        #[cfg(not(efabus_libfabric))]
        {
            Err(FabricError::NotBuilt(
                env!("EFABUS_LIBFABRIC_MISSING").to_string(),
            ))
        }
    }
}

impl Transport for FabricTransport {
    fn scheme(&self) -> &str {
        self.scheme
    }

    fn infos(&self) -> Result<Vec<FabricInfo>, TransportError> {
        let raw = self.raw_infos().map_err(|e| self.unavailable(&e))?;
        Ok(raw.iter().map(convert::to_fabric_info).collect())
    }

    fn open(&self, config: &EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        #[cfg(efabus_libfabric)]
        {
            Ok(Box::new(self.open_fabric(config)?))
        }
        #[cfg(not(efabus_libfabric))]
        {
            let _ = config;
            Err(self.unavailable(&FabricError::NotBuilt(
                env!("EFABUS_LIBFABRIC_MISSING").to_string(),
            )))
        }
    }
}

/// The name this process's `shm` endpoints are opened under: its process
/// id followed by ten random digits. Left to itself, libfabric 1.17's
/// `shm` names an endpoint's region in `/dev/shm` after the process id
/// alone and will not open one whose name exists (`fi_enable` fails with
/// `-FI_EBUSY`). A process killed before it closed its endpoints leaves
/// its regions behind, and a later process given the same id (or one in
/// another pid namespace sharing `/dev/shm`) could then not open `shm`
/// at all. The provider adds the user and the endpoint's index to the
/// name, so endpoints of one process stay apart. Digits only: peers check
/// that an `shm` address has the provider's form.
fn shm_name() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let mut random = [0u8; 8];
        // Without randomness the name is the process id alone, as the
        // provider would choose.
        let nonce = match getrandom::fill(&mut random) {
            Ok(()) => format!("{:010}", u64::from_le_bytes(random) % 10_000_000_000),
            Err(_) => String::new(),
        };
        format!("{}{nonce}", std::process::id())
    })
}
