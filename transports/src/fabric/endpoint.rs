//! The fabric endpoint: one libfabric RDM or DGRAM endpoint with its AV,
//! completion queues and registered buffer pools, behind efabus's
//! [`Endpoint`] trait.
//!
//! Set-up: fi_getinfo → fabric → domain → AV (FI_AV_TABLE) → wait set
//! (FI_WAIT_FD, where offered) → tx and rx CQs (FI_CQ_FORMAT_DATA, on the
//! wait set or FI_WAIT_NONE) → endpoint → bind → (efa RDM:
//! FI_OPT_EFA_RNR_RETRY) → enable → (FI_OPT_MIN_MULTI_RECV) → fi_getname
//! → receives posted.
//!
//! Data path:
//! - Receives stay posted, each a slot of the rx pool. On RDM, where the
//!   provider grants FI_MULTI_RECV and gives a buffer back only once all
//!   its messages have landed (`config::releases_whole_buffers`), and
//!   `multi_recv` is set, a slot is a multi-receive buffer of
//!   `config::MULTI_RECV_SLOTS` eager buffers' worth, which messages fill
//!   one after another, each taking only its own bytes; the provider
//!   releases it once less than one largest message fits, and it is
//!   posted again. Otherwise `rx_depth` slots of one eager
//!   buffer each take a message each. A completion is decoded and its
//!   frames handed on. Small messages are copied out (and a slot of one
//!   message reposted at once). On RDM a message of at least `LEND_MIN`
//!   bytes is lent instead: its frames point into the slot, which is
//!   reposted once the provider has released it and they are all dropped.
//!   At most half the slots hold lent frames at a time, so receives stay
//!   posted however long a consumer holds its frames (and the provider
//!   holds any early messages meanwhile; DGRAM, which would drop them,
//!   always copies).
//! - A send copies the frame into a free tx slot, which waits in the peer's
//!   backlog until the next `poll` (or `flush`, `prepare_wait`, `close`)
//!   posts it; frames sent meanwhile are packed into the same slot while
//!   they fit, so a burst costs one message, not one per frame. A slot whose
//!   posted length fits the provider's `inject_size` goes with `fi_inject`
//!   and is free again at once. No free slot returns `WouldBlock`, and
//!   `Writable` follows once a slot is free.
//! - Each peer may hold only its share of the tx slots and of the bytes in
//!   them (`may_take_slot`): a receiver that stops taking messages (a
//!   stopped process, or an efa receiver that posts nothing while
//!   `rnr_retry` keeps the sends alive) pins its own sends and no one
//!   else's. Its sender sees `WouldBlock` for it alone, so its frames wait
//!   in the session's queue, where the slow-consumer policy applies. Sends
//!   already posted to a peer that is then closed keep their slots until
//!   the provider completes them: on efa, whose `rnr_retry` is always
//!   finite (7, without limit, is refused), they fail in bounded time; to
//!   a process stopped for good on `tcp;ofi_rxm` they stay until its
//!   connection ends, so peers stopped that way for good each pin their
//!   share.
//! - A frame whose body (the payload, shared with the caller) has at least
//!   `SHARE_MIN` bytes is not copied where the provider can send from it:
//!   the slot carries the header and the frame's head, and `fi_sendv`
//!   sends the body from where it lies, held until the send completes.
//!   That needs no FI_MR_LOCAL, or a body inside the rx pool, registered
//!   for sends too where the provider allows it (a lent frame forwarded),
//!   and a `tx iov_limit` of 2.
//!   Nothing is packed behind such a frame.
//! - -FI_EAGAIN on a post: the slot stays at the head of the backlog,
//!   ahead of anything newer, and the CQs are read (which drives progress
//!   on manual-progress providers); every later poll retries the backlog.
//! - Descriptors from the pools' regions go with every post when the
//!   provider requires FI_MR_LOCAL (or `force_mr_local` is set).
//! - Every message is authenticated (see [`super::layout`]): a peer is
//!   inserted with the keys and ids of its link, which the session layer
//!   agreed over its control link, and a message is delivered only once
//!   its link id names a peer, its sender address is that peer's (and,
//!   where FI_SOURCE is granted, so is the source the completion reports),
//!   its tag checks under the peer's key and its counter is new. Anything
//!   else is dropped and counted, and costs no peer, no reply and no
//!   address-vector entry: sessions start on the control link, never
//!   here. Addresses of closed peers stay in the address vector for reuse
//!   until it fills; then the least recently used one no live peer needs
//!   is removed (`fi_av_remove`).
//!
//! Nothing here waits: the endpoint must be polled. With a wait set its
//! owner may sleep on the set's descriptor between polls
//! (`Readiness::PollOrWait`), after `prepare_wait` (`fi_trywait`) allowed
//! it; without one it reports `Readiness::MustPoll`.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::transport::{
    BufferMemory, CloseReason, Endpoint, EndpointConfig, Event, LinkKeys, OutFrame, PeerId,
    Readiness, Refused, SendError, TransportError,
};
use rustc_hash::FxHashMap;

use super::config::{addr_to_hex, EpKind, FabricOptions, OrderWanted, RMA_READ_CAPS};
use super::consts::*;
use super::error::{FabricError, FiCode};
use super::handle::{
    AddressVector, Completion, CompletionQueue, CqError, CqRead, Domain, Fabric, FiEndpoint,
    MemoryRegion, WaitSet,
};
use super::info::{Hints, Info, InfoList};
use super::layout::{
    check_frame, frame_declared_len, frame_kind, frames, rma_done, rma_done_id, rma_fence,
    rma_fence_id, BufferLayout, Received, ReplayWindow, RmaDescriptor, TagKey, UsedSendKeys,
    HEADER_VERSION, MAX_ADDR_LEN, RMA_DESCRIPTOR_KIND, RMA_DONE_KIND, RMA_FENCE_KIND,
};
use super::log_limit::BadInputLog;
use super::pool::{touch_pages, BufferPool};
use super::rendezvous::{self, Outstanding, Owed, QueuedRead, ReadJob, Rendezvous};

/// Modes efabus honours: it reserves prefixes and always passes a
/// context big enough for `struct fi_context2`.
pub const SUPPORTED_MODES: u64 = FI_MSG_PREFIX | FI_CONTEXT | FI_CONTEXT2;
/// mr_mode bits efabus honours: it registers its own pools, passes their
/// descriptors, never touches unbacked memory, takes provider keys and
/// would address RMA by virtual address. (FI_MR_ENDPOINT is not handled.)
pub const SUPPORTED_MR_MODES: u64 =
    FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_VIRT_ADDR;
/// mr_mode bits that may be reported but concern memory efabus never
/// registers (device memory).
const IGNORED_MR_MODES: u64 = FI_MR_HMEM;

/// Longest sleep of an owner while a manual-progress provider may hold
/// sends of this endpoint in flight: its retransmission timers need our
/// calls.
const MANUAL_PROGRESS_TICK: Duration = Duration::from_millis(1);
/// How long after its last post a manual-progress provider may still hold
/// a send we no longer see: an injected one is ours no more, yet ofi_rxd
/// keeps it for retransmission until acknowledged, backing off up to about
/// this long between tries.
const MANUAL_PROGRESS_LINGER: Duration = Duration::from_millis(250);

/// Progress rounds without a tx CQ read, while nothing of ours is due
/// there, before it is read anyway: a completion no post of ours
/// accounts for (a provider's error report) is still found.
const TX_CQ_CHECK_ROUNDS: u32 = 64;

/// Completions read per `fi_cq_read`.
const CQ_BATCH: usize = 64;

/// A rendezvous read whose posting took this long or longer was a copy
/// made inside `fi_read` (`shm` copies the body there, by
/// `process_vm_readv`): the poll starts no further read, so that the
/// frames already landed are handed on before the next copy. Starting
/// every queued read at once held each landed frame back until the last
/// copy was done: through a broker, its reads from the publisher and the
/// subscriber's reads from it took turns instead of overlapping. Posting
/// a read that the provider moves later takes less (`tcp;ofi_rxm` here:
/// 4 us at the median, 14 at the 90th percentile, for 1 MiB).
const SLOW_READ_POST: Duration = Duration::from_micros(50);

/// Smallest received run of frames lent rather than copied: below it a
/// copy costs less than a slot held out of the receive queue.
const LEND_MIN: usize = 8 << 10;

/// Smallest frame body sent from where it lies rather than copied.
const SHARE_MIN: usize = 8 << 10;

/// A peer's share of the tx slots: at most this fraction of them...
const PEER_SLOTS_DIVISOR: usize = 16;
/// ...but at least this many (or half the slots, when fewer), so a burst
/// to one peer still packs into a few messages.
const PEER_SLOTS_FLOOR: usize = 8;
/// Slots a peer may always take, however few are free: every peer can
/// make progress.
const PEER_SLOTS_MIN: usize = 2;
/// Frame bytes one peer may have in tx slots (waiting or posted). A frame
/// alone may exceed it.
const PEER_TX_BYTES: usize = 8 << 20;

/// Peers one `shm` endpoint can address (libfabric's `SMR_MAX_PEERS`); its
/// `fi_av_open` fails with `FI_ENOSYS` for a larger table.
const SHM_MAX_PEERS: usize = 256;

/// Whether each open `shm` endpoint of this process is still open, by
/// address. With libfabric 1.17 a send to a `shm` endpoint of the same
/// process that has closed crashes inside the provider (its region is gone
/// from the shared address space), so sends to such a peer check first
/// and end the link instead.
fn local_shm_endpoints() -> &'static Mutex<HashMap<Vec<u8>, Arc<AtomicBool>>> {
    static ENDPOINTS: OnceLock<Mutex<HashMap<Vec<u8>, Arc<AtomicBool>>>> = OnceLock::new();
    ENDPOINTS.get_or_init(Default::default)
}

/// What the provider granted, as the endpoint uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    pub kind: EpKind,
    pub provider: String,
    pub fabric: String,
    pub domain: String,
    /// FI_ORDER_SAS granted on both tx and rx: frames from one sender
    /// arrive in send order. When false the session layer must sequence
    /// and reorder.
    pub sas: bool,
    /// Prefix bytes reserved in front of every buffer (the provider's
    /// `msg_prefix_size`, or `force_prefix`).
    pub msg_prefix_size: usize,
    /// The provider's own `msg_prefix_size`.
    pub provider_prefix: usize,
    /// The provider's `max_msg_size`.
    pub max_msg_size: u64,
    /// The provider's `inject_size` (0: never inject).
    pub inject_size: usize,
    /// Largest frame one send carries.
    pub max_frame: usize,
    /// Buffers are registered and descriptors passed with every post.
    pub mr_local: bool,
    /// Buffers one send may gather (`tx_attr.iov_limit`).
    pub tx_iov_limit: usize,
    pub rx_depth: usize,
    /// The bytes of each receive buffer when receives are posted as
    /// FI_MULTI_RECV buffers (RDM, granted and asked for).
    pub multi_recv: Option<usize>,
    pub tx_depth: usize,
    pub addr_format: u64,
    pub resource_mgmt: u64,
    /// FI_PROGRESS_MANUAL data progress: the provider's own timers
    /// (retransmissions, RNR back-off) advance only inside our calls.
    pub manual_progress: bool,
    /// The FI_OPT_EFA_RNR_RETRY value set, if it was.
    pub rnr_retry: Option<u64>,
    /// FI_SOURCE granted: every receive's sender is checked against the
    /// peer's address-vector entry, besides the tag.
    pub source_checked: bool,
    /// Largest frame moved by rendezvous (FI_RMA reads granted and
    /// enabled); 0 without.
    pub rendezvous_max: usize,
    /// A transfer's body is let go once a fence frame, sent when the
    /// reader's done arrives, has been sent, not at the done: the provider
    /// serves a read of this endpoint's memory itself, in its progress,
    /// from the memory (`ofi_rxm` over `tcp`), possibly after a reader
    /// that finished early (or lied) sent its done, and queues the read's
    /// bytes ahead of any send posted after the read's request came, so
    /// the fence's completion shows that they are all out. Elsewhere the
    /// done lets the body go at once.
    pub fenced_release: bool,
}

/// Counters of what the endpoint did, for diagnostics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FabricStats {
    pub sent: u64,
    pub injected: u64,
    /// Frames delivered (a message may carry several).
    pub received: u64,
    /// Authentic messages taken from the rx queue, the endpoint's own
    /// (rendezvous descriptors and dones) included.
    pub received_messages: u64,
    pub provider_packets: u64,
    pub malformed: u64,
    /// Messages naming a link id no live peer has: from senders that never
    /// had a session, or from a peer closed since.
    pub unknown_links: u64,
    /// Messages whose sender address, source (where the provider reports
    /// it) or tag did not match their link: forged, or corrupted on the way.
    pub forged: u64,
    /// Authentic messages whose counter was taken before: replayed.
    pub replayed: u64,
    /// Frames packed into a message behind an earlier frame.
    pub packed: u64,
    /// Received messages lent to the caller rather than copied.
    pub lent: u64,
    /// Receives posted (a multi-receive buffer takes many messages per
    /// post).
    pub rx_posts: u64,
    /// Frames whose body was sent from the caller's buffer, uncopied.
    pub shared_sends: u64,
    /// Reads of the tx completion queue. Each runs the provider's progress
    /// (with `shm`, under its locks; with `tcp;ofi_rxm`, a poll of its
    /// sockets), so the tx queue is read only while an operation of ours
    /// is due there, and once in `TX_CQ_CHECK_ROUNDS` progress rounds.
    pub tx_cq_reads: u64,
    /// Reads of the rx completion queue: one or more per progress round.
    pub rx_cq_reads: u64,
    /// Addresses removed from the address vector to make room.
    pub av_evictions: u64,
    /// Addresses the provider gave an entry that an unused older address
    /// had, which went to them (see [`FabricError::AddressAliased`]).
    pub av_aliases: u64,
    pub would_block: u64,
    /// Sends refused because the peer held its whole share of the tx slots
    /// or bytes while other slots were free (a slow or stopped receiver).
    pub peer_share_full: u64,
    pub tx_errors: u64,
    pub rx_errors: u64,
    /// Of the send errors, those saying the receiver had no buffer
    /// posted (FI_ENORX).
    pub rnr_failures: u64,
    /// Frames sent by rendezvous (a descriptor in their place).
    pub rendezvous_sent: u64,
    /// Of those, the ones whose body was registered already (the same
    /// frame sent to another peer): no new registration.
    pub rendezvous_shared: u64,
    /// Bodies registered for remote reads.
    pub rendezvous_registrations: u64,
    /// Reads of rendezvous transfers started.
    pub rendezvous_reads_started: u64,
    /// Frames received by rendezvous (read one-sided), and their bytes.
    pub rendezvous_read: u64,
    pub rendezvous_read_bytes: u64,
    /// Of the reads started, those landing in huge pages (`huge_landing`
    /// over `shm`).
    pub rendezvous_huge_landed: u64,
    /// Transfers released without their done frame: the peer closed first.
    pub rendezvous_abandoned: u64,
    /// Reads of a peer's frames given up because the peer closed first.
    pub rendezvous_reads_given_up: u64,
    /// Sends refused for a while by the registration bounds.
    pub rendezvous_deferred: u64,
    /// The most recent error the endpoint absorbed (a failed completion
    /// with the provider's text, a malformed message), for diagnostics.
    pub last_error: Option<String>,
}

