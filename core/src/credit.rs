//! Credit-based flow control for sequenced links.
//!
//! A receiver has a fixed number of posted receive buffers and a bounded
//! amount of memory for frames it must hold back (reordering, reassembly).
//! A [`CreditWindow`] keeps the sending side within both: it allows at most
//! a number of wire messages ("pieces") and bytes beyond the last sequence
//! the receiver has acknowledged. A [`CreditGrant`] decides on the receiving
//! side when to tell the sender how far it got, in a
//! [`Credit`] frame.
//!
//! A credit is cumulative, not additive: it says "everything up to
//! `ack_seq` is taken; you may have `messages` pieces and `bytes` bytes
//! beyond it". A lost, duplicated or late credit therefore never corrupts
//! the window; the next one repairs it. Credits travel outside the link's
//! sequence so that they never wait for credit themselves. On a lossy link
//! a receiver still taking in a message of more pieces than the window
//! adds what it holds of it to `messages`: the sender of such a message
//! sends a window of it at a time, and goes on as its pieces arrive.
//!
//! The initial window comes from the negotiated queue sizes
//! ([`crate::caps::LinkParams::send_window`]); the receiver's credits may
//! lower or raise it, but never above what the sender's own limits allow.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::frame::Credit;

/// The limits of one direction of a link, in pieces and bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Wire messages the sender may have beyond the acknowledged sequence.
    pub pieces: u32,
    /// Wire bytes the sender may have beyond the acknowledged sequence.
    pub bytes: u64,
}

/// One frame not yet acknowledged.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    seq: u64,
    pieces: u32,
    bytes: u64,
}

/// The sending side: what may still be sent.
#[derive(Debug)]
pub struct CreditWindow {
    /// The most the sender itself allows, whatever the receiver says.
    ceiling: Window,
    /// The window in force.
    window: Window,
    /// Highest sequence acknowledged.
    acked: u64,
    /// Highest sequence sent.
    sent: u64,
    in_flight: VecDeque<InFlight>,
    pieces: u64,
    bytes: u64,
    stats: CreditStats,
}

/// Counters of a [`CreditWindow`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CreditStats {
    /// Credits applied.
    pub credits: u64,
    /// Credits ignored: acknowledging what was never sent, or older than
    /// one already applied.
    pub ignored: u64,
    /// Times a frame had to wait (or was dropped, on lossy links) because
    /// the window was full.
    pub stalls: u64,
    /// Times the window was reset after credits stopped arriving (lossy
    /// links).
    pub resets: u64,
}

impl CreditWindow {
    /// A window starting at `initial` and never above `ceiling`.
    pub fn new(initial: Window, ceiling: Window) -> CreditWindow {
        CreditWindow {
            ceiling,
            window: min_window(initial, ceiling),
            acked: 0,
            sent: 0,
            in_flight: VecDeque::new(),
            pieces: 0,
            bytes: 0,
            stats: CreditStats::default(),
        }
    }

    /// May a frame of `pieces` pieces and `bytes` wire bytes go now? With
    /// nothing in flight, anything may: a frame larger than the window must
    /// still pass, alone.
    pub fn admits(&self, pieces: u32, bytes: u64) -> bool {
        self.in_flight.is_empty()
            || (self.pieces + u64::from(pieces) <= u64::from(self.window.pieces)
                && self.bytes + bytes <= self.window.bytes)
    }

    /// Count a stall (the caller found [`Self::admits`] false).
    pub fn note_stall(&mut self) {
        self.stats.stalls += 1;
    }

    /// Record frame `seq` as sent. Sequences must increase.
    pub fn sent(&mut self, seq: u64, pieces: u32, bytes: u64) {
        debug_assert!(seq > self.sent, "sequences increase");
        self.sent = seq;
        self.in_flight.push_back(InFlight { seq, pieces, bytes });
        self.pieces += u64::from(pieces);
        self.bytes += bytes;
    }

