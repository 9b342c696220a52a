//! Data links: the fabric paths a session negotiates beside its control
//! link. A [`DataLink`] drives one negotiated link (libfabric RDM or DGRAM)
//! with the core link layer (sequencing, fragmentation, reordering) and
//! credit-based flow control in front of the endpoint; [`DataLinks`] holds
//! a session's pair (reliable and best-effort), opens them from both
//! sides' offers, and hands received messages and credits to the right one.
//! Client sessions, the broker's sessions and routes all use this module.
//!
//! The control link (TCP or mem) that carried the handshake stays open; it
//! carries everything for peers without a common fabric.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::caps::{negotiate, Choice, Offer};
use efabus_core::codec::{self, FrameKind, FRAME_OVERHEAD, PREFIX_LEN};
use efabus_core::credit::{CreditGrant, CreditWindow, Window};
use efabus_core::fragment::Fragmenter;
use efabus_core::frame::LinkAuth;
use efabus_core::frame::{Credit, Frame};
use efabus_core::link::{LinkConfig, LinkError, LinkReceiver, LinkSender, LinkTuning};
use efabus_core::transport::{
    split_run_slices, Detacher, Endpoint, LinkKeys, OutFrame, PeerId, SendError, TransportError,
};
use thiserror::Error;
use tracing::warn;

use super::link_auth::{random_u64, HandshakeRole, LinkSecret, ReopenRoot};
use super::outbound::Control;
use crate::endpoints;

/// Why a data link could not open or send.
#[derive(Debug, Error)]
pub enum DataLinkError {
    /// The peer's fabric address was refused by the endpoint.
    #[error("{scheme}: cannot add the peer's address: {source}")]
    Address {
        scheme: String,
        #[source]
        source: TransportError,
    },
    /// The link's keys could not be agreed.
    #[error("{scheme}: {source}")]
    Keys {
        scheme: String,
        #[source]
        source: super::link_auth::LinkAuthError,
    },
    /// The negotiated parameters leave the link layer unusable.
    #[error("{scheme}: unusable link parameters: {source}")]
    Parameters {
        scheme: String,
        #[source]
        source: LinkError,
    },
    /// The link layer could not turn a frame into wire messages.
    #[error("{scheme}: {source}")]
    Prepare {
        scheme: String,
        #[source]
        source: LinkError,
    },
    /// The endpoint failed a send for another reason than a full queue.
    #[error("{scheme}: {source}")]
    Send {
        scheme: String,
        #[source]
        source: SendError,
    },
}

/// What happened to a frame handed to [`DataLink::send`].
pub(crate) enum Sent {
    /// On its way (possibly waiting in the link's backlog, or on a lossy
    /// link for credit).
    Accepted,
    /// The reliable link is full; the frame is handed back untouched.
    Blocked(OutFrame),
    /// The reliable link failed on pieces of earlier frames before it took
    /// this one, which is handed back untouched (to be counted with what
    /// is queued, not lost unseen).
    Failed(OutFrame, DataLinkError),
}

/// Pings a data link sends to ask for its proof (the first when the
/// peer's first data message arrives, then one per heartbeat) before its
/// session is ended.
pub(crate) const MAX_CHALLENGES: u32 = 3;

/// Which links [`DataLinks::send_challenges`] asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ask {
    /// This one, for the first time.
    First(LinkKind),
    /// Those asked before and not answered yet.
    Again,
}

/// Links whose proof [`DataLinks::send_challenges`] asked for in vain.
#[derive(Default)]
pub(crate) struct Unanswered {
    /// The best-effort link given up for it, closed (as
    /// [`DataLinks::close_best_effort`]).
    pub best_effort_given_up: Option<Closed>,
    /// A link the session cannot do without went unanswered.
    pub session_ends: bool,
}

/// Whether the peer has shown that it receives at the address it gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proof {
    /// Shown, or not asked for: the side that dialed trusts the address
    /// the accepting side gave over the control link it chose to reach.
    Proven,
    /// A `Ping` with `nonce` went to the address `asked` times and its
    /// `Pong` has not come back yet. Until it does, nothing else is sent
    /// there: a peer naming someone else's address must not turn the
    /// broker into a sender of traffic at that victim. The ping waits for
    /// the peer's first message on a data link, which shows the peer has
    /// set up its side of the link: a message arriving before that would be
    /// dropped there, a gap in the reliable link's sequence.
    Awaiting { nonce: u64, asked: u32 },
}

/// Bytes of frames a lossy link keeps waiting for credit; beyond it the
/// oldest are dropped. A few credit windows of the largest datagram
/// links, so a burst rides out a round trip of credits.
pub(crate) const PACED_MAX_BYTES: usize = 4 << 20;

/// One negotiated link to one peer over a data endpoint.
pub(crate) struct DataLink {
    /// Index of the endpoint in the owner's endpoint list.
    pub endpoint: usize,
    pub peer: PeerId,
    /// The peer's address on the endpoint.
    pub address: Vec<u8>,
    pub proof: Proof,
    pub scheme: String,
    pub lossy: bool,
    pub description: String,
    sender: LinkSender,
    receiver: LinkReceiver,
    /// What the peer still lets this side send.
    window: CreditWindow,
    /// What this side tells the peer it may send.
    grant: CreditGrant,
    /// Lossy links: since when a frame has found the window full.
    stalled_since: Option<Instant>,
    /// Lossy links: how long the window may stay full without a credit
    /// before it is reset (the receiver has given those frames up by then).
    stall_reset: Duration,
    /// Wire pieces already numbered but refused by the endpoint, the last
    /// of each frame with the frame's sequence: they must go before
    /// anything else, and are never dropped (but for the rest of a frame
    /// whose piece failed).
    backlog: VecDeque<(OutFrame, Option<u64>)>,
    /// Lossy links: frames waiting for credit, in order, at most
    /// [`PACED_MAX_BYTES`] of them (the oldest give way, counted in
    /// `dropped`). A datagram sender paces to what the receiver has
    /// posted rather than dropping what finds the window full.
    paced: VecDeque<OutFrame>,
    paced_bytes: usize,
    /// Copies the small bodies that would keep a larger buffer alive while
    /// they wait for credit (a message's payload sliced from a publisher's
    /// read buffer): the bound counts frame bytes.
    paced_detacher: Detacher,
    /// Most bytes of whole frames one [`Frame::Run`] carries here: a run
    /// crosses in one eager piece, never by rendezvous or in fragments.
    run_limit: usize,
    /// Reliable links: the runs sent and not acknowledged, by sequence,
    /// with the frames each holds beyond the one the window counts.
    runs_in_flight: VecDeque<(u64, u64)>,
    /// Lossy links: frames dropped on this side (given way while waiting
    /// for credit, or waiting when a send failed).
    pub dropped: u64,
    /// Lossy links: frames whose send failed before any piece of them
    /// went, since a piece of a later one or a probe last went to the
    /// endpoint: nothing may show the peer their gap, so the link's
    /// closing counts them (see [`Self::failed`]).
    failed_at_tail: u64,
    /// Some pieces of the frame at the head of the backlog went already.
    head_started: bool,
    /// How many of `dropped` [`DataLinks::take_best_effort_drops`] told.
    dropped_told: u64,
    /// How many of the receiver's lost messages
    /// [`DataLinks::take_best_effort_lost`] told.
    lost_told: u64,
    /// Credits sent to the peer.
    pub credits_out: u64,
    credit_waits_reported: u64,
    /// Credit and probe frames that did not decode on a lossy link, since
    /// [`DataLinks::take_bad_link_frames`] last took them: ignored, a later
    /// credit or probe carrying what they would have said.
    bad_link_frames: u64,
    /// Runs that did not open on a lossy link, dropped and counted as lost
    /// (one each: what they held cannot be known).
    bad_runs: u64,
    /// Whether anything came back from the peer since this side first sent
    /// (see [`DataLink::silent_since`]).
    contact: Contact,
    /// A credit came from the peer: it has taken this side's address
    /// (an accepting side sends none before the proof).
    credited: bool,
    /// A dialer's datagram link: frames wait for the peer's first credit
    /// (see [`DataLinks::tend_best_effort`]).
    awaits_credit: bool,
    /// Lossy links: how far the peer's credits confirm what was sent.
    confirmed: Confirmed,
    /// Lossy links: the rest of a frame of more pieces than the window,
    /// sent a window at a time.
    trickle: Option<Trickle>,
    /// Whether the session's best effort rides this link yet.
    pub(crate) switch: Switch,
}

/// Whether a best-effort link carries the session's best effort. The link
/// opened with the session does from its opening (its frames wait on it
/// for its proof or credit, none having gone another way). A link opened
/// again later finds best effort on the reliable path: it takes none
/// until it is usable (so a path still dead costs nothing but its
/// pings), and then none goes on it before what went the reliable way
/// has arrived (a later message could otherwise overtake an earlier one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Switch {
    /// It carries best effort.
    Carrying,
    /// Opened again, not usable yet: best effort goes the reliable way.
    Opening,
    /// Usable: a `Ping` with `nonce` went the reliable way, at `since`,
    /// behind what best effort sent there, and best effort waits on the
    /// link (within its paced bound) for its `Pong`.
    Barrier { nonce: u64, since: Instant },
}

/// The pieces of a frame larger than a lossy link's window still to send:
/// datagrams beyond the receiver's posted buffers would be lost, so the
/// frame (sent alone) goes out as far as the receiver's credits say it
/// holds of it (see [`CreditGrant::note_partial`]).
///
/// [`CreditGrant::note_partial`]: efabus_core::credit::CreditGrant::note_partial
#[derive(Debug)]
struct Trickle {
    /// The frame's sequence: a credit acknowledging it (delivered or
    /// given up) ends the trickle.
    seq: u64,
    pieces: VecDeque<OutFrame>,
    /// Pieces handed to the endpoint so far.
    sent: u64,
    /// Pieces the peer's credits allow beyond what they acknowledge.
    granted: u64,
}

/// Lossy links: what the peer's credits confirm of what this side sent. A
/// datagram link may stop delivering once in use (a path or device gone
/// quiet) while its session lives on: the receiver, hearing nothing, sees
/// no gap to count, and the sender's window, reset when it stays full,
/// sends into the void again and again. Frames left unconfirmed for a
/// while are followed by a probe there (a ping outside the sequence,
/// saying how far this side sent): a live receiver answers it (a `Pong`,
/// even while it holds its credits back) and settles what it lacks up to
/// there (counting it lost), which its next credit acknowledges; a link
/// whose probes go unanswered is given up, and the peer, told how far
/// this side sent, counts what it lacks of that ([`GiveUp`]).
#[derive(Debug, Default)]
struct Confirmed {
    /// Highest sequence a credit acknowledged.
    through: u64,
    /// Since when frames sent have gone unconfirmed: the last credit or
    /// answered ping, if frames were left unconfirmed, or the first send
    /// after it. `None` when all are confirmed.
    waiting_since: Option<Instant>,
    /// Pings sent since then, the latest one's nonce, and when the first
    /// and the latest went.
    probes: u32,
    probe_nonce: u64,
    first_probe: Option<Instant>,
    last_probe: Option<Instant>,
}

/// Unanswered pings after which [`DataLinks::probe_best_effort`] gives a
/// datagram link up.
pub(crate) const MAX_PROBES: u32 = 3;

/// What a link has heard from its peer since it first sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contact {
    /// Nothing sent yet.
    Unsent,
    /// Sent at this time, and nothing received since the link opened.
    SentAt(Instant),
    /// Something arrived from the peer.
    Heard,
}