struct PeerState {
    addr: Vec<u8>,
    fi_addr: u64,
    /// The id this side gave the link, and the one the peer gave it.
    local_id: u64,
    remote_id: u64,
    /// What tags the messages sent to the peer, and checks those from it.
    send_tag: TagKey,
    receive_tag: TagKey,
    /// Counter of the last message sent.
    sent_counter: u64,
    replay: ReplayWindow,
    /// Frame bytes in tx slots: waiting in `backlog` or posted.
    queued_bytes: usize,
    /// Tx slots this peer holds: waiting in `backlog` or posted.
    slots: usize,
    /// Encoded tx slots not posted yet, oldest first: new ones, which the
    /// next poll or flush posts, and ones the provider refused with
    /// -FI_EAGAIN (e.g. while `tcp;ofi_rxm` connects). The newest may
    /// still take more frames.
    backlog: VecDeque<usize>,
    wants_writable: bool,
    /// Frame bytes one message to this peer may carry (its receive
    /// buffers may be smaller than ours); 0 until the caller sets it, and
    /// then nothing is packed.
    pack_limit: usize,
    /// Frames above `pack_limit` and up to this go by rendezvous (0: none).
    rendezvous: usize,
    /// Transfers to this peer waiting for its done frame, and their bytes.
    rma_sends: usize,
    rma_bytes: usize,
    /// Reads of this peer's transfers, queued or in flight.
    rma_reads: usize,
    /// For a `shm` peer in this process: whether its endpoint is open.
    in_process: Option<Arc<AtomicBool>>,
}

impl PeerState {
    /// The peer is a `shm` endpoint of this process that has closed.
    fn endpoint_closed(&self) -> bool {
        self.in_process
            .as_ref()
            .is_some_and(|open| !open.load(Ordering::Acquire))
    }
}

/// Why a link to an in-process `shm` peer ended (see `local_shm_endpoints`).
const IN_PROCESS_CLOSED: &str = "its shm endpoint in this process closed";

/// One address in the address vector.
struct AvEntry {
    fi_addr: u64,
    /// Live peers at this address.
    users: usize,
    /// `av_clock` when a peer last took it.
    last_used: u64,
}

/// A libfabric RDM or DGRAM endpoint. See the module docs.
pub struct FabricEndpoint {
    // Field order is drop order: the endpoint closes first, which ends
    // every posted operation; then the CQs and AV; then the pools (their
    // regions, then their memory); then domain and fabric. Rendezvous
    // reads land in buffers, and read registered bodies, kept in `rma`.
    ep: FiEndpoint,
    rma: Option<Rendezvous>,
    tx_cq: Rc<CompletionQueue>,
    rx_cq: Rc<CompletionQueue>,
    wait: Option<Rc<WaitSet>>,
    av: Rc<AddressVector>,
    rx_pool: BufferPool,
    tx_pool: BufferPool,
    /// The rx pool's region allows sends (or none is needed).
    rx_pool_sendable: bool,
    _domain: Rc<Domain>,
    _fabric: Rc<Fabric>,
    info: Info,

    link: LinkInfo,
    /// The scheme it reports: its kind's, or `shm` for the same-host RDM
    /// endpoints (set by [`super::FabricTransport::open_fabric`]).
    pub(crate) scheme: &'static str,
    /// What its buffer pools take.
    buffers: BufferMemory,
    layout: BufferLayout,
    local_addr: Vec<u8>,
    /// The sender address written in every message: `local_addr`, except
    /// in tests that play an attacker (`claim_address`).
    header_addr: Vec<u8>,
    /// The header version written in every message: the right one, except
    /// in tests that send what no efabus endpoint would
    /// (`claim_header_version`).
    header_version: u8,
    /// Per tx slot: it carries the endpoint's own frames (a control
    /// message), which are never packed with the caller's.
    tx_control: Vec<bool>,
    /// Per tx slot: the transfer whose fence frame it carries, let go when
    /// its send completes (see [`LinkInfo::fenced_release`]).
    tx_fence: Vec<Option<u64>>,
    /// Inside `progress` (see there).
    progressing: bool,
    /// A call made while `progressing` asked for progress: the outer call
    /// reads the queues once more.
    progress_again: bool,
    /// Sends posted whose completion is due on the tx CQ (an injected send
    /// has none). While there are none and no read is in flight, progress
    /// reads only the rx CQ, and the tx CQ once in `TX_CQ_CHECK_ROUNDS`
    /// rounds: every CQ read runs the provider's progress.
    sends_posted: usize,
    /// Progress rounds since the tx CQ was last read.
    rounds_since_tx_read: u32,
    /// When a send was last posted, on a manual-progress provider.
    last_post: Option<Instant>,
    /// See [`SLOW_READ_POST`].
    slow_read_post: Duration,
    /// A `shm` endpoint's entry in `local_shm_endpoints`.
    shm_open: Option<Arc<AtomicBool>>,

    next_peer: u64,
    /// Looked up on every send and receive; keyed by ids this endpoint
    /// hands out, so a fast unkeyed hash does.
    peers: FxHashMap<PeerId, PeerState>,
    /// Live peers by the id this side gave their link.
    links: FxHashMap<u64, PeerId>,
    /// Send keys of the latest links, none of which may serve another.
    used_send_keys: UsedSendKeys,
    /// Addresses inserted in the address vector.
    av_cache: HashMap<Vec<u8>, AvEntry>,
    /// Ticks at each insert, for least-recently-used eviction.
    av_clock: u64,
    max_addresses: usize,
    /// The provider reports each receive's source (FI_SOURCE): it must be
    /// the peer's own address-vector entry.
    checks_source: bool,
    /// Per completion read: its source address, when `checks_source`.
    sources: Vec<u64>,

    free_tx: Vec<usize>,
    /// Most tx slots one peer may hold; see [`FabricEndpoint::may_take_slot`].
    peer_slots: usize,
    /// Free slots kept for peers holding fewer than `PEER_SLOTS_MIN`.
    reserved_slots: usize,
    /// Per tx slot: the peer and frame length it carries, while in use.
    tx_owner: Vec<Option<(PeerId, usize)>>,
    /// Per tx slot: the length to post (prefix and header included).
    tx_post_len: Vec<usize>,
    /// Per tx slot: its tag covers what it holds. A post the provider
    /// refuses for now is tried again at every poll and flush; the tag of
    /// a large frame is not worth computing again each time.
    tx_sealed: Vec<bool>,
    /// Per tx slot: the `fi_addr_t` it goes to, while in use.
    tx_dest: Vec<u64>,
    /// Per tx slot: the frame body sent after the slot's bytes, uncopied,
    /// held until the send completes.
    tx_body: Vec<Option<Bytes>>,
    unposted_rx: Vec<usize>,
    /// Per rx slot: posted, and not yet let go of by the provider.
    rx_posted: Vec<bool>,
    /// Per rx slot: frames were lent from it since it was last posted.
    rx_lent_from: Vec<bool>,
    /// Rx slots with `rx_lent_from` set.
    lent_rx: usize,
    pending: VecDeque<Event>,
    /// Peers whose backlog is not empty (or was, until they went away).
    backlogged: Vec<PeerId>,
    /// Peers told `WouldBlock`, owed a `Writable` once a slot is free.
    writable_waiters: Vec<PeerId>,
    completions: Vec<Completion>,
    stats: FabricStats,
    /// Warnings about bad input, one line a second at most for each kind,
    /// so a flood of one kind hides no other.
    bad_input_log: BadInputLog,
}

// SAFETY: every libfabric object of this endpoint's fabric and domain is
// owned by this value alone: the `Rc`s linking them are private and never
// cloned out, so moving the endpoint moves the whole object graph, and
// every call into it goes through `&mut self` (or `&self` for reads that
// make no libfabric call). That serializes all use of the domain, which is
// what FI_THREAD_DOMAIN (requested in the hints) asks of the application.
// Raw pointers in the pools point into memory this value owns.
unsafe impl Send for FabricEndpoint {}

impl Drop for FabricEndpoint {
    /// Tells this process's other `shm` endpoints, before the provider's
    /// endpoint closes (the fields drop after this), that this one is gone;
    /// over `ofi_rxm`, first reads what the completion queues still hold.
    fn drop(&mut self) {
        if let Some(open) = &self.shm_open {
            open.store(false, Ordering::Release);
            local_shm_endpoints()
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&self.local_addr);
        }
        if self.link.provider.contains("ofi_rxm") && self.drain_for_close() > 0 {
            self.leave_open();
        }
    }
}

/// Before an `ofi_rxm` endpoint closes, its completion queues are read
/// until they have stayed empty this long (its peers have stopped sending:
/// a closing broker's sessions said goodbye), or for at most
/// `CLOSE_DRAIN_MAX`.
const CLOSE_QUIET: Duration = Duration::from_millis(20);
const CLOSE_DRAIN_MAX: Duration = Duration::from_millis(250);

