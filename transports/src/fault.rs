//! A seeded fault injector wrapped around any endpoint: a testing aid.
//!
//! [`FaultyEndpoint`] wraps an [`Endpoint`] and, frame by frame, drops,
//! duplicates, reorders, delays, corrupts or truncates what passes, or
//! disconnects the peer, each with its own rate. [`FaultTransport`] wraps a
//! [`Transport`] so that a [`Registry`](crate::Registry) can offer it under
//! a scheme such as `faulty+mem` or `faulty+tcp`, configured from
//! [`EndpointConfig::options`] (see [`FaultConfig::from_options`]).
//!
//! It exists to prove what efabus promises under faults, in tests and in
//! chaos runs of a deployment. It must never run in production, and is
//! compiled only with this crate's `testing` feature (the broker's
//! `testing` feature turns it on): a production build has no
//! `FaultTransport` to register, so no `faulty+` scheme to open.
//!
//! # Where faults apply
//!
//! [`FaultConfig::direction`] says which frames are touched: those the
//! wrapped endpoint *receives* (the default: faults happen to what this
//! side reads, as if the wire had misbehaved), those it *sends*, or both.
//! Each direction draws from its own pseudo-random stream derived from the
//! seed, so for the same seed, configuration and sequence of calls the same
//! faults happen to the same frames.
//!
//! For every frame, in this order (each a separate draw, only made when its
//! rate is above zero):
//!
//! 1. **disconnect**: the peer is closed with the wrapped endpoint's
//!    `close`; the frame is lost, later frames from the peer are discarded,
//!    and the peer's one `Closed` event carries
//!    [`CloseReason::Error`] naming the injected fault. Sends to it fail
//!    with [`SendError::Closed`].
//! 2. **drop**: the frame is lost.
//! 3. **corrupt**: one to three bytes at distinct random positions are
//!    XORed with non-zero values, so the frame always differs. Received
//!    frames may be hit anywhere, length prefix included. Sent frames keep
//!    their 4-byte length prefix: stream transports refuse a frame whose
//!    prefix lies, and a lying prefix on a stream would desynchronise every
//!    later frame, which is a broken link rather than a corrupted frame.
//! 4. **truncate**: a received frame is cut to a random shorter length
//!    (possibly empty) and keeps its original prefix, as a datagram cut
//!    short would; a sent frame is cut to a random length of at least its
//!    prefix, and the prefix is rewritten to match so the transport carries
//!    it (the peer sees a well-framed but incomplete frame).
//! 5. **duplicate**: the frame goes out twice, right after each other
//!    unless reordering or delay separates the copies.
//! 6. Then, for each copy: **reorder** holds it back until
//!    [`reorder_span`](FaultConfig::reorder_span) later frames of the same
//!    peer have passed (at most [`max_delay_polls`](FaultConfig::max_delay_polls)
//!    polls); otherwise **delay** holds it for 1 to `max_delay_polls` polls.
//!
//! Held frames are released by `poll` (received frames as events, sent
//! frames handed to the wrapped endpoint); frames held for a peer that
//! closes are released before its `Closed` event (received) or discarded
//! and counted (sent). Because released frames need polls, an endpoint
//! whose configuration can hold frames reports [`Readiness::MustPoll`].
//!
//! A frame that is dropped, held or sent as a duplicate hides the wrapped
//! endpoint's verdict on it (as a wire would), except that frames larger
//! than [`Endpoint::max_frame`] are still refused with
//! [`SendError::TooLarge`].
//!
//! Every action is counted in [`FaultStats`].
//!
//! Apart from frames, [`FaultConfig::fail_polls_after`] makes every poll
//! fail once that many frames were received, as a failed device would, and
//! [`FaultConfig::stall_after`] makes one poll block for
//! [`FaultConfig::stall_ms`], as a provider call stuck on a lock would, and
//! [`FaultConfig::panic_after`] makes the poll that takes the n-th frame
//! received panic, as a bug in handling one would.

use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::Arc;

use bytes::Bytes;
use efabus_core::caps::FabricInfo;
use efabus_core::codec::PREFIX_LEN;
use efabus_core::transport::{
    BufferMemory, CloseReason, Endpoint, EndpointConfig, Event, LinkKeys, OutFrame, PeerId,
    Readiness, Refused, SendError, Transport, TransportError,
};
use parking_lot::Mutex;
use thiserror::Error;

/// What schemes of wrapped transports start with: `faulty+mem`, `faulty+tcp`.
pub const SCHEME_PREFIX: &str = "faulty+";

/// The reason text of a `Closed` event caused by an injected disconnect.
pub const INJECTED_DISCONNECT: &str = "injected fault: disconnect";

/// The error of a poll failed by `fail_polls_after`.
pub const INJECTED_POLL_FAILURE: &str = "injected fault: poll failure";

/// The message of a poll's panic by `panic_after`.
pub const INJECTED_PANIC: &str = "injected fault: a poll panics";

/// Which frames a [`FaultyEndpoint`] touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultDirection {
    /// Frames the wrapped endpoint receives, before the caller sees them.
    #[default]
    Receive,
    /// Frames the caller sends, before the wrapped endpoint gets them.
    Send,
    /// Both.
    Both,
}

impl FaultDirection {
    /// The name used in options (`receive`, `send`, `both`).
    pub fn name(self) -> &'static str {
        match self {
            FaultDirection::Receive => "receive",
            FaultDirection::Send => "send",
            FaultDirection::Both => "both",
        }
    }

    /// Parse a name as [`name`](FaultDirection::name) gives it.
    pub fn from_name(name: &str) -> Option<FaultDirection> {
        match name {
            "receive" => Some(FaultDirection::Receive),
            "send" => Some(FaultDirection::Send),
            "both" => Some(FaultDirection::Both),
            _ => None,
        }
    }

    fn receive(self) -> bool {
        matches!(self, FaultDirection::Receive | FaultDirection::Both)
    }

    fn send(self) -> bool {
        matches!(self, FaultDirection::Send | FaultDirection::Both)
    }
}

/// What to inject, how often, and from which seed. Rates are probabilities
/// per frame, from 0.0 (never) to 1.0 (every frame). The default injects
/// nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultConfig {
    /// Seed of the pseudo-random streams (option `fault_seed`).
    pub seed: u64,
    /// Which frames are touched (`fault_direction`: receive, send, both).
    pub direction: FaultDirection,
    /// Frames lost (`fault_drop`).
    pub drop: f64,
    /// Frames delivered twice (`fault_duplicate`).
    pub duplicate: f64,
    /// Frames held back behind later ones (`fault_reorder`).
    pub reorder: f64,
    /// How many later frames of the same peer overtake a reordered one
    /// (`fault_reorder_span`, at least 1).
    pub reorder_span: u32,
    /// Frames held for some polls (`fault_delay`).
    pub delay: f64,
    /// Longest hold, in polls, of a delayed frame, and the latest a
    /// reordered one is released (`fault_max_delay_polls`, at least 1).
    pub max_delay_polls: u32,
    /// Frames with bytes flipped (`fault_corrupt`).
    pub corrupt: f64,
    /// Frames cut short (`fault_truncate`).
    pub truncate: f64,
    /// Frames on which the peer is disconnected (`fault_disconnect`).
    pub disconnect: f64,
    /// Once this many frames of the faulted direction passed, every later
    /// one is lost, as on a path that went quiet (`fault_drop_after`; 0,
    /// the default, never).
    pub drop_after: u64,
    /// Once this many milliseconds have passed since the first frame of the
    /// faulted direction, no frame is faulted any more (the rates and
    /// `drop_after`), as on a path that came back (`fault_heal_after_ms`;
    /// 0, the default, never).
    pub heal_after_ms: u64,
    /// Once this many frames were received, every later poll fails, as an
    /// endpoint whose device went away does (`fault_fail_polls_after`; 0,
    /// the default, never).
    pub fail_polls_after: u64,
    /// Once this many frames were received, the next poll blocks for
    /// `stall_ms` before it goes on, once (`fault_stall_after`; 0, the
    /// default, never).
    pub stall_after: u64,
    /// How long that poll blocks, in milliseconds (`fault_stall_ms`).
    pub stall_ms: u64,
    /// The poll that receives the frame that makes this many in all panics
    /// as it takes that frame, once, as a bug in handling a frame would;
    /// the frames that poll had taken after it are lost with it
    /// (`fault_panic_after`; 0, the default, never).
    pub panic_after: u64,
    /// Every TLS reload of the endpoint fails, as one whose files cannot
    /// be read would (`[testing.faults]` only; not a transport option).
    pub fail_tls_reload: bool,
    /// Only endpoints of this scheme get faults, where one configuration
    /// serves several endpoints (a broker's listeners, a client's links);
    /// `None` (the default) is all of them. Not a transport option.
    pub scheme: Option<String>,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            seed: 0,
            direction: FaultDirection::Receive,
            drop: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            reorder_span: 1,
            delay: 0.0,
            max_delay_polls: 4,
            corrupt: 0.0,
            truncate: 0.0,
            disconnect: 0.0,
            drop_after: 0,
            heal_after_ms: 0,
            fail_polls_after: 0,
            stall_after: 0,
            stall_ms: 0,
            panic_after: 0,
            fail_tls_reload: false,
            scheme: None,
        }
    }
}

