//! Argmin over eligible rows with ties broken uniformly at random: the core
//! shared by least-loaded, device-aware and the temperature-0 pick.
//!
//! ```text
//! pass 1: per 64-row mask word, the lane-wise min of its stored words (a
//!         fleet counter's value is its high bits: no decode shift), then
//!         one vector test against the least key so far:
//!           above it     -> next word (no reduction, no count)
//!           otherwise    -> m = the word's least key; the ties of m counted
//!                           from the lanes already loaded; m below the least
//!                           so far restarts the count at this word
//!         = min over eligible rows, ties = #{eligible rows with key == min},
//!           each word's tie count remembered
//!         k = 0 if ties == 1 else rng.below(ties)          (exactly one draw iff ties > 1)
//! pass 3: skip whole words by their remembered counts, then find the k-th
//!         tie inside one word (8 lane groups)
//! ```
//!
//! A caller that already knows the minimum (the fused KV scan) runs pass 2
//! instead of pass 1: ties counted in the words whose least key is the
//! minimum, then pass 3.
//!
//! Mask words that are all ones (every row eligible: the common case) take a
//! path with no per-group mask work; all-zero words are skipped.
//!
//! Keys are compared with `<` / `==`; callers guarantee keys are not NaN.
//!
//! Over a live fleet column the passes may see different values. The
//! kernel then still returns an eligible row (or `None` only when no row is
//! eligible) and never panics: a tie that vanished between passes makes pass
//! 3 walk on, and if the chosen tie is gone altogether one scalar pass takes
//! the least key it reads. The booking re-validates whatever row is chosen.

use crate::lanes::LANES;
use crate::mask::contains;
use crate::simd::{F32Lanes, Simd, U32Lanes};
use crate::Rng;

/// A column of keys that the argmin can read one lane group at a time.
pub(crate) trait ArgminKey {
    /// Scalar key (`u32` or `f32`).
    type Key: Key;
    /// Number of rows.
    fn rows(&self) -> usize;
    /// Key of one row.
    fn key(&self, row: usize) -> Self::Key;
    /// Keys of one lane group.
    fn keys<S: Simd>(&self, s: S, group: usize) -> KeyLanes<S, Self::Key>;
    /// Keys of the eight lane groups of one full mask word (`first_group`
    /// is a multiple of 8 and `first_group + 8 <= rows() / LANES`).
    #[inline(always)]
    fn keys8<S: Simd>(&self, s: S, first_group: usize) -> [KeyLanes<S, Self::Key>; 8] {
        let mut keys = [self.keys(s, first_group); 8];
        for (i, k) in keys.iter_mut().enumerate().skip(1) {
            *k = self.keys(s, first_group + i);
        }
        keys
    }
    /// Keys of one lane group in a form ordered like the keys: the least of
    /// them, through [`key_of_ordered`](Self::key_of_ordered), is the least key
    /// (a fleet counter's stored word, whose value is its high bits).
    /// Default: the keys.
    #[inline(always)]
    fn ordered<S: Simd>(&self, s: S, group: usize) -> KeyLanes<S, Self::Key> {
        self.keys(s, group)
    }
    /// [`ordered`](Self::ordered) for the eight lane groups of one full mask
    /// word.
    #[inline(always)]
    fn ordered8<S: Simd>(&self, s: S, first_group: usize) -> [KeyLanes<S, Self::Key>; 8] {
        self.keys8(s, first_group)
    }
    /// The key of an [`ordered`](Self::ordered) value.
    #[inline(always)]
    fn key_of_ordered(&self, k: Self::Key) -> Self::Key {
        k
    }
    /// The greatest [`ordered`](Self::ordered) value whose key is at most
    /// `key`. Default: `key`.
    #[inline(always)]
    fn ordered_at_most(&self, key: Self::Key) -> Self::Key {
        key
    }
    /// The keys of eight [`ordered8`](Self::ordered8) lane groups, decoded in
    /// registers (no second read). Default: the ordered lanes are the keys.
    #[inline(always)]
    fn keys_of_ordered8<S: Simd>(&self, s: S, ordered: [KeyLanes<S, Self::Key>; 8]) -> [KeyLanes<S, Self::Key>; 8] {
        let _ = s;
        ordered
    }
}

