//! Data paths negotiated per peer: the offers a side makes in the
//! handshake, and a [`DataLink`] that drives one negotiated link (libfabric
//! RDM or DGRAM) with the core link layer (sequencing, fragmentation,
//! reordering) in front of the endpoint.
//!
//! The control link (TCP or mem) that carried the handshake stays open; it
//! carries everything for peers without a common fabric.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;
use efabus_core::caps::{Choice, Offer};
use efabus_core::link::{LinkConfig, LinkError, LinkReceiver, LinkSender, LinkTuning};
use efabus_core::transport::{Endpoint, OutFrame, PeerId, SendError};

/// Schemes whose endpoints carry data for peers negotiated onto them.
pub(crate) fn is_data_scheme(scheme: &str) -> bool {
    matches!(scheme, "efa-rdm" | "efa-dgram")
}

/// The offer an endpoint makes: its fi_info, its address, and a message
/// size no larger than what its buffers hold, so both sides settle on the
/// smaller of their frame limits.
pub(crate) fn offer_for(endpoint: &dyn Endpoint) -> Option<Offer> {
    let info = endpoint.info()?;
    let mut offer = Offer::from_info(endpoint.scheme(), &info, endpoint.local_addr());
    let capacity = endpoint.max_frame() as u64 + offer.msg_prefix_size;
    offer.max_msg_size = offer.max_msg_size.min(capacity);
    Some(offer)
}

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
    /// Wire frames already numbered but refused by the endpoint: they must
    /// go before anything else, and are never dropped.
    backlog: VecDeque<OutFrame>,
    pub frames_out: u64,
    pub frames_in: u64,
    pub dropped: u64,
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
        // FI_ORDER_SAS orders how messages are matched to receives, not the
        // order their completions are reported (receive comp_order is
        // FI_ORDER_NONE for `tcp;ofi_rxm` and `udp;ofi_rxd`, and libfabric
        // 2.x no longer reports it): `tcp;ofi_rxm` completes a
        // rendezvous-sized message after smaller ones sent later. Frames
        // leave the endpoint in completion order, so data links always carry
        // sequence numbers and reorder; both sides apply the same rule.
        let mut choice = choice.clone();
        choice.params.sequence_and_reorder = true;
        let config = LinkConfig::from_params(&choice.params, endpoint.max_frame(), tuning);
        let sender = LinkSender::new(&config)
            .map_err(|err| format!("{}: unusable link parameters: {err}", choice.scheme))?;
        Ok(DataLink {
            endpoint: endpoint_index,
            peer,
            scheme: choice.scheme.clone(),
            lossy: config.lossy,
            description: choice.to_string(),
            sender,
            receiver: LinkReceiver::new(&config),
            backlog: VecDeque::new(),
            frames_out: 0,
            frames_in: 0,
            dropped: 0,
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
        let mut wire = Vec::new();
        self.sender
            .prepare(frame, &mut wire)
            .map_err(|err| format!("{}: {err}", self.scheme))?;
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
    pub fn receive(
        &mut self,
        now: Instant,
        message: Bytes,
        out: &mut Vec<Bytes>,
    ) -> Result<(), LinkError> {
        let before = out.len();
        let result = self.receiver.receive(now, message, out);
        self.frames_in += (out.len() - before) as u64;
        result
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
