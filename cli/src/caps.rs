//! `efabus caps`: what each transport offers, in `fi_info` terms, and what
//! efabus would choose from it.
//!
//! Without `--input` it asks the transports of this build: it lists the
//! entries each would use (efabus's own hints), then opens the endpoints a
//! broker with the given config listens on and shows what two such brokers
//! (or a broker and a client of the same config) negotiate, from offers
//! built exactly as the broker builds them ([`endpoints::offer_for`],
//! [`endpoints::as_driven`]). With `--provider` it lists instead
//! what `fi_info -p PROVIDER -t TYPE` lists (the same hints as that tool),
//! so `caps -v --provider P` and `fi_info -v -p P` can be compared entry by
//! entry. With `--input` it reads a saved `fi_info -v` dump (e.g. from an
//! EFA host), prints it back, says which entries efabus would accept and
//! why others are rejected, and shows the links two hosts would negotiate
//! (this dump on both sides, or against `--peer`).

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use efabus_broker::{endpoints, Config};
use efabus_core::caps::{
    check, negotiate, parse_fi_info_dump, to_fi_info_text, AddrFormat, Caps, EpType, FabricInfo,
    Hints, MrMode, Negotiated, Offer,
};
use efabus_core::transport::BufferMemory;
use efabus_transports::fabric::config::{buffer_memory, queue_depth, wants_multi_recv};
use efabus_transports::fabric::layout::BufferLayout;
use efabus_transports::fabric::{
    buffer_size, huge_page_size, probe_like_fi_info, provider_eager_limit, receive_depth,
    rendezvous_max, EpKind, FabricTransport, DGRAM_SCHEME, RDM_SCHEME, SHM_SCHEME,
};
use efabus_transports::registry::{EndpointSpec, Registry};
use efabus_transports::tcp;

use crate::cli::{out, Failure, Output};

/// Endpoint types `--ep-type` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EpTypeArg {
    /// `FI_EP_RDM`, reliable datagrams (`efa-rdm`).
    Rdm,
    /// `FI_EP_DGRAM`, unreliable datagrams (`efa-dgram`).
    Dgram,
}

impl From<EpTypeArg> for EpKind {
    fn from(arg: EpTypeArg) -> EpKind {
        match arg {
            EpTypeArg::Rdm => EpKind::Rdm,
            EpTypeArg::Dgram => EpKind::Dgram,
        }
    }
}

#[derive(Debug, Args)]
pub struct CapsArgs {
    /// Print every attribute, in the layout of `fi_info -v`.
    #[arg(short, long)]
    pub verbose: bool,
    /// Read a saved `fi_info -v` dump instead of asking the local transports.
    #[arg(long, short, conflicts_with = "provider")]
    pub input: Option<PathBuf>,
    /// A second dump: show what this host (`--input`) and that peer would negotiate.
    #[arg(long, requires = "input")]
    pub peer: Option<PathBuf>,
    /// Config whose listen list, [negotiation] preference and [fabric] settings apply.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// List what libfabric offers for this provider as `fi_info -p PROVIDER`
    /// does (its hints, not efabus's), and nothing else.
    #[arg(long, short)]
    pub provider: Option<String>,
    /// Endpoint type for `--provider`, as `fi_info -t`.
    #[arg(long, value_enum, default_value = "rdm", requires = "provider")]
    pub ep_type: EpTypeArg,
    /// Source address for `--provider`, as `fi_info -s`.
    #[arg(long, requires = "provider")]
    pub source: Option<String>,
}

pub fn run(args: CapsArgs) -> Result<(), Failure> {
    let config = match &args.config {
        Some(path) => Config::from_file(path)?,
        None => Config::default(),
    };
    let mut output = Output::new();
    match (&args.input, &args.provider) {
        (Some(input), _) => from_dump(&args, input, &config, &mut output),
        (None, Some(provider)) => like_fi_info(&args, provider, &mut output),
        (None, None) => from_transports(&args, &config, &mut output),
    }?;
    output.flush()
}

/// The scheme under which efabus would use an fi_info entry, if any.
fn scheme_for(info: &FabricInfo) -> Option<&'static str> {
    match info.ep_attr.ep_type {
        EpType::Rdm => Some(RDM_SCHEME),
        EpType::Dgram => Some(DGRAM_SCHEME),
        _ => None,
    }
}

/// Largest `fi_info -v` dump read (a host's whole dump is a few hundred
/// KiB).
const DUMP_MAX: u64 = 16 << 20;

