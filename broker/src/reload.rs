//! What a running broker can change without a restart: the limits and the
//! slow-consumer policy ([`LiveLimits`], read by the event loop and the
//! in-process API on every use), and [`Broker::reload`], which applies a new
//! configuration's values for them and names every other key that changed
//! as needing a restart.
//!
//! Each value applies from its next use: a lower `max_pending_bytes` to
//! the queues as they are next checked, `max_connections` to the next
//! connection, `max_subscriptions_per_peer` to the next subscribe, the
//! policy and `block_timeout_ms` to the next message that finds a queue
//! full (a remote subscriber already held under `block` stays held until
//! it drains or its timeout ends it); `subscription_queue`, the policy and
//! `block_timeout_ms` are fixed into an in-process subscription when it is
//! made. `max_payload` is sent in the welcome of sessions made after the
//! change and checked on every client publish (a client connected before
//! a lowering learns it from the error its larger publishes get, counted
//! in `oversized_payloads`); messages from routes are checked against the
//! starting value, their broker having accepted them under its own. It may
//! not grow past the value the broker started with, because the
//! endpoints' frame limits were sized from it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::broker::{Broker, LoopRequest};
use crate::config::{Config, ConfigError, SlowConsumerPolicy};

/// How long a reload waits for the event loop to read the TLS files.
const TLS_RELOAD_WAIT: Duration = Duration::from_secs(5);

/// What [`Reloaded::applied`] says when the TLS files were read again.
pub const TLS_FILES: &str = "tls (certificate, key and authority files read again)";

/// The dotted keys [`Broker::reload`] applies while running.
pub const RELOADABLE: &[&str] = &[
    "limits.max_payload",
    "limits.max_connections",
    "limits.max_subscriptions_per_peer",
    "limits.max_pending_bytes",
    "limits.subscription_queue",
    "slow_consumer.policy",
    "slow_consumer.block_timeout_ms",
];

/// The limits in force, changed by [`Broker::reload`].
#[derive(Debug)]
pub(crate) struct LiveLimits {
    /// Held across a reload's compare and store, so two reloads do not
    /// interleave.
    reloading: parking_lot::Mutex<()>,
    max_payload: AtomicU64,
    max_connections: AtomicUsize,
    max_subscriptions_per_peer: AtomicUsize,
    max_pending_bytes: AtomicUsize,
    subscription_queue: AtomicUsize,
    policy: AtomicU8,
    block_timeout_ms: AtomicU64,
}

fn policy_code(policy: SlowConsumerPolicy) -> u8 {
    match policy {
        SlowConsumerPolicy::Block => 0,
        SlowConsumerPolicy::DropOldest => 1,
        SlowConsumerPolicy::Disconnect => 2,
    }
}

impl LiveLimits {
    pub(crate) fn new(config: &Config) -> LiveLimits {
        let live = LiveLimits {
            reloading: parking_lot::Mutex::new(()),
            max_payload: AtomicU64::new(0),
            max_connections: AtomicUsize::new(0),
            max_subscriptions_per_peer: AtomicUsize::new(0),
            max_pending_bytes: AtomicUsize::new(0),
            subscription_queue: AtomicUsize::new(0),
            policy: AtomicU8::new(0),
            block_timeout_ms: AtomicU64::new(0),
        };
        live.store(config);
        live
    }

    fn store(&self, config: &Config) {
        let limits = &config.limits;
        let set = |cell: &AtomicUsize, value: usize| cell.store(value, Ordering::Relaxed);
        self.max_payload
            .store(limits.max_payload, Ordering::Relaxed);
        set(&self.max_connections, limits.max_connections);
        set(
            &self.max_subscriptions_per_peer,
            limits.max_subscriptions_per_peer,
        );
        set(&self.max_pending_bytes, limits.max_pending_bytes);
        set(&self.subscription_queue, limits.subscription_queue);
        self.policy
            .store(policy_code(config.slow_consumer.policy), Ordering::Relaxed);
        self.block_timeout_ms
            .store(config.slow_consumer.block_timeout_ms, Ordering::Relaxed);
    }

    /// `config` with the values in force in place of its own.
    pub(crate) fn applied_to(&self, config: &Config) -> Config {
        let mut running = config.clone();
        running.limits.max_payload = self.max_payload();
        running.limits.max_connections = self.max_connections();
        running.limits.max_subscriptions_per_peer = self.max_subscriptions_per_peer();
        running.limits.max_pending_bytes = self.max_pending_bytes();
        running.limits.subscription_queue = self.subscription_queue();
        running.slow_consumer.policy = self.policy();
        running.slow_consumer.block_timeout_ms = self.block_timeout_ms.load(Ordering::Relaxed);
        running
    }

    pub(crate) fn max_payload(&self) -> u64 {
        self.max_payload.load(Ordering::Relaxed)
    }

    pub(crate) fn max_connections(&self) -> usize {
        self.max_connections.load(Ordering::Relaxed)
    }