/// The flow-control windows of a link: what this side may send and what it
/// grants the peer, in pieces and in bytes (at most half the memory either
/// may hold back for reordering and reassembly). On a lossy link the piece
/// window is the negotiated queue size (the peer's posted receives), as a
/// datagram beyond them is lost, within [`LinkConfig::piece_limit`]. On a
/// reliable link it is that limit. Pieces are
/// packed many to a message, and the endpoint's share of send slots per
/// peer already bounds the messages in flight, so a window of posted
/// receives would only stall small frames (it held 16-byte messages over
/// `tcp;ofi_rxm` to 381k/s here, against 548k/s without; twice the slots
/// rather than once took them from about 690k/s to 800k/s).
/// Until its first credit a sender assumes the window it would grant
/// itself: both sides run the same `LinkTuning` defaults (the reorder
/// window and reassembly slots are not configurable), except the
/// reassembly memory, which grows with a side's frame limit
/// ([`ReassemblyConfig::for_frames_up_to`]): in bytes a sender assumes
/// what every peer grants at least, half the default.
///
/// [`ReassemblyConfig::for_frames_up_to`]: efabus_core::fragment::ReassemblyConfig::for_frames_up_to
fn windows(config: &LinkConfig, send_window: u64, recv_window: u64) -> (Window, Window) {
    let pieces = |negotiated: u64| {
        let limit = config.piece_limit();
        let wanted = if config.lossy { negotiated } else { limit };
        u32::try_from(wanted.clamp(1, limit)).unwrap_or(u32::MAX)
    };
    let bytes = |max_bytes: usize| (max_bytes as u64 / 2).max(1);
    let least = config
        .reassembly
        .max_bytes
        .min(efabus_core::fragment::ReassemblyConfig::default().max_bytes);
    (
        Window {
            pieces: pieces(send_window),
            bytes: bytes(least),
        },
        Window {
            pieces: pieces(recv_window),
            bytes: bytes(config.reassembly.max_bytes),
        },
    )
}

/// The frames of a [`Frame::Run`] as a data link released it (the run
/// frame whole), or `None` for any other frame.
fn run_body(message: &[u8]) -> Option<&[u8]> {
    if message.get(PREFIX_LEN) != Some(&(FrameKind::Run as u8)) {
        return None;
    }
    message.get(FRAME_OVERHEAD..)
}

/// Where the frames of one message a data link released lie in it: the
/// whole message, or each frame of a run (checked by the link). Reading
/// them in place spares a `Bytes` (two atomic operations) per frame.
pub(crate) fn released_frames(message: &[u8]) -> impl Iterator<Item = Range<usize>> + '_ {
    let mut run = run_body(message).map(split_run_slices);
    let mut whole = run.is_none().then_some(0..message.len());
    std::iter::from_fn(move || match &mut run {
        Some(frames) => {
            let start = FRAME_OVERHEAD + frames.offset();
            frames.next().map(|frame| start..start + frame.len())
        }
        None => whole.take(),
    })
}

/// Replace each run among `released` (messages a data link released) by
/// its frames, as slices of it, for a reader that needs each frame as a
/// `Bytes` of its own. `scratch` is kept between calls.
pub(crate) fn open_released(released: &mut Vec<Bytes>, scratch: &mut Vec<Bytes>) {
    if !released.iter().any(|message| run_body(message).is_some()) {
        return;
    }
    scratch.clear();
    for message in released.drain(..) {
        if run_body(&message).is_some() {
            scratch.extend(released_frames(&message).map(|frames| message.slice(frames)));
        } else {
            scratch.push(message);
        }
    }
    std::mem::swap(released, scratch);
}

impl DataLink {
    /// Insert the peer's address from the chosen offer into the endpoint,
    /// with the keys of the link, and set up both directions of the link
    /// layer.
    pub fn open(
        endpoint_index: usize,
        endpoint: &mut dyn Endpoint,
        choice: &Choice,
        tuning: &LinkTuning,
        keys: &LinkKeys,
        proof: Proof,
    ) -> Result<DataLink, DataLinkError> {
        let address = &choice.remote.address;
        let choice = endpoints::as_driven(choice);
        let mut config = LinkConfig::from_params(&choice.params, endpoint.max_frame(), tuning);
        let eager_limit = config.frame_limit;
        let run_limit = Fragmenter::data_per_fragment(eager_limit)
            .unwrap_or(0)
            .saturating_sub(FRAME_OVERHEAD)
            .min(codec::MAX_RUN_LEN);
        // Frames above the eager limit cross whole by rendezvous where both
        // sides offered it; only larger ones are fragmented.
        let rendezvous = usize::try_from(choice.params.rendezvous_limit)
            .unwrap_or(usize::MAX)
            .min(endpoint.rendezvous_max());
        let by_rendezvous = rendezvous > eager_limit;
        if by_rendezvous {
            config.frame_limit = rendezvous;
        }
        // Before the peer's address goes in: parameters that leave the link
        // layer unusable (a frame limit a peer may offer too small for a
        // fragment) leave nothing behind in the endpoint.
        let sender = LinkSender::new(&config).map_err(|source| DataLinkError::Parameters {
            scheme: choice.scheme.clone(),
            source,
        })?;
        let peer =
            endpoint
                .insert_peer(address, keys)
                .map_err(|source| DataLinkError::Address {
                    scheme: choice.scheme.clone(),
                    source,
                })?;
        endpoint.set_peer_frame_limit(peer, eager_limit);
        if by_rendezvous {
            endpoint.set_peer_rendezvous(peer, rendezvous);
            // A read goes to the address the peer gave: only once proven.
            if proof != Proof::Proven {
                endpoint.hold_reads(peer, true);
            }
        }
        let (send, grant) = windows(
            &config,
            choice.params.send_window,
            choice.params.recv_window,
        );
        let send_ceiling = Window {
            pieces: send.pieces,
            bytes: u64::MAX,
        };
        Ok(DataLink {
            endpoint: endpoint_index,
            peer,
            address: choice.remote.address.clone(),
            proof,
            scheme: choice.scheme.clone(),
            lossy: config.lossy,
            description: choice.to_string(),
            sender,
            receiver: LinkReceiver::new(&config),
            window: CreditWindow::new(send, send_ceiling),
            grant: CreditGrant::new(grant),
            stalled_since: None,
            stall_reset: config.gap_timeout.saturating_mul(4),
            backlog: VecDeque::new(),
            paced: VecDeque::new(),
            paced_bytes: 0,
            paced_detacher: Detacher::strict(),
            run_limit,
            runs_in_flight: VecDeque::new(),
            dropped: 0,
            dropped_told: 0,
            lost_told: 0,
            credits_out: 0,
            credit_waits_reported: 0,
            bad_link_frames: 0,
            failed_at_tail: 0,
            head_started: false,
            bad_runs: 0,
            contact: Contact::Unsent,
            credited: false,
            awaits_credit: false,
            confirmed: Confirmed::default(),
            trickle: None,
            switch: Switch::Carrying,
        })
    }

    /// Send one frame through the link layer: a frame alone, or a `Run`
    /// of `frames` frames (reliable links only). A lossy link that cannot
    /// send it now keeps it for [`pace`](Self::pace) (older waiting frames
    /// may give way to it, counted in `dropped`), also when it returns the
    /// endpoint's error; on a reliable link an error means the link failed
    /// with the frame numbered.
    pub fn send(
        &mut self,
        endpoint: &mut dyn Endpoint,
        frame: OutFrame,
        frames: u64,
    ) -> Result<Sent, DataLinkError> {
        if self.lossy {
            self.wait_for_credit(frame);
            self.pace(endpoint)?;
            return Ok(Sent::Accepted);
        }
        match self.flush(endpoint) {
            Err(err) => return Ok(Sent::Failed(frame, err)),
            Ok(false) => return Ok(Sent::Blocked(frame)),
            Ok(true) if !self.admit(frame.len()) => return Ok(Sent::Blocked(frame)),
            Ok(true) => {}
        }
        // Recorded first: a run whose send fails is lost with the link,
        // and counted with what was in flight when the session ends.
        if frames > 1 {
            let seq = self.sender.next_sequence();
            self.runs_in_flight.push_back((seq, frames - 1));
        }
        self.transmit(endpoint, frame)?;
        Ok(Sent::Accepted)
    }

    /// Lossy links: queue `frame` behind those waiting for credit, the
    /// oldest giving way beyond [`PACED_MAX_BYTES`].
    fn wait_for_credit(&mut self, mut frame: OutFrame) {
        if self.paced.is_empty() {
            // Likely sent at once: the next may follow it in its buffer.
            self.paced_detacher.passed(&frame.body);
        } else {
            self.paced_detacher.settle(&mut frame.body);
        }
        self.paced_bytes += frame.len();
        self.paced.push_back(frame);
        while self.paced_bytes > PACED_MAX_BYTES && self.paced.len() > 1 {
            if let Some(oldest) = self.paced.pop_front() {
                self.paced_bytes -= oldest.len();
                self.dropped += 1;
            }
        }
    }

    /// Lossy links: send the frames waiting for credit, as far as the
    /// window and the endpoint take them.
    pub fn pace(&mut self, endpoint: &mut dyn Endpoint) -> Result<(), DataLinkError> {
        // Pieces the endpoint refused go first, with or without frames
        // behind them (before the link is usable, only pings asking for
        // that are there).
        if !self.flush(endpoint)? || !self.usable() {
            return Ok(());
        }
        self.send_trickle(endpoint)?;
        while let Some(len) = self.paced.front().map(OutFrame::len) {
            if !self.flush(endpoint)? || !self.admit(len) {
                return Ok(());
            }
            let Some(frame) = self.paced.pop_front() else {
                break;
            };
            self.paced_bytes -= frame.len();
            self.transmit(endpoint, frame)?;
        }
        Ok(())
    }

    /// Lossy links: the pieces of a frame larger than the window that the
    /// peer's credits now allow (the frames behind it wait: the window
    /// counts it whole).
    fn send_trickle(&mut self, endpoint: &mut dyn Endpoint) -> Result<(), DataLinkError> {
        let Some(trickle) = self.trickle.as_mut() else {
            return Ok(());
        };
        while trickle.sent < trickle.granted {
            let Some(piece) = trickle.pieces.pop_front() else {
                break;
            };
            match endpoint.send(self.peer, piece) {
                Ok(()) => {
                    trickle.sent += 1;
                    self.failed_at_tail = 0;
                }
                Err(SendError::WouldBlock(piece)) => {
                    trickle.pieces.push_front(piece);
                    return Ok(());
                }
                Err(source) => {
                    // Its first window went.
                    let seq = trickle.seq;
                    self.failed(seq, true);
                    return Err(self.send_error(source));
                }
            }
        }
        if trickle.pieces.is_empty() {
            self.trickle = None;
        }
        Ok(())
    }

    /// Frames sent and not acknowledged yet: a run counts the frames it
    /// holds.
    pub fn frames_in_flight(&self) -> u64 {
        let extra: u64 = self.runs_in_flight.iter().map(|&(_, extra)| extra).sum();
        self.window.frames_in_flight() + extra
    }

