//! Behaviour of the fabric endpoints themselves, beyond the generic
//! endpoint conformance suite (which `conformance_fabric.rs` runs over
//! them): exchange between inserted peers, senders announced before they
//! are inserted, wait sets, the forced prefix and memory registration
//! paths, packing of bursts and its per-peer limit, bounded unknown
//! senders, dropped oversized messages, lent receive buffers and uncopied
//! sends, backpressure through `tx_depth`. Over libfabric's
//! loopback-capable providers: `tcp;ofi_rxm`, `udp;ofi_rxd` and `sockets`
//! as RDM, `udp` as DGRAM. Each suite opens two endpoints on 127.0.0.1 and
//! exchanges frames.
//!
//! A provider that is not available skips its tests with a message, unless
//! `EFABUS_REQUIRE_FABRIC=1` (set in CI), which turns the skip into a
//! failure. Every wait is bounded by a deadline.

use efabus_transports::fabric::build_unavailable_reason;

fn fabric_required() -> bool {
    std::env::var("EFABUS_REQUIRE_FABRIC").is_ok_and(|v| v == "1")
}

#[test]
fn libfabric_is_linked_when_required() {
    if let Some(reason) = build_unavailable_reason() {
        assert!(!fabric_required(), "EFABUS_REQUIRE_FABRIC=1 but: {reason}");
        eprintln!("skipping fabric tests: {reason}");
    }
}

#[cfg(efabus_libfabric)]
mod suite {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use bytes::Bytes;
    use efabus_core::transport::{
        CloseReason, Endpoint, EndpointConfig, Event, FabricOptions, LinkKeys, OutFrame, PeerId,
        SendError, Transport, TransportError,
    };
    use efabus_transports::conformance::link_keys;
    use efabus_transports::fabric::{addr_to_hex, EpKind, FabricEndpoint, FabricTransport};

    use super::fabric_required;

    const DEADLINE: Duration = Duration::from_secs(20);
    const RX_DEPTH: usize = 16;

    /// A frame: 4-byte little-endian length, then the payload.
    pub fn frame(payload: &[u8]) -> OutFrame {
        let mut head = (payload.len() as u32).to_le_bytes().to_vec();
        // Split the payload between head and body to cover both parts.
        let split = payload.len() / 3;
        head.extend_from_slice(&payload[..split]);
        OutFrame {
            head: head.into(),
            body: Bytes::copy_from_slice(&payload[split..]),
        }
    }

    fn payload_of(frame: &[u8]) -> &[u8] {
        &frame[4..]
    }

