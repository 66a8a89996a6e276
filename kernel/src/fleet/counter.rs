//! Tagged counters: the load columns (active requests, active prefill tokens,
//! active decode blocks) and the read-modify-writes that book and release
//! against them.
//!
//! A counter word packs a 24-bit value above an 8-bit generation tag:
//!
//! ```text
//!  31                                8 7          0
//! +-----------------------------------+------------+
//! |  value (0 ..= COUNTER_MAX)        | generation |
//! |                                   |  & 0xFF    |
//! +-----------------------------------+------------+
//! ```
//!
//! Scans read the value with `Decode::Shift(8)`: one vector shift, no mask.
//! Every write is a compare-and-swap that first checks the tag, so a booking
//! made against one occupant of a slot can never change the counters of the
//! next occupant: `add` stores `0 << 8 | new_tag` into every counter of the
//! slot, after which every CAS carrying the old tag fails. Values saturate at
//! [`COUNTER_MAX`] instead of carrying into the tag, and never go below zero;
//! callers record the amount that was really added so that they release
//! exactly that.
//!
//! This module must not know about slots, states or bookings: only words.

use crate::sync::{AtomicU32, Ordering};

/// Bits of a counter word that hold the generation tag.
pub(crate) const TAG_BITS: u32 = 8;

/// The largest value a tagged counter can hold: `2^24 - 1` (16,777,215).
///
/// Counters saturate here; an admission limit above it is capped to it.
pub const COUNTER_MAX: u32 = u32::MAX >> TAG_BITS;

/// One unit of value, in word encoding.
const ONE: u32 = 1 << TAG_BITS;

/// The tag a slot generation gives its counters.
#[inline(always)]
pub(crate) const fn tag_of_generation(generation: u32) -> u32 {
    generation & ((1 << TAG_BITS) - 1)
}

/// A counter word holding `value` under `tag`.
#[inline(always)]
pub(crate) const fn pack(value: u32, tag: u32) -> u32 {
    value << TAG_BITS | tag
}

/// The value of a counter word.
#[inline(always)]
pub(crate) const fn value_of(word: u32) -> u32 {
    word >> TAG_BITS
}

/// The tag of a counter word (what [`carries`] compares).
#[cfg(test)]
pub(crate) const fn tag_of(word: u32) -> u32 {
    word & ((1 << TAG_BITS) - 1)
}

/// Whether the counter word carries `tag` (a tag of
/// [`tag_of_generation`]): the word's low byte compared with the tag's,
/// one comparison in each read-modify-write loop (no widening).
#[inline(always)]
pub(crate) const fn carries(word: u32, tag: u32) -> bool {
    const { assert!(TAG_BITS == u8::BITS) };
    word as u8 == tag as u8
}

/// The word an admission limit is kept as: the limit, capped to
/// [`COUNTER_MAX`], in a counter word's value bits over tag 0. A counter's
/// value is at the limit exactly when its word is at least this (its tag
/// sits below the value), so a booking compares the two words as they are.
#[inline(always)]
pub(crate) const fn limit_word(limit: u32) -> u32 {
    pack(if limit < COUNTER_MAX { limit } else { COUNTER_MAX }, 0)
}

/// The admission limit a [`limit_word`] keeps: a limit at or above
/// [`COUNTER_MAX`] (they admit alike) as [`UNLIMITED`](crate::fleet::UNLIMITED).
#[inline(always)]
pub(crate) const fn limit_of_word(word: u32) -> u32 {
    match value_of(word) {
        COUNTER_MAX => crate::fleet::UNLIMITED,
        limit => limit,
    }
}

/// Why [`increment_below`] refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The counter carries another generation's tag: the slot was reused.
    Stale,
    /// The value had reached the limit.
    AtLimit,
}

/// Marks the way it is called on as the unlikely one (what
/// `core::hint::cold_path` does from Rust 1.95, above this crate's minimum
/// Rust version): a call of a `#[cold]` function.
#[cold]
#[inline(always)]
const fn cold_path() {}