/// The lanes of backend `S` that hold keys of type `K`.
pub(crate) type KeyLanes<S, K> = <K as Key>::Lanes<S>;

/// A scalar key (`u32` or `f32`) and the lane operations the argmin needs.
pub(crate) trait Key: Copy + PartialOrd {
    /// The backend's lanes of this key.
    type Lanes<S: Simd>: Copy;
    /// Larger than every key.
    const WORST: Self;
    /// All lanes larger than every key.
    fn worst<S: Simd>(s: S) -> Self::Lanes<S>;
    /// Lane-wise min of `acc` and `keys`, ineligible lanes (bit clear in
    /// `bits`) ignored.
    fn min_eligible<S: Simd>(s: S, acc: Self::Lanes<S>, keys: Self::Lanes<S>, bits: u8) -> Self::Lanes<S>;
    /// All-ones in lanes equal to `k`, zero elsewhere.
    fn eq_lanes<S: Simd>(s: S, keys: Self::Lanes<S>, k: Self) -> S::U32;
    /// Horizontal min.
    fn reduce_min<S: Simd>(lanes: Self::Lanes<S>) -> Self;
    /// Whether some lane is at most `bound`.
    fn any_at_most<S: Simd>(s: S, lanes: Self::Lanes<S>, bound: Self) -> bool;
}

impl Key for u32 {
    const WORST: u32 = u32::MAX;
    type Lanes<S: Simd> = S::U32;
    #[inline(always)]
    fn worst<S: Simd>(s: S) -> S::U32 {
        s.splat_u32(u32::MAX)
    }
    #[inline(always)]
    fn min_eligible<S: Simd>(s: S, acc: S::U32, keys: S::U32, bits: u8) -> S::U32 {
        if bits == 0xFF {
            acc.min(keys)
        } else {
            acc.min(keys | !s.lane_mask(bits))
        }
    }
    #[inline(always)]
    fn eq_lanes<S: Simd>(s: S, keys: S::U32, k: u32) -> S::U32 {
        keys.cmp_eq(s.splat_u32(k))
    }
    #[inline(always)]
    fn reduce_min<S: Simd>(lanes: S::U32) -> u32 {
        lanes.reduce_min()
    }
    #[inline(always)]
    fn any_at_most<S: Simd>(s: S, lanes: S::U32, bound: u32) -> bool {
        lanes.min(s.splat_u32(bound)).cmp_eq(lanes).bits() != 0
    }
}

impl Key for f32 {
    const WORST: f32 = f32::INFINITY;
    type Lanes<S: Simd> = S::F32;
    #[inline(always)]
    fn worst<S: Simd>(s: S) -> S::F32 {
        s.splat_f32(f32::INFINITY)
    }
    #[inline(always)]
    fn min_eligible<S: Simd>(s: S, acc: S::F32, keys: S::F32, bits: u8) -> S::F32 {
        if bits == 0xFF {
            acc.min(keys)
        } else {
            let m = s.lane_mask(bits).cast_f32();
            acc.min(m.blend(keys, s.splat_f32(f32::INFINITY)))
        }
    }
    #[inline(always)]
    fn eq_lanes<S: Simd>(s: S, keys: S::F32, k: f32) -> S::U32 {
        keys.cmp_eq(s.splat_f32(k)).cast_u32()
    }
    #[inline(always)]
    fn reduce_min<S: Simd>(lanes: S::F32) -> f32 {
        lanes.to_array().into_iter().fold(f32::INFINITY, f32::min)
    }
    #[inline(always)]
    fn any_at_most<S: Simd>(s: S, lanes: S::F32, bound: f32) -> bool {
        lanes.cmp_le(s.splat_f32(bound)).bits() != 0
    }
}

