//! The session layer shared by the client, the broker's sessions with its
//! clients, and routes between brokers.
//!
//! A session is one peer reached over a control link (TCP or mem), with
//! the data links negotiated beside it. Every kind of session holds a
//! [`Connection`]: the control link, the [`DataLinks`](data_link::DataLinks),
//! the [`Outbound`](outbound::Outbound) queue and the [`Liveness`] timers.
//! What differs per kind lives with that kind: the client loop
//! (`crate::client`), the broker's view of a client and a route
//! (`crate::event_loop`).
//!
//! Sessions take the time as an argument (`now`) and say when they next
//! need it ([`Connection::poll_timeout`]); the loops sleep until the
//! earliest of those deadlines rather than waking on a fixed tick.

pub(crate) mod data_link;
pub mod link_auth;
pub(crate) mod outbound;

use std::time::{Duration, Instant};

use efabus_core::codec;
use efabus_core::frame::{ErrorCode, ErrorFrame, Frame};
use efabus_core::transport::{Endpoint, OutFrame};

use data_link::DataLinks;
use outbound::{Control, Outbound, Queued, SendCounts};

/// Reasons a connection's or route's report keeps: a datagram link given
/// up and opened again over weeks would otherwise add two each time.
pub(crate) const REASONS_KEPT: usize = 32;

/// Adds `reason` to a report's, the oldest going past [`REASONS_KEPT`].
pub(crate) fn push_reason(reasons: &mut Vec<String>, reason: String) {
    if reasons.len() >= REASONS_KEPT {
        reasons.remove(0);
    }
    reasons.push(reason);
}

/// Heartbeats: when to ping a quiet peer and when to give it up.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Liveness {
    last_heard: Instant,
    last_ping: Instant,
    interval: Duration,
    timeout: Duration,
    /// Ping every interval, or only when the peer has been quiet for one.
    only_when_quiet: bool,
}

/// What the heartbeat timers ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heartbeat {
    /// Nothing yet.
    Wait,
    /// Send a ping now.
    Ping,
    /// Nothing heard for the timeout: the peer is presumed dead.
    Dead,
}

impl Liveness {
    pub fn new(now: Instant, interval: Duration, timeout: Duration, only_when_quiet: bool) -> Self {
        Liveness {
            last_heard: now,
            last_ping: now,
            interval,
            timeout,
            only_when_quiet,
        }
    }

    /// Something arrived from the peer.
    #[inline]
    pub fn heard(&mut self, now: Instant) {
        self.last_heard = now;
    }

    /// The peer is not being read (this side holds it back): its silence
    /// until `now` does not count against it, and pings still go out.
    pub fn excuse(&mut self, now: Instant) {
        let grace = self.interval.min(self.timeout / 2);
        let excused = now.checked_sub(grace).unwrap_or(now);
        self.last_heard = self.last_heard.max(excused);
    }

    /// What is due at `now`; a ping asked for counts as sent.
    pub fn poll(&mut self, now: Instant) -> Heartbeat {
        if now.duration_since(self.last_heard) >= self.timeout {
            return Heartbeat::Dead;
        }
        let quiet = !self.only_when_quiet || now.duration_since(self.last_heard) >= self.interval;
        if quiet && now.duration_since(self.last_ping) >= self.interval {
            self.last_ping = now;
            return Heartbeat::Ping;
        }
        Heartbeat::Wait
    }

    /// When [`Self::poll`] next may have something to say.
    pub fn next_deadline(&self) -> Instant {
        let ping = if self.only_when_quiet {
            self.last_ping.max(self.last_heard)
        } else {
            self.last_ping
        } + self.interval;
        ping.min(self.last_heard + self.timeout)
    }
}

/// What every session holds: its control link, its data links, what waits
/// to be sent, and its heartbeat timers.
pub(crate) struct Connection {
    pub control: Control,
    pub links: DataLinks,
    pub out: Outbound,
    pub liveness: Liveness,
}