/// One read-modify-write of `counter`: `step` turns the word read into the
/// word to write, or refuses (`Err`, nothing written); the compare-and-swap
/// (`order` on success) is retried with the word found until it succeeds or
/// `step` refuses. Returns what `step` returned for the word replaced.
///
/// A lost race is the cold way (the hot path runs the loop's body once).
#[inline(always)]
fn update<T, E>(counter: &AtomicU32, order: Ordering, step: impl Fn(u32) -> Result<(u32, T), E>) -> Result<T, E> {
    let mut word = counter.load(Ordering::Relaxed);
    loop {
        let (new, done) = step(word)?;
        match counter.compare_exchange_weak(word, new, order, Ordering::Relaxed) {
            Ok(_) => return Ok(done),
            Err(now) => {
                cold_path();
                word = now;
            }
        }
    }
}

/// Adds one to the value if the tag is `tag` and the value is below the
/// limit whose [`limit_word`] is `full`; returns the value it found. This
/// CAS is the admission decision: it is `SeqCst` so that it is ordered with
/// the booking's state re-check and with `set_state` / `remove` (see
/// `booking`).
#[cfg_attr(not(debug_assertions), inline(always))]
pub(crate) fn increment_below(counter: &AtomicU32, tag: u32, full: u32) -> Result<u32, Refusal> {
    update(counter, Ordering::SeqCst, |word| {
        if !carries(word, tag) {
            return Err(Refusal::Stale);
        }
        if word >= full {
            return Err(Refusal::AtLimit);
        }
        Ok((word + ONE, value_of(word)))
    })
}

/// Adds up to `amount`, saturating at [`COUNTER_MAX`], if the tag is `tag`.
/// Returns the amount really added, or `None` (nothing changed) if stale.
#[cfg_attr(not(debug_assertions), inline(always))]
pub(crate) fn add_saturating(counter: &AtomicU32, tag: u32, amount: u32) -> Option<u32> {
    if amount == 0 {
        return Some(0);
    }
    let mut amount = amount;
    if amount > COUNTER_MAX {
        cold_path();
        amount = COUNTER_MAX;
    }
    let step = pack(amount, 0);
    update(counter, Ordering::AcqRel, |word| {
        if !carries(word, tag) {
            return Err(());
        }
        // The sum carries out of the word exactly when the value would pass
        // `COUNTER_MAX` (the tag below is untouched by adding `step`): only
        // then is the room worked out.
        Ok(match word.checked_add(step) {
            Some(new) => (new, amount),
            None => {
                cold_path();
                let room = COUNTER_MAX - value_of(word);
                (word + room * ONE, room)
            }
        })
    })
    .ok()
}

/// Subtracts `amount` (never below zero) if the tag is `tag`; a no-op on a
/// stale tag. Returns whether the counter carried the tag.
///
/// `amount` is at most [`COUNTER_MAX`]: an amount an add returned, or a
/// difference of two values.
#[cfg_attr(not(debug_assertions), inline(always))]
pub(crate) fn sub_if_tagged(counter: &AtomicU32, tag: u32, amount: u32) -> bool {
    if amount == 0 {
        return true;
    }
    debug_assert!(amount <= COUNTER_MAX, "no counter holds {amount}");
    let step = pack(amount, 0);
    update(counter, Ordering::AcqRel, |word| {
        if !carries(word, tag) {
            return Err(());
        }
        // The difference borrows exactly when the value is below `amount`
        // (`step`'s low byte is 0, so the tag is untouched): only then is
        // the counter emptied instead.
        Ok(match word.checked_sub(step) {
            Some(new) => (new, ()),
            None => {
                cold_path();
                debug_assert!(false, "releasing more than was booked (counter word {word:#x})");
                (word & (ONE - 1), ())
            }
        })
    })
    .is_ok()
}

/// Deliberately broken counter operations, for the loom models to catch.
#[cfg(selkie_loom)]
pub(crate) mod broken {
    use super::*;

