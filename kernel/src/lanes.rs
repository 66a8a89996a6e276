//! Lane width and column storage: how the SIMD kernels read a column.
//!
//! # Lanes and backends
//!
//! selkie's SIMD kernels process eight rows per step, through the lane
//! types of a SIMD backend ([`crate::simd`]): one `ymm` register with AVX2,
//! a pair of SSE2 registers on baseline x86-64, one NEON pair on aarch64,
//! plain arrays where there is no vector unit (Cortex-M, miri). Eight lanes
//! is the widest that is native on AVX2 and still cheap everywhere else. The
//! backend is chosen at run time on x86-64, in one place: see
//! [`crate::simd`] and [`crate::simd_backend`].
//!
//! Every kernel has a scalar reference in the same file; the SIMD versions
//! only need [`U32Source`] / [`F32Source`] to read a column, so they run
//! unchanged over plain slices (tests, fuzzing, per-request columns) and over
//! the fleet's atomic columns.
//!
//! This module must not contain selection logic.

use crate::simd::{Simd, U32Lanes};
use crate::sync::{load_lanes, AtomicU32, Ordering};

/// `[e(0), e(1), ..., e(7)]` without a closure: a closure is compiled
/// without the target features of the AVX2 entry point it is called from
/// whenever LLVM declines to inline it.
macro_rules! by_lane8 {
    ($i:ident => $e:expr) => {
        [
            {
                let $i = 0;
                $e
            },
            {
                let $i = 1;
                $e
            },
            {
                let $i = 2;
                $e
            },
            {
                let $i = 3;
                $e
            },
            {
                let $i = 4;
                $e
            },
            {
                let $i = 5;
                $e
            },
            {
                let $i = 6;
                $e
            },
            {
                let $i = 7;
                $e
            },
        ]
    };
}

/// Number of rows processed per SIMD step. Columns are padded to a multiple.
pub const LANES: usize = 8;

/// Rounds a row count up to a whole number of lane groups.
#[inline]
pub const fn padded_rows(rows: usize) -> usize {
    rows.div_ceil(LANES) * LANES
}

/// A column of `u32` values a kernel can read one lane group at a time.
///
/// Implemented for plain slices and for the fleet's atomic counter columns.
pub trait U32Source {
    /// Number of rows.
    fn rows(&self) -> usize;
    /// The value at `row` (`row < rows()`).
    fn value(&self, row: usize) -> u32;
    /// The `LANES` values of lane group `group` (`(group + 1) * LANES <= rows()`).
    fn group(&self, group: usize) -> [u32; LANES];
    /// [`group`](Self::group) as lanes of backend `s`. The default loads the
    /// array; slices and the fleet's columns load directly.
    #[inline(always)]
    fn lanes<S: Simd>(&self, s: S, group: usize) -> S::U32 {
        s.load_u32(&self.group(group))
    }
    /// Eight lane groups (64 rows, one mask word) from `first_group`
    /// (`(first_group + 8) * LANES <= rows()`); one bounds check for all.
    #[inline(always)]
    fn lanes8<S: Simd>(&self, s: S, first_group: usize) -> [S::U32; 8] {
        by_lane8!(i => self.lanes(s, first_group + i))
    }
    /// The number of low bits of each stored word below the value (`value =
    /// word >> word_shift()`): 0 (the default) for a column that stores its
    /// values.
    #[inline(always)]
    fn word_shift(&self) -> u32 {
        0
    }
    /// The stored words of eight lane groups (as [`lanes8`](Self::lanes8)),
    /// before the [`word_shift`](Self::word_shift): ordered like the values
    /// (a value sits in the high bits), so a scan for the least value can
    /// take the least word and shift it once. Default: the values.
    #[inline(always)]
    fn words8<S: Simd>(&self, s: S, first_group: usize) -> [S::U32; 8] {
        self.lanes8(s, first_group)
    }
    /// The stored words of one lane group (see [`words8`](Self::words8)).
    #[inline(always)]
    fn words<S: Simd>(&self, s: S, group: usize) -> S::U32 {
        self.lanes(s, group)
    }
    /// The first `words` mask words' lane groups (`8 * words` groups) as a
    /// [`GroupWords`], bounds checked once here so that a kernel's inner
    /// loop indexes them without checks; `None` (the default) when the
    /// column has no such form or is shorter, and the kernel then reads it
    /// with [`lanes`](Self::lanes).
    #[inline(always)]
    fn group_words(&self, words: usize) -> Option<GroupWords<'_>> {
        let _ = words;
        None
    }
}

