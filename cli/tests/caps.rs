//! `efabus caps` (the real binary) against libfabric's own tools and a
//! live broker, on this machine's loopback-capable providers:
//!
//! - `efabus caps -v --provider P --ep-type T` lists what
//!   `fi_info -p P -t T -v` (libfabric-bin) lists: both outputs, parsed
//!   with the core `fi_info -v` parser, are equal entry by entry.
//! - The negotiation view of `efabus caps --config FILE` is what an
//!   embedded broker and a client built from the same config negotiate
//!   (`Client::link()`), line for line.
//!
//! A missing `fi_info` or provider skips with a message, unless
//! `EFABUS_REQUIRE_FABRIC=1` (CI), which turns the skip into a failure.

mod common;

use std::process::Command;

use common::{efabus, text};
use std::time::Duration;

use efabus::{Broker, Client, ClientOptions, Config, Error};
use efabus_core::caps::{parse_fi_info_dump, FabricInfo};

const WAIT: Duration = Duration::from_secs(10);

/// Reliable providers (RDM), each paired with `udp` for DGRAM.
const RDM_PROVIDERS: &[&str] = &["tcp;ofi_rxm", "udp;ofi_rxd", "sockets"];

fn skip(why: &str) {
    assert!(
        !common::fabric_required(),
        "EFABUS_REQUIRE_FABRIC=1 but {why}"
    );
    eprintln!("skipping: {why} (set EFABUS_REQUIRE_FABRIC=1 to fail instead)");
}

/// `fi_info -p PROVIDER -t TYPE -v`, or None (after a skip) when the tool
/// or the provider is missing.
fn fi_info(provider: &str, ep_type: &str) -> Option<String> {
    match Command::new("fi_info")
        .args(["-p", provider, "-t", ep_type, "-v"])
        .output()
    {
        Ok(out) if out.status.success() => Some(text(&out.stdout)),
        Ok(out) => {
            skip(&format!(
                "fi_info -p {provider} -t {ep_type} failed: {}",
                text(&out.stderr).trim()
            ));
            None
        }
        Err(err) => {
            skip(&format!(
                "fi_info cannot run ({err}); install libfabric-bin"
            ));
            None
        }
    }
}

fn parse(what: &str, dump: &str) -> Vec<FabricInfo> {
    parse_fi_info_dump(dump).unwrap_or_else(|err| panic!("{what} does not parse: {err}\n{dump}"))
}

fn compare_with_fi_info(provider: &str, ep_type: &str, fi_type: &str) {
    let Some(theirs) = fi_info(provider, fi_type) else {
        return;
    };
    let output = efabus(&["caps", "-v", "--provider", provider, "--ep-type", ep_type]);
    assert!(
        output.status.success(),
        "efabus caps -v --provider {provider} --ep-type {ep_type}: {}",
        text(&output.stderr)
    );
    let ours = text(&output.stdout);
    let theirs = parse("fi_info output", &theirs);
    let ours = parse("efabus caps -v output", &ours);
    assert!(!theirs.is_empty(), "fi_info listed nothing for {provider}");
    assert_eq!(
        ours.len(),
        theirs.len(),
        "{provider} {fi_type}: efabus lists {} entries, fi_info {}",
        ours.len(),
        theirs.len()
    );
    for (i, (ours, theirs)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(ours.fabric_attr.prov_name, provider);
        assert_eq!(ours.ep_attr.ep_type.name(), fi_type);
        assert_eq!(
            ours, theirs,
            "{provider} entry {i} differs:\n--- efabus caps -v\n{ours}\n--- fi_info -v\n{theirs}"
        );
    }
}

#[test]
fn caps_verbose_for_a_provider_equals_fi_info() {
    for provider in RDM_PROVIDERS {
        compare_with_fi_info(provider, "rdm", "FI_EP_RDM");
    }
    compare_with_fi_info("udp", "dgram", "FI_EP_DGRAM");
}