/// Mask words (64 rows each) whose tie counts pass 2 remembers on the stack
/// so pass 3 can jump to the word holding the chosen tie: 16,384 rows in 256
/// bytes. Words past it are recounted in pass 3.
const REMEMBERED_WORDS: usize = 256;

/// Lane groups `[first, end)` covered by mask word `w`, and the word.
#[inline(always)]
fn word_span(mask: &[u64], w: usize, groups: usize) -> (usize, usize, u64) {
    let first = w * 8;
    (first, (first + 8).min(groups), mask.get(w).copied().unwrap_or(0))
}

/// Pass 1 over one mask word: folds its eligible keys, in their
/// [`ordered`](ArgminKey::ordered) form, into `acc`.
#[inline(always)]
fn min_of_word<S: Simd, C: ArgminKey + ?Sized>(
    s: S,
    col: &C,
    mask: &[u64],
    w: usize,
    groups: usize,
    mut acc: KeyLanes<S, C::Key>,
) -> KeyLanes<S, C::Key> {
    let (first, end, word) = word_span(mask, w, groups);
    if word == u64::MAX && end - first == 8 {
        // Constant trip count: unrolled, no mask work.
        for keys in col.ordered8(s, first) {
            acc = C::Key::min_eligible(s, acc, keys, 0xFF);
        }
    } else if word != 0 {
        for g in first..end {
            let bits = (word >> ((g - first) * 8)) as u8;
            if bits != 0 {
                acc = C::Key::min_eligible(s, acc, col.ordered(s, g), bits);
            }
        }
    }
    acc
}

/// Number of eligible rows of mask word `w` whose key equals `min`.
#[inline(always)]
fn ties_in_word<S: Simd, C: ArgminKey + ?Sized>(
    s: S,
    col: &C,
    mask: &[u64],
    w: usize,
    groups: usize,
    min: C::Key,
) -> usize {
    let (first, end, word) = word_span(mask, w, groups);
    // Lane counters: an all-ones (equal) lane is -1, so subtracting adds one.
    let mut lane_ties = s.splat_u32(0);
    if word == u64::MAX && end - first == 8 {
        for keys in col.keys8(s, first) {
            lane_ties = lane_ties - C::Key::eq_lanes(s, keys, min);
        }
    } else if word != 0 {
        for g in first..end {
            let bits = (word >> ((g - first) * 8)) as u8;
            if bits != 0 {
                lane_ties = lane_ties - (C::Key::eq_lanes(s, col.keys(s, g), min) & s.lane_mask(bits));
            }
        }
    } else {
        return 0;
    }
    lane_ties.reduce_add() as usize
}