impl FabricEndpoint {
    /// Reads and discards completions until both queues have stayed empty
    /// for [`CLOSE_QUIET`] (at most [`CLOSE_DRAIN_MAX`]). libfabric 1.17's
    /// `ofi_rxm`, closing an endpoint, closes each connection's endpoint
    /// before it flushes the completion queue the connections share, and
    /// a message that arrived meanwhile leaves a completion there that
    /// refers to a connection endpoint already freed: the process crashes
    /// inside `fi_close` (seen in the fabric tests, where brokers and
    /// clients close while their peers in the same process still send).
    /// Reading the queues until the peers have gone quiet, as a poll would,
    /// leaves that flush little or nothing: the route and client-path test
    /// binaries crashed 3 times in 60 runs with a single read-out, and not
    /// in 72 runs with this one.
    ///
    /// For an endpoint about to be dropped (a drop does this first over
    /// `ofi_rxm`): what it reads is discarded, and reads that end
    /// meanwhile are over, nothing delivered. Returns how many reads are
    /// still in flight: an `ofi_rxm` endpoint dropped with any is left
    /// open (see [`FabricEndpoint::leave_open`]).
    pub fn drain_for_close(&mut self) -> usize {
        let started = Instant::now();
        let mut quiet_since = started;
        loop {
            let mut read = false;
            for tx in [true, false] {
                let cq = if tx { &self.tx_cq } else { &self.rx_cq };
                let contexts: Vec<*mut std::ffi::c_void> = match cq.read(&mut self.completions) {
                    Ok(CqRead::Entries(0)) | Err(_) => Vec::new(),
                    Ok(CqRead::Entries(n)) => {
                        self.completions[..n].iter().map(|c| c.op_context).collect()
                    }
                    Ok(CqRead::ErrorAvailable) => match cq.read_error() {
                        Ok(Some(err)) => vec![err.op_context],
                        _ => Vec::new(),
                    },
                };
                read |= !contexts.is_empty();
                // A read that ends now is over: its slot and buffer are
                // free, and it no longer keeps the endpoint open.
                if let Some(rma) = self.rma.as_mut().filter(|_| tx) {
                    for context in contexts {
                        if let Some(slot) = rma.slot_of(context) {
                            if let Some(job) = rma.slots[slot].job.take() {
                                rma.read_ended(slot, &job);
                            }
                        }
                    }
                }
            }
            let now = Instant::now();
            if now.duration_since(started) >= CLOSE_DRAIN_MAX {
                break;
            }
            if read {
                quiet_since = now;
            } else if now.duration_since(quiet_since) >= CLOSE_QUIET {
                break;
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        self.rma.as_ref().map_or(0, |rma| {
            rma.slots.iter().filter(|slot| slot.job.is_some()).count()
        })
    }

    /// libfabric 1.17's `ofi_rxm` crashes closing an endpoint with reads
    /// in flight that its peer never served (a peer that stopped polling,
    /// a suspended process; with two such reads it crashed every time
    /// here, with one it did not, which is not relied on): an endpoint
    /// with reads still in flight once the close's drain is over is left
    /// open instead, with everything it may still refer to (its pools,
    /// the bodies of its sends, the reads' buffers), for the rest of the
    /// process, and said so.
    fn leave_open(&mut self) {
        let jobs: Vec<usize> = self.rma.as_ref().map_or(Vec::new(), |rma| {
            rma.slots
                .iter()
                .filter_map(|slot| slot.job.as_ref())
                .map(ReadJob::footprint)
                .collect()
        });
        tracing::warn!(
            reads = jobs.len(),
            bytes = self.buffers.held + jobs.iter().sum::<usize>(),
            "closing a fabric endpoint with rendezvous reads its peers never served: \
             left open with its memory until the process ends, as closing it would crash libfabric"
        );
        self.ep.leave_open();
        std::mem::forget(self.rma.take());
        // Bodies of sends posted from where they lay.
        std::mem::forget(std::mem::take(&mut self.tx_body));
        self.rx_pool.leave_allocated();
        self.tx_pool.leave_allocated();
    }

    /// Opens an endpoint of `kind` with `options` (see [`FabricOptions`]).
    pub fn open(
        kind: EpKind,
        options: &FabricOptions,
        config: &EndpointConfig,
    ) -> Result<FabricEndpoint, FabricError> {
        let (list, sas_requested) = get_info(kind, options)?;
        let first = list.iter().next().ok_or_else(|| FabricError::GetInfo {
            provider: options.provider.clone(),
            ep_type: kind.fi_name(),
            code: FiCode::from_ret(FI_ENODATA.into()),
        })?;
        let info = first.dup()?;
        drop(list);
        let attrs = info.attrs();
        super::provider_env::note_unset_defaults(attrs.provider());
        let unusable = |reason: String| FabricError::Unusable {
            provider: attrs.provider().to_string(),
            reason,
        };
        let (tx, rx, ep_attrs, dom) = match (&attrs.tx, &attrs.rx, &attrs.ep, &attrs.domain) {
            (Some(tx), Some(rx), Some(ep), Some(dom)) => (tx, rx, ep, dom),
            _ => {
                return Err(unusable(
                    "fi_info without tx/rx/ep/domain attributes".into(),
                ))
            }
        };
        if ep_attrs.ep_type != kind.fi_value() {
            return Err(unusable(format!(
                "returned endpoint type {}",
                ep_attrs.ep_type
            )));
        }
        let modes = attrs.mode | tx.mode | rx.mode;
        if modes & !SUPPORTED_MODES != 0 {
            return Err(unusable(format!(
                "requires mode bits {:#x} efabus does not honour",
                modes & !SUPPORTED_MODES
            )));
        }
        if dom.mr_mode & !(SUPPORTED_MR_MODES | IGNORED_MR_MODES) != 0 {
            return Err(unusable(format!(
                "requires mr_mode bits {:#x} efabus does not honour",
                dom.mr_mode & !(SUPPORTED_MR_MODES | IGNORED_MR_MODES)
            )));
        }
        let sas =
            sas_requested && tx.msg_order & FI_ORDER_SAS != 0 && rx.msg_order & FI_ORDER_SAS != 0;
        if options.order == OrderWanted::Require && !sas {
            return Err(unusable("FI_ORDER_SAS was required but not granted".into()));
        }

        let provider_prefix = usize::try_from(ep_attrs.msg_prefix_size)
            .map_err(|_| unusable("msg_prefix_size does not fit in memory".into()))?;
        if provider_prefix > 0
            && options.force_prefix > 0
            && options.force_prefix != provider_prefix
        {
            tracing::warn!(
                provider_prefix,
                forced = options.force_prefix,
                "force_prefix ignored: the provider sets its own prefix"
            );
        }
        let prefix = if provider_prefix > 0 {
            provider_prefix
        } else {
            options.force_prefix
        };
        let cap = super::config::buffer_size(kind, attrs.provider(), options);
        let layout = BufferLayout::new(
            prefix,
            BufferLayout::payload_for(ep_attrs.max_msg_size, prefix, cap),
        );
        let mr_local = dom.mr_mode & FI_MR_LOCAL != 0 || options.force_mr_local;
        let wanted_rx =
            super::config::receive_depth(kind, attrs.provider(), options, layout.recv_len());
        let rx_depth = super::config::queue_depth(wanted_rx, rx.size);
        let tx_depth = super::config::queue_depth(options.tx_depth, tx.size);
        let inject_size = usize::try_from(tx.inject_size).unwrap_or(usize::MAX);
        let tx_iov_limit = usize::try_from(tx.iov_limit).unwrap_or(usize::MAX);

        let fabric = Fabric::open(&info)?;
        let domain = Domain::open(&fabric, &info)?;
        // shm keeps at most SHM_MAX_PEERS peers and refuses a larger table.
        let av_limit = if attrs.provider() == "shm" {
            SHM_MAX_PEERS
        } else {
            usize::MAX
        };
        let av = AddressVector::open_table(&domain, options.av_size.min(av_limit))?;
        // The sockets provider signals its wait set by writing to a
        // blocking socketpair that only `fi_wait` drains: under a sustained
        // stream its own progress thread blocks on the full pair (seen with
        // libfabric 1.17), so it is polled.
        let want_wait = options.wait_fd && attrs.provider() != "sockets";
        // Only an asked-for grant is relied on, as for FI_SOURCE.
        let multi_recv =
            super::config::wants_multi_recv(kind, options) && attrs.caps & FI_MULTI_RECV != 0;
        // A multi-receive buffer completes many messages per post: more
        // room than one completion per buffer (small messages may still
        // outrun it; the providers' queues then hold the rest).
        let rx_completions = if multi_recv {
            rx_depth * super::config::MULTI_RECV_SLOTS
        } else {
            rx_depth
        };
        let (wait, tx_cq, rx_cq) = open_cqs(
            &fabric,
            &domain,
            want_wait,
            tx_depth + rendezvous::READ_SLOTS + rendezvous::ORPHANS_MAX,
            rx_completions,
        )?;
        let mut ep = FiEndpoint::open(&domain, &info)?;
        ep.bind_av(&av)?;
        ep.bind_cq(&tx_cq, FI_TRANSMIT)?;
        ep.bind_cq(&rx_cq, FI_RECV)?;
        // Providers may report FI_SOURCE unasked; only an asked-for grant
        // is relied on.
        let checks_source = attrs.caps & FI_SOURCE != 0 && honours_source(attrs.provider());
        let mut rnr_retry = None;
        if kind == EpKind::Rdm && attrs.provider().starts_with("efa") {
            // Before fi_enable, RDM only (fi_efa(7)). Devices that cannot
            // change it answer ENOSYS/EOPNOTSUPP: keep the default then.
            match ep.set_efa_rnr_retry(options.rnr_retry) {
                Ok(()) => rnr_retry = Some(options.rnr_retry),
                Err(err)
                    if matches!(err.code().map(|c| c.code), Some(FI_ENOSYS | FI_EOPNOTSUPP)) =>
                {
                    tracing::warn!("{err}; keeping the provider's RNR retry")
                }
                Err(err) => return Err(err),
            }
        }
        ep.enable()?;
        // A buffer is released once the largest message no longer fits.
        let multi_recv = multi_recv
            && match ep.set_min_multi_recv(layout.recv_len()) {
                Ok(()) => true,
                Err(err) => {
                    tracing::warn!("{err}; posting one receive per message");
                    false
                }
            };
        let local_addr = ep.name()?;
        if local_addr.is_empty() || local_addr.len() > MAX_ADDR_LEN {
            return Err(unusable(format!("address of {} bytes", local_addr.len())));
        }
        let text_addresses = attrs.addr_format == FI_ADDR_STR;
        // SAFETY: the length fi_getname reported is the provider's address
        // size for this endpoint's format, which says whether it is text.
        unsafe { av.set_addr_len(local_addr.len(), text_addresses) };

        let max_frame = layout
            .frame_limit(local_addr.len(), text_addresses)
            .min(config.max_frame);
        if max_frame < 64 {
            return Err(unusable(format!(
                "only {max_frame} bytes per message remain after prefix and header"
            )));
        }
        let stride = layout.slot_stride();
        let buffers =
            super::config::buffer_memory(stride, (rx_depth, tx_depth), multi_recv, mr_local);
        let (rx_slots, rx_stride) = buffers.multi_recv.unwrap_or((rx_depth, stride));
        let mut rx_pool = BufferPool::new(rx_slots, rx_stride)?;
        let mut tx_pool = BufferPool::new(tx_depth, stride)?;
        // Received frames may be forwarded from the rx pool as they lie when
        // its region also allows sends; a provider refusing that gets a
        // receive-only region, and forwarded payloads are copied.
        let mut rx_pool_sendable = false;
        if mr_local {
            // Distinct keys matter only to providers without FI_MR_PROV_KEY.
            match rx_pool.register(&domain, FI_RECV | FI_SEND, 1) {
                Ok(()) => rx_pool_sendable = true,
                Err(err) => {
                    tracing::debug!("{err}; registering the receive buffers for receives only");
                    rx_pool.register(&domain, FI_RECV, 1)?;
                }
            }
            tx_pool.register(&domain, FI_SEND, 2)?;
        }

        let rendezvous_max = super::config::rendezvous_max(
            kind,
            attrs.provider(),
            attrs.caps,
            options,
            (ep_attrs.max_msg_size, config.max_frame, max_frame),
        );
        let mut rma = (rendezvous_max > 0)
            .then(|| {
                Rendezvous::new(
                    dom.mr_mode & FI_MR_VIRT_ADDR != 0,
                    rendezvous_max,
                    dom.mr_key_size,
                )
            })
            .transpose()?;
        if let Some(rma) = rma.as_mut().filter(|rma| {
            options.huge_landing && rma.virt_addr && attrs.provider() == super::config::SHM_PROVIDER
        }) {
            // Its reads are `process_vm_readv`, which pins the source's
            // pages per read: landing buffers are sources when forwarded.
            if !rma.landing.use_huge_pages() {
                tracing::debug!("no transparent huge pages here: landing buffers stay ordinary");
            }
        }
        let link = LinkInfo {
            kind,
            provider: attrs.provider().to_string(),
            fabric: attrs
                .fabric
                .as_ref()
                .and_then(|f| f.name.clone())
                .unwrap_or_default(),
            domain: dom.name.clone().unwrap_or_default(),
            sas,
            msg_prefix_size: prefix,
            provider_prefix,
            max_msg_size: ep_attrs.max_msg_size,
            inject_size,
            max_frame,
            mr_local,
            tx_iov_limit,
            rx_depth,
            multi_recv: multi_recv.then_some(rx_stride),
            tx_depth,
            addr_format: attrs.addr_format,
            resource_mgmt: dom.resource_mgmt,
            manual_progress: Some(dom.data_progress)
                == efabus_core::caps::Progress::Manual.c_value().map(u64::from),
            rnr_retry,
            source_checked: checks_source,
            rendezvous_max: rma.as_ref().map_or(0, |rma| rma.max_frame),
            fenced_release: rma.is_some() && super::provider_env::rxm_over_tcp(attrs.provider()),
        };
        tracing::debug!(?link, "fabric endpoint open");

        let mut endpoint = FabricEndpoint {
            ep,
            rma,
            tx_cq,
            rx_cq,
            wait,
            av,
            rx_pool,
            tx_pool,
            rx_pool_sendable,
            _domain: domain,
            _fabric: fabric,
            info,
            scheme: kind.scheme(),
            buffers,
            link,
            layout,
            header_addr: local_addr.clone(),
            header_version: super::layout::HEADER_VERSION,
            local_addr,
            next_peer: 1,
            peers: FxHashMap::default(),
            links: FxHashMap::default(),
            used_send_keys: UsedSendKeys::default(),
            av_cache: HashMap::new(),
            av_clock: 0,
            max_addresses: options.max_addresses.min(av_limit),
            checks_source,
            sources: vec![FI_ADDR_NOTAVAIL; CQ_BATCH],
            free_tx: (0..tx_depth).rev().collect(),
            peer_slots: (tx_depth / PEER_SLOTS_DIVISOR)
                .max(PEER_SLOTS_FLOOR.min(tx_depth / 2))
                .max(PEER_SLOTS_MIN),
            reserved_slots: tx_depth / 8,
            tx_owner: vec![None; tx_depth],
            tx_post_len: vec![0; tx_depth],
            tx_sealed: vec![false; tx_depth],
            tx_dest: vec![0; tx_depth],
            tx_body: vec![None; tx_depth],
            tx_control: vec![false; tx_depth],
            tx_fence: vec![None; tx_depth],
            progressing: false,
            progress_again: false,
            sends_posted: 0,
            rounds_since_tx_read: 0,
            last_post: None,
            slow_read_post: SLOW_READ_POST,
            shm_open: None,
            unposted_rx: (0..rx_slots).rev().collect(),
            rx_posted: vec![false; rx_slots],
            rx_lent_from: vec![false; rx_slots],
            lent_rx: 0,
            pending: VecDeque::new(),
            backlogged: Vec::new(),
            writable_waiters: Vec::new(),
            completions: vec![Completion::default(); CQ_BATCH],
            stats: FabricStats::default(),
            bad_input_log: BadInputLog::default(),
        };
        if endpoint.link.provider == super::config::SHM_PROVIDER {
            let open = Arc::new(AtomicBool::new(true));
            local_shm_endpoints()
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(endpoint.local_addr.clone(), open.clone());
            endpoint.shm_open = Some(open);
        }
        endpoint.post_receives()?;
        if !endpoint.unposted_rx.is_empty() {
            tracing::debug!(
                left = endpoint.unposted_rx.len(),
                "provider accepted fewer receives than were offered; the rest are posted later"
            );
        }
        Ok(endpoint)
    }

    /// Testing aid: write `addr` as the sender of every message from now
    /// on, as an attacker forging another endpoint's address would.
    #[cfg(feature = "testing")]
    pub fn claim_address(&mut self, addr: &[u8]) {
        self.header_addr = addr.to_vec();
    }

    /// Testing aid: write `version` as the header version of every message
    /// from now on, so that receivers find it malformed.
    #[cfg(feature = "testing")]
    pub fn claim_header_version(&mut self, version: u8) {
        self.header_version = version;
    }

    /// Testing aid: send `frame` to `peer` as one of the endpoint's own
    /// frames (a rendezvous descriptor or done frame), whatever it says,
    /// as a peer holding the link's keys could.
    #[cfg(feature = "testing")]
    pub fn send_endpoint_frame(&mut self, peer: PeerId, frame: Bytes) -> Result<(), SendError> {
        self.send_eager(peer, OutFrame::whole(frame), EagerFrame::Descriptor)
    }

    /// What the provider granted.
    pub fn link(&self) -> &LinkInfo {
        &self.link
    }

    /// Whether FI_ORDER_SAS was granted (see [`LinkInfo::sas`]).
    pub fn sas_granted(&self) -> bool {
        self.link.sas
    }

    /// The selected `fi_info`, in `fi_info -v` layout.
    pub fn info_text(&self) -> String {
        self.info.to_text()
    }

    /// The selected `fi_info` as values.
    pub fn info_attrs(&self) -> super::attrs::InfoAttrs {
        self.info.attrs()
    }

    pub fn stats(&self) -> &FabricStats {
        &self.stats
    }

    /// How long posting one rendezvous read may take before the poll
    /// starts no further read (50 us by default: such a read was a copy
    /// made inside `fi_read`). Zero starts one read per poll.
    pub fn set_slow_read_post(&mut self, slow: Duration) {
        self.slow_read_post = slow;
    }

    /// Rendezvous transfers sent and not yet done (read by their peers, or
    /// given up with them), and the body bytes registered for them.
    pub fn rendezvous_held(&self) -> (usize, usize) {
        self.rma
            .as_ref()
            .map_or((0, 0), |rma| (rma.sends.len(), rma.registrations.bytes()))
    }

    /// Bodies of transfers abandoned by their link's close that are kept
    /// while the peer may still read them, and their bytes.
    pub fn rendezvous_abandoned_kept(&self) -> (usize, usize) {
        self.rma.as_ref().map_or((0, 0), |rma| rma.abandoned.held())
    }

    /// Rendezvous frames offered by peers whose reads have not started
    /// yet (waiting for a read slot, their peer's share, or a hold), and
    /// the memory their descriptors hold.
    pub fn rendezvous_queued(&self) -> (usize, usize) {
        self.rma
            .as_ref()
            .map_or((0, 0), |rma| (rma.queue.len(), rma.queue.bytes()))
    }

    /// The memory the descriptors waiting for their reads may hold, all
    /// peers together ([`rendezvous::QUEUED_MAX`] by default); past it,
    /// the peer whose descriptors hold the most is cut off.
    pub fn set_rendezvous_queued_max(&mut self, bytes: usize) {
        if let Some(rma) = self.rma.as_mut() {
            rma.queue.set_max(bytes);
        }
    }

    /// Posts every receive slot not currently posted. A -FI_EAGAIN leaves
    /// the rest for the next poll.
    fn post_receives(&mut self) -> Result<(), FabricError> {
        let multi_recv = self.link.multi_recv.is_some();
        let len = self.link.multi_recv.unwrap_or(self.layout.recv_len());
        let desc = self.rx_pool.desc();
        while let Some(&slot) = self.unposted_rx.last() {
            let buf = self.rx_pool.slot_ptr(slot);
            let context = self.rx_pool.context(slot);
            // Held from its post on; a post that fails gives it back.
            self.rx_pool.hold(slot);
            // SAFETY: the slot is not posted (it is in `unposted_rx`, so
            // nothing lent from it is alive), lies in the rx pool, which
            // outlives the endpoint (drop order), and is not touched until
            // its completions are read (of a multi-receive buffer, only
            // the bytes each reports landed); `desc` is the pool's region
            // or NULL when the provider needs none.
            match unsafe { self.ep.recv(buf, len, desc, context, multi_recv) } {
                Ok(()) => {
                    self.unposted_rx.pop();
                    self.rx_posted[slot] = true;
                    self.stats.rx_posts += 1;
                }
                Err(code) => {
                    // Nothing lent from it: it stays with the endpoint.
                    self.rx_pool.release(slot);
                    if code.is_again() {
                        break;
                    }
                    return Err(FabricError::Recv { code });
                }
            }
        }
        Ok(())
    }

    /// Posts the backlogs, then reads the rx CQ and, while a completion
    /// of ours is due there (or once in `TX_CQ_CHECK_ROUNDS` rounds), the
    /// tx CQ: more than once only while they come back full or a send
    /// asked for progress meanwhile. Queues events.
    fn progress(&mut self) -> Result<(), FabricError> {
        // A send made from within progress (a done frame) may find no slot
        // and ask for progress again: the outer call carries on instead.
        if self.progressing {
            self.progress_again = true;
            return Ok(());
        }
        self.progressing = true;
        let result = self.progress_once();
        self.progressing = false;
        result
    }

    fn progress_once(&mut self) -> Result<(), FabricError> {
        // Slots given back first, so what arrives now may be lent again.
        let first = self.unposted_rx.len();
        self.rx_pool.take_returned(&mut self.unposted_rx);
        for i in first..self.unposted_rx.len() {
            self.forget_lends(self.unposted_rx[i]);
        }
        // Frames sent since the last call go before the queues are read:
        // a reply made to what the last call delivered waits for no
        // provider call (with `tcp;ofi_rxm`, a poll of its sockets).
        self.flush_backlogs();
        let budget = self.link.tx_depth + self.link.rx_depth + CQ_BATCH;
        let mut handled = 0;
        loop {
            let tx = if self.tx_due() || self.rounds_since_tx_read >= TX_CQ_CHECK_ROUNDS {
                self.drain_tx()?
            } else {
                self.rounds_since_tx_read += 1;
                0
            };
            let rx = self.drain_rx()?;
            handled += tx + rx;
            // A read that came back short of a batch emptied its queue:
            // what completes after it is found at the next poll, unless a
            // send made meanwhile is waiting for a slot. Reading both
            // queues again only to find them empty doubled the provider
            // calls (and, with `shm`, its locking) per message.
            let again = std::mem::take(&mut self.progress_again);
            let full = tx == CQ_BATCH || rx == CQ_BATCH;
            if tx + rx == 0 || !(full || again) || handled >= budget {
                break;
            }
        }
        self.start_reads();
        if let Some(rma) = self.rma.as_mut().filter(|rma| !rma.abandoned.is_empty()) {
            rma.abandoned.let_go(Instant::now());
        }
        self.flush_dones();
        // What was sent meanwhile (dones of reads just finished, answers
        // made while handling completions) leaves in this call too.
        self.flush_backlogs();
        self.post_receives()?;
        if !self.free_tx.is_empty() {
            // A peer still at its share keeps waiting: waking it would
            // only have it refused again.
            let mut waiters = std::mem::take(&mut self.writable_waiters);
            waiters.retain(|&peer| {
                let Some(state) = self.peers.get(&peer) else {
                    return false;
                };
                if !self.may_take_slot(state) {
                    return true;
                }
                if let Some(state) = self.peers.get_mut(&peer) {
                    if std::mem::take(&mut state.wants_writable) {
                        self.pending.push_back(Event::Writable { peer });
                    }
                }
                false
            });
            self.writable_waiters = waiters;
        }
        Ok(())
    }

    /// Whether a completion of ours is due on the tx CQ: a send posted
    /// without inject, or a rendezvous read.
    fn tx_due(&self) -> bool {
        self.sends_posted > 0 || self.rma.as_ref().is_some_and(Rendezvous::reads_in_flight)
    }

    fn drain_tx(&mut self) -> Result<usize, FabricError> {
        self.rounds_since_tx_read = 0;
        self.stats.tx_cq_reads += 1;
        match self.tx_cq.read(&mut self.completions)? {
            CqRead::Entries(n) => {
                for i in 0..n {
                    let context = self.completions[i].op_context;
                    match self.rma.as_ref().and_then(|rma| rma.slot_of(context)) {
                        Some(slot) => self.finish_read(slot, None),
                        None => {
                            if let (_, Some(id)) = self.finish_send(context) {
                                self.end_transfer(id);
                                if let Some(rma) = self.rma.as_mut() {
                                    rma.abandoned.fence_passed(id);
                                }
                            }
                        }
                    }
                }
                Ok(n)
            }
            CqRead::ErrorAvailable => {
                if let Some(err) = self.tx_cq.read_error()? {
                    if let Some(slot) = self
                        .rma
                        .as_ref()
                        .and_then(|rma| rma.slot_of(err.op_context))
                    {
                        self.stats.tx_errors += 1;
                        let error = FabricError::Completion {
                            op: "fi_read",
                            code: err.code,
                            prov_errno: err.prov_errno,
                            provider_text: err.provider_text,
                        };
                        self.finish_read(slot, Some(error.to_string()));
                        return Ok(1);
                    }
                    self.on_tx_error(err);
                    return Ok(1);
                }
                Ok(0)
            }
        }
    }

    /// Frees a tx slot whose send completed; returns its peer, and the
    /// transfer whose fence it carried.
    fn finish_send(&mut self, context: *mut std::ffi::c_void) -> (Option<PeerId>, Option<u64>) {
        let Some(slot) = self.tx_pool.slot_of(context) else {
            tracing::warn!("tx completion with an unknown context");
            return (None, None);
        };
        self.sends_posted = self.sends_posted.saturating_sub(1);
        let fence = self.tx_fence[slot].take();
        let Some((peer, _)) = self.tx_owner[slot] else {
            return (None, fence);
        };
        self.release_slot(slot);
        (Some(peer), fence)
    }

    fn on_tx_error(&mut self, err: CqError) {
        self.stats.tx_errors += 1;
        if err.code.code == FI_ENORX {
            self.stats.rnr_failures += 1;
        }
        let (peer, fence) = self.finish_send(err.op_context);
        if let (Some(fence), Some(rma)) = (fence, self.rma.as_mut()) {
            rma.abandoned.fence_lost(fence, Instant::now());
        }
        let error = FabricError::Completion {
            op: "fi_send",
            code: err.code,
            prov_errno: err.prov_errno,
            provider_text: err.provider_text,
        };
        match (self.link.kind, peer) {
            // A reliable send that failed means the peer is unreachable.
            (EpKind::Rdm, Some(peer)) if self.peers.contains_key(&peer) => {
                tracing::warn!(%peer, "{error}");
                self.drop_peer(peer, CloseReason::Error(error.to_string()));
            }
            // Datagrams may be lost anyway: count and carry on.
            _ => {
                if let Some(held_back) = self.bad_input_log.send_failed.allow(Instant::now()) {
                    tracing::warn!(held_back, "{error}");
                }
            }
        }
        self.stats.last_error = Some(error.to_string());
    }

    fn drain_rx(&mut self) -> Result<usize, FabricError> {
        self.stats.rx_cq_reads += 1;
        let read = if self.checks_source {
            self.rx_cq
                .read_from(&mut self.completions, &mut self.sources)?
        } else {
            self.rx_cq.read(&mut self.completions)?
        };
        match read {
            CqRead::Entries(n) => {
                for i in 0..n {
                    let completion = self.completions[i];
                    let source = self.checks_source.then(|| self.sources[i]);
                    self.on_receive(&completion, source);
                }
                Ok(n)
            }
            CqRead::ErrorAvailable => {
                if let Some(err) = self.rx_cq.read_error()? {
                    self.stats.rx_errors += 1;
                    let released = self.let_go(err.flags) || err.code.code == FI_ECANCELED;
                    let slot = self.rx_pool.slot_of(err.op_context);
                    if let Some(slot) = slot.filter(|&slot| released && self.rx_posted[slot]) {
                        self.release_rx(slot);
                    }
                    if err.code.code != FI_ECANCELED {
                        let error = FabricError::Completion {
                            op: "fi_recv",
                            code: err.code,
                            prov_errno: err.prov_errno,
                            provider_text: err.provider_text,
                        };
                        if let Some(held_back) =
                            self.bad_input_log.receive_failed.allow(Instant::now())
                        {
                            tracing::warn!(held_back, "{error}");
                        }
                        self.stats.last_error = Some(error.to_string());
                    }
                    return Ok(1);
                }
                Ok(0)
            }
        }
    }

    /// One receive completion; `source` is the sender's address-vector
    /// entry where the provider reports it (FI_SOURCE).
    fn on_receive(&mut self, completion: &Completion, source: Option<u64>) {
        let Some(slot) = self.rx_pool.slot_of(completion.op_context) else {
            tracing::warn!("rx completion with an unknown context");
            return;
        };
        if !self.rx_posted[slot] {
            // The provider let go of this buffer already: what it reports
            // now cannot be trusted. (Once the buffer is posted again such
            // a completion cannot be told from a new one, which is why
            // multi-receive buffers are used only where the provider lets
            // go of a buffer once all its messages are in.)
            self.stats.rx_errors += 1;
            self.stats.last_error = Some("a receive completion for a buffer let go of".into());
            tracing::warn!("rx completion for a receive buffer the provider had let go of");
            return;
        }
        self.take_message(slot, completion, source);
        if self.let_go(completion.flags) {
            self.release_rx(slot);
        }
    }

    /// Whether a receive completion with `flags` ends its slot's post: a
    /// slot of one message is done with; a multi-receive buffer once the
    /// provider says it has let go of it.
    fn let_go(&self, flags: u64) -> bool {
        self.link.multi_recv.is_none() || flags & FI_MULTI_RECV != 0
    }

    /// The provider is done with rx slot `slot`: it is posted again once
    /// no frame lent from it is alive.
    fn release_rx(&mut self, slot: usize) {
        self.rx_posted[slot] = false;
        if self.rx_pool.release(slot) {
            self.forget_lends(slot);
            self.unposted_rx.push(slot);
        }
    }

    /// Rx slot `slot`, back from the provider and every lent frame, no
    /// longer counts against the lending budget.
    fn forget_lends(&mut self, slot: usize) {
        self.lent_rx -= usize::from(std::mem::take(&mut self.rx_lent_from[slot]));
    }

    /// Decodes, checks and hands on the message a receive completion in
    /// rx slot `slot` reports.
    fn take_message(&mut self, slot: usize, completion: &Completion, source: Option<u64>) {
        let len = usize::try_from(completion.len).unwrap_or(usize::MAX);
        let (offset, data) = if self.link.multi_recv.is_some() {
            if len == 0 {
                // The provider let go of the buffer with no message.
                return;
            }
            // SAFETY: this completion was read: the provider writes the
            // bytes it reports no more, and they are not written again
            // before the buffer is posted again.
            let landed = unsafe {
                self.rx_pool
                    .landed(slot, completion.buf.cast_const().cast(), len)
            };
            let Some(landed) = landed else {
                self.stats.rx_errors += 1;
                self.stats.last_error = Some("a receive completion outside its buffer".into());
                tracing::warn!("rx completion outside its multi-receive buffer");
                return;
            };
            landed
        } else {
            // SAFETY: the completion for this slot was just read, so the
            // provider is done with it; it is not posted again before it
            // is released (or, when lent, before the pool hands it back).
            (0, unsafe { self.rx_pool.slot(slot) })
        };
        // Where the frames lie in the slot, and which peer sent them.
        let accepted = match self.layout.decode(data, len) {
            Ok(Received::ProviderOnly) => {
                self.stats.provider_packets += 1;
                None
            }
            Ok(Received::Frames(message)) => {
                let start = message.frames.as_ptr() as usize - data.as_ptr() as usize;
                let range = start..start + message.frames.len();
                let checks = Checks {
                    links: &self.links,
                    peers: &mut self.peers,
                    stats: &mut self.stats,
                    log: &mut self.bad_input_log,
                };
                checks
                    .authenticate(&message, source)
                    .map(|peer| (peer, range, message.control))
            }
            Err(err) => {
                self.stats.malformed += 1;
                if let Some(held_back) = self.bad_input_log.malformed.allow(Instant::now()) {
                    tracing::warn!(held_back, "dropped a malformed message: {err}");
                }
                self.stats.last_error = Some(format!("malformed message: {err}"));
                None
            }
        };
        let Some((peer, range, control)) = accepted else {
            return;
        };
        self.stats.received_messages += 1;
        let range = offset + range.start..offset + range.end;
        let run = if self.lends(slot, range.len()) {
            if !std::mem::replace(&mut self.rx_lent_from[slot], true) {
                self.lent_rx += 1;
            }
            self.stats.lent += 1;
            // SAFETY: the endpoint holds the slot until `on_receive`
            // releases it, the range's completion was read, and the slot
            // is not posted again until the pool hands it back once the
            // frames are dropped.
            unsafe { self.rx_pool.lend(slot, range) }
        } else {
            // SAFETY: as above; the slot is posted again only after this
            // copy.
            Bytes::copy_from_slice(unsafe { self.rx_pool.part(slot, range) })
        };
        for range in frames(&run) {
            if control {
                // A refused frame ends the link: the rest of its message
                // is not read (nor counted again).
                if !self.peers.contains_key(&peer) {
                    break;
                }
                self.on_endpoint_frame(peer, &run[range]);
                continue;
            }
            self.stats.received += 1;
            let frame = run.slice(range);
            self.pending.push_back(Event::Frame { peer, frame });
        }
    }

    /// Whether a peer holding `state`'s slots and bytes may take one more
    /// slot (a frame may carry its bytes past the share once). Each peer gets a share (`peer_slots`
    /// slots, `PEER_TX_BYTES` bytes), and a peer already holding
    /// `PEER_SLOTS_MIN` leaves the last `reserved_slots` free ones to the
    /// others: a receiver that stops taking its messages holds no more than
    /// its share, and the sends to everyone else go on.
    fn may_take_slot(&self, state: &PeerState) -> bool {
        let first = state.slots < PEER_SLOTS_MIN;
        first
            || state.slots < self.peer_slots
                && state.queued_bytes < PEER_TX_BYTES
                && self.free_tx.len() > self.reserved_slots
    }

    /// Whether a received run of `len` bytes in rx slot `slot` is lent
    /// rather than copied: large enough, on RDM only (a DGRAM peer's window
    /// counts on every receive staying posted; an RDM provider holds early
    /// messages itself), and while at most half the receive slots hold
    /// lent frames (a multi-receive buffer that holds some already may
    /// lend more).
    fn lends(&self, slot: usize, len: usize) -> bool {
        len >= LEND_MIN
            && self.link.kind == EpKind::Rdm
            && (self.rx_lent_from[slot] || self.lent_rx < self.rx_pool.count() / 2)
    }

    fn add_peer(&mut self, addr: &[u8], keys: &LinkKeys) -> Result<PeerId, FabricError> {
        if self.links.contains_key(&keys.local_id) {
            return Err(FabricError::LinkIdInUse(keys.local_id));
        }
        if !self.used_send_keys.take(&keys.send_key) {
            return Err(FabricError::SendKeyReused);
        }
        // shm maps the region a name points at when it is inserted: only
        // names of its own form, none chosen by a peer. It reads a name up
        // to its NUL, so that is the name: two spellings of one would be
        // two entries of one peer.
        let shm = self.link.provider == super::config::SHM_PROVIDER;
        let addr = if shm {
            match addr.iter().position(|&b| b == 0) {
                Some(end) if is_shm_name(addr) => &addr[..=end],
                _ => return Err(FabricError::NotAnShmName),
            }
        } else {
            addr
        };
        self.av_clock += 1;
        let fi_addr = match self.av_cache.get_mut(addr) {
            Some(entry) => {
                entry.users += 1;
                entry.last_used = self.av_clock;
                entry.fi_addr
            }
            None => {
                // libfabric 1.17's shm takes a name whose region does not
                // exist, leaves its slot free, and gives the next name that
                // slot's entry: two names, one `fi_addr`, whose removal
                // unmaps both, and an entry counted against its 256 each
                // time. Such names are refused here; one whose region goes
                // between this look and the insert is caught below.
                if shm && !shm_region_exists(addr) {
                    return Err(FabricError::NoShmRegion);
                }
                if self.av_cache.len() >= self.max_addresses {
                    self.evict_address()?;
                }
                let fi_addr = self.av.insert(addr)?;
                // The older name's entry is given to the new one (never
                // removed: the provider counted both inserts) when no peer
                // uses it; else the new name is refused.
                let aliased = shm
                    .then(|| {
                        self.av_cache
                            .iter()
                            .find(|(_, entry)| entry.fi_addr == fi_addr)
                            .map(|(name, entry)| (name.clone(), entry.users))
                    })
                    .flatten();
                match aliased {
                    Some((_, users)) if users > 0 => return Err(FabricError::AddressAliased),
                    Some((older, _)) => {
                        self.av_cache.remove(&older);
                        self.stats.av_aliases += 1;
                    }
                    None => {}
                }
                self.av_cache.insert(
                    addr.to_vec(),
                    AvEntry {
                        fi_addr,
                        users: 1,
                        last_used: self.av_clock,
                    },
                );
                fi_addr
            }
        };
        let in_process = self.shm_open.as_ref().and_then(|_| {
            local_shm_endpoints()
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(addr)
                .cloned()
        });
        let peer = PeerId(self.next_peer);
        self.next_peer += 1;
        self.links.insert(keys.local_id, peer);
        self.peers.insert(
            peer,
            PeerState {
                addr: addr.to_vec(),
                fi_addr,
                local_id: keys.local_id,
                remote_id: keys.remote_id,
                send_tag: TagKey::new(&keys.send_key),
                receive_tag: TagKey::new(&keys.receive_key),
                sent_counter: 0,
                replay: ReplayWindow::default(),
                queued_bytes: 0,
                slots: 0,
                backlog: VecDeque::new(),
                wants_writable: false,
                pack_limit: 0,
                rendezvous: 0,
                rma_sends: 0,
                rma_bytes: 0,
                rma_reads: 0,
                in_process,
            },
        );
        Ok(peer)
    }

    /// Removes the least recently used address no live peer needs and no
    /// send or read in flight goes to, or fails when there is none. Over
    /// `shm`, one whose process has gone (its region removed) goes before
    /// any other, among the [`DEPARTED_LOOKS`] least recently used:
    /// libfabric 1.17 keeps state of a peer whose entry is removed, which
    /// a process still running finds stale when it comes back.
    fn evict_address(&mut self) -> Result<(), FabricError> {
        let reads = self.rma.iter().flat_map(|rma| &rma.slots);
        let in_flight: std::collections::HashSet<u64> = (0..self.tx_owner.len())
            .filter(|&slot| self.tx_owner[slot].is_some())
            .map(|slot| self.tx_dest[slot])
            .chain(reads.filter_map(|slot| slot.job.as_ref().map(|job| job.fi_addr)))
            .collect();
        let mut unused: Vec<(&Vec<u8>, &AvEntry)> = self
            .av_cache
            .iter()
            .filter(|(_, entry)| entry.users == 0 && !in_flight.contains(&entry.fi_addr))
            .collect();
        unused.sort_unstable_by_key(|(_, entry)| entry.last_used);
        let departed = (self.link.provider == super::config::SHM_PROVIDER)
            .then(|| {
                unused
                    .iter()
                    .take(DEPARTED_LOOKS)
                    .find(|(addr, _)| !shm_region_exists(addr))
            })
            .flatten();
        let Some((addr, fi_addr)) = departed
            .or(unused.first())
            .map(|(addr, entry)| ((*addr).clone(), entry.fi_addr))
        else {
            return Err(FabricError::AddressesFull {
                limit: self.max_addresses,
            });
        };
        // Forgotten only once libfabric has let it go.
        self.av.remove(fi_addr)?;
        self.av_cache.remove(&addr);
        self.stats.av_evictions += 1;
        Ok(())
    }

    fn drop_peer(&mut self, peer: PeerId, reason: CloseReason) {
        if !self.peers.contains_key(&peer) {
            return;
        }
        let fence = self.drop_rendezvous(peer);
        let backlog = self
            .peers
            .get_mut(&peer)
            .map(|s| std::mem::take(&mut s.backlog))
            .unwrap_or_default();
        for slot in backlog {
            self.release_slot(slot);
        }
        if let Some(fence) = fence {
            self.post_closing_fence(peer, fence);
        }
        if let Some(state) = self.peers.remove(&peer) {
            self.links.remove(&state.local_id);
            if let Some(entry) = self.av_cache.get_mut(&state.addr) {
                entry.users = entry.users.saturating_sub(1);
            }
            self.pending.push_back(Event::Closed { peer, reason });
        }
    }

    /// Posts tx slot `slot` to `dest`: with `fi_inject` when the whole
    /// posted length fits the provider's `inject_size` (the provider copies
    /// it, so the slot is free again at once), else with `fi_send`.
    fn post_slot(&mut self, slot: usize, dest: u64) -> Result<(), FiCode> {
        let len = self.tx_post_len[slot];
        // A slot sealed at an earlier, refused try keeps its tag.
        let state = (!self.tx_sealed[slot])
            .then(|| self.tx_owner[slot])
            .flatten()
            .and_then(|(peer, _)| self.peers.get(&peer));
        if let Some(state) = state {
            // SAFETY: the slot is not posted (it waits in a backlog), so
            // no operation reads it while its tag is written.
            let buf = unsafe { self.tx_pool.slot_mut(slot) };
            let body = self.tx_body[slot].as_deref().unwrap_or_default();
            if self.tx_control[slot] {
                self.layout.mark_control(buf);
            }
            self.layout.seal(buf, len, body, &state.send_tag);
            if self.header_version != HEADER_VERSION {
                buf[self.layout.prefix] = self.header_version;
            }
            self.tx_sealed[slot] = true;
        }
        let ptr = self.tx_pool.slot_ptr(slot);
        let desc = self.tx_pool.desc();
        let context = self.tx_pool.context(slot);
        if let Some(body) = &self.tx_body[slot] {
            let body_desc = if self.link.mr_local {
                self.rx_pool.desc()
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: as below for the slot; the body is held in `tx_body`
            // until the completion releases the slot, and `body_desc` is
            // the rx pool's region, which covers it (`shares_body`), or
            // NULL when the provider needs none.
            let posted = unsafe {
                self.ep.send2(
                    (ptr, len, desc),
                    (body.as_ptr(), body.len(), body_desc),
                    dest,
                    context,
                )
            };
            if posted.is_ok() {
                self.stats.sent += 1;
                self.sends_posted += 1;
                self.note_post();
            }
            return posted;
        }
        // A fence's completion is what it is sent for.
        if BufferLayout::fits_inject(self.link.inject_size, len) && self.tx_fence[slot].is_none() {
            // SAFETY: the slot holds `len` encoded bytes and is not posted.
            let bytes = unsafe { std::slice::from_raw_parts(ptr.cast_const(), len) };
            match self.ep.inject(bytes, dest) {
                Ok(()) => {
                    self.stats.injected += 1;
                    self.note_post();
                    self.release_slot(slot);
                    return Ok(());
                }
                // A send may still get through where inject may not.
                Err(code) if code.is_again() => {}
                Err(code) => return Err(code),
            }
        }
        // SAFETY: the slot is owned by one send (tx_owner) and not written
        // again until its completion frees it; the pool outlives the
        // endpoint (drop order); `desc` is the pool's region or NULL.
        let posted = unsafe { self.ep.send(ptr, len, desc, dest, context) };
        if posted.is_ok() {
            self.stats.sent += 1;
            self.sends_posted += 1;
            self.note_post();
        }
        posted
    }

    /// Remember when a manual-progress provider last took a send
    /// ([`FabricEndpoint::wait_cap`]).
    fn note_post(&mut self) {
        if self.link.manual_progress {
            self.last_post = Some(Instant::now());
        }
    }

    /// Returns a tx slot to the free list, uncounting its bytes.
    fn release_slot(&mut self, slot: usize) {
        self.tx_body[slot] = None;
        self.tx_fence[slot] = None;
        if let Some((peer, len)) = self.tx_owner[slot].take() {
            if let Some(state) = self.peers.get_mut(&peer) {
                state.queued_bytes = state.queued_bytes.saturating_sub(len);
                state.slots = state.slots.saturating_sub(1);
            }
        }
        self.free_tx.push(slot);
    }

    /// Posts what each peer's backlog holds, oldest first, until the
    /// provider pushes back again.
    fn flush_backlogs(&mut self) {
        if self.backlogged.is_empty() {
            return;
        }
        // Flushing adds no peer to the list (but one it closes, which is
        // gone), so it is taken and put back.
        let mut waiting = std::mem::take(&mut self.backlogged);
        for &peer in &waiting {
            self.flush_backlog(peer);
        }
        // Keep the peers the provider still refuses.
        waiting.retain(|peer| self.peers.get(peer).is_some_and(|s| !s.backlog.is_empty()));
        self.backlogged = waiting;
    }

    fn flush_backlog(&mut self, peer: PeerId) {
        if !self.peer_endpoint_open(peer) {
            return;
        }
        loop {
            let Some(state) = self.peers.get(&peer) else {
                return;
            };
            let Some(&slot) = state.backlog.front() else {
                return;
            };
            let dest = state.fi_addr;
            match self.post_slot(slot, dest) {
                Ok(()) => {
                    if let Some(state) = self.peers.get_mut(&peer) {
                        state.backlog.pop_front();
                    }
                }
                Err(code) if code.is_again() => return,
                Err(code) => {
                    self.stats.tx_errors += 1;
                    let error = FabricError::Send { code };
                    tracing::warn!(%peer, "{error}");
                    self.stats.last_error = Some(error.to_string());
                    let backlog = self
                        .peers
                        .get_mut(&peer)
                        .map(|s| std::mem::take(&mut s.backlog))
                        .unwrap_or_default();
                    for slot in backlog {
                        self.release_slot(slot);
                    }
                    if self.link.kind == EpKind::Rdm {
                        self.drop_peer(peer, CloseReason::Error(error.to_string()));
                    }
                    return;
                }
            }
        }
    }

    /// Sends `frame` (checked, within the eager limit) in a tx slot: packed
    /// behind the newest unposted frame for the peer where it fits. The
    /// endpoint's own frames go in control messages.
    fn send_eager(
        &mut self,
        peer: PeerId,
        frame: OutFrame,
        kind: EagerFrame,
    ) -> Result<(), SendError> {
        let control = kind != EagerFrame::Caller;
        let len = frame.len();
        // Pack behind the newest frame not posted yet, when it fits: the
        // slots in a backlog are posted by the next poll or flush, so
        // frames sent in one round of the caller's loop share a message.
        let shared_body = self.shares_body(&frame);
        let tail = self.peers.get(&peer).and_then(|state| {
            let tail = *state.backlog.back()?;
            let packed = self.tx_owner[tail].map_or(0, |(_, bytes)| bytes);
            let open = self.tx_body[tail].is_none()
                && self.tx_fence[tail].is_none()
                && !shared_body
                && !matches!(kind, EagerFrame::Fence(_))
                && self.tx_control[tail] == control;
            (open && packed + len <= state.pack_limit).then_some(tail)
        });
        if let Some(tail) = tail {
            // SAFETY: a slot in a backlog has not been posted, so no
            // operation reads it while it is written.
            let buf = unsafe { self.tx_pool.slot_mut(tail) };
            if let Ok(n) = self.layout.append(buf, self.tx_post_len[tail], &frame) {
                self.tx_post_len[tail] = n;
                self.tx_sealed[tail] = false;
                if let Some((_, bytes)) = self.tx_owner[tail].as_mut() {
                    *bytes += len;
                }
                if let Some(state) = self.peers.get_mut(&peer) {
                    state.queued_bytes += len;
                }
                self.stats.packed += 1;
                return Ok(());
            }
        }

        let may_take = |endpoint: &Self| {
            endpoint
                .peers
                .get(&peer)
                .is_some_and(|state| endpoint.may_take_slot(state))
        };
        if !may_take(self) || self.free_tx.is_empty() {
            if matches!(kind, EagerFrame::Done | EagerFrame::Fence(_)) {
                return Err(SendError::WouldBlock(frame));
            }
            // Completions read now may free slots of this peer's.
            self.progress().map_err(other)?;
            if !self.peers.contains_key(&peer) {
                return Err(SendError::Closed(peer));
            }
            if !may_take(self) && !self.free_tx.is_empty() {
                self.stats.peer_share_full += 1;
                return Err(self.would_block(peer, frame));
            }
        }
        let Some(slot) = self.free_tx.pop() else {
            return Err(self.would_block(peer, frame));
        };
        let link = match self.peers.get_mut(&peer) {
            Some(state) => {
                state.sent_counter += 1;
                self.tx_dest[slot] = state.fi_addr;
                (state.remote_id, state.sent_counter)
            }
            None => {
                self.free_tx.push(slot);
                return Err(SendError::Closed(peer));
            }
        };
        // SAFETY: the slot came off the free list, so no send using it is
        // in flight.
        let buf = unsafe { self.tx_pool.slot_mut(slot) };
        let encoded = if shared_body {
            let head = OutFrame::whole(frame.head.clone());
            self.layout.encode(buf, &self.header_addr, link, &head)
        } else {
            self.layout.encode(buf, &self.header_addr, link, &frame)
        };
        let n = match encoded {
            Ok(n) => n,
            Err(err) => {
                self.free_tx.push(slot);
                return Err(other(err).into());
            }
        };
        self.tx_owner[slot] = Some((peer, len));
        self.tx_control[slot] = control;
        self.tx_fence[slot] = match kind {
            EagerFrame::Fence(id) => Some(id),
            _ => None,
        };
        self.tx_post_len[slot] = n;
        self.tx_sealed[slot] = false;
        if shared_body {
            self.stats.shared_sends += 1;
            self.tx_body[slot] = Some(frame.body);
        }
        let Some(state) = self.peers.get_mut(&peer) else {
            // Progress above may have closed the peer.
            self.release_slot(slot);
            return Err(SendError::Closed(peer));
        };
        state.queued_bytes += len;
        state.slots += 1;
        if state.backlog.is_empty() {
            self.backlogged.push(peer);
        }
        state.backlog.push_back(slot);
        Ok(())
    }

    /// False, after ending the link, when `peer` is a `shm` endpoint of this
    /// process that has closed (see `local_shm_endpoints`).
    fn peer_endpoint_open(&mut self, peer: PeerId) -> bool {
        let closed = self
            .peers
            .get(&peer)
            .is_some_and(PeerState::endpoint_closed);
        if closed {
            self.drop_peer(peer, CloseReason::Error(IN_PROCESS_CLOSED.to_string()));
        }
        !closed
    }

    /// Whether `frame`'s body may be sent from where it lies (see the
    /// module docs) rather than copied into a tx slot.
    fn shares_body(&self, frame: &OutFrame) -> bool {
        frame.body.len() >= SHARE_MIN
            && self.link.tx_iov_limit >= 2
            && (!self.link.mr_local || self.rx_pool_sendable && self.rx_pool.contains(&frame.body))
    }

    /// Sends `frame` by rendezvous: registers its body (or shares the
    /// registration a transfer of the same body holds) and sends a
    /// descriptor with the frame's head in its place. Refused with
    /// `WouldBlock` while the peer's or the endpoint's registration bounds
    /// are reached; the peer is told `Writable` when transfers finish.
    fn send_rendezvous(&mut self, peer: PeerId, frame: OutFrame) -> Result<(), SendError> {
        let (Some(rma), Some(state)) = (self.rma.as_mut(), self.peers.get(&peer)) else {
            return Err(SendError::Closed(peer));
        };
        // The descriptor must fit one eager message to this peer.
        let inline_max = rendezvous::INLINE_MAX.min(
            state
                .pack_limit
                .saturating_sub(super::layout::RMA_DESCRIPTOR_FIXED),
        );
        let (inline, body) = if frame.head.len() <= inline_max && !frame.body.is_empty() {
            (frame.head.clone(), frame.body.clone())
        } else {
            (Bytes::new(), frame.to_bytes())
        };
        let new_bytes = if rma.registrations.holds(&body) {
            0
        } else {
            body.len()
        };
        if rendezvous::must_wait(
            (state.rma_sends, state.rma_bytes),
            body.len(),
            (rma.registrations.bytes(), new_bytes),
        ) {
            self.stats.rendezvous_deferred += 1;
            if !rma.waiters.contains(&peer) {
                rma.waiters.push(peer);
            }
            return Err(SendError::WouldBlock(frame));
        }
        let (key, shared) = rma
            .registrations
            .acquire(&self._domain, &body)
            .map_err(other)?;
        let region = rendezvous::region_of(&body);
        let id = rma.next_id();
        let descriptor = RmaDescriptor {
            id,
            addr: rma.remote_addr(&body),
            key,
            body_len: body.len() as u64,
        }
        .encode(&inline);
        match self.send_eager(peer, OutFrame::whole(descriptor), EagerFrame::Descriptor) {
            Ok(()) => {}
            Err(err) => {
                if let Some(rma) = self.rma.as_mut() {
                    rma.registrations.release(region);
                }
                return Err(match err {
                    SendError::WouldBlock(_) => SendError::WouldBlock(frame),
                    err => err,
                });
            }
        }
        if let Some(rma) = self.rma.as_mut() {
            rma.sends.insert(
                id,
                Outstanding {
                    peer,
                    region,
                    fenced: false,
                },
            );
        }
        if let Some(state) = self.peers.get_mut(&peer) {
            state.rma_sends += 1;
            state.rma_bytes += region.1;
        }
        self.stats.rendezvous_sent += 1;
        if shared {
            self.stats.rendezvous_shared += 1;
        } else {
            self.stats.rendezvous_registrations += 1;
        }
        Ok(())
    }

    /// One of the endpoint's own frames, from an authenticated `peer`: a
    /// descriptor to read, or the done frame of a transfer of ours. A peer
    /// that sends one it may not is a broken peer and is dropped.
    fn on_endpoint_frame(&mut self, peer: PeerId, frame: &[u8]) {
        let rendezvous = self.peers.get(&peer).map_or(0, |state| state.rendezvous);
        let refusal = match frame_kind(frame) {
            _ if rendezvous == 0 || self.rma.is_none() => {
                Some("sent a rendezvous frame on a link without rendezvous".to_string())
            }
            Some(RMA_DESCRIPTOR_KIND) => self.on_descriptor(peer, rendezvous, frame).err(),
            Some(RMA_DONE_KIND) => self.on_done(peer, frame).err(),
            // Only its completion at the sender matters.
            Some(RMA_FENCE_KIND) => rma_fence_id(frame)
                .is_none()
                .then(|| "sent a malformed rendezvous fence".to_string()),
            _ => Some("sent a control frame of an unknown kind".to_string()),
        };
        if let Some(reason) = refusal {
            self.stats.malformed += 1;
            self.stats.last_error = Some(format!("peer {peer} {reason}"));
            tracing::warn!(%peer, "{reason}; closing the link");
            self.drop_peer(peer, CloseReason::Error(reason));
        }
    }

    fn on_descriptor(&mut self, peer: PeerId, limit: usize, frame: &[u8]) -> Result<(), String> {
        let (descriptor, head) =
            RmaDescriptor::decode(frame).ok_or("sent a malformed rendezvous descriptor")?;
        if head.len() > rendezvous::INLINE_MAX {
            return Err(format!(
                "sent a rendezvous descriptor with {} inline bytes, over {}",
                head.len(),
                rendezvous::INLINE_MAX
            ));
        }
        let total = usize::try_from(descriptor.body_len)
            .ok()
            .and_then(|body| body.checked_add(head.len()))
            .filter(|&total| descriptor.body_len > 0 && total <= limit)
            .ok_or_else(|| {
                format!(
                    "offered a rendezvous frame of {} + {} bytes, over the link's {limit}",
                    head.len(),
                    descriptor.body_len
                )
            })?;
        if let Some(declared) = frame_declared_len(head) {
            if declared + efabus_core::codec::PREFIX_LEN != total {
                return Err(format!(
                    "offered a rendezvous frame declaring {declared} bytes in {total}"
                ));
            }
        }
        let state = self.peers.get_mut(&peer).ok_or("closed")?;
        if state.rma_reads >= rendezvous::PEER_TRANSFERS_MAX {
            return Err(format!(
                "offered more than {} rendezvous reads at once",
                rendezvous::PEER_TRANSFERS_MAX
            ));
        }
        state.rma_reads += 1;
        if let Some(rma) = self.rma.as_mut() {
            rma.queue.push_back(QueuedRead {
                peer,
                descriptor,
                head: head.to_vec(),
            });
            if rma.held.contains(&peer) {
                self.pending.push_back(Event::ReadHeld { peer });
            }
            if let Some(hog) = rma.queue.over_bound() {
                let reason = format!(
                    "held the most of the {} bytes of rendezvous descriptors waiting to be read",
                    rma.queue.max()
                );
                tracing::warn!(peer = %hog, "{reason}; closing the link");
                self.stats.last_error = Some(format!("peer {hog} {reason}"));
                self.drop_peer(hog, CloseReason::Error(reason));
            }
        }
        Ok(())
    }

    fn on_done(&mut self, peer: PeerId, frame: &[u8]) -> Result<(), String> {
        let id = rma_done_id(frame).ok_or("sent a malformed rendezvous done")?;
        let fenced_release = self.link.fenced_release;
        let rma = self.rma.as_mut().ok_or("closed")?;
        let sent = match rma.sends.get_mut(&id) {
            Some(sent) if sent.peer == peer => sent,
            _ => return Err(format!("finished rendezvous {id}, which it was not sent")),
        };
        if !fenced_release {
            self.end_transfer(id);
            return Ok(());
        }
        // A second done changes nothing.
        if !std::mem::replace(&mut sent.fenced, true) {
            rma.owed.push_back((peer, Owed::Fence(id)));
            self.flush_dones();
        }
        Ok(())
    }

    /// Transfer `id` is over: its registration released, its peer's share
    /// given back.
    fn end_transfer(&mut self, id: u64) {
        let Some(rma) = self.rma.as_mut() else {
            return;
        };
        let Some(sent) = rma.sends.remove(&id) else {
            return;
        };
        rma.registrations.release(sent.region);
        if let Some(state) = self.peers.get_mut(&sent.peer) {
            state.rma_sends -= 1;
            state.rma_bytes -= sent.region.1;
        }
        self.wake_rendezvous_waiters();
    }

    /// Peers refused by the registration bounds may try again.
    fn wake_rendezvous_waiters(&mut self) {
        let Some(rma) = self.rma.as_mut() else {
            return;
        };
        for peer in rma.waiters.drain(..) {
            if self.peers.contains_key(&peer) {
                self.pending.push_back(Event::Writable { peer });
            }
        }
    }

    /// Starts queued reads while read slots and the bytes bound allow,
    /// until one takes [`SLOW_READ_POST`] to post.
    fn start_reads(&mut self) {
        let mut failed = Vec::new();
        let Some(rma) = self.rma.as_mut() else {
            return;
        };
        let mut copied = false;
        while let Some(at) = rma.startable_read() {
            if copied {
                break;
            }
            let (Some(&slot), Some(queued)) = (rma.free_slots.last(), rma.queue.get(at)) else {
                break;
            };
            let body_len = queued.descriptor.body_len as usize;
            let Some(state) = self.peers.get(&queued.peer) else {
                rma.queue.remove(at);
                continue;
            };
            if state.endpoint_closed() {
                let queued = rma.queue.remove(at);
                failed.extend(queued.map(|q| (q.peer, IN_PROCESS_CLOSED.to_string())));
                continue;
            }
            let fi_addr = state.fi_addr;
            let (peer, id) = (queued.peer, queued.descriptor.id);
            let body_at = rma.virt_addr.then_some(queued.descriptor.addr);
            let (mut buf, start) = rma.landing.take_for(queued.head.len(), body_len, body_at);
            buf[start..start + queued.head.len()].copy_from_slice(&queued.head);
            let body = buf[start + queued.head.len()..].as_mut_ptr();
            let mr = if self.link.mr_local {
                // Registered memory must be backed (FI_MR_ALLOCATED, which
                // EFA asks beside FI_MR_LOCAL): a fresh zeroed buffer's
                // pages may all be the shared zero page until written.
                touch_pages(&mut buf[start + queued.head.len()..]);
                // SAFETY: the region is dropped with the job, which owns
                // `buf` (not moved or resized before then).
                match unsafe {
                    rma.registrations
                        .register_fresh(&self._domain, body, body_len, FI_READ)
                } {
                    Ok(mr) => Some(mr),
                    Err(err) => {
                        let queued = rma.queue.remove(at);
                        failed.extend(queued.map(|q| (q.peer, err.to_string())));
                        continue;
                    }
                }
            } else {
                None
            };
            let desc = mr.as_ref().map_or(std::ptr::null_mut(), MemoryRegion::desc);
            let context = rma.slots[slot].context.as_mut_ptr().cast();
            let remote = (queued.descriptor.addr, queued.descriptor.key);
            let posting = Instant::now();
            // SAFETY: `buf` and `mr` move into the slot's job below and stay
            // there, untouched, until this read's completion is read; the
            // context is the slot's own boxed storage.
            match unsafe { self.ep.read(body, body_len, desc, fi_addr, remote, context) } {
                Ok(()) => {
                    rma.queue.remove(at);
                    rma.free_slots.pop();
                    self.stats.rendezvous_reads_started += 1;
                    copied = posting.elapsed() >= self.slow_read_post;
                    if buf.is_huge() {
                        self.stats.rendezvous_huge_landed += 1;
                    }
                    let job = ReadJob {
                        peer,
                        fi_addr,
                        id,
                        mr,
                        buf,
                        start,
                        orphaned: false,
                    };
                    rma.count_read(peer, job.footprint(), true);
                    rma.slots[slot].job = Some(job);
                }
                Err(code) if code.is_again() => {
                    drop(mr);
                    rma.landing.keep(buf);
                    break;
                }
                Err(code) => {
                    let queued = rma.queue.remove(at);
                    let error = FabricError::Read { code };
                    failed.extend(queued.map(|q| (q.peer, error.to_string())));
                }
            }
        }
        for (peer, error) in failed {
            // Out of the queue already, so the drop below does not count it.
            self.stats.rendezvous_reads_given_up += 1;
            self.stats.tx_errors += 1;
            tracing::warn!(%peer, "{error}");
            self.drop_peer(peer, CloseReason::Error(error));
        }
    }

    /// The read in `slot` completed (`error` when it failed): deliver the
    /// frame and tell the sender, or end the link.
    fn finish_read(&mut self, slot: usize, error: Option<String>) {
        let Some(rma) = self.rma.as_mut() else {
            return;
        };
        let Some(job) = rma.slots[slot].job.take() else {
            return;
        };
        rma.read_ended(slot, &job);
        drop(job.mr);
        let Some(state) = self.peers.get_mut(&job.peer) else {
            // Closed meanwhile: nothing to deliver.
            self.stats.rendezvous_reads_given_up += 1;
            return;
        };
        state.rma_reads -= 1;
        if let Some(error) = error {
            self.stats.rendezvous_reads_given_up += 1;
            tracing::warn!(peer = %job.peer, "{error}");
            self.stats.last_error = Some(error.clone());
            self.drop_peer(job.peer, CloseReason::Error(error));
            return;
        }
        let frame = rma.landing.frame(job.buf, job.start);
        if frame_declared_len(&frame).map(|n| n + efabus_core::codec::PREFIX_LEN)
            != Some(frame.len())
        {
            let reason = "sent a rendezvous frame whose length prefix is wrong".to_string();
            self.stats.malformed += 1;
            self.drop_peer(job.peer, CloseReason::Error(reason));
            return;
        }
        self.stats.received += 1;
        self.stats.rendezvous_read += 1;
        self.stats.rendezvous_read_bytes += frame.len() as u64;
        self.pending.push_back(Event::Frame {
            peer: job.peer,
            frame,
        });
        if let Some(rma) = self.rma.as_mut() {
            rma.owed.push_back((job.peer, Owed::Done(job.id)));
        }
    }

    /// Sends the done frames waiting, oldest first; those to a peer whose
    /// send slots are full wait for the next round (a tx completion), the
    /// others go on.
    fn flush_dones(&mut self) {
        let Some(waiting) = self.rma.as_mut().map(|rma| std::mem::take(&mut rma.owed)) else {
            return;
        };
        let mut kept = VecDeque::new();
        let mut blocked = Vec::new();
        for (peer, owed) in waiting {
            if !self.peers.contains_key(&peer) {
                continue;
            }
            if blocked.contains(&peer) {
                kept.push_back((peer, owed));
                continue;
            }
            let (frame, kind) = match owed {
                Owed::Done(id) => (rma_done(id), EagerFrame::Done),
                Owed::Fence(id) => (rma_fence(id), EagerFrame::Fence(id)),
            };
            if let Err(SendError::WouldBlock(_)) =
                self.send_eager(peer, OutFrame::whole(frame), kind)
            {
                blocked.push(peer);
                kept.push_back((peer, owed));
            }
        }
        if let Some(rma) = self.rma.as_mut() {
            // Reads finished meanwhile queued theirs behind these.
            kept.append(&mut rma.owed);
            rma.owed = kept;
        }
    }

    /// Releases what rendezvous holds for `peer`, which is closing: its
    /// transfers (counted as abandoned; their bodies kept a while, see
    /// [`rendezvous::ABANDONED_KEPT_FOR`]) and its queued reads. Its reads in
    /// flight finish into nothing, outside the reading bounds (see
    /// [`rendezvous::ORPHANS_MAX`]).
    fn drop_rendezvous(&mut self, peer: PeerId) -> Option<u64> {
        let fenced_release = self.link.fenced_release;
        let rma = self.rma.as_mut()?;
        // Over a provider that serves reads in order with later sends, the
        // bodies wait for a fence sent behind their reads (the provider
        // keeps its connection, and may send them long after the link is
        // gone).
        let fence = fenced_release.then(|| rma.next_id());
        let evicted_before = rma.abandoned.fenced_evicted;
        let mut abandoned = 0;
        let Rendezvous {
            sends,
            registrations,
            queue,
            owed,
            waiters,
            held,
            abandoned: kept,
            ..
        } = rma;
        let now = Instant::now();
        sends.retain(|_, sent| {
            if sent.peer != peer {
                return true;
            }
            // The peer may still be reading it: kept a while, registered
            // or not.
            if let Some(body) = registrations.body(sent.region) {
                kept.keep(body, now, fence);
            }
            registrations.release(sent.region);
            abandoned += 1;
            false
        });
        self.stats.rendezvous_reads_given_up += queue.remove_peer(peer) as u64;
        held.remove(&peer);
        owed.retain(|&(to, _)| to != peer);
        waiters.retain(|&waiter| waiter != peer);
        rma.orphan_reads(peer);
        let evicted = rma.abandoned.fenced_evicted - evicted_before;
        if evicted > 0 {
            tracing::warn!(
                evicted,
                "abandoned rendezvous bodies over their bound let go of before their fence"
            );
        }
        self.stats.rendezvous_abandoned += abandoned;
        if abandoned > 0 {
            self.wake_rendezvous_waiters();
        }
        fence.filter(|_| abandoned > 0)
    }

    /// Posts `fence` to `peer`, whose link is closing, behind what the
    /// provider still sends it (see `drop_rendezvous`). Not posted (no
    /// slot of the peer's share, the provider refusing), the bodies
    /// waiting for it wait for their time instead, with a warning.
    fn post_closing_fence(&mut self, peer: PeerId, fence: u64) {
        let frame = OutFrame::whole(rma_fence(fence));
        let posted = self
            .send_eager(peer, frame, EagerFrame::Fence(fence))
            .is_ok()
            && match self.peers.get_mut(&peer) {
                Some(state) => match (state.backlog.pop_front(), state.fi_addr) {
                    (Some(slot), dest) => {
                        let posted = self.post_slot(slot, dest).is_ok();
                        if !posted {
                            self.release_slot(slot);
                        }
                        posted
                    }
                    (None, _) => false,
                },
                None => false,
            };
        if !posted {
            tracing::warn!(%peer, "no fence could follow a closed link's reads; its bodies are kept for a time instead");
            if let Some(rma) = self.rma.as_mut() {
                rma.abandoned.fence_lost(fence, Instant::now());
            }
        }
    }

    fn would_block(&mut self, peer: PeerId, frame: OutFrame) -> SendError {
        self.stats.would_block += 1;
        if let Some(state) = self.peers.get_mut(&peer) {
            if !std::mem::replace(&mut state.wants_writable, true) {
                self.writable_waiters.push(peer);
            }
        }
        SendError::WouldBlock(frame)
    }
}

/// Whose frame an eager send carries.
#[derive(Clone, Copy, PartialEq, Eq)]
enum EagerFrame {
    /// A caller's.
    Caller,
    /// The endpoint's own, sent for a caller's send (a rendezvous
    /// descriptor): a refusal is the caller's, counted, and `Writable`
    /// follows.
    Descriptor,
    /// The endpoint's own, sent by itself (a done frame): refused, it waits
    /// in the endpoint and is tried again at every poll, so a refusal is
    /// not counted as a send handed back.
    Done,
    /// A fence frame, as `Done`, but sent alone and never injected: its
    /// completion lets transfer `id`'s body go.
    Fence(u64),
}

/// The endpoint's parts a received message is checked against, borrowed
/// apart from the receive buffer the message lies in.
struct Checks<'a> {
    links: &'a FxHashMap<u64, PeerId>,
    peers: &'a mut FxHashMap<PeerId, PeerState>,
    stats: &'a mut FabricStats,
    log: &'a mut BadInputLog,
}

impl Checks<'_> {
    /// The live peer whose link `message` names, if it really comes from
    /// that peer: the sender address is the peer's, the tag checks under
    /// the peer's receive key and the counter was not taken before. Each
    /// refusal is counted and logged at a bounded rate.
    fn authenticate(
        self,
        message: &super::layout::Message<'_>,
        source: Option<u64>,
    ) -> Option<PeerId> {
        let Some(&peer) = self.links.get(&message.link_id) else {
            self.stats.unknown_links += 1;
            if let Some(held_back) = self.log.unknown_link.allow(Instant::now()) {
                tracing::debug!(
                    held_back,
                    link = message.link_id,
                    sender = %addr_to_hex(message.sender),
                    "dropped a message for no live link"
                );
            }
            return None;
        };
        let state = self.peers.get_mut(&peer)?;
        // Where the provider names the sender, it must be the peer's own
        // entry (a sender not in the address vector has none).
        let from_peer = source.is_none_or(|source| source == state.fi_addr);
        let authentic =
            from_peer && state.addr == message.sender && message.is_authentic(&state.receive_tag);
        if !authentic {
            self.stats.forged += 1;
            if let Some(held_back) = self.log.forged.allow(Instant::now()) {
                tracing::warn!(
                    held_back,
                    %peer,
                    sender = %addr_to_hex(message.sender),
                    "dropped a message that failed authentication"
                );
            }
            self.stats.last_error = Some("a message failed authentication".to_string());
            return None;
        }
        if !state.replay.take(message.counter) {
            self.stats.replayed += 1;
            if let Some(held_back) = self.log.forged.allow(Instant::now()) {
                tracing::warn!(held_back, %peer, "dropped a replayed message");
            }
            return None;
        }
        Some(peer)
    }
}

fn other(err: impl std::fmt::Display) -> TransportError {
    TransportError::Other(err.to_string())
}

/// Hints for `kind` from `options`; asks for FI_SOURCE (so a receive
/// reports its sender's address, checked against the peer's) where the
/// provider grants it and [`honours_source`], and for SAS on RDM as
/// configured, falling back to no ordering when `prefer`red and nothing
/// grants it. Returns the list and whether SAS was asked for.
pub(crate) fn get_info(
    kind: EpKind,
    options: &FabricOptions,
) -> Result<(InfoList, bool), FabricError> {
    let source = if honours_source(&options.provider) {
        FI_SOURCE
    } else {
        0
    };
    let rma = if super::config::asks_rendezvous(kind, &options.provider, options) {
        RMA_READ_CAPS
    } else {
        0
    };
    let multi_recv = if super::config::wants_multi_recv(kind, options) {
        FI_MULTI_RECV
    } else {
        0
    };
    // Most wanted first; a provider without one of them gets the rest
    // (multi-receive buffers matter least).
    let mut wanted: Vec<u64> = Vec::new();
    for caps in [FI_MSG | source | rma, FI_MSG | source, FI_MSG | rma, FI_MSG] {
        for caps in [caps | multi_recv, caps] {
            if !wanted.contains(&caps) {
                wanted.push(caps);
            }
        }
    }
    let mut result = get_info_with(kind, options, wanted[0]);
    for &caps in &wanted[1..] {
        match &result {
            Err(FabricError::GetInfo { code, .. }) if code.code == FI_ENODATA => {
                result = get_info_with(kind, options, caps);
            }
            _ => break,
        }
    }
    result
}

/// Whether `addr` has the form of the names the shm provider gives its
/// endpoints: `fi_shm://`, then digits and colons (process, user and
/// endpoint numbers), then a NUL.
fn is_shm_name(addr: &[u8]) -> bool {
    let Some(rest) = addr.strip_prefix(b"fi_shm://") else {
        return false;
    };
    let Some(end) = rest.iter().position(|&b| b == 0) else {
        return false;
    };
    end > 0 && rest[..end].iter().all(|&b| b.is_ascii_digit() || b == b':')
}

/// Whether the shared-memory region a shm name (already checked by
/// [`is_shm_name`], so digits and colons before its NUL) points at exists
/// on this host.
/// How many of the least recently used unused `shm` addresses an
/// eviction looks at for one whose process has gone: each look is a
/// `stat` on the event loop's thread.
const DEPARTED_LOOKS: usize = 32;

fn shm_region_exists(name: &[u8]) -> bool {
    let region = name
        .strip_prefix(b"fi_shm://")
        .and_then(|rest| rest.split(|&b| b == 0).next())
        .and_then(|region| std::str::from_utf8(region).ok());
    region.is_some_and(|region| std::path::Path::new("/dev/shm").join(region).exists())
}

/// Whether FI_SOURCE is asked of `provider`. The network providers report
/// a receive's source faithfully (efa, sockets, udp); the others do not
/// serve it as efabus uses them: with libfabric 1.17, `ofi_rxm` with
/// FI_SOURCE stalls large messages it has not copied, `ofi_rxd` drops
/// senders missing from the address vector itself (so they go uncounted)
/// and loses peers whose entry was removed and inserted again, and `shm`
/// reported a second endpoint of a peer's process as that peer. There the
/// tag alone authenticates, which the link reports
/// ([`LinkInfo::source_checked`]).
fn honours_source(provider: &str) -> bool {
    provider != super::config::SHM_PROVIDER
        && !provider.split(';').any(|layer| layer.starts_with("ofi_"))
}

fn get_info_with(
    kind: EpKind,
    options: &FabricOptions,
    caps: u64,
) -> Result<(InfoList, bool), FabricError> {
    let mut hints = Hints {
        caps,
        mode: SUPPORTED_MODES,
        mr_mode: SUPPORTED_MR_MODES,
        ep_type: kind.fi_value(),
        threading: FI_THREAD_DOMAIN,
        provider: Some(options.provider.clone()),
        domain: options.domain.clone(),
        fabric: options.fabric.clone(),
        node: options.node.clone(),
        service: options.service.clone(),
        source: options.node.is_some() || options.service.is_some(),
        ..Hints::default()
    };
    let want_sas = kind == EpKind::Rdm && options.order != OrderWanted::None;
    if want_sas {
        hints.tx_msg_order = FI_ORDER_SAS;
        hints.rx_msg_order = FI_ORDER_SAS;
    }
    match InfoList::get(&hints) {
        Ok(list) => Ok((list, want_sas)),
        Err(FabricError::GetInfo { code, .. })
            if want_sas && options.order == OrderWanted::Prefer && code.code == FI_ENODATA =>
        {
            hints.tx_msg_order = 0;
            hints.rx_msg_order = 0;
            Ok((InfoList::get(&hints)?, false))
        }
        Err(err) => Err(err),
    }
}

/// The tx and rx CQs, on a wait set when `want_wait` and the provider
/// offers one (and accepts CQs on it), polled without one otherwise.
type Cqs = (
    Option<Rc<WaitSet>>,
    Rc<CompletionQueue>,
    Rc<CompletionQueue>,
);

fn open_cqs(
    fabric: &Rc<Fabric>,
    domain: &Rc<Domain>,
    want_wait: bool,
    tx_depth: usize,
    rx_depth: usize,
) -> Result<Cqs, FabricError> {
    if want_wait {
        let on_wait_set = WaitSet::open(fabric).and_then(|wait| {
            let open = |depth| {
                CompletionQueue::open(domain, depth + 1, Some(&wait)).map_err(|err| {
                    err.code()
                        .cloned()
                        .unwrap_or_else(|| FiCode::from_ret(FI_EINVAL.into()))
                })
            };
            let tx = open(tx_depth)?;
            let rx = open(rx_depth)?;
            Ok((Some(wait), tx, rx))
        });
        match on_wait_set {
            Ok(cqs) => return Ok(cqs),
            Err(code) => tracing::debug!(%code, "no wait set; the endpoint is polled"),
        }
    }
    let tx = CompletionQueue::open(domain, tx_depth + 1, None)?;
    let rx = CompletionQueue::open(domain, rx_depth + 1, None)?;
    Ok((None, tx, rx))
}

impl Endpoint for FabricEndpoint {
    fn scheme(&self) -> &str {
        self.scheme
    }