    /// Number `frame` and hand its pieces to the endpoint; what the
    /// endpoint refuses waits in the backlog.
    fn transmit(
        &mut self,
        endpoint: &mut dyn Endpoint,
        frame: OutFrame,
    ) -> Result<(), DataLinkError> {
        if self.contact == Contact::Unsent {
            self.contact = Contact::SentAt(Instant::now());
        }
        if self.lossy && self.confirmed.waiting_since.is_none() {
            self.confirmed.waiting_since = Some(Instant::now());
        }
        let seq = self.sender.next_sequence();
        let mut wire = Vec::new();
        if let Err(source) = self.sender.prepare(frame, &mut wire) {
            // Nothing of it went: numbered, it is a gap counted as one lost
            // on the way (see `failed`); not, it is counted here.
            if self.sender.next_sequence() != seq {
                self.failed(seq, false);
            } else if self.lossy {
                self.dropped += 1;
            }
            return Err(DataLinkError::Prepare {
                scheme: self.scheme.clone(),
                source,
            });
        }
        let bytes = wire.iter().map(|piece| piece.len() as u64).sum();
        self.window.sent(seq, wire.len() as u32, bytes);
        let window = self.window.window().pieces as usize;
        if self.lossy && wire.len() > window {
            let rest = wire.split_off(window);
            self.trickle = Some(Trickle {
                seq,
                pieces: rest.into(),
                sent: window as u64,
                granted: window as u64,
            });
        }
        // The backlog is empty here (every caller flushed it first).
        let mut pieces = wire.into_iter();
        let mut started = false;
        while let Some(piece) = pieces.next() {
            match endpoint.send(self.peer, piece) {
                Ok(()) => {
                    started = true;
                    self.failed_at_tail = 0;
                }
                Err(SendError::WouldBlock(piece)) => {
                    self.head_started = started;
                    self.backlog.push_back((piece, None));
                    self.backlog.extend(pieces.map(|piece| (piece, None)));
                    // The last piece queued is its frame's last.
                    if let Some(last) = self.backlog.back_mut() {
                        last.1 = Some(seq);
                    }
                    break;
                }
                Err(source) => {
                    self.failed(seq, started);
                    return Err(self.send_error(source));
                }
            }
        }
        Ok(())
    }

    /// Whether the peer's credit lets `frame` go now. A lossy link whose
    /// credits stopped arriving resets its window after a while: the frames
    /// in flight are lost or given up by the receiver by then.
    fn admit(&mut self, len: usize) -> bool {
        let (pieces, bytes) = self.sender.wire_size(len);
        if self.window.admits(pieces, bytes) {
            self.stalled_since = None;
            return true;
        }
        self.window.note_stall();
        if !self.lossy {
            return false;
        }
        let now = Instant::now();
        let since = *self.stalled_since.get_or_insert(now);
        if now.duration_since(since) < self.stall_reset {
            return false;
        }
        self.window.reset();
        self.stalled_since = None;
        // What was left of a frame sent a window at a time goes no
        // further: the receiver gives it up by now.
        self.trickle = None;
        true
    }

    /// Hand the backlog to the endpoint; true when it is empty. On a
    /// failure the rest of the failed piece's frame goes with it (the peer
    /// could not put it together any more).
    pub fn flush(&mut self, endpoint: &mut dyn Endpoint) -> Result<bool, DataLinkError> {
        while let Some((piece, last)) = self.backlog.pop_front() {
            match endpoint.send(self.peer, piece) {
                Ok(()) => {
                    // The next piece starts a frame after this one's last.
                    self.head_started = last.is_none();
                    self.failed_at_tail = 0;
                }
                Err(SendError::WouldBlock(piece)) => {
                    self.backlog.push_front((piece, last));
                    return Ok(false);
                }
                Err(source) => {
                    let started = std::mem::take(&mut self.head_started);
                    let mut seq = last;
                    while seq.is_none() {
                        let Some((_, last)) = self.backlog.pop_front() else {
                            break;
                        };
                        seq = last;
                    }
                    if let Some(seq) = seq {
                        self.failed(seq, started);
                    }
                    return Err(self.send_error(source));
                }
            }
        }
        Ok(true)
    }

    /// Frames whose last pieces wait in the backlog, but for one some of
    /// whose pieces went (the peer counts that one, holding part of it).
    fn backlog_frames(&self) -> u64 {
        let frames = self.backlog.iter().filter(|(_, last)| last.is_some());
        (frames.count() as u64).saturating_sub(u64::from(self.head_started))
    }

    fn send_error(&self, source: SendError) -> DataLinkError {
        DataLinkError::Send {
            scheme: self.scheme.clone(),
            source,
        }
    }

    /// Bytes waiting in the backlog.
    pub fn backlog_bytes(&self) -> usize {
        self.backlog.iter().map(|(piece, _)| piece.len()).sum()
    }

    /// One message from the endpoint: what it completes goes to `out` in
    /// the sender's order, frames and runs of them (checked, and left
    /// whole: [`released_frames`] reads them, [`open_released`] splits
    /// them). Credits from the peer are taken here and never reach `out`;
    /// a probe (datagram links) goes there at once as the `Ping` the
    /// owner answers, outside that order.
    pub fn receive(
        &mut self,
        now: Instant,
        message: Bytes,
        out: &mut Vec<Bytes>,
    ) -> Result<(), LinkError> {
        self.contact = Contact::Heard;
        if self.lossy && message.get(PREFIX_LEN) == Some(&(FrameKind::Probe as u8)) {
            return match codec::decode(message, &codec::CodecLimits::default()) {
                Ok(Frame::Probe {
                    nonce,
                    sent_through,
                }) => {
                    self.receiver.note_sent_through(sent_through, now);
                    self.grant.ask();
                    // The owner answers it as any ping.
                    out.push(codec::encode(&Frame::Ping { nonce }).to_bytes());
                    Ok(())
                }
                Ok(_) => Ok(()),
                Err(_) => {
                    self.bad_link_frames += 1;
                    Ok(())
                }
            };
        }
        if message.get(PREFIX_LEN) == Some(&(FrameKind::Credit as u8)) {
            return match codec::decode(message, &codec::CodecLimits::default()) {
                Ok(Frame::Credit(credit)) => {
                    self.credited = true;
                    if self.lossy {
                        self.on_lossy_credit(now, &credit);
                    }
                    if self.window.on_credit(&credit) {
                        while self
                            .runs_in_flight
                            .front()
                            .is_some_and(|&(seq, _)| seq <= credit.ack_seq)
                        {
                            self.runs_in_flight.pop_front();
                        }
                    }
                    Ok(())
                }
                // The next credit repairs the window; on a reliable link a
                // mangled message means the link is broken.
                Ok(_) => Ok(()),
                Err(_) if self.lossy => {
                    self.bad_link_frames += 1;
                    Ok(())
                }
                Err(err) => Err(err.into()),
            };
        }
        self.grant.on_received(message.len());
        let before = out.len();
        let result = self.receiver.receive(now, message, out);
        self.note_partial();
        self.check_runs(out, before)?;
        result
    }

    /// Which of a session's links this is: the lossy one carries best
    /// effort.
    fn kind(&self) -> LinkKind {
        if self.lossy {
            LinkKind::BestEffort
        } else {
            LinkKind::Reliable
        }
    }

    /// Whether frames waiting for credit may go: the peer proved its
    /// address (a dialer's link: the peer's first credit came), and a link
    /// opened again has done its [`Switch`]. Until then none goes to an
    /// address not proven, and none sent here is overtaken by one sent
    /// another way meanwhile.
    fn usable(&self) -> bool {
        self.ready() && self.switch == Switch::Carrying
    }

    /// An opened-again link whose peer has proved it and which takes no
    /// best effort yet: what it carries is to move onto it.
    fn ready_to_carry(&self) -> bool {
        self.switch == Switch::Opening && self.ready()
    }

    /// Whether the peer proved its address (a dialer's link: the peer's
    /// first credit came).
    fn ready(&self) -> bool {
        self.proof == Proof::Proven && (self.credited || !self.awaits_credit)
    }

    /// Frames dropped here and not told yet
    /// ([`DataLinks::take_best_effort_drops`]), those numbered and left
    /// in the backlog, and those whose send failed with nothing sent after
    /// them: what the link's closing loses.
    pub fn unsent(&self) -> u64 {
        (self.dropped - self.dropped_told)
            .saturating_add(self.backlog_frames())
            .saturating_add(self.failed_at_tail)
    }

    /// The frames waiting for credit, taken: a link given up before it
    /// became usable sent none of them, so they may go another way in
    /// their order.
    pub fn take_waiting(&mut self) -> VecDeque<OutFrame> {
        self.paced_bytes = 0;
        std::mem::take(&mut self.paced)
    }

    /// On the side that accepted: the peer has sent nothing here yet (so
    /// it was not asked for its address's proof either).
    fn never_heard_from(&self) -> bool {
        matches!(self.proof, Proof::Awaiting { asked: 0, .. })
    }

    /// When this side first sent on the link, while nothing has come back
    /// from the peer since it opened; `None` before the first send and
    /// once anything arrived. A reliable link that stays silent long after
    /// it first sent carries nothing: a broker answers a link's first
    /// message at once (it asks there for proof of the address), but a
    /// provider may refuse the connection underneath without a word
    /// (`ofi_rxm` does between endpoints set up differently).
    pub fn silent_since(&self) -> Option<Instant> {
        match self.contact {
            Contact::SentAt(at) => Some(at),
            Contact::Unsent | Contact::Heard => None,
        }
    }

    /// Most bytes of whole frames [`Self::send`] takes as one run.
    pub fn run_limit(&self) -> usize {
        self.run_limit
    }

    /// Check each run among `out[from..]`, which stays whole (its frames
    /// are read in place, see [`released_frames`]). A run that does not
    /// open fails a reliable link, and what followed it is not released;
    /// on a lossy one it is dropped like a damaged datagram, and counted.
    fn check_runs(&mut self, out: &mut Vec<Bytes>, from: usize) -> Result<(), LinkError> {
        let mut kept = from;
        for at in from..out.len() {
            let checked = match run_body(&out[at]) {
                Some(frames) => codec::check_run(frames).map(|_| ()),
                None => Ok(()),
            };
            match checked {
                Ok(()) => {
                    out.swap(kept, at);
                    kept += 1;
                }
                Err(_) if self.lossy => self.bad_runs += 1,
                Err(err) => {
                    out.truncate(kept);
                    return Err(err.into());
                }
            }
        }
        out.truncate(kept);
        Ok(())
    }

    /// Every sequence up to this one has been delivered or given up.
    fn delivered_through(&self) -> u64 {
        self.receiver
            .expected_sequence()
            .map_or(0, |next| next.saturating_sub(1))
    }

    /// Whether the peer is owed a credit (call [`Self::send_credit`] until
    /// it is not): one that acknowledges more, or on a lossy link the last
    /// one again ([`CreditGrant::repeat_due`]).
    pub fn owes_credit(&self) -> bool {
        let through = self.delivered_through();
        self.grant.owes(through)
            || (self.lossy && self.grant.repeat_due(Instant::now(), through).is_some())
    }

    /// Send the peer a credit if one is due (or at once with `force`).
    /// Credits go straight to the endpoint, outside the link's sequence; a
    /// refused one is simply sent later.
    pub fn send_credit(&mut self, endpoint: &mut dyn Endpoint, now: Instant, force: bool) {
        let through = self.delivered_through();
        let fresh = if force && self.grant.owes(through) {
            Some(self.grant.credit(through))
        } else {
            self.grant.due(now, through)
        };
        let repeat = fresh.is_none() && self.lossy;
        let Some(credit) = fresh.or_else(|| self.grant.repeat_due(now, through).filter(|_| repeat))
        else {
            return;
        };
        if repeat {
            // Tried once, whatever the endpoint says: a repeat is a second
            // chance, not owed.
            self.grant.repeated();
        }
        if endpoint
            .send(self.peer, codec::encode(&Frame::Credit(credit)))
            .is_ok()
        {
            if !repeat {
                self.grant.sent(now, &credit);
            }
            self.credits_out += 1;
        }
    }

