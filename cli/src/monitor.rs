//! `efabus stats` and `efabus conns`: read a running broker's monitoring
//! listener (`serve --monitor`, or `monitor` in its config) and print its
//! counters, with rates when watching, and its connections with the link
//! each one rides.

use std::time::{Duration, Instant};

use clap::Args;
use efabus_broker::BrokerStats;
use serde_json::Value;

use crate::cli::{out, Failure, Output};

/// Where `stats` and `conns` look when not told.
const DEFAULT_MONITOR: &str = "127.0.0.1:8222";
/// How long one read of the monitor may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Args)]
pub struct StatsArgs {
    /// The broker's monitoring address (HOST:PORT).
    #[arg(long, short, default_value = DEFAULT_MONITOR, env = "EFABUS_MONITOR")]
    pub monitor: String,
    /// Print the counters again every interval, with their rates, until
    /// interrupted.
    #[arg(long, short)]
    pub watch: bool,
    /// Seconds between two prints with --watch.
    #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
    pub interval: f64,
}

#[derive(Debug, Args)]
pub struct ConnsArgs {
    /// The broker's monitoring address (HOST:PORT).
    #[arg(long, short, default_value = DEFAULT_MONITOR, env = "EFABUS_MONITOR")]
    pub monitor: String,
    /// Order: cid, start, msgs_to, msgs_from, bytes_to, bytes_from,
    /// pending, dropped, subs.
    #[arg(long, default_value = "cid", value_parser = [
        "cid", "start", "msgs_to", "msgs_from", "bytes_to", "bytes_from", "pending", "dropped", "subs",
    ])]
    pub sort: String,
    /// Most connections listed.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// Also list the routes to other brokers.
    #[arg(long)]
    pub routes: bool,
}

/// GET `path` from the monitor at `address`, as JSON.
fn read(address: &str, path: &str) -> Result<Value, Failure> {
    // A URL given for the address is taken for the address it names.
    let address = address.strip_prefix("http://").unwrap_or(address);
    let address = address.trim_end_matches('/');
    let url = format!("http://{address}{path}");
    let agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(READ_TIMEOUT))
        .build()
        .new_agent();
    let mut response = agent.get(&url).call().map_err(|err| {
        Failure::runtime(format!(
            "cannot read the monitor at {url}: {err}; is the broker running with \
             --monitor {address} (or monitor = \"{address}\" in its config)?"
        ))
    })?;
    let status = response.status().as_u16();
    let body = response
        .body_mut()
        .read_to_string()
        .map_err(|err| Failure::runtime(format!("reading {url}: {err}")))?;
    let value: Value = serde_json::from_str(&body).map_err(|err| {
        Failure::runtime(format!(
            "{url} did not answer with JSON ({err}); is {address} an efabus monitor?"
        ))
    })?;
    if status != 200 {
        let error = value["error"].as_str().unwrap_or("no reason given");
        return Err(Failure::runtime(format!(
            "{url} answered {status}: {error}"
        )));
    }
    Ok(value)
}

pub fn stats(args: StatsArgs) -> Result<(), Failure> {
    let interval = Duration::try_from_secs_f64(args.interval)
        .ok()
        .filter(|interval| *interval >= Duration::from_millis(50))
        .ok_or_else(|| {
            Failure::usage(format!(
                "--interval {} is not a number of seconds of at least 0.05",
                args.interval
            ))
        })?;
    let mut output = Output::new();
    let mut last: Option<(Instant, Value)> = None;
    loop {
        let varz = read(&args.monitor, "/varz")?;
        let now = Instant::now();
        out!(
            output,
            "{} ({}), up {} s, {} connections, {} subscriptions",
            varz["server_name"].as_str().unwrap_or("?"),
            varz["server_id"].as_str().unwrap_or("?"),
            varz["uptime_secs"],
            varz["totals"]["connections"],
            varz["subscriptions"],
        )?;
        let totals = varz["totals"].as_object().cloned().unwrap_or_default();
        let width = totals.keys().map(String::len).max().unwrap_or(0);
        for (name, value) in &totals {
            let value = value.as_u64().unwrap_or(0);
            // Levels (connections, queued bytes) have no rate.
            let rate = last
                .as_ref()
                .filter(|_| !BrokerStats::is_level(name))
                .and_then(|(at, before)| {
                    let before = before["totals"][name].as_u64()?;
                    let seconds = now.duration_since(*at).as_secs_f64();
                    (seconds > 0.0).then(|| (value as f64 - before as f64) / seconds)
                });
            match rate {
                Some(rate) => out!(output, "  {name:<width$} {value:>14}  {rate:>12.0}/s")?,
                None => out!(output, "  {name:<width$} {value:>14}")?,
            }
        }
        if !args.watch {
            return Ok(());
        }
        last = Some((now, varz));
        std::thread::sleep(interval);
        out!(output)?;
    }
}

