//! The conformance suite every [`Endpoint`] implementation must pass.
//!
//! One generic suite, instantiated per transport: a transport's tests
//! implement [`EndpointFactory`] (how to open a reachable endpoint, a
//! connecting one, and how two are linked) and generate one `#[test]` per
//! case with [`conformance_tests!`](crate::conformance_tests) or, for
//! transports with connect/accept links, all cases with
//! [`connected_conformance_tests!`](crate::connected_conformance_tests).
//!
//! Cases are plain functions generic over the factory. Those that work for
//! any link ([`exchange_both_ways`], [`large_frames`], ...) link two
//! endpoints with [`link`], which speaks both styles: `connect` plus
//! `Accepted`, or `insert_peer` with each other's `local_addr` for
//! connectionless endpoints. Cases about connections themselves (accept,
//! orderly close, connect failures) are named as such and apply to
//! [`LinkStyle::ConnectAccept`] only.
//!
//! Capabilities a transport may lack are switches on the factory, and a
//! transport's test list leaves out the cases they rule out; each case
//! asserts the switches it depends on, so a list cannot include a case
//! that does not apply:
//! - [`EndpointFactory::style`]: connection cases need
//!   [`LinkStyle::ConnectAccept`]. Connectionless endpoints (libfabric
//!   RDM/DGRAM) have no accept, no orderly close the other side hears of
//!   and no failed connect; [`close_locally`] is their close case.
//! - [`EndpointFactory::reliable`]: cases that count every frame sent
//!   under load ([`exchange_both_ways`], [`large_frames`], [`many_peers`],
//!   [`backpressure`]) need an endpoint that never drops (not DGRAM).
//! - [`EndpointFactory::sized_for`]: message endpoints carry one frame per
//!   message in buffers sized up front; [`large_frames`] asks the factory
//!   for buffers that hold its frames (streams need nothing).
//!
//! Every wait loop has a deadline ([`DEADLINE`]); a case that times out
//! panics with what it was waiting for. Nothing here measures speed.
//!
//! Enabled by the `conformance` feature.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::transport::{
    CloseReason, Endpoint, EndpointConfig, Event, LinkKeys, OutFrame, PeerId, Readiness, SendError,
    Transport, TransportError,
};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};

use crate::mem::MemTransport;
use crate::tcp::TcpTransport;

/// Longest any single wait in a case may take before the case fails.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// How two endpoints of a transport come to know each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkStyle {
    /// One side `connect`s to the other's address; the other sees
    /// `Event::Accepted` (mem, tcp).
    ConnectAccept,
    /// Each side `insert_peer`s the other's `local_addr`; no `Accepted`
    /// (libfabric RDM/DGRAM).
    InsertPeer,
}

/// What the suite needs to know about a transport.
pub trait EndpointFactory {
    /// A short name for failure messages.
    fn name(&self) -> String;

    /// How endpoints are linked.
    fn style(&self) -> LinkStyle;

    /// The configuration cases start from (they adjust limits on it).
    fn config(&self) -> EndpointConfig {
        EndpointConfig::default()
    }

    /// Open an endpoint others can reach; the factory sets `config.bind`
    /// (a fresh name, `127.0.0.1:0`, ...).
    fn open_bound(&self, config: EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError>;

    /// Open an endpoint that reaches out to others. Connectionless
    /// transports, whose endpoints are all addressable, keep the default.
    fn open_client(&self, config: EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        self.open_bound(config)
    }

    /// The text `connect` takes for an endpoint whose `local_addr` is `addr`.
    fn connect_addr(&self, addr: &[u8]) -> String {
        String::from_utf8_lossy(addr).into_owned()
    }

    /// An address nobody listens on, for the connect-failure case.
    fn unreachable_addr(&self) -> String {
        String::new()
    }

    /// Whether every frame a `send` accepted reaches a peer that keeps
    /// polling. Datagram endpoints drop under load (a receiver whose posted
    /// buffers are full loses what arrives), so cases that count every
    /// frame are not for them.
    fn reliable(&self) -> bool {
        true
    }

    /// `config` adjusted so its endpoints carry frames of `frame` bytes.
    /// Message transports size their buffers from options (and may bound
    /// their number to keep memory small); stream transports keep the
    /// default, which returns `config` unchanged.
    fn sized_for(&self, config: EndpointConfig, frame: usize) -> EndpointConfig {
        let _ = frame;
        config
    }
}

/// An endpoint under test and the events it has produced but a case has
/// not yet consumed.
pub struct Node {
    pub ep: Box<dyn Endpoint>,
    pub log: VecDeque<Event>,
    scratch: Vec<Event>,
}

impl Node {
    pub fn new(ep: Box<dyn Endpoint>) -> Self {
        Node {
            ep,
            log: VecDeque::new(),
            scratch: Vec::new(),
        }
    }

    /// Poll once; returns how many events arrived.
    pub fn pump(&mut self) -> usize {
        self.scratch.clear();
        self.ep.poll(&mut self.scratch).expect("poll failed");
        let n = self.scratch.len();
        self.log.extend(self.scratch.drain(..));
        n
    }

    /// Remove and return the first logged event matching `pred`.
    pub fn take(&mut self, pred: impl Fn(&Event) -> bool) -> Option<Event> {
        let at = self.log.iter().position(pred)?;
        self.log.remove(at)
    }