/// The first lane groups of a `u32` column in the form a kernel's inner
/// loop reads without a bounds check or a decode branch per group (from
/// [`U32Source::group_words`]).
#[derive(Clone, Copy)]
pub struct GroupWords<'a>(pub(crate) Words<'a>);

/// The two forms of [`GroupWords`].
#[derive(Clone, Copy)]
pub(crate) enum Words<'a> {
    /// A plain column: the words are the values.
    Plain(&'a [[[u32; LANES]; 8]]),
    /// A fleet counter column: `value = word >> shift`, `1 <= shift < 32`,
    /// so every value is below `2^31`.
    Counter(&'a [[AtomicGroup; 8]], u32),
}

/// A column's lane groups as values, converted to `f32` exactly as
/// `x as f32` would, indexed by mask word (eight groups) and group within
/// it: the readers of [`Words`], one per form, so that a kernel's loop is
/// compiled once per form with no branch or bounds check per group.
pub(crate) trait GroupValues: Copy {
    /// Group `i` (`< 8`) of word `w` as `f32` lanes.
    fn values_f32<S: Simd>(self, s: S, w: usize, i: usize) -> S::F32;
    /// Group `I` of word `w` as `f32` lanes (a constant group: no address
    /// arithmetic per load in an unrolled loop).
    #[inline(always)]
    fn values_f32_at<S: Simd, const I: usize>(self, s: S, w: usize) -> S::F32 {
        self.values_f32(s, w, I)
    }
}

/// [`Words::Plain`]'s reader: the full `u32` range, two-part conversion.
#[derive(Clone, Copy)]
pub(crate) struct PlainValues<'a>(pub(crate) &'a [[[u32; LANES]; 8]]);

impl GroupValues for PlainValues<'_> {
    #[inline(always)]
    fn values_f32<S: Simd>(self, s: S, w: usize, i: usize) -> S::F32 {
        s.load_u32(&self.0[w][i]).to_f32()
    }
}

/// [`Words::Counter`]'s reader: one shift, then one signed conversion
/// (exact `x as f32` because the shifted value is below `2^31`).
#[derive(Clone, Copy)]
pub(crate) struct CounterValues<'a>(pub(crate) &'a [[AtomicGroup; 8]], pub(crate) u32);

impl GroupValues for CounterValues<'_> {
    #[inline(always)]
    fn values_f32<S: Simd>(self, s: S, w: usize, i: usize) -> S::F32 {
        s.load_atomic(&self.0[w][i]).shr(self.1).small_to_f32()
    }
    #[inline(always)]
    fn values_f32_at<S: Simd, const I: usize>(self, s: S, w: usize) -> S::F32 {
        s.load_atomic_in::<I>(&self.0[w]).shr(self.1).small_to_f32()
    }
}

/// A column of `f32` values a kernel can read one lane group at a time.
pub trait F32Source {
    /// Number of rows.
    fn rows(&self) -> usize;
    /// The value at `row` (`row < rows()`).
    fn value(&self, row: usize) -> f32;
    /// The `LANES` values of lane group `group` (`(group + 1) * LANES <= rows()`).
    fn group(&self, group: usize) -> [f32; LANES];
    /// [`group`](Self::group) as lanes of backend `s`.
    #[inline(always)]
    fn lanes<S: Simd>(&self, s: S, group: usize) -> S::F32 {
        s.load_f32(&self.group(group))
    }
    /// Eight lane groups (64 rows, one mask word) from `first_group`.
    #[inline(always)]
    fn lanes8<S: Simd>(&self, s: S, first_group: usize) -> [S::F32; 8] {
        by_lane8!(i => self.lanes(s, first_group + i))
    }
}

