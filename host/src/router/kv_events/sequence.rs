//! Where a message falls in its endpoint's sequence.
//!
//! A message numbered at or below the last one is either a duplicate (the
//! same message read twice, through the old and the fresh socket while a
//! connecting subscriber replaces one) or the first one heard from an
//! engine that restarted, whose first messages were published before the
//! router's socket joined (ZMQ drops what a publisher sends before a
//! subscriber is connected, so message 0 of a new process can be lost).
//! The number alone cannot tell them apart; the payload can: a duplicate's
//! bytes are the ones already read under that number, and a new process's
//! message carries its own timestamp. The subscriber keeps the digests of
//! the last [`RECENT_MESSAGES`] messages it placed.

/// How many of the latest messages' digests a subscriber keeps (16 bytes
/// each). Duplicates come from two sockets reading the same stream at the
/// same time, so they are among the latest few; a message numbered below
/// the last that matches none of these is a restart.
pub const RECENT_MESSAGES: usize = 1024;

/// A message's place in its endpoint's sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Place {
    /// The first message heard, or the last one's successor.
    Next,
    /// Numbers `from..` the message's own were not heard.
    Gap {
        /// The first missing number.
        from: u64,
    },
    /// The engine restarted: a number at or below the last with a payload
    /// not read under that number.
    Restart,
    /// Read already.
    Duplicate,
}

/// The numbers and payload digests of the messages placed so far.
pub(super) struct Sequence {
    last: Option<u64>,
    /// `(number, digest)` by number modulo [`RECENT_MESSAGES`].
    recent: Box<[Option<(u64, u64)>]>,
}

impl Sequence {
    pub(super) fn new() -> Self {
        Sequence {
            last: None,
            recent: vec![None; RECENT_MESSAGES].into_boxed_slice(),
        }
    }

    /// Where message `seq`, whose payload's digest is `digest`, falls.
    pub(super) fn place(&self, seq: u64, digest: u64) -> Place {
        match self.last {
            None => Place::Next,
            Some(last) if seq <= last => {
                if self.recent[slot(seq)] == Some((seq, digest)) {
                    Place::Duplicate
                } else {
                    Place::Restart
                }
            }
            Some(last) if seq == last + 1 => Place::Next,
            Some(last) => Place::Gap { from: last + 1 },
        }
    }

    /// Records message `seq` as applied; after a restart, the digests of
    /// the engine's previous process are forgotten first.
    pub(super) fn record(&mut self, seq: u64, digest: u64, restart: bool) {
        if restart {
            self.recent.fill(None);
        }
        self.last = Some(seq);
        self.recent[slot(seq)] = Some((seq, digest));
    }
}

fn slot(seq: u64) -> usize {
    (seq % RECENT_MESSAGES as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heard(numbers: std::ops::Range<u64>, digest: impl Fn(u64) -> u64) -> Sequence {
        let mut s = Sequence::new();
        for n in numbers {
            assert_ne!(s.place(n, digest(n)), Place::Duplicate);
            s.record(n, digest(n), false);
        }
        s
    }

    #[test]
    fn a_restart_whose_first_messages_were_lost_is_a_restart() {
        // The engine's first process sent 0..=200; the new one's 0..=2
        // went out before the router's socket joined.
        let s = heard(0..201, |n| n * 7);
        assert_eq!(s.place(3, 0xfeed), Place::Restart);
        assert_eq!(s.place(0, 0xfeed), Place::Restart);
    }

    #[test]
    fn a_message_read_twice_is_a_duplicate() {
        let s = heard(0..201, |n| n * 7);
        assert_eq!(s.place(200, 200 * 7), Place::Duplicate);
        assert_eq!(s.place(150, 150 * 7), Place::Duplicate);
        // Message 0 read again through a fresh socket is no restart.
        let s = heard(0..1, |_| 5);
        assert_eq!(s.place(0, 5), Place::Duplicate);
    }

    #[test]
    fn numbers_ahead_are_next_or_a_gap() {
        let s = heard(0..10, |n| n);
        assert_eq!(s.place(10, 1), Place::Next);
        assert_eq!(s.place(14, 1), Place::Gap { from: 10 });
        assert_eq!(Sequence::new().place(77, 1), Place::Next);
    }

    #[test]
    fn after_a_restart_the_old_digests_are_forgotten() {
        let mut s = heard(0..5, |n| n);
        s.record(0, 100, true);
        assert_eq!(s.place(1, 1), Place::Next);
        // The old process's message 3 is no longer known.
        assert_eq!(s.place(0, 0), Place::Restart);
    }

    #[test]
    fn a_number_older_than_the_kept_digests_is_a_restart() {
        let s = heard(0..(RECENT_MESSAGES as u64 + 10), |n| n);
        assert_eq!(s.place(3, 3), Place::Restart);
        assert_eq!(
            s.place(RECENT_MESSAGES as u64 + 3, RECENT_MESSAGES as u64 + 3),
            Place::Duplicate
        );
    }
}