    fn local_addr(&self) -> Vec<u8> {
        self.local_addr.clone()
    }

    fn max_frame(&self) -> usize {
        self.link.max_frame
    }

    /// Fabric peers come with the keys of their link: see `insert_peer`.
    fn connect(&mut self, addr: &str) -> Result<PeerId, TransportError> {
        let _ = addr;
        Err(TransportError::Unsupported {
            scheme: self.scheme().to_string(),
            operation: "connect (a fabric peer needs link keys: insert_peer)",
        })
    }

    fn insert_peer(&mut self, addr: &[u8], keys: &LinkKeys) -> Result<PeerId, TransportError> {
        self.add_peer(addr, keys)
            .map_err(|err| TransportError::InvalidAddress {
                addr: addr_to_hex(addr),
                reason: err.to_string(),
            })
    }

    fn buffers(&self) -> BufferMemory {
        self.buffers
    }

    fn refused(&self) -> Refused {
        Refused {
            unknown_link: self.stats.unknown_links,
            forged: self.stats.forged,
            replayed: self.stats.replayed,
            malformed: self.stats.malformed,
        }
    }

    fn receiving_from(&self, peer: PeerId) -> bool {
        self.rma
            .as_ref()
            .is_some_and(|rma| rma.receiving_from(peer))
    }

