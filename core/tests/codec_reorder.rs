//! The reorder buffer against a model: items permuted within the window and
//! duplicated come out in exact sequence order, once each; under the skip
//! policy, losses are skipped and accounted for.

use std::time::{Duration, Instant};

use efabus_core::reorder::{GapPolicy, Pushed, ReorderBuffer, ReorderConfig, ReorderError};
use proptest::prelude::*;

/// Arrival order of sequences 1..=n where each is displaced by less than
/// `jitter` positions: sorted by `seq + offset` with offsets in 0..jitter.
/// When sequence s arrives, every sequence up to s - jitter has arrived, so
/// a window of `jitter` always suffices.
fn arrivals(offsets: &[u64]) -> Vec<u64> {
    let mut keyed: Vec<(u64, u64)> = offsets
        .iter()
        .enumerate()
        .map(|(i, &off)| (i as u64 + 1 + off, i as u64 + 1))
        .collect();
    keyed.sort();
    keyed.into_iter().map(|(_, seq)| seq).collect()
}

/// Adds duplicates, each placed somewhere after its original.
fn with_duplicates(order: &[u64], dups: &[(usize, usize)]) -> (Vec<u64>, u64) {
    let mut out = order.to_vec();
    let mut added = 0;
    for &(which, later) in dups {
        if out.is_empty() {
            break;
        }
        let pos = which % out.len();
        let seq = out[pos];
        let at = pos + 1 + later % (out.len() - pos);
        out.insert(at, seq);
        added += 1;
    }
    (out, added)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn wait_policy_releases_everything_in_order(
        capacity in 1usize..64,
        raw_offsets in proptest::collection::vec(any::<u64>(), 0..300),
        dups in proptest::collection::vec((any::<usize>(), any::<usize>()), 0..40),
    ) {
        let offsets: Vec<u64> = raw_offsets.iter().map(|o| o % capacity as u64).collect();
        let n = offsets.len() as u64;
        let (order, added) = with_duplicates(&arrivals(&offsets), &dups);
        let mut buf = ReorderBuffer::new(ReorderConfig { capacity, gap_policy: GapPolicy::Wait });
        let now = Instant::now();
        let mut out = Vec::new();
        for seq in order {
            let before = out.len();
            match buf.push(now, seq, seq, &mut out) {
                Ok(Pushed::Accepted { released }) => prop_assert_eq!(released, out.len() - before),
                Ok(Pushed::Duplicate { released }) => {
                    prop_assert_eq!(released, 0);
                    prop_assert_eq!(out.len(), before);
                }
                Err(err) => prop_assert!(false, "unexpected {}", err),
            }
            prop_assert!(buf.held() < capacity);
        }
        prop_assert_eq!(out, (1..=n).collect::<Vec<_>>());
        let stats = *buf.stats();
        prop_assert_eq!(stats.duplicates, added);
        prop_assert_eq!(stats.released, n);
        prop_assert_eq!((stats.lost, stats.window_exceeded), (0, 0));
        prop_assert_eq!(buf.held(), 0);
        prop_assert_eq!(buf.expected(), n + 1);
    }

    #[test]
    fn skip_policy_delivers_an_increasing_subset(
        capacity in 1usize..32,
        raw_offsets in proptest::collection::vec(any::<u64>(), 0..300),
        drops in proptest::collection::vec(any::<bool>(), 1..50),
        dups in proptest::collection::vec((any::<usize>(), any::<usize>()), 0..20),
        // Items beyond the window are allowed here: they force skips.
        spread in 1u64..48,
        gap_ms in 1u64..20,
        step_us in 0u64..3000,
    ) {
        let offsets: Vec<u64> = raw_offsets.iter().map(|o| o % spread).collect();
        let order: Vec<u64> = arrivals(&offsets)
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !drops[i % drops.len()])
            .map(|(_, seq)| seq)
            .collect();
        let delivered: std::collections::BTreeSet<u64> = order.iter().copied().collect();
        let (order, _) = with_duplicates(&order, &dups);
        let limit = Duration::from_millis(gap_ms);
        let mut buf = ReorderBuffer::new(ReorderConfig { capacity, gap_policy: GapPolicy::SkipAfter(limit) });
        let start = Instant::now();
        let mut out = Vec::new();
        let mut now = start;
        for seq in order {
            now += Duration::from_micros(step_us);
            prop_assert!(buf.push(now, seq, seq, &mut out).is_ok());
            prop_assert!(buf.held() < capacity);
            // No held item has waited past the limit.
            if let Some(deadline) = buf.next_deadline() {
                prop_assert!(deadline > now);
            }
        }
        // Once the limit has passed, nothing is held any more.
        let end = now + limit;
        buf.poll(end, &mut out);
        prop_assert_eq!(buf.held(), 0);
        prop_assert_eq!(buf.next_deadline(), None);

        prop_assert!(out.windows(2).all(|w| w[0] < w[1]), "not increasing: {:?}", out);
        prop_assert!(out.iter().all(|s| delivered.contains(s)));
        let stats = *buf.stats();
        prop_assert_eq!(stats.released, out.len() as u64);
        // Every sequence before `expected` was either released or lost.
        prop_assert_eq!(stats.released + stats.lost, buf.expected() - 1);
        if let Some(&last) = delivered.iter().next_back() {
            prop_assert_eq!(buf.expected(), last + 1);
        }
    }

    #[test]
    fn skip_policy_without_loss_or_timeout_is_exact(
        capacity in 1usize..64,
        raw_offsets in proptest::collection::vec(any::<u64>(), 0..200),
    ) {
        let offsets: Vec<u64> = raw_offsets.iter().map(|o| o % capacity as u64).collect();
        let n = offsets.len() as u64;
        let mut buf = ReorderBuffer::new(ReorderConfig {
            capacity,
            gap_policy: GapPolicy::SkipAfter(Duration::from_secs(3600)),
        });
        let now = Instant::now();
        let mut out = Vec::new();
        for seq in arrivals(&offsets) {
            buf.push(now, seq, seq, &mut out).expect("within window");
        }
        prop_assert_eq!(out, (1..=n).collect::<Vec<_>>());
        prop_assert_eq!(buf.stats().lost, 0);
    }
}

