//! Argmin over eligible rows with ties broken uniformly at random: the core
//! shared by least-loaded, device-aware and the temperature-0 pick.
//!
//! ```text
//! pass 1: per 64-row mask word, the lane-wise min of its stored words (a
//!         fleet counter's value is its high bits: no decode shift), kept
//!         for the passes below and folded lane-wise into the least so far
//!         (no reduction per word)
//!         min = the least key, reduced once
//! cells:  the tie cells: lanes of words whose least key is min (a lane of
//!         a word covers 8 rows, one per lane group); each tie past the
//!         last whole lane group counts as one more
//! regime: at most FEW_WORDS words, or min the largest key: counted
//!         cells >= rows / DENSE: dense
//!         cells > FEW_CELLS: moderate
//!         otherwise: counted
//! dense:    up to TRIES times r = rng.below(rows); r eligible, key(r) == min -> r
//! moderate: up to TRIES times r = a uniform row of the tie cells; a tie -> r
//!         (every try a uniform tie; a cell holds at least one, so each try
//!          finds one with probability at least 1/8)
//! counted (or every try missed):
//!   pass 2: ties = #{eligible rows with key == min}, read again only in
//!           the words with a tie cell, each word's tie lanes remembered
//!           k = 0 if ties == 1 else rng.below(ties)
//!   pass 3: the k-th tie, from the remembered lanes
//! ```
//!
//! Why the rejection steps: a fleet where many rows share the least load
//! (an idle fleet, or one whose loads are small integers) would otherwise
//! pay a second read of every word to count its ties; a uniform row that
//! holds the minimum is already a uniform tie, and when at least one row in
//! `DENSE` ties, `TRIES` draws nearly always find one. Between that and a
//! handful of ties, a uniform row of the tie cells is a uniform tie too,
//! found in about eight tries. Which regime runs depends on the column
//! alone (the cell count), never on a draw, and each is uniform over the
//! ties, so the choice is uniform whichever runs. A sparse minimum (one
//! idle worker among busy ones) counts the ties in the few words that hold
//! one; a column of one word reads its keys once and counts (`argmin`'s
//! first branch, and the fused KV scan's).
//!
//! The fused KV scan fills pass 1's state from the costs it computes and
//! runs the rest (`Least`, `pick_least`).
//!
//! Mask words that are all ones (every row eligible: the common case) take a
//! path with no per-group mask work; all-zero words are skipped.
//!
//! Keys are compared with `<` / `==`. A NaN key (a cost the caller did not
//! refuse) is never chosen: every `min` takes the key first, so a NaN lane
//! leaves the least as it was, and a NaN is equal to nothing.
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
use core::mem::MaybeUninit;

/// A column of keys that the argmin can read one lane group at a time.
pub(crate) trait ArgminKey {
    /// Scalar key (`u32` or `f32`).
    type Key: Key;
    /// Above the dense bound, more tie cells than this take the moderate
    /// rejection step, this many or fewer are counted (see the module
    /// docs): about the number of words whose second read costs what eight
    /// single-row tries cost. A column read from memory counts few; the
    /// fused KV scan, which recomputes the costs it reads, counts more. Two
    /// columns whose argmins must draw alike (the KV cost column and the
    /// fused scan over the same costs) take the same bound.
    const FEW_CELLS: usize = 2;
    /// Number of rows.
    fn rows(&self) -> usize;
    /// Key of one row.
    fn key(&self, row: usize) -> Self::Key;
    /// [`key`](Self::key) of one row inside the whole lane groups, on
    /// backend `s` (the same value): a column that computes its keys may
    /// compute the row's lane group instead of the row alone. Default:
    /// [`key`](Self::key).
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn key_in<S: Simd>(&self, s: S, row: usize) -> Self::Key {
        let _ = s;
        self.key(row)
    }
    /// Keys of one lane group.
    fn keys<S: Simd>(&self, s: S, group: usize) -> KeyLanes<S, Self::Key>;
    /// Keys of the eight lane groups of one full mask word (`first_group`
    /// is a multiple of 8 and `first_group + 8 <= rows() / LANES`).
    #[cfg_attr(not(debug_assertions), inline(always))]
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
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn ordered<S: Simd>(&self, s: S, group: usize) -> KeyLanes<S, Self::Key> {
        self.keys(s, group)
    }
    /// [`ordered`](Self::ordered) for the eight lane groups of one full mask
    /// word.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn ordered8<S: Simd>(&self, s: S, first_group: usize) -> [KeyLanes<S, Self::Key>; 8] {
        self.keys8(s, first_group)
    }
    /// The key of an [`ordered`](Self::ordered) value.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn key_of_ordered(&self, k: Self::Key) -> Self::Key {
        k
    }
    /// The keys of [`ordered`](Self::ordered) lanes, decoded in registers.
    /// Default: the ordered lanes are the keys.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn keys_of_ordered<S: Simd>(&self, s: S, ordered: KeyLanes<S, Self::Key>) -> KeyLanes<S, Self::Key> {
        let _ = s;
        ordered
    }
    /// Pass 1 over the run of whole mask words whose every row is
    /// eligible, from word `w` on (below `end`, at most
    /// [`REMEMBERED_WORDS`]): pushes each word's lane-wise least into
    /// `least` and returns the first word not taken. The default reads
    /// each word through [`ordered8`](Self::ordered8).
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn least_run<S: Simd>(
        &self,
        s: S,
        mask: &[u64],
        w: usize,
        end: usize,
        least: &mut Least<'_, S, Self::Key>,
    ) -> usize {
        least_run_by_word(s, self, mask, w, end, least)
    }
    /// The greatest [`ordered`](Self::ordered) value whose key is at most
    /// `key`. Default: `key`.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn ordered_at_most(&self, key: Self::Key) -> Self::Key {
        key
    }
}