    /// The scheme endpoints of `provider` report.
    fn expected_scheme(kind: EpKind, provider: &str) -> &'static str {
        if provider == "shm" {
            "shm"
        } else {
            kind.scheme()
        }
    }

    /// The transport for `provider`: `shm` has a scheme of its own.
    pub fn transport(kind: EpKind, provider: &str) -> FabricTransport {
        match kind {
            EpKind::Rdm if provider == "shm" => FabricTransport::shm(),
            EpKind::Rdm => FabricTransport::rdm(),
            EpKind::Dgram => FabricTransport::dgram(),
        }
    }

    /// An endpoint on 127.0.0.1 with `provider`, small buffers, and the
    /// `extra` options (as text, later ones winning) on top.
    pub fn config(provider: &str, extra: &[(&str, &str)]) -> EndpointConfig {
        let rx_depth = RX_DEPTH.to_string();
        let base = [
            ("provider", provider),
            ("rx_depth", rx_depth.as_str()),
            ("tx_depth", "16"),
            ("msg_size", "16384"),
        ];
        let options = FabricOptions::parse(base.iter().chain(extra).copied(), None)
            .expect("valid test options");
        EndpointConfig {
            bind: Some("127.0.0.1".to_string()),
            fabric: Some(options),
            ..EndpointConfig::default()
        }
    }

    /// Two endpoints, or None (after a message) when the provider is absent.
    pub fn pair(
        kind: EpKind,
        provider: &str,
        extra: &[(&str, &str)],
    ) -> Option<(FabricEndpoint, FabricEndpoint)> {
        let t = transport(kind, provider);
        let cfg = config(provider, extra);
        let open = || t.open_fabric(&cfg);
        match (open(), open()) {
            (Ok(a), Ok(b)) => Some((a, b)),
            (Err(TransportError::Unavailable { reason, .. }), _)
            | (_, Err(TransportError::Unavailable { reason, .. })) => {
                assert!(
                    !fabric_required(),
                    "EFABUS_REQUIRE_FABRIC=1 but provider {provider} is unavailable: {reason}"
                );
                eprintln!("skipping: provider {provider} unavailable: {reason}");
                None
            }
            (Err(err), _) | (_, Err(err)) => panic!("opening {provider} endpoints: {err}"),
        }
    }

    /// Polls both endpoints until `done` says so; panics at the deadline.
    pub fn pump(
        a: &mut FabricEndpoint,
        b: &mut FabricEndpoint,
        a_events: &mut Vec<Event>,
        b_events: &mut Vec<Event>,
        mut done: impl FnMut(&[Event], &[Event]) -> bool,
        what: &str,
    ) {
        let start = Instant::now();
        loop {
            a.poll(a_events).expect("poll a");
            b.poll(b_events).expect("poll b");
            if done(a_events, b_events) {
                return;
            }
            assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
            std::thread::yield_now();
        }
    }

    fn frames_from(events: &[Event], from: PeerId) -> Vec<Bytes> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Frame { peer, frame } if *peer == from => Some(frame.clone()),
                _ => None,
            })
            .collect()
    }

    /// Sends, polling both sides while the sender pushes back.
    fn send_blocking(
        a: &mut FabricEndpoint,
        b: &mut FabricEndpoint,
        to: PeerId,
        out: OutFrame,
        a_events: &mut Vec<Event>,
        b_events: &mut Vec<Event>,
    ) {
        let start = Instant::now();
        let mut out = out;
        loop {
            match a.send(to, out) {
                Ok(()) => return,
                Err(SendError::WouldBlock(back)) => {
                    out = back;
                    a.poll(a_events).expect("poll a");
                    b.poll(b_events).expect("poll b");
                    assert!(start.elapsed() < DEADLINE, "send stayed blocked");
                }
                Err(err) => panic!("send failed: {err}"),
            }
        }
    }

    fn insert_each_other(a: &mut FabricEndpoint, b: &mut FabricEndpoint) -> (PeerId, PeerId) {
        let b_addr = b.local_addr();
        let a_addr = a.local_addr();
        assert!(!a_addr.is_empty());
        assert_ne!(a_addr, b_addr, "two endpoints with one address");
        let (a_keys, b_keys) = link_keys();
        let pb = a.insert_peer(&b_addr, &a_keys).expect("insert b");
        let pa = b.insert_peer(&a_addr, &b_keys).expect("insert a");
        // A link id is one link's alone, and so is a send key: messages
        // are tagged with the link's counter as the nonce.
        assert!(a.insert_peer(&b_addr, &a_keys).is_err());
        let mut same_send_key = a_keys.clone();
        same_send_key.local_id = a_keys.local_id.wrapping_add(1000);
        let refused = a
            .insert_peer(&b_addr, &same_send_key)
            .expect_err("a send key taken twice");
        assert!(refused.to_string().contains("send key"), "{refused}");
        (pb, pa)
    }

    /// Polls both until `b` has counted `what` (read by `count`) past
    /// `before`.
    fn until_counted(
        a: &mut FabricEndpoint,
        b: &mut FabricEndpoint,
        be: &mut Vec<Event>,
        count: impl Fn(&efabus_transports::fabric::FabricStats) -> u64,
        what: &str,
    ) {
        let before = count(b.stats());
        let start = Instant::now();
        while count(b.stats()) == before {
            a.poll(&mut Vec::new()).expect("poll sender");
            b.poll(be).expect("poll receiver");
            assert!(start.elapsed() < DEADLINE, "never counted: {what}");
        }
    }

    pub fn exchange_both_directions(kind: EpKind, provider: &str, extra: &[(&str, &str)]) {
        let Some((mut a, mut b)) = pair(kind, provider, extra) else {
            return;
        };
        assert_eq!(a.scheme(), expected_scheme(kind, provider));
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        let (mut ae, mut be) = (Vec::new(), Vec::new());

        a.send(pb, frame(b"ping from a"))
            .unwrap_or_else(|e| panic!("send: {e}"));
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| !frames_from(be, pa).is_empty(),
            "a->b",
        );
        assert_eq!(payload_of(&frames_from(&be, pa)[0]), b"ping from a");
        assert!(
            !be.iter().any(|e| matches!(e, Event::Accepted { .. })),
            "a known sender was announced as new: {be:?}"
        );

        b.send(pa, frame(b"pong from b"))
            .unwrap_or_else(|e| panic!("send: {e}"));
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |ae, _| !frames_from(ae, pb).is_empty(),
            "b->a",
        );
        assert_eq!(payload_of(&frames_from(&ae, pb)[0]), b"pong from b");
        assert_eq!(a.stats().received, 1);
        assert_eq!(b.stats().received, 1);
    }

    /// A provider with manual progress moves (and, for ofi_rxd,
    /// retransmits) a send only inside our calls: while one may be in
    /// flight the owner may sleep at most a short tick, whatever its
    /// descriptor says; an endpoint idle for a while, or one whose provider
    /// progresses by itself, sets no limit.
    pub fn sends_in_flight_cap_the_wait(kind: EpKind, provider: &str, manual: bool) {
        let Some((mut a, mut b)) = pair(kind, provider, &[]) else {
            return;
        };
        assert_eq!(a.wait_cap(), None, "{provider}: idle");
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        a.send(pb, frame(b"in flight")).expect("send");
        // Posted, and not acknowledged: the receiver has not been polled.
        a.poll(&mut ae).expect("poll a");
        if manual {
            let cap = a.wait_cap();
            assert!(
                cap.is_some_and(|cap| cap <= Duration::from_millis(1)),
                "{provider}: a send in flight left the wait at {cap:?}"
            );
        } else {
            assert_eq!(a.wait_cap(), None, "{provider} progresses by itself");
        }
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| !frames_from(be, pa).is_empty(),
            "the frame",
        );
        let start = Instant::now();
        while a.wait_cap().is_some() {
            a.poll(&mut ae).expect("poll a");
            b.poll(&mut be).expect("poll b");
            assert!(
                start.elapsed() < DEADLINE,
                "{provider}: the send never completed"
            );
        }
    }

    /// With a wait set, a receiver that is not polled learns of a frame
    /// through its descriptor alone, once `prepare_wait` has allowed the
    /// wait; with `wait_fd=false` (or a provider without wait sets) the
    /// endpoint must be polled.
    pub fn wait_fd_announces_frames(kind: EpKind, provider: &str) {
        use efabus_core::transport::Readiness;
        use mio::unix::SourceFd;
        use mio::{Events, Interest, Poll, Token};

        if let Some((plain, _)) = pair(kind, provider, &[("wait_fd", "false")]) {
            assert_eq!(plain.readiness(), Readiness::MustPoll);
        }
        let Some((mut a, mut b)) = pair(kind, provider, &[]) else {
            return;
        };
        let Readiness::PollOrWait(fd) = b.readiness() else {
            panic!("{provider}: no wait set: {:?}", b.readiness());
        };
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        // A first frame sets up whatever connection the provider needs.
        a.send(pb, frame(b"first")).expect("send");
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| !frames_from(be, pa).is_empty(),
            "first frame",
        );

        let mut poll = Poll::new().expect("poll");
        poll.registry()
            .register(&mut SourceFd(&fd), Token(0), Interest::READABLE)
            .expect("register wait fd");
        let start = Instant::now();
        while !b.prepare_wait() {
            b.poll(&mut be).expect("poll b");
            assert!(
                start.elapsed() < DEADLINE,
                "prepare_wait never allowed a wait"
            );
        }
        let mut events = Events::with_capacity(4);
        // Registration reports the descriptor's state once; after that,
        // with nothing pending, it stays quiet.
        poll.poll(&mut events, Some(Duration::ZERO)).expect("poll");
        poll.poll(&mut events, Some(Duration::from_millis(50)))
            .expect("poll");
        assert!(
            events.is_empty(),
            "the wait fd was readable with nothing to do"
        );

        a.send(pb, frame(b"wake up")).expect("send");
        let mut woken = false;
        while !woken {
            // Only the sender is polled; the receiver sleeps on its fd.
            a.poll(&mut ae).expect("poll a");
            poll.poll(&mut events, Some(Duration::from_millis(20)))
                .expect("poll");
            woken = !events.is_empty();
            assert!(start.elapsed() < DEADLINE, "the wait fd never woke");
        }
        be.clear();
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| !frames_from(be, pa).is_empty(),
            "the announced frame",
        );
        assert_eq!(payload_of(&frames_from(&be, pa)[0]), b"wake up");
    }

    /// More frames than receives posted, so receive slots are reposted; a
    /// window keeps the sender within the receiver's posted buffers (DGRAM
    /// would drop the excess otherwise).
    pub fn many_frames(kind: EpKind, provider: &str, extra: &[(&str, &str)]) {
        let Some((mut a, mut b)) = pair(kind, provider, extra) else {
            return;
        };
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        let total = RX_DEPTH * 6;
        let window = RX_DEPTH / 2;
        let mut sent = 0;
        let start = Instant::now();
        while frames_from(&be, pa).len() < total {
            while sent < total && sent - frames_from(&be, pa).len() < window {
                let payload = format!("frame {sent:05} {}", "x".repeat(sent * 7 % 300));
                send_blocking(
                    &mut a,
                    &mut b,
                    pb,
                    frame(payload.as_bytes()),
                    &mut ae,
                    &mut be,
                );
                sent += 1;
            }
            a.poll(&mut ae).unwrap();
            b.poll(&mut be).unwrap();
            assert!(
                start.elapsed() < DEADLINE,
                "received {} of {total}",
                frames_from(&be, pa).len()
            );
        }
        let got: Vec<String> = frames_from(&be, pa)
            .iter()
            .map(|f| String::from_utf8(payload_of(f).to_vec()).unwrap())
            .collect();
        let expected: Vec<String> = (0..total)
            .map(|i| format!("frame {i:05} {}", "x".repeat(i * 7 % 300)))
            .collect();
        if a.sas_granted() {
            assert_eq!(got, expected, "SAS granted but frames arrived out of order");
        } else {
            let got: HashSet<_> = got.into_iter().collect();
            let expected: HashSet<_> = expected.into_iter().collect();
            assert_eq!(got, expected);
        }
        assert_eq!(b.stats().received as usize, total);
        assert_eq!(b.stats().malformed, 0);
        // Every send completed: nothing is left queued.
        let start = Instant::now();
        while a.queued_bytes(pb) > 0 {
            a.poll(&mut ae).unwrap();
            b.poll(&mut be).unwrap();
            assert!(start.elapsed() < DEADLINE, "sends never completed");
        }
    }

    pub fn max_size_and_too_large(kind: EpKind, provider: &str, extra: &[(&str, &str)]) {
        let Some((mut a, mut b)) = pair(kind, provider, extra) else {
            return;
        };
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        let max = a.max_frame();
        assert_eq!(max, a.link().max_frame);
        assert!(max >= 1000, "max_frame {max}");
        if kind == EpKind::Dgram {
            // The provider's datagram limit bounds the frame, prefix counted.
            assert!((max as u64) < a.link().max_msg_size);
        }
        let big: Vec<u8> = (0..max - 4).map(|i| (i * 31 % 251) as u8).collect();
        a.send(pb, frame(&big))
            .unwrap_or_else(|e| panic!("send: {e}"));
        b.send(pa, frame(&big))
            .unwrap_or_else(|e| panic!("send: {e}"));
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |ae, be| !frames_from(ae, pb).is_empty() && !frames_from(be, pa).is_empty(),
            "max-size frames",
        );
        assert_eq!(payload_of(&frames_from(&be, pa)[0]), &big[..]);
        assert_eq!(payload_of(&frames_from(&ae, pb)[0]), &big[..]);

        let too_big = vec![0u8; max - 3];
        match a.send(pb, frame(&too_big)) {
            Err(SendError::TooLarge { len, max: m }) => {
                assert_eq!((len, m), (max + 1, max));
            }
            Ok(()) => panic!("a frame above max_frame was sent"),
            Err(other) => panic!("expected TooLarge, got {other}"),
        }
        // A frame whose length prefix lies is refused at the sender.
        let lying = OutFrame::whole(Bytes::from_static(&[9, 0, 0, 0, 1, 2]));
        assert!(matches!(a.send(pb, lying), Err(SendError::Transport(_))));
    }

    /// Two RDM endpoints with rendezvous up to `max_frame`, inserted into
    /// each other with the limits a session would set: the eager limit
    /// each side's buffers hold, rendezvous above it.
    #[allow(clippy::type_complexity)]
    fn rendezvous_pair(
        provider: &str,
        extra: &[(&str, &str)],
        max_frame: usize,
    ) -> Option<(FabricEndpoint, FabricEndpoint, PeerId, PeerId)> {
        let t = transport(EpKind::Rdm, provider);
        let cfg = EndpointConfig {
            max_frame,
            ..config(provider, extra)
        };
        let (mut a, mut b) = match (t.open_fabric(&cfg), t.open_fabric(&cfg)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(TransportError::Unavailable { reason, .. }), _) => {
                assert!(!fabric_required(), "{provider} unavailable: {reason}");
                eprintln!("skipping: provider {provider} unavailable: {reason}");
                return None;
            }
            (Err(err), _) | (_, Err(err)) => panic!("opening {provider} endpoints: {err}"),
        };
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        allow_rendezvous((&mut a, &mut b), (pb, pa));
        Some((a, b, pb, pa))
    }

    /// Lets `a` and `b` (each other's `pb` and `pa`) send each other
    /// frames up to their rendezvous limits.
    fn allow_rendezvous(
        (a, b): (&mut FabricEndpoint, &mut FabricEndpoint),
        (pb, pa): (PeerId, PeerId),
    ) {
        for (endpoint, peer) in [(a, pb), (b, pa)] {
            let eager = endpoint.max_frame();
            endpoint.set_peer_frame_limit(peer, eager);
            endpoint.set_peer_rendezvous(peer, endpoint.rendezvous_max());
        }
    }

    /// An authenticated peer's own frames that say what they may not (a
    /// descriptor cut short, over the link's limits or lying about its
    /// length, a done frame for a transfer never sent, an unknown kind, any
    /// on a link without rendezvous) end the link with the reason and are
    /// counted as malformed; nothing is read or delivered.
    pub fn hostile_endpoint_frames_end_the_link(provider: &str) {
        use efabus_transports::fabric::layout::{rma_done, RmaDescriptor, RMA_DESCRIPTOR_KIND};
        let descriptor = |body_len: u64, head: &[u8]| {
            RmaDescriptor {
                id: 7,
                addr: 0,
                key: 0,
                body_len,
            }
            .encode(head)
        };
        let framed = |kind: u8, rest: &[u8]| {
            let mut bytes = ((rest.len() + 1) as u32).to_le_bytes().to_vec();
            bytes.push(kind);
            bytes.extend_from_slice(rest);
            Bytes::from(bytes)
        };
        let mut lying_head = 100u32.to_le_bytes().to_vec();
        lying_head.extend_from_slice(&[1; 12]);
        let cases: Vec<(&str, Bytes, bool, &str)> = vec![
            (
                "cut short",
                framed(RMA_DESCRIPTOR_KIND, &[0; 20]),
                true,
                "malformed rendezvous descriptor",
            ),
            (
                "no body",
                descriptor(0, &[]),
                true,
                "offered a rendezvous frame of 0 + 0",
            ),
            (
                "over the limit",
                descriptor(1 << 40, &[]),
                true,
                "over the link's",
            ),
            (
                "a long head",
                descriptor(16, &[0; 5000]),
                true,
                "inline bytes",
            ),
            (
                "a lying head",
                descriptor(1000, &lying_head),
                true,
                "declaring 100 bytes",
            ),
            (
                "an unknown done",
                rma_done(12345),
                true,
                "which it was not sent",
            ),
            (
                "a malformed fence",
                framed(0xf2, &[0; 3]),
                true,
                "malformed rendezvous fence",
            ),
            (
                "an unknown kind",
                framed(0xf7, &[0; 8]),
                true,
                "unknown kind",
            ),
            (
                "without rendezvous",
                descriptor(1000, &[]),
                false,
                "without rendezvous",
            ),
        ];
        for (case, bad, rendezvous, reason) in cases {
            let Some((mut a, mut b, pb, pa)) = rendezvous_pair(provider, &[], 1 << 20) else {
                return;
            };
            if !rendezvous {
                b.set_peer_rendezvous(pa, 0);
            }
            // Twice before a poll, so both travel in one message: the
            // first ends the link, and the second is neither read nor
            // counted.
            a.send_endpoint_frame(pb, bad.clone()).expect("sent");
            a.send_endpoint_frame(pb, bad).expect("sent");
            assert_eq!(a.stats().packed, 1, "{provider}, {case}: one message");
            let (mut ae, mut be) = (Vec::new(), Vec::new());
            pump(
                &mut a,
                &mut b,
                &mut ae,
                &mut be,
                |_, be| {
                    be.iter()
                        .any(|e| matches!(e, Event::Closed { peer, .. } if *peer == pa))
                },
                case,
            );
            let closed = be.iter().find_map(|e| match e {
                Event::Closed { peer, reason } if *peer == pa => Some(reason.to_string()),
                _ => None,
            });
            assert!(
                closed.as_deref().is_some_and(|text| text.contains(reason)),
                "{provider}, {case}: closed with {closed:?}, not {reason:?}"
            );
            assert_eq!(b.stats().malformed, 1, "{provider}, {case}");
            assert!(frames_from(&be, pa).is_empty(), "{provider}, {case}");
            assert_eq!(b.stats().rendezvous_read, 0, "{provider}, {case}");
        }
    }

    /// A frame of `len` bytes (length prefix included) whose bytes say
    /// which frame `n` it is: a head of 16 bytes, as a message header is
    /// small, and the rest in its body.
    fn numbered_frame(n: u8, len: usize) -> OutFrame {
        let mut bytes = ((len - 4) as u32).to_le_bytes().to_vec();
        bytes.extend((0..len - 4).map(|i| (i as u8) ^ n));
        let mut body = Bytes::from(bytes);
        let head = body.split_to(16.min(len));
        OutFrame { head, body }
    }

    fn is_numbered(frame: &[u8], n: u8, len: usize) -> bool {
        frame.len() == len
            && payload_of(frame)
                .iter()
                .enumerate()
                .all(|(i, &byte)| byte == (i as u8) ^ n)
    }

    /// Sends frame `n` of `sizes[n]` bytes for each `n`, numbered.
    fn send_numbered(
        (a, b): (&mut FabricEndpoint, &mut FabricEndpoint),
        to: PeerId,
        sizes: &[usize],
        (ae, be): (&mut Vec<Event>, &mut Vec<Event>),
    ) {
        for (n, &len) in sizes.iter().enumerate() {
            send_blocking(a, b, to, numbered_frame(n as u8, len), ae, be);
        }
    }

    /// [`rendezvous_pair`], `None` also where the provider has no
    /// rendezvous.
    #[allow(clippy::type_complexity)]
    fn rma_pair(
        provider: &str,
        max_frame: usize,
    ) -> Option<(FabricEndpoint, FabricEndpoint, PeerId, PeerId)> {
        rendezvous_pair(provider, &[], max_frame).filter(|(a, ..)| a.rendezvous_max() > 0)
    }

    /// Polls `a` and `b` until `done` holds, within [`DEADLINE`] (`what`:
    /// what never happened).
    fn poll_until(
        (a, b): (&mut FabricEndpoint, &mut FabricEndpoint),
        (ae, be): (&mut Vec<Event>, &mut Vec<Event>),
        what: &str,
        mut done: impl FnMut(&FabricEndpoint, &FabricEndpoint, &[Event]) -> bool,
    ) {
        let start = Instant::now();
        while !done(a, b, be) {
            a.poll(ae).expect("poll a");
            b.poll(be).expect("poll b");
            assert!(start.elapsed() < DEADLINE, "{what}");
        }
    }

    /// Two RDM endpoints with rendezvous ([`rma_pair`]), their events,
    /// and a read of `b`'s in flight of each frame `a` sent it.
    struct Stalled {
        a: FabricEndpoint,
        b: FabricEndpoint,
        pb: PeerId,
        pa: PeerId,
        ae: Vec<Event>,
        be: Vec<Event>,
    }

    /// [`rma_pair`] where `a` has sent `b` numbered frames of `sizes`, all
    /// by rendezvous, and both were polled until `b` started a read for
    /// each; `a` is polled no more after that, so where the sender's
    /// progress serves a read (`tcp;ofi_rxm`) the reads stay in flight.
    fn stalled_reads(provider: &str, max_frame: usize, sizes: &[usize]) -> Option<Stalled> {
        stalled(provider, max_frame, |a, b, pb, ae, be| {
            send_numbered((a, b), pb, sizes, (ae, be));
            sizes.len() as u64
        })
    }

    /// [`rma_pair`] where `a` sent `b` what `send` sends (returning how many
    /// frames), and both were polled until `b` started a read for each.
    fn stalled(
        provider: &str,
        max_frame: usize,
        send: impl FnOnce(
            &mut FabricEndpoint,
            &mut FabricEndpoint,
            PeerId,
            &mut Vec<Event>,
            &mut Vec<Event>,
        ) -> u64,
    ) -> Option<Stalled> {
        let (mut a, mut b, pb, pa) = rma_pair(provider, max_frame)?;
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        let started =
            b.stats().rendezvous_reads_started + send(&mut a, &mut b, pb, &mut ae, &mut be);
        poll_until(
            (&mut a, &mut b),
            (&mut ae, &mut be),
            &format!("{provider}: the reads never started"),
            |_, b, _| b.stats().rendezvous_reads_started >= started,
        );
        Some(Stalled {
            a,
            b,
            pb,
            pa,
            ae,
            be,
        })
    }

    /// Asserts that `be` holds every numbered frame of `sizes` from `from`,
    /// whole.
    fn assert_numbered(be: &[Event], from: PeerId, sizes: &[usize], what: &str) {
        let got = frames_from(be, from);
        for (n, &len) in sizes.iter().enumerate() {
            assert!(
                got.iter().any(|f| is_numbered(f, n as u8, len)),
                "{what}: frame {n} of {len} bytes missing or damaged"
            );
        }
    }

    /// Frames at the eager limit and one byte either side, and far above
    /// it, cross whole: those above by rendezvous (counted on both sides),
    /// the others eagerly; every registration is released once read. The
    /// sender keeps no handle on what it sent. Returns without testing on
    /// a provider without rendezvous, after checking it offers none.
    pub fn rendezvous_moves_large_frames(provider: &str, extra: &[(&str, &str)]) {
        let Some((mut a, mut b, pb, pa)) = rendezvous_pair(provider, extra, 4 << 20) else {
            return;
        };
        if provider.contains("ofi_rxd") {
            assert_eq!(a.rendezvous_max(), 0, "ofi_rxd's reads are not used");
            return;
        }
        let eager = a.max_frame();
        assert!(a.rendezvous_max() >= 4 << 20, "{}", a.rendezvous_max());
        let sizes = [eager - 1, eager, eager + 1, 3 * eager + 7, 1 << 20, 4 << 20];
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        send_numbered((&mut a, &mut b), pb, &sizes, (&mut ae, &mut be));
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| frames_from(be, pa).len() == sizes.len(),
            "every frame",
        );
        assert_numbered(&be, pa, &sizes, provider);
        let above = sizes.iter().filter(|&&len| len > eager).count() as u64;
        assert_eq!(a.stats().rendezvous_sent, above);
        assert_eq!(b.stats().rendezvous_read, above);
        assert_eq!(
            a.stats().rendezvous_registrations + a.stats().rendezvous_shared,
            above
        );
        // Done frames release the registrations.
        until_released(&mut a, &mut b, &mut ae, &mut be, "done frames");
        assert_eq!(a.stats().rendezvous_abandoned, 0);
    }

    /// Reads of a peer whose reads are held wait, queued, however often
    /// the receiver polls; released, they start and the frames arrive
    /// whole, in order. Held again and then closed, the peer's reads are
    /// given up, and counted as such.
    pub fn held_reads_wait_for_their_release(provider: &str) {
        let Some((mut a, mut b, pb, pa)) = rendezvous_pair(provider, &[], 4 << 20) else {
            return;
        };
        if a.rendezvous_max() == 0 {
            return;
        }
        let sizes = [a.max_frame() + 1, 1 << 20];
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        offer_held((&mut a, &mut b), (pb, pa), &sizes, (&mut ae, &mut be));
        assert!(frames_from(&be, pa).is_empty(), "{provider}");
        b.hold_reads(pa, false);
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| frames_from(be, pa).len() == sizes.len(),
            "the frames, once released",
        );
        assert_numbered(&be, pa, &sizes, provider);
        offer_held((&mut a, &mut b), (pb, pa), &sizes, (&mut ae, &mut be));
        b.close(pa);
        assert_eq!(b.rendezvous_queued(), (0, 0), "{provider}");
        assert_eq!(b.stats().rendezvous_reads_given_up, 2, "{provider}");
        assert_eq!(b.stats().rendezvous_read, 2, "{provider}: the first two");
    }

    /// Has `a` offer frames of `sizes` to a `b` that holds `a`'s reads,
    /// and polls both until the descriptors are in: their reads queued,
    /// none started.
    fn offer_held(
        (a, b): (&mut FabricEndpoint, &mut FabricEndpoint),
        (pb, pa): (PeerId, PeerId),
        sizes: &[usize],
        (ae, be): (&mut Vec<Event>, &mut Vec<Event>),
    ) {
        b.hold_reads(pa, true);
        let started = b.stats().rendezvous_reads_started;
        send_numbered((&mut *a, &mut *b), pb, sizes, (&mut *ae, &mut *be));
        let start = Instant::now();
        while b.rendezvous_queued().0 as u64 + b.stats().rendezvous_reads_started - started
            < sizes.len() as u64
        {
            a.poll(ae).expect("poll a");
            b.poll(be).expect("poll b");
            assert!(start.elapsed() < DEADLINE, "the descriptors never came");
        }
        for _ in 0..1000 {
            a.poll(ae).expect("poll a");
            b.poll(be).expect("poll b");
        }
        assert_eq!(b.stats().rendezvous_reads_started, started, "reads held");
    }

    /// A read in flight when the receiver closes its sender's link
    /// delivers nothing when it ends, and is counted given up. Returns
    /// whether the read was still in flight at the close (`None` when the
    /// provider has no rendezvous): over `shm` the receiver makes the copy
    /// itself and `sockets` progresses on a thread of its own, so the
    /// close's last progress may end it first.
    pub fn a_read_ending_after_its_link_closed_is_given_up(provider: &str) -> Option<bool> {
        let Stalled {
            mut a,
            mut b,
            pa,
            mut be,
            ..
        } = stalled_reads(provider, 4 << 20, &[1 << 20])?;
        // Where the sender's progress serves the read, it cannot end before
        // the close.
        b.close(pa);
        if b.stats().rendezvous_read == 1 {
            return Some(false);
        }
        assert_eq!(
            b.stats().rendezvous_reads_given_up,
            0,
            "{provider}: in flight"
        );
        until_counted(
            &mut a,
            &mut b,
            &mut be,
            |stats| stats.rendezvous_reads_given_up,
            &format!("{provider}: the read in flight"),
        );
        assert_eq!(b.stats().rendezvous_reads_given_up, 1, "{provider}");
        assert_eq!(b.stats().rendezvous_read, 0, "{provider}");
        assert!(
            frames_from(&be, pa).is_empty(),
            "{provider}: nothing delivered"
        );
        Some(true)
    }

    /// The descriptors waiting for their reads hold no more than the
    /// receiver's bound, all peers together: past it, the peer whose
    /// descriptors hold the most is cut off, its reads given up and
    /// counted, and the other peer's read goes on.
    pub fn queued_descriptors_are_bounded_across_peers(provider: &str) {
        let Some((mut a, mut b, pb, pa)) = rendezvous_pair(provider, &[], 4 << 20) else {
            return;
        };
        if a.rendezvous_max() == 0 {
            return;
        }
        let cfg = EndpointConfig {
            max_frame: 4 << 20,
            ..config(provider, &[])
        };
        let mut c = transport(EpKind::Rdm, provider)
            .open_fabric(&cfg)
            .expect("open a third endpoint");
        let (pb_from_c, pc) = insert_each_other(&mut c, &mut b);
        allow_rendezvous((&mut c, &mut b), (pb_from_c, pc));
        let size = a.max_frame() + 1;
        let (mut ae, mut be, mut ce) = (Vec::new(), Vec::new(), Vec::new());
        offer_held((&mut a, &mut b), (pb, pa), &[size; 3], (&mut ae, &mut be));
        let (queued, bytes) = b.rendezvous_queued();
        assert_eq!(queued, 3, "{provider}");
        // Room for a fourth descriptor's half: c's first one passes it.
        b.set_rendezvous_queued_max(bytes + bytes / 6);
        b.hold_reads(pc, true);
        send_numbered((&mut c, &mut b), pb_from_c, &[size], (&mut ce, &mut be));
        let a_closed = |be: &[Event]| {
            be.iter().find_map(|event| match event {
                Event::Closed { peer, reason } if *peer == pa => Some(reason.to_string()),
                _ => None,
            })
        };
        let start = Instant::now();
        while b.rendezvous_queued().0 == 3 {
            c.poll(&mut ce).expect("poll c");
            b.poll(&mut be).expect("poll b");
            assert!(
                start.elapsed() < DEADLINE,
                "{provider}: c's descriptor never came"
            );
        }
        let closed = a_closed(&be).unwrap_or_else(|| panic!("{provider}: a kept its reads"));
        assert!(
            closed.contains("rendezvous descriptors"),
            "{provider}: {closed}"
        );
        assert_eq!(b.stats().rendezvous_reads_given_up, 3, "{provider}");
        assert_eq!(b.rendezvous_queued().0, 1, "{provider}: c's read stays");
        b.hold_reads(pc, false);
        pump(
            &mut c,
            &mut b,
            &mut ce,
            &mut be,
            |_, be| !frames_from(be, pc).is_empty(),
            "c's frame",
        );
        assert_numbered(&be, pc, &[size], provider);
    }

    /// A poll starts no further rendezvous read once posting one took the
    /// slow-post time (a copy made inside `fi_read`). With zero, every
    /// poll starts at most one read, the endpoint does not wait while
    /// reads are still queued, and every frame still arrives whole; with
    /// no limit (`unlimited`, for a provider that takes every queued
    /// message in one poll), the reads of descriptors that arrived
    /// together all start in one poll.
    pub fn slow_read_posts_pace_reads(provider: &str, unlimited: bool) {
        const FRAMES: usize = 4;
        let len = 1 << 20;
        // No wait set: only queued work keeps `prepare_wait` from allowing
        // a wait.
        let extra = [("wait_fd", "false")];
        let Some((mut a, mut b, pb, pa)) = rendezvous_pair(provider, &extra, 2 << 20) else {
            return;
        };
        let (slow, most) = if unlimited {
            (Duration::MAX, FRAMES as u64)
        } else {
            (Duration::ZERO, 1)
        };
        b.set_slow_read_post(slow);
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        let sizes = [len; FRAMES];
        send_numbered((&mut a, &mut b), pb, &sizes, (&mut ae, &mut be));
        // The descriptors leave before `b` looks.
        a.poll(&mut ae).expect("poll a");
        assert_eq!(b.stats().rendezvous_reads_started, 0);
        let start = Instant::now();
        let mut most_in_one_poll = 0;
        let mut saw_reads_queued = false;
        while frames_from(&be, pa).len() < FRAMES {
            let before = b.stats().rendezvous_reads_started;
            b.poll(&mut be).expect("poll b");
            let started = b.stats().rendezvous_reads_started;
            most_in_one_poll = most_in_one_poll.max(started - before);
            if started > 0 && started < FRAMES as u64 {
                // Reads left for the next poll keep the owner polling.
                assert!(
                    !b.prepare_wait(),
                    "{provider}: would wait with reads queued"
                );
                saw_reads_queued = true;
            }
            a.poll(&mut ae).expect("poll a");
            assert!(
                start.elapsed() < DEADLINE,
                "{provider}: the frames never arrived"
            );
        }
        assert_eq!(
            most_in_one_poll, most,
            "{provider}: reads started in one poll"
        );
        assert_eq!(saw_reads_queued, !unlimited);
        assert_numbered(&be, pa, &sizes, provider);
        assert_eq!(b.stats().rendezvous_reads_started, FRAMES as u64);
        until_released(&mut a, &mut b, &mut ae, &mut be, "done frames");
    }

    /// Polls both until `a` holds no rendezvous transfer.
    fn until_released(
        a: &mut FabricEndpoint,
        b: &mut FabricEndpoint,
        ae: &mut Vec<Event>,
        be: &mut Vec<Event>,
        what: &str,
    ) {
        let start = Instant::now();
        while a.rendezvous_held() != (0, 0) {
            a.poll(ae).expect("poll a");
            b.poll(be).expect("poll b");
            assert!(start.elapsed() < DEADLINE, "never released: {what}");
        }
    }

    /// One 64 MiB frame crosses whole, its body registered once and
    /// released after.
    pub fn rendezvous_moves_64_mib(provider: &str) {
        let len = 64 << 20;
        let Some((mut a, mut b, pb, pa)) = rendezvous_pair(provider, &[], len + 4096) else {
            return;
        };
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        send_blocking(&mut a, &mut b, pb, numbered_frame(7, len), &mut ae, &mut be);
        assert_eq!(a.rendezvous_held(), (1, len - 16), "the body is registered");
        receive_numbered(&mut a, &mut b, &mut ae, &mut be, pa, 7, len);
        until_released(&mut a, &mut b, &mut ae, &mut be, "its done frame");
    }

    /// Polls both until `b` has a frame from `pa`, and checks it is frame
    /// `n` of `len` bytes.
    fn receive_numbered(
        a: &mut FabricEndpoint,
        b: &mut FabricEndpoint,
        ae: &mut Vec<Event>,
        be: &mut Vec<Event>,
        pa: PeerId,
        n: u8,
        len: usize,
    ) {
        let what = format!("frame {n} of {len} bytes");
        pump(a, b, ae, be, |_, be| !frames_from(be, pa).is_empty(), &what);
        assert!(is_numbered(&frames_from(be, pa)[0], n, len), "{what}");
    }

    /// Reads `provider`'s receiver started into huge pages for one frame
    /// of 1 MiB, with the endpoints opened with `extra`; `None` when the
    /// provider cannot open here.
    pub fn huge_landings_of_a_mebibyte_frame(
        provider: &str,
        extra: &[(&str, &str)],
    ) -> Option<u64> {
        let len = 1 << 20;
        let (mut a, mut b, pb, pa) = rendezvous_pair(provider, extra, len + 4096)?;
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        send_blocking(&mut a, &mut b, pb, numbered_frame(5, len), &mut ae, &mut be);
        receive_numbered(&mut a, &mut b, &mut ae, &mut be, pa, 5, len);
        assert_eq!(b.stats().rendezvous_read, 1);
        Some(b.stats().rendezvous_huge_landed)
    }

    /// The same body sent to two peers is registered once.
    pub fn rendezvous_shares_one_registration(provider: &str) {
        let Some((mut a, mut b, pb, pa)) = rendezvous_pair(provider, &[], 1 << 20) else {
            return;
        };
        let Some((mut c, _, _, _)) = rendezvous_pair(provider, &[], 1 << 20) else {
            return;
        };
        let (a_keys, c_keys) = link_keys();
        let pc = a.insert_peer(&c.local_addr(), &a_keys).expect("insert c");
        let pa_at_c = c.insert_peer(&a.local_addr(), &c_keys).expect("insert a");
        for (endpoint, peer) in [(&mut a, pc), (&mut c, pa_at_c)] {
            let eager = endpoint.max_frame();
            endpoint.set_peer_frame_limit(peer, eager);
            endpoint.set_peer_rendezvous(peer, endpoint.rendezvous_max());
        }
        let out = numbered_frame(3, 512 << 10);
        a.send(pb, out.clone()).expect("send to b");
        a.send(pc, out).expect("send to c");
        assert_eq!(a.stats().rendezvous_registrations, 1);
        assert_eq!(a.stats().rendezvous_shared, 1);
        assert_eq!(a.rendezvous_held().0, 2);
        // What monitoring reports: one registration, shared once; two
        // addresses in use.
        let counts = a.rendezvous_counts();
        assert_eq!(
            (counts.registrations, counts.cache_hits, counts.registered),
            (1, 1, 1)
        );
        assert_eq!(counts.registered_bytes, a.rendezvous_held().1 as u64);
        assert!(counts.registered_bytes > 500 << 10, "{counts:?}");
        let fabric = a.fabric_counts();
        assert_eq!(fabric.addresses, 2, "{fabric:?}");
        assert!(fabric.address_capacity >= 2, "{fabric:?}");
        let (mut be, mut ce) = (Vec::new(), Vec::new());
        let start = Instant::now();
        while frames_from(&be, pa).is_empty() || frames_from(&ce, pa_at_c).is_empty() {
            a.poll(&mut Vec::new()).expect("poll a");
            b.poll(&mut be).expect("poll b");
            c.poll(&mut ce).expect("poll c");
            assert!(start.elapsed() < DEADLINE, "fan-out never arrived");
        }
        assert!(is_numbered(&frames_from(&be, pa)[0], 3, 512 << 10));
        assert!(is_numbered(&frames_from(&ce, pa_at_c)[0], 3, 512 << 10));
        while a.rendezvous_held() != (0, 0) {
            a.poll(&mut Vec::new()).expect("poll a");
            b.poll(&mut be).expect("poll b");
            c.poll(&mut ce).expect("poll c");
            assert!(start.elapsed() < DEADLINE, "registration never released");
        }
        let counts = a.rendezvous_counts();
        assert_eq!((counts.registered, counts.registered_bytes), (0, 0));
    }

    /// Both sides send large frames, each followed by a small one, to each
    /// other at once through only 4 send slots each, so done frames
    /// compete with descriptors and data for slots: every frame arrives
    /// intact and every registration is released.
    pub fn rendezvous_both_ways_with_few_send_slots(provider: &str) {
        let extra = [("tx_depth", "4")];
        let Some((mut a, mut b, pb, pa)) = rendezvous_pair(provider, &extra, 1 << 20) else {
            return;
        };
        let count = 80u8;
        let size = |n: u8| if n % 2 == 0 { 100 << 10 } else { 1000 };
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        let mut to_b: Vec<OutFrame> = (0..count).map(|n| numbered_frame(n, size(n))).collect();
        let mut to_a: Vec<OutFrame> = (0..count).map(|n| numbered_frame(n, size(n))).collect();
        to_b.reverse();
        to_a.reverse();
        let start = Instant::now();
        // Sends handed back to the callers: the endpoint's own done frames
        // wait for slots too, retried at every poll, and must not be
        // counted as refused sends. (Over `sockets` here thousands of done
        // frames waited in each run, and the counts differed by as many.)
        let mut refused = [0u64; 2];
        while !to_b.is_empty() || !to_a.is_empty() {
            for (side, (from, to, queue)) in [(&mut a, pb, &mut to_b), (&mut b, pa, &mut to_a)]
                .into_iter()
                .enumerate()
            {
                if let Some(out) = queue.pop() {
                    match from.send(to, out) {
                        Ok(()) => {}
                        Err(SendError::WouldBlock(back)) => {
                            refused[side] += 1;
                            queue.push(back);
                        }
                        Err(err) => panic!("send: {err}"),
                    }
                }
            }
            a.poll(&mut ae).expect("poll a");
            b.poll(&mut be).expect("poll b");
            assert!(start.elapsed() < DEADLINE, "sends stayed blocked");
        }
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |ae, be| {
                frames_from(ae, pb).len() == count as usize
                    && frames_from(be, pa).len() == count as usize
            },
            "every frame both ways",
        );
        for got in [frames_from(&ae, pb), frames_from(&be, pa)] {
            for n in 0..count {
                assert!(got.iter().any(|f| is_numbered(f, n, size(n))), "frame {n}");
            }
        }
        until_released(&mut a, &mut b, &mut ae, &mut be, "a's transfers");
        until_released(&mut b, &mut a, &mut be, &mut ae, "b's transfers");
        assert_eq!(a.stats().rendezvous_read, count as u64 / 2);
        assert_eq!(b.stats().rendezvous_read, count as u64 / 2);
        assert_eq!(a.fabric_counts().queue_full, refused[0], "{provider}: a");
        assert_eq!(b.fabric_counts().queue_full, refused[1], "{provider}: b");
    }

    /// Ends the test process, saying `what`, unless dropped within `after`:
    /// for a test that may hang inside libfabric, where no deadline of its
    /// own can end it.
    struct Watchdog(std::sync::Arc<std::sync::atomic::AtomicBool>);

    impl Watchdog {
        fn arm(after: Duration, what: &'static str) -> Watchdog {
            let disarmed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let watched = disarmed.clone();
            std::thread::spawn(move || {
                std::thread::sleep(after);
                if !watched.load(std::sync::atomic::Ordering::Acquire) {
                    eprintln!("{what} within {after:?}");
                    std::process::exit(1);
                }
            });
            Watchdog(disarmed)
        }
    }

    impl Drop for Watchdog {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// `shm` names an endpoint after the process, the user and the
    /// endpoint's index, so one peer's address may be longer than the
    /// other's, and each message carries its sender's. A frame at the
    /// negotiated limit from the sender with the longer name and the larger
    /// buffers must still fit the other's posted receive whole.
    pub fn shm_sender_with_a_longer_name_fits_the_receivers_buffers() {
        let t = transport(EpKind::Rdm, "shm");
        let Some((_, mut b)) = pair(EpKind::Rdm, "shm", &[]) else {
            return;
        };
        let larger = config("shm", &[("msg_size", "65536")]);
        // Each endpoint of the process takes the next index, which ends
        // its name: open until one has a name longer than b's (the index
        // gains a digit), at most as many as that takes (other tests open
        // endpoints meanwhile, which only shortens the way).
        let name = String::from_utf8_lossy(&b.local_addr()).to_string();
        let index: u64 = name
            .trim_end_matches('\0')
            .rsplit(':')
            .next()
            .and_then(|index| index.parse().ok())
            .unwrap_or_else(|| panic!("no endpoint index at the end of {name:?}"));
        let opens = 10u64.pow(index.checked_ilog10().unwrap_or(0) + 1) - index;
        let mut a = None;
        for _ in 0..opens {
            let candidate = t.open_fabric(&larger).expect("open shm");
            if candidate.local_addr().len() > b.local_addr().len() {
                a = Some(candidate);
                break;
            }
        }
        let mut a = a.unwrap_or_else(|| {
            panic!("no shm endpoint with a longer name than {name:?} in {opens} opens")
        });
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        // As a link does: both sides limited to the smaller of the two.
        let limit = a.max_frame().min(b.max_frame());
        a.set_peer_frame_limit(pb, limit);
        b.set_peer_frame_limit(pa, limit);
        let payload = vec![0x6Bu8; limit - 4];
        // libfabric 1.17's `shm` hangs in the receiver's poll on a message
        // longer than the posted receive: no deadline in this thread would
        // end the test then. The watchdog is disarmed when the test ends,
        // by a panic too.
        let watchdog = Watchdog::arm(2 * DEADLINE, "the receiver's poll never returned");
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        send_blocking(&mut a, &mut b, pb, frame(&payload), &mut ae, &mut be);
        let start = Instant::now();
        while frames_from(&be, pa).is_empty() && b.stats().rx_errors == 0 {
            a.poll(&mut ae).expect("poll a");
            b.poll(&mut be).expect("poll b");
            assert!(
                start.elapsed() < DEADLINE,
                "the frame at the limit never came"
            );
        }
        drop(watchdog);
        assert_eq!(b.stats().rx_errors, 0, "{:?}", b.stats());
        assert_eq!(payload_of(&frames_from(&be, pa)[0]), &payload[..]);
    }

    /// A `shm` peer in this process whose endpoint closes: sending to it
    /// ends its link with the reason instead of reaching into its region,
    /// which went with it.
    pub fn closed_in_process_shm_peer_ends_its_link() {
        let Some((mut a, b)) = pair(EpKind::Rdm, "shm", &[]) else {
            return;
        };
        let mut b = b;
        let (pb, _) = insert_each_other(&mut a, &mut b);
        drop(b);
        let mut events = Vec::new();
        // The frame waits for the next poll, which finds the peer gone.
        let _ = a.send(pb, frame(b"to nobody"));
        let start = Instant::now();
        loop {
            a.poll(&mut events).expect("poll");
            let closed = events.iter().find_map(|e| match e {
                Event::Closed { peer, reason } if *peer == pb => Some(reason.clone()),
                _ => None,
            });
            if let Some(reason) = closed {
                assert!(
                    matches!(&reason, CloseReason::Error(text) if text.contains("closed")),
                    "{reason:?}"
                );
                break;
            }
            assert!(start.elapsed() < DEADLINE, "the link was never ended");
        }
        assert!(matches!(
            a.send(pb, frame(b"again")),
            Err(SendError::Closed(_))
        ));
    }

    /// A read whose sender stopped serving it (a process suspended, one
    /// that never polls) and whose link then closed does not hold up the
    /// reads of anyone else: one of 120 MiB held most of what the endpoint
    /// reads at once (128 MiB), and a second peer's 16 MiB frame waited
    /// behind it for as long as it lived.
    pub fn a_read_of_a_closed_link_does_not_hold_up_others(provider: &str) {
        let Some(Stalled {
            mut b, pa, mut be, ..
        }) = stalled_reads(provider, 128 << 20, &[120 << 20])
        else {
            return;
        };
        b.close(pa);
        if b.stats().rendezvous_reads_given_up > 0 {
            return; // the provider ended it within the close: nothing held
        }
        let mut c = transport(EpKind::Rdm, provider)
            .open_fabric(&EndpointConfig {
                max_frame: 128 << 20,
                ..config(provider, &[])
            })
            .expect("open c");
        let (pb_at_c, pc) = insert_each_other(&mut c, &mut b);
        allow_rendezvous((&mut c, &mut b), (pb_at_c, pc));
        let mut ce = Vec::new();
        send_numbered((&mut c, &mut b), pb_at_c, &[16 << 20], (&mut ce, &mut be));
        poll_until(
            (&mut c, &mut b),
            (&mut ce, &mut be),
            &format!("{provider}: the second peer's frame waited behind the closed link's read"),
            |_, _, be| !frames_from(be, pc).is_empty(),
        );
        assert_numbered(&be, pc, &[16 << 20], provider);
    }

    /// An endpoint closed while reads of its peer's frames are in flight
    /// that the peer never serves (it stopped polling) does not crash the
    /// process: over `tcp;ofi_rxm` with two such reads libfabric 1.17
    /// crashed inside `fi_close`, so the endpoint is left open instead.
    pub fn closing_with_reads_never_served_does_not_crash(provider: &str) {
        let Some(Stalled { a, mut b, .. }) = stalled_reads(provider, 16 << 20, &[8 << 20, 8 << 20])
        else {
            return;
        };
        // The reads cannot end.
        assert_eq!(b.stats().rendezvous_read, 0, "{provider}");
        assert_eq!(b.drain_for_close(), 2, "{provider}: left open");
        drop(b);
        drop(a);
    }

    /// Reads whose peer served them before the close, their completions
    /// still queued, end in the close's drain: the endpoint is closed,
    /// not left open with its memory.
    pub fn closing_with_reads_served_closes(provider: &str) {
        let Some(Stalled {
            mut a,
            mut b,
            mut ae,
            ..
        }) = stalled_reads(provider, 16 << 20, &[1 << 20])
        else {
            return;
        };
        // `a` serves the read; `b` does not poll its completion.
        for _ in 0..2000 {
            a.poll(&mut ae).expect("poll a");
        }
        assert_eq!(b.drain_for_close(), 0, "{provider}: left open");
    }

    /// A transfer whose link closes before the peer's done keeps its body
    /// a while: the peer may still be reading it (over `shm` it reads this
    /// process's memory itself; over `tcp;ofi_rxm` the provider serves a
    /// read already asked for from that memory), and must not read memory
    /// put to another use. (It was let go of at once.)
    pub fn an_abandoned_transfer_keeps_its_body(provider: &str) {
        let Some((mut a, mut b, pb, pa)) = rma_pair(provider, 2 << 20) else {
            return;
        };
        let len = 1 << 20;
        let dropped = Arc::new(AtomicBool::new(false));
        let frame = tracked_frame(len, 9, &dropped);
        b.hold_reads(pa, true);
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        send_blocking(&mut a, &mut b, pb, frame, &mut ae, &mut be);
        poll_until(
            (&mut a, &mut b),
            (&mut ae, &mut be),
            &format!("{provider}: the descriptor never came"),
            |_, b, _| b.rendezvous_queued().0 > 0,
        );
        a.close(pb);
        assert_eq!(a.stats().rendezvous_abandoned, 1, "{provider}");
        assert_eq!(
            a.rendezvous_held(),
            (0, 0),
            "{provider}: registration released"
        );
        assert_eq!(a.rendezvous_abandoned_kept(), (1, len - 16), "{provider}");
        assert!(
            !dropped.load(Ordering::SeqCst),
            "{provider}: the body was let go of"
        );
    }

    /// A reader that sends its done before its read has finished (as a
    /// peer holding the link's keys could) does not have the body let go
    /// of while `tcp;ofi_rxm`, which serves the read in the sender's
    /// progress, still sends it from that memory: the fence frame the done
    /// is answered with goes out behind the read's bytes, and the body
    /// goes when it has. (It was let go of at the done: memory put to
    /// another use by then would have been sent as the rest of the read.)
    pub fn an_early_done_does_not_free_a_body_being_read() {
        use efabus_transports::fabric::layout::rma_done;
        let len = 32 << 20;
        let Some((
            Stalled {
                mut a,
                mut b,
                pa,
                mut ae,
                mut be,
                ..
            },
            dropped,
        )) = stalled_read(len, 9)
        else {
            return;
        };
        // The first transfer's id is 1; `b` reads no more for now (the
        // provider's progress is manual: it moves only in `b`'s calls).
        b.send_endpoint_frame(pa, rma_done(1))
            .expect("the early done");
        b.flush();
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(300) {
            a.poll(&mut ae).expect("poll a");
        }
        assert!(
            !dropped.load(Ordering::SeqCst),
            "the body was let go of while being read"
        );
        assert_eq!(a.rendezvous_held().0, 1, "still registered");
        poll_until(
            (&mut a, &mut b),
            (&mut ae, &mut be),
            "the body was never let go of",
            |_, _, _| dropped.load(Ordering::SeqCst),
        );
        // The last bytes may still wait in `b`'s socket.
        poll_until(
            (&mut a, &mut b),
            (&mut ae, &mut be),
            "the frame was not read whole",
            |_, _, be| {
                frames_from(be, pa)
                    .iter()
                    .any(|f| f.len() == len && f[16..].iter().all(|&byte| byte == 9))
            },
        );
    }

    /// A link closed while its peer's read is still being served (the
    /// reader stopped reading its socket) keeps the body until a fence
    /// sent behind the read is out, however long, not for a time:
    /// `ofi_rxm` keeps its connection after the link is gone and would
    /// send the rest of the read from that memory whenever the reader read
    /// on. (The body went after 15 s, reused memory or not.)
    pub fn a_closed_link_s_body_waits_for_its_fence() {
        let len = 32 << 20;
        let Some((
            Stalled {
                mut a,
                mut b,
                pb,
                mut ae,
                mut be,
                ..
            },
            dropped,
        )) = stalled_read(len, 5)
        else {
            return;
        };
        // `b` reads no more for now; `a` closes the link.
        a.close(pb);
        let closed = Instant::now();
        assert_eq!(a.rendezvous_abandoned_kept(), (1, len - 16));
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(300) {
            a.poll(&mut ae).expect("poll a");
        }
        assert!(
            !dropped.load(Ordering::SeqCst),
            "let go of while being read"
        );
        // `b` reads on: once the read's bytes are out, so is the fence.
        poll_until(
            (&mut a, &mut b),
            (&mut ae, &mut be),
            "the body was kept after its fence went",
            |_, _, _| dropped.load(Ordering::SeqCst),
        );
        assert_eq!(a.rendezvous_abandoned_kept(), (0, 0));
        // By the fence, not by the 15 s that bodies without one are kept.
        assert!(
            closed.elapsed() < Duration::from_secs(15),
            "let go of by time"
        );
    }

    /// [`stalled_reads`] over `tcp;ofi_rxm` of one frame of `len` bytes,
    /// its body all `fill`, and the flag set when `a` lets the body go.
    fn stalled_read(len: usize, fill: u8) -> Option<(Stalled, Arc<AtomicBool>)> {
        let provider = "tcp;ofi_rxm";
        let dropped = Arc::new(AtomicBool::new(false));
        let frame = tracked_frame(len, fill, &dropped);
        let stalled = stalled(provider, len + (1 << 20), |a, b, pb, ae, be| {
            send_blocking(a, b, pb, frame, ae, be);
            1
        })?;
        assert!(
            stalled.a.link().fenced_release,
            "{provider} serves reads itself"
        );
        Some((stalled, dropped))
    }

    /// A frame of `len` bytes whose body (all `fill`) sets `dropped` when
    /// it is let go of.
    fn tracked_frame(len: usize, fill: u8, dropped: &Arc<AtomicBool>) -> OutFrame {
        struct Owned(Vec<u8>, Arc<AtomicBool>);
        impl AsRef<[u8]> for Owned {
            fn as_ref(&self) -> &[u8] {
                &self.0
            }
        }
        impl Drop for Owned {
            fn drop(&mut self) {
                self.1.store(true, Ordering::SeqCst);
            }
        }
        let mut head = ((len - 4) as u32).to_le_bytes().to_vec();
        head.extend_from_slice(&[0; 12]);
        OutFrame {
            head: Bytes::from(head),
            body: Bytes::from_owner(Owned(vec![fill; len - 16], dropped.clone())),
        }
    }

    /// Where the provider needs local registrations, the buffer a read
    /// lands in is registered while the read is out and counted beside
    /// the bodies offered (`RendezvousCounts::registered`); both go once
    /// the frame is in.
    pub fn landing_registrations_are_counted(provider: &str) {
        let len = 4 << 20;
        let forced = [("force_mr_local", "true")];
        let Some((mut a, mut b, pb, pa)) = rendezvous_pair(provider, &forced, len + (1 << 20))
            .filter(|(a, ..)| a.rendezvous_max() > 0)
        else {
            return;
        };
        assert!(b.link().mr_local);
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        send_numbered((&mut a, &mut b), pb, &[len], (&mut ae, &mut be));
        poll_until(
            (&mut a, &mut b),
            (&mut ae, &mut be),
            &format!("{provider}: the read never started"),
            |_, b, _| b.stats().rendezvous_reads_started >= 1,
        );
        // Its completion is read at b's next poll at the earliest.
        let (offered, landing) = (a.rendezvous_counts(), b.rendezvous_counts());
        assert_eq!(
            (offered.registered, offered.registered_bytes),
            (1, len as u64 - 16),
            "{provider}: the body offered"
        );
        assert_eq!(landing.registered, 1, "{provider}: the landing buffer");
        assert_eq!(
            landing.registered_bytes,
            len as u64 - 16,
            "{provider}: the landing buffer's bytes"
        );
        poll_until(
            (&mut a, &mut b),
            (&mut ae, &mut be),
            &format!("{provider}: registrations still held"),
            |a, b, be| {
                !frames_from(be, pa).is_empty()
                    && a.rendezvous_counts().registered == 0
                    && b.rendezvous_counts().registered == 0
            },
        );
        assert_numbered(&be, pa, &[len], provider);
        assert_eq!(b.rendezvous_counts().registered_bytes, 0, "{provider}");
    }

    /// A read queued for an in-process `shm` peer that then closes is
    /// given up when its turn comes, and counted as such.
    pub fn a_queued_read_of_a_closed_in_process_shm_peer_is_counted() {
        let Some((mut a, mut b, pb, pa)) = rendezvous_pair("shm", &[], 4 << 20) else {
            return;
        };
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        offer_held((&mut a, &mut b), (pb, pa), &[1 << 20], (&mut ae, &mut be));
        drop(a);
        b.hold_reads(pa, false);
        let start = Instant::now();
        while !be
            .iter()
            .any(|e| matches!(e, Event::Closed { peer, .. } if *peer == pa))
        {
            b.poll(&mut be).expect("poll b");
            assert!(start.elapsed() < DEADLINE, "the link was never ended");
        }
        assert_eq!(b.stats().rendezvous_reads_given_up, 1);
        assert_eq!(b.stats().rendezvous_read, 0);
        assert!(frames_from(&be, pa).is_empty(), "nothing delivered");
    }

    /// A receiver that stops reading holds at most its share of the
    /// sender's registrations (the sender is told to wait, then `Writable`
    /// once the receiver reads again); one that goes away for good has its
    /// transfers released, and counted, when its peer is closed.
    pub fn rendezvous_bounds_and_abandoned_transfers(provider: &str) {
        let Some((mut a, mut b, pb, pa)) = rendezvous_pair(provider, &[], 2 << 20) else {
            return;
        };
        let mut sent = 0;
        let refused = loop {
            match a.send(pb, numbered_frame(sent as u8, 1 << 20)) {
                Ok(()) => sent += 1,
                Err(SendError::WouldBlock(back)) => break back,
                Err(err) => panic!("send: {err}"),
            }
            a.poll(&mut Vec::new()).expect("poll a");
            assert!(
                sent <= 64,
                "no bound on registrations for a peer that does not read"
            );
        };
        assert!(sent >= 1);
        assert_eq!(a.rendezvous_held().0, sent);
        assert!(a.stats().rendezvous_deferred >= 1);
        // The receiver reads again: the sender is told it may go on.
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |ae, _| {
                ae.iter()
                    .any(|e| matches!(e, Event::Writable { peer } if *peer == pb))
            },
            "writable after reads",
        );
        a.send(pb, refused).expect("sent once told writable");
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| frames_from(be, pa).len() == sent + 1,
            "every frame",
        );

        // A receiver that goes away before reading: closing it releases
        // its transfers, counted as abandoned.
        let Some((mut a, b, pb, _)) = rendezvous_pair(provider, &[], 2 << 20) else {
            return;
        };
        for n in 0..3 {
            a.send(pb, numbered_frame(n, 1 << 20)).expect("send");
            a.poll(&mut Vec::new()).expect("poll a");
        }
        assert_eq!(a.rendezvous_held().0, 3);
        drop(b);
        a.close(pb);
        assert_eq!(
            a.rendezvous_held(),
            (0, 0),
            "closing the peer releases them"
        );
        assert_eq!(a.stats().rendezvous_abandoned, 3);

        // A receiver whose reads are under way when the sender gives it
        // up, and which is then dropped: nothing breaks on either side, the
        // sender is left holding nothing, and each transfer still out is
        // counted as abandoned.
        let Some((mut a, mut b, pb, _)) = rendezvous_pair(provider, &[], 2 << 20) else {
            return;
        };
        for n in 0..3 {
            a.send(pb, numbered_frame(n, 1 << 20)).expect("send");
        }
        let start = Instant::now();
        while b.stats().rendezvous_reads_started == 0 {
            a.poll(&mut Vec::new()).expect("poll a");
            b.poll(&mut Vec::new()).expect("poll b");
            assert!(start.elapsed() < DEADLINE, "no read started");
        }
        let outstanding = a.rendezvous_held().0 as u64;
        assert!(outstanding > 0, "every transfer was done already");
        let abandoned = a.stats().rendezvous_abandoned;
        a.close(pb);
        assert_eq!(a.rendezvous_held(), (0, 0));
        assert_eq!(a.stats().rendezvous_abandoned - abandoned, outstanding);
        for _ in 0..3 {
            b.poll(&mut Vec::new()).expect("poll b");
        }
        drop(b);
    }

    /// Sending without polling the receiver fills the send slots: `send`
    /// hands the frame back with `WouldBlock`, `Writable` follows once the
    /// endpoints are polled, and every frame still arrives in order.
    pub fn backpressure_then_writable(kind: EpKind, provider: &str) {
        let Some((mut a, mut b)) = pair(kind, provider, &[("tx_depth", "4")]) else {
            return;
        };
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        // Above every dev provider's inject size, so each send holds a slot.
        let body = |i: usize| vec![i as u8; 2000];
        let total = 40;
        let mut sent = 0;
        let mut blocked = 0;
        let start = Instant::now();
        while sent < total {
            match a.send(pb, frame(&body(sent))) {
                Ok(()) => sent += 1,
                Err(SendError::WouldBlock(back)) => {
                    assert_eq!(back.len(), 2004, "the frame is handed back whole");
                    blocked += 1;
                    assert!(a.queued_bytes(pb) > 0);
                    // Writable comes once polling frees a slot.
                    pump(
                        &mut a,
                        &mut b,
                        &mut ae,
                        &mut be,
                        |ae, _| ae.contains(&Event::Writable { peer: pb }),
                        "Writable after WouldBlock",
                    );
                    ae.retain(|e| !matches!(e, Event::Writable { .. }));
                }
                Err(err) => panic!("send: {err}"),
            }
            assert!(start.elapsed() < DEADLINE, "sending stalled");
        }
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| frames_from(be, pa).len() == total,
            "all frames",
        );
        let got = frames_from(&be, pa);
        for (i, f) in got.iter().enumerate() {
            assert_eq!(payload_of(f), &body(i)[..], "frame {i}");
        }
        eprintln!("{provider}: {blocked} WouldBlock(s) over {total} frames");
    }

    /// The test-only switches push a message prefix and registered buffers
    /// with descriptors through a real provider.
    pub fn forced_prefix_and_mr(kind: EpKind, provider: &str) {
        let forced = [("force_prefix", "64"), ("force_mr_local", "true")];
        let Some((mut a, mut b)) = pair(kind, provider, &forced) else {
            return;
        };
        for ep in [&a, &b] {
            assert_eq!(ep.link().provider_prefix, 0);
            assert_eq!(ep.link().msg_prefix_size, 64);
            assert!(ep.link().mr_local);
        }
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        let max = a.max_frame();
        let big: Vec<u8> = (0..max - 4).map(|i| (i % 253) as u8).collect();
        for i in 0..RX_DEPTH * 2 {
            let body = if i % 5 == 0 {
                big.clone()
            } else {
                format!("forced {i}").into_bytes()
            };
            send_blocking(&mut a, &mut b, pb, frame(&body), &mut ae, &mut be);
            pump(
                &mut a,
                &mut b,
                &mut ae,
                &mut be,
                |_, be| frames_from(be, pa).len() > i,
                "forced frame",
            );
            assert_eq!(payload_of(&frames_from(&be, pa)[i]), &body[..]);
        }
        b.send(pa, frame(b"back"))
            .unwrap_or_else(|e| panic!("send: {e}"));
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |ae, _| !frames_from(ae, pb).is_empty(),
            "reply",
        );
        assert_eq!(b.stats().malformed, 0);
    }

    /// Only a peer inserted with its link's keys is heard. A sender the
    /// receiver never inserted, one naming a live link with the wrong key,
    /// and one forging the address of the link's peer are dropped and
    /// counted: no `Accepted`, no frame. `connect` is refused (a fabric
    /// peer needs keys); `close` ends a peer, and a new link to the same
    /// address is a new peer.
    pub fn strangers_and_forgeries_are_dropped(kind: EpKind, provider: &str) {
        let Some((mut a, mut b)) = pair(kind, provider, &[]) else {
            return;
        };
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        assert!(a.connect(&addr_to_hex(&b.local_addr())).is_err());
        let (a_keys, b_keys) = link_keys();
        let pb = a.insert_peer(&b.local_addr(), &a_keys).expect("insert b");
        // `b` has not inserted `a`: the link id names nothing there.
        a.send(pb, frame(b"hello stranger")).expect("send");
        until_counted(&mut a, &mut b, &mut be, |s| s.unknown_links, "a stranger");
        let pa = b.insert_peer(&a.local_addr(), &b_keys).expect("insert a");
        a.send(pb, frame(b"hello friend")).expect("send");
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| !frames_from(be, pa).is_empty(),
            "a frame over a keyed link",
        );
        assert_eq!(payload_of(&frames_from(&be, pa)[0]), b"hello friend");

        // An attacker that knows the link id but not the key, first as
        // itself, then claiming `a`'s address.
        let t = transport(kind, provider);
        let mut attacker = t.open_fabric(&config(provider, &[])).expect("attacker");
        let stolen = LinkKeys {
            send_key: [0x66; 32],
            ..a_keys.clone()
        };
        let to_b = attacker
            .insert_peer(&b.local_addr(), &stolen)
            .expect("insert b");
        attacker.send(to_b, frame(b"forged")).expect("send");
        until_counted(
            &mut attacker,
            &mut b,
            &mut be,
            |s| s.forged,
            "another address",
        );
        attacker.claim_address(&a.local_addr());
        attacker.send(to_b, frame(b"forged as a")).expect("send");
        until_counted(&mut attacker, &mut b, &mut be, |s| s.forged, "a wrong key");
        assert!(
            !be.iter().any(|e| matches!(e, Event::Accepted { .. })
                || matches!(e, Event::Frame { frame, .. } if payload_of(frame) != b"hello friend")),
            "only the keyed peer's frame got through: {be:?}"
        );

        b.close(pa);
        let mut events = Vec::new();
        b.poll(&mut events).unwrap();
        assert!(events.contains(&Event::Closed {
            peer: pa,
            reason: CloseReason::Local
        }));
        assert!(matches!(
            b.send(pa, frame(b"x")),
            Err(SendError::Closed(p)) if p == pa
        ));
        assert_eq!(b.queued_bytes(pa), 0);
        // A late message of the closed link is a stranger's now.
        a.send(pb, frame(b"too late")).expect("send");
        until_counted(
            &mut a,
            &mut b,
            &mut be,
            |s| s.unknown_links,
            "a closed link",
        );
        // A new link to the same address is a new peer.
        let (_, fresh) = link_keys();
        let again = b.insert_peer(&a.local_addr(), &fresh).unwrap();
        assert_ne!(again, pa);
        // A wrongly sized address is refused, not read past its end.
        let (_, other) = link_keys();
        assert!(b.insert_peer(&[1, 2, 3], &other).is_err());
    }

    /// `rounds` ping-pongs of small frames between `a` and `b`.
    fn ping_pong(
        (a, b): (&mut FabricEndpoint, &mut FabricEndpoint),
        (pb, pa): (PeerId, PeerId),
        rounds: usize,
    ) {
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        for n in 0..rounds {
            let ping = format!("ping {n}");
            a.send(pb, frame(ping.as_bytes())).expect("send ping");
            pump(
                a,
                b,
                &mut ae,
                &mut be,
                |_, be| !frames_from(be, pa).is_empty(),
                "a ping",
            );
            assert_eq!(payload_of(&frames_from(&be, pa)[0]), ping.as_bytes());
            be.clear();
            b.send(pa, frame(b"pong")).expect("send pong");
            pump(
                a,
                b,
                &mut ae,
                &mut be,
                |ae, _| !frames_from(ae, pb).is_empty(),
                "a pong",
            );
            ae.clear();
        }
    }

    /// Every completion-queue read runs the provider's progress, so the tx
    /// queue is read only while a send or read of ours is due there: a
    /// ping-pong of small frames, which the provider takes by `fi_inject`
    /// (no completion), reads it about once in 64 rounds (to find what no
    /// post of ours accounts for), the rx queue every round.
    pub fn completion_queues_are_read_as_needed(kind: EpKind, provider: &str) {
        let Some((mut a, mut b)) = pair(kind, provider, &[]) else {
            return;
        };
        let peers = insert_each_other(&mut a, &mut b);
        // The first exchange sets up the provider's connection, during
        // which a send may be refused by inject and go by fi_send; polls
        // then go on until neither side has a completion due.
        ping_pong((&mut a, &mut b), peers, 1);
        let (start, mut quiet) = (Instant::now(), 0);
        while quiet < 8 {
            let reads = (a.stats().tx_cq_reads, b.stats().tx_cq_reads);
            a.poll(&mut Vec::new()).expect("poll a");
            b.poll(&mut Vec::new()).expect("poll b");
            let unread = reads == (a.stats().tx_cq_reads, b.stats().tx_cq_reads);
            quiet = if unread { quiet + 1 } else { 0 };
            assert!(
                start.elapsed() < DEADLINE,
                "the tx queue stayed read at every poll"
            );
        }
        let before = [a.stats().clone(), b.stats().clone()];
        const ROUNDS: u64 = 100;
        ping_pong((&mut a, &mut b), peers, ROUNDS as usize);
        for ((side, stats), before) in [("a", a.stats()), ("b", b.stats())].into_iter().zip(before)
        {
            let what = format!("{provider}, {side}: {stats:?}");
            assert_eq!(stats.received - before.received, ROUNDS, "{what}");
            // Every provider here takes frames this small by inject.
            assert_eq!(stats.injected - before.injected, ROUNDS, "{what}");
            assert_eq!(stats.sent, before.sent, "{what}");
            let (tx, rx) = (
                stats.tx_cq_reads - before.tx_cq_reads,
                stats.rx_cq_reads - before.rx_cq_reads,
            );
            assert!(tx <= rx / 64 + 1, "tx queue read with nothing due: {what}");
        }
    }

    /// `flush` posts what `send` queued and reads no completion queue: the
    /// frame arrives, though the sender was not polled after the send.
    pub fn flush_posts_without_reading(kind: EpKind, provider: &str) {
        let Some((mut a, mut b)) = pair(kind, provider, &[]) else {
            return;
        };
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        // The first exchange sets up the provider's connection.
        ping_pong((&mut a, &mut b), (pb, pa), 1);
        let before = a.stats().clone();
        a.send(pb, frame(b"flushed")).expect("send");
        assert_eq!(
            a.stats().sent + a.stats().injected,
            before.sent + before.injected
        );
        a.flush();
        let after = a.stats().clone();
        assert_eq!(
            after.sent + after.injected,
            before.sent + before.injected + 1
        );
        assert_eq!(
            (after.tx_cq_reads, after.rx_cq_reads),
            (before.tx_cq_reads, before.rx_cq_reads),
            "{provider}: flush read a queue"
        );
        let (start, mut events) = (Instant::now(), Vec::new());
        while frames_from(&events, pa).is_empty() {
            b.poll(&mut events).expect("poll b");
            assert!(
                start.elapsed() < DEADLINE,
                "{provider}: the flushed frame never arrived"
            );
        }
        assert_eq!(payload_of(&frames_from(&events, pa)[0]), b"flushed");
    }

    /// Frames sent in a burst, without a poll between them, share
    /// messages, and still arrive whole and in order.
    pub fn bursts_are_packed(kind: EpKind, provider: &str) {
        let Some((mut a, mut b)) = pair(kind, provider, &[]) else {
            return;
        };
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        // Without the peer's limit nothing is packed.
        a.send(pb, frame(b"alone")).expect("send");
        a.send(pb, frame(b"alone too")).expect("send");
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| frames_from(be, pa).len() >= 2,
            "two frames",
        );
        assert_eq!(a.stats().packed, 0);
        be.clear();
        let before = a.stats().clone();
        let limit = a.max_frame();
        a.set_peer_frame_limit(pb, limit);
        const BURST: usize = 50;
        for n in 0..BURST {
            a.send(pb, frame(format!("burst {n}").as_bytes()))
                .unwrap_or_else(|e| panic!("send {n}: {e}"));
        }
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| frames_from(be, pa).len() >= BURST,
            "the burst",
        );
        let got: Vec<Vec<u8>> = frames_from(&be, pa)
            .iter()
            .map(|f| payload_of(f).to_vec())
            .collect();
        let want: Vec<Vec<u8>> = (0..BURST)
            .map(|n| format!("burst {n}").into_bytes())
            .collect();
        assert_eq!(got, want);
        let stats = a.stats();
        assert_eq!(stats.packed as usize, BURST - 1, "{stats:?}");
        let posted = stats.sent + stats.injected - (before.sent + before.injected);
        assert_eq!(posted, 1, "{stats:?}");
        // Frames and messages are counted apart: the two lone frames came
        // in two messages, the burst in one.
        assert_eq!(b.stats().received as usize, BURST + 2);
        assert_eq!(b.stats().received_messages, 3, "{:?}", b.stats());
    }

    /// A sender with bigger buffers than its peer packs only up to the
    /// peer's limit, so every message fits the peer's receive buffers.
    pub fn packing_respects_a_smaller_peer(kind: EpKind, provider: &str) {
        let t = transport(kind, provider);
        let big = t.open_fabric(&config(provider, &[("msg_size", "16384")]));
        let small = t.open_fabric(&config(provider, &[("msg_size", "4096")]));
        let (mut a, mut b) = match (big, small) {
            (Ok(a), Ok(b)) => (a, b),
            _ => {
                assert!(!fabric_required(), "{provider} did not open");
                return;
            }
        };
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        a.set_peer_frame_limit(pb, b.max_frame());
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        const BURST: usize = 40;
        for n in 0..BURST {
            let payload = vec![n as u8; 300];
            a.send(pb, frame(&payload)).expect("send");
        }
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| frames_from(be, pa).len() >= BURST,
            "every frame of the burst",
        );
        for (n, f) in frames_from(&be, pa).iter().enumerate() {
            assert_eq!(payload_of(f), &vec![n as u8; 300][..], "frame {n}");
        }
        assert!(a.stats().packed > 0, "{:?}", a.stats());
        let received = b.stats();
        assert_eq!(received.rx_errors + received.malformed, 0, "{received:?}");
    }

    /// A forger holding the link's very keys and writing the peer's
    /// address: where the provider reports each receive's source
    /// (FI_SOURCE), the source is not the peer's and the message is dropped
    /// and counted as forged. Where it is not asked for (the `ofi_rxm` and
    /// `ofi_rxd` layers) the tag alone authenticates, which such a forger
    /// passes; the link says so.
    pub fn the_source_is_checked_where_reported(kind: EpKind, provider: &str) {
        let Some((mut a, mut b)) = pair(kind, provider, &[]) else {
            return;
        };
        if !b.link().source_checked {
            // The network providers here (sockets, udp) all grant it.
            assert!(
                provider.contains("ofi_") || provider == "shm",
                "{provider} grants FI_SOURCE, yet the endpoint does not check it"
            );
            eprintln!("{provider}: FI_SOURCE not asked; the tag alone authenticates");
            return;
        }
        let (a_keys, b_keys) = link_keys();
        let pb = a.insert_peer(&b.local_addr(), &a_keys).expect("insert b");
        let pa = b.insert_peer(&a.local_addr(), &b_keys).expect("insert a");
        let mut be = Vec::new();
        a.send(pb, frame(b"genuine")).expect("send");
        pump(
            &mut a,
            &mut b,
            &mut Vec::new(),
            &mut be,
            |_, be| !frames_from(be, pa).is_empty(),
            "the genuine frame",
        );
        let t = transport(kind, provider);
        let mut forger = t.open_fabric(&config(provider, &[])).expect("forger");
        let to_b = forger
            .insert_peer(&b.local_addr(), &a_keys)
            .expect("insert b");
        forger.claim_address(&a.local_addr());
        // The forger's counters start at 1 again: its first message would
        // be a replay, the 99 after it new; only the source stops them.
        // Sends complete as the receiver takes them (on shm, only then).
        let forged_before = b.stats().forged;
        let start = Instant::now();
        for _ in 0..100 {
            while let Err(err) = forger.send(to_b, frame(b"forged")) {
                assert!(matches!(err, SendError::WouldBlock(_)), "{err}");
                assert!(start.elapsed() < DEADLINE, "the forger cannot send");
                forger.poll(&mut Vec::new()).expect("poll forger");
                b.poll(&mut be).expect("poll b");
            }
            forger.poll(&mut Vec::new()).expect("poll forger");
        }
        while b.stats().forged == forged_before {
            forger.poll(&mut Vec::new()).expect("poll forger");
            b.poll(&mut be).expect("poll b");
            assert!(
                start.elapsed() < DEADLINE,
                "a forger with the keys: never counted: {:?}; delivered {}",
                b.stats(),
                be.len()
            );
        }
        assert!(
            !be.iter()
                .any(|e| matches!(e, Event::Frame { frame, .. } if payload_of(frame) == b"forged")),
            "a forged frame was delivered"
        );
    }

    /// Messages recorded on the wire and sent again are refused: a second
    /// endpoint holding the link's keys and writing the peer's address
    /// sends, one message at a time as the peer did, the very messages the
    /// peer sent (same link, counters and bytes). None is delivered, each
    /// is counted (as replayed, or as forged where the source is checked
    /// first), and the peer's next message still arrives.
    pub fn replayed_messages_are_refused(kind: EpKind, provider: &str) {
        const MESSAGES: u64 = 20;
        let Some((mut a, mut b)) = pair(kind, provider, &[]) else {
            return;
        };
        let (a_keys, b_keys) = link_keys();
        let pb = a.insert_peer(&b.local_addr(), &a_keys).expect("insert b");
        let pa = b.insert_peer(&a.local_addr(), &b_keys).expect("insert a");
        let message = |i: u64| frame(format!("message {i}").as_bytes());
        let mut be = Vec::new();
        for i in 0..MESSAGES {
            a.send(pb, message(i)).expect("send");
            pump(
                &mut a,
                &mut b,
                &mut Vec::new(),
                &mut be,
                |_, be| !frames_from(be, pa).is_empty(),
                "a genuine message",
            );
            be.clear();
        }
        let t = transport(kind, provider);
        let mut replayer = t.open_fabric(&config(provider, &[])).expect("replayer");
        let to_b = replayer
            .insert_peer(&b.local_addr(), &a_keys)
            .expect("insert b");
        replayer.claim_address(&a.local_addr());
        let refused = |b: &FabricEndpoint| b.stats().replayed + b.stats().forged;
        let start = Instant::now();
        for i in 0..MESSAGES {
            replayer.send(to_b, message(i)).expect("send");
            while refused(&b) <= i {
                replayer.poll(&mut Vec::new()).expect("poll replayer");
                b.poll(&mut be).expect("poll b");
                assert!(start.elapsed() < DEADLINE, "replay {i} never counted");
            }
        }
        assert_eq!(refused(&b), MESSAGES, "{:?}", b.stats());
        if !b.link().source_checked {
            assert_eq!(b.stats().replayed, MESSAGES, "{:?}", b.stats());
        }
        assert!(
            frames_from(&be, pa).is_empty(),
            "a replayed message was delivered"
        );
        a.send(pb, frame(b"after the replay")).expect("send");
        pump(
            &mut a,
            &mut b,
            &mut Vec::new(),
            &mut be,
            |_, be| !frames_from(be, pa).is_empty(),
            "the peer's next message",
        );
        let after = frames_from(&be, pa);
        assert_eq!(after.len(), 1);
        assert_eq!(payload_of(&after[0]), b"after the replay");
    }

    /// Over `shm`, the entry removed to make room is one of a peer whose
    /// process has gone (its region removed), not the least recently used
    /// one of a peer still running: libfabric 1.17 keeps state of a peer
    /// whose entry is removed, which that peer finds stale when it comes
    /// back.
    pub fn shm_evicts_a_departed_peer_first() {
        let Some((mut a, running)) = pair(EpKind::Rdm, "shm", &[("max_addresses", "2")]) else {
            return;
        };
        let t = transport(EpKind::Rdm, "shm");
        let departing = t.open_fabric(&config("shm", &[])).expect("open");
        let newcomer = t.open_fabric(&config("shm", &[])).expect("open");
        let departing_addr = departing.local_addr();
        // The running peer's entry is the older one: the least recently
        // used once both peers are closed.
        for addr in [running.local_addr(), departing_addr.clone()] {
            let (keys, _) = link_keys();
            let peer = a.insert_peer(&addr, &keys).expect("insert");
            a.close(peer);
        }
        drop(departing);
        let region = departing_addr
            .strip_prefix(b"fi_shm://")
            .and_then(|rest| rest.split(|&b| b == 0).next())
            .map(|name| {
                std::path::Path::new("/dev/shm").join(String::from_utf8_lossy(name).as_ref())
            })
            .expect("an shm name");
        assert!(!region.exists(), "the departed peer's region is gone");
        let (keys, _) = link_keys();
        a.insert_peer(&newcomer.local_addr(), &keys)
            .expect("room made");
        assert_eq!(a.stats().av_evictions, 1);
        // The running peer's entry is still there: no eviction for it.
        let (keys, _) = link_keys();
        a.insert_peer(&running.local_addr(), &keys)
            .expect("the running peer");
        assert_eq!(a.stats().av_evictions, 1, "the departed peer's entry went");
    }

    /// libfabric 1.17's `shm` takes a name whose region does not exist and
    /// gives the next name inserted the same entry, whose removal unmaps
    /// both: such a name is refused, and a live peer's frames keep
    /// arriving. One name spelled with more bytes after its NUL is the
    /// same name: one entry. (A peer inserted after such a name got its
    /// entry, and evicting the first made every frame to it vanish.)
    pub fn shm_names_without_a_region_are_refused() {
        let Some((mut a, mut b)) = pair(EpKind::Rdm, "shm", &[("max_addresses", "2")]) else {
            return;
        };
        let mut c = transport(EpKind::Rdm, "shm")
            .open_fabric(&config("shm", &[]))
            .expect("open c");
        // No process has this number: no region of that name exists.
        let (keys, _) = link_keys();
        let refused = a.insert_peer(b"fi_shm://4000000000:0:0\0", &keys);
        let refused = refused.expect_err("a name without a region");
        assert!(
            refused.to_string().contains("no shared-memory region"),
            "{refused}"
        );
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        let mut spelled = b.local_addr();
        spelled.extend_from_slice(b"\0\0");
        let (keys, _) = link_keys();
        let again = a.insert_peer(&spelled, &keys).expect("the same name");
        assert_eq!(a.fabric_counts().addresses, 1, "one entry for both");
        a.close(again);
        // Room for c without evicting b's entry, the only one.
        let (pc, pa_at_c) = insert_each_other(&mut a, &mut c);
        assert_eq!(a.stats().av_evictions, 0);
        let (mut ae, mut be, mut ce) = (Vec::new(), Vec::new(), Vec::new());
        send_blocking(&mut a, &mut b, pb, frame(b"to b"), &mut ae, &mut be);
        send_blocking(&mut a, &mut c, pc, frame(b"to c"), &mut ae, &mut ce);
        let start = Instant::now();
        while frames_from(&be, pa).is_empty() || frames_from(&ce, pa_at_c).is_empty() {
            a.poll(&mut ae).expect("poll a");
            b.poll(&mut be).expect("poll b");
            c.poll(&mut ce).expect("poll c");
            assert!(start.elapsed() < DEADLINE, "a frame did not arrive");
        }
        assert_eq!(payload_of(&frames_from(&be, pa)[0]), b"to b");
        assert_eq!(payload_of(&frames_from(&ce, pa_at_c)[0]), b"to c");
    }

    /// An address vector bounded to two addresses holds the addresses of
    /// two live peers and refuses a third; once a peer closes, its address
    /// is removed (least recently used first) to make room, and the peers
    /// left carry on.
    pub fn unused_addresses_are_evicted(kind: EpKind, provider: &str) {
        let Some((mut first, mut receiver)) = pair(kind, provider, &[("max_addresses", "2")])
        else {
            return;
        };
        let t = transport(kind, provider);
        let mut second = t.open_fabric(&config(provider, &[])).expect("sender");
        let mut third = t.open_fabric(&config(provider, &[])).expect("sender");
        let (p1, r1) = insert_each_other(&mut first, &mut receiver);
        let (p2, r2) = insert_each_other(&mut second, &mut receiver);
        let (_, r3_keys) = link_keys();
        let refused = receiver.insert_peer(&third.local_addr(), &r3_keys);
        assert!(refused.is_err(), "a third live address fits in two");
        receiver.close(r1);
        let (t_keys, r3_keys) = link_keys();
        let r3 = receiver
            .insert_peer(&third.local_addr(), &r3_keys)
            .expect("room once a peer closed");
        assert_eq!(receiver.stats().av_evictions, 1);
        let p3 = third
            .insert_peer(&receiver.local_addr(), &t_keys)
            .expect("insert receiver");
        let mut events = Vec::new();
        for (sender, to, from, text) in [
            (&mut third, p3, r3, b"three".as_slice()),
            (&mut second, p2, r2, b"two".as_slice()),
        ] {
            sender.send(to, frame(text)).expect("send");
            let start = Instant::now();
            while !events.iter().any(|e| {
                matches!(e, Event::Frame { peer, frame } if *peer == from && payload_of(frame) == text)
            }) {
                sender.poll(&mut Vec::new()).expect("poll sender");
                receiver.poll(&mut events).expect("poll receiver");
                assert!(start.elapsed() < DEADLINE, "no frame from {from}");
            }
        }
        // The evicted address's late messages go nowhere.
        first.send(p1, frame(b"one")).expect("send");
        until_counted(
            &mut first,
            &mut receiver,
            &mut events,
            |s| s.unknown_links,
            "a closed peer",
        );
    }

    /// A message larger than the receiver's buffers (peers configured with
    /// different `msg_size`) is dropped and counted: as a completion error
    /// with the provider's text (`tcp;ofi_rxm`, `sockets`), or as a
    /// truncated, malformed message (`udp;ofi_rxd`, `udp`). The receive slot
    /// is reposted and later frames still arrive (checked where the provider
    /// delivers them promptly).
    pub fn oversized_message_is_dropped(kind: EpKind, provider: &str) {
        let t = transport(kind, provider);
        let big_cfg = config(provider, &[]);
        // Room for the header with `shm`'s longest name, and far less than
        // the frame sent.
        let small_cfg = config(provider, &[("msg_size", "512")]);
        let (mut a, mut b) = match (t.open_fabric(&big_cfg), t.open_fabric(&small_cfg)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(err), _) | (_, Err(err)) => {
                assert!(matches!(err, TransportError::Unavailable { .. }), "{err}");
                assert!(!fabric_required(), "{err}");
                eprintln!("skipping: {err}");
                return;
            }
        };
        assert!(b.max_frame() < 512);
        let (pb, pa) = insert_each_other(&mut a, &mut b);
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        a.send(pb, frame(&[7u8; 1000]))
            .unwrap_or_else(|e| panic!("send: {e}"));
        let start = Instant::now();
        while b.stats().rx_errors + b.stats().malformed == 0 {
            a.poll(&mut ae).unwrap();
            b.poll(&mut be).unwrap();
            assert!(
                start.elapsed() < DEADLINE,
                "the oversized message was never reported"
            );
        }
        assert!(b.stats().last_error.is_some());
        assert!(
            frames_from(&be, pa).is_empty(),
            "a truncated frame was delivered"
        );
        if provider == "tcp;ofi_rxm" {
            // libfabric 1.17's rxm holds the messages that follow a truncated
            // one on the same connection until some later, timing-dependent
            // point; the drop and count above are what efabus controls.
            return;
        }
        a.send(pb, frame(b"small again"))
            .unwrap_or_else(|e| panic!("send: {e}"));
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| !frames_from(be, pa).is_empty(),
            "a later frame",
        );
        assert_eq!(payload_of(&frames_from(&be, pa)[0]), b"small again");
    }

    /// A payload of `len` bytes that says which frame `tag` it is.
    fn tagged(tag: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| tag.wrapping_add((i % 251) as u8))
            .collect()
    }

    /// The tag of a frame made from [`tagged`].
    fn tag_of(frame: &[u8]) -> u8 {
        payload_of(frame)[0]
    }

    /// Sends `count` tagged frames of `len` bytes from `a` to `b` and
    /// returns the frames `b` received, checked byte for byte.
    fn deliver_tagged(
        a: &mut FabricEndpoint,
        b: &mut FabricEndpoint,
        (pb, pa): (PeerId, PeerId),
        tags: std::ops::Range<u8>,
        len: usize,
    ) -> Vec<Bytes> {
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        let count = tags.len();
        let tags_sent = tags.clone();
        for tag in tags {
            send_blocking(a, b, pb, frame(&tagged(tag, len)), &mut ae, &mut be);
        }
        pump(
            a,
            b,
            &mut ae,
            &mut be,
            |_, be| frames_from(be, pa).len() == count,
            "tagged frames",
        );
        let got = frames_from(&be, pa);
        check_tagged(&got, tags_sent, len);
        got
    }

    /// Each frame holds its tag's bytes, and the tags are those sent.
    fn check_tagged(frames: &[Bytes], sent: std::ops::Range<u8>, len: usize) {
        let mut tags: Vec<u8> = frames
            .iter()
            .map(|f| {
                assert_eq!(payload_of(f), tagged(tag_of(f), len), "frame corrupted");
                tag_of(f)
            })
            .collect();
        tags.sort();
        assert_eq!(tags, sent.collect::<Vec<_>>());
    }

    /// Large received messages are lent rather than copied: at most half
    /// the receives are held out by frames the caller keeps (the rest
    /// arrive as copies), dropped frames give their slots back, and lent
    /// frames stay readable after their endpoint is gone. One receive per
    /// message here (see `multi_receive_buffers_take_many_messages`).
    pub fn large_frames_are_lent(kind: EpKind, provider: &str) {
        let Some((mut a, mut b)) = pair(kind, provider, &[("multi_recv", "false")]) else {
            return;
        };
        assert!(b.link().multi_recv.is_none());
        let peers = insert_each_other(&mut a, &mut b);
        let len = 12 << 10;
        let kept = deliver_tagged(&mut a, &mut b, peers, 0..RX_DEPTH as u8, len);
        assert_eq!(b.stats().lent, RX_DEPTH as u64 / 2, "{:?}", b.stats());
        // Small messages are copied whatever the lending state, and large
        // ones while half the slots are lent; the slots behind the kept
        // frames are not reused meanwhile.
        deliver_tagged(&mut a, &mut b, peers, 100..104, 100);
        deliver_tagged(&mut a, &mut b, peers, 150..150 + 2 * RX_DEPTH as u8, len);
        assert_eq!(b.stats().lent, RX_DEPTH as u64 / 2);
        check_tagged(&kept, 0..RX_DEPTH as u8, len);

        drop(kept);
        let kept = deliver_tagged(&mut a, &mut b, peers, 50..54, len);
        assert_eq!(
            b.stats().lent,
            RX_DEPTH as u64 / 2 + 4,
            "dropped frames did not give their slots back"
        );
        drop((a, b));
        for f in &kept {
            assert_eq!(payload_of(f), tagged(tag_of(f), len));
        }
    }

    /// Multi-receive buffers (forced: efabus relies on them on efa
    /// alone; here one sender's messages land one at a time): the receive
    /// memory is posted as a few buffers that many messages fill in turn,
    /// far fewer posts than messages, yet every message intact, the
    /// largest ones too (the provider lets go of a buffer before one no
    /// longer fits). Lent frames hold their buffer until they are dropped,
    /// and while one buffer is held that way the other takes everything,
    /// copied.
    pub fn multi_receive_buffers_take_many_messages(provider: &str) {
        if let Some((_, b)) = pair(EpKind::Rdm, provider, &[]) {
            assert!(
                b.link().multi_recv.is_none(),
                "{provider} is not relied on for it"
            );
        }
        let Some((mut a, mut b)) = pair(EpKind::Rdm, provider, &[("force_multi_recv", "true")])
        else {
            return;
        };
        let link = b.link().clone();
        let buffer = link.multi_recv;
        assert!(
            buffer.is_some(),
            "{provider} grants FI_MULTI_RECV: {link:?}"
        );
        assert!(buffer >= Some(8 * link.max_frame), "{link:?}");
        let peers = insert_each_other(&mut a, &mut b);
        let posts = b.stats().rx_posts;
        assert_eq!(
            posts, 2,
            "{RX_DEPTH} buffers' worth make two multi-receive buffers"
        );

        let before = b.stats().received_messages;
        deliver_tagged(&mut a, &mut b, peers, 0..200, 4000);
        let messages = b.stats().received_messages - before;
        let reposts = b.stats().rx_posts - posts;
        assert!(messages >= 200, "each frame its own message: {messages}");
        assert!(
            reposts > 0 && reposts * 10 < messages,
            "{reposts} buffers posted again for {messages} messages"
        );

        // The largest frames one message carries, more than both buffers
        // hold at once.
        let largest = a.link().max_frame - 4;
        deliver_tagged(&mut a, &mut b, peers, 0..3 * RX_DEPTH as u8, largest);
        assert_eq!(b.stats().rx_errors, 0, "{:?}", b.stats());

        // Frames of 12 KiB are lent: those of the first buffer are kept,
        // which holds it; the other buffer takes the rest, copied.
        let len = 12 << 10;
        let lent = b.stats().lent;
        let kept = deliver_tagged(&mut a, &mut b, peers, 0..40, len);
        let lent_kept = b.stats().lent - lent;
        assert!(lent_kept > 0 && lent_kept < 40, "{lent_kept} of 40 lent");
        deliver_tagged(&mut a, &mut b, peers, 100..180, len);
        assert_eq!(
            b.stats().lent - lent,
            lent_kept,
            "a second buffer lent while the first is held"
        );
        check_tagged(&kept, 0..40, len);
        drop(kept);
        deliver_tagged(&mut a, &mut b, peers, 200..240, len);
        assert!(
            b.stats().lent - lent > lent_kept,
            "dropped frames did not give their buffer back"
        );
    }

    /// With eight multi-receive buffers, frames kept for good hold at most
    /// half of them: the rest take everything after, copied, and no
    /// message is lost for want of a posted buffer.
    pub fn kept_frames_hold_at_most_half_the_multi_receive_buffers(provider: &str) {
        let extra = [("force_multi_recv", "true"), ("rx_depth", "64")];
        let Some((mut a, mut b)) = pair(EpKind::Rdm, provider, &extra) else {
            return;
        };
        let buffer = b.link().multi_recv.expect("multi-receive buffers, forced");
        assert_eq!(b.buffers().multi_recv, Some((8, buffer)), "{:?}", b.link());
        let peers = insert_each_other(&mut a, &mut b);
        let len = 12 << 10;
        // Far more than all eight buffers hold, every frame kept.
        let kept = deliver_tagged(&mut a, &mut b, peers, 0..250, len);
        let lent = b.stats().lent;
        let per_buffer = buffer as u64 / len as u64 + 1;
        assert!(
            lent > 0 && lent <= 4 * per_buffer,
            "{lent} frames lent, {per_buffer} at most to a buffer"
        );
        check_tagged(&kept, 0..250, len);
        drop(kept);
        deliver_tagged(&mut a, &mut b, peers, 0..20, len);
        assert!(b.stats().lent > lent, "the buffers came back to lend again");
    }

    /// A frame body of 8 KiB or more goes from the caller's buffer where
    /// the provider needs no registration; with registration required
    /// (forced here), only a body lent from the rx pool does: a receiver
    /// forwarding what it got copies nothing, yet a fresh body is copied.
    /// The providers here ignore descriptors, so a wrong one would pass;
    /// what this checks with registration forced is which bodies are
    /// shared and that they arrive intact.
    pub fn large_bodies_are_sent_uncopied(kind: EpKind, provider: &str) {
        let Some((mut a, mut b)) = pair(kind, provider, &[]) else {
            return;
        };
        let peers = insert_each_other(&mut a, &mut b);
        let len = 12 << 10;
        deliver_tagged(&mut a, &mut b, peers, 1..3, len);
        assert_eq!(a.stats().shared_sends, 2, "{:?}", a.stats());
        deliver_tagged(&mut a, &mut b, peers, 3..5, 1000);
        assert_eq!(a.stats().shared_sends, 2, "a small body was not copied");

        // Packing: nothing goes into or behind a message that carries a
        // body from the caller's buffer. small, large, small, small packs
        // only the last small frame behind the one before it.
        let (pb, pa) = peers;
        a.set_peer_frame_limit(pb, a.max_frame());
        let packed_before = a.stats().packed;
        let (mut ae, mut be) = (Vec::new(), Vec::new());
        for (tag, size) in [(20, 100), (21, len), (22, 100), (23, 100)] {
            a.send(pb, frame(&tagged(tag, size))).expect("send");
        }
        pump(
            &mut a,
            &mut b,
            &mut ae,
            &mut be,
            |_, be| frames_from(be, pa).len() == 4,
            "a mixed burst",
        );
        assert_eq!(a.stats().packed - packed_before, 1, "{:?}", a.stats());
        assert_eq!(a.stats().shared_sends, 3);
        let got = frames_from(&be, pa);
        let sizes: Vec<(u8, usize)> = got
            .iter()
            .map(|f| (tag_of(f), payload_of(f).len()))
            .collect();
        for f in &got {
            assert_eq!(payload_of(f), tagged(tag_of(f), payload_of(f).len()));
        }
        let mut sorted = sizes.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            [(20, 100), (21, len), (22, 100), (23, 100)],
            "{sizes:?}"
        );

        let forced = [("force_mr_local", "true")];
        let Some((mut relay, mut sink)) = pair(kind, provider, &forced) else {
            return;
        };
        let (to_sink, from_relay) = insert_each_other(&mut relay, &mut sink);
        let relay_peers = insert_each_other(&mut a, &mut relay);
        let got = deliver_tagged(&mut a, &mut relay, relay_peers, 7..8, len);
        assert_eq!(relay.stats().lent, 1);
        let (mut re, mut se) = (Vec::new(), Vec::new());
        let lent = got[0].clone();
        let forward = OutFrame {
            head: lent.slice(..4),
            body: lent.slice(4..),
        };
        send_blocking(&mut relay, &mut sink, to_sink, forward, &mut re, &mut se);
        assert_eq!(relay.stats().shared_sends, 1, "{:?}", relay.stats());
        send_blocking(
            &mut relay,
            &mut sink,
            to_sink,
            frame(&tagged(9, len)),
            &mut re,
            &mut se,
        );
        assert_eq!(
            relay.stats().shared_sends,
            1,
            "an unregistered body was not copied"
        );
        pump(
            &mut relay,
            &mut sink,
            &mut re,
            &mut se,
            |_, se| frames_from(se, from_relay).len() == 2,
            "forwarded frames",
        );
        let mut tags: Vec<u8> = frames_from(&se, from_relay)
            .iter()
            .map(|f| {
                assert_eq!(payload_of(f), tagged(tag_of(f), len));
                tag_of(f)
            })
            .collect();
        tags.sort();
        assert_eq!(tags, [7, 9]);
    }

    /// `Transport::open` gives the same endpoint behind the trait object.
    pub fn through_the_trait(kind: EpKind, provider: &str) {
        let t = transport(kind, provider);
        let cfg = config(provider, &[]);
        let (mut a, mut b) = match (t.open(&cfg), t.open(&cfg)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(err), _) | (_, Err(err)) => {
                assert!(matches!(err, TransportError::Unavailable { .. }), "{err}");
                assert!(!fabric_required(), "{err}");
                eprintln!("skipping: {err}");
                return;
            }
        };
        assert_eq!(t.scheme(), expected_scheme(kind, provider));
        let (a_keys, b_keys) = link_keys();
        let pb = a.insert_peer(&b.local_addr(), &a_keys).unwrap();
        b.insert_peer(&a.local_addr(), &b_keys).unwrap();
        a.send(pb, frame(b"via dyn Endpoint"))
            .unwrap_or_else(|e| panic!("send: {e}"));
        let start = Instant::now();
        let mut events = Vec::new();
        loop {
            a.poll(&mut Vec::new()).unwrap();
            b.poll(&mut events).unwrap();
            if let Some(f) = events.iter().find_map(|e| match e {
                Event::Frame { frame, .. } => Some(frame.clone()),
                _ => None,
            }) {
                assert_eq!(payload_of(&f), b"via dyn Endpoint");
                break;
            }
            assert!(start.elapsed() < DEADLINE, "timed out");
        }
    }
}