    /// Apply a credit from the receiver. Returns false when it was ignored
    /// (it acknowledges a sequence never sent, or less than already known).
    pub fn on_credit(&mut self, credit: &Credit) -> bool {
        if credit.ack_seq > self.sent || credit.ack_seq < self.acked {
            self.stats.ignored += 1;
            return false;
        }
        self.acked = credit.ack_seq;
        while let Some(front) = self.in_flight.front() {
            if front.seq > self.acked {
                break;
            }
            self.pieces -= u64::from(front.pieces);
            self.bytes -= front.bytes;
            self.in_flight.pop_front();
        }
        let offered = Window {
            pieces: credit.messages.max(1),
            bytes: credit.bytes.max(1),
        };
        self.window = min_window(offered, self.ceiling);
        self.stats.credits += 1;
        true
    }

    /// Forget everything in flight, as if acknowledged: for lossy links
    /// whose credits stopped arriving (the receiver gives such frames up by
    /// time anyway).
    pub fn reset(&mut self) {
        self.acked = self.sent;
        self.in_flight.clear();
        self.pieces = 0;
        self.bytes = 0;
        self.stats.resets += 1;
    }

    /// The window in force.
    pub fn window(&self) -> Window {
        self.window
    }

    /// Frames sent and not yet acknowledged.
    pub fn frames_in_flight(&self) -> u64 {
        self.in_flight.len() as u64
    }

    /// Pieces sent and not yet acknowledged.
    pub fn pieces_in_flight(&self) -> u64 {
        self.pieces
    }

    /// Bytes sent and not yet acknowledged.
    pub fn bytes_in_flight(&self) -> u64 {
        self.bytes
    }

    /// Counters since creation.
    pub fn stats(&self) -> &CreditStats {
        &self.stats
    }
}

fn min_window(a: Window, b: Window) -> Window {
    Window {
        pieces: a.pieces.min(b.pieces),
        bytes: a.bytes.min(b.bytes),
    }
}

/// How long a receiver may sit on an acknowledgement that has not reached
/// a quarter of the window.
pub const CREDIT_DELAY: Duration = Duration::from_millis(1);

/// How long after its last credit a lossy link's receiver, with nothing
/// new to acknowledge, sends that credit once more: a sender whose window
/// it filled would otherwise wait, if it was lost, until it gives up on
/// what it has in flight.
pub const CREDIT_REPEAT_AFTER: Duration = Duration::from_millis(20);

/// The receiving side: when to send a credit, and what it says.
#[derive(Debug)]
pub struct CreditGrant {
    window: Window,
    /// The acknowledgement last sent.
    last_ack: u64,
    last_sent_at: Option<Instant>,
    /// Received since the last credit was sent.
    pieces_since: u64,
    bytes_since: u64,
    /// The last credit has not been sent again (see [`Self::repeat_due`]).
    unrepeated: bool,
    /// Pieces held of the next message still arriving, granted on top of
    /// the window (see [`Self::note_partial`]), and as the last credit
    /// granted them.
    held: u64,
    last_held: u64,
    /// The peer asked for a credit since the last one was sent (a probe,
    /// which takes no sequence: see [`Self::ask`]).
    asked: bool,
}

impl CreditGrant {
    /// A grant advertising `window` in every credit.
    pub fn new(window: Window) -> CreditGrant {
        CreditGrant {
            window,
            last_ack: 0,
            last_sent_at: None,
            pieces_since: 0,
            bytes_since: 0,
            unrepeated: false,
            held: 0,
            last_held: 0,
            asked: false,
        }
    }

    /// The peer asks for a credit (a datagram link's probe): one is owed,
    /// and due at once, though nothing new may be acknowledged. A sender
    /// that has had none yet learns so that its frames arrive, one whose
    /// credits were lost what has been settled.
    pub fn ask(&mut self) {
        self.asked = true;
    }

    /// Lossy links: the receiver holds `held` of the `count` pieces of
    /// the next message, still arriving. A message of more pieces than
    /// the window goes a window at a time (its pieces beyond the window
    /// would find no posted buffer): credits grant what is held of it on
    /// top of the window, for a message of more than half the window, one
    /// more credit each quarter window of its pieces.
    pub fn note_partial(&mut self, held: u32, count: u32) {
        self.held = if u64::from(count) * 2 > u64::from(self.window.pieces) {
            u64::from(held)
        } else {
            0
        };
    }

