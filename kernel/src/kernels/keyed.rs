//! Worker-keyed overlaps into row columns: a request that names its cached
//! prefix per worker rank (`(worker id, DP rank) -> blocks`) has each entry
//! mapped to its row and written into the per-row columns the KV cost
//! kernel reads.
//!
//! ```text
//! for each entry e, in order:
//!     row = dense.rows[e.id * dense.ranks + e.rank]   if e.id < workers and e.rank < ranks
//!           probe(e.id, e.rank)                       otherwise
//!     if row < columns' length:
//!         device[row] = e.device_blocks as f32
//!         cached[row] = e.cached_tokens as f32
//!         lower |= e.host_blocks | e.disk_blocks | e.shared_blocks
//!         written += 1
//! ```
//!
//! Later entries for the same row overwrite earlier ones. The fast version
//! takes eight entries at a time with gathers (each field of eight entries,
//! then their eight rows from the dense table, is one gather, its field's
//! offset the gather's displacement) and
//! writes the eight rows from registers; a group with an entry outside the
//! dense table, a row outside the columns or a value of `2^31` or more is
//! done entry by entry, as the reference does it. Backends without a gather
//! instruction run the reference: a gather emulated lane by lane is no
//! faster than the scalar loop.
//!
//! The entries are the caller's own type, described by [`KeyedOverlap`]:
//! its fields are read where they lie, so a request's entries are never
//! copied.
//!
//! This module must not choose rows or read the fleet.

use core::mem::size_of;

use crate::lanes::LANES;
use crate::simd::{dispatch, F32Lanes, FieldAt, Simd, U32Lanes};
use core::marker::PhantomData;

/// An overlap entry keyed by worker rank, in the caller's own layout: the
/// byte offsets of its fields (for the gathers) and the same fields read
/// the ordinary way (for the reference and the entries done one by one).
///
/// # Safety
///
/// An implementation promises that, in every value of the type:
///
/// * `WORKER_ID_AT` is the offset of a `u64` field holding
///   [`worker_id`](Self::worker_id), and each other `*_AT` constant the
///   offset of a `u32` field holding what the accessor of the same name
///   returns;
/// * those fields are plain integers (always initialized, never padding).
///
/// The kernel checks at compile time that every field lies inside the
/// type. `core::mem::offset_of!` gives the offsets:
///
/// ```
/// use core::mem::offset_of;
/// use selkie_kernel::kernels::keyed::KeyedOverlap;
///
/// struct Entry { id: u64, rank: u32, device: u32, host: u32, disk: u32, shared: u32, tokens: u32 }
///
/// // SAFETY: every offset is its field's, and every field is an integer.
/// unsafe impl KeyedOverlap for Entry {
///     const WORKER_ID_AT: usize = offset_of!(Entry, id);
///     const DP_RANK_AT: usize = offset_of!(Entry, rank);
///     const DEVICE_BLOCKS_AT: usize = offset_of!(Entry, device);
///     const HOST_BLOCKS_AT: usize = offset_of!(Entry, host);
///     const DISK_BLOCKS_AT: usize = offset_of!(Entry, disk);
///     const SHARED_BLOCKS_AT: usize = offset_of!(Entry, shared);
///     const CACHED_TOKENS_AT: usize = offset_of!(Entry, tokens);
///     fn worker_id(&self) -> u64 { self.id }
///     fn dp_rank(&self) -> u32 { self.rank }
///     fn device_blocks(&self) -> u32 { self.device }
///     fn host_blocks(&self) -> u32 { self.host }
///     fn disk_blocks(&self) -> u32 { self.disk }
///     fn shared_blocks(&self) -> u32 { self.shared }
///     fn cached_tokens(&self) -> u32 { self.tokens }
/// }
/// ```
pub unsafe trait KeyedOverlap {
    /// Byte offset of the worker id (`u64`).
    const WORKER_ID_AT: usize;
    /// Byte offset of the DP rank (`u32`).
    const DP_RANK_AT: usize;
    /// Byte offset of the device-tier blocks (`u32`).
    const DEVICE_BLOCKS_AT: usize;
    /// Byte offset of the host-tier blocks (`u32`).
    const HOST_BLOCKS_AT: usize;
    /// Byte offset of the disk-tier blocks (`u32`).
    const DISK_BLOCKS_AT: usize;
    /// Byte offset of the shared-cache blocks (`u32`).
    const SHARED_BLOCKS_AT: usize;
    /// Byte offset of the cached tokens (`u32`).
    const CACHED_TOKENS_AT: usize;
    /// The worker id.
    fn worker_id(&self) -> u64;
    /// The DP rank.
    fn dp_rank(&self) -> u32;
    /// Prompt blocks held on the device.
    fn device_blocks(&self) -> u32;
    /// Prompt blocks held in the host tier.
    fn host_blocks(&self) -> u32;
    /// Prompt blocks held in the disk tier.
    fn disk_blocks(&self) -> u32;
    /// Shared-cache blocks.
    fn shared_blocks(&self) -> u32;
    /// Prompt tokens cached.
    fn cached_tokens(&self) -> u32;
}