    /// [`increment_below`] as a load then a store: two bookers can both see
    /// the last free place and both take it.
    pub(crate) fn increment_below_load_store(counter: &AtomicU32, tag: u32, limit: u32) -> Result<u32, Refusal> {
        let word = counter.load(Ordering::SeqCst);
        if !carries(word, tag) {
            return Err(Refusal::Stale);
        }
        if value_of(word) >= limit {
            return Err(Refusal::AtLimit);
        }
        counter.store(word + ONE, Ordering::SeqCst);
        Ok(value_of(word))
    }

    /// [`increment_below`] without the tag check: keeps whatever tag is there.
    pub(crate) fn increment_below_untagged(counter: &AtomicU32, limit: u32) -> Result<u32, Refusal> {
        let mut word = counter.load(Ordering::Relaxed);
        loop {
            if value_of(word) >= limit {
                return Err(Refusal::AtLimit);
            }
            match counter.compare_exchange(word, word + ONE, Ordering::SeqCst, Ordering::Relaxed) {
                Ok(_) => return Ok(value_of(word)),
                Err(now) => word = now,
            }
        }
    }

    /// [`sub_if_tagged`] as a load then a store: concurrent releases lose
    /// updates.
    pub(crate) fn sub_load_store(counter: &AtomicU32, tag: u32, amount: u32) -> bool {
        let word = counter.load(Ordering::Acquire);
        if !carries(word, tag) {
            return false;
        }
        counter.store(word - amount.min(value_of(word)) * ONE, Ordering::Release);
        true
    }

