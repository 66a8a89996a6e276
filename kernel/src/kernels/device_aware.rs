//! Device-aware weighted selection (parity with Dynamo's
//! `device-aware-weighted` router mode in `dynamo-runtime` 1.6.1): rows are
//! CPU or accelerator workers, each with a count of cache hits for the
//! request, and CPU workers take a share of the load proportional to their
//! number, discounted by a ratio.
//!
//! ```text
//! pass 1 (SIMD, one read of each column):
//!   per group G in {full-cache, CPU, accelerator}: count, total load (u64), minimum load
//!   full-cache = eligible rows with cache_hits >= required_cache_hits, only if required > 0
//!   CPU        = eligible rows set in `is_cpu`; accelerator = the other eligible rows
//! decide:
//!   full-cache non-empty                      -> full-cache
//!   neither CPU nor accelerator rows          -> None
//!   only one kind                             -> that kind
//!   both: ratio   = max(non_cpu_to_cpu_ratio, 1)
//!         allowed = accel_total * cpu_count / (ratio * accel_count)   (u64, saturating *, floor /)
//!         CPU if cpu_total < allowed (strict), else accelerator
//! passes 2, 3: the least-loaded row of the chosen group, ties uniformly at random
//!   (count the rows at the group's minimum, one rng.below draw iff more than one, select)
//! ```
//!
//! The comparisons and integer arithmetic are Dynamo's exactly: `>=` for the
//! cache-hit threshold (which is off at 0), saturating `u64` products, floor
//! division, strict `<`, and all-zero loads (`allowed = 0`) going to the
//! accelerators. Dynamo breaks ties by reservoir sampling in all three groups
//! during its single pass; selkie draws only for the group it returns, which
//! gives the same distribution with at most one draw. A full-cache choice is
//! made without occupancy admission in Dynamo
//! ([`DeviceGroup::books_occupancy`] says so to the host).
//!
//! The load sums are word-parallel: each lane accumulates the low and high 16
//! bits of its loads separately in `u32`, which cannot overflow for 65,536
//! lane groups, and is flushed to `u64` after that many.
//!
//! This module must not book or decide which rows are CPUs: `is_cpu` is the
//! host's (rows past its end are accelerators, as Dynamo's default device).

use super::KernelError;
use crate::lanes::{U32Source, LANES};
use crate::mask::{contains, group_bits, nth};
use crate::simd::{dispatch, Simd, U32Lanes};
use crate::Rng;

/// The parameters of the device-aware weighted policy: the
/// kernel's input and, with the `serde` feature, the host policy's
/// configuration (`device-aware-weighted` parameters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default, deny_unknown_fields))]
pub struct DeviceAwareConfig {
    /// Cache hits a row needs to be taken outright (Dynamo: the number of
    /// distinct multimodal cache keys of the request); 0 disables the rule.
    /// A host policy's value is the default of its requests; a request's
    /// own non-zero `required_cache_hits` replaces it.
    pub required_cache_hits: u32,
    /// Accelerator-to-CPU load ratio (values below 1 count as 1; default 8,
    /// Dynamo's `DYN_ENCODER_CUDA_TO_CPU_RATIO`).
    pub non_cpu_to_cpu_ratio: u32,
}

impl Default for DeviceAwareConfig {
    fn default() -> Self {
        DeviceAwareConfig {
            required_cache_hits: 0,
            non_cpu_to_cpu_ratio: 8,
        }
    }
}

/// Which group the chosen row came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceGroup {
    /// A row with at least the required cache hits.
    FullCache,
    /// A CPU row.
    Cpu,
    /// An accelerator row.
    Accelerator,
}

impl DeviceGroup {
    /// Whether Dynamo admits the choice against occupancy: every group but
    /// [`DeviceGroup::FullCache`].
    pub const fn books_occupancy(self) -> bool {
        !matches!(self, DeviceGroup::FullCache)
    }
}

/// The chosen row and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceAwareChoice {
    /// The row.
    pub row: usize,
    /// The group it was chosen from.
    pub group: DeviceGroup,
}