pub fn conns(args: ConnsArgs) -> Result<(), Failure> {
    let query = format!("?sort={}&limit={}", args.sort, args.limit);
    let mut output = Output::new();
    let connz = read(&args.monitor, &format!("/connz{query}"))?;
    print_table(&mut output, &connz, "connections")?;
    if args.routes {
        out!(output)?;
        let routez = read(&args.monitor, &format!("/routez{query}"))?;
        print_table(&mut output, &routez, "routes")?;
    }
    Ok(())
}

/// The one reason a row shows for its reliable traffic being off the
/// fabric: the first about the reliable link that names something other
/// than a scheme neither side offered (which every scheme in the
/// preference list but the ones in use produces), else the first at all.
fn why_not_fabric<'a>(reasons: &[&'a str]) -> &'a str {
    let reliable = || reasons.iter().filter(|r| r.starts_with("reliable:"));
    reliable()
        .find(|reason| !reason.ends_with("offered by neither side"))
        .or_else(|| reliable().next())
        .or(reasons.first())
        .copied()
        .unwrap_or("")
}

/// A JSON value as a table cell: strings unquoted, nothing as "-".
fn text(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        Value::Null => "-".to_string(),
        other => other.to_string(),
    }
}

fn print_table(output: &mut Output, view: &Value, key: &str) -> Result<(), Failure> {
    let rows = view[key].as_array().cloned().unwrap_or_default();
    out!(output, "{} {key} (of {})", rows.len(), view["total"])?;
    if rows.is_empty() {
        return Ok(());
    }
    out!(
        output,
        "{:>5}  {:<20} {:<22} {:<8} {:<12} {:>10} {:>10} {:>10} {:>8} {:>5}  WHY NOT FABRIC",
        "CID",
        "NAME",
        "REMOTE",
        "LINK",
        "PROVIDER",
        "MSGS IN",
        "MSGS OUT",
        "PENDING",
        "DROPPED",
        "SUBS"
    )?;
    for row in rows {
        let link = &row["link"];
        // Why the reliable traffic is not on the fabric.
        let reasons: Vec<&str> = link["reasons"]
            .as_array()
            .map(|reasons| reasons.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let why = if link["on_fabric"] == true {
            ""
        } else {
            why_not_fabric(&reasons)
        };
        out!(
            output,
            "{:>5}  {:<20} {:<22} {:<8} {:<12} {:>10} {:>10} {:>10} {:>8} {:>5}  {}",
            text(&row["cid"]),
            text(&row["name"]),
            text(&row["remote"]),
            text(&link["kind"]),
            text(&link["provider"]),
            text(&row["in_msgs"]),
            text(&row["out_msgs"]),
            text(&row["pending_bytes"]),
            text(&row["dropped"]),
            text(&row["subscriptions"]),
            why
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::why_not_fabric;

    #[test]
    fn the_reason_shown_is_the_one_about_a_scheme_someone_offered() {
        let silent = "reliable: efa-rdm: the route's data link carried nothing back";
        assert_eq!(
            why_not_fabric(&[
                "reliable: shm: offered by neither side",
                "reliable: efa-rdm: not offered by the peer",
                "best-effort: efa-dgram: offered by neither side",
            ]),
            "reliable: efa-rdm: not offered by the peer"
        );
        assert_eq!(
            why_not_fabric(&[silent, "reliable: efa-rdm: not offered by this side"]),
            silent
        );
        assert_eq!(
            why_not_fabric(&["reliable: shm: offered by neither side"]),
            "reliable: shm: offered by neither side"
        );
        assert_eq!(why_not_fabric(&["best-effort: x"]), "best-effort: x");
        assert_eq!(why_not_fabric(&[]), "");
    }
}