    /// Whether what is held of a message still arriving grew by a quarter
    /// window since the last credit.
    fn held_grew(&self) -> bool {
        self.held >= self.last_held + u64::from(self.window.pieces / 4).max(1)
    }

    /// Count one wire message of `bytes` taken from the link.
    pub fn on_received(&mut self, bytes: usize) {
        self.pieces_since += 1;
        self.bytes_since += bytes as u64;
    }

    /// The credit to send now, if one is due, given that every sequence up
    /// to `through` has been delivered (or given up). One is due when
    /// `through` moved and a quarter of the window has been received since
    /// the last credit, or [`CREDIT_DELAY`] has passed; and at once when
    /// the peer asked for one ([`Self::ask`]).
    pub fn due(&self, now: Instant, through: u64) -> Option<Credit> {
        if self.asked {
            return Some(self.credit(through.max(self.last_ack)));
        }
        if through <= self.last_ack {
            return self.held_grew().then(|| self.credit(self.last_ack));
        }
        let quarter_pieces = u64::from(self.window.pieces / 4).max(1);
        let quarter_bytes = (self.window.bytes / 4).max(1);
        let waited = self
            .last_sent_at
            .is_none_or(|at| now.saturating_duration_since(at) >= CREDIT_DELAY);
        (self.pieces_since >= quarter_pieces || self.bytes_since >= quarter_bytes || waited)
            .then_some(self.credit(through))
    }

    /// Whether an acknowledgement is owed at all (`through` moved since the
    /// last credit, what is held of a message still arriving grew, or the
    /// peer asked for one): the
    /// caller keeps asking [`Self::due`] until it is not.
    pub fn owes(&self, through: u64) -> bool {
        through > self.last_ack || self.held_grew() || self.asked
    }

    /// The credit for `through`, due or not: the window beyond it, and
    /// what is held of a message still arriving.
    pub fn credit(&self, through: u64) -> Credit {
        let held = u32::try_from(self.held).unwrap_or(u32::MAX);
        Credit {
            messages: self.window.pieces.saturating_add(held),
            bytes: self.window.bytes,
            ack_seq: through,
        }
    }

    /// Record that `credit` was handed to the endpoint.
    pub fn sent(&mut self, now: Instant, credit: &Credit) {
        self.last_ack = self.last_ack.max(credit.ack_seq);
        self.last_held = u64::from(credit.messages.saturating_sub(self.window.pieces));
        self.last_sent_at = Some(now);
        self.pieces_since = 0;
        self.bytes_since = 0;
        self.unrepeated = true;
        self.asked = false;
    }

    /// For a lossy link: the last credit, to send once more, when nothing
    /// new has been acknowledged for [`CREDIT_REPEAT_AFTER`] since it went
    /// (credits are cumulative: a sender takes one it had). A credit lost
    /// then costs that wait, not the sender's.
    pub fn repeat_due(&self, now: Instant, through: u64) -> Option<Credit> {
        let at = self.repeat_at()?;
        (through <= self.last_ack && now >= at).then(|| self.credit(self.last_ack))
    }

    /// When the last credit is due to be sent again, if it is to be.
    pub fn repeat_at(&self) -> Option<Instant> {
        let sent = self.last_sent_at.filter(|_| self.unrepeated)?;
        sent.checked_add(CREDIT_REPEAT_AFTER)
    }

    /// Record that the last credit was sent again.
    pub fn repeated(&mut self) {
        self.unrepeated = false;
    }