    /// Sends that found the credit window full since the last call.
    pub fn take_credit_waits(&mut self) -> u64 {
        let stalls = self.window.stats().stalls;
        let new = stalls - self.credit_waits_reported;
        self.credit_waits_reported = stalls;
        new
    }

    /// Frames and runs released by the passing of time (lossy links), as
    /// [`Self::receive`] releases them; on a reliable link, the failure of
    /// a gap that did not fill in time.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<Bytes>) -> Result<(), LinkError> {
        let before = out.len();
        let result = self.receiver.poll(now, out);
        self.note_partial();
        self.check_runs(out, before)?;
        result
    }

    /// When the link next has something to do by time alone: a gap a
    /// lossy link gives up on, or a reliable link fails on; a lossy link's
    /// last credit to send again.
    pub fn next_deadline(&self) -> Option<Instant> {
        let repeat = self.grant.repeat_at().filter(|_| self.lossy);
        [self.receiver.next_deadline(), repeat]
            .into_iter()
            .flatten()
            .min()
    }

    /// Messages given up on this link (lossy links), as the receiver counts.
    pub fn lost(&self) -> u64 {
        self.receiver.stats().lost.saturating_add(self.bad_runs)
    }

    /// Lossy links: what is held of the next message still arriving goes
    /// into the credits ([`CreditGrant::note_partial`]).
    fn note_partial(&mut self) {
        if self.lossy {
            let (held, count) = if self.receiver.partial_messages() == 0 {
                (0, 0)
            } else {
                self.receiver.next_partial()
            };
            self.grant.note_partial(held, count);
        }
    }

    /// Frames numbered so far (sequences start at 1).
    fn numbered(&self) -> u64 {
        self.sender.next_sequence().saturating_sub(1)
    }

    /// Lossy links: a credit from the peer. It hears this side (a credit
    /// older than the window knows shows that too), and it may end or
    /// grant more of a frame sent a window at a time.
    fn on_lossy_credit(&mut self, now: Instant, credit: &Credit) {
        self.confirm_through(credit.ack_seq);
        self.heard_on_link(now);
        let Some(trickle) = self.trickle.as_mut() else {
            return;
        };
        if credit.ack_seq >= trickle.seq {
            self.trickle = None;
        } else if credit.ack_seq + 1 == trickle.seq && u64::from(credit.messages) > trickle.granted
        {
            // What the peer holds is of the message after `ack_seq`: this
            // one. Going on, it is no stalled window to reset.
            trickle.granted = u64::from(credit.messages);
            self.stalled_since = None;
        }
    }

    /// Lossy links: the peer has settled (delivered, or counted lost)
    /// every frame sent here up to `seq`.
    fn confirm_through(&mut self, seq: u64) {
        let numbered = self.numbered();
        let confirmed = &mut self.confirmed;
        confirmed.through = confirmed.through.max(seq.min(numbered));
    }

    /// The peer hears this link: the pings start over, from `now` if
    /// frames are left unconfirmed.
    fn heard_on_link(&mut self, now: Instant) {
        let unconfirmed = self.numbered() > self.confirmed.through;
        let confirmed = &mut self.confirmed;
        confirmed.waiting_since = unconfirmed.then_some(now);
        confirmed.probes = 0;
        confirmed.first_probe = None;
        confirmed.last_probe = None;
    }

    /// Lossy links: a ping sent ahead of the frames waiting, as a
    /// [`Frame::Probe`] outside the link's sequence (the peer answers it
    /// as a `Ping`): lost, it leaves no gap the peer would count as a lost
    /// message. It tells the peer how far this side sent, so that the
    /// peer settles a lost tail that no later frame reveals. Refused by
    /// the endpoint, it is not sent (each caller pings again in time).
    fn transmit_probe(
        &mut self,
        endpoint: &mut dyn Endpoint,
        nonce: u64,
    ) -> Result<(), DataLinkError> {
        if self.contact == Contact::Unsent {
            self.contact = Contact::SentAt(Instant::now());
        }
        let probe = Frame::Probe {
            nonce,
            sent_through: self.sent_through(),
        };
        endpoint
            .send(self.peer, codec::encode(&probe))
            .map_err(|source| self.send_error(source))?;
        // It shows the peer the gaps of the sends that failed before it.
        self.failed_at_tail = 0;
        Ok(())
    }

    /// The highest sequence of which some pieces went to the endpoint
    /// (a frame sent a window at a time, one whose last pieces wait in
    /// the backlog): those numbered but for the frames wholly in the
    /// backlog. A peer that has nothing of such a frame gives it up (its
    /// credit then ends a trickle); one that holds part of it goes on
    /// taking it.
    fn sent_through(&self) -> u64 {
        let first_waiting = self.backlog.iter().find_map(|&(_, last)| last);
        match first_waiting {
            Some(seq) if !self.head_started => seq.saturating_sub(1),
            Some(seq) => seq,
            None => self.numbered(),
        }
    }

    /// Frame `seq`'s send failed, after some of its pieces went if
    /// `started`: what is left of it goes no further. On a lossy link it
    /// is lost as a datagram lost on the way is, and counted once as
    /// such: by the peer, which holds part of it or learns of it from a
    /// later frame, a probe or this side's notice when the link is given
    /// up ([`GiveUp`]), else by this side when the session ends with
    /// nothing sent after it ([`Self::unsent`]). (Counted as dropped here
    /// as well, it was counted twice.)
    fn failed(&mut self, seq: u64, started: bool) {
        if self.lossy && !started {
            self.failed_at_tail += 1;
        }
        if self
            .trickle
            .as_ref()
            .is_some_and(|trickle| trickle.seq == seq)
        {
            self.trickle = None;
        }
    }

    /// Lossy links: when frames sent will have gone unconfirmed long
    /// enough for the next ping (or, after [`MAX_PROBES`], for the link to
    /// be given up): `stall_reset` after they began to wait, then after
    /// each ping.
    pub fn probe_at(&self) -> Option<Instant> {
        if !self.lossy || !self.usable() {
            return None;
        }
        let since = self.confirmed.waiting_since?;
        self.confirmed
            .last_probe
            .unwrap_or(since)
            .checked_add(self.stall_reset)
    }

    /// Frames sent and not confirmed by any credit, but for what still
    /// waits in the backlog (counted apart, see [`Self::unsent`]).
    fn unconfirmed(&self) -> u64 {
        self.numbered()
            .saturating_sub(self.confirmed.through)
            .saturating_sub(self.backlog_frames())
    }
}

/// Which of a session's data links a message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LinkKind {
    Reliable,
    BestEffort,
}

/// This side's part in agreeing link keys, and the peer's.
pub(crate) struct Keying<'a> {
    pub secret: &'a LinkSecret,
    pub role: HandshakeRole,
    pub peer: &'a LinkAuth,
}

/// The accepting side's switch to the reliable link (when the peer's
/// first message arrives there) waits for the peer to have read what it
/// sent on the control link before: frames sent on the data link
/// afterwards could otherwise be taken before them (a route's unsubscribe
/// before the subscribe it undoes, still in the interest snapshot on
/// TCP). A ping on the control link, behind all of that, is the barrier:
/// its pong comes once the peer has read up to it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Barrier {
    /// Nothing to wait for (or the pong came).
    #[default]
    Passed,
    /// The ping is still to go: the control link took no more for now.
    Unsent(u64),
    /// The ping went; its pong has not come back yet.
    Awaiting(u64),
}

/// A link closed alone ([`DataLinks::close_best_effort`],
/// [`DataLinks::close_unused`]).
pub(crate) struct Closed {
    pub kind: LinkKind,
    pub description: String,
    /// What the peer sent there this side has delivered or counted lost
    /// (best effort: see [`efabus_core::link::LinkReceiver::settled_through`]).
    pub settled_through: u64,
    /// This side's frames that went there, up to this sequence (best
    /// effort: the peer, told so, counts those it lacks).
    pub sent_through: u64,
    /// Its `(endpoint, peer)`.
    pub address: (usize, PeerId),
    /// Best-effort messages from the peer lost with it (as
    /// [`DataLinks::close`] counts them).
    pub lost: u64,
    /// Frames for the peer dropped with it, or on it and not told yet
    /// ([`DataLinks::take_best_effort_drops`]).
    pub unsent: u64,
    /// Frames that waited on it for credit (see [`DataLink::take_waiting`]).
    pub waiting: VecDeque<OutFrame>,
    /// Given up telling the peer ([`GiveUp::Telling`]): the nonce of the
    /// `Ping` the owner sends behind the notice ([`GivenUp::unread`]).
    pub notice_ping: Option<u64>,
}

/// Who counts, when a datagram link is given up, the frames each side
/// sent there that went unconfirmed: some arrived though their credits
/// did not, and only the side that received them can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GiveUp {
    /// This side gives up and tells the peer (a `best-effort closed`
    /// frame) how far it sent ([`Closed::sent_through`]): the peer counts
    /// what it lacks of that, this side none of it (unless the session
    /// ends before the peer shows it read the notice, [`GivenUp::unread`],
    /// or the peer gave its side up at the same time,
    /// [`DataLinks::late_notice`]).
    Telling,
    /// The peer gave up, saying it settled what this side sent up to
    /// `settled_through` and sent up to `sent_through`: this side counts
    /// what it sent beyond the first, and, as lost, what it lacks of the
    /// peer's up to the second.
    Told {
        settled_through: u64,
        sent_through: u64,
    },
    /// The peer's side is gone without a word (the peer opened the link
    /// again): what this side sent unconfirmed is counted here.
    Alone,
}

/// The data links both sides agreed on in one handshake.
pub(crate) struct Negotiation {
    /// This side's offer of each link opened: put in the welcome so the
    /// peer arrives at the same choice. Empty when no data link opened.
    pub opened: Vec<Offer>,
    /// A link chosen could not open here (another may have opened in its
    /// place): when none opened, the peer must not be offered the data
    /// paths (it would open its side and send where nobody reads).
    pub failed: bool,
    /// Why candidates were skipped or links could not open, for reports.
    pub reasons: Vec<String>,
}

/// Opens `choice` on `endpoint` (at `index`) under keys derived for it,
/// asking the peer to prove its address when this side accepted.
fn open_keyed(
    endpoint: &mut dyn Endpoint,
    index: usize,
    choice: &Choice,
    tuning: &LinkTuning,
    keying: &Keying<'_>,
) -> Result<DataLink, DataLinkError> {
    let keys = keying
        .secret
        .keys(keying.role, keying.peer, &choice.scheme)
        .map_err(|source| DataLinkError::Keys {
            scheme: choice.scheme.clone(),
            source,
        })?;
    let proof = first_proof(keying.role, &choice.scheme)?;
    DataLink::open(index, endpoint, choice, tuning, &keys, proof)
}

/// A new link's proof: the side that accepted checks the address it was
/// given.
fn first_proof(role: HandshakeRole, scheme: &str) -> Result<Proof, DataLinkError> {
    Ok(match role {
        HandshakeRole::Dialer => Proof::Proven,
        HandshakeRole::Acceptor => Proof::Awaiting {
            nonce: random_u64().map_err(|source| DataLinkError::Keys {
                scheme: scheme.to_string(),
                source,
            })?,
            asked: 0,
        },
    })
}

/// Most times a dialer's wait to open a given-up datagram link again
/// doubles ([`DataLinks::reopen_due`]): at most 64 times its first.
const REOPEN_DOUBLINGS_MAX: u32 = 6;

/// Least time between two reopenings the accepting side does for its
/// peer ([`DataLinks::admit_reopen`]); a dialer waits its connect (a
/// route: handshake) timeout or longer, growing while its tries fail.
pub(crate) const REOPEN_MIN_INTERVAL: Duration = Duration::from_secs(1);

