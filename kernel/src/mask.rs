//! Eligibility bitmasks: one bit per row, built by the host's hard filters
//! and intersected in every scan.
//!
//! Kernels take a mask as `&[u64]` words (bit `i % 64` of word `i / 64` is row
//! `i`); rows past the end of the mask are ineligible. [`RowMask`] is a
//! fixed-capacity owned mask for callers without an allocator.
//!
//! This module must not know about workers or load: only bits.

/// Number of `u64` words needed for `rows` rows.
#[inline]
pub const fn words_for(rows: usize) -> usize {
    rows.div_ceil(64)
}

/// Whether row `row` is set in `mask`.
#[inline(always)]
pub fn contains(mask: &[u64], row: usize) -> bool {
    mask.get(row / 64).is_some_and(|w| w >> (row % 64) & 1 == 1)
}

/// The 8 bits of lane group `group` (rows `8 * group .. 8 * group + 8`).
#[inline(always)]
pub fn group_bits(mask: &[u64], group: usize) -> u8 {
    match mask.get(group / 8) {
        Some(w) => (w >> ((group % 8) * 8)) as u8,
        None => 0,
    }
}

/// Number of set rows among the first `rows`.
#[inline(always)]
pub fn count(mask: &[u64], rows: usize) -> usize {
    let full = rows / 64;
    let mut n: usize = mask.iter().take(full).map(|w| w.count_ones() as usize).sum();
    let rest = rows % 64;
    if rest != 0 {
        if let Some(w) = mask.get(full) {
            n += (w & ((1u64 << rest) - 1)).count_ones() as usize;
        }
    }
    n
}

/// The row of the `n`-th (0-based) set bit among the first `rows`, walking
/// whole words with `popcount` and then selecting inside one word.
#[inline(always)]
pub fn nth(mask: &[u64], rows: usize, mut n: usize) -> Option<usize> {
    for (wi, &w) in mask.iter().enumerate() {
        let base = wi * 64;
        if base >= rows {
            return None;
        }
        let w = if rows - base < 64 {
            w & ((1u64 << (rows - base)) - 1)
        } else {
            w
        };
        let c = w.count_ones() as usize;
        if n < c {
            return Some(base + select_in_word(w, n as u32) as usize);
        }
        n -= c;
    }
    None
}

/// Position of the `n`-th set bit of `w` (`n < w.count_ones()`).
#[inline(always)]
fn select_in_word(mut w: u64, n: u32) -> u32 {
    // Byte-wise skip, then bit-wise: at most 8 + 8 steps, no BMI2 needed
    // (the same code runs on Cortex-M and baseline x86-64).
    let mut n = n;
    let mut base = 0;
    loop {
        let c = (w & 0xFF).count_ones();
        if n < c {
            break;
        }
        n -= c;
        w >>= 8;
        base += 8;
    }
    for _ in 0..n {
        w &= w - 1;
    }
    base + w.trailing_zeros()
}

/// A fixed-capacity eligibility mask of `WORDS * 64` rows, for callers
/// without an allocator.
///
/// ```
/// use selkie_kernel::RowMask;
/// let mut m = RowMask::<2>::new();
/// m.insert(3);
/// m.insert(70);
/// assert_eq!(m.count(128), 2);
/// assert!(m.contains(70) && !m.contains(4));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowMask<const WORDS: usize> {
    words: [u64; WORDS],
}

impl<const WORDS: usize> Default for RowMask<WORDS> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const WORDS: usize> RowMask<WORDS> {
    /// An empty mask.
    pub const fn new() -> Self {
        RowMask { words: [0; WORDS] }
    }
    /// A mask with rows `0..rows` set.
    pub fn first(rows: usize) -> Self {
        let mut m = Self::new();
        for (i, w) in m.words.iter_mut().enumerate() {
            let lo = i * 64;
            *w = if rows >= lo + 64 {
                u64::MAX
            } else if rows > lo {
                (1u64 << (rows - lo)) - 1
            } else {
                0
            };
        }
        m
    }
    /// Sets row `row` (ignored past capacity).
    pub fn insert(&mut self, row: usize) {
        if let Some(w) = self.words.get_mut(row / 64) {
            *w |= 1 << (row % 64);
        }
    }
    /// Clears row `row`.
    pub fn remove(&mut self, row: usize) {
        if let Some(w) = self.words.get_mut(row / 64) {
            *w &= !(1 << (row % 64));
        }
    }
    /// Whether row `row` is set.
    pub fn contains(&self, row: usize) -> bool {
        contains(&self.words, row)
    }
    /// Number of set rows among the first `rows`.
    pub fn count(&self, rows: usize) -> usize {
        count(&self.words, rows)
    }
    /// The mask's words, as the kernels take them.
    pub fn words(&self) -> &[u64] {
        &self.words
    }
    /// The mask's words, mutable.
    pub fn words_mut(&mut self) -> &mut [u64] {
        &mut self.words
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nth_matches_bit_by_bit_walk() {
        let mask = [0xF0F0_0000_0000_0001u64, 0, 0x8000_0000_0000_0003];
        let rows = 190;
        let set: [usize; 12] = [0, 52, 53, 54, 55, 60, 61, 62, 63, 128, 129, 191];
        let expected: [usize; 11] = [0, 52, 53, 54, 55, 60, 61, 62, 63, 128, 129];
        assert_eq!(count(&mask, rows), 11);
        for (k, &r) in expected.iter().enumerate() {
            assert_eq!(nth(&mask, rows, k), Some(r), "k={k}");
        }
        assert_eq!(nth(&mask, rows, 11), None, "row 191 is past rows");
        assert!(contains(&mask, set[11]));
    }

    #[test]
    fn group_bits_reads_bytes() {
        let mask = [0x0000_0000_0000_AB00u64, 0x12];
        assert_eq!(group_bits(&mask, 1), 0xAB);
        assert_eq!(group_bits(&mask, 8), 0x12);
        assert_eq!(group_bits(&mask, 99), 0);
    }
}
