//! Rendezvous state of one RDM endpoint: frames above the eager size move
//! by one-sided reads instead of through the posted buffers.
//!
//! The sender registers the frame's body for remote reads and sends, in its
//! place, a descriptor (see [`super::layout::RmaDescriptor`]) carrying the
//! frame's head; the receiver reads the body into a buffer of its own with
//! `fi_read`, delivers the rebuilt frame and answers with a done frame, on
//! which the sender releases the body (over `ofi_rxm` on `tcp`, once a
//! fence frame it sends behind the read's bytes is out: see
//! `LinkInfo::fenced_release`). Reads, chosen over writes into a
//! buffer the receiver grants, cost one control message each way as writes
//! would, but let the receiver pace them: it reads only as much as it has
//! room for, and a receiver that stops reading stops costing the sender
//! anything but the registration, which is bounded.
//!
//! This module owns the bookkeeping: the registration cache (one
//! registration per distinct body, shared by every descriptor in flight for
//! it, so a frame fanned out to N peers is registered once), the
//! transfers waiting for their done frame, and the receiver's reads (queued
//! and in flight). The endpoint drives it and issues the reads.

use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::transport::PeerId;

use super::consts::FI_ENOKEY;
use super::error::FabricError;
use super::handle::{Domain, MemoryRegion};
use super::huge::HugePages;
use super::layout::RmaDescriptor;

/// Distinct body bytes registered at once (a single frame may exceed it
/// when nothing else is registered, so any frame the link allows moves):
/// room for 32 receivers that stopped reading at their share each.
pub const REGISTERED_MAX: usize = 512 << 20;
/// Body bytes one peer may have waiting for its done frames (a single
/// frame may exceed it when the peer has none), so a receiver that stops
/// reading holds at most this much of the sender's registrations.
pub const PEER_BYTES_MAX: usize = 16 << 20;
/// Transfers one peer may have outstanding, both ways: a receiver refuses
/// a peer that offers more reads than this.
pub const PEER_TRANSFERS_MAX: usize = 256;
/// Reads in flight at once.
pub const READ_SLOTS: usize = 64;
/// Bytes being read at once (a single read may exceed it).
pub const READING_MAX: usize = 128 << 20;
/// Reads of one peer's transfers in flight at once, and their bytes (a
/// single read may exceed it): a peer that stops serving its reads holds
/// no more than this of the receiver's read slots and memory, and the
/// others' reads go on.
pub const PEER_READS_MAX: usize = 8;
pub const PEER_READING_MAX: usize = 16 << 20;
/// Reads of links that closed while they were in flight ("orphans"),
/// and their bytes, held outside the bounds above: the provider may still
/// land them, so each keeps its buffer until it completes, but a spare
/// slot takes its place, so that peers that stop serving their reads and
/// go (a suspended process, say) do not use up everyone else's. Past
/// these, a closed link's reads count as before.
pub const ORPHANS_MAX: usize = READ_SLOTS;
pub const ORPHANED_MAX: usize = READING_MAX;
/// How long the body of a transfer whose link closed before the peer's
/// done is kept, and how much of such bodies: the peer may still be
/// reading it (over `shm` it reads this process's memory itself; over
/// `tcp;ofi_rxm` the provider goes on serving a read already asked for
/// from that memory), and until it learns that the link has gone (at the
/// latest by its heartbeat timeout, 10 s by default) what it reads must
/// not be memory put to another use. Past the bound the oldest go first.
pub const ABANDONED_KEPT_FOR: Duration = Duration::from_secs(15);
pub const ABANDONED_KEPT_MAX: usize = 128 << 20;
/// Largest frame head sent inline in a descriptor; a frame with a larger
/// head is registered whole (copied into one buffer first).
pub const INLINE_MAX: usize = 4 << 10;
/// Memory the descriptors waiting for their reads may hold, all peers
/// together (each peer holds at most [`PEER_TRANSFERS_MAX`] of them, but
/// peers are many): past it, the peer holding the most is cut off.
pub const QUEUED_MAX: usize = 64 << 20;

/// Whether a transfer of `body_len` bytes must wait for others to finish:
/// its peer has `(transfers, bytes)` out, at [`PEER_TRANSFERS_MAX`] or
/// with no room under [`PEER_BYTES_MAX`], or the endpoint has
/// `registered` bytes and `new` more (0 for a body registered already)
/// would pass [`REGISTERED_MAX`]. A peer with nothing out, and an
/// endpoint with nothing registered, never wait: any frame the link
/// allows moves.
pub fn must_wait(peer: (usize, usize), body_len: usize, (registered, new): (usize, usize)) -> bool {
    let (transfers, bytes) = peer;
    let peer_full =
        transfers > 0 && (transfers >= PEER_TRANSFERS_MAX || bytes + body_len > PEER_BYTES_MAX);
    let endpoint_full = registered > 0 && registered + new > REGISTERED_MAX;
    peer_full || endpoint_full
}

/// Bytes of landing buffers kept for reuse once their frames are dropped.
pub const LANDING_KEPT_MAX: usize = 64 << 20;

/// How much larger than the `len` bytes it is taken for a kept heap
/// landing buffer may be: the frame holds the whole buffer while it lives
/// (in a subscriber's queue, say) but the bounds count its own bytes, so a
/// small frame must not take a much larger buffer. An eighth, or a page:
/// frames of one size reuse each other's buffers whatever their heads.
pub fn reuse_slack(len: usize) -> usize {
    (len / 8).max(PAGE)
}

/// Where a body lies: its address and length, the cache's key.
pub type Region = (usize, usize);

/// The region of `body`.
pub fn region_of(body: &Bytes) -> Region {
    (body.as_ptr() as usize, body.len())
}

struct Registration {
    mr: MemoryRegion,
    /// Keeps the registered bytes alive (and unmoved) while registered.
    _body: Bytes,
    users: usize,
}

/// The keys this endpoint asks for its registrations. Providers without
/// FI_MR_PROV_KEY take the key asked for, and a peer that knows a body's
/// key (and, without FI_MR_VIRT_ADDR, offset 0) can read it; so keys are
/// drawn from a keyed BLAKE3 stream over a counter, with a random seed,
/// which a peer cannot predict from the keys it was sent. They fit the
/// provider's `mr_key_size` and stay clear of the pools' keys (1 and 2).
pub struct KeySource {
    seed: [u8; 32],
    counter: u64,
    mask: u64,
}

/// Keys this small are left to the pools.
const SMALLEST_KEY: u64 = 16;