/// The lanes of backend `S` that hold keys of type `K`.
pub(crate) type KeyLanes<S, K> = <K as Key>::Lanes<S>;

/// Pass 1's lane-wise state: per lane, the least key so far, the number of
/// words whose lane holds it (reset to 1 by a lower key, one more for an
/// equal one) and the first of those words. At the end, the lanes whose
/// least is the minimum give the tie cells and the first word holding one.
pub(crate) struct Cells<S: Simd, K: Key> {
    least: K::Lanes<S>,
    count: S::U32,
    first: S::U32,
}

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
    /// Folds word `word`'s lane-wise least keys `keys` into `cells`.
    fn fold_cells<S: Simd>(s: S, cells: &mut Cells<S, Self>, keys: Self::Lanes<S>, word: S::U32);
    /// The lanes as an array.
    fn lanes_to_array<S: Simd>(lanes: Self::Lanes<S>) -> [Self; LANES];
    /// Lane-wise min of `keys` and `acc` (NaN keys passed over).
    fn min_lanes<S: Simd>(keys: Self::Lanes<S>, acc: Self::Lanes<S>) -> Self::Lanes<S>;
    /// The lanes at most `bound`, one bit each.
    fn at_most_bits<S: Simd>(s: S, lanes: Self::Lanes<S>, bound: Self) -> u8;
}