/// SIMD argmin with uniform random ties. See the module docs.
///
/// Returns `None` when no row is eligible. Makes exactly one `rng.below`
/// draw when more than one eligible row holds the minimum, none otherwise.
#[inline(always)]
pub(crate) fn argmin<S: Simd, C: ArgminKey + ?Sized>(s: S, col: &C, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    let rows = col.rows();
    let groups = rows / LANES;
    let words = groups.div_ceil(8);
    // Mask words whose eight lane groups all exist.
    let full = (groups / 8).min(mask.len());
    // Pass 1 (min and ties in one read): each word's least key `m`; a word
    // whose `m` is not above the least so far counts its ties of `m` from
    // the lanes it already holds, and a new least discards the counts
    // before it (`first`: the first word that can hold a tie).
    let mut word_ties = [0u8; REMEMBERED_WORDS];
    let mut min = C::Key::WORST;
    let mut ties = 0usize;
    let mut first = 0usize;
    // `ordered_at_most(min)`: a word none of whose ordered lanes is at most
    // this holds no key at most `min` (one vector test, no reduction).
    let mut bound = col.ordered_at_most(min);
    for w in 0..words {
        let (m, c) = if w < full && mask[w] == u64::MAX {
            let ordered = col.ordered8(s, w * 8);
            let mut acc = ordered[0];
            for lanes in &ordered[1..] {
                acc = C::Key::min_eligible(s, acc, *lanes, 0xFF);
            }
            if !C::Key::any_at_most(s, acc, bound) {
                continue;
            }
            let m = col.key_of_ordered(C::Key::reduce_min::<S>(acc));
            let keys = col.keys_of_ordered8(s, ordered);
            let mut lane_ties = s.splat_u32(0);
            for k in keys {
                lane_ties = lane_ties - C::Key::eq_lanes(s, k, m);
            }
            (m, lane_ties.reduce_add() as usize)
        } else {
            let m = col.key_of_ordered(C::Key::reduce_min::<S>(min_of_word(
                s,
                col,
                mask,
                w,
                groups,
                C::Key::worst(s),
            )));
            if m > min {
                continue;
            }
            (m, ties_in_word(s, col, mask, w, groups, m))
        };
        if m < min {
            (min, ties, first) = (m, 0, w);
            bound = col.ordered_at_most(min);
        }
        ties += c;
        if let Some(slot) = word_ties.get_mut(w) {
            *slot = c as u8; // at most 64
        }
    }
    // The rows past the last whole lane group.
    let mut tail_min = C::Key::WORST;
    for row in groups * LANES..rows {
        if contains(mask, row) {
            let k = col.key(row);
            if k < tail_min {
                tail_min = k;
            }
        }
    }
    if tail_min < min {
        // Only tail rows hold the minimum: no word holds a tie.
        (min, ties, first) = (tail_min, 0, words);
    }
    ties += tail_ties(col, mask, min);
    pick_tie(
        s,
        col,
        mask,
        min,
        ties,
        &word_ties[..words.min(REMEMBERED_WORDS)],
        first,
        rng,
    )
}

/// Eligible rows past the last whole lane group whose key equals `min`.
#[inline(always)]
fn tail_ties<C: ArgminKey + ?Sized>(col: &C, mask: &[u64], min: C::Key) -> usize {
    let rows = col.rows();
    (rows / LANES * LANES..rows)
        .filter(|&row| contains(mask, row) && col.key(row) == min)
        .count()
}

/// Passes 2 and 3 of [`argmin`] for a caller that already knows the minimum
/// key over eligible rows (e.g. from the pass that computed the keys).
/// `word_min[w]`, where given, is at most the least eligible key of mask
/// word `w` or above every key (an empty word); pass 2 skips the words
/// whose entry is above `min` (they hold no tie). Returns `None` if no eligible row's key equals `min`.
#[inline(always)]
pub(crate) fn argmin_given_min<S: Simd, C: ArgminKey + ?Sized>(
    s: S,
    col: &C,
    mask: &[u64],
    min: C::Key,
    word_min: &[C::Key],
    rng: &mut Rng,
) -> Option<usize> {
    let rows = col.rows();
    let groups = rows / LANES;
    let words = groups.div_ceil(8);
    // Pass 2: ties, remembering each word's count.
    let mut word_ties = [0u8; REMEMBERED_WORDS];
    let mut ties = 0usize;
    for w in 0..words {
        let c = if word_min.get(w).is_some_and(|&m| m > min) {
            0
        } else {
            ties_in_word(s, col, mask, w, groups, min)
        };
        if let Some(slot) = word_ties.get_mut(w) {
            *slot = c as u8; // at most 64
        }
        ties += c;
    }
    ties += tail_ties(col, mask, min);
    pick_tie(
        s,
        col,
        mask,
        min,
        ties,
        &word_ties[..words.min(REMEMBERED_WORDS)],
        0,
        rng,
    )
}