impl KeySource {
    /// Keys of `key_size` bytes (0, or more than 8: 8).
    pub fn new(key_size: u64) -> Result<KeySource, FabricError> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|err| FabricError::Random(err.to_string()))?;
        Ok(KeySource::seeded(seed, key_size))
    }

    fn seeded(seed: [u8; 32], key_size: u64) -> KeySource {
        let mask = match key_size {
            1..=7 => (1u64 << (8 * key_size)) - 1,
            _ => u64::MAX,
        };
        KeySource {
            seed,
            counter: 0,
            mask,
        }
    }

    pub fn next_key(&mut self) -> u64 {
        loop {
            self.counter += 1;
            let hash = blake3::keyed_hash(&self.seed, &self.counter.to_le_bytes());
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&hash.as_bytes()[..8]);
            let key = u64::from_le_bytes(bytes) & self.mask;
            if key > SMALLEST_KEY {
                return key;
            }
        }
    }
}

/// How many keys a registration tries before it gives up: the provider
/// refuses one already in use (FI_ENOKEY), which with random keys of 4
/// bytes or more is rare.
const KEY_TRIES: usize = 4;

/// Registrations of bodies for remote reads, shared by the transfers of one
/// body and released with the last of them.
pub struct Registrations {
    entries: HashMap<Region, Registration>,
    bytes: usize,
    keys: KeySource,
}

impl Registrations {
    /// Bytes registered now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Registrations held now.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether `body`'s region is registered already.
    pub fn holds(&self, body: &Bytes) -> bool {
        self.entries.contains_key(&region_of(body))
    }

    /// Registers `len` bytes at `buf` for `access` under a fresh key,
    /// drawing another while the provider has the key in use.
    ///
    /// # Safety
    /// As [`MemoryRegion::register`]: the memory stays allocated until
    /// the region is dropped.
    pub unsafe fn register_fresh(
        &mut self,
        domain: &Rc<Domain>,
        buf: *const u8,
        len: usize,
        access: u64,
    ) -> Result<MemoryRegion, FabricError> {
        let mut tries = 1;
        loop {
            let key = self.keys.next_key();
            // SAFETY: the caller keeps the memory allocated for the
            // region's lifetime.
            match unsafe { MemoryRegion::register(domain, buf, len, access, key) } {
                Err(FabricError::MrReg { code, .. })
                    if code.code == FI_ENOKEY && tries < KEY_TRIES =>
                {
                    tries += 1;
                }
                registered => return registered,
            }
        }
    }

    /// One more use of `body`'s registration, registering it for remote
    /// reads first if it has none. Returns the remote key and whether an
    /// existing registration was shared.
    pub fn acquire(
        &mut self,
        domain: &Rc<Domain>,
        body: &Bytes,
    ) -> Result<(u64, bool), FabricError> {
        let region = region_of(body);
        if let Some(entry) = self.entries.get_mut(&region) {
            entry.users += 1;
            return Ok((entry.mr.key(), true));
        }
        // SAFETY: the entry keeps a clone of `body`, so the bytes stay
        // allocated and unmoved until the region is dropped with the entry.
        let mr = unsafe {
            self.register_fresh(
                domain,
                body.as_ptr(),
                body.len(),
                super::consts::FI_REMOTE_READ,
            )
        }?;
        let key = mr.key();
        self.entries.insert(
            region,
            Registration {
                mr,
                _body: body.clone(),
                users: 1,
            },
        );
        self.bytes += body.len();
        Ok((key, false))
    }

    /// The bytes registered for `region`, if it is.
    pub fn body(&self, region: Region) -> Option<Bytes> {
        self.entries.get(&region).map(|entry| entry._body.clone())
    }

    /// One use of `region` fewer; the registration goes with the last.
    pub fn release(&mut self, region: Region) {
        if let Some(entry) = self.entries.get_mut(&region) {
            entry.users -= 1;
            if entry.users == 0 {
                self.entries.remove(&region);
                self.bytes -= region.1;
            }
        }
    }
}

/// Bodies of transfers abandoned by their link's close, kept for
/// [`ABANDONED_KEPT_FOR`], or until a fence sent behind their reads is out
/// (where the provider serves reads in order with later sends, see
/// `LinkInfo::fenced_release`), within [`ABANDONED_KEPT_MAX`] bytes.
#[derive(Default)]
pub struct Abandoned {
    /// When each may go, oldest first.
    timed: VecDeque<(Instant, Bytes)>,
    /// The fence each waits for, oldest first.
    fenced: VecDeque<(u64, Bytes)>,
    bytes: usize,
    /// Bodies let go of past the bound while their fence was still to
    /// come.
    pub fenced_evicted: u64,
}

impl Abandoned {
    /// Keeps `body` until `fence` is out, or without one for its time.
    pub fn keep(&mut self, body: Bytes, now: Instant, fence: Option<u64>) {
        self.bytes += body.len();
        match fence {
            Some(fence) => self.fenced.push_back((fence, body)),
            None => self.timed.push_back((now + ABANDONED_KEPT_FOR, body)),
        }
        // Past the bound the oldest go, those waiting for their time
        // first.
        while self.bytes > ABANDONED_KEPT_MAX {
            let oldest = match self.timed.pop_front() {
                Some((_, body)) => body,
                None => match self.fenced.pop_front() {
                    Some((_, body)) => {
                        self.fenced_evicted += 1;
                        body
                    }
                    None => break,
                },
            };
            self.bytes -= oldest.len();
        }
    }

    /// Lets go of the bodies whose time is up.
    pub fn let_go(&mut self, now: Instant) {
        while self.timed.front().is_some_and(|(until, _)| *until <= now) {
            if let Some((_, body)) = self.timed.pop_front() {
                self.bytes -= body.len();
            }
        }
    }

    /// The bodies waiting for `fence`, which will not come (never posted,
    /// or its send failed), wait for their time instead.
    pub fn fence_lost(&mut self, fence: u64, now: Instant) {
        let (lost, kept): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.fenced)
            .into_iter()
            .partition(|(waited, _)| *waited == fence);
        self.fenced = kept;
        let until = now + ABANDONED_KEPT_FOR;
        self.timed
            .extend(lost.into_iter().map(|(_, body)| (until, body)));
    }

    /// Lets go of the bodies that waited for `fence`.
    pub fn fence_passed(&mut self, fence: u64) {
        let bytes = &mut self.bytes;
        self.fenced.retain(|(waited, body)| {
            let passed = *waited == fence;
            if passed {
                *bytes -= body.len();
            }
            !passed
        });
    }

    pub fn is_empty(&self) -> bool {
        self.timed.is_empty() && self.fenced.is_empty()
    }

    /// Bodies kept, and their bytes.
    pub fn held(&self) -> (usize, usize) {
        (self.timed.len() + self.fenced.len(), self.bytes)
    }
}

/// A transfer sent, waiting for the peer's done frame.
pub struct Outstanding {
    pub peer: PeerId,
    pub region: Region,
    /// The done came, and a fence frame follows it (see
    /// `LinkInfo::fenced_release`): the body goes once the fence is sent.
    pub fenced: bool,
}