/// Rows of worker ranks kept in an array indexed by id: rank `r` of worker
/// `id` is at `rows[id * ranks + r]` when `id < rows.len() / ranks` and
/// `r < ranks` ([`DenseRows::EMPTY`] where that rank has no row); other
/// ranks are not in it.
#[derive(Clone, Copy, Debug)]
pub struct DenseRows<'a> {
    rows: &'a [u32],
    ranks: u32,
    workers: u32,
}

impl<'a> DenseRows<'a> {
    /// The row value of a rank that has none.
    pub const EMPTY: u32 = u32::MAX;
    /// The most entries a table may have (the gathers address it with
    /// 32-bit signed byte offsets).
    pub const MAX_LEN: usize = 1 << 28;

    /// `rows` with `ranks` entries per worker; `None` if `ranks` is 0 or
    /// `rows` is longer than [`MAX_LEN`](Self::MAX_LEN). A table whose
    /// length is not a multiple of `ranks` ignores the partial worker at
    /// its end.
    pub fn new(rows: &'a [u32], ranks: u32) -> Option<Self> {
        if ranks == 0 || rows.len() > Self::MAX_LEN {
            return None;
        }
        let workers = (rows.len() / ranks as usize) as u32;
        Some(DenseRows { rows, ranks, workers })
    }

    /// A table holding no rank (every lookup goes to the probe).
    pub const fn none() -> Self {
        DenseRows {
            rows: &[],
            ranks: 1,
            workers: 0,
        }
    }

    /// The row of `(id, rank)` as the table has it ([`EMPTY`](Self::EMPTY)
    /// for none), or `None` if the table does not cover that rank.
    #[inline(always)]
    pub fn row_of(&self, id: u64, rank: u32) -> Option<u32> {
        if id < u64::from(self.workers) && rank < self.ranks {
            Some(self.rows[id as usize * self.ranks as usize + rank as usize])
        } else {
            None
        }
    }
}

/// What [`scatter_keyed`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scattered {
    /// Entries whose row is inside the columns (each was written).
    pub written: usize,
    /// `host | disk | shared` blocks of those entries, or-ed together: zero
    /// when none of them has a lower tier.
    pub lower_tiers: u32,
}

impl Scattered {
    /// Adds what another part of the entries wrote.
    #[inline(always)]
    fn merge(&mut self, part: Scattered) {
        self.written += part.written;
        self.lower_tiers |= part.lower_tiers;
    }
}