    fn rendezvous_counts(&self) -> efabus_core::transport::RendezvousCounts {
        // Bodies registered for the peers' reads, and, where the provider
        // needs local registrations, the buffers this endpoint's reads
        // land in (the slots are looked at only while reads are out).
        let (registered, registered_bytes) = self.rma.as_ref().map_or((0, 0), |rma| {
            let offered = (rma.registrations.len(), rma.registrations.bytes());
            if !(self.link.mr_local && rma.reads_in_flight()) {
                return offered;
            }
            rma.slots
                .iter()
                .filter_map(|slot| slot.job.as_ref()?.mr.as_ref())
                .fold(offered, |(count, bytes), mr| (count + 1, bytes + mr.len()))
        });
        efabus_core::transport::RendezvousCounts {
            sent: self.stats.rendezvous_sent,
            registrations: self.stats.rendezvous_registrations,
            read: self.stats.rendezvous_read,
            read_bytes: self.stats.rendezvous_read_bytes,
            huge_landed: self.stats.rendezvous_huge_landed,
            abandoned: self.stats.rendezvous_abandoned,
            reads_given_up: self.stats.rendezvous_reads_given_up,
            cache_hits: self.stats.rendezvous_shared,
            registered: registered as u64,
            registered_bytes: registered_bytes as u64,
        }
    }

