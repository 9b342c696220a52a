//! The in-process transport (scheme `mem`).
//!
//! Endpoints in one process reach each other by name: an endpoint opened
//! with `bind = Some("name")` registers the name in a process-global table
//! (until it is dropped), and `connect("name")` from any other endpoint
//! creates a link pair between the two.
//!
//! Frames cross as [`Bytes`] handles: a frame whose [`OutFrame::body`] is
//! empty is delivered as its `head` itself, without a copy. A frame in two
//! parts (a header with a payload behind it) is copied once, joined into
//! one buffer on `send`, because an [`Event::Frame`] carries one contiguous
//! `Bytes` (and receivers read frames in place from it). So a payload a
//! `Client` sends over `mem` is copied once per hop; only in-process
//! subscribers of an embedded broker get the publisher's buffer itself.
//!
//! Links are ordered and reliable. The frames a side has sent and the
//! receiver has not yet taken with `poll` count against the sender's
//! `queue_frames` / `queue_bytes`; past them `send` returns
//! [`SendError::WouldBlock`], and an [`Event::Writable`] follows once the
//! receiver has drained the link to half of both bounds.
//!
//! Readiness: every endpoint owns a `mio::Poll` with a `mio::Waker` (an
//! eventfd) registered in it, and exposes the poll's epoll descriptor as
//! [`Readiness::Fd`]. Whoever hands the endpoint work (a peer's frame,
//! connection or close; its own `close`) wakes it, which makes that
//! descriptor readable until the next `poll` consumes the wake-up.
//!
//! Closing behaves like TCP: frames sent before `close` are still delivered,
//! then the peer sees `Closed { PeerClosed }`; dropping an endpoint closes
//! all its links the same way and frees its name.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use efabus_core::caps::FabricInfo;
use efabus_core::transport::{
    CloseReason, Endpoint, EndpointConfig, Event, OutFrame, PeerId, Readiness, SendError,
    Transport, TransportError,
};
use mio::{Events, Poll, Token, Waker};
use parking_lot::Mutex;

use crate::prefix;

/// The scheme naming this transport in endpoint strings.
pub const SCHEME: &str = "mem";

/// Names bound by live endpoints of this process.
static NAMES: Mutex<BTreeMap<String, Weak<Shared>>> = Mutex::new(BTreeMap::new());

/// Source of link ids, unique in the process.
static NEXT_LINK: AtomicU64 = AtomicU64::new(1);

/// Source of labels for endpoints without a name.
static NEXT_ANON: AtomicU64 = AtomicU64::new(1);

const WAKER: Token = Token(0);

/// The in-process transport. Stateless: endpoints meet through the
/// process-global name table.
#[derive(Debug, Default, Clone, Copy)]
pub struct MemTransport;

impl MemTransport {
    pub fn new() -> Self {
        MemTransport
    }

    /// Open an endpoint with its concrete type.
    pub fn open_mem(&self, config: &EndpointConfig) -> Result<MemEndpoint, TransportError> {
        MemEndpoint::open(config)
    }
}

impl Transport for MemTransport {
    fn scheme(&self) -> &str {
        SCHEME
    }

    fn infos(&self) -> Result<Vec<FabricInfo>, TransportError> {
        Ok(vec![FabricInfo::mem()])
    }

    fn open(&self, config: &EndpointConfig) -> Result<Box<dyn Endpoint>, TransportError> {
        Ok(Box::new(MemEndpoint::open(config)?))
    }
}

/// Which end of a link: the side that connected or the side that accepted.
type Side = usize;
const CONNECTOR: Side = 0;
const ACCEPTOR: Side = 1;

/// What one endpoint hands another.
enum Incoming {
    /// A new link; the receiver is its acceptor.
    Accept { link: Arc<Link>, remote: String },
    /// A frame for the receiver's end `to` of link `link`.
    Frame { link: u64, to: Side, frame: Bytes },
    /// The other end of the link closed.
    Closed { link: u64, to: Side },
    /// The receiver's end `to` may send again.
    Writable { link: u64, to: Side },
}