/// Why fault options do not parse.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum FaultConfigError {
    #[error("fault option {key}: {value:?} is not a valid number")]
    NotANumber { key: String, value: String },
    #[error("fault option {key}: rate {value} is not within 0.0..=1.0")]
    RateOutOfRange { key: String, value: f64 },
    #[error("fault option {key} must be at least 1")]
    Zero { key: String },
    #[error("fault option fault_direction: {value:?} is not receive, send or both")]
    Direction { value: String },
    #[error("unknown fault option {key:?}; known: {known}")]
    UnknownKey { key: String, known: String },
}

/// The option keys [`FaultConfig::from_options`] reads.
pub const OPTION_KEYS: [&str; 17] = [
    "fault_seed",
    "fault_direction",
    "fault_drop",
    "fault_duplicate",
    "fault_reorder",
    "fault_reorder_span",
    "fault_delay",
    "fault_max_delay_polls",
    "fault_corrupt",
    "fault_truncate",
    "fault_disconnect",
    "fault_drop_after",
    "fault_heal_after_ms",
    "fault_fail_polls_after",
    "fault_stall_after",
    "fault_stall_ms",
    "fault_panic_after",
];

impl FaultConfig {
    /// Whether some fault can happen to a frame.
    pub fn is_active(&self) -> bool {
        self.rates().iter().any(|(_, rate)| *rate > 0.0) || self.drop_after > 0
    }

    /// Whether an endpoint of `scheme` gets faults.
    pub fn applies_to(&self, scheme: &str) -> bool {
        self.scheme.as_deref().is_none_or(|only| only == scheme)
    }

    /// Whether frames may be held, so that the endpoint must be polled to
    /// release them.
    pub fn holds_frames(&self) -> bool {
        self.reorder > 0.0 || self.delay > 0.0
    }