    pub(crate) fn max_subscriptions_per_peer(&self) -> usize {
        self.max_subscriptions_per_peer.load(Ordering::Relaxed)
    }

    pub(crate) fn max_pending_bytes(&self) -> usize {
        self.max_pending_bytes.load(Ordering::Relaxed)
    }

    pub(crate) fn subscription_queue(&self) -> usize {
        self.subscription_queue.load(Ordering::Relaxed)
    }

    pub(crate) fn policy(&self) -> SlowConsumerPolicy {
        match self.policy.load(Ordering::Relaxed) {
            0 => SlowConsumerPolicy::Block,
            2 => SlowConsumerPolicy::Disconnect,
            _ => SlowConsumerPolicy::DropOldest,
        }
    }

    pub(crate) fn block_timeout(&self) -> Duration {
        Duration::from_millis(self.block_timeout_ms.load(Ordering::Relaxed))
    }
}

/// What [`Broker::reload`] did with a new configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reloaded {
    /// Keys whose new values are in force now.
    pub applied: Vec<String>,
    /// Keys that changed but keep their running values until a restart.
    pub needs_restart: Vec<String>,
}

impl Broker {
    /// Applies what can change while running from `config` (the keys in
    /// [`RELOADABLE`]) and names the other keys that changed. `log_level`
    /// is left to whoever installed the log subscriber and is in neither
    /// list. A configuration that does not validate, or raises
    /// `limits.max_payload` past the starting value, changes nothing; nor
    /// does one made while the broker is stopping, though TLS files are
    /// read again before that is known. TLS files are taken by every
    /// listener or by none. The event loop takes a reload between two
    /// rounds, also while it holds publishers back for a slow consumer.
    pub fn reload(&self, config: &Config) -> Result<Reloaded, ConfigError> {
        config.validate("(reloaded)")?;
        let started = &self.shared.config;
        if config.limits.max_payload > started.limits.max_payload {
            return Err(reload_error(
                "limits.max_payload",
                format!(
                    "{} is more than the {} the broker started with; raising it needs a restart",
                    config.limits.max_payload, started.limits.max_payload
                ),
            ));
        }
        let live = &self.shared.live;
        let _reloading = live.reloading.lock();
        let running = live.applied_to(started);
        let mut reloaded = Reloaded::default();
        let tls = started.tls.is_set();
        if tls {
            self.reload_tls()?;
            reloaded.applied.push(TLS_FILES.to_string());
        }
        for key in changed_keys(&running, config) {
            if key == "log_level" {
                continue;
            }
            if RELOADABLE.contains(&key.as_str()) {
                reloaded.applied.push(key);
            } else {
                reloaded.needs_restart.push(key);
            }
        }
        // The event loop's endpoints (NATS listeners above all) hold peers
        // to some limits themselves: the loop hands them theirs between
        // two rounds, also while it holds publishers back, which the
        // reload waits for. A broker that is stopping takes nothing.
        if self.shared.shutdown.load(Ordering::Relaxed) {
            let tls = if tls {
                " (the TLS files were read again)"
            } else {
                ""
            };
            return Err(reload_error(
                "limits",
                format!("the broker is shutting down: the running limits stay{tls}"),
            ));
        }
        let (done, wait) = crossbeam_channel::bounded(1);
        self.shared
            .ask_loop(LoopRequest::Reconfigure(Box::new(config.clone()), done));
        live.store(config);
        if wait.recv_timeout(Duration::from_secs(5)).is_err() {
            tracing::warn!(
                "the limits are reloaded, but the event loop has not given its endpoints \
                 theirs within 5 s (a round is taking that long); they follow when it ends"
            );
        }
        Ok(reloaded)
    }

    /// Has the endpoints read their TLS files again, all or none. The
    /// loop answers between two rounds, also while it holds publishers
    /// back; one that does not within 5 s never takes this reload.
    fn reload_tls(&self) -> Result<(), ConfigError> {
        let failed = |message: String| reload_error("tls", message);
        if self.shared.shutdown.load(Ordering::Relaxed) {
            return Err(failed("the broker is shutting down".to_string()));
        }
        let (answer, wait) = crossbeam_channel::bounded(1);
        let taken = Arc::new(AtomicBool::new(false));
        self.shared
            .ask_loop(LoopRequest::ReloadTls(Arc::clone(&taken), answer));
        let mut answered = wait.recv_timeout(TLS_RELOAD_WAIT);
        if answered.is_err() && taken.swap(true, Ordering::AcqRel) {
            // Taken just now: the loop is reading the files.
            answered = wait.recv_timeout(TLS_RELOAD_WAIT);
        }
        match answered {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(reason)) => Err(failed(format!("{reason}; the certificates in use stay"))),
            Err(_) => Err(failed(format!(
                "the broker's event loop did not answer within {TLS_RELOAD_WAIT:?}; the \
                 certificates in use stay"
            ))),
        }
    }

    /// The configuration in force: the one the broker started with, with
    /// what [`reload`](Self::reload) changed since.
    pub fn running_config(&self) -> Config {
        self.shared.live.applied_to(&self.shared.config)
    }
}