struct Inbox {
    /// False once the owning endpoint is dropped: nothing more is accepted,
    /// so nothing can be lost in a queue nobody reads.
    alive: bool,
    queue: VecDeque<Incoming>,
}

/// The part of an endpoint its peers can reach.
struct Shared {
    waker: Waker,
    label: String,
    max_frame: usize,
    queue_frames: usize,
    queue_bytes: usize,
    inbox: Mutex<Inbox>,
}

impl Shared {
    /// Hand over one item; false when the endpoint is gone. Wakes the owner
    /// only when the inbox was empty: the owner drains the whole inbox on
    /// each poll, so one wake-up covers everything queued behind it.
    fn deliver(&self, item: Incoming) -> bool {
        let was_empty = {
            let mut inbox = self.inbox.lock();
            if !inbox.alive {
                return false;
            }
            let was_empty = inbox.queue.is_empty();
            inbox.queue.push_back(item);
            was_empty
        };
        if was_empty {
            wake(&self.waker);
        }
        true
    }
}

fn wake(waker: &Waker) {
    if let Err(err) = waker.wake() {
        // Only fails if the eventfd is broken; the owner then learns of the
        // work on its next poll, whenever that happens.
        tracing::warn!("mem: cannot wake endpoint: {err}");
    }
}

struct LinkState {
    /// Side `i` has not closed its end.
    open: [bool; 2],
    /// Frames sent by side `i` that the other side has not taken yet.
    frames: [usize; 2],
    bytes: [usize; 2],
    /// Side `i` was refused with `WouldBlock` and waits for `Writable`.
    blocked: [bool; 2],
}

/// A link pair between two endpoints (possibly the same one).
struct Link {
    id: u64,
    ends: [Weak<Shared>; 2],
    state: Mutex<LinkState>,
}

struct PeerLink {
    link: Arc<Link>,
    side: Side,
}

/// An endpoint of the in-process transport. See the module docs.
pub struct MemEndpoint {
    shared: Arc<Shared>,
    poll: Poll,
    events: Events,
    name: Option<String>,
    max_frame: usize,
    queue_frames: usize,
    queue_bytes: usize,
    peers: HashMap<PeerId, PeerLink>,
    by_link: HashMap<(u64, Side), PeerId>,
    next_peer: u64,
    pending: VecDeque<Event>,
}

impl std::fmt::Debug for MemEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemEndpoint")
            .field("label", &self.shared.label)
            .field("peers", &self.peers.len())
            .finish()
    }
}

impl MemEndpoint {
    /// Open an endpoint; with `config.bind` set, register that name.
    pub fn open(config: &EndpointConfig) -> Result<Self, TransportError> {
        let poll = Poll::new()?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        let label = match &config.bind {
            Some(name) => {
                check_name(name)?;
                name.clone()
            }
            None => format!("anonymous#{}", NEXT_ANON.fetch_add(1, Ordering::Relaxed)),
        };
        let shared = Arc::new(Shared {
            waker,
            label,
            max_frame: config.max_frame,
            queue_frames: config.queue_frames.max(1),
            queue_bytes: config.queue_bytes.max(1),
            inbox: Mutex::new(Inbox {
                alive: true,
                queue: VecDeque::new(),
            }),
        });
        if let Some(name) = &config.bind {
            let mut names = NAMES.lock();
            if names.get(name).and_then(Weak::upgrade).is_some() {
                return Err(TransportError::Bind {
                    addr: name.clone(),
                    source: io::Error::new(
                        io::ErrorKind::AddrInUse,
                        "another mem endpoint of this process holds the name",
                    ),
                });
            }
            names.insert(name.clone(), Arc::downgrade(&shared));
        }
        Ok(MemEndpoint {
            shared,
            poll,
            events: Events::with_capacity(8),
            name: config.bind.clone(),
            max_frame: config.max_frame,
            queue_frames: config.queue_frames.max(1),
            queue_bytes: config.queue_bytes.max(1),
            peers: HashMap::new(),
            by_link: HashMap::new(),
            next_peer: 1,
            pending: VecDeque::new(),
        })
    }

