//! The broker's counters in the Prometheus text format (OpenMetrics), built
//! with `prometheus-client` on each scrape from the broker's statistics and
//! a report of its sessions:
//!
//! - every [`efabus_broker::BrokerStats`] value as `efabus_<name>` (a
//!   counter, `_total`, except the values that are levels right now
//!   ([`BrokerStats::is_level`]: connections, routes, queued bytes, buffer
//!   and registered bytes, address-vector entries);
//!   `connections_total` is `efabus_connections_opened_total`);
//! - the live sessions by kind (client, route), link kind (`efa-rdm`,
//!   `shm`, `tcp`, ...) and provider: how many, and their messages, bytes,
//!   pending bytes and drops (levels over the live sessions, which come and
//!   go, hence gauges);
//! - sessions whose reliable traffic is not on the fabric, by the class
//!   of traffic and the data path each negotiation reason names
//!   (`efabus_fabric_fallbacks`; the reasons' text is in `/connz`).

use efabus_broker::{Broker, BrokerStats, ConnectionReport};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;

/// Labels from a negotiation reason (`reliable: efa-rdm: offered by
/// neither side`): its class of traffic and the data path it names, each
/// from a short list, so the free text never becomes a label value.
fn reason_labels(reason: &str) -> (&'static str, &'static str) {
    let mut parts = reason.splitn(3, ':').map(str::trim);
    let class = match parts.next() {
        Some("reliable") => "reliable",
        Some("best-effort") => "best-effort",
        _ => "other",
    };
    let path = match parts.next() {
        Some("efa-rdm") => "efa-rdm",
        Some("efa-dgram") => "efa-dgram",
        Some("shm") => "shm",
        Some("tcp") => "tcp",
        _ => "none",
    };
    (class, path)
}

fn gauge(value: u64) -> Gauge {
    let gauge = Gauge::default();
    gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
    gauge
}

/// The metrics text for `broker` with its sessions `sessions`, up for
/// `uptime_secs`.
pub fn render(
    broker: &Broker,
    sessions: &[ConnectionReport],
    uptime_secs: u64,
) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::with_prefix("efabus");
    registry.register(
        "uptime_seconds",
        "Seconds since the broker started",
        gauge(uptime_secs),
    );
    for (name, value) in broker.stats().snapshot() {
        // The running count of connections would share its family name
        // with the level, `_total` being the counter's suffix.
        let name = if name == "connections_total" {
            "connections_opened"
        } else {
            name
        };
        let help = format!("Broker statistic {name}");
        if BrokerStats::is_level(name) {
            registry.register(name, help, gauge(value));
        } else {
            let counter: Counter = Counter::default();
            counter.inc_by(value);
            registry.register(name, help, counter);
        }
    }

    let by_link = |name: &str, help: &str, value: fn(&ConnectionReport) -> u64| {
        let family = Family::<Labels, Gauge>::default();
        for session in sessions {
            let labels = vec![
                ("kind".to_string(), session.kind.name().to_string()),
                ("link".to_string(), session.link_kind().to_string()),
                (
                    "provider".to_string(),
                    session.provider().unwrap_or_default().to_string(),
                ),
            ];
            family
                .get_or_create(&labels)
                .inc_by(i64::try_from(value(session)).unwrap_or(i64::MAX));
        }
        (name.to_string(), help.to_string(), family)
    };
    let families = [
        by_link(
            "sessions",
            "Live sessions by kind, link and provider",
            |_| 1,
        ),
        by_link(
            "session_messages_in",
            "Messages received over the live sessions",
            |s| s.counts.messages_in,
        ),
        by_link(
            "session_messages_out",
            "Messages delivered over the live sessions",
            |s| s.counts.messages_out,
        ),
        by_link(
            "session_bytes_in",
            "Bytes of message frames received over the live sessions",
            |s| s.counts.bytes_in,
        ),
        by_link(
            "session_bytes_out",
            "Bytes of message frames delivered over the live sessions",
            |s| s.counts.bytes_out,
        ),
        by_link(
            "session_pending_bytes",
            "Bytes queued for the live sessions",
            |s| s.pending_bytes,
        ),
        by_link(
            "session_dropped",
            "Messages dropped for the live sessions",
            |s| s.counts.dropped,
        ),
    ];
    for (name, help, family) in families {
        registry.register(name, help, family);
    }

    let fallbacks = Family::<Labels, Gauge>::default();
    for session in sessions.iter().filter(|session| !session.on_fabric()) {
        for reason in &session.reasons {
            let (class, path) = reason_labels(reason);
            let labels = vec![
                ("kind".to_string(), session.kind.name().to_string()),
                ("class".to_string(), class.to_string()),
                ("path".to_string(), path.to_string()),
            ];
            fallbacks.get_or_create(&labels).inc();
        }
    }
    registry.register(
        "fabric_fallbacks",
        "Live sessions not on a fabric data link, by the class of traffic and the data path not taken",
        fallbacks,
    );

    let mut text = String::new();
    encode(&mut text, &registry)?;
    Ok(text)
}
