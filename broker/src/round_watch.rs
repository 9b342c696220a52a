//! Where the event loop is, for other threads: when the round under way
//! began (a shutdown's drain counts its passes as rounds, and the
//! endpoints' preparation for a wait and their closing count too: both run
//! the providers' progress) and which endpoint it is calling into, and for
//! what. A loop stuck in a call that
//! does not return (libfabric 1.17's `shm` after a same-host peer was
//! stopped or killed holding the provider's lock, README "shm") shows here
//! as one round that has lasted for seconds, with the endpoint and the
//! call; a busy loop starts a round every few microseconds.
//!
//! Every endpoint the loop owns is wrapped in a [`WatchedEndpoint`], which
//! marks the calls that may reach a provider (two relaxed stores each, on
//! a cache line of their own).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::caps::FabricInfo;
use efabus_core::transport::{
    BufferMemory, DirectSend, Endpoint, EndpointConfig, Event, FabricCounts, LinkKeys, OutFrame,
    PeerId, Readiness, Refused, RendezvousCounts, SendError, TransportError,
};

/// The loop's position, written by whichever thread runs its rounds.
#[repr(align(64))]
pub(crate) struct RoundWatch {
    epoch: Instant,
    /// Microseconds from `epoch` to the start of the round under way, plus
    /// one; 0 between rounds.
    began: AtomicU64,
    /// `CALLS * index + call + 1` while calling into endpoint `index`; 0
    /// elsewhere.
    endpoint: AtomicUsize,
    /// The loop panicked, on its thread ([`RoundWatch::ended_on_unwind`])
    /// or in a round a waiting thread ran ([`RoundWatch::ended_by_panic`]).
    panicked: AtomicBool,
}

/// What the loop may be calling an endpoint for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointCall {
    Poll,
    Send,
    Flush,
    Close,
    Connect,
    /// Anything else that may reach the provider.
    Other,
}

const CALLS: usize = 6;
const ALL_CALLS: [EndpointCall; CALLS] = [
    EndpointCall::Poll,
    EndpointCall::Send,
    EndpointCall::Flush,
    EndpointCall::Close,
    EndpointCall::Connect,
    EndpointCall::Other,
];

/// What the loop is doing in a round that has lasted long
/// ([`crate::Broker::stalled_round`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopStall {
    /// How long the round has run so far.
    pub running_for: Duration,
    /// Which round it is (when it began, as a number): the same value
    /// seen twice is the same round.
    pub round: u64,
    /// The endpoint the loop is calling into, by its listener
    /// (`scheme/address`), and for what; `None` when it is in no call.
    pub endpoint: Option<(String, EndpointCall)>,
}

impl fmt::Display for LoopStall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the event loop has been in one round for {:.1} s, ",
            self.running_for.as_secs_f64()
        )?;
        let Some((endpoint, call)) = &self.endpoint else {
            return f.write_str("in no endpoint's call");
        };
        let doing = match call {
            EndpointCall::Poll => "polling",
            EndpointCall::Send => "sending on",
            EndpointCall::Flush => "handing sends to",
            EndpointCall::Close => "closing a peer of",
            EndpointCall::Connect => "dialing from",
            EndpointCall::Other => "in a call to",
        };
        write!(f, "{doing} {endpoint}")
    }
}

impl RoundWatch {
    pub(crate) fn new() -> RoundWatch {
        RoundWatch {
            epoch: Instant::now(),
            began: AtomicU64::new(0),
            endpoint: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        }
    }

    pub(crate) fn round_began(&self, now: Instant) {
        let micros = now.saturating_duration_since(self.epoch).as_micros();
        let stamp = u64::try_from(micros).unwrap_or(u64::MAX - 1) + 1;
        self.began.store(stamp, Ordering::Relaxed);
    }

    pub(crate) fn round_ended(&self) {
        self.began.store(0, Ordering::Relaxed);
    }

