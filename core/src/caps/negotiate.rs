//! Peer negotiation: the [`Offer`]s two sides exchange in the handshake, the
//! deterministic choice of a reliable and a best-effort link from them, and
//! the [`LinkParams`] that follow from the chosen pair.
//!
//! # The choice
//!
//! Candidates are the schemes of the preference list, in its order, with
//! `tcp` appended when the list does not name it: TCP is the last resort
//! and is always there as the bootstrap channel. Schemes outside the list
//! are never used. For each scheme, every pair of one local and one remote
//! offer of that scheme is checked:
//!
//! - same endpoint type, same provider, same protocol, the same fabric
//!   message header version stated (see [`Offer::mark_fabric_header`]),
//!   and the providers' protocol versions equal (or one of them
//!   unspecified, 0);
//! - a frame limit (see [`LinkParams::frame_limit`]) of at least
//!   [`MIN_FRAME_LIMIT`] bytes.
//!
//! The **reliable** link is the first scheme with a compatible pair of
//! reliable endpoints (RDM, MSG or a socket stream). The **best-effort**
//! link is the first scheme with a compatible pair of datagram endpoints;
//! without one, best-effort traffic rides the reliable link
//! ([`Negotiated::best_effort`] is `None`). Among several compatible pairs
//! of one scheme the ranking is: ordered (`FI_ORDER_SAS` on both) first,
//! then the larger frame limit, then the larger credit window, then a fixed
//! order of the offers' contents. Every rule is a function of the unordered
//! pair of offers, so both sides reach the same choice whatever the order of
//! the offers and whichever side computes it — provided both use the same
//! preference list, which the configuration of a cluster must ensure.
//!
//! Every candidate that is skipped gets a line in [`Negotiated::reasons`].

use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::enums::{EpType, Protocol};
use super::flags::MsgOrder;
use super::info::FabricInfo;

/// The scheme that is always a candidate, last unless the preference list
/// places it.
pub const TCP_SCHEME: &str = "tcp";

/// Largest frame the wire contract can express: a 4-byte length and up to
/// `u32::MAX` bytes after it.
pub const MAX_WIRE_FRAME: u64 = 4 + u32::MAX as u64;

/// A link whose frame limit is below this cannot carry efabus frames
/// usefully (headers plus some payload) and is not chosen.
pub const MIN_FRAME_LIMIT: u64 = 256;

/// Where an offer's `protocol_version` holds the version of efabus's
/// fabric message header (see [`Offer::mark_fabric_header`]); the bits
/// below hold the provider's own version.
const FABRIC_HEADER_SHIFT: u32 = 24;
const PROVIDER_VERSION_MASK: u32 = (1 << FABRIC_HEADER_SHIFT) - 1;

/// What one side can open as a data path, sent in the handshake.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Offer {
    /// Transport scheme: `efa-rdm`, `efa-dgram`, `tcp`, `mem`.
    pub scheme: String,
    /// Endpoint type.
    pub ep_type: EpType,
    /// Provider name (`efa`, `tcp;ofi_rxm`, `efabus-tcp`).
    pub provider: String,
    /// Wire protocol.
    pub protocol: Protocol,
    /// Version of the wire protocol; 0 when unspecified. A fabric offer's
    /// holds the provider's version in its low 24 bits and the version of
    /// efabus's fabric message header in its top byte
    /// ([`Offer::mark_fabric_header`]).
    pub protocol_version: u32,
    /// Largest message, prefix included.
    pub max_msg_size: u64,
    /// Bytes the provider reserves at the head of each buffer
    /// (`FI_MSG_PREFIX`); 0 without that mode.
    pub msg_prefix_size: u64,
    /// Largest message sent with `fi_inject`.
    pub inject_size: u64,
    /// Ordering kept in both directions (tx ∩ rx `msg_order`).
    pub msg_order: MsgOrder,
    /// Bytes of remote CQ data a message may carry.
    pub cq_data_size: u64,
    /// Transmit queue depth.
    pub tx_size: u64,
    /// Receive queue depth.
    pub rx_size: u64,
    /// The endpoint's address, as the transport's `local_addr` gives it.
    pub address: Vec<u8>,
    /// For endpoints that reach only processes of their own host (`shm`),
    /// that host's identity: such a pair is compatible only when both name
    /// the same host. Empty for the others.
    pub host: String,
    /// Largest frame this side sends and takes by rendezvous (a descriptor
    /// sent eagerly, the bytes moved by a one-sided read); 0 when it has no
    /// RMA. Frames up to [`Offer::frame_capacity`] always go eagerly.
    /// One figure covers both roles: an endpoint that offers it both
    /// serves reads of its own frames and issues reads of its peer's (it
    /// asks for FI_READ and FI_REMOTE_READ together, or for neither). No
    /// key size is offered: keys travel as 64 bits in the descriptor, which
    /// holds EFA's 4-byte keys and those of every provider here (one with
    /// longer keys, `mr_key_size` above 8, would need a descriptor of its
    /// own).
    pub rendezvous_max: u64,
    /// The provider's own eager limit where the provider refuses a peer
    /// whose limit differs (`ofi_rxm`, which reads it from the environment
    /// of each process); 0 elsewhere. Such a pair would negotiate a link
    /// the provider then never connects.
    pub provider_eager_limit: u64,
}