fn read_dump(path: &Path) -> Result<Vec<FabricInfo>, Failure> {
    let text = efabus_broker::config::read_bounded(path, DUMP_MAX)
        .map_err(|err| Failure::usage(format!("cannot read {}: {err}", path.display())))?;
    let infos = parse_fi_info_dump(&text).map_err(|err| {
        Failure::usage(format!(
            "{}: {err}; expected the output of `fi_info -v`",
            path.display()
        ))
    })?;
    if infos.is_empty() {
        return Err(Failure::usage(format!(
            "{}: no `fi_info:` entries found; expected the output of `fi_info -v`",
            path.display()
        )));
    }
    Ok(infos)
}

/// The offers a host with these infos would make with `config`: the first
/// accepted entry per scheme, as an endpoint opened on it would offer it
/// ([`as_opened`]), plus TCP; and lines on each entry, then on what each
/// accepted one's buffers would take.
fn offers(
    infos: &[FabricInfo],
    provider: Option<&str>,
    config: &Config,
) -> (Vec<Offer>, Vec<String>) {
    let mut offers: Vec<Offer> = Vec::new();
    let mut lines = Vec::new();
    let mut memory = Vec::new();
    for info in infos {
        let name = format!(
            "{} {} {}",
            info.fabric_attr.prov_name, info.domain_attr.name, info.ep_attr.ep_type
        );
        let Some(scheme) = scheme_for(info) else {
            lines.push(format!(
                "  skipped  {name}: efabus uses RDM and DGRAM endpoints only"
            ));
            continue;
        };
        let mut hints = Hints::efabus(info.ep_attr.ep_type.clone());
        if let Some(provider) = provider {
            hints = hints.with_provider(provider);
        }
        match check(&hints, info) {
            Ok(()) if offers.iter().any(|o| o.scheme == scheme) => {
                lines.push(format!(
                    "  accepted {name} (a better {scheme} entry comes first)"
                ));
            }
            Ok(()) => {
                lines.push(format!("  accepted {name} as {scheme}"));
                let (offer, buffers) = as_opened(scheme, info, config);
                if buffers.held > 0 {
                    memory.push(buffer_line(scheme, buffers, None));
                }
                offers.push(offer);
            }
            Err(rejection) => lines.push(format!("  rejected {name}: {rejection}")),
        }
    }
    offers.push(Offer::from_info(
        tcp::SCHEME,
        &FabricInfo::tcp(None),
        Vec::new(),
    ));
    lines.extend(memory);
    (offers, lines)
}

/// The offer an endpoint opened on `info` with `config` makes, as a live
/// one reports it ([`endpoints::offer_for`]): queues at most the configured
/// depths, and messages at most what a buffer holds after the endpoint's
/// header, within the broker's frame limit; and what its buffers take.
fn as_opened(scheme: &str, info: &FabricInfo, config: &Config) -> (Offer, BufferMemory) {
    let mut offer = endpoints::offer_on(scheme, info, Vec::new());
    let Some(options) = endpoints::endpoint_options(&config.fabric, scheme) else {
        return (offer, BufferMemory::default());
    };
    // The endpoint reserves the provider's prefix whether or not its mode
    // asks for it, else the forced one.
    let prefix = match usize::try_from(info.ep_attr.msg_prefix_size) {
        Ok(prefix) if prefix > 0 => prefix,
        _ => options.force_prefix,
    };
    let kind = match info.ep_attr.ep_type {
        EpType::Rdm => EpKind::Rdm,
        _ => EpKind::Dgram,
    };
    let cap = buffer_size(kind, &info.fabric_attr.prov_name, &options);
    let layout = BufferLayout::new(
        prefix,
        BufferLayout::payload_for(info.ep_attr.max_msg_size, prefix, cap),
    );
    let addr_len = usize::try_from(info.src_addrlen).unwrap_or(0);
    let text_addresses = info.addr_format == AddrFormat::Str;
    let max_frame = layout
        .frame_limit(addr_len, text_addresses)
        .min(config.max_frame());
    offer.max_msg_size = offer
        .max_msg_size
        .min(max_frame as u64 + offer.msg_prefix_size);
    offer.rendezvous_max = rendezvous_max(
        kind,
        &info.fabric_attr.prov_name,
        info.caps.bits(),
        &options,
        (info.ep_attr.max_msg_size, config.max_frame(), max_frame),
    ) as u64;
    offer.provider_eager_limit =
        provider_eager_limit(&info.fabric_attr.prov_name).map_or(0, |limit| limit as u64);
    let rx_depth = receive_depth(
        kind,
        &info.fabric_attr.prov_name,
        &options,
        layout.recv_len(),
    );
    let depths = (
        queue_depth(rx_depth, info.rx_attr.size),
        queue_depth(options.tx_depth, info.tx_attr.size),
    );
    offer.rx_size = depths.0 as u64;
    offer.tx_size = depths.1 as u64;
    let multi_recv = wants_multi_recv(kind, &options) && info.caps.contains(&Caps::MULTI_RECV);
    let mr_local = info.domain_attr.mr_mode.contains(&MrMode::LOCAL) || options.force_mr_local;
    let buffers = buffer_memory(layout.slot_stride(), depths, multi_recv, mr_local);
    (offer, buffers)
}