/// A frame of the endpoint's own owed to a peer, waiting for a tx slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owed {
    /// The done of a read finished.
    Done(u64),
    /// The fence behind a transfer's read (see [`Outstanding::fenced`]).
    Fence(u64),
}

/// A descriptor received, waiting for a read slot.
pub struct QueuedRead {
    pub peer: PeerId,
    pub descriptor: RmaDescriptor,
    /// The frame's first bytes, sent inline.
    pub head: Vec<u8>,
}

impl QueuedRead {
    /// The memory it holds while queued.
    fn cost(&self) -> usize {
        std::mem::size_of::<QueuedRead>() + self.head.capacity()
    }
}

/// The descriptors waiting for their reads, oldest first, and the memory
/// they hold.
pub struct ReadQueue {
    reads: VecDeque<QueuedRead>,
    bytes: usize,
    max: usize,
}

impl ReadQueue {
    /// A queue whose descriptors may hold `max` bytes.
    pub fn new(max: usize) -> ReadQueue {
        ReadQueue {
            reads: VecDeque::new(),
            bytes: 0,
            max,
        }
    }

    pub fn len(&self) -> usize {
        self.reads.len()
    }

    /// The memory the queued descriptors hold.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The memory its descriptors may hold.
    pub fn max(&self) -> usize {
        self.max
    }

    pub fn set_max(&mut self, max: usize) {
        self.max = max;
    }

    pub fn get(&self, at: usize) -> Option<&QueuedRead> {
        self.reads.get(at)
    }

    pub fn iter(&self) -> impl Iterator<Item = &QueuedRead> {
        self.reads.iter()
    }

    pub fn push_back(&mut self, read: QueuedRead) {
        self.bytes += read.cost();
        self.reads.push_back(read);
    }

    pub fn remove(&mut self, at: usize) -> Option<QueuedRead> {
        let read = self.reads.remove(at)?;
        self.bytes -= read.cost();
        Some(read)
    }

    /// Removes `peer`'s descriptors; returns how many there were.
    pub fn remove_peer(&mut self, peer: PeerId) -> usize {
        let before = self.reads.len();
        let mut freed = 0;
        self.reads.retain(|read| {
            let keep = read.peer != peer;
            if !keep {
                freed += read.cost();
            }
            keep
        });
        self.bytes -= freed;
        before - self.reads.len()
    }

    /// The peer to cut off while the queue holds more than its bound: the
    /// one whose descriptors hold the most.
    pub fn over_bound(&self) -> Option<PeerId> {
        if self.bytes <= self.max {
            return None;
        }
        let mut by_peer: HashMap<PeerId, usize> = HashMap::new();
        for read in &self.reads {
            *by_peer.entry(read.peer).or_default() += read.cost();
        }
        by_peer
            .into_iter()
            .max_by_key(|&(peer, bytes)| (bytes, std::cmp::Reverse(peer)))
            .map(|(peer, _)| peer)
    }
}

/// A read in flight: the buffer it lands in, after the inline head.
pub struct ReadJob {
    pub peer: PeerId,
    /// Where the read goes: kept in the address vector until it completes,
    /// even once its peer is dropped.
    pub fi_addr: u64,
    pub id: u64,
    /// The buffer's registration, where the provider needs local ones;
    /// before `buf`, so it is closed first when a job is dropped whole.
    pub mr: Option<MemoryRegion>,
    /// The frame lands at `buf[start..]`.
    pub buf: LandingBuf,
    pub start: usize,
    /// Its link closed while it was in flight (see [`ORPHANS_MAX`]).
    pub orphaned: bool,
}

impl ReadJob {
    /// What the read counts against the reading bounds, from its start to
    /// its end.
    pub fn footprint(&self) -> usize {
        self.buf.footprint(self.buf.len() - self.start)
    }
}

/// One read's operation context: room for `struct fi_context2`, at an
/// address that does not move.
pub struct ReadSlot {
    pub context: Box<[u64; 8]>,
    pub job: Option<ReadJob>,
}

/// Everything rendezvous of one endpoint.
pub struct Rendezvous {
    /// Remote addresses are virtual addresses (FI_MR_VIRT_ADDR), else
    /// offsets into the registration.
    pub virt_addr: bool,
    /// Largest frame sent or taken by rendezvous.
    pub max_frame: usize,
    pub registrations: Registrations,
    /// Transfers sent, by id.
    pub sends: HashMap<u64, Outstanding>,
    next_id: u64,
    pub slots: Vec<ReadSlot>,
    pub free_slots: Vec<usize>,
    /// Slots whose orphaned read completed, to stand in for the next
    /// orphan's (so there are never more than [`READ_SLOTS`] plus
    /// [`ORPHANS_MAX`]).
    spare_slots: Vec<usize>,
    /// Orphaned reads in flight, and their bytes.
    pub orphans: usize,
    orphaned_bytes: usize,
    pub queue: ReadQueue,
    /// Bytes of the reads in flight, and per peer their count and bytes.
    pub reading: usize,
    pub reading_by_peer: HashMap<PeerId, (usize, usize)>,
    /// Peers whose reads wait in the queue until their owner releases
    /// them ([`Endpoint::hold_reads`](efabus_core::transport::Endpoint::hold_reads)).
    pub held: HashSet<PeerId>,
    /// Done and fence frames the tx slots had no room for yet.
    pub owed: VecDeque<(PeerId, Owed)>,
    /// Peers refused a transfer by the registration bounds, told when
    /// transfers finish.
    pub waiters: Vec<PeerId>,
    pub landing: LandingBuffers,
    pub abandoned: Abandoned,
}

impl Rendezvous {
    /// Rendezvous for frames up to `max_frame`, its keys of `key_size`
    /// bytes (the domain's `mr_key_size`).
    pub fn new(
        virt_addr: bool,
        max_frame: usize,
        key_size: u64,
    ) -> Result<Rendezvous, FabricError> {
        Ok(Rendezvous {
            virt_addr,
            max_frame,
            registrations: Registrations {
                entries: HashMap::new(),
                bytes: 0,
                keys: KeySource::new(key_size)?,
            },
            sends: HashMap::new(),
            next_id: 0,
            slots: (0..READ_SLOTS)
                .map(|_| ReadSlot {
                    context: Box::new([0; 8]),
                    job: None,
                })
                .collect(),
            free_slots: (0..READ_SLOTS).rev().collect(),
            spare_slots: Vec::new(),
            orphans: 0,
            orphaned_bytes: 0,
            queue: ReadQueue::new(QUEUED_MAX),
            reading: 0,
            reading_by_peer: HashMap::new(),
            held: HashSet::new(),
            owed: VecDeque::new(),
            waiters: Vec::new(),
            landing: LandingBuffers::default(),
            abandoned: Abandoned::default(),
        })
    }

