//! Atomic row bitmaps: which rows are occupied (claimed by an `add`) and
//! which are selectable (Live), 32 rows per `AtomicU32` word.
//!
//! Stable Rust cannot size an array `GROUPS * LANES / 32`, so a bitmap holds
//! `GROUPS` words and uses the first [`RowBits::WORDS_USED`] of them (a
//! quarter; 6 KiB unused at 16,384 rows). Scans copy the used words into the
//! `u64` masks the kernels take.
//!
//! This module must not know what a bit means: only bits.

use crate::lanes::LANES;
use crate::sync::{AtomicU32, Ordering};

/// A bitmap of `GROUPS * LANES` rows.
pub(crate) struct RowBits<const GROUPS: usize> {
    words: [AtomicU32; GROUPS],
}

impl<const GROUPS: usize> RowBits<GROUPS> {
    /// Number of rows.
    const ROWS: usize = GROUPS * LANES;
    /// Words that hold rows: `ceil(GROUPS * LANES / 32)`, at most `GROUPS`.
    pub(crate) const WORDS_USED: usize = Self::ROWS.div_ceil(32);

    /// All rows clear.
    #[cfg(not(selkie_loom))]
    pub(crate) const fn new() -> Self {
        RowBits {
            words: [const { crate::sync::atomic_u32(0) }; GROUPS],
        }
    }

    /// All rows clear.
    #[cfg(selkie_loom)]
    pub(crate) fn new() -> Self {
        RowBits {
            words: core::array::from_fn(|_| crate::sync::atomic_u32(0)),
        }
    }

    /// Bits of word `w` that are rows of the fleet (the last word may be
    /// partial when `GROUPS` is not a multiple of 4).
    #[inline]
    const fn valid(w: usize) -> u32 {
        let rest = Self::ROWS - w * 32;
        if rest >= 32 {
            u32::MAX
        } else {
            (1 << rest) - 1
        }
    }

    /// Sets `row`.
    #[inline]
    pub(crate) fn set(&self, row: usize, order: Ordering) {
        self.words[row / 32].fetch_or(1 << (row % 32), order);
    }

    /// Clears `row`.
    #[inline]
    pub(crate) fn clear(&self, row: usize, order: Ordering) {
        self.words[row / 32].fetch_and(!(1 << (row % 32)), order);
    }

    /// Whether `row` is set.
    #[inline]
    pub(crate) fn contains(&self, row: usize, order: Ordering) -> bool {
        self.words[row / 32].load(order) >> (row % 32) & 1 == 1
    }

    /// Atomically sets the lowest clear row and returns it, or `None` if
    /// every row is set. Each word is claimed with a CAS, so two callers
    /// never get the same row.
    pub(crate) fn claim_lowest_clear(&self) -> Option<usize> {
        for w in 0..Self::WORDS_USED {
            let valid = Self::valid(w);
            let mut word = self.words[w].load(Ordering::Relaxed);
            while word & valid != valid {
                let bit = (!word & valid).trailing_zeros();
                match self.words[w].compare_exchange_weak(word, word | 1 << bit, Ordering::Acquire, Ordering::Relaxed) {
                    Ok(_) => return Some(w * 32 + bit as usize),
                    Err(now) => word = now,
                }
            }
        }
        None
    }

    /// [`claim_lowest_clear`](Self::claim_lowest_clear) with a load and a
    /// store instead of a CAS: two callers can claim the same row. For the
    /// loom models only.
    #[cfg(selkie_loom)]
    pub(crate) fn claim_lowest_clear_load_store(&self) -> Option<usize> {
        for w in 0..Self::WORDS_USED {
            let valid = Self::valid(w);
            let word = self.words[w].load(Ordering::Acquire);
            if word & valid != valid {
                let bit = (!word & valid).trailing_zeros();
                self.words[w].store(word | 1 << bit, Ordering::Release);
                return Some(w * 32 + bit as usize);
            }
        }
        None
    }

    /// Copies the bitmap into `out` (bit `i % 64` of word `i / 64` is row
    /// `i`), zero-filling words past the fleet. Each 32-row word is read
    /// with one relaxed load; the copy is not a snapshot across words.
    pub(crate) fn copy_to(&self, out: &mut [u64]) {
        for (i, o) in out.iter_mut().enumerate() {
            let lo = self.word(2 * i);
            let hi = self.word(2 * i + 1);
            *o = lo as u64 | (hi as u64) << 32;
        }
    }

    #[inline]
    fn word(&self, w: usize) -> u32 {
        if w < Self::WORDS_USED {
            self.words[w].load(Ordering::Relaxed)
        } else {
            0
        }
    }
}