/// `caps` says first which libfabric it loaded: hosts often have more
/// than one (the distribution's, the EFA installer's).
#[test]
fn caps_names_the_libfabric_it_uses() {
    let output = efabus(&["caps", "--config", "/dev/null"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let said = text(&output.stdout);
    let first = said.lines().next().unwrap_or_default();
    if !efabus::transports::fabric::LIBFABRIC_LINKED {
        assert!(first.contains("not found at build time"), "{said}");
        return;
    }
    let (version, rest) = first
        .strip_prefix("libfabric ")
        .and_then(|rest| rest.split_once(" from "))
        .unwrap_or_else(|| panic!("no libfabric line first:\n{said}"));
    assert!(
        version.starts_with("1.") || version.starts_with("2."),
        "{first}"
    );
    let path = rest.split(" (").next().unwrap_or_default();
    assert!(std::path::Path::new(path).exists(), "{first}");
    assert!(rest.ends_with(" headers)"), "{first}");
}

#[test]
fn caps_for_an_unknown_provider_fails_with_the_reason() {
    let output = efabus(&["caps", "--provider", "no-such-provider"]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output.stdout));
    let errors = text(&output.stderr);
    assert!(errors.contains("no-such-provider"), "{errors}");
    assert!(!errors.contains("panicked"), "{errors}");
}

/// The config of a broker on loopback whose data paths use `provider`.
fn fabric_config(provider: &str) -> String {
    format!(
        "name = \"caps-test\"\nlog_level = \"error\"\n\
         listen = [\"tcp/127.0.0.1:0\", \"efa-rdm\", \"efa-dgram\"]\n\
         [fabric]\nprovider = \"{provider}\"\ndgram_provider = \"udp\"\nnode = \"127.0.0.1\"\n"
    )
}

/// What `efabus caps --config FILE` prints for a config of `toml`.
fn caps_with_config(toml: &str) -> String {
    let path = common::temp_path("caps.toml");
    std::fs::write(&path, toml).expect("write config");
    let output = efabus(&["caps", "--config", path.to_str().expect("utf-8 path")]);
    let _ = std::fs::remove_file(&path);
    assert!(output.status.success(), "{}", text(&output.stderr));
    text(&output.stdout)
}

/// The line of `text` that starts with `label`, without it.
fn line_after<'a>(text: &'a str, label: &str) -> &'a str {
    text.lines()
        .find_map(|line| line.strip_prefix(label))
        .unwrap_or_else(|| panic!("no {label:?} line in:\n{text}"))
}

/// `caps --config` of `toml` and a client of a broker started from it
/// agree on the link, which is on `path` (`efa-rdm`, `shm`).
fn caps_view_matches_a_live_negotiation(provider: &str, toml: &str, path: &str) {
    let config = Config::from_toml_str(toml, "caps test").expect("valid config");
    let broker = match Broker::start(config) {
        Ok(broker) => broker,
        Err(err @ Error::Endpoint { .. }) => return skip(&format!("{provider}: {err}")),
        Err(err) => panic!("broker with {provider} does not start: {err}"),
    };
    let options = ClientOptions {
        connect_timeout: WAIT,
        ..ClientOptions::from_config(broker.config())
    };
    let endpoint = broker.endpoint("tcp").expect("a TCP listener");
    let client = Client::connect_with(
        &endpoint,
        options,
        efabus_transports::registry::Registry::with_builtins(),
    )
    .expect("client connects");
    let link = client.link();
    assert!(
        link.reliable.starts_with(&format!("{path} via ")),
        "{provider}: the client is not on {path}: {link:?}"
    );

    let view = caps_with_config(toml);
    assert_eq!(
        line_after(&view, "reliable: "),
        link.reliable,
        "{provider}: caps view and live link differ"
    );
    // A link with no datagram link of its own carries best effort on the
    // reliable one, as the view says.
    assert_eq!(
        line_after(&view, "best-effort: "),
        link.best_effort
            .as_deref()
            .unwrap_or("on the reliable link"),
        "{provider}: caps view and live link differ"
    );
}

#[test]
fn caps_negotiation_view_equals_what_a_broker_and_client_negotiate() {
    for provider in RDM_PROVIDERS {
        caps_view_matches_a_live_negotiation(provider, &fabric_config(provider), "efa-rdm");
    }
    // `shm` addresses differ in length from endpoint to endpoint, which
    // its frame limit allows for.
    let shm = "name = \"caps-test\"\nlog_level = \"error\"\n\
               listen = [\"tcp/127.0.0.1:0\", \"shm\"]\n\
               [fabric]\nprovider = \"tcp;ofi_rxm\"\nnode = \"127.0.0.1\"\n";
    caps_view_matches_a_live_negotiation("shm", shm, "shm");
}

/// `caps` says where a broker's large `shm` frames land: in huge pages
/// where the system has them, unless `fabric.huge_landing` is off.
#[test]
fn caps_shows_where_a_broker_s_large_shm_frames_land() {
    let huge = efabus_transports::fabric::huge_page_size();
    for (setting, expected) in [("true", huge), ("false", None)] {
        let toml = format!(
            "name = \"caps-huge\"\nlog_level = \"error\"\n\
             listen = [\"tcp/127.0.0.1:0\", \"shm\"]\n\
             [fabric]\nprovider = \"tcp;ofi_rxm\"\nnode = \"127.0.0.1\"\nhuge_landing = {setting}\n"
        );
        let view = caps_with_config(&toml);
        let Some(line) = view.lines().find(|line| line.starts_with("  shm: buffers")) else {
            return skip(&format!("shm did not open here:\n{view}"));
        };
        let landing = expected.map(|page| {
            format!(
                "; frames of 1 MiB and more land in {} MiB huge pages",
                page >> 20
            )
        });
        assert!(
            line.ends_with(landing.as_deref().unwrap_or(" MiB")),
            "huge_landing = {setting}: {line}"
        );
        assert_eq!(line.contains("huge pages"), landing.is_some(), "{line}");
    }
}