impl Key for u32 {
    const WORST: u32 = u32::MAX;
    type Lanes<S: Simd> = S::U32;
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn worst<S: Simd>(s: S) -> S::U32 {
        s.splat_u32(u32::MAX)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn min_eligible<S: Simd>(s: S, acc: S::U32, keys: S::U32, bits: u8) -> S::U32 {
        if bits == 0xFF {
            acc.min(keys)
        } else {
            acc.min(keys | !s.lane_mask(bits))
        }
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn eq_lanes<S: Simd>(s: S, keys: S::U32, k: u32) -> S::U32 {
        keys.cmp_eq(s.splat_u32(k))
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn fold_cells<S: Simd>(_s: S, c: &mut Cells<S, u32>, keys: S::U32, word: S::U32) {
        let lower = c.least.min(keys);
        // Lanes where the key is at most the least so far, equal to it,
        // and below it. Subtracting an all-ones lane adds one.
        let le = lower.cmp_eq(keys);
        let lt = le.xor(keys.cmp_eq(c.least));
        c.count = (c.count & !lt) - le;
        c.first = lt.cast_f32().blend(word.cast_f32(), c.first.cast_f32()).cast_u32();
        c.least = lower;
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn lanes_to_array<S: Simd>(lanes: S::U32) -> [u32; LANES] {
        lanes.to_array()
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn min_lanes<S: Simd>(keys: S::U32, acc: S::U32) -> S::U32 {
        keys.min(acc)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn at_most_bits<S: Simd>(s: S, lanes: S::U32, bound: u32) -> u8 {
        lanes.min(s.splat_u32(bound)).cmp_eq(lanes).bits()
    }
}

impl Key for f32 {
    const WORST: f32 = f32::INFINITY;
    type Lanes<S: Simd> = S::F32;
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn worst<S: Simd>(s: S) -> S::F32 {
        s.splat_f32(f32::INFINITY)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn min_eligible<S: Simd>(s: S, acc: S::F32, keys: S::F32, bits: u8) -> S::F32 {
        // `keys` first: `min` returns its second operand where either is
        // NaN, so a NaN key is passed over.
        if bits == 0xFF {
            keys.min(acc)
        } else {
            let m = s.lane_mask(bits).cast_f32();
            m.blend(keys, s.splat_f32(f32::INFINITY)).min(acc)
        }
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn eq_lanes<S: Simd>(s: S, keys: S::F32, k: f32) -> S::U32 {
        keys.cmp_eq(s.splat_f32(k)).cast_u32()
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn fold_cells<S: Simd>(_s: S, c: &mut Cells<S, f32>, keys: S::F32, word: S::U32) {
        let le = keys.cmp_le(c.least);
        let lt = le.cast_u32().xor(keys.cmp_eq(c.least).cast_u32());
        c.count = (c.count & !lt) - le.cast_u32();
        c.first = lt.cast_f32().blend(word.cast_f32(), c.first.cast_f32()).cast_u32();
        c.least = keys.min(c.least);
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn lanes_to_array<S: Simd>(lanes: S::F32) -> [f32; LANES] {
        lanes.to_array()
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn min_lanes<S: Simd>(keys: S::F32, acc: S::F32) -> S::F32 {
        keys.min(acc)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn at_most_bits<S: Simd>(s: S, lanes: S::F32, bound: f32) -> u8 {
        lanes.cmp_le(s.splat_f32(bound)).bits()
    }
}

/// Mask words (64 rows each) whose tie counts pass 2 remembers on the stack
/// so pass 3 can jump to the word holding the chosen tie: 16,384 rows in 256
/// bytes. Words past it are recounted in pass 3.
pub(crate) const REMEMBERED_WORDS: usize = 256;

/// Lane groups `[first, end)` covered by mask word `w`, and the word.
#[cfg_attr(not(debug_assertions), inline(always))]
fn word_span(mask: &[u64], w: usize, groups: usize) -> (usize, usize, u64) {
    let first = w * 8;
    (first, (first + 8).min(groups), mask.get(w).copied().unwrap_or(0))
}

/// Pass 1 over one mask word: folds its eligible keys, in their
/// [`ordered`](ArgminKey::ordered) form, into `acc`.
#[cfg_attr(not(debug_assertions), inline(always))]
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

/// Draws of the rejection step: at most this many uniform rows are tried
/// before the ties are counted. The step runs only with at least
/// `rows / DENSE` tie cells, each holding a tie, so at least one row in
/// [`DENSE`] holds the minimum and every try finds one with probability at
/// least `1 / DENSE`: all `TRIES` miss in at most one call in 7.6 at that
/// bound (`(31/32)^64`), and in one in 10^11 when a third of the rows tie.
const TRIES: usize = 64;

/// The dense rejection step (uniform rows) runs when the tie cells (see
/// [`Least`]) number at least `rows / DENSE`.
const DENSE: usize = 32;

/// A column of at most this many mask words (256 rows) has its ties
/// counted: a second read of its few words costs less than the draws.
const FEW_WORDS: usize = 4;

/// Tie cells the moderate step lists: below the dense bound a fleet of
/// `REMEMBERED_WORDS` words (16,384 rows) has fewer than `16_384 / DENSE`.
const LISTED_CELLS: usize = REMEMBERED_WORDS * 64 / DENSE;

/// The row of tie cell `cell` (`8 * word + lane`) in its lane group `g`.
#[cfg_attr(not(debug_assertions), inline(always))]
fn cell_row(cell: u16, g: usize) -> usize {
    let (w, lane) = (usize::from(cell) / LANES, usize::from(cell) % LANES);
    64 * w + 8 * g + lane
}

/// The `k`-th eligible row at `min` past the last whole lane group.
#[cfg_attr(not(debug_assertions), inline(always))]
fn tail_tie<C: ArgminKey + ?Sized>(col: &C, mask: &[u64], min: C::Key, k: usize) -> Option<usize> {
    let rows = col.rows();
    (rows / LANES * LANES..rows)
        .filter(|&row| contains(mask, row) && col.key(row) == min)
        .nth(k)
}

/// The lane-wise least [`ordered`](ArgminKey::ordered) key of the whole
/// mask word `w`, every row eligible.
#[cfg_attr(not(debug_assertions), inline(always))]
fn least_of_whole_word<S: Simd, C: ArgminKey + ?Sized>(s: S, col: &C, w: usize) -> KeyLanes<S, C::Key> {
    let ordered = col.ordered8(s, w * 8);
    let mut acc = ordered[0];
    for lanes in &ordered[1..] {
        acc = C::Key::min_eligible(s, acc, *lanes, 0xFF);
    }
    acc
}

/// [`ArgminKey::least_run`]'s default: each word through
/// [`ordered8`](ArgminKey::ordered8).
#[cfg_attr(not(debug_assertions), inline(always))]
pub(crate) fn least_run_by_word<S: Simd, C: ArgminKey + ?Sized>(
    s: S,
    col: &C,
    mask: &[u64],
    mut w: usize,
    end: usize,
    least: &mut Least<'_, S, C::Key>,
) -> usize {
    while w < end && mask[w] == u64::MAX {
        let lanes = least_of_whole_word(s, col, w);
        least.push_remembered(s, w, lanes, col.keys_of_ordered(s, lanes));
        w += 1;
    }
    w
}

/// The lane-wise least [`ordered`](ArgminKey::ordered) key of mask word
/// `w`'s eligible rows (ineligible lanes above every key).
#[cfg_attr(not(debug_assertions), inline(always))]
fn least_of_word<S: Simd, C: ArgminKey + ?Sized>(
    s: S,
    col: &C,
    mask: &[u64],
    w: usize,
    full: usize,
    groups: usize,
) -> KeyLanes<S, C::Key> {
    if w < full && mask.get(w) == Some(&u64::MAX) {
        least_of_whole_word(s, col, w)
    } else {
        min_of_word(s, col, mask, w, groups, C::Key::worst(s))
    }
}

/// The room [`Least`] remembers word leasts in (on the caller's stack,
/// left uninitialised until written).
pub(crate) type LeastRoom<S, K> = [MaybeUninit<<K as Key>::Lanes<S>>; REMEMBERED_WORDS];

/// An empty [`LeastRoom`].
#[cfg_attr(not(debug_assertions), inline(always))]
pub(crate) const fn least_room<S: Simd, K: Key>() -> LeastRoom<S, K> {
    [const { MaybeUninit::uninit() }; REMEMBERED_WORDS]
}

/// Pass 1's result: each mask word's lane-wise least
/// [`ordered`](ArgminKey::ordered) keys (the first [`REMEMBERED_WORDS`]
/// words, in a room apart so that the rest stays in registers) and what
/// gives the tie cells once the minimum is known. Filled one word at a
/// time, in order, two ways:
///
/// * [`push`](Self::push) (and [`push_remembered`](Self::push_remembered))
///   folds the word into lane-wise [`Cells`] as it goes: the argmin's scan
///   of a column, which has registers to spare;
/// * [`remember`](Self::remember) only stores the word and keeps a
///   lane-wise minimum: the fused KV scan, whose costs need every register;
///   [`tie_cells`](Self::tie_cells) then counts those words' tie cells from
///   the room, once the minimum is known. Remembered words come first.
pub(crate) struct Least<'r, S: Simd, K: Key> {
    words: &'r mut LeastRoom<S, K>,
    /// Words pushed or remembered.
    pushed: usize,
    /// The leading words remembered without a fold.
    unfolded: usize,
    /// The lane-wise least key of the unfolded words.
    unfolded_least: K::Lanes<S>,
    cells: Cells<S, K>,
    word: S::U32,
}

impl<'r, S: Simd, K: Key> Least<'r, S, K> {
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(crate) fn new(s: S, room: &'r mut LeastRoom<S, K>) -> Self {
        Least {
            words: room,
            pushed: 0,
            unfolded: 0,
            unfolded_least: K::worst(s),
            cells: Cells {
                least: K::worst(s),
                count: s.splat_u32(0),
                first: s.splat_u32(0),
            },
            word: s.splat_u32(0),
        }
    }

    /// The next word's lane-wise least ordered keys `ordered`, and the
    /// same decoded (`keys`).
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(crate) fn push(&mut self, s: S, ordered: K::Lanes<S>, keys: K::Lanes<S>) {
        if let Some(slot) = self.words.get_mut(self.pushed) {
            slot.write(ordered);
        }
        K::fold_cells(s, &mut self.cells, keys, self.word);
        self.word = self.word + s.splat_u32(1);
        self.pushed += 1;
    }

    /// [`push`](Self::push) for word `w`, the next one, below
    /// [`REMEMBERED_WORDS`] as the caller's loop knows: no room check.
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(crate) fn push_remembered(&mut self, s: S, w: usize, ordered: K::Lanes<S>, keys: K::Lanes<S>) {
        debug_assert_eq!(w, self.pushed);
        self.words[w].write(ordered);
        K::fold_cells(s, &mut self.cells, keys, self.word);
        self.word = self.word + s.splat_u32(1);
        // From `w`, not counted: the caller's loop counter is the count.
        self.pushed = w + 1;
    }

    /// Remembers word `w`, the next one, below [`REMEMBERED_WORDS`], whose
    /// ordered keys are its keys, without a fold. Only before any
    /// [`push`](Self::push).
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(crate) fn remember(&mut self, w: usize, keys: K::Lanes<S>) {
        debug_assert!(w == self.pushed && self.pushed == self.unfolded);
        self.words[w].write(keys);
        self.unfolded_least = K::min_lanes(keys, self.unfolded_least);
        (self.pushed, self.unfolded) = (w + 1, w + 1);
    }

    /// Notes that the words pushed from now on start at word `w` (after the
    /// remembered ones): the tie cells' first word counts from there.
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(crate) fn fold_from(&mut self, s: S, w: usize) {
        self.word = s.splat_u32(w as u32);
    }

    /// The least key of every word (the key of the worst lanes when none
    /// held a key).
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(crate) fn min(&self) -> K {
        let lanes = if self.unfolded == 0 {
            self.cells.least
        } else {
            K::min_lanes(self.unfolded_least, self.cells.least)
        };
        K::lanes_to_array::<S>(lanes)
            .into_iter()
            .fold(K::WORST, |m, k| if k < m { k } else { m })
    }

    /// The tie cells at the minimum `min` (`bound` its
    /// [`ordered_at_most`](ArgminKey::ordered_at_most)): their number and
    /// the first word holding one (`words` when none does).
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn tie_cells(&self, s: S, min: K, bound: K, words: usize) -> (usize, usize) {
        // The lanes whose least is the minimum: their counts, and the
        // least of their first words.
        let at_min = K::eq_lanes(s, self.cells.least, min);
        let mut cells = (self.cells.count & at_min).reduce_add() as usize;
        let mut start = (self.cells.first | !at_min).reduce_min().min(words as u32) as usize;
        for w in (0..self.unfolded).rev() {
            // SAFETY: `remember` wrote every word below `unfolded`.
            let bits = K::at_most_bits(s, unsafe { self.words[w].assume_init() }, bound);
            if bits != 0 {
                cells += bits.count_ones() as usize;
                start = w;
            }
        }
        (cells, start)
    }

    /// Word `w`'s lane-wise least ordered keys, if remembered.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn remembered(&self, w: usize) -> Option<K::Lanes<S>> {
        if w < self.pushed {
            // SAFETY: `push`, `push_remembered` and `remember` wrote every
            // entry below `pushed` that fits the room (`get` checks the
            // room).
            self.words.get(w).map(|slot| unsafe { slot.assume_init() })
        } else {
            None
        }
    }
}

/// SIMD argmin with uniform random ties. See the module docs.
///
/// Returns `None` when no row is eligible. Draws at most `TRIES + 1`
/// times: none when one eligible row holds the minimum.
#[cfg_attr(not(debug_assertions), inline(always))]
pub(crate) fn argmin<S: Simd, C: ArgminKey + ?Sized>(s: S, col: &C, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    let rows = col.rows();
    let groups = rows / LANES;
    let words = groups.div_ceil(8);
    if words <= 1 {
        // At most one word of whole lane groups: its keys read once.
        let keys: [KeyLanes<S, C::Key>; 8] =
            core::array::from_fn(|g| if g < groups { col.keys(s, g) } else { C::Key::worst(s) });
        let mut least = C::Key::worst(s);
        for (g, &k) in keys.iter().enumerate().take(groups) {
            least = C::Key::min_eligible(s, least, k, crate::mask::group_bits(mask, g));
        }
        let mut min = C::Key::lanes_to_array::<S>(least)
            .into_iter()
            .fold(C::Key::WORST, |m, k| if k < m { k } else { m });
        for row in groups * LANES..rows {
            if contains(mask, row) {
                let k = col.key(row);
                if k < min {
                    min = k;
                }
            }
        }
        return pick_in_one_word(s, col, mask, &keys, min, rng);
    }
    // Mask words whose eight lane groups all exist.
    let full = (groups / 8).min(mask.len());
    // Pass 1: the least key, lane by lane (no reduction per word), with the
    // tie cells (see `Least`); each word's lanes remembered for pass 2.
    let mut room = least_room::<S, C::Key>();
    let mut least = Least::new(s, &mut room);
    let stored = words.min(REMEMBERED_WORDS);
    let whole = full.min(stored);
    let mut w = 0;
    while w < stored {
        // Runs of whole words whose every row is eligible take a loop of
        // their own: no per-group mask work, nothing else live.
        w = col.least_run(s, mask, w, whole, &mut least);
        if w == stored {
            break;
        }
        let lanes = min_of_word(s, col, mask, w, groups, C::Key::worst(s));
        least.push_remembered(s, w, lanes, col.keys_of_ordered(s, lanes));
        w += 1;
    }
    for w in stored..words {
        let lanes = least_of_word(s, col, mask, w, full, groups);
        least.push(s, lanes, col.keys_of_ordered(s, lanes));
    }
    let mut min = least.min();
    // The rows past the last whole lane group.
    for row in groups * LANES..rows {
        if contains(mask, row) {
            let k = col.key(row);
            if k < min {
                min = k;
            }
        }
    }
    pick_least(s, col, mask, &least, min, rng)
}

/// Row `row`'s key: through its lane group inside the whole ones
/// ([`ArgminKey::key_in`]), alone past them.
#[cfg_attr(not(debug_assertions), inline(always))]
fn key_of_row<S: Simd, C: ArgminKey + ?Sized>(s: S, col: &C, row: usize, groups: usize) -> C::Key {
    if row < groups * LANES {
        col.key_in(s, row)
    } else {
        col.key(row)
    }
}

/// The argmin after pass 1: `least` holds every whole lane group's word
/// leasts (pushed by mask word, in order) and `min` is the least eligible
/// key, the rows past the last whole lane group included. The tie cells,
/// the rejection step, pass 2 and pass 3 of the module docs.
#[cfg_attr(not(debug_assertions), inline(always))]
pub(crate) fn pick_least<S: Simd, C: ArgminKey + ?Sized>(
    s: S,
    col: &C,
    mask: &[u64],
    least: &Least<'_, S, C::Key>,
    min: C::Key,
    rng: &mut Rng,
) -> Option<usize> {
    let rows = col.rows();
    let groups = rows / LANES;
    let words = groups.div_ceil(8);
    let full = (groups / 8).min(mask.len());
    let tail = tail_ties(col, mask, min);
    let bound = col.ordered_at_most(min);
    // The tie cells (lanes of words whose least is the minimum) and the
    // first word holding one.
    let (mut tie_cells, start) = least.tie_cells(s, min, bound, words);
    // Rejection (see the module docs): whether and how to try depends on
    // the column alone, never on a draw, and every try is uniform over the
    // ties, so the choice is uniform whichever runs.
    if min != col.key_of_ordered(C::Key::WORST) && words > FEW_WORDS {
        if (tie_cells + tail) * DENSE >= rows {
            // Dense: a uniform row.
            for _ in 0..TRIES {
                let row = rng.below(rows as u64) as usize;
                if contains(mask, row) && key_of_row(s, col, row, groups) == min {
                    return Some(row);
                }
            }
        } else if tie_cells > C::FEW_CELLS && words <= REMEMBERED_WORDS {
            // Moderate: a uniform row of a tie cell (or a tie past the
            // last whole lane group), each cell holding a tie.
            let mut listed = [0u16; LISTED_CELLS];
            let mut n = 0;
            let mut w = start;
            while n < tie_cells && w < words {
                if let Some(lanes) = least.remembered(w) {
                    let mut bits = C::Key::at_most_bits(s, lanes, bound);
                    while bits != 0 {
                        if let Some(slot) = listed.get_mut(n) {
                            *slot = (w * LANES) as u16 | bits.trailing_zeros() as u16;
                        }
                        n += 1;
                        bits &= bits - 1;
                    }
                }
                w += 1;
            }
            let listed = &listed[..n.min(LISTED_CELLS)];
            let grouped = (listed.len() * 8 + tail) as u64;
            for _ in 0..TRIES {
                let r = rng.below(grouped) as usize;
                let row = match listed.get(r / 8) {
                    Some(&cell) => cell_row(cell, r % 8),
                    None => match tail_tie(col, mask, min, r - listed.len() * 8) {
                        Some(row) => return Some(row),
                        None => break,
                    },
                };
                if row < groups * LANES && contains(mask, row) && col.key_in(s, row) == min {
                    return Some(row);
                }
            }
        }
    }
    // Pass 2: the ties, counted in the words that hold a tie cell, from the
    // first such word until every tie cell is seen; each counted word's tie
    // lanes remembered, so that pass 3 reads no key again.
    let mut tied = Tied::new();
    let mut ties = tail;
    let mut w = start;
    while tie_cells > 0 && w < words {
        let lanes = match least.remembered(w) {
            Some(lanes) => lanes,
            None => least_of_word(s, col, mask, w, full, groups),
        };
        let cells = C::Key::at_most_bits(s, lanes, bound);
        if cells != 0 {
            tie_cells = tie_cells.saturating_sub(cells.count_ones() as usize);
            ties += tied.count(w, tie_lanes_of_word(s, col, mask, w, groups, min));
        } else {
            tied.none(w);
        }
        w += 1;
    }
    // Pass 3: one tie drawn (none for a single one) and found.
    if ties == 0 {
        // No row holds `min` any more (a live column changed since it was
        // computed), or none is eligible: one more pass decides.
        return settle(col, mask);
    }
    let mut k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    for v in start..w {
        let lanes = match tied.lanes(v) {
            Some(lanes) => lanes,
            None => tie_lanes_of_word(s, col, mask, v, groups, min),
        };
        for (g, &t) in lanes.iter().enumerate() {
            let c = t.count_ones() as usize;
            if k < c {
                return Some(64 * v + 8 * g + nth_bit(t, k));
            }
            k -= c;
        }
    }
    (groups * LANES..rows)
        .filter(|&row| contains(mask, row) && col.key(row) == min)
        .nth(k)
        .or_else(|| settle(col, mask))
}

/// The argmin of a column of at most one mask word of whole lane groups
/// (at most 71 rows), whose lane groups' keys `keys` its caller read once
/// (the groups past the column's are not read) and whose least eligible key
/// is `min`: the ties counted (the only regime of so few words) and one
/// drawn.
#[cfg_attr(not(debug_assertions), inline(always))]
pub(crate) fn pick_in_one_word<S: Simd, C: ArgminKey + ?Sized>(
    s: S,
    col: &C,
    mask: &[u64],
    keys: &[KeyLanes<S, C::Key>; 8],
    min: C::Key,
    rng: &mut Rng,
) -> Option<usize> {
    let rows = col.rows();
    let groups = (rows / LANES).min(8);
    let mut tied = [0u8; 8];
    let mut ties = tail_ties(col, mask, min);
    for (g, t) in tied.iter_mut().enumerate().take(groups) {
        *t = C::Key::eq_lanes(s, keys[g], min).bits() & crate::mask::group_bits(mask, g);
        ties += t.count_ones() as usize;
    }
    if ties == 0 {
        return settle(col, mask);
    }
    let mut k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    for (g, &t) in tied.iter().enumerate() {
        let c = t.count_ones() as usize;
        if k < c {
            return Some(8 * g + nth_bit(t, k));
        }
        k -= c;
    }
    tail_tie(col, mask, min, k).or_else(|| settle(col, mask))
}

/// Eligible rows past the last whole lane group whose key equals `min`.
#[cfg_attr(not(debug_assertions), inline(always))]
fn tail_ties<C: ArgminKey + ?Sized>(col: &C, mask: &[u64], min: C::Key) -> usize {
    let rows = col.rows();
    (rows / LANES * LANES..rows)
        .filter(|&row| contains(mask, row) && col.key(row) == min)
        .count()
}

/// The `k`-th set bit of `bits` (`k < bits.count_ones()`).
#[cfg_attr(not(debug_assertions), inline(always))]
fn nth_bit(mut bits: u8, k: usize) -> usize {
    for _ in 0..k {
        bits &= bits - 1;
    }
    bits.trailing_zeros() as usize
}

/// Pass 2's tie lanes of the words it visited (the first
/// [`REMEMBERED_WORDS`]; past them pass 3 reads the keys again), left
/// uninitialised until written: pass 2 writes the count of every word it
/// visits, and the lanes of those whose count is not 0; pass 3 reads only
/// the words pass 2 visited.
struct Tied {
    lanes: [MaybeUninit<[u8; 8]>; REMEMBERED_WORDS],
    counts: [MaybeUninit<u8>; REMEMBERED_WORDS],
}

impl Tied {
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn new() -> Self {
        Tied {
            lanes: [const { MaybeUninit::uninit() }; REMEMBERED_WORDS],
            counts: [const { MaybeUninit::uninit() }; REMEMBERED_WORDS],
        }
    }

    /// Word `w` holds no tie.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn none(&mut self, w: usize) {
        if let Some(count) = self.counts.get_mut(w) {
            count.write(0);
        }
    }

    /// Word `w`'s tie lanes (one byte per lane group); returns how many.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn count(&mut self, w: usize, lanes: [u8; 8]) -> usize {
        let c = lanes.iter().map(|b| b.count_ones() as usize).sum::<usize>();
        if let (Some(slot), Some(count)) = (self.lanes.get_mut(w), self.counts.get_mut(w)) {
            slot.write(lanes);
            count.write(c as u8); // at most 64
        }
        c
    }

    /// Word `w`'s tie lanes, if remembered; `w` must be a word pass 2
    /// visited.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn lanes(&self, w: usize) -> Option<[u8; 8]> {
        // SAFETY: pass 2 wrote the count of every word it visited (`none`
        // or `count`), and the lanes of those whose count is not 0.
        let c = unsafe { self.counts.get(w)?.assume_init() };
        Some(if c == 0 {
            [0; 8]
        } else {
            // SAFETY: as above, a non-zero count comes with its lanes.
            unsafe { self.lanes[w].assume_init() }
        })
    }
}

/// The eligible rows of mask word `w` whose key equals `min`, one byte per
/// lane group (lane `l` of group `g` in bit `l` of byte `g`).
#[cfg_attr(not(debug_assertions), inline(always))]
fn tie_lanes_of_word<S: Simd, C: ArgminKey + ?Sized>(
    s: S,
    col: &C,
    mask: &[u64],
    w: usize,
    groups: usize,
    min: C::Key,
) -> [u8; 8] {
    let (first, end, word) = word_span(mask, w, groups);
    let mut lanes = [0u8; 8];
    if word == u64::MAX && end - first == 8 {
        for (t, keys) in lanes.iter_mut().zip(col.keys8(s, first)) {
            *t = C::Key::eq_lanes(s, keys, min).bits();
        }
    } else {
        for g in first..end {
            let bits = (word >> ((g - first) * 8)) as u8;
            if bits != 0 {
                lanes[g - first] = C::Key::eq_lanes(s, col.keys(s, g), min).bits() & bits;
            }
        }
    }
    lanes
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
        // `k == k`: not NaN.
        #[allow(clippy::eq_op)]
        if k == k && best.is_none_or(|(_, b)| k < b) {
            best = Some((row, k));
        }
    }
    best.map(|(row, _)| row)
}

/// Scalar reference of [`argmin`]: same result, same draws.
///
/// The minimum over eligible rows (NaN keys never chosen); then the regime
/// of [`tie_regime`]: dense, up to `TRIES` uniform rows, the first eligible
/// one at the minimum the answer; moderate, up to `TRIES` uniform rows of
/// the tie cells (in order of word, then lane; a draw past them is a tie
/// past the last whole lane group, taken), the first eligible one at the
/// minimum the answer; otherwise, or when every try missed, the ties
/// counted and one drawn (no draw for a single tie).
pub(crate) fn argmin_reference<C: ArgminKey + ?Sized>(col: &C, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    let no_key = col.key_of_ordered(C::Key::WORST);
    argmin_reference_by(col.rows(), mask, no_key, C::FEW_CELLS, |row| col.key(row), rng)
}

/// How the argmin breaks a tie at `min` (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TieRegime {
    /// Uniform rows, at most `TRIES` of them.
    Dense,
    /// Uniform rows of the `cells` tie cells, or one of the `tail` ties past
    /// the last whole lane group, at most `TRIES` of them.
    Moderate { cells: usize, tail: usize },
    /// The ties counted and one drawn.
    Counted,
}

/// The regime the argmin takes for the minimum `min` of `rows` rows whose
/// keys `key` gives, from the definitions alone: a tie cell is one lane of
/// one mask word (the rows `64 * w + 8 * g + lane` of its whole lane groups
/// `g`) holding an eligible row at `min`; each eligible tie past the last
/// whole lane group counts as one more. At the largest key, or with at most
/// `FEW_WORDS` mask words of whole lane groups: counted. Otherwise at least
/// `rows / DENSE` of them: dense; more than `few_cells` cells (and at most
/// `REMEMBERED_WORDS` words): moderate; otherwise counted.
pub(crate) fn tie_regime<K: Key>(
    rows: usize,
    mask: &[u64],
    no_key: K,
    few_cells: usize,
    key: &impl Fn(usize) -> K,
    min: K,
) -> TieRegime {
    let tie = |row: usize| contains(mask, row) && key(row) == min;
    let grouped = rows / LANES * LANES;
    let words = grouped.div_ceil(64);
    if min == no_key || words <= FEW_WORDS {
        return TieRegime::Counted;
    }
    let tail = (grouped..rows).filter(|&r| tie(r)).count();
    let cells = (0..words)
        .flat_map(|w| (0..LANES).map(move |lane| (w, lane)))
        .filter(|&(w, lane)| (0..8).map(|g| 64 * w + 8 * g + lane).any(|r| r < grouped && tie(r)))
        .count();
    if (cells + tail) * DENSE >= rows {
        TieRegime::Dense
    } else if cells > few_cells && words <= REMEMBERED_WORDS {
        TieRegime::Moderate { cells, tail }
    } else {
        TieRegime::Counted
    }
}

/// [`argmin_reference`] over `rows` rows whose keys `key` gives (NaN keys
/// are never chosen), `no_key` the key of a lane without one (the largest
/// key: no rejection step at that minimum).
pub(crate) fn argmin_reference_by<K: Key>(
    rows: usize,
    mask: &[u64],
    no_key: K,
    few_cells: usize,
    key: impl Fn(usize) -> K,
    rng: &mut Rng,
) -> Option<usize> {
    let mut min: Option<K> = None;
    for row in 0..rows {
        if contains(mask, row) {
            let k = key(row);
            // `k == k`: not NaN.
            #[allow(clippy::eq_op)]
            if k == k && min.is_none_or(|m| k < m) {
                min = Some(k);
            }
        }
    }
    let min = min?;
    let tie = |row: usize| contains(mask, row) && key(row) == min;
    let grouped = rows / LANES * LANES;
    match tie_regime(rows, mask, no_key, few_cells, &key, min) {
        TieRegime::Dense => {
            for _ in 0..TRIES {
                let row = rng.below(rows as u64) as usize;
                if tie(row) {
                    return Some(row);
                }
            }
        }
        TieRegime::Moderate { cells, tail } => {
            // The tie cells, in order of word, then lane.
            let cell = |i: usize| {
                (0..grouped.div_ceil(64))
                    .flat_map(|w| (0..LANES).map(move |lane| (w, lane)))
                    .filter(|&(w, lane)| (0..8).map(|g| 64 * w + 8 * g + lane).any(|r| r < grouped && tie(r)))
                    .nth(i)
            };
            for _ in 0..TRIES {
                let r = rng.below((cells * 8 + tail) as u64) as usize;
                if r >= cells * 8 {
                    return (grouped..rows).filter(|&r| tie(r)).nth(r - cells * 8);
                }
                let (w, lane) = cell(r / 8)?;
                let row = 64 * w + 8 * (r % 8) + lane;
                if row < grouped && tie(row) {
                    return Some(row);
                }
            }
        }
        TieRegime::Counted => {}
    }
    let ties = (0..rows).filter(|&r| tie(r)).count();
    let k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    (0..rows).filter(|&r| tie(r)).nth(k)
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