/// Count, total load and minimum load of one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GroupStats {
    count: u64,
    total: u64,
    min: u32,
}

impl GroupStats {
    const EMPTY: GroupStats = GroupStats {
        count: 0,
        total: 0,
        min: u32::MAX,
    };

    fn add(&mut self, load: u32) {
        self.count += 1;
        self.total = self.total.saturating_add(load as u64);
        self.min = self.min.min(load);
    }
}

/// Lane accumulators of one group's statistics.
struct GroupLanes<S: Simd> {
    s: S,
    lo: S::U32,
    hi: S::U32,
    min: S::U32,
    count: u64,
    total: u64,
}

impl<S: Simd> GroupLanes<S> {
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn new(s: S) -> Self {
        GroupLanes {
            s,
            lo: s.splat_u32(0),
            hi: s.splat_u32(0),
            min: s.splat_u32(u32::MAX),
            count: 0,
            total: 0,
        }
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn add(&mut self, loads: S::U32, bits: u8) {
        if bits == 0 {
            return;
        }
        let on = self.s.lane_mask(bits);
        self.lo = self.lo + (loads & on & self.s.splat_u32(0xFFFF));
        self.hi = self.hi + (loads.shr(16) & on);
        self.min = self.min.min(loads | !on);
        self.count += bits.count_ones() as u64;
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn flush(&mut self) {
        let (l, h) = (self.lo.to_array(), self.hi.to_array());
        let (mut lo, mut hi) = (0u64, 0u64);
        for i in 0..LANES {
            lo += l[i] as u64;
            hi += h[i] as u64;
        }
        self.total += lo + (hi << 16);
        self.lo = self.s.splat_u32(0);
        self.hi = self.s.splat_u32(0);
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn finish(mut self) -> GroupStats {
        self.flush();
        GroupStats {
            count: self.count,
            total: self.total,
            min: self.min.reduce_min(),
        }
    }
}

/// Dynamo's decision between the groups, from their statistics.
fn decide(full: GroupStats, cpu: GroupStats, accel: GroupStats, ratio: u32) -> Option<(DeviceGroup, u32)> {
    if full.count > 0 {
        return Some((DeviceGroup::FullCache, full.min));
    }
    match (cpu.count > 0, accel.count > 0) {
        (false, false) => None,
        (true, false) => Some((DeviceGroup::Cpu, cpu.min)),
        (false, true) => Some((DeviceGroup::Accelerator, accel.min)),
        (true, true) => {
            let ratio = ratio.max(1) as u64;
            let allowed = accel.total.saturating_mul(cpu.count) / ratio.saturating_mul(accel.count);
            if cpu.total < allowed {
                Some((DeviceGroup::Cpu, cpu.min))
            } else {
                Some((DeviceGroup::Accelerator, accel.min))
            }
        }
    }
}

/// Rows at or past this many lane groups flush the 16-bit lane sums.
const FLUSH_GROUPS: usize = 1 << 16;

dispatch! {
    /// Device-aware weighted selection (SIMD). See the module docs.
    ///
    /// `load`: in-flight requests per row (its length is the number of rows);
    /// `cache_hits`: the request's cache hits per row; `is_cpu`: CPU rows as a
    /// bitmask. `Err(ColumnTooShort)` if `cache_hits` is shorter than `load`;
    /// `Ok(None)` if no row is eligible. Makes one `rng.below` draw iff several
    /// rows of the chosen group share its minimum load.
    ///
    /// ```
    /// use selkie_kernel::kernels::device_aware::{device_aware, DeviceAwareConfig, DeviceGroup};
    /// use selkie_kernel::Rng;
    /// let load = [0u32, 40, 30];
    /// let hits = [0u32, 0, 0];
    /// let is_cpu = [0b001u64]; // row 0 is a CPU worker
    /// // allowed CPU load = 70 * 1 / (8 * 2) = 4 > 0: the idle CPU row takes it.
    /// let pick = device_aware(&load[..], &hits[..], &is_cpu, &[0b111], &DeviceAwareConfig::default(), &mut Rng::new(1));
    /// assert_eq!(pick.unwrap().map(|c| (c.row, c.group)), Some((0, DeviceGroup::Cpu)));
    /// ```
    pub fn device_aware / device_aware_on [L: U32Source + ?Sized, H: U32Source + ?Sized] (
        load: &L,
        cache_hits: &H,
        is_cpu: &[u64],
        mask: &[u64],
        config: &DeviceAwareConfig,
        rng: &mut Rng,
    ) -> Result<Option<DeviceAwareChoice>, KernelError>
        = |s| device_aware_in(s, load, cache_hits, is_cpu, mask, config, rng)
}

/// The body of [`device_aware`].
///
/// No closures and no iterator adapters over closures between the AVX2 entry
/// point and the lane operations: a closure that LLVM declines to inline is
/// compiled without the entry point's target features, and every lane
/// operation in it becomes a call. The per-group and per-row helpers below
/// are `#[inline(always)]` functions instead.
#[cfg_attr(not(debug_assertions), inline(always))]
fn device_aware_in<S: Simd, L, H>(
    s: S,
    load: &L,
    cache_hits: &H,
    is_cpu: &[u64],
    mask: &[u64],
    config: &DeviceAwareConfig,
    rng: &mut Rng,
) -> Result<Option<DeviceAwareChoice>, KernelError>
where
    L: U32Source + ?Sized,
    H: U32Source + ?Sized,
{
    let rows = checked_rows(load, cache_hits)?;
    let groups = rows / LANES;
    let cols = Columns {
        load,
        cache_hits,
        is_cpu,
        mask,
        required: config.required_cache_hits,
    };
    // Pass 1: statistics, a mask word (eight lane groups) at a time, then
    // the lane groups past the last whole word.
    let words = groups / 8;
    let (mut full, mut cpu, mut accel) = (GroupLanes::new(s), GroupLanes::new(s), GroupLanes::new(s));
    for w in 0..words {
        let m = word(mask, w);
        if m != 0 {
            let c = word(is_cpu, w);
            let loads = load.lanes8(s, 8 * w);
            for (i, &loads) in loads.iter().enumerate() {
                let bits = (m >> (8 * i)) as u8;
                if bits != 0 {
                    let cpu_bits = (c >> (8 * i)) as u8;
                    full.add(loads, cols.full_bits(s, 8 * w + i, bits));
                    cpu.add(loads, cpu_bits & bits);
                    accel.add(loads, !cpu_bits & bits);
                }
            }
        }
        if (8 * w + 7) % FLUSH_GROUPS == FLUSH_GROUPS - 1 {
            full.flush();
            cpu.flush();
            accel.flush();
        }
    }
    for g in 8 * words..groups {
        let bits = group_bits(mask, g);
        if bits != 0 {
            let loads = load.lanes(s, g);
            let [f, c, a] = cols.split(s, g, bits);
            full.add(loads, f);
            cpu.add(loads, c);
            accel.add(loads, a);
        }
        if g % FLUSH_GROUPS == FLUSH_GROUPS - 1 {
            full.flush();
            cpu.flush();
            accel.flush();
        }
    }
    let (mut full, mut cpu, mut accel) = (full.finish(), cpu.finish(), accel.finish());
    for r in groups * LANES..rows {
        if contains(mask, r) {
            let l = load.value(r);
            let [f, c, _] = cols.row_is(r);
            if f {
                full.add(l);
            }
            if c {
                cpu.add(l);
            } else {
                accel.add(l);
            }
        }
    }
    let Some((group, min)) = decide(full, cpu, accel, config.non_cpu_to_cpu_ratio) else {
        return Ok(None);
    };
    // Pass 2: rows of the chosen group at its minimum.
    let mut ties: usize = 0;
    for w in 0..words {
        ties += cols.tie_word(s, w, group, min).count_ones() as usize;
    }
    for g in 8 * words..groups {
        ties += cols.ties(s, g, group, min).count_ones() as usize;
    }
    for r in groups * LANES..rows {
        ties += cols.chosen_row(r, group, Some(min)) as usize;
    }
    let mut k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    // Pass 3: the k-th of them.
    for w in 0..words {
        let t = cols.tie_word(s, w, group, min);
        let c = t.count_ones() as usize;
        if k < c {
            let row = 64 * w + nth(core::slice::from_ref(&t), 64, k).unwrap_or(0);
            return Ok(Some(DeviceAwareChoice { row, group }));
        }
        k -= c;
    }
    for g in 8 * words..groups {
        let mut t = cols.ties(s, g, group, min);
        let c = t.count_ones() as usize;
        if k < c {
            for _ in 0..k {
                t &= t - 1;
            }
            return Ok(Some(DeviceAwareChoice {
                row: g * LANES + t.trailing_zeros() as usize,
                group,
            }));
        }
        k -= c;
    }
    for r in groups * LANES..rows {
        if cols.chosen_row(r, group, Some(min)) {
            if k == 0 {
                return Ok(Some(DeviceAwareChoice { row: r, group }));
            }
            k -= 1;
        }
    }
    // Over a live column (the fleet's counters) the loads may change between
    // the passes, so that no row of the chosen group is at pass 1's minimum
    // any more. The kernel stays total: it settles on the group's
    // least-loaded eligible row as read now (one scalar pass, only then;
    // the first such row, as `min_by_key` would).
    let mut best: Option<(usize, u32)> = None;
    for r in 0..rows {
        if cols.chosen_row(r, group, None) {
            let l = load.value(r);
            match best {
                Some((_, b)) if b <= l => {}
                _ => best = Some((r, l)),
            }
        }
    }
    Ok(best.map(|(row, _)| DeviceAwareChoice { row, group }))
}

/// The columns and the threshold the passes read.
struct Columns<'a, L: ?Sized, H: ?Sized> {
    load: &'a L,
    cache_hits: &'a H,
    is_cpu: &'a [u64],
    mask: &'a [u64],
    required: u32,
}

impl<L: U32Source + ?Sized, H: U32Source + ?Sized> Columns<'_, L, H> {
    /// The bits of lane group `g` among `bits` in each device group:
    /// `[full-cache, CPU, accelerator]`.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn split<S: Simd>(&self, s: S, g: usize, bits: u8) -> [u8; 3] {
        let cpu = group_bits(self.is_cpu, g);
        [self.full_bits(s, g, bits), cpu & bits, !cpu & bits]
    }