    fn new_peer(&mut self, link: Arc<Link>, side: Side) -> PeerId {
        let peer = PeerId(self.next_peer);
        self.next_peer += 1;
        self.by_link.insert((link.id, side), peer);
        self.peers.insert(peer, PeerLink { link, side });
        peer
    }

    fn forget(&mut self, peer: PeerId) -> Option<PeerLink> {
        let gone = self.peers.remove(&peer)?;
        self.by_link.remove(&(gone.link.id, gone.side));
        Some(gone)
    }

    fn push_local(&mut self, event: Event) {
        self.pending.push_back(event);
        wake(&self.shared.waker);
    }

    fn take_inbox(&self) -> VecDeque<Incoming> {
        std::mem::take(&mut self.shared.inbox.lock().queue)
    }

    /// The receiver took a frame sent by `from` over `link`: release its
    /// room, and tell a blocked sender once the link is down to half.
    fn released(link: &Link, from: Side, len: usize) {
        let sender = link.ends[from].upgrade();
        let notify = {
            let mut st = link.state.lock();
            st.frames[from] = st.frames[from].saturating_sub(1);
            st.bytes[from] = st.bytes[from].saturating_sub(len);
            let below_half = sender.as_ref().is_some_and(|s| {
                st.frames[from] <= s.queue_frames / 2 && st.bytes[from] <= s.queue_bytes / 2
            });
            if st.blocked[from] && st.open[from] && below_half {
                st.blocked[from] = false;
                true
            } else {
                false
            }
        };
        if notify {
            if let Some(sender) = sender {
                sender.deliver(Incoming::Writable {
                    link: link.id,
                    to: from,
                });
            }
        }
    }
}

/// Close our end of a link and tell the other end.
fn close_end(link: &Link, side: Side) {
    let other = 1 - side;
    let other_open = {
        let mut st = link.state.lock();
        st.open[side] = false;
        st.open[other]
    };
    if other_open {
        if let Some(peer) = link.ends[other].upgrade() {
            peer.deliver(Incoming::Closed {
                link: link.id,
                to: other,
            });
        }
    }
}

fn check_name(name: &str) -> Result<(), TransportError> {
    if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(TransportError::InvalidAddress {
            addr: name.to_string(),
            reason: "a mem name is non-empty text without whitespace".into(),
        });
    }
    Ok(())
}

impl Endpoint for MemEndpoint {
    fn scheme(&self) -> &str {
        SCHEME
    }

    fn local_addr(&self) -> Vec<u8> {
        self.name.clone().unwrap_or_default().into_bytes()
    }

    fn max_frame(&self) -> usize {
        self.max_frame
    }