impl U32Source for [u32] {
    #[inline(always)]
    fn rows(&self) -> usize {
        self.len()
    }
    #[inline(always)]
    fn value(&self, row: usize) -> u32 {
        self[row]
    }
    #[inline(always)]
    fn group(&self, group: usize) -> [u32; LANES] {
        // `as_chunks` gives LLVM the chunk count, so loops over `0..rows / LANES`
        // need no bounds check per group.
        self.as_chunks::<LANES>().0[group]
    }
    #[inline(always)]
    fn lanes<S: Simd>(&self, s: S, group: usize) -> S::U32 {
        s.load_u32(&self.as_chunks::<LANES>().0[group])
    }
    #[inline(always)]
    fn lanes8<S: Simd>(&self, s: S, first_group: usize) -> [S::U32; 8] {
        let block: &[u32; 8 * LANES] = self.as_chunks::<{ 8 * LANES }>().0[..]
            .get(first_group / 8)
            .filter(|_| first_group.is_multiple_of(8))
            .unwrap_or_else(|| panic!("groups8({first_group}) out of range or unaligned"));
        let groups: &[[u32; LANES]; 8] = bytemuck::cast_ref(block);
        by_lane8!(i => s.load_u32(&groups[i]))
    }
    #[inline(always)]
    fn group_words(&self, words: usize) -> Option<GroupWords<'_>> {
        self.as_chunks::<LANES>()
            .0
            .as_chunks::<8>()
            .0
            .get(..words)
            .map(|g| GroupWords(Words::Plain(g)))
    }
}

impl F32Source for [f32] {
    #[inline(always)]
    fn rows(&self) -> usize {
        self.len()
    }
    #[inline(always)]
    fn value(&self, row: usize) -> f32 {
        self[row]
    }
    #[inline(always)]
    fn group(&self, group: usize) -> [f32; LANES] {
        self.as_chunks::<LANES>().0[group]
    }
    #[inline(always)]
    fn lanes<S: Simd>(&self, s: S, group: usize) -> S::F32 {
        s.load_f32(&self.as_chunks::<LANES>().0[group])
    }
    #[inline(always)]
    fn lanes8<S: Simd>(&self, s: S, first_group: usize) -> [S::F32; 8] {
        let block: &[f32; 8 * LANES] = self.as_chunks::<{ 8 * LANES }>().0[..]
            .get(first_group / 8)
            .filter(|_| first_group.is_multiple_of(8))
            .unwrap_or_else(|| panic!("groups8({first_group}) out of range or unaligned"));
        let groups: &[[f32; LANES]; 8] = bytemuck::cast_ref(block);
        by_lane8!(i => s.load_f32(&groups[i]))
    }
}

/// One 8-row lane group of atomics, aligned so [`load_lanes`] may use
/// aligned vector loads. Public only so that the sealed
/// [`Simd`](crate::simd::Simd) trait can name it; nothing outside the
/// kernel can build or read one.
#[doc(hidden)]
#[repr(C, align(32))]
pub struct AtomicGroup(pub(crate) [AtomicU32; LANES]);

impl AtomicGroup {
    #[cfg(not(selkie_loom))]
    pub(crate) const fn new(v: u32) -> Self {
        AtomicGroup([const { crate::sync::atomic_u32(0) }; LANES]).with(v)
    }
    #[cfg(not(selkie_loom))]
    const fn with(self, v: u32) -> Self {
        if v == 0 {
            self
        } else {
            AtomicGroup([
                crate::sync::atomic_u32(v),
                crate::sync::atomic_u32(v),
                crate::sync::atomic_u32(v),
                crate::sync::atomic_u32(v),
                crate::sync::atomic_u32(v),
                crate::sync::atomic_u32(v),
                crate::sync::atomic_u32(v),
                crate::sync::atomic_u32(v),
            ])
        }
    }
    #[cfg(selkie_loom)]
    pub(crate) fn new(v: u32) -> Self {
        AtomicGroup(core::array::from_fn(|_| crate::sync::atomic_u32(v)))
    }
}