/// How long after a reopening its dialer's first ping goes
/// ([`DataLinks::tend_best_effort`]).
const REOPEN_FIRST_PING_AFTER: Duration = Duration::from_millis(50);

/// How far past the last epoch a peer may ask to reopen in: a dialer
/// counts each of its tries, the accepting side sees those that reached
/// it.
const REOPEN_EPOCHS_AHEAD: u32 = 64;

/// What the best-effort link needs to open again after it was given up
/// ([`DataLinks::reopen_best_effort`]), kept from the handshake.
pub(crate) struct Reopening {
    root: ReopenRoot,
    choice: Choice,
    tuning: LinkTuning,
    /// The epoch of the link opened last (0: the handshake's).
    epoch: u32,
    /// On the dialing side: since when the link has been closed, and the
    /// tries since best effort last rode a reopened link.
    closed_at: Option<Instant>,
    tries: u32,
    /// On the accepting side: when the peer last had it opened again.
    reopened_at: Option<Instant>,
}

impl Reopening {
    /// A link negotiated as `choice` with `tuning`, keyed again from
    /// `root`.
    pub(crate) fn new(root: ReopenRoot, choice: Choice, tuning: LinkTuning) -> Reopening {
        Reopening {
            root,
            choice,
            tuning,
            epoch: 0,
            closed_at: None,
            tries: 0,
            reopened_at: None,
        }
    }
}

/// A session's data links: a reliable one (RDM) and a best-effort one
/// (DGRAM), each present only when negotiated.
#[derive(Default)]
pub(crate) struct DataLinks {
    pub reliable: Option<DataLink>,
    /// Whether frames to the peer go over `reliable` yet. The side that
    /// accepted the handshake switches once the peer has used it (and,
    /// before anything goes there, the peer has proven the address and
    /// passed the [`Barrier`]).
    pub in_use: bool,
    pub best_effort: Option<DataLink>,
    /// Why the reliable link may send nothing more: a send failed after its
    /// frame was numbered, so the peer would wait for that sequence in
    /// vain. Nothing goes out behind it; the owner ends the connection.
    pub failure: Option<String>,
    /// On the accepting side, what the switch to the reliable link waits
    /// for besides its address's proof.
    pub barrier: Barrier,
    /// Whether this side dialed (its links need no proof from the peer).
    pub(crate) dialed: bool,
    /// On the dialing side, when the best-effort link's ping goes again
    /// (see [`Self::tend_best_effort`]); `None`: at once.
    pub(crate) announce_again_at: Option<Instant>,
    /// On the dialing side, when the best-effort link's first ping went.
    pub(crate) announced_since: Option<Instant>,
    /// On the accepting side, when its links opened (see
    /// [`Self::unused_deadline`]).
    pub(crate) opened_at: Option<Instant>,
    /// How the best-effort link opens again once given up; `None` where
    /// none was negotiated.
    pub(crate) reopening: Option<Reopening>,
    /// The datagram links this side gave up telling the peer
    /// ([`GiveUp::Telling`]), oldest first, at most [`GIVEN_UP_KEPT`].
    pub(super) given_up: VecDeque<GivenUp>,
    /// Frames left to the peer by notices of links no longer kept, not yet
    /// known read (see [`GivenUp::unread`]).
    pub(super) unread_beyond_kept: u64,
}

/// A datagram link this side gave up telling the peer (a `best-effort
/// closed` notice), leaving the frames it sent there unconfirmed to the
/// peer to count.
pub(super) struct GivenUp {
    epoch: u32,
    /// How far this side sent there: where the peer gave its side up at
    /// the same time, its own notice says what it settled, and this side
    /// counts the rest ([`DataLinks::late_notice`], which takes it; the
    /// record stays for its pong).
    sent_through: Option<u64>,
    /// The frames left to the peer, while it is not known to have read the
    /// notice: a peer gone before reading it counts none of them, so a
    /// session that ends counts them as unacknowledged, as it does frames
    /// in flight. The `Pong` answering the `Ping` sent behind the notice
    /// (`nonce`; on the same ordered path, so read after it) zeroes this.
    unread: u64,
    nonce: u64,
}

/// Links given up kept for their proofs of reading and the peer's late
/// notices (a peer that answers no ping is soon given up anyway): past
/// it, the oldest one's unread frames still count, its late notice no
/// more.
pub(super) const GIVEN_UP_KEPT: usize = 8;

impl DataLinks {
    /// Choose data paths from both sides' offers and open the chosen links
    /// on `endpoints` (found by scheme). A link that cannot open here (the
    /// peer's address refused, `shm` full past its peers) takes its scheme
    /// out of this side's offers and the choice is made again, so the next
    /// path both sides have is tried before the control link. Nothing
    /// opens when negotiation finds no path in common; the control link
    /// then carries everything.
    pub fn open(
        &mut self,
        endpoints: &mut [Box<dyn Endpoint>],
        local: &[Offer],
        remote: &[Offer],
        preference: &[String],
        tuning: &LinkTuning,
        keying: Option<Keying<'_>>,
    ) -> Negotiation {
        let mut negotiation = Negotiation {
            opened: Vec::new(),
            failed: false,
            reasons: Vec::new(),
        };
        self.dialed = keying
            .as_ref()
            .is_some_and(|keying| keying.role == HandshakeRole::Dialer);
        self.announce_again_at = None;
        self.announced_since = None;
        self.opened_at = (!self.dialed).then(Instant::now);
        self.reopening = None;
        self.given_up.clear();
        self.unread_beyond_kept = 0;
        // Schemes whose link failed to open here; each pass drops one more,
        // so the passes end.
        let mut unusable: Vec<String> = Vec::new();
        loop {
            let usable: Vec<Offer> = local
                .iter()
                .filter(|o| !unusable.contains(&o.scheme))
                .cloned()
                .collect();
            let negotiated = match negotiate(&usable, remote, preference) {
                Ok(negotiated) => negotiated,
                Err(err) => {
                    negotiation.reasons.push(err.to_string());
                    return negotiation;
                }
            };
            let mut choose_again = false;
            for (choice, kind) in [
                (Some(&negotiated.reliable), LinkKind::Reliable),
                (negotiated.best_effort.as_ref(), LinkKind::BestEffort),
            ] {
                let Some(choice) = choice else { continue };
                let slot = match kind {
                    LinkKind::Reliable => &mut self.reliable,
                    LinkKind::BestEffort => &mut self.best_effort,
                };
                // Opened in an earlier pass (a failure of the other kind's
                // scheme does not change this kind's choice).
                if slot.is_some() || !endpoints::is_data_scheme(&choice.scheme) {
                    continue;
                }
                let Some(index) = endpoints.iter().position(|e| e.scheme() == choice.scheme) else {
                    continue;
                };
                // Every fabric message is authenticated: no keys, no link.
                let Some(keying) = &keying else {
                    negotiation.reasons.push(format!(
                        "{}: the peer gave no link keys; staying on the control link",
                        choice.scheme
                    ));
                    continue;
                };
                match open_keyed(endpoints[index].as_mut(), index, choice, tuning, keying) {
                    Ok(link) => {
                        negotiation.opened.push(choice.local.clone());
                        *slot = Some(link);
                        if kind == LinkKind::BestEffort {
                            self.reopening = keying
                                .secret
                                .reopen_root(keying.role, keying.peer)
                                .map(|root| Reopening::new(root, choice.clone(), tuning.clone()))
                                .ok();
                        }
                    }
                    Err(reason) => {
                        warn!(%reason, "data path unusable; trying the next one in common");
                        negotiation.reasons.push(reason.to_string());
                        negotiation.failed = true;
                        unusable.push(choice.scheme.clone());
                        choose_again = true;
                    }
                }
            }
            if !choose_again {
                if let Some(link) = self.best_effort.as_mut() {
                    link.awaits_credit = self.dialed;
                }
                negotiation.reasons.extend(negotiated.reasons);
                return negotiation;
            }
        }
    }

    fn links(&self) -> impl Iterator<Item = &DataLink> {
        [&self.reliable, &self.best_effort].into_iter().flatten()
    }

    fn links_mut(&mut self) -> impl Iterator<Item = &mut DataLink> {
        [&mut self.reliable, &mut self.best_effort]
            .into_iter()
            .flatten()
    }

    /// The reliable link, when frames to the peer go over it: once the
    /// peer uses it and has proven its address.
    pub fn sending(&mut self) -> Option<&mut DataLink> {
        let in_use = self.in_use;
        self.reliable
            .as_mut()
            .filter(|link| in_use && link.proof == Proof::Proven)
    }

    /// Most bytes of whole frames a run may hold to go to the peer as one
    /// piece: the reliable link's limit while it is in use, else no limit
    /// of the link's (the control link takes runs of any length).
    pub fn run_limit(&self) -> usize {
        match &self.reliable {
            Some(link) if self.in_use => link.run_limit(),
            _ => usize::MAX,
        }
    }

    /// Whether frames to the peer wait: it uses the reliable link, which
    /// has not proven its address yet. They go neither there nor on the
    /// control link (from where they could arrive after later ones sent on
    /// the data link), but stay queued for one round trip, under the
    /// slow-consumer policy like any queue.
    pub fn held(&self) -> bool {
        self.in_use
            && self
                .reliable
                .as_ref()
                .is_some_and(|link| link.proof != Proof::Proven || self.barrier != Barrier::Passed)
    }

    /// Sends the barrier's ping if it is still to go, straight to the
    /// control link, behind everything handed to it (call again when the
    /// link takes frames again).
    pub fn send_barrier(&mut self, endpoints: &mut [Box<dyn Endpoint>], control: Control) {
        let Barrier::Unsent(nonce) = self.barrier else {
            return;
        };
        let ping = codec::encode(&Frame::Ping { nonce });
        // Refused when full: sent again from the next flush. When failing,
        // the link's closing event ends the session.
        if endpoints[control.endpoint].send(control.peer, ping).is_ok() {
            self.barrier = Barrier::Awaiting(nonce);
        }
    }

    /// Whether the move to the reliable link waits for the [`Barrier`]
    /// alone (the address proven).
    pub fn only_barrier_holds(&self) -> bool {
        self.held()
            && self
                .reliable
                .as_ref()
                .is_some_and(|link| link.proof == Proof::Proven)
    }

    /// A `Pong` from the peer: whether it answers the barrier's ping.
    pub fn on_barrier_pong(&mut self, nonce: u64) -> bool {
        if self.barrier == Barrier::Awaiting(nonce) {
            self.barrier = Barrier::Passed;
            return true;
        }
        false
    }

    /// The best-effort link. The one opened with the session takes the
    /// session's best-effort frames from its opening on: they wait there
    /// for the peer's proof of its address (on the side that dialed, for
    /// the peer's first credit, see [`Self::tend_best_effort`]), within
    /// the link's paced bound, so that none is overtaken by one sent on
    /// the reliable path before the link was usable; given up, it hands
    /// what waited to the reliable path. One opened again takes them once
    /// its [`Switch`] begins ([`Self::takes_best_effort`]).
    pub fn best_effort_link(&mut self) -> Option<&mut DataLink> {
        self.best_effort.as_mut()
    }

