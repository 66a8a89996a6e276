//! Lane width, column storage, and the one place the SIMD backend is chosen.
//!
//! # Backend choice
//!
//! selkie's SIMD kernels are written once against `wide`'s 8-lane types
//! (`f32x8`, `u32x8`, `i32x8`). `wide` picks its implementation at compile
//! time from the enabled target features: with AVX2 (the workspace builds
//! x86-64 for `x86-64-v3`) each type is one `ymm` register; on baseline
//! x86-64 it is a pair of SSE2 registers; on other targets (Cortex-M, miri)
//! it is plain arrays that LLVM lowers as it can. Eight lanes is the widest
//! that is native on the build target and still cheap everywhere else.
//!
//! There is no runtime dispatch on purpose: a router is built for the fleet
//! machine it runs on, the hot path is a few hundred instructions long, and a
//! function-pointer indirection per scan would cost more than it could win.
//!
//! Every kernel has a scalar reference in the same file; the SIMD versions
//! only need [`U32Source`] / [`F32Source`] to read a column, so they run
//! unchanged over plain slices (tests, fuzzing, per-request columns) and over
//! the fleet's atomic columns.
//!
//! This module must not contain selection logic.

use crate::sync::{load_lanes, AtomicU32, Ordering};
use wide::{f32x8, i32x8, u32x8};

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
    fn group(&self, group: usize) -> u32x8;
    /// Eight lane groups (64 rows, one mask word) from `first_group`
    /// (`(first_group + 8) * LANES <= rows()`); one bounds check for all.
    #[inline(always)]
    fn groups8(&self, first_group: usize) -> [u32x8; 8] {
        core::array::from_fn(|i| self.group(first_group + i))
    }
}

/// A column of `f32` values a kernel can read one lane group at a time.
pub trait F32Source {
    /// Number of rows.
    fn rows(&self) -> usize;
    /// The value at `row` (`row < rows()`).
    fn value(&self, row: usize) -> f32;
    /// The `LANES` values of lane group `group` (`(group + 1) * LANES <= rows()`).
    fn group(&self, group: usize) -> f32x8;
    /// Eight lane groups (64 rows, one mask word) from `first_group`.
    #[inline(always)]
    fn groups8(&self, first_group: usize) -> [f32x8; 8] {
        core::array::from_fn(|i| self.group(first_group + i))
    }
}

impl U32Source for [u32] {
    #[inline]
    fn rows(&self) -> usize {
        self.len()
    }
    #[inline]
    fn value(&self, row: usize) -> u32 {
        self[row]
    }
    #[inline]
    fn group(&self, group: usize) -> u32x8 {
        // `as_chunks` gives LLVM the chunk count, so loops over `0..rows / LANES`
        // need no bounds check per group.
        u32x8::from(self.as_chunks::<LANES>().0[group])
    }
    #[inline(always)]
    fn groups8(&self, first_group: usize) -> [u32x8; 8] {
        let block: &[u32; 8 * LANES] = self.as_chunks::<{ 8 * LANES }>().0[..]
            .get(first_group / 8)
            .filter(|_| first_group.is_multiple_of(8))
            .unwrap_or_else(|| panic!("groups8({first_group}) out of range or unaligned"));
        let groups: &[[u32; LANES]; 8] = bytemuck::cast_ref(block);
        groups.map(u32x8::from)
    }
}

impl F32Source for [f32] {
    #[inline]
    fn rows(&self) -> usize {
        self.len()
    }
    #[inline]
    fn value(&self, row: usize) -> f32 {
        self[row]
    }
    #[inline]
    fn group(&self, group: usize) -> f32x8 {
        f32x8::from(self.as_chunks::<LANES>().0[group])
    }
    #[inline(always)]
    fn groups8(&self, first_group: usize) -> [f32x8; 8] {
        let block: &[f32; 8 * LANES] = self.as_chunks::<{ 8 * LANES }>().0[..]
            .get(first_group / 8)
            .filter(|_| first_group.is_multiple_of(8))
            .unwrap_or_else(|| panic!("groups8({first_group}) out of range or unaligned"));
        let groups: &[[f32; LANES]; 8] = bytemuck::cast_ref(block);
        groups.map(f32x8::from)
    }
}