dispatch! {
    /// Writes each entry's device blocks and cached tokens into `device`
    /// and `cached` at its row (see the module docs): the row from `dense`
    /// when it covers the rank, else from `probe(worker_id, dp_rank)` (any
    /// value at or above the columns' length, such as
    /// [`DenseRows::EMPTY`], means no row). Entries whose row is at or past
    /// `min(device.len(), cached.len())` are skipped. `probe` is called once
    /// for each entry the table does not cover, in entry order.
    ///
    /// ```
    /// use selkie_kernel::kernels::keyed::{scatter_keyed, DenseRows, KeyedOverlap};
    /// # struct Entry { id: u64, rank: u32, device: u32, tokens: u32 }
    /// # // SAFETY: every offset is its field's, and every field is an integer.
    /// # unsafe impl KeyedOverlap for Entry {
    /// #     const WORKER_ID_AT: usize = core::mem::offset_of!(Entry, id);
    /// #     const DP_RANK_AT: usize = core::mem::offset_of!(Entry, rank);
    /// #     const DEVICE_BLOCKS_AT: usize = core::mem::offset_of!(Entry, device);
    /// #     const HOST_BLOCKS_AT: usize = core::mem::offset_of!(Entry, device);
    /// #     const DISK_BLOCKS_AT: usize = core::mem::offset_of!(Entry, device);
    /// #     const SHARED_BLOCKS_AT: usize = core::mem::offset_of!(Entry, device);
    /// #     const CACHED_TOKENS_AT: usize = core::mem::offset_of!(Entry, tokens);
    /// #     fn worker_id(&self) -> u64 { self.id }
    /// #     fn dp_rank(&self) -> u32 { self.rank }
    /// #     fn device_blocks(&self) -> u32 { self.device }
    /// #     fn host_blocks(&self) -> u32 { self.device }
    /// #     fn disk_blocks(&self) -> u32 { self.device }
    /// #     fn shared_blocks(&self) -> u32 { self.device }
    /// #     fn cached_tokens(&self) -> u32 { self.tokens }
    /// # }
    /// // Workers 0..3, rank 0 only: worker 0 on row 2, worker 2 on row 0.
    /// let table = [2, DenseRows::EMPTY, 0];
    /// let dense = DenseRows::new(&table, 1).unwrap();
    /// let entries = [
    ///     Entry { id: 2, rank: 0, device: 5, tokens: 80 },
    ///     Entry { id: 9, rank: 1, device: 7, tokens: 112 }, // probed: row 1
    ///     Entry { id: 1, rank: 0, device: 3, tokens: 48 },  // no row
    /// ];
    /// let (mut device, mut cached) = ([0.0f32; 3], [0.0f32; 3]);
    /// let mut probe = |id: u64, rank: u32| if (id, rank) == (9, 1) { 1 } else { DenseRows::EMPTY };
    /// let out = scatter_keyed(&entries, dense, &mut probe, &mut device, &mut cached);
    /// assert_eq!(device, [5.0, 7.0, 0.0]);
    /// assert_eq!(cached, [80.0, 112.0, 0.0]);
    /// assert_eq!(out.written, 2);
    /// ```
    pub fn scatter_keyed / scatter_keyed_on [T: KeyedOverlap, P: FnMut(u64, u32) -> u32 + ?Sized] (
        entries: &[T],
        dense: DenseRows<'_>,
        probe: &mut P,
        device: &mut [f32],
        cached: &mut [f32],
    ) -> Scattered
    = |s| scatter_lanes(s, entries, dense, probe, device, cached)
}

dispatch! {
    /// Sets every value of `column` to `0.0`: what a caller reusing its
    /// columns does after the selection that read a scatter's values.
    /// A lane group (eight values) at a time, 64 values to a step: one
    /// vector store per group on AVX2 (`fill(0.0)` becomes a
    /// call to `memset`, which clears columns of this size with `rep
    /// stosb`: a step per byte as an instruction counter sees it).
    ///
    /// ```
    /// use selkie_kernel::kernels::keyed::clear_column;
    /// let mut column = [1.5f32; 100];
    /// clear_column(&mut column);
    /// assert!(column.iter().all(|&v| v == 0.0));
    /// ```
    pub fn clear_column / clear_column_on [] (column: &mut [f32]) -> ()
    = |s| clear_lanes(s, column)
}

/// The scalar reference of [`clear_column`].
pub fn clear_column_reference(column: &mut [f32]) {
    for v in column {
        *v = 0.0;
    }
}

/// [`clear_column`] a lane group per store.
#[cfg_attr(not(debug_assertions), inline(always))]
fn clear_lanes<S: Simd>(s: S, column: &mut [f32]) {
    // A zero the optimiser cannot see: stores of a known zero become
    // `memset` again.
    let zero = s.splat_f32(core::hint::black_box(0.0)).to_array();
    let mut steps = column.chunks_exact_mut(8 * LANES);
    for step in &mut steps {
        for group in step.chunks_exact_mut(LANES) {
            group.copy_from_slice(&zero);
        }
    }
    let mut groups = steps.into_remainder().chunks_exact_mut(LANES);
    for group in &mut groups {
        group.copy_from_slice(&zero);
    }
    for v in groups.into_remainder() {
        *v = 0.0;
    }
}