    /// [`sub_if_tagged`] without the tag check: subtracts from whoever owns
    /// the slot now.
    pub(crate) fn sub_untagged(counter: &AtomicU32, amount: u32) -> bool {
        let mut word = counter.load(Ordering::Relaxed);
        loop {
            let taken = amount.min(value_of(word));
            match counter.compare_exchange(word, word - taken * ONE, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(now) => word = now,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `carries` is `tag_of(word) == tag` for every tag a generation gives,
    /// whatever the value above it.
    #[test]
    fn a_word_carries_exactly_its_own_tag() {
        for generation in [0, 1, 7, 255, 256, 257, 0x1FFF_FFFF] {
            let tag = tag_of_generation(generation);
            for value in [0, 1, 255, 256, COUNTER_MAX] {
                for other in [0, 1, 128, 255] {
                    let word = pack(value, other);
                    assert_eq!(carries(word, tag), tag_of(word) == tag, "{word:#x} under {tag}");
                }
                assert!(carries(pack(value, tag), tag), "value {value} under {tag}");
            }
        }
    }

    /// Values at and around every boundary the word arithmetic relies on.
    const VALUES: [u32; 9] = [
        0,
        1,
        2,
        255,
        256,
        COUNTER_MAX / 2,
        COUNTER_MAX - 2,
        COUNTER_MAX - 1,
        COUNTER_MAX,
    ];
    const TAGS: [u32; 4] = [0, 1, 128, 255];

    /// A counter holding `value` under `tag`.
    fn counter(value: u32, tag: u32) -> AtomicU32 {
        AtomicU32::new(pack(value, tag))
    }

    /// Comparing a counter word with a limit's word is comparing the
    /// counter's value with the limit capped to `COUNTER_MAX`, whatever the
    /// tag; `increment_below` admits exactly below it.
    #[test]
    fn a_limit_word_compares_as_the_capped_limit() {
        let limits = [
            0,
            1,
            2,
            256,
            COUNTER_MAX - 1,
            COUNTER_MAX,
            COUNTER_MAX + 1,
            u32::MAX - 1,
            u32::MAX,
        ];
        for limit in limits {
            let full = limit_word(limit);
            for tag in TAGS {
                for value in VALUES
                    .into_iter()
                    .chain([limit.saturating_sub(1), limit.min(COUNTER_MAX)])
                {
                    let value = value.min(COUNTER_MAX);
                    let at_limit = value >= limit.min(COUNTER_MAX);
                    assert_eq!(
                        pack(value, tag) >= full,
                        at_limit,
                        "value {value}, tag {tag}, limit {limit}"
                    );
                    let c = counter(value, tag);
                    let admitted = increment_below(&c, tag, full);
                    if at_limit {
                        assert_eq!(admitted, Err(Refusal::AtLimit), "value {value}, limit {limit}");
                        assert_eq!(c.load(Ordering::Relaxed), pack(value, tag));
                    } else {
                        assert_eq!(admitted, Ok(value), "value {value}, limit {limit}");
                        assert_eq!(c.load(Ordering::Relaxed), pack(value + 1, tag));
                    }
                    let stale = increment_below(&counter(value, tag ^ 1), tag, full);
                    assert_eq!(stale, Err(Refusal::Stale), "value {value}, limit {limit}");
                }
            }
        }
    }

    /// A limit reads back as it was set, but for one at or above
    /// `COUNTER_MAX`, which admits as `UNLIMITED` does and reads back so.
    #[test]
    fn a_limit_word_reads_back_as_its_limit() {
        for limit in [0, 1, 9, 256, COUNTER_MAX - 1] {
            assert_eq!(limit_of_word(limit_word(limit)), limit);
        }
        for limit in [COUNTER_MAX, COUNTER_MAX + 1, u32::MAX] {
            assert_eq!(limit_word(limit), limit_word(crate::fleet::UNLIMITED));
            assert_eq!(limit_of_word(limit_word(limit)), crate::fleet::UNLIMITED);
        }
    }

    /// `add_saturating` adds `min(amount, COUNTER_MAX - value)` under its
    /// own tag, returns what it added, and leaves the tag alone.
    #[test]
    fn an_add_saturates_exactly_at_the_counter_max() {
        let amounts = [
            0,
            1,
            2,
            255,
            256,
            COUNTER_MAX - 1,
            COUNTER_MAX,
            COUNTER_MAX + 1,
            u32::MAX,
        ];
        for tag in TAGS {
            for value in VALUES {
                for amount in amounts {
                    let c = counter(value, tag);
                    let added = amount.min(COUNTER_MAX - value);
                    assert_eq!(add_saturating(&c, tag, amount), Some(added), "{value} + {amount}");
                    assert_eq!(
                        c.load(Ordering::Relaxed),
                        pack(value + added, tag),
                        "{value} + {amount}"
                    );
                    let stale = counter(value, tag ^ 1);
                    let refused = if amount == 0 { Some(0) } else { None };
                    assert_eq!(add_saturating(&stale, tag, amount), refused, "{value} + {amount}");
                    assert_eq!(stale.load(Ordering::Relaxed), pack(value, tag ^ 1));
                }
            }
        }
    }

    /// `sub_if_tagged` takes exactly `amount` from a value that holds it,
    /// under its own tag only.
    #[test]
    fn a_sub_takes_exactly_its_amount_under_its_tag() {
        for tag in TAGS {
            for value in VALUES {
                for amount in VALUES.into_iter().filter(|&a| a <= value) {
                    let c = counter(value, tag);
                    assert!(sub_if_tagged(&c, tag, amount), "{value} - {amount}");
                    assert_eq!(
                        c.load(Ordering::Relaxed),
                        pack(value - amount, tag),
                        "{value} - {amount}"
                    );
                    let stale = counter(value, tag ^ 1);
                    assert_eq!(sub_if_tagged(&stale, tag, amount), amount == 0, "{value} - {amount}");
                    assert_eq!(stale.load(Ordering::Relaxed), pack(value, tag ^ 1));
                }
            }
        }
    }

    /// Releasing more than a counter holds empties it (and, in a debug
    /// build, is caught as the bug it is).
    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "releasing more than was booked"))]
    fn a_sub_of_more_than_the_value_empties_the_counter() {
        let c = counter(3, 7);
        assert!(sub_if_tagged(&c, 7, 5));
        assert_eq!(c.load(Ordering::Relaxed), pack(0, 7));
    }
}