    /// On the side that dialed, sends a `Ping` on the best-effort link
    /// until the peer's first credit comes back there, once a `heartbeat`
    /// (at most a quarter of `give_up_after`), and gives the link up alone (closed, as [`Self::close_best_effort`])
    /// when none came within `give_up_after` of the first ping. The peer
    /// asks there for the address's proof once the link's first message
    /// arrives; beside a control link nothing else of this side's may go
    /// on the best-effort link (best-effort traffic may flow toward the
    /// dialer alone), so the peer would never ask. Once this side's
    /// address is proven the peer credits the pings it took; until then
    /// this side's frames wait on the link (within its paced bound), so
    /// none goes where the peer may have given the link up, and none is
    /// overtaken by one sent on another path. Again and again: a datagram
    /// may be lost. No credit within `give_up_after` means the peer never
    /// heard this side, or this side receives nothing there: the link is
    /// given up (the owner tells the peer, which closes its side and
    /// carries best effort on the reliable path).
    pub fn tend_best_effort(
        &mut self,
        endpoints: &mut [Box<dyn Endpoint>],
        now: Instant,
        heartbeat: Duration,
        give_up_after: Duration,
    ) -> Option<Closed> {
        let due = self.best_effort_due(now, give_up_after)?;
        let every = heartbeat.min(give_up_after / 4);
        if self
            .announced_since
            .is_some_and(|since| now >= since + give_up_after)
        {
            return self.close_best_effort(endpoints);
        }
        if now >= due {
            let link = self.best_effort.as_mut()?;
            // Ahead of the frames waiting for the credit it asks for;
            // refused (a datagram dropped), it goes again in time.
            let _ = link.transmit_probe(endpoints[link.endpoint].as_mut(), 0);
            self.announced_since.get_or_insert(now);
            self.announce_again_at = Some(now + every);
        }
        None
    }

    /// When [`Self::tend_best_effort`] has something to do next.
    pub fn best_effort_due(&self, now: Instant, give_up_after: Duration) -> Option<Instant> {
        if !self.dialed || self.best_effort.as_ref()?.credited {
            return None;
        }
        let again = self.announce_again_at.unwrap_or(now);
        Some(
            self.announced_since
                .map_or(again, |since| again.min(since + give_up_after)),
        )
    }

    /// Since when the reliable link has been silent after its first send
    /// (see [`DataLink::silent_since`]).
    pub fn reliable_silent_since(&self) -> Option<Instant> {
        self.reliable.as_ref().and_then(DataLink::silent_since)
    }

    /// Whether something came back on the reliable link.
    pub fn reliable_heard(&self) -> bool {
        self.reliable
            .as_ref()
            .is_some_and(|link| link.contact == Contact::Heard)
    }

    /// Whether link `kind` awaits its proof and has not asked for it yet.
    pub fn challenge_due(&self, kind: LinkKind) -> bool {
        self.link(kind).is_some_and(DataLink::never_heard_from)
    }

    fn link(&self, kind: LinkKind) -> Option<&DataLink> {
        match kind {
            LinkKind::Reliable => self.reliable.as_ref(),
            LinkKind::BestEffort => self.best_effort.as_ref(),
        }
    }

    /// Sends a `Ping` with its nonce to each link awaiting its proof that
    /// `ask` names: the first time to link `kind` ([`Ask::First`]: the
    /// peer's first message there arrived, so it has that side up), or
    /// once more to those asked before ([`Ask::Again`]: a datagram may
    /// have been lost). A link never asked is not asked again: the peer
    /// may not have its side up (its own opening failed), and would drop
    /// it; such a link is closed by time instead
    /// ([`Self::unused_deadline`]).
    ///
    /// A link asked `MAX_CHALLENGES` times without an answer does not
    /// reach the peer at the address it gave. A best-effort link is given
    /// up alone, unless the session ends anyway (the peer's datagram
    /// endpoint may receive nothing, or every ping was lost; the owner
    /// tells the peer, which closes its side too): it is closed
    /// and handed back (with the frames that waited on it for the proof,
    /// for the owner to send the reliable way), and best-effort traffic
    /// goes on the reliable path.
    /// A reliable one ends the session.
    pub fn send_challenges(&mut self, endpoints: &mut [Box<dyn Endpoint>], ask: Ask) -> Unanswered {
        let mut unanswered = Unanswered::default();
        let mut give_up_best_effort = false;
        let mut failure = None;
        for link in self.links_mut() {
            let Proof::Awaiting { nonce, asked } = link.proof else {
                continue;
            };
            let asked_now = match ask {
                Ask::First(first) => first == link.kind() && asked == 0,
                Ask::Again => asked > 0,
            };
            if !asked_now {
                continue;
            }
            if asked >= MAX_CHALLENGES {
                if link.lossy {
                    give_up_best_effort = true;
                } else {
                    unanswered.session_ends = true;
                }
                continue;
            }
            // On a lossy link ahead of the frames that wait for its answer.
            let sent = if link.lossy {
                link.transmit_probe(endpoints[link.endpoint].as_mut(), nonce)
                    .map(|()| Sent::Accepted)
            } else {
                let ping = codec::encode(&Frame::Ping { nonce });
                link.send(endpoints[link.endpoint].as_mut(), ping, 1)
            };
            match sent {
                // A ping the link refused (blocked, or a datagram dropped)
                // counts as asked too, so the next heartbeat asks again.
                Ok(Sent::Accepted | Sent::Blocked(_)) => {
                    link.proof = Proof::Awaiting {
                        nonce,
                        asked: asked + 1,
                    };
                }
                // A reliable link that failed (on the ping or on earlier
                // frames' pieces) has a gap the peer waits for in vain; on
                // a lossy one the ping is lost like a datagram, and counts
                // as asked.
                Ok(Sent::Failed(_, err)) | Err(err) if !link.lossy => {
                    failure = Some(err.to_string());
                }
                Ok(Sent::Failed(..)) | Err(_) => {
                    link.proof = Proof::Awaiting {
                        nonce,
                        asked: asked + 1,
                    };
                }
            }
        }
        if let Some(failure) = failure {
            self.failure.get_or_insert(failure);
        }
        // Alone: a session that ends closes it anyway.
        if give_up_best_effort && !unanswered.session_ends {
            unanswered.best_effort_given_up = self.close_best_effort(endpoints);
        }
        unanswered
    }

    /// A `Pong` from the peer: the links whose challenge it answers are
    /// proven, and their rendezvous reads may start. Returns the addresses
    /// proven, as `(endpoint, address)`.
    pub fn on_pong(
        &mut self,
        nonce: u64,
        endpoints: &mut [Box<dyn Endpoint>],
    ) -> Vec<(usize, Vec<u8>)> {
        let mut proven = Vec::new();
        for link in self.links_mut() {
            if matches!(link.proof, Proof::Awaiting { nonce: n, .. } if n == nonce) {
                link.proof = Proof::Proven;
                endpoints[link.endpoint].hold_reads(link.peer, false);
                proven.push((link.endpoint, link.address.clone()));
            }
        }
        proven
    }