    /// The bits of lane group `g` among `bits` with at least the required
    /// cache hits (none when the rule is off).
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn full_bits<S: Simd>(&self, s: S, g: usize, bits: u8) -> u8 {
        if self.required > 0 {
            let hits = self.cache_hits.lanes(s, g);
            hits.max(s.splat_u32(self.required)).cmp_eq(hits).bits() & bits
        } else {
            0
        }
    }

    /// The eligible rows of mask word `w` (lane groups `8 * w .. 8 * w + 8`,
    /// all below `rows / LANES`) in `group` whose load is `min`, row `64 * w
    /// + i` in bit `i`.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn tie_word<S: Simd>(&self, s: S, w: usize, group: DeviceGroup, min: u32) -> u64 {
        let m = word(self.mask, w);
        let candidates = match group {
            DeviceGroup::FullCache => m,
            DeviceGroup::Cpu => m & word(self.is_cpu, w),
            DeviceGroup::Accelerator => m & !word(self.is_cpu, w),
        };
        if candidates == 0 {
            return 0;
        }
        let loads = self.load.lanes8(s, 8 * w);
        let min = s.splat_u32(min);
        let mut ties = 0u64;
        for (i, &loads) in loads.iter().enumerate() {
            let mut bits = (candidates >> (8 * i)) as u8;
            if group == DeviceGroup::FullCache {
                bits = self.full_bits(s, 8 * w + i, bits);
            }
            ties |= ((loads.cmp_eq(min).bits() & bits) as u64) << (8 * i);
        }
        ties
    }

    /// Whether row `r` is in each device group: `[full-cache, CPU,
    /// accelerator]`.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn row_is(&self, r: usize) -> [bool; 3] {
        let cpu = contains(self.is_cpu, r);
        [
            self.required > 0 && self.cache_hits.value(r) >= self.required,
            cpu,
            !cpu,
        ]
    }

    /// The eligible rows of lane group `g` in `group` whose load is `min`.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn ties<S: Simd>(&self, s: S, g: usize, group: DeviceGroup, min: u32) -> u8 {
        let bits = group_bits(self.mask, g);
        if bits == 0 {
            return 0;
        }
        let [f, c, a] = self.split(s, g, bits);
        self.load.lanes(s, g).cmp_eq(s.splat_u32(min)).bits() & chosen(group, f, c, a)
    }

    /// Whether row `r` is eligible, in `group` and (if given) at load `min`.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn chosen_row(&self, r: usize, group: DeviceGroup, min: Option<u32>) -> bool {
        let [f, c, a] = self.row_is(r);
        contains(self.mask, r)
            && chosen(group, f, c, a)
            && match min {
                Some(min) => self.load.value(r) == min,
                None => true,
            }
    }
}