    /// Whether a read of ours is in flight (its completion is due on the
    /// tx queue).
    pub fn reads_in_flight(&self) -> bool {
        self.free_slots.len() + self.spare_slots.len() < self.slots.len()
    }

    /// Takes the reads in flight of `peer`, whose link has closed, out of
    /// the reading bounds while [`ORPHANS_MAX`] and [`ORPHANED_MAX`] allow:
    /// each keeps its slot and buffer until the provider completes it, and
    /// a spare slot joins the free ones in its place.
    pub fn orphan_reads(&mut self, peer: PeerId) {
        for index in 0..self.slots.len() {
            let Some(job) = self.slots[index].job.as_mut() else {
                continue;
            };
            if job.peer != peer || job.orphaned {
                continue;
            }
            let footprint = job.footprint();
            if self.orphans >= ORPHANS_MAX || self.orphaned_bytes + footprint > ORPHANED_MAX {
                return;
            }
            job.orphaned = true;
            self.count_read(peer, footprint, false);
            self.orphans += 1;
            self.orphaned_bytes += footprint;
            let stand_in = self.spare_slots.pop().unwrap_or_else(|| {
                self.slots.push(ReadSlot {
                    context: Box::new([0; 8]),
                    job: None,
                });
                self.slots.len() - 1
            });
            self.free_slots.push(stand_in);
        }
    }

    /// Slot `slot`'s read, whose job was just taken, has ended: its slot
    /// is free again (a spare one, if the read was orphaned), and its
    /// bytes no longer count.
    pub fn read_ended(&mut self, slot: usize, job: &ReadJob) {
        if job.orphaned {
            self.orphans -= 1;
            self.orphaned_bytes -= job.footprint();
            self.spare_slots.push(slot);
        } else {
            self.free_slots.push(slot);
            self.count_read(job.peer, job.footprint(), false);
        }
    }

    /// The queued read to start next, if one may start now: the oldest
    /// whose peer is within its share of reads (so one peer's stalled or
    /// numerous transfers do not hold up the others') and not held, when a
    /// slot is free and the endpoint's bytes allow it. When they do not,
    /// nothing younger starts before it: smaller reads passing it would
    /// keep a large one waiting for as long as they keep coming.
    pub fn startable_read(&self) -> Option<usize> {
        if self.free_slots.is_empty() {
            return None;
        }
        for (index, queued) in self.queue.iter().enumerate() {
            if self.held.contains(&queued.peer) {
                continue;
            }
            let total = self.landing.footprint(queued);
            let (reads, bytes) = self
                .reading_by_peer
                .get(&queued.peer)
                .copied()
                .unwrap_or_default();
            if reads > 0 && (reads >= PEER_READS_MAX || bytes + total > PEER_READING_MAX) {
                continue;
            }
            let all_ok = self.reading == 0 || self.reading + total <= READING_MAX;
            return all_ok.then_some(index);
        }
        None
    }

    /// Whether a read of `peer`'s is in flight or queued.
    pub fn receiving_from(&self, peer: PeerId) -> bool {
        self.reading_by_peer.contains_key(&peer) || self.queue.iter().any(|q| q.peer == peer)
    }

    /// Accounts a read for `peer` whose landing buffer takes `total` bytes
    /// ([`LandingBuf::footprint`]), starting (`started`) or ending.
    pub fn count_read(&mut self, peer: PeerId, total: usize, started: bool) {
        let entry = self.reading_by_peer.entry(peer).or_default();
        if started {
            self.reading += total;
            entry.0 += 1;
            entry.1 += total;
        } else {
            self.reading -= total;
            entry.0 -= 1;
            entry.1 -= total;
            if entry.0 == 0 {
                self.reading_by_peer.remove(&peer);
            }
        }
    }

    /// The next transfer id.
    pub fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// The read slot whose context is `context`.
    pub fn slot_of(&self, context: *mut std::ffi::c_void) -> Option<usize> {
        self.slots
            .iter()
            .position(|slot| std::ptr::eq(slot.context.as_ptr().cast(), context))
    }

    /// The address a descriptor names for `body`.
    pub fn remote_addr(&self, body: &Bytes) -> u64 {
        if self.virt_addr {
            body.as_ptr() as u64
        } else {
            0
        }
    }
}

/// Buffers reads land in, reused once the frames built on them are
/// dropped (wherever that happens): a fresh buffer per frame would cost
/// its pages' faults and zeroing on every read, more than the read itself.
/// Where [`LandingBuffers::use_huge_pages`] says so, large frames land in
/// huge pages ([`HugePages`]), which a peer's kernel-copied read (`shm`)
/// takes about twice as fast.
#[derive(Clone, Default)]
pub struct LandingBuffers {
    kept: Arc<Mutex<Kept>>,
    /// The huge-page size, where large bodies land in huge pages.
    huge_page: Option<usize>,
}

#[derive(Default)]
struct Kept {
    /// Oldest first.
    buffers: VecDeque<LandingBuf>,
    bytes: usize,
}

/// Page size for [`LandingBuffers::take_for`]'s placement.
const PAGE: usize = 4096;

/// Bodies from this long on land in huge pages where the endpoint asks
/// for them: frames of 1 MiB (their heads inline, up to [`INLINE_MAX`])
/// and larger, so that about half of a 2 MiB page is slack at most.
pub const HUGE_LANDING_MIN: usize = (1 << 20) - INLINE_MAX;

/// One landing buffer: `len` bytes in use of its capacity.
pub enum LandingBuf {
    Heap(Vec<u8>),
    Huge { pages: HugePages, len: usize },
}

impl LandingBuf {
    fn capacity(&self) -> usize {
        match self {
            LandingBuf::Heap(buf) => buf.capacity(),
            LandingBuf::Huge { pages, .. } => pages.capacity(),
        }
    }

    /// Sets the length, within the capacity for huge pages; a heap
    /// buffer's bytes beyond its last length are zeroed.
    fn set_len(&mut self, new_len: usize) {
        match self {
            LandingBuf::Heap(buf) => buf.resize(new_len, 0),
            LandingBuf::Huge { pages, len } => {
                // A read is posted for the whole length: a shorter slice
                // would let the provider write past the mapping.
                assert!(new_len <= pages.capacity(), "landing beyond its mapping");
                *len = new_len;
            }
        }
    }

    pub fn is_huge(&self) -> bool {
        matches!(self, LandingBuf::Huge { .. })
    }

    /// The memory a read landing here counts against the reading bounds:
    /// the frame's bytes (`total`), or all the pages of a huge buffer.
    pub fn footprint(&self, total: usize) -> usize {
        if self.is_huge() {
            self.capacity()
        } else {
            total
        }
    }
}