    fn rates(&self) -> [(&'static str, f64); 7] {
        [
            ("fault_drop", self.drop),
            ("fault_duplicate", self.duplicate),
            ("fault_reorder", self.reorder),
            ("fault_delay", self.delay),
            ("fault_corrupt", self.corrupt),
            ("fault_truncate", self.truncate),
            ("fault_disconnect", self.disconnect),
        ]
    }

    /// Check that every rate is within 0.0..=1.0 and the spans are at least 1.
    pub fn validate(&self) -> Result<(), FaultConfigError> {
        for (key, rate) in self.rates() {
            if !(0.0..=1.0).contains(&rate) {
                return Err(FaultConfigError::RateOutOfRange {
                    key: key.to_string(),
                    value: rate,
                });
            }
        }
        for (key, value) in [
            ("fault_reorder_span", self.reorder_span),
            ("fault_max_delay_polls", self.max_delay_polls),
        ] {
            if value == 0 {
                return Err(FaultConfigError::Zero {
                    key: key.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Read the `fault_*` entries of transport options (the keys in
    /// [`OPTION_KEYS`]; rates as decimal fractions, `fault_seed` and the
    /// spans as integers, `fault_direction` as `receive`, `send` or
    /// `both`). Missing keys keep their defaults; other options are
    /// ignored; an unknown `fault_*` key is an error.
    pub fn from_options(options: &[(String, String)]) -> Result<FaultConfig, FaultConfigError> {
        let mut config = FaultConfig::default();
        for (key, value) in options {
            if !key.starts_with("fault_") {
                continue;
            }
            let not_a_number = || FaultConfigError::NotANumber {
                key: key.clone(),
                value: value.clone(),
            };
            let rate = || value.trim().parse::<f64>().map_err(|_| not_a_number());
            let count = || value.trim().parse::<u32>().map_err(|_| not_a_number());
            match key.as_str() {
                "fault_seed" => {
                    config.seed = value.trim().parse().map_err(|_| not_a_number())?;
                }
                "fault_direction" => {
                    config.direction =
                        FaultDirection::from_name(value.trim()).ok_or_else(|| {
                            FaultConfigError::Direction {
                                value: value.clone(),
                            }
                        })?;
                }
                "fault_drop" => config.drop = rate()?,
                "fault_duplicate" => config.duplicate = rate()?,
                "fault_reorder" => config.reorder = rate()?,
                "fault_reorder_span" => config.reorder_span = count()?,
                "fault_delay" => config.delay = rate()?,
                "fault_max_delay_polls" => config.max_delay_polls = count()?,
                "fault_corrupt" => config.corrupt = rate()?,
                "fault_truncate" => config.truncate = rate()?,
                "fault_disconnect" => config.disconnect = rate()?,
                "fault_drop_after" => {
                    config.drop_after = value.trim().parse().map_err(|_| not_a_number())?;
                }
                "fault_heal_after_ms" => {
                    config.heal_after_ms = value.trim().parse().map_err(|_| not_a_number())?;
                }
                "fault_fail_polls_after" => {
                    config.fail_polls_after = value.trim().parse().map_err(|_| not_a_number())?;
                }
                "fault_stall_after" => {
                    config.stall_after = value.trim().parse().map_err(|_| not_a_number())?;
                }
                "fault_stall_ms" => {
                    config.stall_ms = value.trim().parse().map_err(|_| not_a_number())?;
                }
                "fault_panic_after" => {
                    config.panic_after = value.trim().parse().map_err(|_| not_a_number())?;
                }
                _ => {
                    return Err(FaultConfigError::UnknownKey {
                        key: key.clone(),
                        known: OPTION_KEYS.join(", "),
                    })
                }
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// The configuration as transport options, as
    /// [`from_options`](FaultConfig::from_options) reads them back.
    pub fn to_options(&self) -> Vec<(String, String)> {
        let mut options = vec![
            ("fault_seed".to_string(), self.seed.to_string()),
            (
                "fault_direction".to_string(),
                self.direction.name().to_string(),
            ),
            (
                "fault_reorder_span".to_string(),
                self.reorder_span.to_string(),
            ),
            (
                "fault_max_delay_polls".to_string(),
                self.max_delay_polls.to_string(),
            ),
            ("fault_drop_after".to_string(), self.drop_after.to_string()),
            (
                "fault_heal_after_ms".to_string(),
                self.heal_after_ms.to_string(),
            ),
            (
                "fault_fail_polls_after".to_string(),
                self.fail_polls_after.to_string(),
            ),
            (
                "fault_stall_after".to_string(),
                self.stall_after.to_string(),
            ),
            ("fault_stall_ms".to_string(), self.stall_ms.to_string()),
            (
                "fault_panic_after".to_string(),
                self.panic_after.to_string(),
            ),
        ];
        for (key, rate) in self.rates() {
            options.push((key.to_string(), rate.to_string()));
        }
        options
    }

    /// The same configuration with the seed of stream `index`, so that
    /// several endpoints from one configuration do not inject identical
    /// sequences.
    pub fn for_stream(&self, index: u64) -> FaultConfig {
        FaultConfig {
            seed: self.seed.wrapping_add(index),
            ..self.clone()
        }
    }
}

/// What a [`FaultyEndpoint`] did to the frames of one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Frames that came by, before any fault.
    pub frames: u64,
    /// Frames lost on purpose.
    pub dropped: u64,
    /// Extra copies delivered.
    pub duplicated: u64,
    /// Copies held back behind later frames.
    pub reordered: u64,
    /// Copies held for some polls.
    pub delayed: u64,
    /// Frames with flipped bytes.
    pub corrupted: u64,
    /// Frames cut short.
    pub truncated: u64,
    /// Peers disconnected.
    pub disconnected: u64,
    /// Held sent frames thrown away because their peer closed first.
    pub discarded: u64,
}

impl FaultCounts {
    fn add(&mut self, other: &FaultCounts) {
        self.frames += other.frames;
        self.dropped += other.dropped;
        self.duplicated += other.duplicated;
        self.reordered += other.reordered;
        self.delayed += other.delayed;
        self.corrupted += other.corrupted;
        self.truncated += other.truncated;
        self.disconnected += other.disconnected;
        self.discarded += other.discarded;
    }
}

/// What a [`FaultyEndpoint`] did, per direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultStats {
    pub receive: FaultCounts,
    pub send: FaultCounts,
}

impl FaultStats {
    /// The counts of `direction` (both added up for `Both`).
    pub fn of(&self, direction: FaultDirection) -> FaultCounts {
        match direction {
            FaultDirection::Send => self.send,
            FaultDirection::Receive => self.receive,
            FaultDirection::Both => {
                let mut both = self.receive;
                both.add(&self.send);
                both
            }
        }
    }

    /// Add another endpoint's counts.
    pub fn add(&mut self, other: &FaultStats) {
        self.receive.add(&other.receive);
        self.send.add(&other.send);
    }
}

/// A handle on a [`FaultyEndpoint`]'s counters that outlives borrowing it
/// (e.g. once the endpoint is boxed inside a broker).
#[derive(Debug, Clone, Default)]
pub struct SharedFaultStats(Arc<Mutex<FaultStats>>);

impl SharedFaultStats {
    /// The counters as of now.
    pub fn snapshot(&self) -> FaultStats {
        *self.0.lock()
    }
}

/// splitmix64: small, fast, and enough to pick faults reproducibly.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// True with probability `rate`; draws nothing when the rate is 0, so
    /// a fault that is off leaves the other faults' sequence unchanged.
    fn hit(&mut self, rate: f64) -> bool {
        rate > 0.0 && self.unit() < rate
    }

    /// Uniform in [0, n); n > 0.
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// When a held frame goes.
#[derive(Debug, Clone, Copy)]
struct Hold {
    /// Later frames of the same peer still to pass it, if reordered.
    frames_left: Option<u32>,
    /// Polls left before it goes regardless.
    polls_left: u32,
}

#[derive(Debug)]
struct Held<T> {
    peer: PeerId,
    frame: T,
    hold: Hold,
}

/// What happens to one frame, decided before it is touched.
struct Plan {
    disconnect: bool,
    drop: bool,
    /// (position, XOR mask) pairs, positions distinct.
    flips: Vec<(usize, u8)>,
    /// New length.
    truncate: Option<usize>,
    /// One entry per copy: `None` goes at once.
    copies: Vec<Option<Hold>>,
}

/// One direction's random stream, held frames and decisions.
#[derive(Debug)]
struct Injector<T> {
    rng: Rng,
    held: Vec<Held<T>>,
    /// Frames planned so far.
    planned: u64,
    /// When the first was (see `FaultConfig::heal_after_ms`).
    first_at: Option<std::time::Instant>,
}

impl<T> Injector<T> {
    fn new(seed: u64) -> Self {
        Injector {
            rng: Rng(seed),
            held: Vec::new(),
            planned: 0,
            first_at: None,
        }
    }

    /// Decide a frame's fate. `len` is its length; `keep` how many leading
    /// bytes corruption and truncation leave alone.
    fn plan(&mut self, config: &FaultConfig, len: usize, keep: usize) -> Plan {
        self.planned += 1;
        let quiet = config.drop_after > 0 && self.planned > config.drop_after;
        let first_at = *self.first_at.get_or_insert_with(std::time::Instant::now);
        let healed = config.heal_after_ms > 0
            && first_at.elapsed() >= std::time::Duration::from_millis(config.heal_after_ms);
        let rng = &mut self.rng;
        let mut plan = Plan {
            disconnect: false,
            drop: false,
            flips: Vec::new(),
            truncate: None,
            copies: Vec::new(),
        };
        if healed {
            plan.copies.push(None);
            return plan;
        }
        plan.disconnect = rng.hit(config.disconnect);
        if plan.disconnect {
            return plan;
        }
        plan.drop = rng.hit(config.drop) || quiet;
        if plan.drop {
            return plan;
        }
        if rng.hit(config.corrupt) && len > keep {
            let span = (len - keep) as u64;
            let count = 1 + rng.below(3);
            for _ in 0..count {
                let at = keep + rng.below(span) as usize;
                let mask = 1 + rng.below(255) as u8;
                if !plan.flips.iter().any(|(pos, _)| *pos == at) {
                    plan.flips.push((at, mask));
                }
            }
        }
        if rng.hit(config.truncate) && len > keep {
            plan.truncate = Some(keep + rng.below((len - keep) as u64) as usize);
        }
        let copies = if rng.hit(config.duplicate) { 2 } else { 1 };
        for _ in 0..copies {
            let hold = if rng.hit(config.reorder) {
                Some(Hold {
                    frames_left: Some(config.reorder_span),
                    polls_left: config.max_delay_polls,
                })
            } else if rng.hit(config.delay) {
                Some(Hold {
                    frames_left: None,
                    polls_left: 1 + rng.below(u64::from(config.max_delay_polls)) as u32,
                })
            } else {
                None
            };
            plan.copies.push(hold);
        }
        plan
    }

    /// Count one poll; take out the frames whose time has come, in the
    /// order they were held.
    fn tick(&mut self) -> Vec<Held<T>> {
        for held in &mut self.held {
            held.hold.polls_left = held.hold.polls_left.saturating_sub(1);
        }
        self.take_where(|held| held.hold.polls_left == 0)
    }

    /// One frame of `peer` passed: count it against the frames held back
    /// behind it (`before` of them, the ones held before it) and take out
    /// those it was the last to overtake.
    fn passed(&mut self, peer: PeerId, before: usize) -> Vec<Held<T>> {
        let mut due = false;
        for held in self.held.iter_mut().take(before) {
            if held.peer != peer {
                continue;
            }
            if let Some(left) = &mut held.hold.frames_left {
                *left = left.saturating_sub(1);
                due |= *left == 0;
            }
        }
        if !due {
            return Vec::new();
        }
        self.take_where(|held| held.hold.frames_left == Some(0))
    }

    fn take_peer(&mut self, peer: PeerId) -> Vec<Held<T>> {
        self.take_where(|held| held.peer == peer)
    }

    fn take_where(&mut self, pred: impl Fn(&Held<T>) -> bool) -> Vec<Held<T>> {
        if !self.held.iter().any(&pred) {
            return Vec::new();
        }
        let (due, kept) = std::mem::take(&mut self.held).into_iter().partition(pred);
        self.held = kept;
        due
    }
}

/// Apply a plan's byte changes to a received frame (prefix not protected).
fn damage(frame: Bytes, flips: &[(usize, u8)], truncate: Option<usize>) -> Bytes {
    if flips.is_empty() && truncate.is_none() {
        return frame;
    }
    let mut bytes = frame.to_vec();
    for &(at, mask) in flips {
        if let Some(byte) = bytes.get_mut(at) {
            *byte ^= mask;
        }
    }
    if let Some(len) = truncate {
        bytes.truncate(len);
    }
    Bytes::from(bytes)
}

/// Apply a plan's byte changes to a frame being sent: flips after the
/// prefix, truncation with the prefix rewritten to the new length.
fn damage_outgoing(frame: OutFrame, flips: &[(usize, u8)], truncate: Option<usize>) -> OutFrame {
    if flips.is_empty() && truncate.is_none() {
        return frame;
    }
    let mut bytes = damage(frame.to_bytes(), flips, truncate).to_vec();
    if truncate.is_some() && bytes.len() >= PREFIX_LEN {
        let declared = (bytes.len() - PREFIX_LEN) as u32;
        bytes[..PREFIX_LEN].copy_from_slice(&declared.to_le_bytes());
    }
    OutFrame::whole(bytes.into())
}

/// An endpoint that injects faults into the frames of the endpoint it
/// wraps. See the module docs for what happens and in which order.
pub struct FaultyEndpoint {
    inner: Box<dyn Endpoint>,
    config: FaultConfig,
    receive: Injector<Bytes>,
    send: Injector<OutFrame>,
    /// Peers closed by an injected disconnect whose `Closed` is pending.
    disconnecting: HashSet<PeerId>,
    stats: SharedFaultStats,
    scratch: Vec<Event>,
    /// Frames received so far, for `fail_polls_after`, `stall_after` and
    /// `panic_after`.
    received: u64,
    /// Whether the poll `stall_after` blocks has come.
    stalled: bool,
    /// Whether the poll `panic_after` panics has come.
    panicked: bool,
}

impl std::fmt::Debug for FaultyEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyEndpoint")
            .field("scheme", &self.inner.scheme())
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Offset mixed into the seed of the send direction's stream.
const SEND_STREAM: u64 = 0x5eed_0f5e_4d00_0001;

impl FaultyEndpoint {
    /// Wrap `inner`. The configuration should pass
    /// [`FaultConfig::validate`]; rates outside 0..=1 act as 0 or 1.
    pub fn new(inner: Box<dyn Endpoint>, config: FaultConfig) -> FaultyEndpoint {
        FaultyEndpoint::with_stats(inner, config, SharedFaultStats::default())
    }

    /// Wrap `inner`, counting into `stats` (shared with whoever holds a clone).
    pub fn with_stats(
        inner: Box<dyn Endpoint>,
        config: FaultConfig,
        stats: SharedFaultStats,
    ) -> FaultyEndpoint {
        FaultyEndpoint {
            inner,
            receive: Injector::new(config.seed),
            send: Injector::new(config.seed ^ SEND_STREAM),
            config,
            disconnecting: HashSet::new(),
            stats,
            scratch: Vec::new(),
            received: 0,
            stalled: false,
            panicked: false,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &FaultConfig {
        &self.config
    }

    /// What was injected so far.
    pub fn stats(&self) -> FaultStats {
        self.stats.snapshot()
    }

    /// A handle on the counters that can be kept after the endpoint is boxed.
    pub fn stats_handle(&self) -> SharedFaultStats {
        self.stats.clone()
    }

    /// Frames held back in both directions.
    pub fn held(&self) -> usize {
        self.receive.held.len() + self.send.held.len()
    }

    fn count(&self, update: impl FnOnce(&mut FaultStats)) {
        update(&mut self.stats.0.lock());
    }

    /// Close a peer for an injected disconnect.
    fn disconnect(&mut self, peer: PeerId) {
        self.disconnecting.insert(peer);
        self.inner.close(peer);
    }

    /// A received frame through the receive faults, into `events`.
    fn on_received(&mut self, peer: PeerId, frame: Bytes, events: &mut Vec<Event>) {
        let plan = self.receive.plan(&self.config, frame.len(), 0);
        let before = self.receive.held.len();
        self.count(|s| {
            let c = &mut s.receive;
            c.frames += 1;
            c.disconnected += u64::from(plan.disconnect);
            c.dropped += u64::from(plan.drop);
            c.corrupted += u64::from(!plan.flips.is_empty());
            c.truncated += u64::from(plan.truncate.is_some());
            c.duplicated += plan.copies.len().saturating_sub(1) as u64;
            for hold in plan.copies.iter().flatten() {
                if hold.frames_left.is_some() {
                    c.reordered += 1;
                } else {
                    c.delayed += 1;
                }
            }
        });
        if plan.disconnect {
            self.disconnect(peer);
            return;
        }
        if plan.drop {
            return;
        }
        let frame = damage(frame, &plan.flips, plan.truncate);
        let mut passed = 0;
        for hold in plan.copies {
            match hold {
                Some(hold) => self.receive.held.push(Held {
                    peer,
                    frame: frame.clone(),
                    hold,
                }),
                None => {
                    events.push(Event::Frame {
                        peer,
                        frame: frame.clone(),
                    });
                    passed += 1;
                }
            }
        }
        for _ in 0..passed {
            for due in self.receive.passed(peer, before) {
                events.push(Event::Frame {
                    peer: due.peer,
                    frame: due.frame,
                });
            }
        }
    }

    /// Hand a held frame to the wrapped endpoint; a full queue keeps it
    /// for the next poll, a closed peer discards it.
    fn release_sent(&mut self, held: Held<OutFrame>) {
        if self.disconnecting.contains(&held.peer) {
            self.count(|s| s.send.discarded += 1);
            return;
        }
        match self.inner.send(held.peer, held.frame) {
            Ok(()) => {}
            Err(SendError::WouldBlock(frame)) => self.send.held.push(Held {
                peer: held.peer,
                frame,
                hold: Hold {
                    frames_left: None,
                    polls_left: 1,
                },
            }),
            Err(_) => self.count(|s| s.send.discarded += 1),
        }
    }
}

impl Drop for FaultyEndpoint {
    fn drop(&mut self) {
        if self.config.is_active() {
            let stats = self.stats();
            tracing::info!(
                scheme = self.inner.scheme(),
                receive = ?stats.receive,
                send = ?stats.send,
                "fault injection ends"
            );
        }
    }
}

impl Endpoint for FaultyEndpoint {
    /// The wrapped endpoint's scheme, so offers and negotiation see the
    /// real transport.
    fn scheme(&self) -> &str {
        self.inner.scheme()
    }

    fn local_addr(&self) -> Vec<u8> {
        self.inner.local_addr()
    }

    fn max_frame(&self) -> usize {
        self.inner.max_frame()
    }

    fn connect(&mut self, addr: &str) -> Result<PeerId, TransportError> {
        self.inner.connect(addr)
    }

    fn insert_peer(&mut self, addr: &[u8], keys: &LinkKeys) -> Result<PeerId, TransportError> {
        self.inner.insert_peer(addr, keys)
    }

    fn buffers(&self) -> BufferMemory {
        self.inner.buffers()
    }

    fn refused(&self) -> Refused {
        self.inner.refused()
    }

    fn receiving_from(&self, peer: PeerId) -> bool {
        self.inner.receiving_from(peer)
    }

    fn rendezvous_counts(&self) -> efabus_core::transport::RendezvousCounts {
        self.inner.rendezvous_counts()
    }

    fn fabric_counts(&self) -> efabus_core::transport::FabricCounts {
        self.inner.fabric_counts()
    }

    fn reload_tls(&mut self) -> Result<bool, TransportError> {
        if self.config.fail_tls_reload {
            return Err(TransportError::Tls(
                "an injected failure (fail_tls_reload)".to_string(),
            ));
        }
        self.inner.reload_tls()
    }

    fn revert_tls(&mut self) {
        self.inner.revert_tls();
    }

    fn reconfigure(&mut self, config: &EndpointConfig) -> Result<(), TransportError> {
        self.inner.reconfigure(config)
    }

    fn peer_certificate(&self, peer: PeerId) -> Option<Vec<u8>> {
        self.inner.peer_certificate(peer)
    }

    fn send(&mut self, peer: PeerId, frame: OutFrame) -> Result<(), SendError> {
        if self.disconnecting.contains(&peer) {
            return Err(SendError::Closed(peer));
        }
        if !self.config.direction.send() || (!self.config.is_active() && self.send.held.is_empty())
        {
            return self.inner.send(peer, frame);
        }
        let max = self.inner.max_frame();
        if frame.len() > max {
            return Err(SendError::TooLarge {
                len: frame.len(),
                max,
            });
        }
        let plan = self.send.plan(&self.config, frame.len(), PREFIX_LEN);
        if plan.disconnect {
            self.count(|s| {
                s.send.frames += 1;
                s.send.disconnected += 1;
            });
            self.disconnect(peer);
            return Ok(());
        }
        if plan.drop {
            self.count(|s| {
                s.send.frames += 1;
                s.send.dropped += 1;
            });
            return Ok(());
        }
        let original = frame.clone();
        let frame = damage_outgoing(frame, &plan.flips, plan.truncate);
        let before = self.send.held.len();
        let mut counts = FaultCounts {
            frames: 1,
            corrupted: u64::from(!plan.flips.is_empty()),
            truncated: u64::from(plan.truncate.is_some()),
            ..FaultCounts::default()
        };
        let mut passed = 0;
        for (copy, hold) in plan.copies.into_iter().enumerate() {
            if let Some(hold) = hold {
                if hold.frames_left.is_some() {
                    counts.reordered += 1;
                } else {
                    counts.delayed += 1;
                }
                counts.duplicated += u64::from(copy > 0);
                self.send.held.push(Held {
                    peer,
                    frame: frame.clone(),
                    hold,
                });
                continue;
            }
            match self.inner.send(peer, frame.clone()) {
                Ok(()) => {
                    passed += 1;
                    counts.duplicated += u64::from(copy > 0);
                }
                // Nothing of this frame went anywhere yet: hand it back as
                // it came, and count nothing.
                Err(SendError::WouldBlock(_)) if copy == 0 => {
                    self.send.held.truncate(before);
                    return Err(SendError::WouldBlock(original));
                }
                Err(err) if copy == 0 => {
                    self.send.held.truncate(before);
                    return Err(err);
                }
                // The extra copy found no room: it simply does not exist.
                Err(_) => {}
            }
        }
        self.count(|s| s.send.add(&counts));
        for _ in 0..passed {
            for due in self.send.passed(peer, before) {
                self.release_sent(due);
            }
        }
        Ok(())
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), TransportError> {
        let limit = self.config.fail_polls_after;
        if limit > 0 && self.received >= limit {
            return Err(TransportError::Other(INJECTED_POLL_FAILURE.to_string()));
        }
        let stall = self.config.stall_after;
        if stall > 0 && self.received >= stall && !self.stalled {
            self.stalled = true;
            std::thread::sleep(std::time::Duration::from_millis(self.config.stall_ms));
        }
        for due in self.receive.tick() {
            events.push(Event::Frame {
                peer: due.peer,
                frame: due.frame,
            });
        }
        for due in self.send.tick() {
            self.release_sent(due);
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        let result = self.inner.poll(&mut scratch);
        // Held frames must still see the frames that pass them.
        let faults_in = self.config.direction.receive()
            && (self.config.is_active() || !self.receive.held.is_empty());
        for event in scratch.drain(..) {
            if matches!(event, Event::Frame { .. }) {
                self.received += 1;
                let panic_at = self.config.panic_after;
                if panic_at > 0 && self.received >= panic_at && !self.panicked {
                    self.panicked = true;
                    panic!("{INJECTED_PANIC}");
                }
            }
            match event {
                Event::Frame { peer, .. } if self.disconnecting.contains(&peer) => {}
                Event::Frame { peer, frame } if faults_in => self.on_received(peer, frame, events),
                Event::Closed { peer, reason } => {
                    for held in self.receive.take_peer(peer) {
                        events.push(Event::Frame {
                            peer: held.peer,
                            frame: held.frame,
                        });
                    }
                    let discarded = self.send.take_peer(peer).len() as u64;
                    if discarded > 0 {
                        self.count(|s| s.send.discarded += discarded);
                    }
                    let reason = if self.disconnecting.remove(&peer) {
                        CloseReason::Error(INJECTED_DISCONNECT.to_string())
                    } else {
                        reason
                    };
                    events.push(Event::Closed { peer, reason });
                }
                other => events.push(other),
            }
        }
        self.scratch = scratch;
        result
    }

    fn close(&mut self, peer: PeerId) {
        // Held frames were sent as far as the caller knows: flush them first.
        for held in self.send.take_peer(peer) {
            self.release_sent(held);
        }
        self.inner.close(peer);
    }

    fn readiness(&self) -> Readiness {
        if self.config.holds_frames() {
            Readiness::MustPoll
        } else {
            self.inner.readiness()
        }
    }

    fn prepare_wait(&mut self) -> bool {
        self.inner.prepare_wait()
    }

    fn flush(&mut self) {
        self.inner.flush();
    }

    fn wait_cap(&self) -> Option<std::time::Duration> {
        self.inner.wait_cap()
    }

    fn set_peer_frame_limit(&mut self, peer: PeerId, limit: usize) {
        self.inner.set_peer_frame_limit(peer, limit);
    }

    fn rendezvous_max(&self) -> usize {
        self.inner.rendezvous_max()
    }

    fn set_peer_rendezvous(&mut self, peer: PeerId, limit: usize) {
        self.inner.set_peer_rendezvous(peer, limit);
    }

    fn set_receive_limit(&mut self, peer: PeerId, limit: Option<usize>) {
        self.inner.set_receive_limit(peer, limit);
    }

    fn set_accepted_receive_limit(&mut self, limit: Option<usize>) {
        self.inner.set_accepted_receive_limit(limit);
    }

    fn info(&self) -> Option<FabricInfo> {
        self.inner.info()
    }

    fn queued_bytes(&self, peer: PeerId) -> usize {
        let held: usize = self
            .send
            .held
            .iter()
            .filter(|held| held.peer == peer)
            .map(|held| held.frame.len())
            .sum();
        self.inner.queued_bytes(peer) + held
    }

    fn set_read_paused(&mut self, peer: PeerId, paused: bool) {
        self.inner.set_read_paused(peer, paused);
    }
}

/// A transport whose endpoints are another transport's, wrapped in
/// [`FaultyEndpoint`]. Its scheme is [`SCHEME_PREFIX`] plus the wrapped
/// scheme (`faulty+tcp`); the fault settings come from each open's
/// `fault_*` options (see [`FaultConfig::from_options`]), over a default
/// configuration given at construction. The `fault_*` options are removed
/// before the wrapped transport sees the config. The `n`-th endpoint
/// opened (from 0) uses seed `seed + n`.
pub struct FaultTransport {
    inner: Arc<dyn Transport>,
    scheme: String,
    defaults: FaultConfig,
    opened: Mutex<Vec<SharedFaultStats>>,
}

impl std::fmt::Debug for FaultTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultTransport")
            .field("scheme", &self.scheme)
            .field("defaults", &self.defaults)
            .finish()
    }
}

impl FaultTransport {
    /// Wrap `inner`; endpoints opened without `fault_*` options use `defaults`.
    pub fn new(inner: Arc<dyn Transport>, defaults: FaultConfig) -> FaultTransport {
        let scheme = format!("{SCHEME_PREFIX}{}", inner.scheme());
        FaultTransport {
            inner,
            scheme,
            defaults,
            opened: Mutex::new(Vec::new()),
        }
    }

    /// The counters of every endpoint opened so far, added up.
    pub fn stats(&self) -> FaultStats {
        let mut total = FaultStats::default();
        for stats in self.opened.lock().iter() {
            total.add(&stats.snapshot());
        }
        total
    }
}

impl Transport for FaultTransport {
    fn scheme(&self) -> &str {
        &self.scheme
    }

    fn infos(&self) -> Result<Vec<FabricInfo>, TransportError> {
        self.inner.infos()
    }

    fn open(&self, config: &EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        let (faults, rest): (Vec<_>, Vec<_>) = config
            .options
            .iter()
            .cloned()
            .partition(|(key, _)| key.starts_with("fault_"));
        let mut options = self.defaults.to_options();
        options.extend(faults);
        let fault_config = FaultConfig::from_options(&options)
            .map_err(|err| TransportError::Other(format!("{}: {err}", self.scheme)))?;
        let inner = self.inner.open(&EndpointConfig {
            options: rest,
            ..config.clone()
        })?;
        let stats = SharedFaultStats::default();
        let index = {
            let mut opened = self.opened.lock();
            opened.push(stats.clone());
            opened.len() as u64 - 1
        };
        Ok(Box::new(FaultyEndpoint::with_stats(
            inner,
            fault_config.for_stream(index),
            stats,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemTransport;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    static NEXT: AtomicU64 = AtomicU64::new(1);

    fn fresh_name() -> String {
        format!(
            "fault-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// A frame: prefix, then a 4-byte number, then `extra` filler bytes.
    fn numbered(n: u32, extra: usize) -> Bytes {
        let mut v = ((4 + extra) as u32).to_le_bytes().to_vec();
        v.extend_from_slice(&n.to_le_bytes());
        v.extend((0..extra).map(|i| (i as u8).wrapping_mul(7)));
        v.into()
    }

    fn number(frame: &[u8]) -> u32 {
        u32::from_le_bytes(frame[4..8].try_into().expect("4 bytes"))
    }

    /// A plain mem endpoint sending to a faulty one (receive faults) or a
    /// faulty one sending to a plain one (send faults); returns (sender,
    /// receiver, sender's peer id, receiver's peer id).
    struct Pair {
        tx: Box<dyn Endpoint>,
        rx: Box<dyn Endpoint>,
        to_rx: PeerId,
        from_tx: PeerId,
        /// The sender's events, kept by `pump`.
        tx_log: Vec<Event>,
    }

    fn pair(config: FaultConfig) -> (Pair, SharedFaultStats) {
        let name = fresh_name();
        let bound = MemTransport
            .open(&EndpointConfig {
                bind: Some(name.clone()),
                ..EndpointConfig::default()
            })
            .expect("bind mem");
        let client = MemTransport
            .open(&EndpointConfig::default())
            .expect("open mem");
        let (mut tx, mut rx, handle) = match config.direction {
            FaultDirection::Send => {
                let faulty = FaultyEndpoint::new(client, config);
                let handle = faulty.stats_handle();
                (Box::new(faulty) as Box<dyn Endpoint>, bound, handle)
            }
            _ => {
                let faulty = FaultyEndpoint::new(bound, config);
                let handle = faulty.stats_handle();
                (client, Box::new(faulty) as Box<dyn Endpoint>, handle)
            }
        };
        let to_rx = tx.connect(&name).expect("connect");
        let mut events = Vec::new();
        let mut from_tx = None;
        for _ in 0..1000 {
            rx.poll(&mut events).expect("poll");
            tx.poll(&mut Vec::new()).expect("poll");
            for event in events.drain(..) {
                if let Event::Accepted { peer, .. } = event {
                    from_tx = Some(peer);
                }
            }
            if from_tx.is_some() {
                break;
            }
        }
        let from_tx = from_tx.expect("accepted");
        (
            Pair {
                tx,
                rx,
                to_rx,
                from_tx,
                tx_log: Vec::new(),
            },
            handle,
        )
    }

    impl Pair {
        fn send_all(&mut self, frames: &[Bytes]) {
            for frame in frames {
                self.tx
                    .send(self.to_rx, OutFrame::whole(frame.clone()))
                    .expect("send");
            }
        }

        /// Poll both sides `rounds` times; the receiver's events, in order.
        fn pump(&mut self, rounds: usize) -> Vec<Event> {
            let mut all = Vec::new();
            for _ in 0..rounds {
                self.tx.poll(&mut self.tx_log).expect("poll tx");
                self.rx.poll(&mut all).expect("poll rx");
            }
            all
        }

        fn frames(&mut self, rounds: usize) -> Vec<Bytes> {
            self.pump(rounds)
                .into_iter()
                .filter_map(|event| match event {
                    Event::Frame { peer, frame } if peer == self.from_tx => Some(frame),
                    _ => None,
                })
                .collect()
        }
    }

    fn frames(n: u32) -> Vec<Bytes> {
        (0..n).map(|i| numbered(i, 16)).collect()
    }

    fn with(direction: FaultDirection, set: impl FnOnce(&mut FaultConfig)) -> FaultConfig {
        let mut config = FaultConfig {
            seed: 7,
            direction,
            ..FaultConfig::default()
        };
        set(&mut config);
        config
    }

    const BOTH_WAYS: [FaultDirection; 2] = [FaultDirection::Receive, FaultDirection::Send];

    #[test]
    fn all_rates_zero_pass_everything_untouched() {
        for direction in BOTH_WAYS {
            let (mut p, stats) = pair(with(direction, |_| {}));
            let sent = frames(50);
            p.send_all(&sent);
            assert_eq!(p.frames(4), sent, "{direction:?}");
            assert_eq!(stats.snapshot(), FaultStats::default(), "{direction:?}");
        }
    }

    #[test]
    fn drop_at_one_loses_every_frame_and_counts_them() {
        for direction in BOTH_WAYS {
            let (mut p, stats) = pair(with(direction, |c| c.drop = 1.0));
            p.send_all(&frames(20));
            assert!(p.frames(4).is_empty(), "{direction:?}");
            let c = stats.snapshot().of(direction);
            assert_eq!((c.frames, c.dropped), (20, 20), "{direction:?}");
        }
    }

    #[test]
    fn drop_after_passes_that_many_frames_and_loses_every_later_one() {
        for direction in BOTH_WAYS {
            let (mut p, stats) = pair(with(direction, |c| c.drop_after = 5));
            p.send_all(&frames(20));
            assert_eq!(p.frames(5), frames(5), "{direction:?}");
            let c = stats.snapshot().of(direction);
            assert_eq!((c.frames, c.dropped), (20, 15), "{direction:?}");
        }
        let options = [("fault_drop_after".to_string(), "7".to_string())];
        let config = FaultConfig::from_options(&options).expect("parses");
        assert_eq!(config.drop_after, 7);
        assert!(config.is_active());
        assert_eq!(FaultConfig::from_options(&config.to_options()), Ok(config));
    }

    #[test]
    fn heal_after_ms_ends_the_faults_that_long_after_the_first_frame() {
        for direction in BOTH_WAYS {
            let (mut p, stats) = pair(with(direction, |c| {
                c.drop = 1.0;
                c.heal_after_ms = 200;
            }));
            p.send_all(&frames(5));
            assert!(p.frames(1).is_empty(), "{direction:?}: lost before");
            std::thread::sleep(Duration::from_millis(250));
            p.send_all(&frames(5));
            assert_eq!(p.frames(5), frames(5), "{direction:?}: passed after");
            let c = stats.snapshot().of(direction);
            assert_eq!((c.frames, c.dropped), (10, 5), "{direction:?}");
        }
        let options = [("fault_heal_after_ms".to_string(), "1500".to_string())];
        let config = FaultConfig::from_options(&options).expect("parses");
        assert_eq!(config.heal_after_ms, 1500);
        assert_eq!(FaultConfig::from_options(&config.to_options()), Ok(config));
    }

    #[test]
    fn duplicate_at_one_doubles_every_frame_in_place() {
        for direction in BOTH_WAYS {
            let (mut p, stats) = pair(with(direction, |c| c.duplicate = 1.0));
            let sent = frames(10);
            p.send_all(&sent);
            let got = p.frames(4);
            let expect: Vec<Bytes> = sent.iter().flat_map(|f| [f.clone(), f.clone()]).collect();
            assert_eq!(got, expect, "{direction:?}");
            let c = stats.snapshot().of(direction);
            assert_eq!((c.frames, c.duplicated), (10, 10), "{direction:?}");
        }
    }

    #[test]
    fn reorder_at_one_swaps_with_the_next_frame_or_releases_by_polls() {
        // Every frame is held until one later frame passed; with every
        // frame held, none passes, so all go when their polls run out, in
        // the order they were held.
        let (mut p, stats) = pair(with(FaultDirection::Receive, |c| {
            c.reorder = 1.0;
            c.max_delay_polls = 3;
        }));
        let sent = frames(6);
        p.send_all(&sent);
        // The first poll takes them in and holds them all; they go on the
        // third poll after that, in order.
        assert!(p.frames(3).is_empty());
        assert_eq!(p.frames(1), sent, "released after three polls, in order");
        assert_eq!(stats.snapshot().receive.reordered, 6);

        // Half the frames reordered: each held one goes right after the
        // next frame that passes.
        let (mut p, _) = pair(with(FaultDirection::Receive, |c| {
            c.reorder = 0.5;
            c.max_delay_polls = 1000;
        }));
        let sent = frames(200);
        p.send_all(&sent);
        let got: Vec<u32> = p.frames(1).iter().map(|f| number(f)).collect();
        assert!(
            got.windows(2).any(|w| w[0] > w[1]),
            "order changed: {got:?}"
        );
        // Each frame is overtaken by at most the frames behind it in one
        // run of held frames, and released right after the first to pass.
        for (i, n) in got.iter().enumerate() {
            if i > 0 && got[i - 1] > *n {
                assert_eq!(got[i - 1], got[..i].iter().copied().max().unwrap());
            }
        }
        let mut rest = p.frames(1001);
        rest.sort_by_key(|f| number(f));
        let mut all: Vec<u32> = got;
        all.extend(rest.iter().map(|f| number(f)));
        all.sort_unstable();
        assert_eq!(all, (0..200).collect::<Vec<_>>(), "nothing lost or doubled");
    }

    #[test]
    fn reorder_span_lets_that_many_frames_overtake() {
        let reorder_first = FaultConfig {
            reorder: 1.0,
            reorder_span: 2,
            max_delay_polls: 100,
            ..FaultConfig::default()
        };
        // Receive side: frame 0 is taken in and held; then reordering is
        // switched off and frames 1..4 pass it.
        let name = fresh_name();
        let bound = MemTransport.open_mem(&EndpointConfig {
            bind: Some(name.clone()),
            ..EndpointConfig::default()
        });
        let mut rx = FaultyEndpoint::new(Box::new(bound.unwrap()), reorder_first.clone());
        let mut tx = MemTransport.open(&EndpointConfig::default()).unwrap();
        let peer = tx.connect(&name).unwrap();
        tx.send(peer, OutFrame::whole(numbered(0, 0))).unwrap();
        let mut events = Vec::new();
        rx.poll(&mut events).unwrap();
        assert_eq!(rx.held(), 1);
        rx.config.reorder = 0.0;
        for n in 1..4 {
            tx.send(peer, OutFrame::whole(numbered(n, 0))).unwrap();
        }
        rx.poll(&mut events).unwrap();
        let got: Vec<u32> = events
            .iter()
            .filter_map(|e| match e {
                Event::Frame { frame, .. } => Some(number(frame)),
                _ => None,
            })
            .collect();
        assert_eq!(got, vec![1, 2, 0, 3]);

        // Send side: the same, with the faulty endpoint sending.
        let name = fresh_name();
        let mut rx = MemTransport
            .open(&EndpointConfig {
                bind: Some(name.clone()),
                ..EndpointConfig::default()
            })
            .unwrap();
        let inner = MemTransport.open(&EndpointConfig::default()).unwrap();
        let mut tx = FaultyEndpoint::new(
            inner,
            FaultConfig {
                direction: FaultDirection::Send,
                ..reorder_first
            },
        );
        let peer = tx.connect(&name).unwrap();
        tx.send(peer, OutFrame::whole(numbered(0, 0))).unwrap();
        assert_eq!(tx.queued_bytes(peer), 8, "a held frame counts as queued");
        tx.config.reorder = 0.0;
        for n in 1..4 {
            tx.send(peer, OutFrame::whole(numbered(n, 0))).unwrap();
        }
        let mut events = Vec::new();
        rx.poll(&mut events).unwrap();
        let got: Vec<u32> = events
            .iter()
            .filter_map(|e| match e {
                Event::Frame { frame, .. } => Some(number(frame)),
                _ => None,
            })
            .collect();
        assert_eq!(got, vec![1, 2, 0, 3]);
        assert_eq!(tx.stats().send.reordered, 1);
    }

    #[test]
    fn delay_at_one_releases_every_frame_within_the_bound() {
        for direction in BOTH_WAYS {
            let (mut p, stats) = pair(with(direction, |c| {
                c.delay = 1.0;
                c.max_delay_polls = 5;
            }));
            let sent = frames(40);
            p.send_all(&sent);
            let mut got = p.frames(1);
            if direction == FaultDirection::Receive {
                assert!(got.is_empty(), "nothing on the poll that takes them in");
            }
            got.extend(p.frames(5));
            let mut numbers: Vec<u32> = got.iter().map(|f| number(f)).collect();
            numbers.sort_unstable();
            assert_eq!(numbers, (0..40).collect::<Vec<_>>(), "{direction:?}");
            let c = stats.snapshot().of(direction);
            assert_eq!(c.delayed, 40, "{direction:?}");
        }
    }

    #[test]
    fn corrupt_at_one_changes_every_received_frame_but_not_its_length() {
        let (mut p, stats) = pair(with(FaultDirection::Receive, |c| c.corrupt = 1.0));
        let sent = frames(100);
        p.send_all(&sent);
        let got = p.frames(2);
        assert_eq!(got.len(), 100);
        for (a, b) in sent.iter().zip(&got) {
            assert_eq!(a.len(), b.len());
            let differing = a.iter().zip(b.iter()).filter(|(x, y)| x != y).count();
            assert!((1..=3).contains(&differing), "{differing} bytes differ");
        }
        assert_eq!(stats.snapshot().receive.corrupted, 100);
    }

    #[test]
    fn corrupt_on_send_keeps_the_prefix() {
        let (mut p, stats) = pair(with(FaultDirection::Send, |c| c.corrupt = 1.0));
        let sent = frames(100);
        p.send_all(&sent);
        let got = p.frames(2);
        assert_eq!(got.len(), 100);
        for (a, b) in sent.iter().zip(&got) {
            assert_eq!(a[..4], b[..4], "prefix kept");
            assert_ne!(a, b);
        }
        assert_eq!(stats.snapshot().send.corrupted, 100);
    }

    #[test]
    fn truncate_at_one_shortens_every_frame() {
        let (mut p, stats) = pair(with(FaultDirection::Receive, |c| c.truncate = 1.0));
        let sent = frames(50);
        p.send_all(&sent);
        let got = p.frames(2);
        assert_eq!(got.len(), 50);
        for (a, b) in sent.iter().zip(&got) {
            assert!(b.len() < a.len());
            assert_eq!(a[..b.len()], b[..], "a prefix of the original");
        }
        assert_eq!(stats.snapshot().receive.truncated, 50);

        let (mut p, stats) = pair(with(FaultDirection::Send, |c| c.truncate = 1.0));
        p.send_all(&sent);
        let got = p.frames(2);
        assert_eq!(got.len(), 50);
        for (a, b) in sent.iter().zip(&got) {
            assert!(b.len() >= 4 && b.len() < a.len());
            let declared = u32::from_le_bytes(b[..4].try_into().unwrap()) as usize;
            assert_eq!(declared, b.len() - 4, "prefix rewritten");
            assert_eq!(a[4..b.len()], b[4..]);
        }
        assert_eq!(stats.snapshot().send.truncated, 50);
    }

    #[test]
    fn polls_fail_once_enough_frames_came() {
        let (mut p, _) = pair(with(FaultDirection::Receive, |c| c.fail_polls_after = 3));
        p.send_all(&frames(5));
        p.tx.poll(&mut Vec::new()).expect("poll tx");
        let mut events = Vec::new();
        p.rx.poll(&mut events)
            .expect("the poll that brings the frames succeeds");
        let got = events
            .iter()
            .filter(|e| matches!(e, Event::Frame { .. }))
            .count();
        assert_eq!(got, 5);
        for _ in 0..3 {
            let err = p.rx.poll(&mut events).expect_err("every later poll fails");
            assert_eq!(err.to_string(), INJECTED_POLL_FAILURE);
        }
        let config =
            FaultConfig::from_options(&[("fault_fail_polls_after".to_string(), "7".to_string())])
                .expect("valid option");
        assert_eq!(config.fail_polls_after, 7);
        assert_eq!(FaultConfig::from_options(&config.to_options()), Ok(config));
    }

    #[test]
    fn one_poll_stalls_once_enough_frames_came() {
        let (mut p, _) = pair(with(FaultDirection::Receive, |c| {
            c.stall_after = 3;
            c.stall_ms = 300;
        }));
        p.send_all(&frames(5));
        p.tx.poll(&mut Vec::new()).expect("poll tx");
        let mut events = Vec::new();
        let timed = |p: &mut Pair, events: &mut Vec<Event>| {
            let start = std::time::Instant::now();
            p.rx.poll(events).expect("poll");
            start.elapsed()
        };
        assert!(timed(&mut p, &mut events) < Duration::from_millis(300));
        assert_eq!(events.len(), 5, "{events:?}");
        assert!(timed(&mut p, &mut events) >= Duration::from_millis(300));
        assert!(
            timed(&mut p, &mut events) < Duration::from_millis(300),
            "once"
        );
        let config = FaultConfig::from_options(&[
            ("fault_stall_after".to_string(), "7".to_string()),
            ("fault_stall_ms".to_string(), "9".to_string()),
        ])
        .expect("valid options");
        assert_eq!((config.stall_after, config.stall_ms), (7, 9));
        assert_eq!(FaultConfig::from_options(&config.to_options()), Ok(config));
    }

    #[test]
    fn one_poll_panics_once_enough_frames_came() {
        let (mut p, _) = pair(with(FaultDirection::Receive, |c| c.panic_after = 3));
        p.send_all(&frames(5));
        p.tx.poll(&mut Vec::new()).expect("poll tx");
        let mut events = Vec::new();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = p.rx.poll(&mut events);
        }));
        let message = panicked.expect_err("the poll taking the third frame panics");
        assert_eq!(
            message.downcast_ref::<String>().map(String::as_str),
            Some(INJECTED_PANIC)
        );
        assert_eq!(events.len(), 2, "as it takes the third");
        p.rx.poll(&mut events).expect("once");
        let config =
            FaultConfig::from_options(&[("fault_panic_after".to_string(), "7".to_string())])
                .expect("valid option");
        assert_eq!(config.panic_after, 7);
        assert_eq!(FaultConfig::from_options(&config.to_options()), Ok(config));
    }

    fn closed_reason(events: &[Event], peer: PeerId) -> Vec<CloseReason> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Closed { peer: p, reason } if *p == peer => Some(reason.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn disconnect_on_receive_closes_the_peer_with_an_error() {
        let (mut p, stats) = pair(with(FaultDirection::Receive, |c| c.disconnect = 1.0));
        p.send_all(&frames(5));
        let events = p.pump(3);
        assert!(!events.iter().any(|e| matches!(e, Event::Frame { .. })));
        assert_eq!(
            closed_reason(&events, p.from_tx),
            vec![CloseReason::Error(INJECTED_DISCONNECT.into())],
            "exactly one Closed, with the injected reason"
        );
        assert_eq!(stats.snapshot().receive.disconnected, 1);
        // The sender sees an orderly close.
        p.pump(1);
        assert_eq!(
            closed_reason(&p.tx_log, p.to_rx),
            vec![CloseReason::PeerClosed]
        );
    }

    #[test]
    fn disconnect_on_send_closes_and_refuses_further_sends() {
        let (mut p, stats) = pair(with(FaultDirection::Send, |c| c.disconnect = 1.0));
        p.tx.send(p.to_rx, OutFrame::whole(numbered(0, 4))).unwrap();
        assert!(matches!(
            p.tx.send(p.to_rx, OutFrame::whole(numbered(1, 4))),
            Err(SendError::Closed(_))
        ));
        let mut events = Vec::new();
        p.tx.poll(&mut events).unwrap();
        assert_eq!(
            closed_reason(&events, p.to_rx),
            vec![CloseReason::Error(INJECTED_DISCONNECT.into())]
        );
        assert_eq!(stats.snapshot().send.disconnected, 1);
        let events = p.pump(2);
        assert!(!events.iter().any(|e| matches!(e, Event::Frame { .. })));
        assert_eq!(
            closed_reason(&events, p.from_tx),
            vec![CloseReason::PeerClosed]
        );
    }

    /// Everything the receiver sees, as text, for comparing runs.
    fn trace(config: FaultConfig, n: u32) -> (Vec<String>, FaultStats) {
        let (mut p, stats) = pair(config);
        p.send_all(&frames(n));
        let events = p.pump(12);
        let text = events
            .iter()
            .map(|e| match e {
                Event::Frame { frame, .. } => format!("{frame:?}"),
                other => format!("{other:?}"),
            })
            .collect();
        (text, stats.snapshot())
    }

    fn mixed(direction: FaultDirection, seed: u64) -> FaultConfig {
        FaultConfig {
            seed,
            direction,
            drop: 0.1,
            duplicate: 0.1,
            reorder: 0.1,
            reorder_span: 2,
            delay: 0.1,
            max_delay_polls: 4,
            corrupt: 0.1,
            truncate: 0.1,
            disconnect: 0.0,
            ..FaultConfig::default()
        }
    }

    #[test]
    fn same_seed_same_faults_other_seed_other_faults() {
        for direction in BOTH_WAYS {
            let a = trace(mixed(direction, 42), 300);
            let b = trace(mixed(direction, 42), 300);
            assert_eq!(a, b, "{direction:?}: same seed must replay");
            let c = trace(mixed(direction, 43), 300);
            assert_ne!(a.0, c.0, "{direction:?}: another seed differs");
        }
    }

    #[test]
    fn counters_add_up_with_what_arrived() {
        for direction in BOTH_WAYS {
            let (mut p, stats) = pair(FaultConfig {
                corrupt: 0.0,
                truncate: 0.0,
                ..mixed(direction, 9)
            });
            let sent = frames(1000);
            p.send_all(&sent);
            let got = p.frames(12);
            let c = stats.snapshot().of(direction);
            assert_eq!(c.frames, 1000);
            assert_eq!(got.len() as u64, c.frames - c.dropped + c.duplicated);
            assert!(c.dropped > 50 && c.duplicated > 50 && c.reordered > 50 && c.delayed > 30);
            // Each number arrives as often as the counters say.
            let mut seen = vec![0u32; 1000];
            for frame in &got {
                seen[number(frame) as usize] += 1;
            }
            let missing = seen.iter().filter(|&&n| n == 0).count() as u64;
            let doubled = seen.iter().filter(|&&n| n == 2).count() as u64;
            assert_eq!((missing, doubled), (c.dropped, c.duplicated));
            assert!(seen.iter().all(|&n| n <= 2));
        }
    }

    #[test]
    fn options_round_trip_and_bad_values_are_refused() {
        let config = mixed(FaultDirection::Both, 77);
        assert_eq!(
            FaultConfig::from_options(&config.to_options()).unwrap(),
            config
        );
        let opt = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        assert!(matches!(
            FaultConfig::from_options(&opt("fault_drop", "1.5")),
            Err(FaultConfigError::RateOutOfRange { .. })
        ));
        assert!(matches!(
            FaultConfig::from_options(&opt("fault_drop", "NaN")),
            Err(FaultConfigError::RateOutOfRange { .. })
        ));
        assert!(matches!(
            FaultConfig::from_options(&opt("fault_drop", "often")),
            Err(FaultConfigError::NotANumber { .. })
        ));
        assert!(matches!(
            FaultConfig::from_options(&opt("fault_reorder_span", "0")),
            Err(FaultConfigError::Zero { .. })
        ));
        assert!(matches!(
            FaultConfig::from_options(&opt("fault_direction", "sideways")),
            Err(FaultConfigError::Direction { .. })
        ));
        let err = FaultConfig::from_options(&opt("fault_dorp", "0.1")).unwrap_err();
        assert!(err.to_string().contains("fault_drop"), "{err}");
        // Other options are not ours.
        assert_eq!(
            FaultConfig::from_options(&opt("provider", "efa")).unwrap(),
            FaultConfig::default()
        );
    }

    #[test]
    fn transport_wraps_by_scheme_and_strips_its_options() {
        let mut registry = crate::Registry::with_builtins();
        let faulty = Arc::new(FaultTransport::new(
            Arc::new(MemTransport),
            FaultConfig::default(),
        ));
        registry.register(faulty.clone());
        assert!(registry.schemes().contains(&"faulty+mem"));
        let name = fresh_name();
        let spec = crate::EndpointSpec::parse(&format!("faulty+mem/{name}")).unwrap();
        let config = EndpointConfig {
            options: vec![
                ("fault_seed".into(), "5".into()),
                ("fault_drop".into(), "1.0".into()),
            ],
            ..EndpointConfig::default()
        };
        let mut rx = registry.open(&spec, &config).unwrap();
        assert_eq!(rx.scheme(), "mem", "the wrapped endpoint's scheme");
        let mut tx = MemTransport.open(&EndpointConfig::default()).unwrap();
        let peer = tx.connect(&name).unwrap();
        tx.send(peer, OutFrame::whole(numbered(1, 0))).unwrap();
        let mut events = Vec::new();
        for _ in 0..3 {
            rx.poll(&mut events).unwrap();
        }
        assert!(events.iter().any(|e| matches!(e, Event::Accepted { .. })));
        assert!(!events.iter().any(|e| matches!(e, Event::Frame { .. })));
        assert_eq!(faulty.stats().receive.dropped, 1);

        let bad = EndpointConfig {
            options: vec![("fault_drop".into(), "2".into())],
            ..EndpointConfig::default()
        };
        assert!(registry.open(&spec, &bad).is_err());
    }

    #[test]
    fn readiness_is_the_inner_fd_unless_frames_can_be_held() {
        let open = || MemTransport.open(&EndpointConfig::default()).unwrap();
        let plain = FaultyEndpoint::new(open(), with(FaultDirection::Both, |c| c.drop = 0.5));
        assert!(matches!(plain.readiness(), Readiness::Fd(_)));
        let holding = FaultyEndpoint::new(open(), with(FaultDirection::Both, |c| c.delay = 0.1));
        assert_eq!(holding.readiness(), Readiness::MustPoll);
    }
}