    /// Remove and return the frames logged from `peer`, in arrival order.
    pub fn take_frames(&mut self, peer: PeerId) -> Vec<Bytes> {
        let mut frames = Vec::new();
        self.log.retain(|event| match event {
            Event::Frame { peer: p, frame } if *p == peer => {
                frames.push(frame.clone());
                false
            }
            _ => true,
        });
        frames
    }

    /// Count logged frames from `peer`.
    pub fn frames_from(&self, peer: PeerId) -> usize {
        self.log
            .iter()
            .filter(|e| matches!(e, Event::Frame { peer: p, .. } if *p == peer))
            .count()
    }

    /// Whether a `Closed` for `peer` has been logged.
    pub fn closed(&self, peer: PeerId) -> Option<CloseReason> {
        self.log.iter().find_map(|e| match e {
            Event::Closed { peer: p, reason } if *p == peer => Some(reason.clone()),
            _ => None,
        })
    }
}

/// Poll every node until `done` holds, failing the case after [`DEADLINE`].
pub fn pump_until(nodes: &mut [Node], what: &str, mut done: impl FnMut(&mut [Node]) -> bool) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if done(nodes) {
            return;
        }
        if Instant::now() > deadline {
            let logs: Vec<usize> = nodes.iter().map(|n| n.log.len()).collect();
            panic!("timed out waiting for {what} (events logged per node: {logs:?})");
        }
        let mut got = 0;
        for node in nodes.iter_mut() {
            got += node.pump();
        }
        if got == 0 {
            thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Poll every node for a while, for states that must settle first.
pub fn pump_rounds(nodes: &mut [Node], rounds: usize) {
    for _ in 0..rounds {
        for node in nodes.iter_mut() {
            node.pump();
        }
        thread::sleep(Duration::from_millis(1));
    }
}

/// Link `nodes[client]` to `nodes[server]`; returns the peer ids on each
/// side: (server as seen by the client, client as seen by the server).
pub fn link<F: EndpointFactory + ?Sized>(
    f: &F,
    nodes: &mut [Node],
    client: usize,
    server: usize,
) -> (PeerId, PeerId) {
    let server_addr = nodes[server].ep.local_addr();
    match f.style() {
        LinkStyle::ConnectAccept => {
            let addr = f.connect_addr(&server_addr);
            let c = nodes[client]
                .ep
                .connect(&addr)
                .unwrap_or_else(|e| panic!("{}: connect to {addr}: {e}", f.name()));
            let mut accepted = None;
            pump_until(nodes, "Accepted", |nodes| {
                if let Some(Event::Accepted { peer, remote }) =
                    nodes[server].take(|e| matches!(e, Event::Accepted { .. }))
                {
                    assert!(!remote.is_empty(), "Accepted names no remote");
                    accepted = Some(peer);
                }
                accepted.is_some()
            });
            let s = accepted.expect("loop ends only once accepted");
            (c, s)
        }
        LinkStyle::InsertPeer => {
            let client_addr = nodes[client].ep.local_addr();
            let (client_keys, server_keys) = link_keys();
            let c = nodes[client]
                .ep
                .insert_peer(&server_addr, &client_keys)
                .unwrap_or_else(|e| panic!("{}: insert_peer: {e}", f.name()));
            let s = nodes[server]
                .ep
                .insert_peer(&client_addr, &server_keys)
                .unwrap_or_else(|e| panic!("{}: insert_peer: {e}", f.name()));
            (c, s)
        }
    }
}

static NEXT_LINK_ID: AtomicU64 = AtomicU64::new(1);

/// Matching keys for the two ends of a test link, with ids never used
/// before in this process (a session layer agrees real ones).
pub fn link_keys() -> (LinkKeys, LinkKeys) {
    let id = NEXT_LINK_ID.fetch_add(2, Ordering::Relaxed);
    let key = |n: u64| {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&n.to_le_bytes());
        key
    };
    let a = LinkKeys {
        send_key: key(id),
        receive_key: key(id + 1),
        local_id: id,
        remote_id: id + 1,
    };
    let b = LinkKeys {
        send_key: a.receive_key,
        receive_key: a.send_key,
        local_id: a.remote_id,
        remote_id: a.local_id,
    };
    (a, b)
}

/// A bound endpoint and a client endpoint, linked: nodes 0 (client) and 1
/// (server), with the peer ids from [`link`].
pub fn pair<F: EndpointFactory + ?Sized>(
    f: &F,
    client: EndpointConfig,
    server: EndpointConfig,
) -> (Vec<Node>, PeerId, PeerId) {
    let server = f.open_bound(server).expect("open bound endpoint");
    let client = f.open_client(client).expect("open client endpoint");
    let mut nodes = vec![Node::new(client), Node::new(server)];
    let (c, s) = link(f, &mut nodes, 0, 1);
    (nodes, c, s)
}

/// Length of the tag and sequence number at the start of a test payload.
pub const NUMBERED_HEADER: usize = 12;

fn fill_byte(tag: u32, seq: u64, i: usize) -> u8 {
    (u64::from(tag)
        .wrapping_mul(31)
        .wrapping_add(seq.wrapping_mul(7))
        .wrapping_add(i as u64)) as u8
}

/// A frame with the length prefix and a payload of `payload_len` bytes
/// (at least [`NUMBERED_HEADER`]): tag, sequence number, then a pattern
/// derived from both. Odd sequence numbers are sent in two parts (header,
/// then pattern) so both `OutFrame` shapes are exercised.
pub fn numbered(tag: u32, seq: u64, payload_len: usize) -> OutFrame {
    let payload_len = payload_len.max(NUMBERED_HEADER);
    let mut head = Vec::with_capacity(4 + NUMBERED_HEADER);
    head.extend_from_slice(&(payload_len as u32).to_le_bytes());
    head.extend_from_slice(&tag.to_le_bytes());
    head.extend_from_slice(&seq.to_le_bytes());
    let body: Vec<u8> = (0..payload_len - NUMBERED_HEADER)
        .map(|i| fill_byte(tag, seq, i))
        .collect();
    if seq % 2 == 1 && !body.is_empty() {
        OutFrame {
            head: head.into(),
            body: body.into(),
        }
    } else {
        head.extend_from_slice(&body);
        OutFrame::whole(head.into())
    }
}

/// Check a received [`numbered`] frame end to end; returns (tag, seq).
pub fn read_numbered(frame: &[u8]) -> (u32, u64) {
    assert!(
        frame.len() >= 4 + NUMBERED_HEADER,
        "frame of {} bytes is too short",
        frame.len()
    );
    let declared = u32::from_le_bytes(frame[..4].try_into().expect("4 bytes")) as usize;
    assert_eq!(declared, frame.len() - 4, "length prefix does not match");
    let tag = u32::from_le_bytes(frame[4..8].try_into().expect("4 bytes"));
    let seq = u64::from_le_bytes(frame[8..16].try_into().expect("8 bytes"));
    let bad = frame[16..]
        .iter()
        .enumerate()
        .find(|(i, b)| **b != fill_byte(tag, seq, *i));
    assert!(
        bad.is_none(),
        "payload of frame tag {tag} seq {seq} corrupted at {:?}",
        bad.map(|(i, _)| i)
    );
    (tag, seq)
}

/// A raw frame: prefix plus `payload`.
pub fn raw_frame(payload: &[u8]) -> OutFrame {
    let mut v = (payload.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(payload);
    OutFrame::whole(v.into())
}

/// Send, waiting (pumping every node) while the queue is full.
pub fn send_blocking(nodes: &mut [Node], from: usize, peer: PeerId, frame: OutFrame) {
    let mut frame = Some(frame);
    pump_until(nodes, "room to send", |nodes| {
        match nodes[from]
            .ep
            .send(peer, frame.take().expect("kept until sent"))
        {
            Ok(()) => true,
            Err(SendError::WouldBlock(back)) => {
                frame = Some(back);
                false
            }
            Err(e) => panic!("send to {peer} failed: {e}"),
        }
    });
}

// ---------------------------------------------------------------- cases

/// A connect is answered by one `Accepted` with the remote's description,
/// and the new link carries a frame each way.
pub fn connect_accepted<F: EndpointFactory + ?Sized>(f: &F) {
    assert_eq!(f.style(), LinkStyle::ConnectAccept);
    let (mut nodes, c, s) = pair(f, f.config(), f.config());
    assert!(
        !nodes[1].ep.local_addr().is_empty(),
        "bound endpoint has no address"
    );
    nodes[0].ep.send(c, numbered(1, 0, 32)).expect("send");
    nodes[1].ep.send(s, numbered(2, 0, 32)).expect("send");
    pump_until(&mut nodes, "one frame each way", |n| {
        n[0].frames_from(c) == 1 && n[1].frames_from(s) == 1
    });
    assert_eq!(read_numbered(&nodes[1].take_frames(s)[0]), (1, 0));
    assert_eq!(read_numbered(&nodes[0].take_frames(c)[0]), (2, 0));
    assert!(
        nodes
            .iter()
            .all(|n| !n.log.iter().any(|e| matches!(e, Event::Closed { .. }))),
        "no link may close"
    );
}

/// Connecting where nobody listens fails, at once or with `Closed { Error }`.
pub fn connect_to_nowhere_fails<F: EndpointFactory + ?Sized>(f: &F) {
    assert_eq!(f.style(), LinkStyle::ConnectAccept);
    let mut nodes = vec![Node::new(f.open_client(f.config()).expect("open"))];
    let addr = f.unreachable_addr();
    match nodes[0].ep.connect(&addr) {
        Err(_) => {}
        Ok(peer) => {
            pump_until(&mut nodes, "Closed after a failed connect", |n| {
                n[0].closed(peer).is_some()
            });
            let reason = nodes[0].closed(peer).expect("logged");
            assert!(
                matches!(reason, CloseReason::Error(ref text) if !text.is_empty()),
                "expected an error reason, got {reason:?}"
            );
            assert!(matches!(
                nodes[0].ep.send(peer, numbered(0, 0, 16)),
                Err(SendError::Closed(_))
            ));
        }
    }
}

/// Frames of varied sizes both ways at once arrive complete, in order,
/// attributed to the right peer.
pub fn exchange_both_ways<F: EndpointFactory + ?Sized>(f: &F) {
    assert!(
        f.reliable(),
        "{}: counts every frame; needs a reliable endpoint",
        f.name()
    );
    const N: u64 = 300;
    let (mut nodes, c, s) = pair(f, f.config(), f.config());
    for seq in 0..N {
        let len = 12 + (seq as usize * 37) % 1500;
        send_blocking(&mut nodes, 0, c, numbered(10, seq, len));
        send_blocking(&mut nodes, 1, s, numbered(20, seq, len));
    }
    pump_until(&mut nodes, "all frames both ways", |n| {
        n[0].frames_from(c) as u64 == N && n[1].frames_from(s) as u64 == N
    });
    for (node, peer, tag) in [(0, c, 20), (1, s, 10)] {
        let got: Vec<(u32, u64)> = nodes[node]
            .take_frames(peer)
            .iter()
            .map(|f| read_numbered(f))
            .collect();
        let want: Vec<(u32, u64)> = (0..N).map(|seq| (tag, seq)).collect();
        assert_eq!(got, want);
    }
}

/// Frames of 4 MiB (limit 8 MiB) cross intact both ways.
pub fn large_frames<F: EndpointFactory + ?Sized>(f: &F) {
    assert!(
        f.reliable(),
        "{}: counts every frame; needs a reliable endpoint",
        f.name()
    );
    const BIG: usize = 4 << 20;
    let config = EndpointConfig {
        max_frame: 8 << 20,
        queue_bytes: 32 << 20,
        ..f.config()
    };
    let config = f.sized_for(config, BIG);
    let (mut nodes, c, s) = pair(f, config.clone(), config);
    for seq in 0..3 {
        send_blocking(&mut nodes, 0, c, numbered(1, seq, BIG - 4));
        send_blocking(&mut nodes, 1, s, numbered(2, seq, BIG - 4 - seq as usize));
    }
    pump_until(&mut nodes, "three 4 MiB frames each way", |n| {
        n[0].frames_from(c) == 3 && n[1].frames_from(s) == 3
    });
    for (i, frame) in nodes[1].take_frames(s).iter().enumerate() {
        assert_eq!(frame.len(), BIG);
        assert_eq!(read_numbered(frame), (1, i as u64));
    }
    for (i, frame) in nodes[0].take_frames(c).iter().enumerate() {
        assert_eq!(frame.len(), BIG - i);
        assert_eq!(read_numbered(frame), (2, i as u64));
    }
}

/// A frame of exactly `max_frame` passes; one byte more is `TooLarge`.
pub fn too_large_rejected<F: EndpointFactory + ?Sized>(f: &F) {
    let config = EndpointConfig {
        max_frame: 64 << 10,
        ..f.config()
    };
    let (mut nodes, c, s) = pair(f, config.clone(), config);
    let max = nodes[0].ep.max_frame();
    assert!(
        max <= 64 << 10,
        "max_frame {max} above the configured limit"
    );
    match nodes[0].ep.send(c, numbered(3, 0, max - 3)) {
        Err(SendError::TooLarge { len, max: limit }) => {
            assert_eq!((len, limit), (max + 1, max))
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    nodes[0]
        .ep
        .send(c, numbered(3, 1, max - 4))
        .expect("a frame of exactly max_frame");
    pump_until(&mut nodes, "the max_frame frame", |n| {
        n[1].frames_from(s) == 1
    });
    let frame = &nodes[1].take_frames(s)[0];
    assert_eq!(frame.len(), max);
    assert_eq!(read_numbered(frame), (3, 1));
}

/// A frame whose length prefix does not match its length is refused by
/// `send`, and the link stays usable.
pub fn malformed_frame_rejected<F: EndpointFactory + ?Sized>(f: &F) {
    let (mut nodes, c, s) = pair(f, f.config(), f.config());
    let mut lying = raw_frame(b"twelve bytes").head.to_vec();
    lying[0] = 200;
    assert!(matches!(
        nodes[0].ep.send(c, OutFrame::whole(lying.into())),
        Err(SendError::Transport(_))
    ));
    assert!(matches!(
        nodes[0]
            .ep
            .send(c, OutFrame::whole(Bytes::from_static(b"ab"))),
        Err(SendError::Transport(_))
    ));
    nodes[0].ep.send(c, numbered(4, 0, 20)).expect("send");
    pump_until(&mut nodes, "the valid frame", |n| n[1].frames_from(s) == 1);
    assert_eq!(read_numbered(&nodes[1].take_frames(s)[0]), (4, 0));
}

/// Sending to a peer the endpoint never had is `Closed`.
pub fn unknown_peer_rejected<F: EndpointFactory + ?Sized>(f: &F) {
    let mut ep = f.open_client(f.config()).expect("open");
    assert!(matches!(
        ep.send(PeerId(u64::MAX - 1), numbered(0, 0, 16)),
        Err(SendError::Closed(_))
    ));
    assert_eq!(ep.queued_bytes(PeerId(u64::MAX - 1)), 0);
}

/// Fifty clients on one listener each exchange frames; every frame is
/// attributed to the peer that sent it, on both sides.
pub fn many_peers<F: EndpointFactory + ?Sized>(f: &F) {
    assert!(
        f.reliable(),
        "{}: counts every frame; needs a reliable endpoint",
        f.name()
    );
    const CLIENTS: usize = 50;
    const UP: u64 = 5;
    const DOWN: u64 = 3;
    let mut nodes = vec![Node::new(f.open_bound(f.config()).expect("open server"))];
    let mut links = Vec::new();
    for _ in 0..CLIENTS {
        nodes.push(Node::new(f.open_client(f.config()).expect("open client")));
        let client = nodes.len() - 1;
        links.push(link(f, &mut nodes, client, 0));
    }
    let distinct: std::collections::HashSet<PeerId> = links.iter().map(|(_, s)| *s).collect();
    assert_eq!(distinct.len(), CLIENTS, "server peer ids must be distinct");
    for seq in 0..UP {
        for (i, (c, _)) in links.iter().enumerate() {
            send_blocking(&mut nodes, i + 1, *c, numbered(i as u32, seq, 40 + i));
        }
    }
    pump_until(&mut nodes, "every client's frames at the server", |n| {
        links.iter().all(|(_, s)| n[0].frames_from(*s) as u64 == UP)
    });
    for (i, (_, s)) in links.iter().enumerate() {
        let got: Vec<(u32, u64)> = nodes[0]
            .take_frames(*s)
            .iter()
            .map(|f| read_numbered(f))
            .collect();
        let want: Vec<(u32, u64)> = (0..UP).map(|seq| (i as u32, seq)).collect();
        assert_eq!(got, want, "frames from client {i}");
        for seq in 0..DOWN {
            send_blocking(&mut nodes, 0, *s, numbered(1000 + i as u32, seq, 24));
        }
    }
    pump_until(&mut nodes, "every reply at its client", |n| {
        links
            .iter()
            .enumerate()
            .all(|(i, (c, _))| n[i + 1].frames_from(*c) as u64 == DOWN)
    });
    for (i, (c, _)) in links.iter().enumerate() {
        let got: Vec<(u32, u64)> = nodes[i + 1]
            .take_frames(*c)
            .iter()
            .map(|f| read_numbered(f))
            .collect();
        let want: Vec<(u32, u64)> = (0..DOWN).map(|seq| (1000 + i as u32, seq)).collect();
        assert_eq!(got, want, "replies to client {i}");
    }
    // A send pushed back (and retried by `send_blocking`) is followed by
    // `Writable`, as the contract says; nothing else may be left.
    let stray: Vec<_> = nodes
        .iter()
        .flat_map(|n| n.log.iter())
        .filter(|event| !matches!(event, Event::Writable { .. }))
        .collect();
    assert!(stray.is_empty(), "no stray events expected: {stray:?}");
}

/// Closing a connection: frames queued before `close` still arrive, then
/// the closer sees `Closed { Local }` and the other side
/// `Closed { PeerClosed }`; sends after that fail with `Closed` on both
/// sides. Then the same with the accepting side closing.
pub fn close_by_either_side<F: EndpointFactory + ?Sized>(f: &F) {
    assert_eq!(f.style(), LinkStyle::ConnectAccept);
    const N: u64 = 100;
    for closer in [0usize, 1] {
        let (mut nodes, c, s) = pair(f, f.config(), f.config());
        let ids = [c, s];
        let other = 1 - closer;
        // Enough data that a socket cannot take it all at once: the close
        // must keep flushing after it returns.
        for seq in 0..N {
            nodes[closer]
                .ep
                .send(ids[closer], numbered(7, seq, 64 << 10))
                .expect("queue within bounds");
        }
        nodes[closer].ep.close(ids[closer]);
        assert!(matches!(
            nodes[closer].ep.send(ids[closer], numbered(7, N, 16)),
            Err(SendError::Closed(_))
        ));
        pump_until(&mut nodes, "Closed on both sides", |n| {
            n[closer].closed(ids[closer]).is_some() && n[other].closed(ids[other]).is_some()
        });
        assert_eq!(nodes[closer].closed(ids[closer]), Some(CloseReason::Local));
        assert_eq!(
            nodes[other].closed(ids[other]),
            Some(CloseReason::PeerClosed)
        );
        // Every frame, in order, and all before the Closed event.
        let before_close: Vec<(u32, u64)> = nodes[other]
            .log
            .iter()
            .take_while(|e| !matches!(e, Event::Closed { .. }))
            .filter_map(|e| match e {
                Event::Frame { peer, frame } if *peer == ids[other] => Some(read_numbered(frame)),
                _ => None,
            })
            .collect();
        let want: Vec<(u32, u64)> = (0..N).map(|seq| (7, seq)).collect();
        assert_eq!(before_close, want, "closer {closer}");
        assert!(matches!(
            nodes[other].ep.send(ids[other], numbered(8, 0, 16)),
            Err(SendError::Closed(_))
        ));
        // Nothing more is reported for the closed ids.
        pump_rounds(&mut nodes, 5);
        for (node, id) in [(closer, ids[closer]), (other, ids[other])] {
            let mentions = nodes[node]
                .log
                .iter()
                .filter(|e| match e {
                    Event::Closed { peer, .. }
                    | Event::Writable { peer }
                    | Event::ReadHeld { peer } => *peer == id,
                    Event::Frame { .. } | Event::Frames { .. } | Event::Accepted { .. } => false,
                })
                .count();
            assert_eq!(mentions, 1, "exactly one Closed for {id} on node {node}");
        }
    }
}

/// Dropping an endpoint closes its links: the other side sees `Closed`
/// (not `Local`) and its sends fail.
pub fn drop_closes_links<F: EndpointFactory + ?Sized>(f: &F) {
    assert_eq!(f.style(), LinkStyle::ConnectAccept);
    let (mut nodes, _c, s) = pair(f, f.config(), f.config());
    let client = nodes.remove(0);
    drop(client);
    pump_until(&mut nodes, "Closed after the client dropped", |n| {
        n[0].closed(s).is_some()
    });
    assert_ne!(nodes[0].closed(s), Some(CloseReason::Local));
    assert!(matches!(
        nodes[0].ep.send(s, numbered(0, 0, 16)),
        Err(SendError::Closed(_))
    ));
}

/// A sender whose receiver does not poll fills up to `WouldBlock`; once
/// the receiver drains, `Writable` follows and every accepted frame
/// arrives once, in order.
pub fn backpressure<F: EndpointFactory + ?Sized>(f: &F) {
    assert!(
        f.reliable(),
        "{}: counts every frame; needs a reliable endpoint",
        f.name()
    );
    const FRAME: usize = 8 << 10;
    const AFTER: u64 = 200;
    let sender_config = EndpointConfig {
        queue_frames: 32,
        queue_bytes: 128 << 10,
        ..f.config()
    };
    let (mut nodes, c, s) = pair(f, sender_config, f.config());
    let mut seq = 0u64;
    let mut refused: Option<OutFrame> = None;

    // Fill: send until refused, poll only the sender, and repeat while it
    // reports room; stop once it stays full for a while.
    let deadline = Instant::now() + DEADLINE;
    'fill: loop {
        assert!(Instant::now() < deadline, "never filled up");
        loop {
            let frame = refused.take().unwrap_or_else(|| numbered(5, seq, FRAME));
            match nodes[0].ep.send(c, frame) {
                Ok(()) => seq += 1,
                Err(SendError::WouldBlock(back)) => {
                    refused = Some(back);
                    break;
                }
                Err(e) => panic!("send failed: {e}"),
            }
        }
        for _ in 0..50 {
            nodes[0].pump();
            if nodes[0]
                .take(|e| matches!(e, Event::Writable { peer } if *peer == c))
                .is_some()
            {
                continue 'fill;
            }
            thread::sleep(Duration::from_millis(1));
        }
        break;
    }
    let queued = nodes[0].ep.queued_bytes(c);
    assert!(queued > 0, "a full sender has bytes queued");
    assert!(
        queued <= (128 << 10) + FRAME + 64,
        "queue of {queued} bytes exceeds its bound"
    );
    assert!(
        !nodes[1]
            .log
            .iter()
            .any(|e| matches!(e, Event::Frame { .. })),
        "the receiver has not polled yet"
    );

    // Drain: the receiver polls; the sender must get Writable.
    pump_until(&mut nodes, "Writable after the receiver drained", |n| {
        n[0].take(|e| matches!(e, Event::Writable { peer } if *peer == c))
            .is_some()
    });
    let frame = refused.take().expect("a refused frame is held");
    nodes[0].ep.send(c, frame).expect("room after Writable");
    seq += 1;
    for _ in 0..AFTER {
        send_blocking(&mut nodes, 0, c, numbered(5, seq, FRAME));
        seq += 1;
    }
    let total = seq;
    pump_until(&mut nodes, "every accepted frame", |n| {
        n[1].frames_from(s) as u64 == total
    });
    let got: Vec<u64> = nodes[1]
        .take_frames(s)
        .iter()
        .map(|f| read_numbered(f).1)
        .collect();
    assert_eq!(got, (0..total).collect::<Vec<_>>());
}

fn fd_readable(poll: &mut Poll, events: &mut Events, fd: RawFd, rearm: bool) -> bool {
    if rearm {
        // Re-registering reports the descriptor's current state afresh,
        // which turns mio's edge-triggered view into a level check.
        poll.registry()
            .reregister(&mut SourceFd(&fd), Token(7), Interest::READABLE)
            .expect("reregister");
    }
    poll.poll(events, Some(Duration::ZERO)).expect("poll");
    events.iter().any(|e| e.token() == Token(7))
}

/// Poll `node` until `prepare_wait` allows a wait (at once for endpoints
/// with `Readiness::Fd`).
fn settle_for_wait(node: &mut Node) {
    let deadline = Instant::now() + DEADLINE;
    while !node.ep.prepare_wait() {
        assert!(
            Instant::now() < deadline,
            "prepare_wait never allowed a wait"
        );
        node.pump();
    }
}

/// The readiness descriptor is quiet while there is nothing to do, becomes
/// readable when a frame arrives, and is quiet again once polled. For
/// `Readiness::PollOrWait` "nothing to do" holds once `prepare_wait` has
/// allowed a wait, as its contract says; endpoints that must be polled
/// (`Readiness::MustPoll`) have no descriptor and are not for this case.
pub fn readiness_fd<F: EndpointFactory + ?Sized>(f: &F) {
    let (mut nodes, c, s) = pair(f, f.config(), f.config());
    let fd = match nodes[1].ep.readiness() {
        Readiness::Fd(fd) | Readiness::PollOrWait(fd) => fd,
        Readiness::MustPoll => panic!("{}: expected a readiness descriptor", f.name()),
    };
    pump_rounds(&mut nodes, 10);
    nodes[1].log.clear();
    settle_for_wait(&mut nodes[1]);
    let mut poll = Poll::new().expect("poll");
    let mut events = Events::with_capacity(4);
    poll.registry()
        .register(&mut SourceFd(&fd), Token(7), Interest::READABLE)
        .expect("register");
    assert!(
        !fd_readable(&mut poll, &mut events, fd, false),
        "descriptor readable while idle"
    );

    nodes[0].ep.send(c, numbered(9, 0, 100)).expect("send");
    let deadline = Instant::now() + DEADLINE;
    loop {
        assert!(
            Instant::now() < deadline,
            "descriptor never became readable"
        );
        // The sender may need polls to put the frame on the wire; the
        // receiver is not polled, only watched.
        nodes[0].pump();
        poll.poll(&mut events, Some(Duration::from_millis(5)))
            .expect("poll");
        if events.iter().any(|e| e.token() == Token(7)) {
            break;
        }
    }
    // Both sides are polled now: providers that set up a connection or
    // hand data over in steps (rendezvous) need the sender's progress too.
    pump_until(&mut nodes, "the frame", |n| n[1].frames_from(s) == 1);
    assert_eq!(read_numbered(&nodes[1].take_frames(s)[0]), (9, 0));
    // One more poll to consume wake-ups raced in during the last one.
    nodes[1].pump();
    settle_for_wait(&mut nodes[1]);
    assert!(
        !fd_readable(&mut poll, &mut events, fd, true),
        "descriptor still readable after everything was polled"
    );
}

/// Connectionless endpoints: `close` forgets a peer at once. The closer
/// sees one `Closed { Local }`, its sends to the old id fail with `Closed`
/// and nothing stays queued for it; inserting the address again (a new
/// link, with new keys on both sides) gives a new id, over which frames
/// cross both ways. (The other side hears nothing: there is no connection
/// to end, so that is not checked either way.)
pub fn close_locally<F: EndpointFactory + ?Sized>(f: &F) {
    assert_eq!(f.style(), LinkStyle::InsertPeer);
    let (mut nodes, c, s) = pair(f, f.config(), f.config());
    nodes[0].ep.send(c, numbered(11, 0, 40)).expect("send");
    pump_until(&mut nodes, "a frame before the close", |n| {
        n[1].frames_from(s) == 1
    });
    assert_eq!(read_numbered(&nodes[1].take_frames(s)[0]), (11, 0));

    nodes[0].ep.close(c);
    assert!(matches!(
        nodes[0].ep.send(c, numbered(11, 1, 16)),
        Err(SendError::Closed(p)) if p == c
    ));
    assert_eq!(nodes[0].ep.queued_bytes(c), 0);
    pump_until(&mut nodes, "Closed after close", |n| {
        n[0].closed(c).is_some()
    });
    assert_eq!(nodes[0].closed(c), Some(CloseReason::Local));
    pump_rounds(&mut nodes, 5);
    let mentions = nodes[0]
        .log
        .iter()
        .filter(|e| matches!(e, Event::Closed { peer, .. } if *peer == c))
        .count();
    assert_eq!(mentions, 1, "exactly one Closed for {c}");

    let server_addr = nodes[1].ep.local_addr();
    let client_addr = nodes[0].ep.local_addr();
    let (client_keys, server_keys) = link_keys();
    let again = nodes[0]
        .ep
        .insert_peer(&server_addr, &client_keys)
        .unwrap_or_else(|e| panic!("{}: insert_peer again: {e}", f.name()));
    assert_ne!(again, c, "a closed id is not reused");
    nodes[1].ep.close(s);
    let s = nodes[1]
        .ep
        .insert_peer(&client_addr, &server_keys)
        .unwrap_or_else(|e| panic!("{}: insert_peer again: {e}", f.name()));
    nodes[0].ep.send(again, numbered(12, 0, 40)).expect("send");
    nodes[1].ep.send(s, numbered(13, 0, 40)).expect("send");
    pump_until(&mut nodes, "a frame each way after re-inserting", |n| {
        n[1].frames_from(s) == 1 && n[0].frames_from(again) == 1
    });
    assert_eq!(read_numbered(&nodes[1].take_frames(s)[0]), (12, 0));
    assert_eq!(read_numbered(&nodes[0].take_frames(again)[0]), (13, 0));
}

// ------------------------------------------------------------ factories

static NEXT_NAME: AtomicU64 = AtomicU64::new(1);

/// The built-in `mem` transport, one fresh name per bound endpoint.
#[derive(Debug, Default)]
pub struct MemFactory;

impl MemFactory {
    fn fresh_name() -> String {
        format!(
            "conformance-{}-{}",
            std::process::id(),
            NEXT_NAME.fetch_add(1, Ordering::Relaxed)
        )
    }
}

impl EndpointFactory for MemFactory {
    fn name(&self) -> String {
        crate::mem::SCHEME.into()
    }
    fn style(&self) -> LinkStyle {
        LinkStyle::ConnectAccept
    }
    fn open_bound(&self, config: EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        MemTransport.open(&EndpointConfig {
            bind: Some(Self::fresh_name()),
            ..config
        })
    }
    fn open_client(&self, config: EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        MemTransport.open(&EndpointConfig {
            bind: None,
            ..config
        })
    }
    fn unreachable_addr(&self) -> String {
        Self::fresh_name()
    }
}

/// The built-in `tcp` transport on loopback, ports chosen by the system.
#[derive(Debug, Default)]
pub struct TcpFactory;

impl EndpointFactory for TcpFactory {
    fn name(&self) -> String {
        crate::tcp::SCHEME.into()
    }
    fn style(&self) -> LinkStyle {
        LinkStyle::ConnectAccept
    }
    fn open_bound(&self, config: EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        TcpTransport.open(&EndpointConfig {
            bind: Some("127.0.0.1:0".into()),
            ..config
        })
    }
    fn open_client(&self, config: EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        TcpTransport.open(&EndpointConfig {
            bind: None,
            ..config
        })
    }
    fn unreachable_addr(&self) -> String {
        // A port that was free a moment ago: bound, read, released.
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("probe bind");
        let addr = probe.local_addr().expect("probe addr");
        drop(probe);
        addr.to_string()
    }
}

/// The `tcp` transport with TLS on loopback: listeners present a
/// certificate for `127.0.0.1` from a test CA, and with `mutual` ask every
/// client for one from the same CA; clients verify the server against it
/// (and present theirs).
#[derive(Debug, Default)]
pub struct TlsFactory {
    pub mutual: bool,
}

impl TlsFactory {
    fn with_options(&self, config: EndpointConfig, server: bool) -> EndpointConfig {
        let pki = pki::shared();
        let mut options = config.options;
        options.push(("tls_ca".into(), pki.ca.clone()));
        if server {
            options.push(("tls_cert".into(), pki.server_cert.clone()));
            options.push(("tls_key".into(), pki.server_key.clone()));
            if self.mutual {
                options.push(("tls_verify_clients".into(), "true".into()));
            }
        } else if self.mutual {
            options.push(("tls_cert".into(), pki.client_cert.clone()));
            options.push(("tls_key".into(), pki.client_key.clone()));
        }
        EndpointConfig { options, ..config }
    }
}

impl EndpointFactory for TlsFactory {
    fn name(&self) -> String {
        if self.mutual {
            "tcp+mutual-tls"
        } else {
            "tcp+tls"
        }
        .into()
    }
    fn style(&self) -> LinkStyle {
        LinkStyle::ConnectAccept
    }
    fn open_bound(&self, config: EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        TcpFactory.open_bound(self.with_options(config, true))
    }
    fn open_client(&self, config: EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        TcpFactory.open_client(self.with_options(config, false))
    }
    fn unreachable_addr(&self) -> String {
        TcpFactory.unreachable_addr()
    }
}

/// Certificates for tests, made with rcgen and written as PEM files to a
/// directory of the system's temporary directory.
pub mod pki {
    use std::path::{Path, PathBuf};
    use std::sync::OnceLock;

    use rcgen::{
        BasicConstraints, Certificate, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose,
    };

    /// An authority, with its key, to issue certificates from.
    pub struct Authority {
        cert: Certificate,
        key: KeyPair,
        /// Its certificate's PEM file.
        pub pem: String,
    }

    fn write(dir: &Path, name: &str, text: &str) -> String {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("test PEM written");
        path.to_string_lossy().into_owned()
    }

    impl Authority {
        /// A new self-signed CA named `name`, its PEM in `dir`.
        pub fn new(dir: &Path, name: &str) -> Authority {
            let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            params.distinguished_name.push(DnType::CommonName, name);
            let key = KeyPair::generate().expect("CA key");
            let cert = params.self_signed(&key).expect("CA certificate");
            let pem = write(dir, &format!("{name}.pem"), &cert.pem());
            Authority { cert, key, pem }
        }

        /// A certificate for `names` (DNS names or IP addresses) with
        /// common name `subject`, written as `{file}.pem` and
        /// `{file}.key` in `dir`; expired long ago when `expired`.
        /// Returns the two paths.
        pub fn issue(
            &self,
            dir: &Path,
            file: &str,
            subject: &str,
            names: &[&str],
            expired: bool,
        ) -> (String, String) {
            let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
            let mut params = CertificateParams::new(names).expect("certificate params");
            params.distinguished_name.push(DnType::CommonName, subject);
            if expired {
                params.not_before = rcgen::date_time_ymd(2001, 1, 1);
                params.not_after = rcgen::date_time_ymd(2002, 1, 1);
            }
            let key = KeyPair::generate().expect("key");
            let cert = params
                .signed_by(&key, &self.cert, &self.key)
                .expect("certificate");
            (
                write(dir, &format!("{file}.pem"), &cert.pem()),
                write(dir, &format!("{file}.key"), &key.serialize_pem()),
            )
        }
    }

    /// A CA, a server certificate for `127.0.0.1` and `localhost`, and a
    /// client certificate (subject `client`), as PEM file paths.
    pub struct Pki {
        pub dir: PathBuf,
        pub authority: Authority,
        pub ca: String,
        pub server_cert: String,
        pub server_key: String,
        pub client_cert: String,
        pub client_key: String,
    }

    impl Pki {
        /// A fresh set in a new directory named after `label`.
        pub fn new(label: &str) -> Pki {
            let dir = std::env::temp_dir().join(format!(
                "efabus-pki-{label}-{}-{:?}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos()
            ));
            std::fs::create_dir_all(&dir).expect("PKI directory");
            let authority = Authority::new(&dir, &format!("efabus-{label}-ca"));
            let (server_cert, server_key) =
                authority.issue(&dir, "server", "server", &["127.0.0.1", "localhost"], false);
            let (client_cert, client_key) =
                authority.issue(&dir, "client", "client", &["client.local"], false);
            Pki {
                ca: authority.pem.clone(),
                dir,
                authority,
                server_cert,
                server_key,
                client_cert,
                client_key,
            }
        }
    }

    /// One set for the whole test process.
    pub fn shared() -> &'static Pki {
        static PKI: OnceLock<Pki> = OnceLock::new();
        PKI.get_or_init(|| Pki::new("shared"))
    }
}

/// One `#[test]` per named case for a factory expression:
/// `conformance_tests!(MyFactory => exchange_both_ways, large_frames);`
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr => $($case:ident),+ $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::conformance::$case(&$factory);
            }
        )+
    };
}

/// Every case, for transports whose links are made by connect/accept.
#[macro_export]
macro_rules! connected_conformance_tests {
    ($factory:expr) => {
        $crate::conformance_tests!($factory =>
            connect_accepted,
            connect_to_nowhere_fails,
            exchange_both_ways,
            large_frames,
            too_large_rejected,
            malformed_frame_rejected,
            unknown_peer_rejected,
            many_peers,
            close_by_either_side,
            drop_closes_links,
            backpressure,
            readiness_fd,
        );
    };
}