    /// Links at once: there is no handshake in-process, so an absent name is
    /// an immediate `Connect` error (connection refused).
    fn connect(&mut self, addr: &str) -> Result<PeerId, TransportError> {
        check_name(addr)?;
        let refused = || TransportError::Connect {
            addr: addr.to_string(),
            source: io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "no mem endpoint of this process is bound to that name",
            ),
        };
        let target = NAMES
            .lock()
            .get(addr)
            .and_then(Weak::upgrade)
            .ok_or_else(refused)?;
        let link = Arc::new(Link {
            id: NEXT_LINK.fetch_add(1, Ordering::Relaxed),
            ends: [Arc::downgrade(&self.shared), Arc::downgrade(&target)],
            state: Mutex::new(LinkState {
                open: [true, true],
                frames: [0; 2],
                bytes: [0; 2],
                blocked: [false; 2],
            }),
        });
        let peer = self.new_peer(link.clone(), CONNECTOR);
        let accepted = target.deliver(Incoming::Accept {
            link,
            remote: self.shared.label.clone(),
        });
        if !accepted {
            self.forget(peer);
            return Err(refused());
        }
        Ok(peer)
    }

    fn send(&mut self, peer: PeerId, frame: OutFrame) -> Result<(), SendError> {
        let Some(entry) = self.peers.get(&peer) else {
            return Err(SendError::Closed(peer));
        };
        let (link, side) = (&entry.link, entry.side);
        let other = 1 - side;
        let Some(receiver) = link.ends[other].upgrade() else {
            return Err(SendError::Closed(peer));
        };
        prefix::check(&frame, self.max_frame.min(receiver.max_frame))?;
        let len = frame.len();
        {
            let mut st = link.state.lock();
            if !st.open[other] {
                return Err(SendError::Closed(peer));
            }
            // An empty link always takes one frame, so a frame larger than
            // the byte bound (but within max_frame) can still pass.
            let full = st.frames[side] > 0
                && (st.frames[side] >= self.queue_frames
                    || st.bytes[side] + len > self.queue_bytes);
            if full {
                st.blocked[side] = true;
                return Err(SendError::WouldBlock(frame));
            }
            // Counted before the frame is visible, so the receiver never
            // releases room that was not taken.
            st.frames[side] += 1;
            st.bytes[side] += len;
        }
        let bytes = frame.to_bytes();
        let delivered = receiver.deliver(Incoming::Frame {
            link: link.id,
            to: other,
            frame: bytes,
        });
        if !delivered {
            return Err(SendError::Closed(peer));
        }
        Ok(())
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), TransportError> {
        // Consume the wake-ups first, then the work: a wake-up that lands
        // after this point leaves the descriptor readable for the next round.
        match self.poll.poll(&mut self.events, Some(Duration::ZERO)) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err.into()),
        }
        events.extend(self.pending.drain(..));
        for item in self.take_inbox() {
            match item {
                Incoming::Accept { link, remote } => {
                    let peer = self.new_peer(link, ACCEPTOR);
                    events.push(Event::Accepted { peer, remote });
                }
                Incoming::Frame { link, to, frame } => {
                    let Some(&peer) = self.by_link.get(&(link, to)) else {
                        // Closed here already; the frame is dropped like
                        // bytes arriving on a closed socket.
                        continue;
                    };
                    if let Some(entry) = self.peers.get(&peer) {
                        MemEndpoint::released(&entry.link, 1 - to, frame.len());
                    }
                    events.push(Event::Frame { peer, frame });
                }
                Incoming::Closed { link, to } => {
                    if let Some(&peer) = self.by_link.get(&(link, to)) {
                        self.forget(peer);
                        events.push(Event::Closed {
                            peer,
                            reason: CloseReason::PeerClosed,
                        });
                    }
                }
                Incoming::Writable { link, to } => {
                    if let Some(&peer) = self.by_link.get(&(link, to)) {
                        events.push(Event::Writable { peer });
                    }
                }
            }
        }
        Ok(())
    }

    fn close(&mut self, peer: PeerId) {
        if let Some(gone) = self.forget(peer) {
            close_end(&gone.link, gone.side);
            self.push_local(Event::Closed {
                peer,
                reason: CloseReason::Local,
            });
        }
    }

    fn readiness(&self) -> Readiness {
        Readiness::Fd(self.poll.as_raw_fd())
    }

    fn info(&self) -> Option<FabricInfo> {
        Some(FabricInfo::mem())
    }

    fn queued_bytes(&self, peer: PeerId) -> usize {
        self.peers
            .get(&peer)
            .map(|entry| entry.link.state.lock().bytes[entry.side])
            .unwrap_or(0)
    }
}