/// One 8-row lane group of atomics, aligned so [`load_lanes`] may use
/// aligned vector loads.
#[repr(C, align(32))]
pub(crate) struct AtomicGroup(pub(crate) [AtomicU32; LANES]);

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
    #[inline]
    pub(crate) fn at(&self, row: usize) -> &AtomicU32 {
        &self.groups[row / LANES].0[row % LANES]
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
    #[inline]
    fn decode_one(&self, w: u32) -> u32 {
        match self.decode {
            Decode::Raw => w,
            Decode::Shift(s) => w >> s,
        }
    }
    #[inline(always)]
    fn decode_lanes(&self, v: u32x8) -> u32x8 {
        match self.decode {
            Decode::Raw => v,
            Decode::Shift(s) => v >> s,
        }
    }
}

impl U32Source for AtomicView<'_> {
    #[inline]
    fn rows(&self) -> usize {
        self.rows
    }
    #[inline]
    fn value(&self, row: usize) -> u32 {
        debug_assert!(row < self.rows);
        self.decode_one(self.groups[row / LANES].0[row % LANES].load(Ordering::Relaxed))
    }
    #[inline]
    fn group(&self, group: usize) -> u32x8 {
        self.decode_lanes(u32x8::from(load_lanes(&self.groups[group].0)))
    }
    #[inline(always)]
    fn groups8(&self, first_group: usize) -> [u32x8; 8] {
        // One bounds check for the block; the eight loads index a slice of
        // known length 8.
        let block = &self.groups[first_group..first_group + 8];
        core::array::from_fn(|i| self.decode_lanes(u32x8::from(load_lanes(&block[i].0))))
    }
}

impl F32Source for AtomicView<'_> {
    #[inline]
    fn rows(&self) -> usize {
        self.rows
    }
    #[inline]
    fn value(&self, row: usize) -> f32 {
        f32::from_bits(self.groups[row / LANES].0[row % LANES].load(Ordering::Relaxed))
    }
    #[inline]
    fn group(&self, group: usize) -> f32x8 {
        bytemuck_cast_f32(u32x8::from(load_lanes(&self.groups[group].0)))
    }
}

/// Reinterprets lanes of bits as lanes of `f32`.
#[inline(always)]
pub(crate) fn bytemuck_cast_f32(v: u32x8) -> f32x8 {
    bytemuck::cast(v)
}

/// Converts lanes of `u32` to `f32` exactly as `x as f32` does (round to
/// nearest): the high and low halves convert exactly and one add rounds once.
#[inline(always)]
pub(crate) fn u32_to_f32(v: u32x8) -> f32x8 {
    let hi = bytemuck::cast::<u32x8, i32x8>(v >> 16u32).round_float();
    let lo = bytemuck::cast::<u32x8, i32x8>(v & u32x8::splat(0xFFFF)).round_float();
    hi * f32x8::splat(65536.0) + lo
}

/// Expands 8 eligibility bits (bit `i` = lane `i`) to an all-ones/all-zeros
/// lane mask.
#[inline(always)]
pub(crate) fn lane_mask(bits: u8) -> u32x8 {
    const BIT: u32x8 = u32x8::new([1, 2, 4, 8, 16, 32, 64, 128]);
    (u32x8::splat(bits as u32) & BIT).cmp_eq(BIT)
}

/// Collapses a lane mask (all-ones/all-zeros lanes) to 8 bits.
#[inline(always)]
pub(crate) fn lane_bits(mask: u32x8) -> u8 {
    bytemuck::cast::<u32x8, i32x8>(mask).move_mask() as u8
}

/// As [`lane_bits`], for an `f32x8` comparison mask.
#[inline(always)]
pub(crate) fn lane_bits_f32(mask: f32x8) -> u8 {
    mask.move_mask() as u8
}