/// The backend's way: gathers where they are one instruction, the
/// reference elsewhere.
#[cfg_attr(not(debug_assertions), inline(always))]
fn scatter_lanes<S: Simd, T: KeyedOverlap, P: FnMut(u64, u32) -> u32 + ?Sized>(
    s: S,
    entries: &[T],
    dense: DenseRows<'_>,
    probe: &mut P,
    device: &mut [f32],
    cached: &mut [f32],
) -> Scattered {
    if S::FAST_GATHER {
        scatter_gathered(s, entries, dense, probe, device, cached)
    } else {
        scatter_keyed_reference(entries, dense, probe, device, cached)
    }
}

/// The scalar reference of [`scatter_keyed`] (and its path for the entries
/// it does one by one).
pub fn scatter_keyed_reference<T: KeyedOverlap, P: FnMut(u64, u32) -> u32 + ?Sized>(
    entries: &[T],
    dense: DenseRows<'_>,
    probe: &mut P,
    device: &mut [f32],
    cached: &mut [f32],
) -> Scattered {
    let limit = device.len().min(cached.len());
    let mut out = Scattered::default();
    for e in entries {
        let (id, rank) = (e.worker_id(), e.dp_rank());
        let row = match dense.row_of(id, rank) {
            Some(row) => row,
            None => probe(id, rank),
        } as usize;
        if row < limit {
            device[row] = e.device_blocks() as f32;
            cached[row] = e.cached_tokens() as f32;
            out.lower_tiers |= e.host_blocks() | e.disk_blocks() | e.shared_blocks();
            out.written += 1;
        }
    }
    out
}

/// Byte offsets of the low and high halves of a little- or big-endian
/// `u64` at `at`.
const fn halves(at: usize) -> (usize, usize) {
    if cfg!(target_endian = "little") {
        (at, at + 4)
    } else {
        (at + 4, at)
    }
}