#[cfg(efabus_libfabric)]
macro_rules! provider_suite {
    ($name:ident, $kind:expr, $provider:expr) => {
        mod $name {
            use super::suite;
            use efabus_transports::fabric::EpKind;

            #[test]
            fn exchange_both_directions() {
                suite::exchange_both_directions($kind, $provider, &[]);
            }

            #[test]
            fn many_frames_repost_receives() {
                suite::many_frames($kind, $provider, &[]);
            }

            #[test]
            fn max_size_frames_and_too_large() {
                suite::max_size_and_too_large($kind, $provider, &[]);
            }

            #[test]
            fn forced_prefix_and_registration() {
                suite::forced_prefix_and_mr($kind, $provider);
            }

            #[test]
            fn forced_path_with_many_frames() {
                suite::many_frames(
                    $kind,
                    $provider,
                    &[("force_prefix", "176"), ("force_mr_local", "true")],
                );
            }

            #[test]
            fn strangers_and_forgeries_are_dropped() {
                suite::strangers_and_forgeries_are_dropped($kind, $provider);
            }

            #[test]
            fn completion_queues_are_read_as_needed() {
                suite::completion_queues_are_read_as_needed($kind, $provider);
            }

            #[test]
            fn flush_posts_without_reading() {
                suite::flush_posts_without_reading($kind, $provider);
            }

            #[test]
            fn bursts_are_packed() {
                suite::bursts_are_packed($kind, $provider);
            }

            #[test]
            fn packing_respects_a_smaller_peer() {
                suite::packing_respects_a_smaller_peer($kind, $provider);
            }

            #[test]
            fn the_source_is_checked_where_reported() {
                suite::the_source_is_checked_where_reported($kind, $provider);
            }

            #[test]
            fn replayed_messages_are_refused() {
                suite::replayed_messages_are_refused($kind, $provider);
            }

            #[test]
            fn unused_addresses_are_evicted() {
                suite::unused_addresses_are_evicted($kind, $provider);
            }

            #[test]
            fn oversized_message_is_dropped() {
                suite::oversized_message_is_dropped($kind, $provider);
            }

            #[test]
            fn through_the_trait() {
                suite::through_the_trait($kind, $provider);
            }
        }
    };
}