impl Default for LandingBuf {
    fn default() -> Self {
        LandingBuf::Heap(Vec::new())
    }
}

impl std::ops::Deref for LandingBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            LandingBuf::Heap(buf) => buf,
            LandingBuf::Huge { pages, len } => &pages.as_slice()[..*len],
        }
    }
}

impl std::ops::DerefMut for LandingBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            LandingBuf::Heap(buf) => buf,
            LandingBuf::Huge { pages, len } => &mut pages.as_mut_slice()[..*len],
        }
    }
}

impl LandingBuffers {
    /// Land bodies of [`HUGE_LANDING_MIN`] bytes or more in huge pages,
    /// where the system has them; false where it has none.
    pub fn use_huge_pages(&mut self) -> bool {
        self.huge_page = super::config::huge_page_size();
        self.huge_page.is_some()
    }

    /// The memory the landing buffer for `queued` will take, as
    /// [`LandingBuf::footprint`] counts it (the bounds are checked with
    /// this before a buffer is taken). Descriptors are checked against the
    /// link's frame limit before they are queued.
    pub fn footprint(&self, queued: &QueuedRead) -> usize {
        let body_len = queued.descriptor.body_len as usize;
        let total = queued.head.len() + body_len;
        match self.huge_page_for(body_len) {
            Some(page) => (total + PAGE - 1).next_multiple_of(page),
            None => total,
        }
    }

    /// The huge-page size when a body this long lands in huge pages.
    fn huge_page_for(&self, body_len: usize) -> Option<usize> {
        self.huge_page.filter(|_| body_len >= HUGE_LANDING_MIN)
    }

    /// A buffer for a frame of `head_len + body_len` bytes, and where in it
    /// the frame starts: with `body_at` (the body's address in the
    /// sender's memory) the body lands at the same offset within a page.
    /// Where a copy's destination sits just above its source within a page
    /// (4K aliasing), the copy was 6 times slower here: a 1 MiB
    /// `process_vm_readv` (shm's read) took 620 us from offset 0x20 to
    /// 0x24, 92-105 us at equal or distant offsets.
    pub fn take_for(
        &self,
        head_len: usize,
        body_len: usize,
        body_at: Option<u64>,
    ) -> (LandingBuf, usize) {
        let total = head_len + body_len;
        let Some(body_at) = body_at else {
            return (self.take(total), 0);
        };
        let huge = self.huge_page_for(body_len).is_some();
        let mut buf = self.take_kind(total + PAGE - 1, huge);
        let body_base = buf.as_ptr() as usize + head_len;
        let start = (body_at as usize).wrapping_sub(body_base) % PAGE;
        buf.set_len(start + total);
        (buf, start)
    }

    /// A heap buffer of `len` bytes: a kept one large enough if there is
    /// one (its old bytes are overwritten by the caller), else a new one.
    pub fn take(&self, len: usize) -> LandingBuf {
        self.take_kind(len, false)
    }

    /// A buffer of `len` bytes, in huge pages if `huge` (a heap one when
    /// none can be mapped): a kept one if one fits (the smallest heap one
    /// at most [`reuse_slack`] larger, or a huge one of exactly the pages
    /// `len` needs, so that what the bounds count is what
    /// [`footprint`](Self::footprint) predicted, give or take that slack; of
    /// equal ones the last kept, whose bytes are likeliest still in a
    /// core's cache: taking the oldest cycled a stream of 1 MiB frames
    /// through every kept buffer, and through the broker it ran 10-20%
    /// slower), else a new one.
    fn take_kind(&self, len: usize, huge: bool) -> LandingBuf {
        let huge_capacity = self
            .huge_page
            .filter(|_| huge)
            .map(|page| len.next_multiple_of(page));
        let reused = {
            let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
            let found = (0..kept.buffers.len())
                .rev()
                .filter(|&at| {
                    let buf = &kept.buffers[at];
                    match huge_capacity {
                        Some(capacity) => buf.is_huge() && buf.capacity() == capacity,
                        None => {
                            !buf.is_huge()
                                && (len..=len.saturating_add(reuse_slack(len)))
                                    .contains(&buf.capacity())
                        }
                    }
                })
                .min_by_key(|&at| kept.buffers[at].capacity());
            found.and_then(|at| {
                let buf = kept.buffers.remove(at)?;
                kept.bytes -= buf.capacity();
                Some(buf)
            })
        };
        match reused {
            Some(mut buf) => {
                buf.set_len(len);
                buf
            }
            None => match huge.then(|| HugePages::new(len)).flatten() {
                Some(pages) => LandingBuf::Huge { pages, len },
                // Zeroed by the allocator: fresh pages are not written
                // until the read lands in them.
                None => LandingBuf::Heap(vec![0u8; len]),
            },
        }
    }

    /// `buf[start..]` as a frame's bytes; `buf` comes back here when the
    /// last of them goes.
    pub fn frame(&self, buf: LandingBuf, start: usize) -> Bytes {
        Bytes::from_owner(Landed {
            buf,
            start,
            home: self.clone(),
        })
    }

    /// Keeps `buf` for reuse within the bound, letting the oldest kept
    /// ones go to make room: the sizes in use now are the ones worth
    /// keeping.
    pub fn keep(&self, buf: LandingBuf) {
        let capacity = buf.capacity();
        if capacity > LANDING_KEPT_MAX {
            return;
        }
        let mut evicted = Vec::new();
        {
            let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
            while kept.bytes + capacity > LANDING_KEPT_MAX {
                let Some(old) = kept.buffers.pop_front() else {
                    break;
                };
                kept.bytes -= old.capacity();
                evicted.push(old);
            }
            kept.bytes += capacity;
            kept.buffers.push_back(buf);
        }
        // Freed (unmapped) outside the lock.
        drop(evicted);
    }

    /// Bytes kept for reuse now.
    #[cfg(test)]
    pub fn kept_bytes(&self) -> usize {
        self.kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .bytes
    }
}

/// A landed frame's buffer, given back to its pool when dropped.
struct Landed {
    buf: LandingBuf,
    start: usize,
    home: LandingBuffers,
}

impl AsRef<[u8]> for Landed {
    fn as_ref(&self) -> &[u8] {
        self.buf.get(self.start..).unwrap_or_default()
    }
}