fn from_dump(
    args: &CapsArgs,
    input: &Path,
    config: &Config,
    output: &mut Output,
) -> Result<(), Failure> {
    let infos = read_dump(input)?;
    print_infos(&infos, args.verbose, output)?;
    let (local, lines) = offers(&infos, None, config);
    out!(output, "\nefabus selection for {}:", input.display())?;
    for line in &lines {
        out!(output, "{line}")?;
    }
    let (remote, peer_name) = match &args.peer {
        Some(peer) => {
            let (remote, lines) = offers(&read_dump(peer)?, None, config);
            out!(output, "\nefabus selection for {}:", peer.display())?;
            for line in &lines {
                out!(output, "{line}")?;
            }
            (remote, peer.display().to_string())
        }
        None => (local.clone(), "a peer with the same dump".to_string()),
    };
    out!(
        output,
        "\nnegotiation with {peer_name} (preference: {}):",
        config.negotiation.preference.join(", ")
    )?;
    match negotiate(&local, &remote, &config.negotiation.preference) {
        Ok(negotiated) => output.write(format_args!("{negotiated}"))?,
        Err(err) => out!(output, "  {err}")?,
    }
    Ok(())
}

fn print_infos(infos: &[FabricInfo], verbose: bool, output: &mut Output) -> Result<(), Failure> {
    if verbose {
        output.write(format_args!("{}", to_fi_info_text(infos)))
    } else {
        for info in infos {
            out!(output, "{}", info.summary())?;
        }
        Ok(())
    }
}

/// `fi_info -p PROVIDER -t TYPE [-s SOURCE]`: the same query, printed the
/// same way with `-v`.
fn like_fi_info(args: &CapsArgs, provider: &str, output: &mut Output) -> Result<(), Failure> {
    let kind = EpKind::from(args.ep_type);
    let infos = probe_like_fi_info(provider, kind, args.source.as_deref())
        .map_err(|err| Failure::runtime(format!("{provider} {}: {err}", kind.fi_name())))?;
    print_infos(&infos, args.verbose, output)
}

fn from_transports(args: &CapsArgs, config: &Config, output: &mut Output) -> Result<(), Failure> {
    match efabus_transports::fabric::load_libfabric() {
        Ok(loaded) => out!(output, "{loaded}")?,
        Err(err) => out!(output, "{err}")?,
    }
    out!(output)?;
    let mut registry = Registry::with_builtins();
    for transport in [FabricTransport::rdm(), FabricTransport::dgram()] {
        let scheme = transport.kind().scheme();
        let configured = endpoints::endpoint_options(&config.fabric, scheme)
            .into_iter()
            .fold(transport, |t, options| t.with_options(options));
        registry.register(std::sync::Arc::new(configured));
    }
    for scheme in registry.schemes() {
        let transport = match registry.get(scheme) {
            Ok(transport) => transport,
            Err(err) => return Err(Failure::runtime(err.to_string())),
        };
        match transport.infos() {
            Ok(infos) => {
                out!(
                    output,
                    "{scheme}: {} entr{}",
                    infos.len(),
                    if infos.len() == 1 { "y" } else { "ies" }
                )?;
                print_infos(&infos, args.verbose, output)?;
            }
            Err(err) => out!(output, "{scheme}: {err}")?,
        }
        out!(output)?;
    }

    let listen = listened_schemes(config);
    out!(
        output,
        "negotiation between two hosts like this one, listening on {} (preference: {}):",
        listen.join(", "),
        config.negotiation.preference.join(", ")
    )?;
    let mut local = Vec::new();
    let mut memory = Vec::new();
    for spec in &listen {
        match open_offer(&registry, config, spec) {
            Ok(Some((offer, buffers))) => {
                if buffers.held > 0 {
                    let huge = (offer.scheme == SHM_SCHEME && config.fabric.huge_landing)
                        .then(huge_page_size)
                        .flatten();
                    memory.push(buffer_line(&offer.scheme, buffers, huge));
                }
                local.push(offer);
            }
            Ok(None) => {}
            Err(reason) => out!(output, "  not opened: {reason}")?,
        }
    }
    for line in &memory {
        out!(output, "{line}")?;
    }
    match negotiate(&local, &local, &config.negotiation.preference) {
        Ok(negotiated) => output.write(format_args!("{}", as_driven(&negotiated)))?,
        Err(err) => out!(output, "  {err}")?,
    }
    Ok(())
}

