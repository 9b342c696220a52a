//! Credit-based flow control against a model of a reliable, reordering
//! link: the sender, held by a [`CreditWindow`], never has more pieces or
//! bytes beyond the receiver's acknowledgement than the window allows, so a
//! receiver whose reorder window and posted buffers are exactly that size
//! never refuses a piece; credits may arrive late, reordered or twice; and
//! every frame is delivered once, in order.

mod link_common;

use std::time::Instant;

use efabus_core::credit::{CreditGrant, CreditWindow, Window, CREDIT_DELAY};
use efabus_core::frame::Credit;
use efabus_core::link::{LinkReceiver, LinkSender};
use link_common::{config, frame_id, test_frame};
use proptest::prelude::*;

/// One step of the schedule: which party acts, and a choice among what is
/// in transit.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// The sender sends its next frame if the window admits it.
    Send,
    /// One piece in transit (chosen by the value) reaches the receiver.
    Deliver(usize),
    /// The receiver sends a credit if one is due.
    Grant,
    /// One credit in transit reaches the sender, possibly also staying in
    /// transit (a duplicate).
    Credit(usize, bool),
    /// Time passes beyond the credit delay.
    Tick,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => Just(Step::Send),
        4 => any::<usize>().prop_map(Step::Deliver),
        2 => Just(Step::Grant),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(i, d)| Step::Credit(i, d)),
        1 => Just(Step::Tick),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn sender_stays_within_the_window_and_everything_arrives_once_in_order(
        sizes in proptest::collection::vec(13usize..5_000, 1..80),
        pieces in 1u32..24,
        bytes in 1_500u64..40_000,
        schedule in proptest::collection::vec(step(), 0..600),
    ) {
        let limit = 1472;
        let window = Window { pieces, bytes };
        // The receiver's reorder window is exactly the credit window: a
        // sender that overran it would be refused.
        let cfg = config(
            limit,
            true,
            false,
            pieces as usize,
            std::time::Duration::from_millis(100),
            std::time::Duration::from_secs(3600),
        );
        let mut sender = LinkSender::new(&cfg).unwrap();
        let mut credit_window = CreditWindow::new(window, window);
        let mut receiver = LinkReceiver::new(&cfg);
        let mut grant = CreditGrant::new(window);

        let mut now = Instant::now();
        let mut next = 0usize;
        // (sequence, piece) in transit, and credits in transit.
        let mut wire: Vec<(u64, bytes::Bytes)> = Vec::new();
        let mut credits: Vec<Credit> = Vec::new();
        let mut out = Vec::new();
        let mut sent: Vec<(u64, u32, u64)> = Vec::new();

        let through = |rx: &LinkReceiver| rx.expected_sequence().unwrap() - 1;

        // The schedule, then a fair finish: deliver everything, grant,
        // credit, until all frames are through.
        let finish = std::iter::repeat_n(
            [Step::Send, Step::Deliver(0), Step::Tick, Step::Grant, Step::Credit(0, false)],
            sizes.len() * 8 + 64,
        )
        .flatten();
        for step in schedule.into_iter().chain(finish) {
            match step {
                Step::Send if next < sizes.len() => {
                    let frame = test_frame(next as u64, sizes[next], sizes[next] / 2);
                    let (need, need_bytes) = sender.wire_size(frame.len());
                    if !credit_window.admits(need, need_bytes) {
                        continue;
                    }
                    let seq = sender.next_sequence();
                    let mut pieces_out = Vec::new();
                    sender.prepare(frame, &mut pieces_out).unwrap();
                    let total: u64 = pieces_out.iter().map(|p| p.len() as u64).sum();
                    prop_assert_eq!((pieces_out.len() as u32, total), (need, need_bytes));
                    credit_window.sent(seq, need, total);
                    sent.push((seq, need, total));
                    wire.extend(pieces_out.into_iter().map(|p| (seq, p.to_bytes())));
                    next += 1;
                }
                Step::Send => {}
                Step::Deliver(choice) if !wire.is_empty() => {
                    let (_, piece) = wire.swap_remove(choice % wire.len());
                    grant.on_received(piece.len());
                    receiver.receive(now, piece, &mut out).unwrap();
                }
                Step::Deliver(_) => {}
                Step::Grant => {
                    if let Some(credit) = grant.due(now, through(&receiver)) {
                        grant.sent(now, &credit);
                        credits.push(credit);
                    }
                }
                Step::Credit(choice, duplicate) if !credits.is_empty() => {
                    let index = choice % credits.len();
                    let credit = if duplicate {
                        credits[index]
                    } else {
                        credits.swap_remove(index)
                    };
                    credit_window.on_credit(&credit);
                }
                Step::Credit(..) => {}
                Step::Tick => now += CREDIT_DELAY,
            }
            // What the receiver has not yet acknowledged as delivered is
            // within the window, unless one frame alone exceeds it.
            let acked = through(&receiver);
            let beyond: Vec<_> = sent.iter().filter(|s| s.0 > acked).collect();
            let (p, b) = beyond
                .iter()
                .fold((0u64, 0u64), |(p, b), s| (p + u64::from(s.1), b + s.2));
            prop_assert!(
                beyond.len() <= 1 || (p <= u64::from(pieces) && b <= bytes),
                "{} frames, {} pieces, {} bytes beyond {}",
                beyond.len(), p, b, acked
            );
            prop_assert!(wire.len() as u64 <= u64::from(pieces).max(p));
            if next == sizes.len() && wire.is_empty() && out.len() == sizes.len() {
                break;
            }
        }
        let ids: Vec<u64> = out.iter().map(|f| frame_id(f)).collect();
        prop_assert_eq!(ids, (0..sizes.len() as u64).collect::<Vec<_>>());
        prop_assert_eq!(receiver.stats().window_exceeded, 0);
    }
}