/// Why a reload changed nothing, at `key`.
fn reload_error(key: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        origin: "(reloaded)".to_string(),
        line: None,
        key: key.to_string(),
        message,
    }
}

/// The dotted keys whose values differ between two configurations.
fn changed_keys(before: &Config, after: &Config) -> Vec<String> {
    let mut changed = Vec::new();
    if let (Ok(before), Ok(after)) = (toml::Value::try_from(before), toml::Value::try_from(after)) {
        compare("", &before, &after, &mut changed);
    }
    changed
}

fn compare(prefix: &str, before: &toml::Value, after: &toml::Value, out: &mut Vec<String>) {
    match (before, after) {
        (toml::Value::Table(a), toml::Value::Table(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => compare(&path, x, y, out),
                    _ => out.push(path),
                }
            }
        }
        (a, b) if a != b => out.push(prefix.to_string()),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Client, ClientOptions, Error};
    use efabus_transports::registry::Registry;

    const WAIT: Duration = Duration::from_secs(10);

    fn broker() -> Broker {
        let config = Config::from_toml_str(
            "name = \"reloading\"\nlisten = [\"tcp/127.0.0.1:0\"]\n",
            "reload test",
        )
        .expect("valid config");
        Broker::start(config).expect("the broker starts")
    }

    fn connect(broker: &Broker, name: &str) -> Result<Client, Error> {
        let options = ClientOptions {
            name: name.to_string(),
            connect_timeout: WAIT,
            reconnect: false,
            ..ClientOptions::default()
        };
        let server = broker.endpoint("tcp").expect("a TCP listener");
        Client::connect_with(&server, options, Registry::with_builtins())
    }

    #[test]
    fn limits_apply_at_once_and_other_keys_wait_for_a_restart() {
        let broker = broker();
        let first = connect(&broker, "first").expect("the first client connects");
        let mut config = broker.running_config();
        config.limits.max_connections = 1;
        config.limits.max_payload = 5000;
        config.limits.subscription_queue = 4;
        config.slow_consumer.policy = SlowConsumerPolicy::DropOldest;
        config.name = "renamed".to_string();
        config.log_level = "debug".to_string();
        let reloaded = broker.reload(&config).expect("the reload applies");
        assert_eq!(
            reloaded.applied,
            [
                "limits.max_connections",
                "limits.max_payload",
                "limits.subscription_queue"
            ]
        );
        assert_eq!(reloaded.needs_restart, ["name"]);
        assert_eq!(broker.running_config().limits.max_payload, 5000);
        assert_eq!(broker.config().name, "reloading");

        // The event loop refuses the connection over the new maximum.
        assert!(connect(&broker, "second").is_err());
        first.flush(WAIT).expect("the first is still served");
        // An in-process publish is checked against the new payload limit,
        // and so is one from a client that connected before (its welcome
        // said 1 MiB): refused and counted.
        let err = broker.publish("big", vec![0u8; 6000]).unwrap_err();
        assert!(
            matches!(err, Error::PayloadTooLarge { max: 5000, .. }),
            "{err}"
        );
        first
            .publish("big", vec![0u8; 6000])
            .expect("within the welcome's limit");
        first.flush(WAIT).expect("flush");
        let deadline = std::time::Instant::now() + WAIT;
        while broker.stats().value("oversized_payloads") != Some(1) {
            assert!(
                std::time::Instant::now() < deadline,
                "the refusal is counted"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // A new in-process subscription gets the new queue size.
        let subscription = broker.subscribe("small.queue").expect("subscribe");
        for n in 0..10u8 {
            broker.publish("small.queue", vec![n]).expect("publish");
        }
        broker.flush(WAIT).expect("flush");
        assert_eq!(subscription.stats().dropped(), 6);

        // The same configuration again applies nothing new; the name
        // still waits for a restart.
        let again = broker.reload(&config).expect("reload");
        assert!(again.applied.is_empty(), "{again:?}");
        assert_eq!(again.needs_restart, ["name"]);
    }

    #[test]
    fn every_level_is_a_statistic() {
        let names: Vec<&str> = crate::BrokerStats::default()
            .snapshot()
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        // A renamed statistic would otherwise turn into a counter unseen.
        for level in crate::BrokerStats::LEVELS {
            assert!(names.contains(level), "{level} is not a statistic");
        }
    }

    #[test]
    fn a_reload_that_raises_max_payload_or_does_not_validate_changes_nothing() {
        let broker = broker();
        let mut config = broker.running_config();
        config.limits.max_payload += 1;
        config.limits.max_connections = 1;
        let err = broker.reload(&config).unwrap_err();
        assert!(
            err.to_string().contains("raising it needs a restart"),
            "{err}"
        );
        config.limits.max_payload -= 1;
        config.name = String::new();
        assert!(broker.reload(&config).is_err());
        assert_eq!(broker.running_config(), *broker.config());
    }
}