/// The endpoints whose offers the negotiation view uses: TCP (the control
/// link) and the data endpoints the config listens on, or both data
/// endpoints when it names none (what a fabric config would get).
fn listened_schemes(config: &Config) -> Vec<String> {
    let data: Vec<String> = config
        .listen
        .iter()
        .filter(|spec| endpoints::is_data_scheme(spec.split('/').next().unwrap_or_default()))
        .cloned()
        .collect();
    let mut listen = vec![tcp::SCHEME.to_string()];
    if data.is_empty() {
        listen.extend([RDM_SCHEME.to_string(), DGRAM_SCHEME.to_string()]);
    } else {
        listen.extend(data);
    }
    listen
}

/// Open an endpoint as a broker with `config` opens its listener for
/// `spec` (TCP without binding its port, which a running broker may hold)
/// and take its offer as the broker does.
fn open_offer(
    registry: &Registry,
    config: &Config,
    spec: &str,
) -> Result<Option<(Offer, BufferMemory)>, String> {
    let spec = EndpointSpec::parse(spec).map_err(|err| err.to_string())?;
    let bind = if endpoints::is_data_scheme(spec.scheme()) {
        Some(spec.address().unwrap_or_default().to_string())
    } else {
        None
    };
    let endpoint_config = endpoints::listener_config(config, spec.scheme(), bind);
    let endpoint = registry
        .open(&spec, &endpoint_config)
        .map_err(|err| err.to_string())?;
    Ok(endpoints::offer_for(endpoint.as_ref()).map(|offer| (offer, endpoint.buffers())))
}

/// One line on what an endpoint's buffers take, and whether its large
/// frames land in huge pages of `huge` bytes.
fn buffer_line(scheme: &str, memory: BufferMemory, huge: Option<usize>) -> String {
    let mib = |bytes: usize| bytes as f64 / f64::from(1 << 20);
    let receives = match memory.multi_recv {
        None => String::new(),
        Some((count, bytes)) => format!(
            "; receives in {count} multi-receive buffers of {} KiB",
            bytes >> 10
        ),
    };
    let landing = match huge {
        None => String::new(),
        Some(page) => format!(
            "; frames of 1 MiB and more land in {} MiB huge pages",
            page >> 20
        ),
    };
    format!(
        "  {scheme}: buffers {:.1} MiB, of which registered (pinned) {:.1} MiB{receives}{landing}",
        mib(memory.held),
        mib(memory.registered)
    )
}

/// The negotiation as live links report it: data links through
/// [`endpoints::as_driven`], the control link as chosen.
fn as_driven(negotiated: &Negotiated) -> Negotiated {
    let driven = |choice: &efabus_core::caps::Choice| {
        if endpoints::is_data_scheme(&choice.scheme) {
            endpoints::as_driven(choice)
        } else {
            choice.clone()
        }
    };
    Negotiated {
        reliable: driven(&negotiated.reliable),
        best_effort: negotiated.best_effort.as_ref().map(driven),
        reasons: negotiated.reasons.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An efa-rdm endpoint opened with the defaults on the EFA host of the
    /// saved dump pins at most 16 MiB of buffers.
    #[test]
    fn efa_endpoints_pin_at_most_16_mib_by_default() {
        let dump = include_str!("../../core/tests/fixtures/efa-fi_info-v.txt");
        let infos = parse_fi_info_dump(dump).expect("the saved EFA dump parses");
        let rdm = infos
            .iter()
            .find(|info| info.ep_attr.ep_type == EpType::Rdm)
            .expect("an RDM entry");
        let (offer, buffers) = as_opened(RDM_SCHEME, rdm, &Config::default());
        assert_eq!((offer.rx_size, offer.tx_size), (256, 256));
        assert!(
            buffers.multi_recv.is_some(),
            "efa takes multi-receive buffers"
        );
        assert_eq!(buffers.registered, buffers.held, "efa registers them all");
        assert!(
            buffers.registered <= 16 << 20,
            "{} bytes registered",
            buffers.registered
        );
        assert!(buffers.registered > 15 << 20, "{buffers:?}");
    }
}