/// The atomic of row `row` of `groups`: one bound check and one scaled
/// add (indexing the group, then its lane, costs a division, a remainder
/// and a check each).
///
/// # Panics
/// If `row >= groups.len() * LANES`.
#[cfg(not(selkie_loom))]
#[inline(always)]
fn row_atomic(groups: &[AtomicGroup], row: usize) -> &AtomicU32 {
    const {
        assert!(core::mem::size_of::<AtomicGroup>() == LANES * core::mem::size_of::<AtomicU32>());
    }
    assert!(row < groups.len() * LANES);
    // SAFETY: `AtomicGroup` is `repr(C)` over `[AtomicU32; LANES]` and no
    // larger (the assertion above), so `groups` is `groups.len() * LANES`
    // contiguous `AtomicU32`s, row `row` the `row`-th, and `row` is in
    // bounds (checked above).
    unsafe { &*groups.as_ptr().cast::<AtomicU32>().add(row) }
}

/// The atomic of row `row` of `groups` (loom's atomics are larger than
/// the machine's: indexed group by group).
#[cfg(selkie_loom)]
#[inline(always)]
fn row_atomic(groups: &[AtomicGroup], row: usize) -> &AtomicU32 {
    &groups[row / LANES].0[row % LANES]
}

/// A fixed-capacity column of `u32` atomics, `GROUPS * LANES` rows, 32-byte
/// aligned. The fleet's columns are all of this type.
pub(crate) struct Column<const GROUPS: usize> {
    groups: [AtomicGroup; GROUPS],
}

impl<const GROUPS: usize> Column<GROUPS> {
    /// A column with every row set to `v`.
    #[cfg(not(selkie_loom))]
    pub(crate) const fn new(v: u32) -> Self {
        let mut groups = [const { AtomicGroup::new(0) }; GROUPS];
        if v != 0 {
            let mut i = 0;
            while i < GROUPS {
                groups[i] = AtomicGroup::new(v);
                i += 1;
            }
        }
        Column { groups }
    }
    /// A column with every row set to `v`.
    #[cfg(selkie_loom)]
    pub(crate) fn new(v: u32) -> Self {
        Column {
            groups: core::array::from_fn(|_| AtomicGroup::new(v)),
        }
    }
    /// The atomic of one row.
    ///
    /// # Panics
    /// If `row >= GROUPS * LANES`.
    #[inline]
    pub(crate) fn at(&self, row: usize) -> &AtomicU32 {
        row_atomic(&self.groups, row)
    }
    /// A read-only view of the first `rows` rows for the kernels.
    #[inline]
    pub(crate) fn view(&self, rows: usize, decode: Decode) -> AtomicView<'_> {
        debug_assert!(rows <= GROUPS * LANES);
        AtomicView {
            groups: &self.groups,
            rows,
            decode,
        }
    }
}

/// How a column's raw word becomes the value kernels see.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decode {
    /// The word is the value.
    Raw,
    /// The word is a tagged counter: value in the high bits, generation tag
    /// in the low `shift` bits (see `fleet::counter`).
    Shift(u32),
}

/// A read-only view of an atomic column, readable by the SIMD kernels.
#[derive(Clone, Copy)]
pub struct AtomicView<'a> {
    groups: &'a [AtomicGroup],
    rows: usize,
    decode: Decode,
}

impl AtomicView<'_> {
    #[inline(always)]
    fn decode_one(&self, w: u32) -> u32 {
        match self.decode {
            Decode::Raw => w,
            Decode::Shift(s) => w >> s,
        }
    }
    #[inline(always)]
    fn decode_lanes<U: U32Lanes>(&self, v: U) -> U {
        match self.decode {
            Decode::Raw => v,
            Decode::Shift(s) => v.shr(s),
        }
    }
}