    /// Ends the round under way, and records the panic, when the loop's
    /// thread unwinds past the guard: a loop that died is not stuck in a
    /// call, and what its thread still drops (the endpoints) is no round.
    pub(crate) fn ended_on_unwind(&self) -> RoundEndsOnUnwind<'_> {
        RoundEndsOnUnwind(self)
    }

    /// Ends the round under way and records that the loop panicked, for a
    /// round an application thread ran
    /// ([`crate::drive::DriveHandle::install`]).
    pub(crate) fn ended_by_panic(&self) {
        self.round_ended();
        self.returned();
        self.panicked.store(true, Ordering::Release);
    }

    /// Whether the loop panicked, on its thread or in a driven round.
    pub(crate) fn panicked(&self) -> bool {
        self.panicked.load(Ordering::Acquire)
    }

    fn calling(&self, index: usize, call: EndpointCall) {
        let code = CALLS * index + call as usize + 1;
        self.endpoint.store(code, Ordering::Relaxed);
    }

    fn returned(&self) {
        self.endpoint.store(0, Ordering::Relaxed);
    }

    /// The round under way if it has run for `at_least` by `now`, with the
    /// endpoint call it is in: the endpoint, named by `name` from its
    /// index among the loop's endpoints, and the call.
    pub(crate) fn stalled(
        &self,
        at_least: Duration,
        now: Instant,
        name: impl Fn(usize) -> String,
    ) -> Option<LoopStall> {
        let stamp = self.began.load(Ordering::Relaxed);
        let began = self.epoch + Duration::from_micros(stamp.checked_sub(1)?);
        let running_for = now.saturating_duration_since(began);
        if running_for < at_least {
            return None;
        }
        let endpoint = match self.endpoint.load(Ordering::Relaxed) {
            0 => None,
            code => Some((name((code - 1) / CALLS), ALL_CALLS[(code - 1) % CALLS])),
        };
        Some(LoopStall {
            running_for,
            round: stamp,
            endpoint,
        })
    }
}

/// See [`RoundWatch::ended_on_unwind`].
pub(crate) struct RoundEndsOnUnwind<'a>(&'a RoundWatch);

impl Drop for RoundEndsOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.ended_by_panic();
        }
    }
}

/// An endpoint of the loop whose calls that may reach its provider are
/// marked in the [`RoundWatch`], under the endpoint's index.
pub(crate) struct WatchedEndpoint {
    inner: Box<dyn Endpoint>,
    watch: Arc<RoundWatch>,
    index: usize,
}

impl WatchedEndpoint {
    pub(crate) fn wrap(
        inner: Box<dyn Endpoint>,
        watch: Arc<RoundWatch>,
        index: usize,
    ) -> Box<dyn Endpoint> {
        Box::new(WatchedEndpoint {
            inner,
            watch,
            index,
        })
    }

    #[inline(always)]
    fn marked<T>(&mut self, call: EndpointCall, f: impl FnOnce(&mut dyn Endpoint) -> T) -> T {
        self.watch.calling(self.index, call);
        let result = f(self.inner.as_mut());
        self.watch.returned();
        result
    }
}