/// The fields the gathers read, as types ([`FieldAt`]): each gather
/// carries its field's offset as its displacement.
macro_rules! fields {
    ($($(#[$doc:meta])* $name:ident = $at:expr;)*) => {$(
        $(#[$doc])*
        struct $name<T>(PhantomData<T>);
        impl<T: KeyedOverlap> FieldAt for $name<T> {
            const AT: usize = $at;
        }
    )*};
}

fields! {
    /// The low half of the worker id.
    IdLo = halves(T::WORKER_ID_AT).0;
    /// The high half of the worker id.
    IdHi = halves(T::WORKER_ID_AT).1;
    /// The DP rank.
    Rank = T::DP_RANK_AT;
    /// The device-tier blocks.
    Device = T::DEVICE_BLOCKS_AT;
    /// The host-tier blocks.
    Host = T::HOST_BLOCKS_AT;
    /// The disk-tier blocks.
    Disk = T::DISK_BLOCKS_AT;
    /// The shared-cache blocks.
    Shared = T::SHARED_BLOCKS_AT;
    /// The cached tokens.
    Tokens = T::CACHED_TOKENS_AT;
}

/// [`scatter_keyed`] eight entries at a time with gathers.
#[cfg_attr(not(debug_assertions), inline(always))]
pub(crate) fn scatter_gathered<S: Simd, T: KeyedOverlap, P: FnMut(u64, u32) -> u32 + ?Sized>(
    s: S,
    entries: &[T],
    dense: DenseRows<'_>,
    probe: &mut P,
    device: &mut [f32],
    cached: &mut [f32],
) -> Scattered {
    // Every field the gathers read lies inside the entry, and eight
    // entries' offsets fit the gathers' signed 32-bit offsets.
    const {
        let size = size_of::<T>();
        assert!(size <= 1 << 24, "a KeyedOverlap entry is at most 16 MiB");
        assert!(T::WORKER_ID_AT + 8 <= size);
        assert!(T::DP_RANK_AT + 4 <= size);
        assert!(T::DEVICE_BLOCKS_AT + 4 <= size);
        assert!(T::HOST_BLOCKS_AT + 4 <= size);
        assert!(T::DISK_BLOCKS_AT + 4 <= size);
        assert!(T::SHARED_BLOCKS_AT + 4 <= size);
        assert!(T::CACHED_TOKENS_AT + 4 <= size);
    }
    let limit = device.len().min(cached.len());
    let (device, cached) = (&mut device[..limit], &mut cached[..limit]);
    let groups = entries.len() / LANES;
    if limit == 0 || dense.workers == 0 || groups == 0 {
        return scatter_keyed_reference(entries, dense, probe, device, cached);
    }
    let offsets = s
        .splat_u32(size_of::<T>() as u32)
        .mul_lo(s.load_u32(&[0, 1, 2, 3, 4, 5, 6, 7]));
    let zero = s.splat_u32(0);
    let last_worker = s.splat_u32(dense.workers - 1);
    let last_rank = s.splat_u32(dense.ranks - 1);
    let ranks = s.splat_u32(dense.ranks);
    let last_row = s.splat_u32((limit - 1).min(u32::MAX as usize) as u32);
    let table = dense.rows.as_ptr().cast::<u8>();
    let mut lower = zero;
    let mut out = Scattered::default();
    // Runs of groups gathered whole, each group that is not done one by
    // one between them: the inner loop calls nothing, so its vectors stay
    // in registers. `written` counts the groups done one by one; every
    // other group wrote its eight entries.
    let mut one_by_one = 0;
    let mut chunks = entries[..groups * LANES].chunks_exact(LANES);
    loop {
        let mut refused = None;
        for group in &mut chunks {
            let base = group.as_ptr().cast::<u8>();
            // SAFETY: `group` is eight entries of `size_of::<T>()` bytes,
            // so `base + offsets[i] + AT` is inside entry `i` for every
            // field offset `AT` the const block above checked (each field
            // lies inside the entry); the offsets are below `8 << 24`; and
            // the trait's contract makes those bytes initialized integers.
            let (id_lo, id_hi, rank) = unsafe {
                (
                    s.gather_field::<IdLo<T>>(base, offsets),
                    s.gather_field::<IdHi<T>>(base, offsets),
                    s.gather_field::<Rank<T>>(base, offsets),
                )
            };
            // Unsigned `a <= b` is `min(a, b) == a`: a lane is outside the
            // table where its id's high half, `min(id, last) ^ id` or
            // `min(rank, last) ^ rank` is not zero (one test for all three).
            let outside = id_hi | id_lo.min(last_worker).xor(id_lo) | rank.min(last_rank).xor(rank);
            if outside.cmp_eq(zero).bits() != 0xFF {
                refused = Some(group);
                break;
            }
            let index = id_lo.mul_lo(ranks) + rank;
            // SAFETY: every lane is covered: `id <= workers - 1` and
            // `rank <= ranks - 1`, so `index < workers * ranks <=
            // rows.len()` (at most `MAX_LEN`, so `4 * index` fits the
            // gather's offsets), and the table is initialized `u32`s.
            let row = unsafe { s.gather_u32(table, index.shl(2)) };
            // SAFETY: as for the first gathers.
            let (blocks, tokens) = unsafe {
                (
                    s.gather_field::<Device<T>>(base, offsets),
                    s.gather_field::<Tokens<T>>(base, offsets),
                )
            };
            // Every row inside the columns, and every value below `2^31`
            // (where the signed conversion is the unsigned one).
            if row.min(last_row).cmp_eq(row).bits() != 0xFF || (blocks | tokens).bits() != 0 {
                refused = Some(group);
                break;
            }
            // SAFETY: as for the first gathers.
            lower = lower
                | unsafe {
                    s.gather_field::<Host<T>>(base, offsets)
                        | s.gather_field::<Disk<T>>(base, offsets)
                        | s.gather_field::<Shared<T>>(base, offsets)
                };
            let (rows, blocks, tokens) = (
                row.to_array(),
                blocks.small_to_f32().to_array(),
                tokens.small_to_f32().to_array(),
            );
            for lane in 0..LANES {
                let r = rows[lane] as usize;
                // SAFETY: `r <= limit - 1` in every lane (checked above),
                // and both columns were cut to `limit`.
                unsafe {
                    *device.get_unchecked_mut(r) = blocks[lane];
                    *cached.get_unchecked_mut(r) = tokens[lane];
                }
            }
        }
        let Some(group) = refused else { break };
        out.merge(scatter_keyed_reference(group, dense, probe, device, cached));
        one_by_one += 1;
    }
    out.written += (groups - one_by_one) * LANES;
    let tail = &entries[groups * LANES..];
    out.merge(scatter_keyed_reference(tail, dense, probe, device, cached));
    out.lower_tiers |= lower.to_array().iter().fold(0, |a, &l| a | l);
    out
}
