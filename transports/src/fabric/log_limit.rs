//! The fabric endpoint's limits on warnings about bad input, one per kind
//! (see [`efabus_core::log_limit`]), so a flood of one kind hides no other.

use std::time::Duration;

use efabus_core::log_limit::LogLimit;

/// How often a flood of bad input may log a line.
pub(crate) const BAD_INPUT_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// The endpoint's limits, one per kind of bad input.
#[derive(Debug)]
pub(crate) struct BadInputLog {
    pub malformed: LogLimit,
    pub unknown_link: LogLimit,
    pub forged: LogLimit,
    pub receive_failed: LogLimit,
    pub send_failed: LogLimit,
}

impl Default for BadInputLog {
    fn default() -> Self {
        let limit = || LogLimit::new(BAD_INPUT_LOG_INTERVAL);
        BadInputLog {
            malformed: limit(),
            unknown_link: limit(),
            forged: limit(),
            receive_failed: limit(),
            send_failed: limit(),
        }
    }
}
