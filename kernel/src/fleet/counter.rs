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

/// Why [`increment_below`] refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The counter carries another generation's tag: the slot was reused.
    Stale,
    /// The value had reached the limit.
    AtLimit,
}

/// Adds one to the value if the tag is `tag` and the value is below `limit`
/// (capped to [`COUNTER_MAX`]). This CAS is the admission decision: it is
/// `SeqCst` so that it is ordered with the booking's state re-check and with
/// `set_state` / `remove` (see `booking`).
#[inline]
pub(crate) fn increment_below(counter: &AtomicU32, tag: u32, limit: u32) -> Result<(), Refusal> {
    let limit = if limit < COUNTER_MAX { limit } else { COUNTER_MAX };
    let mut word = counter.load(Ordering::Relaxed);
    loop {
        if !carries(word, tag) {
            return Err(Refusal::Stale);
        }
        if value_of(word) >= limit {
            return Err(Refusal::AtLimit);
        }
        match counter.compare_exchange_weak(word, word + ONE, Ordering::SeqCst, Ordering::Relaxed) {
            Ok(_) => return Ok(()),
            Err(now) => word = now,
        }
    }
}

/// Adds up to `amount`, saturating at [`COUNTER_MAX`], if the tag is `tag`.
/// Returns the amount really added, or `None` (nothing changed) if stale.
#[inline]
pub(crate) fn add_saturating(counter: &AtomicU32, tag: u32, amount: u32) -> Option<u32> {
    if amount == 0 {
        return Some(0);
    }
    let mut word = counter.load(Ordering::Relaxed);
    loop {
        if !carries(word, tag) {
            return None;
        }
        let added = amount.min(COUNTER_MAX - value_of(word));
        match counter.compare_exchange_weak(word, word + added * ONE, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return Some(added),
            Err(now) => word = now,
        }
    }
}

/// Subtracts `amount` (never below zero) if the tag is `tag`; a no-op on a
/// stale tag. Returns whether the counter carried the tag.
#[inline]
pub(crate) fn sub_if_tagged(counter: &AtomicU32, tag: u32, amount: u32) -> bool {
    if amount == 0 {
        return true;
    }
    let mut word = counter.load(Ordering::Relaxed);
    loop {
        if !carries(word, tag) {
            return false;
        }
        let taken = amount.min(value_of(word));
        debug_assert_eq!(taken, amount, "releasing more than was booked");
        match counter.compare_exchange_weak(word, word - taken * ONE, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(now) => word = now,
        }
    }
}

/// Deliberately broken counter operations, for the loom models to catch.
#[cfg(selkie_loom)]
pub(crate) mod broken {
    use super::*;

    /// [`increment_below`] as a load then a store: two bookers can both see
    /// the last free place and both take it.
    pub(crate) fn increment_below_load_store(counter: &AtomicU32, tag: u32, limit: u32) -> Result<(), Refusal> {
        let word = counter.load(Ordering::SeqCst);
        if !carries(word, tag) {
            return Err(Refusal::Stale);
        }
        if value_of(word) >= limit {
            return Err(Refusal::AtLimit);
        }
        counter.store(word + ONE, Ordering::SeqCst);
        Ok(())
    }

    /// [`increment_below`] without the tag check: keeps whatever tag is there.
    pub(crate) fn increment_below_untagged(counter: &AtomicU32, limit: u32) -> Result<(), Refusal> {
        let mut word = counter.load(Ordering::Relaxed);
        loop {
            if value_of(word) >= limit {
                return Err(Refusal::AtLimit);
            }
            match counter.compare_exchange(word, word + ONE, Ordering::SeqCst, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
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
}
