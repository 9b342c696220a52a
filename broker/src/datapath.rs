//! Data paths negotiated per peer: the offers a side makes in the
//! handshake, and a [`DataLink`] that drives one negotiated link (libfabric
//! RDM or DGRAM) with the core link layer (sequencing, fragmentation,
//! reordering) and credit-based flow control in front of the endpoint.
//!
//! The control link (TCP or mem) that carried the handshake stays open; it
//! carries everything for peers without a common fabric.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::caps::Choice;
use efabus_core::codec::{self, FrameKind, PREFIX_LEN};
use efabus_core::credit::{CreditGrant, CreditWindow, Window};
use efabus_core::frame::Frame;
use efabus_core::link::{LinkConfig, LinkError, LinkReceiver, LinkSender, LinkTuning};
use efabus_core::transport::{Endpoint, OutFrame, PeerId, SendError};

/// What happened to a frame handed to [`DataLink::send`].
pub(crate) enum Sent {
    /// On its way (possibly waiting in the link's backlog).
    Accepted,
    /// The link is full; the frame is handed back untouched.
    Blocked(OutFrame),
    /// Lost: the datagram endpoint refused it; counted.
    Dropped,
}

/// One negotiated link to one peer over a data endpoint.
pub(crate) struct DataLink {
    /// Index of the endpoint in the owner's endpoint list.
    pub endpoint: usize,
    pub peer: PeerId,
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
    /// Wire frames already numbered but refused by the endpoint: they must
    /// go before anything else, and are never dropped.
    backlog: VecDeque<OutFrame>,
    pub frames_out: u64,
    pub frames_in: u64,
    pub dropped: u64,
    /// Credits sent to the peer.
    pub credits_out: u64,
    credit_waits_reported: u64,
    /// Credit frames that did not decode on a lossy link (counted,
    /// otherwise ignored: the next credit repairs the window).
    pub bad_credits: u64,
}

/// The flow-control windows of a link: what this side may send (bounded by
/// the negotiated send window, the peer's posted receives) and what it
/// grants the peer (its own posted receives, and at most half the memory
/// it may hold back for reordering and reassembly).
fn windows(config: &LinkConfig, send_window: u64, recv_window: u64) -> (Window, Window) {
    let pieces = |negotiated: u64| {
        let limit = config
            .reorder_window
            .min(config.reassembly.max_messages)
            .max(1) as u64;
        u32::try_from(negotiated.clamp(1, limit)).unwrap_or(u32::MAX)
    };
    let bytes = (config.reassembly.max_bytes as u64 / 2).max(1);
    (
        Window {
            pieces: pieces(send_window),
            bytes,
        },
        Window {
            pieces: pieces(recv_window),
            bytes,
        },
    )
}