/// Longest scheme, provider name and host identity an offer carries, and
/// most ordering names this build does not know (a peer's offer is read
/// before its hello is accepted, and negotiation compares offers field by
/// field: these bound what one costs).
const MAX_OFFER_SCHEME: usize = 32;
const MAX_OFFER_PROVIDER: usize = 64;
const MAX_OFFER_HOST: usize = 255;
const MAX_OFFER_UNKNOWN_ORDERS: usize = 16;

impl Offer {
    /// Whether the offer's text fields are within the bounds above; why
    /// not, otherwise.
    pub fn check_sizes(&self) -> Result<(), String> {
        let texts = [
            ("scheme", self.scheme.len(), MAX_OFFER_SCHEME),
            ("provider", self.provider.len(), MAX_OFFER_PROVIDER),
            ("host", self.host.len(), MAX_OFFER_HOST),
        ];
        for (field, len, max) in texts {
            if len > max {
                return Err(format!("an offer's {field} of {len} bytes; at most {max}"));
            }
        }
        let unknown = self.msg_order.unknown();
        if unknown.len() > MAX_OFFER_UNKNOWN_ORDERS
            || unknown.iter().any(|name| name.len() > MAX_OFFER_PROVIDER)
        {
            return Err(format!(
                "an offer naming {} orderings this build does not know; at most \
                 {MAX_OFFER_UNKNOWN_ORDERS}, of {MAX_OFFER_PROVIDER} bytes each",
                unknown.len()
            ));
        }
        Ok(())
    }

    /// The offer for one info of a transport, under its scheme, reachable at
    /// `address`. The prefix counts only when the info requires
    /// `FI_MSG_PREFIX`.
    pub fn from_info(scheme: impl Into<String>, info: &FabricInfo, address: Vec<u8>) -> Offer {
        let prefix = if info
            .required_mode()
            .contains(&super::flags::Mode::MSG_PREFIX)
        {
            info.ep_attr.msg_prefix_size
        } else {
            0
        };
        Offer {
            scheme: scheme.into(),
            ep_type: info.ep_attr.ep_type.clone(),
            provider: info.fabric_attr.prov_name.clone(),
            protocol: info.ep_attr.protocol.clone(),
            protocol_version: info.ep_attr.protocol_version,
            max_msg_size: info.ep_attr.max_msg_size,
            msg_prefix_size: prefix,
            inject_size: info.tx_attr.inject_size,
            msg_order: info.msg_order(),
            cq_data_size: info.domain_attr.cq_data_size,
            tx_size: info.tx_attr.size,
            rx_size: info.rx_attr.size,
            address,
            host: String::new(),
            rendezvous_max: 0,
            provider_eager_limit: 0,
        }
    }

