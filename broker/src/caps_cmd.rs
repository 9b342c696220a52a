//! `efabus caps`: what each transport offers, in `fi_info` terms, and what
//! efabus would choose from it.
//!
//! Without `--input` it asks the transports of this build; with `--input`
//! it reads a saved `fi_info -v` dump (e.g. from an EFA host), prints it
//! back, says which entries efabus would accept and why others are
//! rejected, and shows the links two hosts would negotiate (this dump on
//! both sides, or against `--peer`).

use std::path::{Path, PathBuf};

use clap::Args;
use efabus_core::caps::{
    check, negotiate, parse_fi_info_dump, to_fi_info_text, EpType, FabricInfo, Hints, Offer,
};
use efabus_transports::fabric::FabricTransport;
use efabus_transports::registry::Registry;

use crate::cli::{out, Failure, Output};
use crate::config::Config;

#[derive(Debug, Args)]
pub struct CapsArgs {
    /// Print every attribute, in the layout of `fi_info -v`.
    #[arg(short, long)]
    pub verbose: bool,
    /// Read a saved `fi_info -v` dump instead of asking the local transports.
    #[arg(long, short)]
    pub input: Option<PathBuf>,
    /// A second dump: show what this host (`--input`) and that peer would negotiate.
    #[arg(long, requires = "input")]
    pub peer: Option<PathBuf>,
    /// Config whose [negotiation] preference and [fabric] settings apply.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
}

pub fn run(args: CapsArgs) -> Result<(), Failure> {
    let config = match &args.config {
        Some(path) => Config::from_file(path)?,
        None => Config::default(),
    };
    let mut output = Output::new();
    match &args.input {
        Some(input) => from_dump(&args, input, &config, &mut output),
        None => from_transports(&args, &config, &mut output),
    }?;
    output.flush()
}

/// The scheme under which efabus would use an fi_info entry, if any.
fn scheme_for(info: &FabricInfo) -> Option<&'static str> {
    match info.ep_attr.ep_type {
        EpType::Rdm => Some("efa-rdm"),
        EpType::Dgram => Some("efa-dgram"),
        _ => None,
    }
}

fn read_dump(path: &Path) -> Result<Vec<FabricInfo>, Failure> {
    let text = std::fs::read_to_string(path)
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

/// The offers a host with these infos would make: the first accepted entry
/// per scheme, plus TCP.
fn offers(infos: &[FabricInfo], provider: Option<&str>) -> (Vec<Offer>, Vec<String>) {
    let mut offers: Vec<Offer> = Vec::new();
    let mut lines = Vec::new();
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
                offers.push(Offer::from_info(scheme, info, Vec::new()));
            }
            Err(rejection) => lines.push(format!("  rejected {name}: {rejection}")),
        }
    }
    offers.push(Offer::from_info("tcp", &FabricInfo::tcp(None), Vec::new()));
    (offers, lines)
}

fn from_dump(
    args: &CapsArgs,
    input: &Path,
    config: &Config,
    output: &mut Output,
) -> Result<(), Failure> {
    let infos = read_dump(input)?;
    print_infos(&infos, args.verbose, output)?;
    let (local, lines) = offers(&infos, None);
    out!(output, "\nefabus selection for {}:", input.display())?;
    for line in &lines {
        out!(output, "{line}")?;
    }
    let (remote, peer_name) = match &args.peer {
        Some(peer) => {
            let (remote, lines) = offers(&read_dump(peer)?, None);
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

fn from_transports(args: &CapsArgs, config: &Config, output: &mut Output) -> Result<(), Failure> {
    let mut registry = Registry::with_builtins();
    for transport in [FabricTransport::rdm(), FabricTransport::dgram()] {
        let scheme = transport.kind().scheme();
        let configured = crate::server::endpoint_options(&config.fabric, scheme)
            .into_iter()
            .fold(transport, |t, (key, value)| t.with_option(key, value));
        registry.register(std::sync::Arc::new(configured));
    }
    let mut local = Vec::new();
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
                if let Some(info) = infos.first() {
                    local.push(Offer::from_info(scheme, info, Vec::new()));
                }
            }
            Err(err) => out!(output, "{scheme}: {err}")?,
        }
        out!(output)?;
    }
    out!(
        output,
        "negotiation between two hosts like this one (preference: {}):",
        config.negotiation.preference.join(", ")
    )?;
    match negotiate(&local, &local, &config.negotiation.preference) {
        Ok(negotiated) => output.write(format_args!("{negotiated}"))?,
        Err(err) => out!(output, "  {err}")?,
    }
    Ok(())
}