/// Pass 3: draws which of the `ties` eligible rows of key `min` to return
/// (one `rng.below` iff `ties > 1`) and finds it, skipping whole words by
/// `word_ties` (the counts of the words from `first` on, by word index;
/// words past it are recounted). No word before `first` holds a tie.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pick_tie<S: Simd, C: ArgminKey + ?Sized>(
    s: S,
    col: &C,
    mask: &[u64],
    min: C::Key,
    ties: usize,
    word_ties: &[u8],
    first: usize,
    rng: &mut Rng,
) -> Option<usize> {
    let rows = col.rows();
    let groups = rows / LANES;
    let words = groups.div_ceil(8);
    if ties == 0 {
        // No row holds `min` any more (a live column changed since it was
        // computed), or none is eligible: one more pass decides.
        return settle(col, mask);
    }
    let mut k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    // Skip whole words, then the k-th tie inside one word.
    for w in first..words {
        let c = match word_ties.get(w) {
            Some(&c) => c as usize,
            None => ties_in_word(s, col, mask, w, groups, min),
        };
        if k >= c {
            k -= c;
            continue;
        }
        let (first, end, word) = word_span(mask, w, groups);
        for g in first..end {
            let bits = (word >> ((g - first) * 8)) as u8;
            let mut t = C::Key::eq_lanes(s, col.keys(s, g), min).bits() & bits;
            let c = t.count_ones() as usize;
            if k < c {
                for _ in 0..k {
                    t &= t - 1;
                }
                return Some(g * LANES + t.trailing_zeros() as usize);
            }
            k -= c;
        }
        // Fewer ties than counted: a live column changed between the
        // passes. `k` is now past this word's ties; keep walking.
    }
    (groups * LANES..rows)
        .filter(|&row| contains(mask, row) && col.key(row) == min)
        .nth(k)
        .or_else(|| settle(col, mask))
}

/// The last resort when a live column changed between passes so that the
/// chosen tie vanished: the first eligible row of least key as this single
/// pass reads it (each key read once), or `None` only if no row is eligible.
/// Never reached for a column that does not change during the call, so the
/// SIMD kernel and its reference still agree on every immutable input.
#[cold]
#[inline(never)]
fn settle<C: ArgminKey + ?Sized>(col: &C, mask: &[u64]) -> Option<usize> {
    let mut best: Option<(usize, C::Key)> = None;
    for row in (0..col.rows()).filter(|&r| contains(mask, r)) {
        let k = col.key(row);
        if best.is_none_or(|(_, b)| k < b) {
            best = Some((row, k));
        }
    }
    best.map(|(row, _)| row)
}