    /// Marks a fabric offer with the version of the message header its
    /// endpoint writes, in the top byte of `protocol_version` (the
    /// provider's own version keeps the low 24 bits). The offer keeps its
    /// shape, so a peer of a release that does not mark its offers sees a
    /// version other than its own and refuses the pair as well (unless its
    /// provider states none, 0, which it takes for unspecified): two
    /// releases whose fabric messages cannot be read by each other take the
    /// next path both offer at once, with the reason, instead of opening a
    /// link that carries nothing.
    pub fn mark_fabric_header(&mut self, header_version: u8) {
        self.protocol_version = (self.protocol_version & PROVIDER_VERSION_MASK)
            | (u32::from(header_version) << FABRIC_HEADER_SHIFT);
    }

    /// The fabric message header version the offer states (see
    /// [`Offer::mark_fabric_header`]); 0 when it states none.
    pub fn fabric_header(&self) -> u8 {
        (self.protocol_version >> FABRIC_HEADER_SHIFT) as u8
    }

    /// The provider's own protocol version.
    pub fn provider_version(&self) -> u32 {
        self.protocol_version & PROVIDER_VERSION_MASK
    }

    /// Largest frame this side can put in one message: `max_msg_size`
    /// minus the prefix.
    pub fn frame_capacity(&self) -> u64 {
        self.max_msg_size.saturating_sub(self.msg_prefix_size)
    }

    /// A total order over every field, used only to break ties.
    fn canonical_cmp(&self, other: &Offer) -> Ordering {
        let key = |o: &Offer| {
            (
                (
                    o.scheme.clone(),
                    o.ep_type.name().to_string(),
                    o.provider.clone(),
                ),
                (o.protocol.name().to_string(), o.protocol_version),
                (
                    o.max_msg_size,
                    o.msg_prefix_size,
                    o.inject_size,
                    o.cq_data_size,
                ),
                (o.msg_order.bits(), o.msg_order.unknown().to_vec()),
                (o.tx_size, o.rx_size, o.address.clone(), o.host.clone()),
                (o.rendezvous_max, o.provider_eager_limit),
            )
        };
        key(self).cmp(&key(other))
    }
}

impl fmt::Display for Offer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} {} {} v{}",
            self.scheme,
            self.provider,
            self.ep_type,
            self.protocol,
            self.provider_version()
        )?;
        if self.fabric_header() > 0 {
            write!(f, ", efabus header v{}", self.fabric_header())?;
        }
        write!(
            f,
            ", max_msg_size {}, prefix {}, msg_order [{}], tx {}, rx {}",
            self.max_msg_size, self.msg_prefix_size, self.msg_order, self.tx_size, self.rx_size
        )?;
        if self.provider_eager_limit > 0 {
            write!(f, ", provider eager limit {}", self.provider_eager_limit)?;
        }
        f.write_str(")")
    }
}

/// How a link between two chosen offers must be driven.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LinkParams {
    /// Endpoint type of both sides.
    pub ep_type: EpType,
    /// The endpoint type delivers every message or fails.
    pub reliable: bool,
    /// Largest frame (its 4-byte length included) one message may carry:
    /// the smaller of both sides' `max_msg_size - msg_prefix_size`, and never
    /// more than [`MAX_WIRE_FRAME`]. For datagrams it is the per-datagram
    /// limit.
    pub frame_limit: u64,
    /// Bytes to reserve at the head of each posted buffer: the larger of the
    /// two sides' prefixes, so both agree on the layout.
    pub prefix_size: u64,
    /// The link may reorder (no `FI_ORDER_SAS` on one side or both): send
    /// sequence numbers and reorder on receipt.
    pub sequence_and_reorder: bool,
    /// The link cannot carry every frame the wire can express: split frames
    /// above [`Self::frame_limit`].
    pub fragment: bool,
    /// Frames this side may have in flight towards the peer: the smaller of
    /// the local tx queue and the remote rx queue.
    pub send_window: u64,
    /// Frames the peer may have in flight towards this side: the smaller of
    /// the remote tx queue and the local rx queue.
    pub recv_window: u64,
    /// Frames above [`Self::frame_limit`] and up to this many bytes go by
    /// rendezvous (both sides offer it on a reliable link: the smaller of
    /// their `rendezvous_max`); 0 when the link has none.
    pub rendezvous_limit: u64,
}