impl DataLink {
    /// Insert the peer's address from the chosen offer into the endpoint
    /// and set up both directions of the link layer.
    pub fn open(
        endpoint_index: usize,
        endpoint: &mut dyn Endpoint,
        choice: &Choice,
        tuning: &LinkTuning,
    ) -> Result<DataLink, String> {
        let peer = endpoint
            .insert_peer(&choice.remote.address)
            .map_err(|err| format!("{}: cannot add the peer's address: {err}", choice.scheme))?;
        let choice = crate::endpoints::as_driven(choice);
        let config = LinkConfig::from_params(&choice.params, endpoint.max_frame(), tuning);
        endpoint.set_peer_frame_limit(peer, config.frame_limit);
        let sender = LinkSender::new(&config)
            .map_err(|err| format!("{}: unusable link parameters: {err}", choice.scheme))?;
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
            frames_out: 0,
            frames_in: 0,
            dropped: 0,
            credits_out: 0,
            credit_waits_reported: 0,
            bad_credits: 0,
        })
    }

    /// Send one frame through the link layer.
    pub fn send(&mut self, endpoint: &mut dyn Endpoint, frame: OutFrame) -> Result<Sent, String> {
        if !self.flush(endpoint)? {
            return Ok(if self.lossy {
                self.dropped += 1;
                Sent::Dropped
            } else {
                Sent::Blocked(frame)
            });
        }
        if !self.admit(&frame) {
            return Ok(if self.lossy {
                self.dropped += 1;
                Sent::Dropped
            } else {
                Sent::Blocked(frame)
            });
        }
        let seq = self.sender.next_sequence();
        let mut wire = Vec::new();
        self.sender
            .prepare(frame, &mut wire)
            .map_err(|err| format!("{}: {err}", self.scheme))?;
        let bytes = wire.iter().map(|piece| piece.len() as u64).sum();
        self.window.sent(seq, wire.len() as u32, bytes);
        self.frames_out += 1;
        let mut pieces = wire.into_iter();
        while let Some(piece) = pieces.next() {
            match endpoint.send(self.peer, piece) {
                Ok(()) => {}
                Err(SendError::WouldBlock(piece)) if self.lossy => {
                    // Datagrams: the rest of this frame is lost; the
                    // receiver counts the gap.
                    let _ = piece;
                    self.dropped += 1;
                    return Ok(Sent::Dropped);
                }
                Err(SendError::WouldBlock(piece)) => {
                    self.backlog.push_back(piece);
                    self.backlog.extend(pieces);
                    break;
                }
                Err(err) => return Err(format!("{}: {err}", self.scheme)),
            }
        }
        Ok(Sent::Accepted)
    }

    /// Whether the peer's credit lets `frame` go now. A lossy link whose
    /// credits stopped arriving resets its window after a while: the frames
    /// in flight are lost or given up by the receiver by then.
    fn admit(&mut self, frame: &OutFrame) -> bool {
        let (pieces, bytes) = self.sender.wire_size(frame.len());
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
        true
    }

    /// Hand the backlog to the endpoint; true when it is empty.
    pub fn flush(&mut self, endpoint: &mut dyn Endpoint) -> Result<bool, String> {
        while let Some(piece) = self.backlog.pop_front() {
            match endpoint.send(self.peer, piece) {
                Ok(()) => {}
                Err(SendError::WouldBlock(piece)) => {
                    self.backlog.push_front(piece);
                    return Ok(false);
                }
                Err(err) => return Err(format!("{}: {err}", self.scheme)),
            }
        }
        Ok(true)
    }

    /// Bytes waiting in the backlog.
    pub fn backlog_bytes(&self) -> usize {
        self.backlog.iter().map(OutFrame::len).sum()
    }

    /// One message from the endpoint: whole frames, in the sender's order.
    /// Credits from the peer are taken here and never reach `out`.
    pub fn receive(
        &mut self,
        now: Instant,
        message: Bytes,
        out: &mut Vec<Bytes>,
    ) -> Result<(), LinkError> {
        if message.get(PREFIX_LEN) == Some(&(FrameKind::Credit as u8)) {
            return match codec::decode(message, &codec::CodecLimits::default()) {
                Ok(Frame::Credit(credit)) => {
                    self.window.on_credit(&credit);
                    Ok(())
                }
                // The next credit repairs the window; on a reliable link a
                // mangled message means the link is broken.
                Ok(_) => Ok(()),
                Err(_) if self.lossy => {
                    self.bad_credits += 1;
                    Ok(())
                }
                Err(err) => Err(err.into()),
            };
        }
        self.grant.on_received(message.len());
        let before = out.len();
        let result = self.receiver.receive(now, message, out);
        self.frames_in += (out.len() - before) as u64;
        result
    }

    /// Every sequence up to this one has been delivered or given up.
    fn delivered_through(&self) -> u64 {
        self.receiver
            .expected_sequence()
            .map_or(0, |next| next.saturating_sub(1))
    }

    /// Whether the peer is owed a credit (call [`Self::send_credit`] until
    /// it is not).
    pub fn owes_credit(&self) -> bool {
        self.grant.owes(self.delivered_through())
    }

    /// Send the peer a credit if one is due (or at once with `force`).
    /// Credits go straight to the endpoint, outside the link's sequence; a
    /// refused one is simply sent later.
    pub fn send_credit(&mut self, endpoint: &mut dyn Endpoint, now: Instant, force: bool) {
        let through = self.delivered_through();
        let credit = if force && self.grant.owes(through) {
            Some(self.grant.credit(through))
        } else {
            self.grant.due(now, through)
        };
        let Some(credit) = credit else {
            return;
        };
        if endpoint
            .send(self.peer, codec::encode(&Frame::Credit(credit)))
            .is_ok()
        {
            self.grant.sent(now, &credit);
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

    /// Frames released by the passing of time (lossy links).
    pub fn poll(&mut self, now: Instant, out: &mut Vec<Bytes>) {
        let before = out.len();
        self.receiver.poll(now, out);
        self.frames_in += (out.len() - before) as u64;
    }

    /// Messages given up on this link (lossy links), as the receiver counts.
    pub fn lost(&self) -> u64 {
        self.receiver.stats().lost
    }
}