    fn fabric_counts(&self) -> efabus_core::transport::FabricCounts {
        let stats = &self.stats;
        efabus_core::transport::FabricCounts {
            messages_sent: stats.sent + stats.injected,
            messages_received: stats.received_messages,
            completion_reads: stats.tx_cq_reads + stats.rx_cq_reads,
            completion_errors: stats.tx_errors + stats.rx_errors,
            lent: stats.lent,
            shared_sends: stats.shared_sends,
            av_evictions: stats.av_evictions,
            addresses: self.av_cache.len() as u64,
            address_capacity: self.max_addresses as u64,
            rnr_failures: stats.rnr_failures,
            queue_full: stats.would_block,
        }
    }

    fn send(&mut self, peer: PeerId, frame: OutFrame) -> Result<(), SendError> {
        let Some(state) = self.peers.get(&peer) else {
            return Err(SendError::Closed(peer));
        };
        let len = frame.len();
        let rendezvous = state.rendezvous > 0 && len > state.pack_limit;
        let max = if rendezvous {
            state.rendezvous
        } else {
            self.link.max_frame
        };
        if len > max {
            return Err(SendError::TooLarge { len, max });
        }
        check_frame(&frame).map_err(|e| other(format!("malformed frame: {e}")))?;
        if rendezvous {
            self.send_rendezvous(peer, frame)
        } else {
            self.send_eager(peer, frame, EagerFrame::Caller)
        }
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), TransportError> {
        let result = self.progress().map_err(other);
        events.extend(self.pending.drain(..));
        result
    }