impl LinkParams {
    /// The parameters for a link between these two offers, seen from the
    /// side that made `local`.
    pub fn between(local: &Offer, remote: &Offer) -> LinkParams {
        let capacity = local.frame_capacity().min(remote.frame_capacity());
        let ordered =
            local.msg_order.contains(&MsgOrder::SAS) && remote.msg_order.contains(&MsgOrder::SAS);
        let reliable = local.ep_type.is_reliable() && remote.ep_type.is_reliable();
        let frame_limit = capacity.min(MAX_WIRE_FRAME);
        let rendezvous = local.rendezvous_max.min(remote.rendezvous_max);
        let rendezvous_limit = if reliable && rendezvous > frame_limit {
            rendezvous.min(MAX_WIRE_FRAME)
        } else {
            0
        };
        LinkParams {
            ep_type: local.ep_type.clone(),
            reliable,
            frame_limit,
            prefix_size: local.msg_prefix_size.max(remote.msg_prefix_size),
            sequence_and_reorder: !ordered,
            fragment: frame_limit.max(rendezvous_limit) < MAX_WIRE_FRAME,
            send_window: local.tx_size.min(remote.rx_size),
            recv_window: remote.tx_size.min(local.rx_size),
            rendezvous_limit,
        }
    }

    /// Largest frame that crosses the link whole: eagerly or by rendezvous.
    pub fn largest_frame(&self) -> u64 {
        self.frame_limit.max(self.rendezvous_limit)
    }

    /// Must a frame of this length be split to cross the link?
    pub fn needs_fragmenting(&self, frame_len: u64) -> bool {
        frame_len > self.largest_frame()
    }

    /// The same link seen from the other side.
    pub fn mirrored(&self) -> LinkParams {
        LinkParams {
            send_window: self.recv_window,
            recv_window: self.send_window,
            ..self.clone()
        }
    }
}

/// One chosen link: the pair of offers and what follows from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Choice {
    /// The transport scheme both offers share.
    pub scheme: String,
    /// This side's offer.
    pub local: Offer,
    /// The peer's offer.
    pub remote: Offer,
    /// How to drive the link.
    pub params: LinkParams,
}

impl Choice {
    fn new(local: &Offer, remote: &Offer) -> Choice {
        Choice {
            scheme: local.scheme.clone(),
            local: local.clone(),
            remote: remote.clone(),
            params: LinkParams::between(local, remote),
        }
    }

    /// The same choice as the peer sees it.
    pub fn mirrored(&self) -> Choice {
        Choice {
            scheme: self.scheme.clone(),
            local: self.remote.clone(),
            remote: self.local.clone(),
            params: self.params.mirrored(),
        }
    }
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.params;
        write!(
            f,
            "{} via {} {}: frame limit {}{}, prefix {}, {}, {}, queues {}/{}",
            self.scheme,
            self.local.provider,
            p.ep_type,
            p.frame_limit,
            Rendezvous(p.reliable.then_some(p.rendezvous_limit)),
            p.prefix_size,
            if p.sequence_and_reorder {
                "sequence and reorder"
            } else {
                "ordered"
            },
            if p.fragment {
                "fragment"
            } else {
                "no fragmenting"
            },
            p.send_window,
            p.recv_window
        )
    }
}

/// A reliable link's rendezvous, as `Choice`'s `Display` shows it after
/// the frame limit (nothing for datagram links, which never have one).
struct Rendezvous(Option<u64>);

impl fmt::Display for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            None => Ok(()),
            Some(0) => write!(f, ", no rendezvous"),
            Some(limit) => write!(f, ", rendezvous (RMA read) up to {limit}"),
        }
    }
}

/// The outcome of negotiation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Negotiated {
    /// The link for reliable traffic.
    pub reliable: Choice,
    /// A datagram link for best-effort traffic; `None` means best-effort
    /// traffic rides the reliable link.
    pub best_effort: Option<Choice>,
    /// Why each skipped candidate was skipped, in preference order.
    pub reasons: Vec<String>,
}