#[cfg(efabus_libfabric)]
#[test]
fn hostile_endpoint_frames_end_the_link() {
    for provider in ["tcp;ofi_rxm", "sockets", "shm"] {
        suite::hostile_endpoint_frames_end_the_link(provider);
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn sends_in_flight_cap_the_wait() {
    use efabus_transports::fabric::EpKind;
    suite::sends_in_flight_cap_the_wait(EpKind::Rdm, "udp;ofi_rxd", true);
    suite::sends_in_flight_cap_the_wait(EpKind::Rdm, "sockets", false);
    suite::sends_in_flight_cap_the_wait(EpKind::Dgram, "udp", false);
}

/// Every provider here offers wait sets (efa on libfabric 1.17 does not);
/// `sockets` is polled all the same (see the endpoint's set-up).
#[cfg(efabus_libfabric)]
#[test]
fn wait_fd_announces_frames() {
    use efabus_transports::fabric::EpKind;
    suite::wait_fd_announces_frames(EpKind::Rdm, "tcp;ofi_rxm");
    suite::wait_fd_announces_frames(EpKind::Rdm, "udp;ofi_rxd");
    suite::wait_fd_announces_frames(EpKind::Dgram, "udp");
    if let Some((a, _)) = suite::pair(EpKind::Rdm, "sockets", &[]) {
        use efabus_core::transport::Endpoint;
        assert_eq!(a.readiness(), efabus_core::transport::Readiness::MustPoll);
    }
}

#[cfg(efabus_libfabric)]
provider_suite!(rdm_tcp_rxm, EpKind::Rdm, "tcp;ofi_rxm");
#[cfg(efabus_libfabric)]
provider_suite!(rdm_udp_rxd, EpKind::Rdm, "udp;ofi_rxd");
#[cfg(efabus_libfabric)]
provider_suite!(rdm_sockets, EpKind::Rdm, "sockets");
#[cfg(efabus_libfabric)]
provider_suite!(dgram_udp, EpKind::Dgram, "udp");

#[cfg(efabus_libfabric)]
provider_suite!(rdm_shm, EpKind::Rdm, "shm");

/// This machine's loopback RDM providers.
#[cfg(efabus_libfabric)]
const RDM_PROVIDERS: [&str; 3] = ["tcp;ofi_rxm", "udp;ofi_rxd", "sockets"];

/// Lending and uncopied sends on the reliable endpoints (a burst to a
/// datagram receiver may lose messages, which these counts do not allow).
#[cfg(efabus_libfabric)]
#[test]
fn rdm_large_frames_are_lent() {
    for provider in RDM_PROVIDERS {
        suite::large_frames_are_lent(efabus_transports::fabric::EpKind::Rdm, provider);
    }
}

/// Multi-receive buffers on every RDM provider here.
#[cfg(efabus_libfabric)]
#[test]
fn rdm_multi_receive_buffers_take_many_messages() {
    for provider in RDM_PROVIDERS.iter().chain(&["shm"]) {
        suite::multi_receive_buffers_take_many_messages(provider);
        suite::kept_frames_hold_at_most_half_the_multi_receive_buffers(provider);
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_large_bodies_are_sent_uncopied() {
    for provider in RDM_PROVIDERS {
        suite::large_bodies_are_sent_uncopied(efabus_transports::fabric::EpKind::Rdm, provider);
    }
}

/// Rendezvous on every RDM provider here: sizes around the eager limit,
/// the forced prefix and registration paths, 64 MiB, one registration for
/// a fan-out, the bounds and abandoned transfers.
#[cfg(efabus_libfabric)]
const RENDEZVOUS_PROVIDERS: [&str; 4] = ["tcp;ofi_rxm", "udp;ofi_rxd", "sockets", "shm"];
/// Those whose reads are used (not `ofi_rxd`'s).
#[cfg(efabus_libfabric)]
const READING_PROVIDERS: [&str; 3] = ["tcp;ofi_rxm", "sockets", "shm"];

#[cfg(efabus_libfabric)]
#[test]
fn rdm_rendezvous_moves_large_frames() {
    for provider in RENDEZVOUS_PROVIDERS {
        suite::rendezvous_moves_large_frames(provider, &[]);
        suite::rendezvous_moves_large_frames(
            provider,
            &[("force_prefix", "176"), ("force_mr_local", "true")],
        );
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_held_reads_wait_for_their_release() {
    for provider in READING_PROVIDERS {
        suite::held_reads_wait_for_their_release(provider);
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_a_read_ending_after_its_link_closed_is_given_up() {
    for provider in READING_PROVIDERS {
        let in_flight = suite::a_read_ending_after_its_link_closed_is_given_up(provider);
        // `tcp;ofi_rxm` serves a read only in its sender's polls; `sockets`
        // has a progress thread of its own, and `shm` reads in the caller.
        if provider == "tcp;ofi_rxm" {
            assert_ne!(in_flight, Some(false), "{provider} read without its sender");
        }
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_queued_descriptors_are_bounded_across_peers() {
    for provider in READING_PROVIDERS {
        suite::queued_descriptors_are_bounded_across_peers(provider);
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_slow_read_posts_pace_reads() {
    for provider in READING_PROVIDERS {
        suite::slow_read_posts_pace_reads(provider, false);
    }
    suite::slow_read_posts_pace_reads("shm", true);
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_rendezvous_moves_64_mib() {
    for provider in READING_PROVIDERS {
        suite::rendezvous_moves_64_mib(provider);
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_rendezvous_lands_large_frames_in_huge_pages_over_shm_when_asked() {
    let expected = u64::from(efabus_transports::fabric::huge_page_size().is_some());
    let asked = [("huge_landing", "true")];
    if let Some(huge) = suite::huge_landings_of_a_mebibyte_frame("shm", &asked) {
        assert_eq!(huge, expected, "shm, asked");
    }
    if let Some(huge) = suite::huge_landings_of_a_mebibyte_frame("shm", &[]) {
        assert_eq!(huge, 0, "shm, not asked");
    }
    // Its reads go through sockets: nothing to gain there.
    if let Some(huge) = suite::huge_landings_of_a_mebibyte_frame("tcp;ofi_rxm", &asked) {
        assert_eq!(huge, 0, "tcp;ofi_rxm");
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_rendezvous_shares_one_registration() {
    for provider in READING_PROVIDERS {
        suite::rendezvous_shares_one_registration(provider);
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_rendezvous_both_ways_with_few_send_slots() {
    for provider in READING_PROVIDERS {
        suite::rendezvous_both_ways_with_few_send_slots(provider);
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_rendezvous_bounds_and_abandoned_transfers() {
    for provider in READING_PROVIDERS {
        suite::rendezvous_bounds_and_abandoned_transfers(provider);
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_shm_sender_with_a_longer_name_fits_the_receivers_buffers() {
    suite::shm_sender_with_a_longer_name_fits_the_receivers_buffers();
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_shm_closed_in_process_peer_ends_its_link() {
    suite::closed_in_process_shm_peer_ends_its_link();
}

/// Backpressure on the reliable endpoints (a datagram receiver that is not
/// polled may drop, so DGRAM is left out).
#[cfg(efabus_libfabric)]
#[test]
fn rdm_backpressure_then_writable() {
    for provider in RDM_PROVIDERS {
        suite::backpressure_then_writable(efabus_transports::fabric::EpKind::Rdm, provider);
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn a_read_of_a_closed_link_does_not_hold_up_others() {
    suite::a_read_of_a_closed_link_does_not_hold_up_others("tcp;ofi_rxm");
}

#[cfg(efabus_libfabric)]
#[test]
fn closing_with_reads_never_served_does_not_crash() {
    suite::closing_with_reads_never_served_does_not_crash("tcp;ofi_rxm");
}

#[cfg(efabus_libfabric)]
#[test]
fn closing_with_reads_served_closes() {
    suite::closing_with_reads_served_closes("tcp;ofi_rxm");
}

#[cfg(efabus_libfabric)]
#[test]
fn an_abandoned_transfer_keeps_its_body() {
    for provider in ["tcp;ofi_rxm", "shm"] {
        suite::an_abandoned_transfer_keeps_its_body(provider);
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn an_early_done_does_not_free_a_body_being_read() {
    suite::an_early_done_does_not_free_a_body_being_read();
}

#[cfg(efabus_libfabric)]
#[test]
fn a_closed_link_s_body_waits_for_its_fence() {
    suite::a_closed_link_s_body_waits_for_its_fence();
}

#[cfg(efabus_libfabric)]
#[test]
fn rdm_landing_registrations_are_counted() {
    for provider in READING_PROVIDERS {
        suite::landing_registrations_are_counted(provider);
    }
}

#[cfg(efabus_libfabric)]
#[test]
fn a_queued_read_of_a_closed_in_process_shm_peer_is_counted() {
    suite::a_queued_read_of_a_closed_in_process_shm_peer_is_counted();
}

#[cfg(efabus_libfabric)]
#[test]
fn shm_names_without_a_region_are_refused() {
    suite::shm_names_without_a_region_are_refused();
}

#[cfg(efabus_libfabric)]
#[test]
fn shm_evicts_a_departed_peer_first() {
    suite::shm_evicts_a_departed_peer_first();
}