    /// The window this grant advertises.
    pub fn window(&self) -> Window {
        self.window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credit(ack_seq: u64, messages: u32, bytes: u64) -> Credit {
        Credit {
            messages,
            bytes,
            ack_seq,
        }
    }

    /// The last credit goes once more when nothing new was acknowledged
    /// for a while (a lost one then costs that wait), and only once.
    #[test]
    fn the_last_credit_is_repeated_once_after_a_quiet_while() {
        let window = Window {
            pieces: 8,
            bytes: 1 << 20,
        };
        let mut grant = CreditGrant::new(window);
        let start = Instant::now();
        assert_eq!(grant.repeat_at(), None, "nothing sent yet");
        let first = grant.credit(5);
        grant.sent(start, &first);
        let at = grant.repeat_at().expect("a repeat is due later");
        assert_eq!(at, start + CREDIT_REPEAT_AFTER);
        assert_eq!(grant.repeat_due(start, 5), None, "too soon");
        assert_eq!(grant.repeat_due(at, 5), Some(first));
        // Something new to acknowledge: a fresh credit, not a repeat.
        assert_eq!(grant.repeat_due(at, 6), None);
        grant.repeated();
        assert_eq!(grant.repeat_at(), None);
        assert_eq!(grant.repeat_due(at + CREDIT_REPEAT_AFTER, 5), None, "once");
        // The next credit is repeated in turn.
        grant.sent(at, &grant.credit(9));
        assert_eq!(
            grant.repeat_due(at + CREDIT_REPEAT_AFTER, 9),
            Some(grant.credit(9))
        );
    }

    /// A peer's probe asks for a credit: one is owed and due at once,
    /// with nothing new to acknowledge (the first of all included), and
    /// once sent, no more is owed.
    #[test]
    fn a_credit_asked_for_is_owed_at_once() {
        let window = Window {
            pieces: 8,
            bytes: 1 << 20,
        };
        let mut grant = CreditGrant::new(window);
        let now = Instant::now();
        assert!(!grant.owes(0));
        assert_eq!(grant.due(now, 0), None);
        grant.ask();
        assert!(grant.owes(0));
        assert_eq!(grant.due(now, 0), Some(grant.credit(0)));
        grant.sent(now, &grant.credit(0));
        assert!(!grant.owes(0));
        // Later, behind what was acknowledged: the last acknowledgement.
        grant.sent(now, &grant.credit(6));
        grant.ask();
        assert_eq!(grant.due(now, 6), Some(grant.credit(6)));
        assert_eq!(grant.due(now, 7), Some(grant.credit(7)), "not held back");
    }

    #[test]
    fn window_fills_and_credits_free_it() {
        let w = Window {
            pieces: 4,
            bytes: 1000,
        };
        let mut tx = CreditWindow::new(w, w);
        for seq in 1..=4 {
            assert!(tx.admits(1, 100));
            tx.sent(seq, 1, 100);
        }
        assert!(!tx.admits(1, 100), "four pieces in flight");
        assert!(tx.on_credit(&credit(2, 4, 1000)));
        assert_eq!(tx.pieces_in_flight(), 2);
        assert!(tx.admits(2, 100));
        assert!(!tx.admits(3, 100));
        // Bytes limit too.
        assert!(!tx.admits(1, 801));
    }

    #[test]
    fn a_frame_larger_than_the_window_goes_alone() {
        let w = Window {
            pieces: 2,
            bytes: 100,
        };
        let mut tx = CreditWindow::new(w, w);
        assert!(tx.admits(10, 10_000), "nothing in flight");
        tx.sent(1, 10, 10_000);
        assert!(!tx.admits(1, 1));
        assert!(tx.on_credit(&credit(1, 2, 100)));
        assert!(tx.admits(1, 1));
    }

    #[test]
    fn bogus_and_stale_credits_are_ignored() {
        let w = Window {
            pieces: 8,
            bytes: 8000,
        };
        let mut tx = CreditWindow::new(w, w);
        for seq in 1..=3 {
            tx.sent(seq, 1, 10);
        }
        assert!(!tx.on_credit(&credit(9, 8, 8000)), "never sent");
        assert!(tx.on_credit(&credit(2, 8, 8000)));
        assert!(!tx.on_credit(&credit(1, 8, 8000)), "older");
        assert_eq!(tx.stats().ignored, 2);
        assert_eq!(tx.pieces_in_flight(), 1);
    }

    #[test]
    fn the_receiver_cannot_raise_the_window_above_the_ceiling() {
        let initial = Window {
            pieces: 4,
            bytes: 400,
        };
        let ceiling = Window {
            pieces: 16,
            bytes: 1600,
        };
        let mut tx = CreditWindow::new(initial, ceiling);
        tx.sent(1, 1, 1);
        tx.on_credit(&credit(1, u32::MAX, u64::MAX));
        assert_eq!(tx.window(), ceiling);
        tx.on_credit(&credit(1, 0, 0));
        assert_eq!(
            tx.window(),
            Window {
                pieces: 1,
                bytes: 1
            },
            "zero is read as the least usable window"
        );
    }

    #[test]
    fn reset_forgets_what_is_in_flight() {
        let w = Window {
            pieces: 1,
            bytes: 100,
        };
        let mut tx = CreditWindow::new(w, w);
        tx.sent(1, 1, 10);
        assert!(!tx.admits(1, 10));
        tx.reset();
        assert!(tx.admits(1, 10));
        assert!(
            tx.on_credit(&credit(1, 1, 100)),
            "a late credit still applies"
        );
    }

    #[test]
    fn grant_is_due_at_a_quarter_window_or_after_the_delay() {
        let start = Instant::now();
        let mut grant = CreditGrant::new(Window {
            pieces: 8,
            bytes: 1 << 20,
        });
        assert_eq!(grant.due(start, 0), None, "nothing delivered");
        // First credit: nothing sent before, so it is due at once.
        let first = grant.due(start, 1).expect("first credit");
        grant.sent(start, &first);
        grant.on_received(10);
        assert_eq!(grant.due(start, 2), None, "one piece is below a quarter");
        grant.on_received(10);
        let second = grant.due(start, 3).expect("a quarter of the window");
        assert_eq!(second.ack_seq, 3);
        assert_eq!((second.messages, second.bytes), (8, 1 << 20));
        grant.sent(start, &second);
        grant.on_received(10);
        assert!(grant.owes(4));
        assert_eq!(grant.due(start, 4), None);
        assert!(
            grant.due(start + CREDIT_DELAY, 4).is_some(),
            "after the delay"
        );
        assert!(!grant.owes(3));
    }

    /// What is held of a message of more than half the window still
    /// arriving is granted on top of the window, a credit each quarter
    /// window of it, with nothing new acknowledged; a smaller message's
    /// pieces are not.
    #[test]
    fn pieces_held_of_a_large_message_are_granted_as_they_arrive() {
        let start = Instant::now();
        let mut grant = CreditGrant::new(Window {
            pieces: 8,
            bytes: 1 << 20,
        });
        let first = grant.due(start, 1).expect("first credit");
        grant.sent(start, &first);
        grant.note_partial(3, 4);
        assert!(!grant.owes(1), "a message of half the window or less");
        grant.note_partial(1, 20);
        assert!(!grant.owes(1), "less than a quarter window held");
        grant.note_partial(2, 20);
        assert!(grant.owes(1));
        let credit = grant.due(start, 1).expect("a quarter window held");
        assert_eq!((credit.ack_seq, credit.messages), (1, 10));
        grant.sent(start, &credit);
        grant.note_partial(3, 20);
        assert_eq!(grant.due(start, 1), None, "one more piece is not enough");
        grant.note_partial(4, 20);
        assert_eq!(grant.due(start, 1).map(|credit| credit.messages), Some(12));
        // The message done, the window alone again.
        grant.note_partial(0, 0);
        let done = grant
            .due(start + CREDIT_DELAY, 2)
            .expect("a sequence acknowledged");
        assert_eq!((done.ack_seq, done.messages), (2, 8));
    }

    #[test]
    fn grant_counts_bytes_too() {
        let start = Instant::now();
        let mut grant = CreditGrant::new(Window {
            pieces: 1000,
            bytes: 4000,
        });
        let first = grant.due(start, 1).expect("first credit");
        grant.sent(start, &first);
        grant.on_received(1000);
        assert!(grant.due(start, 2).is_some(), "a quarter of the bytes");
    }
}