    /// Posts the backlogs: frames sent since the last poll, packed per
    /// peer.
    fn flush(&mut self) {
        self.flush_backlogs();
    }

    fn close(&mut self, peer: PeerId) {
        // Posted sends complete on their own; the backlog gets one more try
        // (after progress), and what the provider still refuses is dropped.
        if let Err(err) = self.progress() {
            tracing::warn!("{err}");
        }
        self.drop_peer(peer, CloseReason::Local);
    }

    fn readiness(&self) -> Readiness {
        match &self.wait {
            Some(wait) => Readiness::PollOrWait(wait.fd()),
            None => Readiness::MustPoll,
        }
    }

    fn set_peer_frame_limit(&mut self, peer: PeerId, limit: usize) {
        if let Some(state) = self.peers.get_mut(&peer) {
            state.pack_limit = limit.min(self.link.max_frame);
        }
    }

    fn rendezvous_max(&self) -> usize {
        self.link.rendezvous_max
    }

    fn set_peer_rendezvous(&mut self, peer: PeerId, limit: usize) {
        if let Some(state) = self.peers.get_mut(&peer) {
            state.rendezvous = limit.min(self.link.rendezvous_max);
        }
    }

    fn hold_reads(&mut self, peer: PeerId, held: bool) {
        if !self.peers.contains_key(&peer) {
            return;
        }
        if let Some(rma) = self.rma.as_mut() {
            if held {
                rma.held.insert(peer);
            } else {
                rma.held.remove(&peer);
            }
        }
    }