impl Drop for Landed {
    fn drop(&mut self) {
        self.home.keep(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read of `body_len` bytes offered by peer `peer`.
    fn queued(peer: u64, body_len: usize) -> QueuedRead {
        QueuedRead {
            peer: PeerId(peer),
            descriptor: RmaDescriptor {
                id: 0,
                addr: 0,
                key: 0,
                body_len: body_len as u64,
            },
            head: Vec::new(),
        }
    }

    #[test]
    fn the_read_queue_counts_what_its_descriptors_hold() {
        let with_head = |peer: u64, head_len: usize| QueuedRead {
            head: vec![0; head_len],
            ..queued(peer, 1 << 20)
        };
        let cost = |head_len: usize| std::mem::size_of::<QueuedRead>() + head_len;
        let mut queue = ReadQueue::new(cost(50) + 2 * cost(10));
        queue.push_back(with_head(1, 50));
        queue.push_back(with_head(2, 10));
        queue.push_back(with_head(2, 10));
        assert_eq!(queue.bytes(), cost(50) + 2 * cost(10));
        assert_eq!(queue.over_bound(), None, "at the bound, not past it");
        queue.push_back(with_head(3, 0));
        // Peer 2 holds the most, though peer 1's one descriptor is larger.
        let twice_ten = 2 * cost(10);
        assert!(twice_ten > cost(50), "the sizes make peer 2 the largest");
        assert_eq!(queue.over_bound(), Some(PeerId(2)));
        assert_eq!(queue.remove_peer(PeerId(2)), 2);
        assert_eq!(queue.over_bound(), None);
        assert_eq!(queue.remove(0).map(|read| read.peer), Some(PeerId(1)));
        assert_eq!(queue.bytes(), cost(0));
        assert_eq!(queue.remove(0).map(|read| read.peer), Some(PeerId(3)));
        assert_eq!((queue.len(), queue.bytes()), (0, 0));
    }

    #[test]
    fn transfers_wait_at_the_peer_s_share_and_the_endpoint_s_bound() {
        const MIB: usize = 1 << 20;
        // Nothing out, nothing registered: any size goes.
        assert!(!must_wait(
            (0, 0),
            4 * REGISTERED_MAX,
            (0, 4 * REGISTERED_MAX)
        ));
        // The peer's share, in transfers and in bytes.
        assert!(!must_wait(
            (PEER_TRANSFERS_MAX - 1, MIB),
            MIB,
            (2 * MIB, MIB)
        ));
        assert!(must_wait((PEER_TRANSFERS_MAX, MIB), MIB, (2 * MIB, MIB)));
        assert!(!must_wait((1, PEER_BYTES_MAX - MIB), MIB, (2 * MIB, MIB)));
        assert!(must_wait(
            (1, PEER_BYTES_MAX - MIB),
            MIB + 1,
            (2 * MIB, MIB + 1)
        ));
        // The endpoint's: a body registered already adds nothing.
        let full = REGISTERED_MAX - MIB;
        assert!(!must_wait((0, 0), MIB, (full, MIB)));
        assert!(must_wait((0, 0), MIB + 1, (full, MIB + 1)));
        assert!(!must_wait((0, 0), 8 * MIB, (REGISTERED_MAX, 0)));
    }

    #[test]
    fn reads_start_within_each_peer_s_share_and_the_endpoint_s_bound() {
        let mut rma = Rendezvous::new(true, 1 << 30, 8).expect("keys");
        // Peer 1 at its share of reads: its next waits, peer 2's starts.
        for _ in 0..PEER_READS_MAX {
            rma.count_read(PeerId(1), 1 << 20, true);
        }
        rma.queue.push_back(queued(1, 1 << 20));
        rma.queue.push_back(queued(2, 1 << 20));
        assert_eq!(rma.startable_read(), Some(1));
        // Peer 2 at its share of bytes: nothing more of its starts either.
        rma.count_read(PeerId(2), PEER_READING_MAX, true);
        assert_eq!(rma.startable_read(), None);
        // A peer with nothing in flight may read one frame of any size,
        // within what the endpoint reads at once.
        rma.queue.push_back(queued(3, PEER_READING_MAX * 2));
        assert_eq!(rma.startable_read(), Some(2));
        let filling = READING_MAX - rma.reading;
        rma.count_read(PeerId(3), filling, true);
        rma.queue.push_back(queued(4, 1));
        assert_eq!(rma.startable_read(), None, "the endpoint's bound");
        // Reads that end make room again.
        rma.count_read(PeerId(3), filling, false);
        assert_eq!(rma.startable_read(), Some(2));
        // And with no slot free, nothing starts.
        rma.free_slots.clear();
        assert_eq!(rma.startable_read(), None);
    }

    #[test]
    fn a_large_read_waiting_for_room_is_not_passed_by_smaller_ones() {
        let mut rma = Rendezvous::new(true, 1 << 30, 8).expect("keys");
        // Other peers' reads take all but 1 MiB of the endpoint's bytes.
        rma.count_read(PeerId(1), READING_MAX - (1 << 20), true);
        rma.queue.push_back(queued(2, 32 << 20));
        rma.queue.push_back(queued(3, 1 << 10));
        assert_eq!(rma.startable_read(), None, "the small one waits behind");
        // A peer's share still lets the others by: peer 2 at its share.
        rma.count_read(PeerId(1), READING_MAX - (1 << 20), false);
        for _ in 0..PEER_READS_MAX {
            rma.count_read(PeerId(2), 1 << 10, true);
        }
        assert_eq!(rma.startable_read(), Some(1));
    }

    /// Starts a read of `len` bytes from `peer` in a free slot, as the
    /// endpoint does; returns the slot.
    fn start_read(rma: &mut Rendezvous, peer: u64, len: usize) -> usize {
        let slot = rma.free_slots.pop().expect("a free slot");
        let (buf, start) = rma.landing.take_for(0, len, None);
        let job = ReadJob {
            peer: PeerId(peer),
            fi_addr: 0,
            id: 1,
            mr: None,
            buf,
            start,
            orphaned: false,
        };
        rma.count_read(PeerId(peer), job.footprint(), true);
        rma.slots[slot].job = Some(job);
        slot
    }

    #[test]
    fn reads_of_a_closed_link_leave_the_bounds_within_their_own() {
        let mut rma = Rendezvous::new(true, 1 << 30, 8).expect("keys");
        let first = start_read(&mut rma, 1, 1 << 20);
        start_read(&mut rma, 1, 1 << 20);
        start_read(&mut rma, 2, 1 << 20);
        let reading = rma.reading;
        rma.orphan_reads(PeerId(1));
        assert_eq!(rma.orphans, 2);
        assert_eq!(rma.reading, reading / 3, "peer 2's read alone counts");
        assert_eq!(rma.free_slots.len(), READ_SLOTS - 1, "stand-ins for both");
        assert!(rma.reads_in_flight());
        // An orphan that ends gives its slot to the spares, not the free
        // list; the next orphan takes it.
        let job = rma.slots[first].job.take().expect("a job");
        rma.read_ended(first, &job);
        assert_eq!((rma.orphans, rma.free_slots.len()), (1, READ_SLOTS - 1));
        let slots = rma.slots.len();
        rma.orphan_reads(PeerId(2));
        assert_eq!(rma.slots.len(), slots, "the spare stood in");
        assert_eq!((rma.orphans, rma.reading), (2, 0));
        while let Some(index) = rma.slots.iter().position(|s| s.job.is_some()) {
            let job = rma.slots[index].job.take().expect("a job");
            assert!(job.orphaned);
            rma.read_ended(index, &job);
        }
        assert!(!rma.reads_in_flight());
        assert_eq!(rma.free_slots.len(), READ_SLOTS);
        assert_eq!(rma.orphans, 0);
    }

    #[test]
    fn orphans_past_their_bound_keep_counting() {
        let mut rma = Rendezvous::new(true, 1 << 30, 8).expect("keys");
        start_read(&mut rma, 1, ORPHANED_MAX + 1);
        start_read(&mut rma, 2, 1 << 20);
        rma.orphan_reads(PeerId(1));
        assert_eq!(rma.orphans, 0, "its footprint is past the bound");
        rma.orphan_reads(PeerId(2));
        assert_eq!(rma.orphans, 1);
        assert!(rma.reading >= ORPHANED_MAX, "the first still counts");
    }

    #[test]
    fn abandoned_bodies_are_kept_for_their_time_within_their_bound() {
        let now = Instant::now();
        let mut kept = Abandoned::default();
        let body = Bytes::from(vec![7u8; 1 << 20]);
        kept.keep(body.clone(), now, None);
        kept.let_go(now + ABANDONED_KEPT_FOR / 2);
        assert_eq!(kept.held(), (1, 1 << 20), "kept while the peer may read");
        kept.let_go(now + ABANDONED_KEPT_FOR);
        assert_eq!(kept.held(), (0, 0));
        assert!(body.is_unique(), "let go of");
        // Past the bound the oldest go first.
        let count = ABANDONED_KEPT_MAX / (1 << 20);
        let first = Bytes::from(vec![1u8; 1 << 20]);
        kept.keep(first.clone(), now, None);
        for _ in 1..=count {
            kept.keep(Bytes::from(vec![2u8; 1 << 20]), now, None);
        }
        assert_eq!(kept.held(), (count, ABANDONED_KEPT_MAX));
        assert!(first.is_unique(), "the oldest went");
    }

    #[test]
    fn fenced_bodies_wait_for_their_fence_not_their_time() {
        let now = Instant::now();
        let mut kept = Abandoned::default();
        let body = Bytes::from(vec![7u8; 1 << 20]);
        kept.keep(body.clone(), now, Some(3));
        kept.let_go(now + ABANDONED_KEPT_FOR * 2);
        assert_eq!(kept.held(), (1, 1 << 20), "kept past its time");
        kept.fence_passed(2);
        assert_eq!(kept.held(), (1, 1 << 20), "another fence");
        kept.fence_passed(3);
        assert_eq!(kept.held(), (0, 0));
        assert!(body.is_unique(), "let go of");
        // Past the bound those waiting for their time go first, then the
        // oldest fenced, counted.
        let fenced = Bytes::from(vec![1u8; 1 << 20]);
        kept.keep(fenced.clone(), now, Some(4));
        let timed = Bytes::from(vec![1u8; 1 << 20]);
        kept.keep(timed.clone(), now, None);
        for _ in 0..ABANDONED_KEPT_MAX / (1 << 20) - 1 {
            kept.keep(Bytes::from(vec![2u8; 1 << 20]), now, Some(5));
        }
        assert!(
            timed.is_unique() && !fenced.is_unique(),
            "the timed one went first"
        );
        kept.keep(Bytes::from(vec![2u8; 1 << 20]), now, Some(5));
        assert!(fenced.is_unique(), "then the oldest fenced");
        assert_eq!(kept.fenced_evicted, 1);
        // A fence that will not come leaves its bodies to their time.
        let mut kept = Abandoned::default();
        let body = Bytes::from(vec![3u8; 1 << 20]);
        kept.keep(body.clone(), now, Some(6));
        kept.fence_lost(6, now);
        kept.let_go(now + ABANDONED_KEPT_FOR / 2);
        assert_eq!(kept.held(), (1, 1 << 20));
        kept.let_go(now + ABANDONED_KEPT_FOR);
        assert!(body.is_unique(), "let go of by time");
    }

    #[test]
    fn landing_buffers_come_back_when_their_frames_go() {
        let buffers = LandingBuffers::default();
        let buf = buffers.take(1000);
        assert_eq!(buf.len(), 1000);
        let address = buf.as_ptr();
        let frame = buffers.frame(buf, 0);
        let part = frame.slice(10..20);
        drop(frame);
        assert_eq!(buffers.kept_bytes(), 0, "a slice still holds it");
        drop(part);
        assert!(buffers.kept_bytes() >= 1000);
        let again = buffers.take(600);
        assert_eq!((again.as_ptr(), again.len()), (address, 600));
        assert_eq!(buffers.kept_bytes(), 0);
        assert_eq!(
            buffers.take(2000).len(),
            2000,
            "none large enough: a new one"
        );
    }

    #[test]
    fn a_body_lands_at_its_source_s_offset_within_a_page() {
        let buffers = LandingBuffers::default();
        for (head_len, body_at) in [
            (36, 0x7f00_0000_0020u64),
            (0, 0x1000),
            (13, 0xfff),
            (36, 0x24),
        ] {
            let (mut buf, start) = buffers.take_for(head_len, 10_000, Some(body_at));
            assert_eq!(buf.len(), start + head_len + 10_000);
            let body = buf.as_ptr() as u64 + (start + head_len) as u64;
            assert_eq!(body % PAGE as u64, body_at % PAGE as u64);
            buf[start] = 7;
            let frame = buffers.frame(buf, start);
            assert_eq!((frame.len(), frame[0]), (head_len + 10_000, 7));
        }
        let (buf, start) = buffers.take_for(36, 100, None);
        assert_eq!((buf.len(), start), (136, 0));
    }

    #[test]
    fn large_bodies_land_in_huge_pages_where_asked() {
        let queued = |head_len: usize, body_len: usize| QueuedRead {
            peer: PeerId(1),
            descriptor: RmaDescriptor {
                id: 1,
                addr: 0x7f00_0000_0123,
                key: 1,
                body_len: body_len as u64,
            },
            head: vec![0; head_len],
        };
        let mut buffers = LandingBuffers::default();
        let mebibyte = queued(60, 1 << 20);
        assert_eq!(buffers.footprint(&mebibyte), 60 + (1 << 20), "not asked");
        if !buffers.use_huge_pages() {
            // No huge pages here: everything lands as before.
            assert_eq!(buffers.footprint(&mebibyte), 60 + (1 << 20));
            return;
        }
        for (head_len, body_len, huge) in [
            (60, 1 << 20, true),
            (INLINE_MAX, HUGE_LANDING_MIN, true),
            (60, HUGE_LANDING_MIN - 1, false),
            (60, 3 << 20, true),
        ] {
            let read = queued(head_len, body_len);
            let total = head_len + body_len;
            let (buf, start) = buffers.take_for(head_len, body_len, Some(read.descriptor.addr));
            assert_eq!(buf.is_huge(), huge, "{body_len}");
            assert_eq!(buf.len(), start + total);
            let body = buf.as_ptr() as u64 + (start + head_len) as u64;
            assert_eq!(body % PAGE as u64, read.descriptor.addr % PAGE as u64);
            // What the bounds were told before the buffer was taken is
            // what it takes.
            assert_eq!(buffers.footprint(&read), buf.footprint(total));
            if huge {
                assert_eq!(buf.footprint(total), buf.capacity());
                assert!(buf.capacity() < 2 * total + (4 << 20), "{}", buf.capacity());
            } else {
                assert_eq!(buf.footprint(total), total);
            }
            // Given back and taken again: the same kind comes back.
            let address = buf.as_ptr();
            drop(buffers.frame(buf, start));
            let (again, _) = buffers.take_for(head_len, body_len, Some(read.descriptor.addr));
            assert_eq!((again.as_ptr(), again.is_huge()), (address, huge));
            buffers.keep(again);
        }
        assert!(buffers.kept_bytes() <= LANDING_KEPT_MAX);
        // With only the 3 MiB frame's pages kept, a 1 MiB frame gets pages
        // of its own: what the bounds were told is what it takes.
        let (small, _) = buffers.take_for(60, 1 << 20, Some(0));
        let (large, _) = buffers.take_for(60, 3 << 20, Some(0));
        drop(small);
        let large_capacity = large.capacity();
        buffers.keep(large);
        let kept = buffers.kept_bytes();
        let read = queued(60, 1 << 20);
        let (small, _) = buffers.take_for(60, 1 << 20, Some(0));
        assert_eq!(buffers.footprint(&read), small.footprint(60 + (1 << 20)));
        assert!(small.capacity() < large_capacity);
        assert_eq!(buffers.kept_bytes(), kept, "the 3 MiB pages stay kept");
    }

    #[test]
    fn the_smallest_kept_heap_buffer_that_fits_is_taken() {
        let buffers = LandingBuffers::default();
        // Both within the slack of what is asked; the larger kept last.
        let (small, large) = (buffers.take(1 << 20), buffers.take((1 << 20) + (64 << 10)));
        let small_at = small.as_ptr();
        buffers.keep(small);
        buffers.keep(large);
        let len = (1 << 20) - 1000;
        assert!((1 << 20) + (64 << 10) <= len + reuse_slack(len));
        let taken = buffers.take(len);
        assert_eq!((taken.as_ptr(), taken.len()), (small_at, len));
    }

    #[test]
    fn a_frame_takes_no_kept_buffer_much_larger_than_itself() {
        let buffers = LandingBuffers::default();
        let large = buffers.take(1 << 20);
        let large_at = large.as_ptr();
        buffers.keep(large);
        // A 20 KiB frame would hold the whole 1 MiB while it lives.
        let small = buffers.take(20 << 10);
        assert_ne!(small.as_ptr(), large_at);
        assert!(small.capacity() <= (20 << 10) + reuse_slack(20 << 10));
        // One within the slack takes it.
        let near = (1 << 20) - (64 << 10);
        assert_eq!(buffers.take(near).as_ptr(), large_at);
    }

    #[test]
    fn of_equal_kept_buffers_the_last_kept_is_taken() {
        let buffers = LandingBuffers::default();
        let (first, second) = (buffers.take(1 << 20), buffers.take(1 << 20));
        let second_at = second.as_ptr();
        buffers.keep(first);
        buffers.keep(second);
        assert_eq!(buffers.take(1 << 20).as_ptr(), second_at);
    }

    #[test]
    fn keeping_a_buffer_lets_the_oldest_go_when_full() {
        let buffers = LandingBuffers::default();
        let third = LANDING_KEPT_MAX / 3;
        let taken: Vec<LandingBuf> = (0..3).map(|_| buffers.take(third)).collect();
        for buf in taken {
            buffers.keep(buf);
        }
        assert_eq!(buffers.kept_bytes(), 3 * third);
        // A larger one makes room for itself: the two oldest go.
        buffers.keep(buffers.take(LANDING_KEPT_MAX / 2));
        assert_eq!(buffers.kept_bytes(), third + LANDING_KEPT_MAX / 2);
        assert_eq!(
            buffers.take(LANDING_KEPT_MAX / 2).capacity(),
            LANDING_KEPT_MAX / 2
        );
        // One above the bound is not kept, and takes nothing with it.
        let before = buffers.kept_bytes();
        buffers.keep(LandingBuf::Heap(vec![0; LANDING_KEPT_MAX + 1]));
        assert_eq!(buffers.kept_bytes(), before);
    }

    #[test]
    fn landing_buffers_keep_at_most_their_bound() {
        let buffers = LandingBuffers::default();
        let frames: Vec<Bytes> = (0..3)
            .map(|_| buffers.frame(buffers.take(LANDING_KEPT_MAX / 2), 0))
            .collect();
        drop(frames);
        assert!(buffers.kept_bytes() <= LANDING_KEPT_MAX);
        assert!(buffers.kept_bytes() >= LANDING_KEPT_MAX / 2);
    }

    #[test]
    fn memory_keys_fit_the_key_size_and_cannot_be_told_from_one_another() {
        for (key_size, max) in [(4, u64::from(u32::MAX)), (8, u64::MAX), (0, u64::MAX)] {
            let mut keys = KeySource::seeded([7; 32], key_size);
            let drawn: Vec<u64> = (0..1000).map(|_| keys.next_key()).collect();
            assert!(drawn.iter().all(|&key| key > SMALLEST_KEY && key <= max));
            let distinct: std::collections::HashSet<_> = drawn.iter().collect();
            assert_eq!(distinct.len(), drawn.len(), "key size {key_size}");
            // Not a counter: consecutive keys are not a step apart.
            assert!(drawn.windows(2).all(|pair| pair[1].abs_diff(pair[0]) > 1));
        }
        let one = KeySource::seeded([1; 32], 8).next_key();
        let other = KeySource::seeded([2; 32], 8).next_key();
        assert_ne!(one, other, "each endpoint's keys depend on its seed");
        assert_eq!(KeySource::seeded([0; 32], 1).mask, 0xff);
    }
}