/// Word `w` of a bitmask (0 past its end).
#[cfg_attr(not(debug_assertions), inline(always))]
fn word(words: &[u64], w: usize) -> u64 {
    words.get(w).copied().unwrap_or(0)
}

/// The member of `[f, c, a]` (full-cache, CPU, accelerator) for `group`.
#[cfg_attr(not(debug_assertions), inline(always))]
fn chosen<T>(group: DeviceGroup, f: T, c: T, a: T) -> T {
    match group {
        DeviceGroup::FullCache => f,
        DeviceGroup::Cpu => c,
        DeviceGroup::Accelerator => a,
    }
}

/// The rows both kernels scan: the load column's, if the cache-hit column
/// covers them.
#[cfg_attr(not(debug_assertions), inline(always))]
fn checked_rows<L, H>(load: &L, cache_hits: &H) -> Result<usize, KernelError>
where
    L: U32Source + ?Sized,
    H: U32Source + ?Sized,
{
    let rows = load.rows();
    match cache_hits.rows() {
        len if len < rows => Err(KernelError::ColumnTooShort { rows, len }),
        _ => Ok(rows),
    }
}

/// Scalar reference of [`device_aware`]: same result, same draws.
pub fn device_aware_reference<L, H>(
    load: &L,
    cache_hits: &H,
    is_cpu: &[u64],
    mask: &[u64],
    config: &DeviceAwareConfig,
    rng: &mut Rng,
) -> Result<Option<DeviceAwareChoice>, KernelError>
where
    L: U32Source + ?Sized,
    H: U32Source + ?Sized,
{
    let rows = checked_rows(load, cache_hits)?;
    let required = config.required_cache_hits;
    let in_group = |r: usize, group: DeviceGroup| match group {
        DeviceGroup::FullCache => required > 0 && cache_hits.value(r) >= required,
        DeviceGroup::Cpu => contains(is_cpu, r),
        DeviceGroup::Accelerator => !contains(is_cpu, r),
    };
    let stats = |group: DeviceGroup| {
        let mut s = GroupStats::EMPTY;
        for r in (0..rows).filter(|&r| contains(mask, r) && in_group(r, group)) {
            s.add(load.value(r));
        }
        s
    };
    let decision = decide(
        stats(DeviceGroup::FullCache),
        stats(DeviceGroup::Cpu),
        stats(DeviceGroup::Accelerator),
        config.non_cpu_to_cpu_ratio,
    );
    let Some((group, min)) = decision else {
        return Ok(None);
    };
    let at_min = || (0..rows).filter(|&r| contains(mask, r) && in_group(r, group) && load.value(r) == min);
    let ties = at_min().count();
    let k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    Ok(at_min().nth(k).map(|row| DeviceAwareChoice { row, group }))
}