    /// The `(endpoint, address)` of each proven link.
    pub fn proven_addresses(&self) -> impl Iterator<Item = (usize, &[u8])> + '_ {
        self.links()
            .filter(|link| link.proof == Proof::Proven)
            .map(|link| (link.endpoint, link.address.as_slice()))
    }

    /// The `(endpoint, peer)` of each open link.
    pub fn addresses(&self) -> impl Iterator<Item = (usize, PeerId)> + '_ {
        self.links().map(|link| (link.endpoint, link.peer))
    }

    /// Which link is `peer` on endpoint `endpoint`, if either.
    pub fn kind_of(&self, endpoint: usize, peer: PeerId) -> Option<LinkKind> {
        let matches = |link: &Option<DataLink>| {
            link.as_ref()
                .is_some_and(|l| l.endpoint == endpoint && l.peer == peer)
        };
        if matches(&self.reliable) {
            Some(LinkKind::Reliable)
        } else if matches(&self.best_effort) {
            Some(LinkKind::BestEffort)
        } else {
            None
        }
    }

    /// One message from the data link `kind`: whole frames and runs of
    /// them go to `out` in the sender's order ([`DataLink::receive`]);
    /// credits are taken here. A message on the
    /// reliable link shows that the peer uses it: so does this side from
    /// then on.
    pub fn receive(
        &mut self,
        kind: LinkKind,
        now: Instant,
        message: Bytes,
        out: &mut Vec<Bytes>,
    ) -> Result<(), LinkError> {
        let link = match kind {
            LinkKind::Reliable => {
                if !self.in_use {
                    // The accepting side moves now: what it sent on the
                    // control link so far must be read first.
                    self.in_use = true;
                    match random_u64() {
                        Ok(nonce) => self.barrier = Barrier::Unsent(nonce),
                        Err(err) => {
                            warn!(%err, "no barrier before the data link: frames sent on it may overtake the control link's")
                        }
                    }
                }
                self.reliable.as_mut()
            }
            LinkKind::BestEffort => self.best_effort.as_mut(),
        };
        match link {
            Some(link) => link.receive(now, message, out),
            None => Ok(()),
        }
    }

    /// Send the credits that are due; true while one is still owed.
    pub fn grant_credits(&mut self, endpoints: &mut [Box<dyn Endpoint>], now: Instant) -> bool {
        let mut still_owed = false;
        // A credit is traffic too: none goes to an address not proven.
        for link in self.links_mut().filter(|link| link.proof == Proof::Proven) {
            if link.owes_credit() {
                link.send_credit(endpoints[link.endpoint].as_mut(), now, false);
            }
            still_owed |= link.owes_credit();
        }
        still_owed
    }

    /// Whether either link owes the peer a credit.
    pub fn owe_credit(&self) -> bool {
        self.links().any(DataLink::owes_credit)
    }

    /// Frames and runs the best-effort link releases by the passing of
    /// time; the reliable link's failure when a gap on it did not fill in
    /// time, unless its endpoint is still reading a frame of the peer's
    /// (a large one's body may take longer than the gap timeout, and the
    /// frames sent after it wait meanwhile).
    pub fn poll(
        &mut self,
        now: Instant,
        endpoints: &[Box<dyn Endpoint>],
        out: &mut Vec<Bytes>,
    ) -> Result<(), LinkError> {
        if let Some(link) = &mut self.best_effort {
            // Lossy links give gaps up rather than fail.
            let _ = link.poll(now, out);
        }
        match &mut self.reliable {
            Some(link) => {
                if endpoints
                    .get(link.endpoint)
                    .is_some_and(|endpoint| endpoint.receiving_from(link.peer))
                {
                    link.receiver.note_frame_in_transit(now);
                }
                link.poll(now, out)
            }
            None => Ok(()),
        }
    }

    /// When a link next has something to do by time alone.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.links().filter_map(DataLink::next_deadline).min()
    }

    /// Queue a frame on the best-effort link for
    /// [`pace_best_effort`](Self::pace_best_effort); false without one
    /// that takes best effort ([`Self::takes_best_effort`]).
    pub fn queue_best_effort(&mut self, frame: OutFrame) -> bool {
        if !self.takes_best_effort() {
            return false;
        }
        let Some(link) = self.best_effort_link() else {
            return false;
        };
        link.wait_for_credit(frame);
        true
    }

    /// When the best-effort link's frames will have gone unconfirmed long
    /// enough for [`Self::probe_best_effort`].
    pub fn best_effort_probe_at(&self) -> Option<Instant> {
        self.best_effort.as_ref()?.probe_at()
    }

    /// The best-effort link, its frames unconfirmed since
    /// [`Self::best_effort_probe_at`]: a probe asks the peer to
    /// show it hears the link (a live one answers it, and settles what it
    /// lacks up to what the probe says was sent). Once [`MAX_PROBES`] went answered
    /// neither way and `give_up_after` has passed since the first (a peer
    /// whose loop is held up for a while answers late), the link is given
    /// up ([`GiveUp::Telling`]), and the owner tells the peer, which
    /// closes its side too and counts what it lacks of what was sent; a
    /// peer gone altogether is its heartbeat's to find.
    pub fn probe_best_effort(
        &mut self,
        endpoints: &mut [Box<dyn Endpoint>],
        now: Instant,
        give_up_after: Duration,
    ) -> Option<Closed> {
        let link = self.best_effort.as_mut()?;
        if link.probe_at().is_none_or(|at| now < at) {
            return None;
        }
        let waited = link
            .confirmed
            .first_probe
            .is_some_and(|first| now.saturating_duration_since(first) >= give_up_after);
        if link.confirmed.probes >= MAX_PROBES && waited {
            return self.give_up_best_effort(endpoints, GiveUp::Telling);
        }
        let confirmed = &mut link.confirmed;
        confirmed.probes += 1;
        confirmed.first_probe.get_or_insert(now);
        confirmed.last_probe = Some(now);
        let endpoint = endpoints[link.endpoint].as_mut();
        // Behind what the endpoint has not taken yet, or not at all: a
        // link that cannot send is as silent as one that is not heard (a
        // frame whose piece failed is lost on the way, see
        // `DataLink::failed`).
        if let Ok(true) = link.flush(endpoint) {
            // The next sequence tells its answer from other pings' (those
            // of heartbeats carry 0, challenges a random nonce); an answer
            // to an earlier probe, with no frame sent since, shows as well
            // that the peer hears the link.
            let seq = link.sender.next_sequence();
            link.confirmed.probe_nonce = seq;
            let _ = link.transmit_probe(endpoint, seq);
        }
        None
    }

    /// A `Pong` that may answer the best-effort link's latest ping (see
    /// [`Self::probe_best_effort`]): the peer hears that link, though it
    /// may credit nothing for a while (holding its publishers back).
    pub fn on_probe_pong(&mut self, nonce: u64, now: Instant) {
        if let Some(link) = self.best_effort.as_mut() {
            if link.confirmed.probes > 0 && link.confirmed.probe_nonce == nonce {
                link.heard_on_link(now);
            }
        }
    }

    /// Send what the best-effort link holds back for credit or for the
    /// endpoint; returns the credit waits it met. A failure loses the
    /// frames still waiting (counted in its `dropped`; the one being sent
    /// is lost on the way, see `DataLink::failed`) and is logged:
    /// best-effort traffic never ends the session.
    pub fn pace_best_effort(&mut self, endpoints: &mut [Box<dyn Endpoint>]) -> u64 {
        let Some(link) = self.best_effort_link() else {
            return 0;
        };
        if let Err(reason) = link.pace(endpoints[link.endpoint].as_mut()) {
            link.dropped += link.paced.len() as u64;
            link.paced.clear();
            link.paced_bytes = 0;
            tracing::debug!(%reason, "best-effort send failed");
        }
        link.take_credit_waits()
    }

    /// Best-effort frames dropped on this side since last asked.
    pub fn take_best_effort_drops(&mut self) -> u64 {
        self.best_effort.as_mut().map_or(0, |link| {
            let new = link.dropped - link.dropped_told;
            link.dropped_told = link.dropped;
            new
        })
    }

    /// Frames the reliable link sent (or numbered and holds in its backlog)
    /// that the peer has not acknowledged: if the session ends now, the
    /// peer may have taken them (its credit still to come) or not.
    pub fn unacknowledged_frames(&self) -> u64 {
        self.reliable.as_ref().map_or(0, DataLink::frames_in_flight)
    }

    /// Frames the best-effort link sent that no credit confirmed, but for
    /// those counted apart ([`Self::best_effort_unsent_frames`]): if the
    /// session ends now, the peer may have taken them, counted them lost,
    /// or never heard of them.
    pub fn best_effort_unconfirmed_frames(&self) -> u64 {
        self.best_effort.as_ref().map_or(0, |link| {
            link.unconfirmed().saturating_sub(link.failed_at_tail)
        })
    }

    /// Credit and probe frames from the peer that did not decode on the
    /// best-effort link since last asked (ignored, the link going on).
    pub fn take_bad_link_frames(&mut self) -> u64 {
        self.best_effort
            .as_mut()
            .map_or(0, |link| std::mem::take(&mut link.bad_link_frames))
    }

    /// Best-effort messages from the peer found missing since last asked.
    pub fn take_best_effort_lost(&mut self) -> u64 {
        self.best_effort.as_mut().map_or(0, |link| {
            let lost = link.lost();
            let new = lost - link.lost_told;
            link.lost_told = lost;
            new
        })
    }

    /// Best-effort frames this side loses if the session ends now: those
    /// waiting for credit or for the endpoint, and those whose send failed
    /// with nothing sent after them (nothing shows the peer their gap).
    pub fn best_effort_unsent_frames(&self) -> u64 {
        self.best_effort.as_ref().map_or(0, |link| {
            link.paced.len() as u64 + link.backlog_frames() + link.failed_at_tail
        })
    }

    /// Whether the best-effort link holds frames back.
    pub fn best_effort_waiting(&self) -> bool {
        self.best_effort.as_ref().is_some_and(|link| {
            !link.paced.is_empty() || !link.backlog.is_empty() || link.trickle.is_some()
        })
    }

    /// Whether frames numbered for the peer wait for the endpoint.
    pub fn has_backlog(&self) -> bool {
        self.reliable
            .as_ref()
            .is_some_and(|link| !link.backlog.is_empty())
    }

    /// Bytes numbered for the peer but not yet taken by the endpoint.
    pub fn backlog_bytes(&self) -> usize {
        self.reliable.as_ref().map_or(0, DataLink::backlog_bytes)
    }

    /// Whether everything sent on the reliable link has left this side.
    pub fn drained(&self, endpoints: &[Box<dyn Endpoint>]) -> bool {
        self.reliable.as_ref().is_none_or(|link| {
            link.backlog_bytes() == 0 && endpoints[link.endpoint].queued_bytes(link.peer) == 0
        })
    }

    /// Close both links and forget them. Returns the best-effort messages
    /// from the peer lost with them: found missing and not yet told
    /// ([`DataLinks::take_best_effort_lost`]), or not yet settled.
    pub fn close(&mut self, endpoints: &mut [Box<dyn Endpoint>]) -> u64 {
        let lost = self
            .close_best_effort(endpoints)
            .map_or(0, |closed| closed.lost);
        if let Some(link) = self.reliable.take() {
            endpoints[link.endpoint].close(link.peer);
        }
        self.in_use = false;
        self.failure = None;
        self.barrier = Barrier::Passed;
        lost
    }

    /// On the side that accepted, when the links the peer has sent nothing
    /// on are given up: `timeout` after they opened. A peer sends on each
    /// link it opened at once (a dialer's first frames), so one it has not
    /// sent on by then it never opened (its side failed), and the link
    /// would only hold an address and report a path nothing takes. `None`
    /// on the dialing side, and once the peer has sent on each.
    pub fn unused_deadline(&self, timeout: Duration) -> Option<Instant> {
        let opened = self.opened_at?;
        self.links()
            .any(DataLink::never_heard_from)
            .then_some(opened + timeout)
    }

    /// Close the links [`Self::unused_deadline`] speaks of and forget
    /// them.
    pub fn close_unused(&mut self, endpoints: &mut [Box<dyn Endpoint>]) -> Vec<Closed> {
        let mut closed = Vec::new();
        if let Some(link) = self.reliable.take_if(|link| link.never_heard_from()) {
            endpoints[link.endpoint].close(link.peer);
            closed.push(Closed {
                kind: LinkKind::Reliable,
                description: link.description,
                settled_through: 0,
                sent_through: 0,
                address: (link.endpoint, link.peer),
                lost: 0,
                unsent: 0,
                waiting: VecDeque::new(),
                notice_ping: None,
            });
        }
        if self
            .best_effort
            .as_ref()
            .is_some_and(DataLink::never_heard_from)
        {
            closed.extend(self.close_best_effort(endpoints));
        }
        closed
    }

    /// Give the best-effort link up (see [`GiveUp`] for who counts what
    /// it sent unconfirmed, which no credit will settle now), then close
    /// it as [`Self::close_best_effort`].
    pub fn give_up_best_effort(
        &mut self,
        endpoints: &mut [Box<dyn Endpoint>],
        how: GiveUp,
    ) -> Option<Closed> {
        let link = self.best_effort.as_mut()?;
        let left_to_peer = (how == GiveUp::Telling).then(|| link.unconfirmed());
        if let GiveUp::Told {
            settled_through,
            sent_through,
        } = how
        {
            link.confirm_through(settled_through);
            link.receiver.settle_at_close(sent_through);
        }
        if how != GiveUp::Telling {
            link.dropped = link.dropped.saturating_add(link.unconfirmed());
        }
        // Sent as far as the peer knows, so counted by it or just now.
        link.failed_at_tail = 0;
        let epoch = self.best_effort_epoch();
        let mut closed = self.close_best_effort(endpoints)?;
        if let Some(unread) = left_to_peer {
            closed.notice_ping = Some(self.note_given_up(epoch, closed.sent_through, unread));
        }
        Some(closed)
    }

    /// The link of `epoch`, sent through `sent_through`, given up telling
    /// the peer, which is left `unread` frames to count: returns the nonce
    /// of the ping to send behind the notice.
    pub(super) fn note_given_up(&mut self, epoch: u32, sent_through: u64, unread: u64) -> u64 {
        if self.given_up.len() == GIVEN_UP_KEPT {
            if let Some(oldest) = self.given_up.pop_front() {
                self.unread_beyond_kept += oldest.unread;
            }
        }
        // Apart from the switch's fallback nonces (near `u64::MAX`).
        let nonce = random_u64().unwrap_or((1 << 62) | u64::from(epoch));
        self.given_up.push_back(GivenUp {
            epoch,
            sent_through: Some(sent_through),
            unread,
            nonce,
        });
        nonce
    }

    /// A `Pong` from the peer: if it answers the ping behind a notice, the
    /// peer read that notice and those before it, and counted their frames.
    pub fn on_notice_pong(&mut self, nonce: u64) {
        if let Some(at) = self.given_up.iter().position(|link| link.nonce == nonce) {
            for link in self.given_up.range_mut(..=at) {
                link.unread = 0;
            }
            self.unread_beyond_kept = 0;
        }
    }

    /// Frames this side left to the peer on datagram links it gave up,
    /// whose notices the peer is not known to have read: if the session
    /// ends now, the peer may have counted them or not.
    pub fn unread_notice_frames(&self) -> u64 {
        self.given_up.iter().map(|link| link.unread).sum::<u64>() + self.unread_beyond_kept
    }

    /// The peer's notice for the datagram link of `epoch`, which this side
    /// gave up telling the peer, arriving once it is closed: both sides
    /// gave up at once, each counting on the other for the frames it sent
    /// unconfirmed. Those this side sent beyond what the peer settled
    /// (`settled_through`) are counted here after all: returns how many.
    /// (The peer does the same for its own.) The link's frames then leave
    /// what a session's end counts ([`GivenUp::unread`]): the peer counted
    /// those it settled. The peer answers pings ahead of what it queued, so
    /// this may come after the pong to the ping behind this side's notice.
    pub fn late_notice(&mut self, epoch: u32, settled_through: u64) -> u64 {
        let Some(link) = self.given_up.iter_mut().find(|link| link.epoch == epoch) else {
            return 0;
        };
        let Some(sent_through) = link.sent_through.take() else {
            return 0;
        };
        link.unread = 0;
        sent_through.saturating_sub(settled_through)
    }

    /// On the side that dialed, when the best-effort link, given up, opens
    /// again ([`Self::reopen_best_effort`]): `base` after it closed,
    /// doubled for each try since best effort last rode one (at most
    /// [`REOPEN_DOUBLINGS_MAX`] times). `None` while it is open,
    /// on the accepting side, and where none was negotiated.
    pub fn reopen_due(&self, base: Duration) -> Option<Instant> {
        if !self.dialed || self.best_effort.is_some() {
            return None;
        }
        let reopening = self.reopening.as_ref()?;
        let doublings = reopening.tries.min(REOPEN_DOUBLINGS_MAX);
        reopening
            .closed_at?
            .checked_add(base.saturating_mul(1 << doublings))
    }

    /// On the side that dialed, when [`Self::reopen_due`] says: opens the
    /// best-effort link given up again in the next epoch (see
    /// [`Self::open_again`]); there it then pings the peer for a credit as
    /// after the handshake ([`Self::tend_best_effort`]). Returns the epoch
    /// opened, or why none did (a dialer then waits longer before the next
    /// try).
    pub fn reopen_best_effort(
        &mut self,
        endpoints: &mut [Box<dyn Endpoint>],
        in_service: impl Fn(usize) -> bool,
        now: Instant,
    ) -> Result<u32, String> {
        if self.best_effort.is_some() {
            return Err("the datagram link is open".to_string());
        }
        // No epoch goes to a try that cannot reach the peer; the wait
        // grows all the same.
        if let Err(why) = self.reopen_endpoint(endpoints, &in_service) {
            if let Some(reopening) = self.reopening.as_mut() {
                reopening.tries = reopening.tries.saturating_add(1);
                reopening.closed_at = Some(now);
            }
            return Err(why);
        }
        let epoch = self.admit_reopen(None, now)?;
        self.open_again(endpoints, in_service, epoch, now)?;
        Ok(epoch)
    }

    /// The endpoint a reopened best-effort link goes on: the handshake's
    /// scheme, there and in service (`in_service` says which are not).
    fn reopen_endpoint(
        &self,
        endpoints: &[Box<dyn Endpoint>],
        in_service: impl Fn(usize) -> bool,
    ) -> Result<usize, String> {
        let reopening = self
            .reopening
            .as_ref()
            .ok_or("no datagram link was negotiated")?;
        let scheme = &reopening.choice.scheme;
        let index = endpoints
            .iter()
            .position(|e| e.scheme() == scheme)
            .ok_or_else(|| format!("{scheme}: no such endpoint here any more"))?;
        if !in_service(index) {
            return Err(format!("{scheme}: the endpoint is out of service"));
        }
        Ok(index)
    }

    /// Whether a reopening in `epoch` (`None`: the one after the last) may
    /// go ahead, and in which epoch: one was negotiated, the epoch asked
    /// is past the last one by at most [`REOPEN_EPOCHS_AHEAD`], and on the
    /// accepting side the peer's last asking is [`REOPEN_MIN_INTERVAL`]
    /// old. The epoch is taken then, opened or not: an epoch tried is
    /// never tried again.
    pub fn admit_reopen(&mut self, epoch: Option<u32>, now: Instant) -> Result<u32, String> {
        let Some(reopening) = self.reopening.as_mut() else {
            return Err("no datagram link was negotiated".to_string());
        };
        if self.dialed && epoch.is_some() {
            return Err("the side that dialed reopens; it takes no asking".to_string());
        }
        let last = reopening.epoch;
        let epoch = match epoch {
            Some(epoch) if epoch > last && epoch - last <= REOPEN_EPOCHS_AHEAD => epoch,
            Some(epoch) => {
                return Err(format!(
                    "epoch {epoch} is not past the last, {last}, by 1 to {REOPEN_EPOCHS_AHEAD}"
                ))
            }
            None => last
                .checked_add(1)
                .ok_or("the datagram link's epochs are used up")?,
        };
        if self.dialed {
            reopening.tries = reopening.tries.saturating_add(1);
            reopening.closed_at = Some(now);
        } else {
            // The peer may tear its side down and ask again at will: each
            // asking costs keys, an open and a report line here.
            if let Some(at) = reopening.reopened_at {
                if now < at + REOPEN_MIN_INTERVAL {
                    return Err(format!(
                        "asked again within {REOPEN_MIN_INTERVAL:?} of the last time"
                    ));
                }
            }
            reopening.reopened_at = Some(now);
        }
        reopening.epoch = epoch;
        Ok(epoch)
    }

    /// Opens the best-effort link again under the keys of `epoch` (from
    /// [`Self::admit_reopen`]), from the address and parameters of the
    /// handshake: on the side that dialed through
    /// [`Self::reopen_best_effort`], on the other when the peer asks
    /// (`Frame::BestEffortReopen`), where it asks for the address's proof
    /// again. The link carries no best effort until it is usable
    /// and its [`Switch`] is done. Fails when a link is open, the endpoint
    /// is gone or out of service (`in_service` says which are not), or it
    /// refuses the peer.
    pub fn open_again(
        &mut self,
        endpoints: &mut [Box<dyn Endpoint>],
        in_service: impl Fn(usize) -> bool,
        epoch: u32,
        now: Instant,
    ) -> Result<(), String> {
        if self.best_effort.is_some() {
            return Err("the datagram link is open".to_string());
        }
        let index = self.reopen_endpoint(endpoints, in_service)?;
        let Some(reopening) = self.reopening.as_mut() else {
            return Err("no datagram link was negotiated".to_string());
        };
        let scheme = &reopening.choice.scheme;
        let role = if self.dialed {
            HandshakeRole::Dialer
        } else {
            HandshakeRole::Acceptor
        };
        let keys = reopening.root.keys(scheme, epoch);
        let proof = first_proof(role, scheme).map_err(|err| err.to_string())?;
        let (choice, tuning) = (&reopening.choice, &reopening.tuning);
        let mut link = DataLink::open(
            index,
            endpoints[index].as_mut(),
            choice,
            tuning,
            &keys,
            proof,
        )
        .map_err(|err| err.to_string())?;
        reopening.closed_at = None;
        link.awaits_credit = self.dialed;
        link.switch = Switch::Opening;
        self.best_effort = Some(link);
        // The peer opens its side once it reads the asking, sent on the
        // control link: a ping before then would find no link there.
        self.announce_again_at = self.dialed.then(|| now + REOPEN_FIRST_PING_AFTER);
        self.announced_since = None;
        if !self.dialed {
            self.opened_at = Some(now);
        }
        Ok(())
    }

    /// The epoch of the best-effort link opened last (0: the handshake's),
    /// which its close notice names.
    pub fn best_effort_epoch(&self) -> u32 {
        self.reopening
            .as_ref()
            .map_or(0, |reopening| reopening.epoch)
    }

    /// Whether best-effort frames go on the best-effort link (see
    /// [`Switch`]): it is open and not [`Switch::Opening`].
    pub fn takes_best_effort(&self) -> bool {
        self.best_effort
            .as_ref()
            .is_some_and(|link| link.switch != Switch::Opening)
    }

    /// The best-effort link's description while it takes best effort
    /// ([`Self::takes_best_effort`]), for reports.
    pub fn best_effort_path(&self) -> Option<String> {
        self.best_effort
            .as_ref()
            .filter(|link| link.switch != Switch::Opening)
            .map(|link| link.description.clone())
    }

    /// A best-effort link opened again that has become usable begins its
    /// switch: the nonce of the `Ping` the owner sends the reliable way,
    /// behind all that went there (a broker's batch closed first), whose
    /// `Pong` ([`Self::on_switch_pong`]) lets best effort go on the link.
    /// `None` when no switch begins now.
    pub fn switch_due(&mut self, now: Instant) -> Option<u64> {
        let epoch = self.best_effort_epoch();
        let link = self
            .best_effort
            .as_mut()
            .filter(|link| link.ready_to_carry())?;
        // Tells the answer from heartbeats' (0) and probes' (sequences);
        // the pong comes over the session's own links, so a guess gains
        // a peer nothing.
        let nonce = random_u64().unwrap_or(u64::MAX - u64::from(epoch));
        link.switch = Switch::Barrier { nonce, since: now };
        Some(nonce)
    }

    /// A side that sends no best effort (a client) has nothing to move:
    /// its link opened again carries once the peer's first credit came.
    /// Whether it did just now.
    pub fn carry_once_credited(&mut self) -> bool {
        match self.best_effort.as_mut() {
            Some(link) if link.ready_to_carry() => {
                link.switch = Switch::Carrying;
                true
            }
            _ => false,
        }
    }

    /// When the switch's `Pong` is overdue: `timeout` after its ping. A
    /// peer that does not answer (a route reading none of what it is
    /// sent) would otherwise keep best effort waiting on the link for
    /// good; the owner gives the link up then, and its frames go the
    /// reliable way, behind the ping.
    pub fn switch_deadline(&self, timeout: Duration) -> Option<Instant> {
        match self.best_effort.as_ref()?.switch {
            Switch::Barrier { since, .. } => Some(since + timeout),
            Switch::Carrying | Switch::Opening => None,
        }
    }

    /// A `Pong` from the peer: whether it answers the switch's ping, after
    /// which best effort goes on the best-effort link (what waited there
    /// meanwhile first).
    pub fn on_switch_pong(&mut self, nonce: u64) -> bool {
        match self.best_effort.as_mut() {
            Some(link) if matches!(link.switch, Switch::Barrier { nonce: n, .. } if n == nonce) => {
                link.switch = Switch::Carrying;
                true
            }
            _ => false,
        }
    }

    /// Close the best-effort link alone and forget it.
    pub fn close_best_effort(&mut self, endpoints: &mut [Box<dyn Endpoint>]) -> Option<Closed> {
        let receiver = &self.best_effort.as_ref()?.receiver;
        let (unsettled, settled_through) = (receiver.unsettled(), receiver.settled_through());
        let lost = self.take_best_effort_lost().saturating_add(unsettled);
        let mut link = self.best_effort.take()?;
        let unsent = link.unsent();
        let sent_through = link.sent_through();
        let waiting = link.take_waiting();
        endpoints[link.endpoint].close(link.peer);
        self.announce_again_at = None;
        self.announced_since = None;
        if let Some(reopening) = self.reopening.as_mut() {
            // A reopening counts as done once best effort rode it: a peer
            // that credits but never answers the switch is no success.
            if link.credited && link.switch == Switch::Carrying {
                reopening.tries = 0;
            }
            reopening.closed_at = Some(Instant::now());
        }
        Some(Closed {
            kind: LinkKind::BestEffort,
            description: link.description,
            settled_through,
            sent_through,
            address: (link.endpoint, link.peer),
            lost,
            unsent,
            waiting,
            notice_ping: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use efabus_core::fragment::ReassemblyConfig;
    use efabus_core::link::LinkTuning;

    fn config(max_frame: usize) -> LinkConfig {
        let tuning = LinkTuning::default();
        LinkConfig {
            frame_limit: 16 << 10,
            sequenced: true,
            lossy: false,
            gap_timeout: tuning.gap_timeout,
            reliable_gap_timeout: tuning.reliable_gap_timeout,
            reorder_window: tuning.reorder_window,
            skip_distance: 1,
            reassembly: ReassemblyConfig::for_frames_up_to(max_frame),
            memory: tuning.memory,
        }
    }

    #[test]
    fn a_sender_assumes_no_more_bytes_than_any_peer_grants() {
        let default = ReassemblyConfig::default().max_bytes as u64 / 2;
        let (send, grant) = windows(&config(1 << 20), 256, 256);
        assert_eq!((send.bytes, grant.bytes), (default, default));
        // A side whose frames go up to 200 MiB grants more, but until the
        // peer's first credit sends no more than a default peer holds.
        let (send, grant) = windows(&config(200 << 20), 256, 256);
        assert_eq!(send.bytes, default);
        assert!(grant.bytes > 100 << 20, "{}", grant.bytes);
    }
}