    fn prepare_wait(&mut self) -> bool {
        // Frames sent since the last poll wait in the backlogs: post them
        // and have the caller poll again, unless the provider takes none.
        let unposted = |endpoint: &Self| -> usize {
            let backlog = |peer| endpoint.peers.get(peer).map_or(0, |s| s.backlog.len());
            endpoint.backlogged.iter().map(backlog).sum()
        };
        let before = unposted(self);
        if before > 0 {
            if let Err(err) = self.progress() {
                tracing::warn!("{err}");
            }
            let left = unposted(self);
            if left < before {
                return false;
            }
            // The provider took none (e.g. `tcp;ofi_rxm` still connecting).
            // A completion would wake the descriptor only if a send or read
            // of ours is in flight; with none, sleeping could outlast the
            // refusal.
            if self.wait.is_some() && !self.tx_due() {
                return false;
            }
        }
        // Reads left for the next poll (after a slow post, or refused by
        // the provider for now) start by polling only (done frames wait
        // for tx completions, which wake the descriptor).
        let rendezvous_waiting = self
            .rma
            .as_ref()
            .is_some_and(|rma| rma.startable_read().is_some());
        // Events queued by a `send` are not in the CQs any more, so the
        // descriptor would not announce them.
        !rendezvous_waiting
            && self.pending.is_empty()
            && self.wait.as_ref().is_none_or(|wait| wait.try_wait())
    }

    fn wait_cap(&self) -> Option<Duration> {
        // A provider with manual progress that keeps a send until the peer
        // acknowledges it (ofi_rxd) retransmits a lost packet only when
        // called: sleeping on the descriptor, which only incoming packets
        // wake, would leave the loss unrepaired until the link times out.
        if !self.link.manual_progress {
            return None;
        }
        let sends_in_flight = self.free_tx.len() < self.tx_owner.len();
        // Transfers of ours the peer reads, and reads of ours.
        let reads_in_flight = self
            .rma
            .as_ref()
            .is_some_and(|rma| !rma.sends.is_empty() || rma.reads_in_flight());
        let recently_posted = self
            .last_post
            .is_some_and(|at| at.elapsed() < MANUAL_PROGRESS_LINGER);
        (sends_in_flight || reads_in_flight || recently_posted).then_some(MANUAL_PROGRESS_TICK)
    }

    /// The provider's attributes, with the queue sizes this endpoint really
    /// uses (receives kept posted, sends in flight): the peer's credit
    /// window is derived from them.
    fn info(&self) -> Option<efabus_core::caps::FabricInfo> {
        let mut info = super::convert::to_fabric_info(&self.info_attrs());
        info.rx_attr.size = info.rx_attr.size.min(self.link.rx_depth as u64);
        info.tx_attr.size = info.tx_attr.size.min(self.link.tx_depth as u64);
        Some(info)
    }

    /// Bytes in tx slots for `peer` and bytes of its transfers waiting for
    /// the peer to read them.
    fn queued_bytes(&self, peer: PeerId) -> usize {
        self.peers
            .get(&peer)
            .map_or(0, |s| s.queued_bytes + s.rma_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_of_the_shm_form_are_shm_names() {
        assert!(is_shm_name(b"fi_shm://15727:0:0\0"));
        assert!(is_shm_name(b"fi_shm://1:2:3\0\0"));
        assert!(!is_shm_name(b"fi_shm://15727:0:0"), "no NUL");
        assert!(!is_shm_name(b"fi_shm://\0"), "no number");
        assert!(!is_shm_name(b"fi_shm://some-file\0"), "a chosen name");
        assert!(!is_shm_name(b"fi_shm://../x\0"));
        assert!(!is_shm_name(b"fi_sockaddr_in://127.0.0.1:1\0"));
    }

    /// A peer's binary address is read only as far as it goes, whatever
    /// its family field says: over the providers whose addresses are
    /// 16-byte `sockaddr_in`s, one naming AF_INET6 (whose `sockaddr_in6`
    /// is 28 bytes) ends where a page that cannot be read begins. (The
    /// `sockets` provider read past it.)
    #[test]
    fn an_address_naming_a_longer_family_is_not_read_past_its_end() {
        use super::super::FabricTransport;
        use efabus_core::transport::{Endpoint, EndpointConfig};
        for (provider, transport) in [
            ("sockets", FabricTransport::rdm()),
            ("tcp;ofi_rxm", FabricTransport::rdm()),
            ("udp;ofi_rxd", FabricTransport::rdm()),
            ("udp", FabricTransport::dgram()),
        ] {
            let options = [
                ("provider", provider),
                ("rx_depth", "16"),
                ("tx_depth", "16"),
            ];
            let config = EndpointConfig {
                bind: Some("127.0.0.1".to_string()),
                fabric: Some(FabricOptions::parse(options, None).expect("valid options")),
                ..EndpointConfig::default()
            };
            let Ok(mut endpoint) = transport.open_fabric(&config) else {
                eprintln!("skipping: {provider} unavailable");
                continue;
            };
            let own = endpoint.local_addr();
            assert_eq!(own.len(), 16, "{provider}: a sockaddr_in");
            let page = 4096;
            // SAFETY: a fresh private anonymous mapping; no memory is named.
            let map = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    2 * page,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(map, libc::MAP_FAILED);
            let start = map.cast::<u8>();
            // SAFETY: the second page lies within the mapping made above.
            let guarded = unsafe { libc::mprotect(start.add(page).cast(), page, libc::PROT_NONE) };
            assert_eq!(guarded, 0);
            // SAFETY: the last 16 bytes of the mapping's first page,
            // readable and writable, referred to by nothing else until the
            // unmap below.
            let addr =
                unsafe { std::slice::from_raw_parts_mut(start.add(page - own.len()), own.len()) };
            addr.copy_from_slice(&own);
            addr[..2].copy_from_slice(&(libc::AF_INET6 as u16).to_ne_bytes());
            let (keys, _) = crate::conformance::link_keys();
            // Inserted or refused: either way nothing past it was read.
            let _ = endpoint.insert_peer(addr, &keys);
            // SAFETY: `addr` is not used again; the mapping is ours.
            assert_eq!(unsafe { libc::munmap(map, 2 * page) }, 0);
        }
    }
}