impl Endpoint for WatchedEndpoint {
    fn scheme(&self) -> &str {
        self.inner.scheme()
    }
    fn local_addr(&self) -> Vec<u8> {
        self.inner.local_addr()
    }
    fn max_frame(&self) -> usize {
        self.inner.max_frame()
    }
    fn deliver_runs(&mut self) -> bool {
        self.inner.deliver_runs()
    }
    fn connect(&mut self, addr: &str) -> Result<PeerId, TransportError> {
        self.marked(EndpointCall::Connect, |e| e.connect(addr))
    }
    fn insert_peer(&mut self, addr: &[u8], keys: &LinkKeys) -> Result<PeerId, TransportError> {
        self.marked(EndpointCall::Connect, |e| e.insert_peer(addr, keys))
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
    fn rendezvous_counts(&self) -> RendezvousCounts {
        self.inner.rendezvous_counts()
    }
    fn fabric_counts(&self) -> FabricCounts {
        self.inner.fabric_counts()
    }
    fn reload_tls(&mut self) -> Result<bool, TransportError> {
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
        self.marked(EndpointCall::Send, |e| e.send(peer, frame))
    }
    fn send_run(&mut self, peer: PeerId, run: Bytes) -> Result<(), SendError> {
        self.marked(EndpointCall::Send, |e| e.send_run(peer, run))
    }
    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), TransportError> {
        self.marked(EndpointCall::Poll, |e| e.poll(events))
    }
    fn flush(&mut self) {
        self.marked(EndpointCall::Flush, |e| e.flush());
    }
    fn direct_sender(&mut self, peer: PeerId) -> Option<Arc<dyn DirectSend>> {
        self.inner.direct_sender(peer)
    }
    fn close(&mut self, peer: PeerId) {
        self.marked(EndpointCall::Close, |e| e.close(peer));
    }
    fn readiness(&self) -> Readiness {
        self.inner.readiness()
    }
    fn has_own_work(&self) -> bool {
        self.inner.has_own_work()
    }
    fn rendezvous_max(&self) -> usize {
        self.inner.rendezvous_max()
    }
    fn set_peer_rendezvous(&mut self, peer: PeerId, limit: usize) {
        self.inner.set_peer_rendezvous(peer, limit);
    }
    fn hold_reads(&mut self, peer: PeerId, held: bool) {
        self.marked(EndpointCall::Other, |e| e.hold_reads(peer, held));
    }
    fn set_peer_frame_limit(&mut self, peer: PeerId, limit: usize) {
        self.inner.set_peer_frame_limit(peer, limit);
    }
    fn set_receive_limit(&mut self, peer: PeerId, limit: Option<usize>) {
        self.inner.set_receive_limit(peer, limit);
    }
    fn set_accepted_receive_limit(&mut self, limit: Option<usize>) {
        self.inner.set_accepted_receive_limit(limit);
    }
    fn prepare_wait(&mut self) -> bool {
        self.marked(EndpointCall::Other, |e| e.prepare_wait())
    }
    fn wait_cap(&self) -> Option<Duration> {
        self.inner.wait_cap()
    }
    fn info(&self) -> Option<FabricInfo> {
        self.inner.info()
    }
    fn queued_bytes(&self, peer: PeerId) -> usize {
        self.inner.queued_bytes(peer)
    }
    fn set_read_paused(&mut self, peer: PeerId, paused: bool) {
        self.marked(EndpointCall::Other, |e| e.set_read_paused(peer, paused));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_round_under_way_past_the_bound_is_a_stall() {
        let watch = RoundWatch::new();
        let name = |index: usize| format!("endpoint {index}");
        let start = Instant::now();
        let later = start + Duration::from_secs(10);
        assert_eq!(
            watch.stalled(Duration::ZERO, later, name),
            None,
            "no round yet"
        );
        watch.round_began(start);
        assert_eq!(watch.stalled(Duration::from_secs(11), later, name), None);
        let stall = watch
            .stalled(Duration::from_secs(9), later, name)
            .expect("a round of ten seconds");
        // The start is kept to the microsecond.
        let ten = Duration::from_secs(10);
        let running = stall.running_for;
        assert!(
            running > ten - Duration::from_millis(1) && running < ten + Duration::from_millis(1)
        );
        assert_eq!(stall.endpoint, None);
        for (index, call) in [
            (3, EndpointCall::Poll),
            (0, EndpointCall::Other),
            (7, EndpointCall::Send),
        ] {
            watch.calling(index, call);
            let stall = watch.stalled(Duration::ZERO, later, name).unwrap();
            assert_eq!(stall.endpoint, Some((format!("endpoint {index}"), call)));
        }
        watch.returned();
        let same = watch.stalled(Duration::ZERO, later, name).unwrap();
        assert_eq!((same.endpoint, same.round), (None, stall.round));
        watch.round_began(start + Duration::from_secs(1));
        let next = watch.stalled(Duration::ZERO, later, name).unwrap();
        assert_ne!(next.round, stall.round, "another round");
        watch.round_ended();
        assert_eq!(
            watch.stalled(Duration::ZERO, later, name),
            None,
            "between rounds"
        );
    }
}