impl fmt::Display for Negotiated {
    /// A report for people: the links chosen, then why each other candidate
    /// was skipped.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "reliable: {}", self.reliable)?;
        match &self.best_effort {
            Some(choice) => writeln!(f, "best-effort: {choice}")?,
            None => writeln!(f, "best-effort: on the reliable link")?,
        }
        for reason in &self.reasons {
            writeln!(f, "  - {reason}")?;
        }
        Ok(())
    }
}

/// No reliable link both sides can use.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("no reliable link both sides can use: {}", .reasons.join("; "))]
pub struct NegotiationError {
    /// Why each candidate was skipped.
    pub reasons: Vec<String>,
}

/// Which endpoint types a pass looks for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Reliable,
    BestEffort,
}

impl Class {
    fn label(self) -> &'static str {
        match self {
            Class::Reliable => "reliable",
            Class::BestEffort => "best-effort",
        }
    }

    fn admits(self, ep_type: &EpType) -> bool {
        match self {
            Class::Reliable => ep_type.is_reliable(),
            Class::BestEffort => ep_type.is_datagram(),
        }
    }
}

/// Choose the reliable and best-effort links for two sides' offers. See the
/// module docs for the rules.
pub fn negotiate<S: AsRef<str>>(
    local: &[Offer],
    remote: &[Offer],
    preference: &[S],
) -> Result<Negotiated, NegotiationError> {
    let order = candidate_schemes(preference);
    let mut reasons = Vec::new();

    let offered: BTreeSet<&str> = local
        .iter()
        .chain(remote)
        .map(|o| o.scheme.as_str())
        .collect();
    for scheme in &offered {
        if !order.iter().any(|s| s == scheme) {
            reasons.push(format!("{scheme}: not in the preference list"));
        }
    }

    let reliable = run_pass(Class::Reliable, local, remote, &order, &mut reasons);
    let Some(reliable) = reliable else {
        return Err(NegotiationError { reasons });
    };
    let best_effort = run_pass(Class::BestEffort, local, remote, &order, &mut reasons);
    if best_effort.is_none() {
        reasons.push(format!(
            "best-effort: no datagram link both sides can use; carried on the reliable link ({})",
            reliable.scheme
        ));
    }
    Ok(Negotiated {
        reliable,
        best_effort,
        reasons,
    })
}

/// The preference list without repeats, with `tcp` last if it is missing.
fn candidate_schemes<S: AsRef<str>>(preference: &[S]) -> Vec<String> {
    let mut order: Vec<String> = Vec::new();
    for scheme in preference {
        let scheme = scheme.as_ref();
        if !order.iter().any(|s| s == scheme) {
            order.push(scheme.to_string());
        }
    }
    if !order.iter().any(|s| s == TCP_SCHEME) {
        order.push(TCP_SCHEME.to_string());
    }
    order
}