#[test]
fn wait_policy_refuses_beyond_the_window() {
    let now = Instant::now();
    let mut buf = ReorderBuffer::new(ReorderConfig {
        capacity: 4,
        gap_policy: GapPolicy::Wait,
    });
    let mut out = Vec::new();
    assert_eq!(
        buf.push(now, 4, "d", &mut out),
        Ok(Pushed::Accepted { released: 0 })
    );
    assert_eq!(
        buf.push(now, 5, "e", &mut out),
        Err(ReorderError::WindowExceeded {
            seq: 5,
            expected: 1,
            capacity: 4
        })
    );
    assert_eq!(buf.stats().window_exceeded, 1);
    // Waiting never gives up a gap.
    assert_eq!(buf.poll(now + Duration::from_secs(3600), &mut out), 0);
    assert_eq!(buf.next_deadline(), None);
    for (seq, item) in [(2, "b"), (3, "c"), (1, "a")] {
        buf.push(now, seq, item, &mut out).expect("in window");
    }
    assert_eq!(out, ["a", "b", "c", "d"]);
    // The window has moved: 5 fits now.
    assert_eq!(
        buf.push(now, 5, "e", &mut out),
        Ok(Pushed::Accepted { released: 1 })
    );
}

#[test]
fn skip_policy_jumps_the_window_in_order() {
    let now = Instant::now();
    let mut buf = ReorderBuffer::new(ReorderConfig {
        capacity: 4,
        gap_policy: GapPolicy::SkipAfter(Duration::from_secs(60)),
    });
    let mut out = Vec::new();
    buf.push(now, 2, 2, &mut out).expect("in window");
    buf.push(now, 3, 3, &mut out).expect("in window");
    // 10 pushes the window to 7..=10: 2 and 3 are released, 1 and 4..=6 lost.
    assert_eq!(
        buf.push(now, 10, 10, &mut out),
        Ok(Pushed::Accepted { released: 2 })
    );
    assert_eq!(out, [2, 3]);
    assert_eq!(buf.expected(), 7);
    let stats = *buf.stats();
    assert_eq!((stats.lost, stats.window_skips), (4, 1));
    buf.push(now, 7, 7, &mut out).expect("in window");
    buf.push(now, 8, 8, &mut out).expect("in window");
    buf.push(now, 9, 9, &mut out).expect("in window");
    assert_eq!(out, [2, 3, 7, 8, 9, 10]);
}

#[test]
fn each_gap_times_out_from_its_oldest_waiting_item() {
    let t0 = Instant::now();
    let limit = Duration::from_millis(10);
    let mut buf = ReorderBuffer::new(ReorderConfig {
        capacity: 16,
        gap_policy: GapPolicy::SkipAfter(limit),
    });
    let mut out = Vec::new();
    buf.push(t0, 5, 5, &mut out).expect("in window");
    buf.push(t0 + Duration::from_millis(5), 3, 3, &mut out)
        .expect("in window");
    // 5 arrived first, so its wait decides: at t0+10, 1..=4 give way.
    assert_eq!(buf.next_deadline(), Some(t0 + limit));
    assert_eq!(buf.poll(t0 + limit, &mut out), 2);
    assert_eq!(out, [3, 5]);
    assert_eq!(buf.stats().lost, 3);
    assert_eq!(buf.stats().gap_timeouts, 1);
}