/// Scalar reference of [`argmin`]: same result, same draws.
pub(crate) fn argmin_reference<C: ArgminKey + ?Sized>(col: &C, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    let mut min: Option<C::Key> = None;
    for row in 0..col.rows() {
        if contains(mask, row) {
            let k = col.key(row);
            if min.is_none_or(|m| k < m) {
                min = Some(k);
            }
        }
    }
    let min = min?;
    let ties = (0..col.rows())
        .filter(|&r| contains(mask, r) && col.key(r) == min)
        .count();
    let k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    (0..col.rows())
        .filter(|&r| contains(mask, r) && col.key(r) == min)
        .nth(k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::least_loaded::{least_loaded_on, least_loaded_reference};
    use crate::lanes::U32Source;
    use crate::simd::Backend;
    use core::cell::Cell;
    use std::vec::Vec;

    /// A column that changes under the scan, as a live fleet column may:
    /// every read of a row returns a different value.
    struct Shifting {
        rows: usize,
        reads: Cell<u32>,
    }

    impl Shifting {
        fn next(&self, row: usize) -> u32 {
            let n = self.reads.get();
            self.reads.set(n.wrapping_add(1));
            (n.wrapping_mul(2_654_435_761) ^ row as u32).rotate_left(n % 31) % 5
        }
    }

    impl U32Source for Shifting {
        fn rows(&self) -> usize {
            self.rows
        }
        fn value(&self, row: usize) -> u32 {
            self.next(row)
        }
        fn group(&self, group: usize) -> [u32; LANES] {
            core::array::from_fn(|i| self.next(group * 8 + i))
        }
    }

    /// Values that change between the passes must never make the kernel
    /// panic or return a row outside the mask, nor `None` while a row is
    /// eligible.
    #[test]
    fn a_column_changing_under_the_scan_still_yields_an_eligible_row() {
        for rows in [0usize, 5, 8, 64, 100, 130, 1000] {
            for seed in 0..300u64 {
                let mut mask: Vec<u64> = std::vec![0; rows.div_ceil(64).max(1)];
                let mut r = Rng::new(seed);
                for w in mask.iter_mut() {
                    *w = if seed % 3 == 0 { u64::MAX } else { r.next_u64() };
                }
                let col = Shifting {
                    rows,
                    reads: Cell::new(seed as u32),
                };
                let any = (0..rows).any(|row| contains(&mask, row));
                for backend in Backend::available() {
                    match least_loaded_on(backend, &col, &mask, &mut r) {
                        Some(row) => assert!(
                            row < rows && contains(&mask, row),
                            "{backend:?} rows {rows} seed {seed}: {row}"
                        ),
                        None => assert!(!any, "{backend:?} rows {rows} seed {seed}: None with eligible rows"),
                    }
                }
            }
        }
    }

    /// Over a tagged counter column (`value << 8 | tag`, the fleet's), pass
    /// 1 takes the least stored word and shifts it once: the tags must not
    /// change the row or the draw, for any mask, tie pattern or length.
    #[test]
    fn counter_columns_match_reference_whatever_the_tags() {
        use crate::lanes::{Column, Decode};
        const GROUPS: usize = 160;
        for seed in 0..300u64 {
            let mut r = Rng::new(seed);
            let rows = [1usize, 63, 64, 65, 200, 1000, GROUPS * LANES][seed as usize % 7];
            let column = Column::<GROUPS>::new(0);
            let spread = [1u64, 3, 1 << 24][seed as usize % 3];
            for row in 0..rows {
                let value = r.below(spread) as u32;
                let tag = r.next_u64() as u32 & 0xFF;
                column.at(row).store(value << 8 | tag, crate::sync::Ordering::Relaxed);
            }
            let mask: Vec<u64> = (0..rows.div_ceil(64))
                .map(|_| match r.below(3) {
                    0 => u64::MAX,
                    1 => r.next_u64(),
                    _ => r.next_u64() & r.next_u64() & r.next_u64(),
                })
                .collect();
            let view = column.view(rows, Decode::Shift(8));
            for backend in Backend::available() {
                let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
                let simd = least_loaded_on(backend, &view, &mask, &mut a);
                let want = least_loaded_reference(&view, &mask, &mut b);
                assert_eq!(simd, want, "{backend:?} seed {seed} rows {rows}");
                assert_eq!(a, b);
            }
        }
    }

    /// Past `REMEMBERED_WORDS` words pass 3 recounts instead of reading the
    /// stack counts; ties placed on both sides of that boundary, with a
    /// partial mask word and a tail, must still match the reference for every
    /// draw.
    #[test]
    fn ties_beyond_remembered_words_match_reference() {
        let rows = REMEMBERED_WORDS * 64 + 3 * 64 + 8 * 3 + 5;
        let mut active: Vec<u32> = (0..rows as u32).map(|r| 5 + r % 7).collect();
        for &r in &[3, 100, REMEMBERED_WORDS * 64 - 1, REMEMBERED_WORDS * 64 + 70, rows - 2] {
            active[r] = 1;
        }
        let mut mask: Vec<u64> = std::vec![u64::MAX; rows.div_ceil(64)];
        mask[2] = 0xF0F0_F0F0_F0F0_F0F0; // a partial word
        for seed in 0..200 {
            for backend in Backend::available() {
                let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
                let simd = least_loaded_on(backend, &active[..], &mask, &mut a);
                let want = least_loaded_reference(&active[..], &mask, &mut b);
                assert_eq!(simd, want, "{backend:?} seed {seed}");
                assert_eq!(a, b);
            }
        }
    }
}