/// One pass over the candidate schemes for one class of endpoint.
fn run_pass(
    class: Class,
    local: &[Offer],
    remote: &[Offer],
    order: &[String],
    reasons: &mut Vec<String>,
) -> Option<Choice> {
    let label = class.label();
    let mut chosen: Option<Choice> = None;
    for scheme in order {
        let mine: Vec<&Offer> = local.iter().filter(|o| &o.scheme == scheme).collect();
        let theirs: Vec<&Offer> = remote.iter().filter(|o| &o.scheme == scheme).collect();
        let mine_fit: Vec<&Offer> = mine
            .iter()
            .copied()
            .filter(|o| class.admits(&o.ep_type))
            .collect();
        let theirs_fit: Vec<&Offer> = theirs
            .iter()
            .copied()
            .filter(|o| class.admits(&o.ep_type))
            .collect();

        if class == Class::BestEffort && mine_fit.is_empty() && theirs_fit.is_empty() {
            // Schemes without datagram endpoints are not best-effort
            // candidates at all; saying so for each would be noise.
            continue;
        }
        if mine.is_empty() || theirs.is_empty() {
            let who = match (mine.is_empty(), theirs.is_empty()) {
                (true, true) => "offered by neither side",
                (true, false) => "not offered by this side",
                _ => "not offered by the peer",
            };
            reasons.push(format!("{label}: {scheme}: {who}"));
            continue;
        }
        if mine_fit.is_empty() || theirs_fit.is_empty() {
            let types: BTreeSet<String> = mine
                .iter()
                .chain(&theirs)
                .filter(|o| !class.admits(&o.ep_type))
                .map(|o| o.ep_type.name().to_string())
                .collect();
            let kind = match class {
                Class::Reliable => "reliable",
                Class::BestEffort => "datagram",
            };
            let types: Vec<String> = types.into_iter().collect();
            reasons.push(format!(
                "{label}: {scheme}: {} is not a {kind} endpoint type",
                types.join(", ")
            ));
            continue;
        }

        let mut problems: BTreeSet<String> = BTreeSet::new();
        let mut best: Option<(&Offer, &Offer)> = None;
        for l in &mine_fit {
            for r in &theirs_fit {
                match compatible(l, r) {
                    Err(problem) => {
                        problems.insert(problem);
                    }
                    Ok(()) => {
                        let better = match best {
                            None => true,
                            Some((bl, br)) => rank(l, r, bl, br) == Ordering::Greater,
                        };
                        if better {
                            best = Some((l, r));
                        }
                    }
                }
            }
        }
        match (best, &chosen) {
            (None, _) => {
                let problems: Vec<String> = problems.into_iter().collect();
                reasons.push(format!("{label}: {scheme}: {}", problems.join("; ")));
            }
            (Some(_), Some(already)) => {
                reasons.push(format!(
                    "{label}: {scheme}: usable, but {} comes first in the preference list",
                    already.scheme
                ));
            }
            (Some((l, r)), None) => chosen = Some(Choice::new(l, r)),
        }
    }
    chosen
}

/// Can these two offers form a link? `Err` says why not.
fn compatible(local: &Offer, remote: &Offer) -> Result<(), String> {
    if local.ep_type != remote.ep_type {
        return Err(format!(
            "endpoint types differ ({} here, {} at the peer)",
            local.ep_type, remote.ep_type
        ));
    }
    if local.provider != remote.provider {
        return Err(format!(
            "providers differ ({} here, {} at the peer)",
            local.provider, remote.provider
        ));
    }
    if local.protocol != remote.protocol {
        return Err(format!(
            "protocols differ ({} here, {} at the peer)",
            local.protocol, remote.protocol
        ));
    }
    if local.fabric_header() != remote.fabric_header() {
        let stated = |version: u8| match version {
            0 => "none stated (an older efabus)".to_string(),
            version => format!("version {version}"),
        };
        return Err(format!(
            "efabus fabric message headers differ ({} here, {} at the peer): only peers that \
             state the same version are paired on the fabric; run the same efabus release on \
             both sides",
            stated(local.fabric_header()),
            stated(remote.fabric_header())
        ));
    }
    let (here, there) = (local.provider_version(), remote.provider_version());
    if here != there && here != 0 && there != 0 {
        return Err(format!(
            "protocol versions differ ({here} here, {there} at the peer)"
        ));
    }
    if local.host != remote.host {
        return Err(format!(
            "reaches only its own host, and the peer is on another ({} here, {} at the peer)",
            or_unknown(&local.host),
            or_unknown(&remote.host)
        ));
    }
    if local.provider_eager_limit != remote.provider_eager_limit {
        return Err(format!(
            "the provider's eager limits differ ({} here, {} at the peer) and it refuses \
             such a pair: give FI_OFI_RXM_EAGER_LIMIT (and FI_OFI_RXM_BUFFER_SIZE) the same \
             value on both sides",
            local.provider_eager_limit, remote.provider_eager_limit
        ));
    }
    let limit = local.frame_capacity().min(remote.frame_capacity());
    if limit < MIN_FRAME_LIMIT {
        return Err(format!(
            "frame limit {limit} is below the minimum of {MIN_FRAME_LIMIT}"
        ));
    }
    Ok(())
}

fn or_unknown(host: &str) -> &str {
    if host.is_empty() {
        "unknown"
    } else {
        host
    }
}