impl Connection {
    pub fn new(control: Control, liveness: Liveness) -> Connection {
        Connection {
            control,
            links: DataLinks::default(),
            out: Outbound::default(),
            liveness,
        }
    }

    /// Hand an entry to the session's path, or queue it behind what waits;
    /// true if any of it was left queued.
    pub fn send(
        &mut self,
        endpoints: &mut [Box<dyn Endpoint>],
        counts: &mut SendCounts,
        queued: Queued,
    ) -> bool {
        self.out
            .send(endpoints, self.control, &mut self.links, counts, queued)
    }

    /// Hand queued entries on until the path pushes back; true when
    /// nothing is left.
    pub fn flush(&mut self, endpoints: &mut [Box<dyn Endpoint>], counts: &mut SendCounts) -> bool {
        counts.credit_waits += self.links.pace_best_effort(endpoints);
        self.out
            .flush(endpoints, self.control, &mut self.links, counts)
    }

    /// The earliest time the session has something to do by time alone.
    pub fn poll_timeout(&self) -> Instant {
        let heartbeat = self.liveness.next_deadline();
        match self.links.next_deadline() {
            Some(link) => link.min(heartbeat),
            None => heartbeat,
        }
    }
}

/// Longest error text sent to a peer, in bytes. Texts echo what the peer
/// sent (escaped, so up to six bytes per byte received); cut, they always
/// fit a control frame.
const MAX_ERROR_TEXT: usize = 1024;

/// An encoded error frame, its text cut to [`MAX_ERROR_TEXT`] bytes.
pub(crate) fn error_frame(code: ErrorCode, mut text: String, fatal: bool) -> OutFrame {
    if text.len() > MAX_ERROR_TEXT {
        efabus_core::frame::cut_at_char(&mut text, MAX_ERROR_TEXT - '…'.len_utf8());
        text.push('…');
    }
    codec::encode(&Frame::Error(ErrorFrame { code, text, fatal }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_pings_each_interval_and_gives_up_after_the_timeout() {
        let start = Instant::now();
        let second = Duration::from_secs(1);
        let mut always = Liveness::new(start, second, 3 * second, false);
        assert_eq!(always.poll(start), Heartbeat::Wait);
        assert_eq!(always.next_deadline(), start + second);
        assert_eq!(always.poll(start + second), Heartbeat::Ping);
        assert_eq!(always.poll(start + second), Heartbeat::Wait);
        always.heard(start + 2 * second);
        assert_eq!(always.poll(start + 2 * second), Heartbeat::Ping);
        assert_eq!(always.poll(start + 5 * second), Heartbeat::Dead);

        let mut quiet = Liveness::new(start, second, 3 * second, true);
        quiet.heard(start + second);
        // Heard within the interval: no ping yet.
        assert_eq!(quiet.poll(start + second), Heartbeat::Wait);
        assert_eq!(quiet.next_deadline(), start + 2 * second);
        assert_eq!(quiet.poll(start + 2 * second), Heartbeat::Ping);
    }

    #[test]
    fn an_excused_peer_is_pinged_but_never_taken_for_dead() {
        let start = Instant::now();
        let second = Duration::from_secs(1);
        let mut held = Liveness::new(start, second, 3 * second, true);
        for at in 1..10 {
            let now = start + at * second;
            held.excuse(now);
            assert_eq!(held.poll(now), Heartbeat::Ping, "at {at} s");
            assert!(held.next_deadline() > now);
        }
        // Read again, and silent: dead a timeout after the last excuse's
        // grace began.
        let resumed = start + 9 * second;
        assert_eq!(held.poll(resumed + 2 * second), Heartbeat::Dead);
    }

    #[test]
    fn long_error_texts_are_cut_on_a_character_boundary() {
        let frame = error_frame(ErrorCode::Protocol, "é".repeat(2000), true);
        assert!(frame.len() < MAX_ERROR_TEXT + 64);
    }
}