impl U32Source for AtomicView<'_> {
    #[inline(always)]
    fn rows(&self) -> usize {
        self.rows
    }
    #[inline(always)]
    fn value(&self, row: usize) -> u32 {
        debug_assert!(row < self.rows);
        self.decode_one(row_atomic(self.groups, row).load(Ordering::Relaxed))
    }
    #[inline(always)]
    fn group(&self, group: usize) -> [u32; LANES] {
        load_lanes(&self.groups[group]).map(|w| self.decode_one(w))
    }
    #[inline(always)]
    fn lanes<S: Simd>(&self, s: S, group: usize) -> S::U32 {
        self.decode_lanes(s.load_atomic(&self.groups[group]))
    }
    #[inline(always)]
    fn lanes8<S: Simd>(&self, s: S, first_group: usize) -> [S::U32; 8] {
        // One bounds check for the block; the eight loads index a slice of
        // known length 8.
        let block: &[AtomicGroup; 8] = self.groups[first_group..first_group + 8]
            .try_into()
            .expect("a range of 8 is 8 groups");
        let words = s.load_atomic8(block);
        by_lane8!(i => self.decode_lanes(words[i]))
    }
    #[inline(always)]
    fn word_shift(&self) -> u32 {
        match self.decode {
            Decode::Raw => 0,
            Decode::Shift(s) => s,
        }
    }
    #[inline(always)]
    fn words8<S: Simd>(&self, s: S, first_group: usize) -> [S::U32; 8] {
        let block: &[AtomicGroup; 8] = self.groups[first_group..first_group + 8]
            .try_into()
            .expect("a range of 8 is 8 groups");
        s.load_atomic8(block)
    }
    #[inline(always)]
    fn words<S: Simd>(&self, s: S, group: usize) -> S::U32 {
        s.load_atomic(&self.groups[group])
    }
    #[inline(always)]
    fn group_words(&self, words: usize) -> Option<GroupWords<'_>> {
        let g = self.groups.as_chunks::<8>().0.get(..words)?;
        Some(GroupWords(match self.decode {
            Decode::Shift(s) if (1..32).contains(&s) => Words::Counter(g, s),
            Decode::Shift(_) | Decode::Raw => return None,
        }))
    }
}

impl F32Source for AtomicView<'_> {
    #[inline(always)]
    fn rows(&self) -> usize {
        self.rows
    }
    #[inline(always)]
    fn value(&self, row: usize) -> f32 {
        f32::from_bits(row_atomic(self.groups, row).load(Ordering::Relaxed))
    }
    #[inline(always)]
    fn group(&self, group: usize) -> [f32; LANES] {
        load_lanes(&self.groups[group]).map(f32::from_bits)
    }
    #[inline(always)]
    fn lanes<S: Simd>(&self, s: S, group: usize) -> S::F32 {
        s.load_atomic(&self.groups[group]).cast_f32()
    }
    #[inline(always)]
    fn lanes8<S: Simd>(&self, s: S, first_group: usize) -> [S::F32; 8] {
        let block = &self.groups[first_group..first_group + 8];
        by_lane8!(i => s.load_atomic(&block[i]).cast_f32())
    }
}

#[cfg(all(test, not(selkie_loom)))]
mod tests {
    use super::*;

    /// Row `r` of a column is lane `r % LANES` of group `r / LANES`, as the
    /// SIMD kernels read it, and every access path agrees.
    #[test]
    fn a_row_is_its_groups_lane() {
        let column = Column::<3>::new(0);
        for row in 0..3 * LANES {
            column.at(row).store(1000 + row as u32, Ordering::Relaxed);
        }
        let view = column.view(3 * LANES, Decode::Raw);
        for row in 0..3 * LANES {
            let lane = column.groups[row / LANES].0[row % LANES].load(Ordering::Relaxed);
            assert_eq!(lane, 1000 + row as u32, "row {row}");
            assert_eq!(U32Source::value(&view, row), 1000 + row as u32, "row {row}");
            assert_eq!(F32Source::value(&view, row).to_bits(), 1000 + row as u32, "row {row}");
        }
    }

    #[test]
    #[should_panic]
    fn a_row_past_the_column_panics() {
        let column = Column::<3>::new(0);
        let _ = column.at(3 * LANES);
    }
}