/// Compare pair (a1, a2) with pair (b1, b2); greater is better. Symmetric in
/// each pair's two offers, so the side computing it does not matter.
fn rank(a1: &Offer, a2: &Offer, b1: &Offer, b2: &Offer) -> Ordering {
    let ordered = |x: &Offer, y: &Offer| {
        x.msg_order.contains(&MsgOrder::SAS) && y.msg_order.contains(&MsgOrder::SAS)
    };
    let limit = |x: &Offer, y: &Offer| x.frame_capacity().min(y.frame_capacity());
    let window = |x: &Offer, y: &Offer| x.tx_size.min(y.rx_size).min(y.tx_size.min(x.rx_size));
    ordered(a1, a2)
        .cmp(&ordered(b1, b2))
        .then(limit(a1, a2).cmp(&limit(b1, b2)))
        .then(window(a1, a2).cmp(&window(b1, b2)))
        // Last resort: prefer the pair whose offers sort first, comparing
        // each pair as (smaller offer, larger offer).
        .then_with(|| {
            let (a_lo, a_hi) = sorted_pair(a1, a2);
            let (b_lo, b_hi) = sorted_pair(b1, b2);
            b_lo.canonical_cmp(a_lo)
                .then_with(|| b_hi.canonical_cmp(a_hi))
        })
}

