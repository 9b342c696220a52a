//! Helpers shared by the embedded broker's tests.

#![allow(dead_code)]

use std::time::Duration;

use efabus_broker::{Broker, Config, Message, Subscription};

/// Bound on every wait; messages normally arrive at once.
pub const WAIT: Duration = Duration::from_secs(5);

/// An embedded broker with no listeners and `extra` config on top.
pub fn broker(extra: &str) -> Broker {
    let text = format!("name = \"embedded-test\"\nlisten = []\n{extra}");
    let config = Config::from_toml_str(&text, "embedded test").expect("valid test config");
    Broker::start(config).expect("broker starts")
}

/// A message as `subject:payload`.
pub fn text(message: &Message) -> String {
    format!(
        "{}:{}",
        message.subject,
        String::from_utf8_lossy(&message.payload)
    )
}

/// Everything already queued on a subscription, without waiting.
pub fn drain(sub: &Subscription) -> Vec<String> {
    std::iter::from_fn(|| sub.try_recv().ok())
        .map(|m| text(&m))
        .collect()
}