impl Drop for MemEndpoint {
    fn drop(&mut self) {
        if let Some(name) = &self.name {
            let mut names = NAMES.lock();
            let ours = names
                .get(name)
                .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.shared)));
            if ours {
                names.remove(name);
            }
        }
        // Refuse anything new, then close every link we know of, including
        // ones offered to us that we never polled.
        let unread = {
            let mut inbox = self.shared.inbox.lock();
            inbox.alive = false;
            std::mem::take(&mut inbox.queue)
        };
        for item in unread {
            if let Incoming::Accept { link, .. } = item {
                close_end(&link, ACCEPTOR);
            }
        }
        for (_, entry) in self.peers.drain() {
            close_end(&entry.link, entry.side);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(payload: &[u8]) -> OutFrame {
        let mut v = (payload.len() as u32).to_le_bytes().to_vec();
        v.extend_from_slice(payload);
        OutFrame::whole(v.into())
    }

    fn bound(name: &str) -> MemEndpoint {
        MemEndpoint::open(&EndpointConfig {
            bind: Some(name.into()),
            ..EndpointConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn name_is_exclusive_and_freed_on_drop() {
        let a = bound("mem-unit-exclusive");
        let err = MemEndpoint::open(&EndpointConfig {
            bind: Some("mem-unit-exclusive".into()),
            ..EndpointConfig::default()
        })
        .unwrap_err();
        assert!(matches!(err, TransportError::Bind { .. }), "{err}");
        drop(a);
        let _again = bound("mem-unit-exclusive");
    }

    #[test]
    fn connect_to_unbound_name_is_refused() {
        let mut a = MemEndpoint::open(&EndpointConfig::default()).unwrap();
        let err = a.connect("mem-unit-nobody").unwrap_err();
        assert!(matches!(err, TransportError::Connect { .. }), "{err}");
        assert!(matches!(
            a.connect("two words"),
            Err(TransportError::InvalidAddress { .. })
        ));
    }

    #[test]
    fn single_part_frames_are_not_copied() {
        let mut server = bound("mem-unit-zero-copy");
        let mut client = MemEndpoint::open(&EndpointConfig::default()).unwrap();
        let peer = client.connect("mem-unit-zero-copy").unwrap();
        let out = frame(b"payload");
        let ptr = out.head.as_ptr();
        client.send(peer, out).unwrap();
        let mut events = Vec::new();
        server.poll(&mut events).unwrap();
        let got = events
            .iter()
            .find_map(|e| match e {
                Event::Frame { frame, .. } => Some(frame.clone()),
                _ => None,
            })
            .unwrap();
        assert_eq!(got.as_ptr(), ptr);
    }

    #[test]
    fn dropping_an_unpolled_acceptor_closes_the_connector() {
        let server = bound("mem-unit-unpolled");
        let mut client = MemEndpoint::open(&EndpointConfig::default()).unwrap();
        let peer = client.connect("mem-unit-unpolled").unwrap();
        drop(server);
        let mut events = Vec::new();
        client.poll(&mut events).unwrap();
        assert_eq!(
            events,
            vec![Event::Closed {
                peer,
                reason: CloseReason::PeerClosed
            }]
        );
        assert!(matches!(
            client.send(peer, frame(b"x")),
            Err(SendError::Closed(_))
        ));
    }

    #[test]
    fn self_link_works() {
        let mut ep = bound("mem-unit-self");
        let out = ep.connect("mem-unit-self").unwrap();
        let mut events = Vec::new();
        ep.poll(&mut events).unwrap();
        let inbound = match events.as_slice() {
            [Event::Accepted { peer, .. }] => *peer,
            other => panic!("unexpected {other:?}"),
        };
        assert_ne!(inbound, out);
        ep.send(out, frame(b"to myself")).unwrap();
        events.clear();
        ep.poll(&mut events).unwrap();
        assert_eq!(
            events,
            vec![Event::Frame {
                peer: inbound,
                frame: frame(b"to myself").head
            }]
        );
    }

    #[test]
    fn receiver_max_frame_bounds_the_sender() {
        let _server = MemEndpoint::open(&EndpointConfig {
            bind: Some("mem-unit-small".into()),
            max_frame: 16,
            ..EndpointConfig::default()
        })
        .unwrap();
        let mut client = MemEndpoint::open(&EndpointConfig::default()).unwrap();
        let peer = client.connect("mem-unit-small").unwrap();
        assert!(matches!(
            client.send(peer, frame(&[0; 13])),
            Err(SendError::TooLarge { len: 17, max: 16 })
        ));
        client.send(peer, frame(&[0; 12])).unwrap();
    }
}