fn sorted_pair<'a>(x: &'a Offer, y: &'a Offer) -> (&'a Offer, &'a Offer) {
    if x.canonical_cmp(y) == Ordering::Greater {
        (y, x)
    } else {
        (x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(scheme: &str, ep_type: EpType, max: u64) -> Offer {
        Offer {
            scheme: scheme.into(),
            ep_type,
            provider: "p".into(),
            max_msg_size: max,
            tx_size: 64,
            rx_size: 128,
            ..Offer::default()
        }
    }

    #[test]
    fn same_host_schemes_need_both_sides_on_one_host() {
        let shm = |host: &str| Offer {
            host: host.into(),
            ..offer("shm", EpType::Rdm, 65536)
        };
        let rdm = offer("efa-rdm", EpType::Rdm, 8192);
        let preference = ["shm", "efa-rdm"];
        let here = [shm("node-a"), rdm.clone()];
        let chosen = negotiate(&here, &[shm("node-a"), rdm.clone()], &preference).unwrap();
        assert_eq!(chosen.reliable.local.scheme, "shm");
        let chosen = negotiate(&here, &[shm("node-b"), rdm.clone()], &preference).unwrap();
        assert_eq!(chosen.reliable.local.scheme, "efa-rdm");
        assert!(
            chosen
                .reasons
                .iter()
                .any(|r| r.contains("shm") && r.contains("node-a here, node-b at the peer")),
            "{:?}",
            chosen.reasons
        );
        let chosen = negotiate(&here, &[shm(""), rdm], &preference).unwrap();
        assert_eq!(chosen.reliable.local.scheme, "efa-rdm", "an unknown host");
    }

    #[test]
    fn providers_that_refuse_other_eager_limits_are_not_paired_across_them() {
        let rxm = |limit: u64| Offer {
            provider: "tcp;ofi_rxm".into(),
            provider_eager_limit: limit,
            ..offer("efa-rdm", EpType::Rdm, 16384)
        };
        let tcp = offer("tcp", EpType::Msg, u64::MAX);
        let preference = ["efa-rdm", "tcp"];
        let here = [rxm(16384), tcp.clone()];
        let chosen = negotiate(&here, &[rxm(16384), tcp.clone()], &preference).unwrap();
        assert_eq!(chosen.reliable.local.scheme, "efa-rdm");
        let chosen = negotiate(&here, &[rxm(32768), tcp], &preference).unwrap();
        assert_eq!(chosen.reliable.local.scheme, "tcp");
        assert!(
            chosen.reasons.iter().any(|r| r.contains("efa-rdm")
                && r.contains("16384 here, 32768 at the peer")
                && r.contains("FI_OFI_RXM_EAGER_LIMIT")),
            "{:?}",
            chosen.reasons
        );
    }

    #[test]
    fn tcp_is_appended_once() {
        assert_eq!(candidate_schemes::<&str>(&[]), ["tcp"]);
        let pref = ["efa-rdm", "tcp", "efa-rdm", "mem"];
        assert_eq!(candidate_schemes(&pref), ["efa-rdm", "tcp", "mem"]);
    }

    #[test]
    fn params_between_two_offers() {
        let mut a = offer("x", EpType::Dgram, 8928);
        a.msg_prefix_size = 40;
        let mut b = offer("x", EpType::Dgram, 9000);
        b.tx_size = 16;
        let p = LinkParams::between(&a, &b);
        assert_eq!(p.frame_limit, 8888);
        assert_eq!(p.prefix_size, 40);
        assert!(p.fragment && p.sequence_and_reorder && !p.reliable);
        assert_eq!((p.send_window, p.recv_window), (64, 16));
        assert_eq!(LinkParams::between(&b, &a), p.mirrored());
        assert!(p.needs_fragmenting(8889) && !p.needs_fragmenting(8888));
    }

    #[test]
    fn unbounded_link_needs_no_fragmenting() {
        let mut a = offer("tcp", EpType::Msg, u64::MAX);
        a.msg_order = MsgOrder::SAS;
        let p = LinkParams::between(&a, &a);
        assert_eq!(p.frame_limit, MAX_WIRE_FRAME);
        assert!(!p.fragment && !p.sequence_and_reorder && p.reliable);
    }

    #[test]
    fn incompatible_pairs_say_why() {
        let a = offer("x", EpType::Rdm, 1 << 20);
        let mut b = a.clone();
        b.provider = "q".into();
        assert!(compatible(&a, &b).unwrap_err().contains("providers differ"));
        let mut c = a.clone();
        c.protocol_version = 3;
        let mut d = a.clone();
        d.protocol_version = 4;
        assert!(compatible(&c, &d).unwrap_err().contains("versions"));
        assert!(compatible(&a, &d).is_ok(), "version 0 is unspecified");
        let tiny = offer("x", EpType::Rdm, 100);
        assert!(compatible(&a, &tiny)
            .unwrap_err()
            .contains("below the minimum"));
    }

    #[test]
    fn fabric_offers_pair_only_with_the_same_message_header() {
        let mut unmarked = offer("efa-rdm", EpType::Rdm, 1 << 20);
        unmarked.protocol_version = 4;
        let mut six = unmarked.clone();
        six.mark_fabric_header(6);
        assert_eq!((six.fabric_header(), six.provider_version()), (6, 4));
        assert!(six.to_string().contains("v4, efabus header v6"), "{six}");
        assert!(compatible(&six, &six.clone()).is_ok());

        let mut seven = unmarked.clone();
        seven.mark_fabric_header(7);
        let reason = compatible(&six, &seven).unwrap_err();
        assert!(
            reason.contains("headers differ (version 6 here, version 7 at the peer)"),
            "{reason}"
        );
        // A release that marks nothing: the same provider version is no
        // match, from either side.
        let reason = compatible(&six, &unmarked).unwrap_err();
        assert!(
            reason.contains("none stated (an older efabus) at the peer"),
            "{reason}"
        );
        assert!(compatible(&unmarked, &six).is_err());

        // A provider that states no version of its own (libfabric's `udp`)
        // leaves the header to decide.
        let mut udp = unmarked.clone();
        udp.protocol_version = 0;
        let mut udp_six = udp.clone();
        udp_six.mark_fabric_header(6);
        assert!(compatible(&udp_six, &udp).is_err());
        assert!(
            compatible(&udp_six, &six).is_ok(),
            "provider version 0 is unspecified"
        );

        // Marking keeps the provider's version, and the provider's
        // versions still decide for equal headers.
        let mut other_provider = unmarked.clone();
        other_provider.protocol_version = 5;
        other_provider.mark_fabric_header(6);
        let reason = compatible(&six, &other_provider).unwrap_err();
        assert!(
            reason.contains("protocol versions differ (4 here, 5 at the peer)"),
            "{reason}"
        );
    }
}
