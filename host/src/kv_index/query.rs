//! The query: one walk over a request's blocks that writes every row's
//! device, host and disk overlap into per-row columns.
//!
//! Each row is in one stage while the walk advances: still matching on
//! device, continuing in host memory, continuing on disk, or done. The
//! stages are three bitsets over rows; at block `i` the block's row set is
//! read as three masks (rows holding it on device, host, disk: a dense set's
//! own bitsets, a sparse set's masks built word by word from its rows) and
//! every 64 rows move at once:
//!
//! ```text
//! device -> device   if held on device
//!        -> host     else if held in host memory   (device overlap = i)
//!        -> disk     else if held on disk          (device overlap = i)
//!        -> done     else                          (device overlap = i)
//! host   -> host     if held in host memory
//!        -> disk     else if held on disk          (host overlap = i - device)
//!        -> done     else                          (host overlap = i - device)
//! disk   -> disk     if held on disk
//!        -> done     else                          (disk overlap = i - device - host)
//! ```
//!
//! Block 0 starts each row holding it in the stage of its best tier. The
//! walk stops at the first block no row holds, or when no row is left, and
//! only visits the words of rows still in a stage; while no row is in the
//! host or disk stage (the common case), a word that loses no row costs a
//! load, a mask and a test. A block held by the same
//! set of rows as the block before (one shared set in the index, compared
//! by address) moves nothing and costs one comparison. Blocks are hashed as
//! the walk reaches them (a chunk ahead), so a query by tokens or local
//! hashes hashes nothing past the block where it stops.
//!
//! The walk writes device overlaps; the cached-token estimates (device
//! blocks times the block size) are written once at its end, over the
//! words of the rows that held block 0.
//!
//! Only rows that held block 0 get a value, so the next query clears just
//! those, and of those only the rows that do not hold its own block 0 on
//! device (it writes every one of those).

use super::block_rows::NONE;
use super::event::KvQueryError;
use super::hash::{next_sequence_hash, KvBlockHasher};
use super::rows::DEVICE;
use super::KvIndex;
use crate::request::{RowLayout, RowOverlaps};

/// A query's output columns and scratch, owned by the caller and reused
/// across queries (one per thread): after the first queries at a fleet size,
/// a query allocates nothing.
#[derive(Clone, Debug, Default)]
pub struct KvOverlaps {
    layout: Option<RowLayout>,
    device: Vec<f32>,
    host: Vec<f32>,
    disk: Vec<f32>,
    cached: Vec<f32>,
    /// Mask words `[start, end)` whose rows the last query may have given
    /// a value (the first block's span: no other row can get one).
    touched: (usize, usize),
    /// The last query's span while the next one has not cleared it.
    stale: (usize, usize),
    /// Whether the last query wrote a host or disk overlap (else those
    /// columns are still zero).
    lower_tiers: bool,
    /// Stage bitsets: device, host, disk.
    stage: [Vec<u64>; 3],
    /// Whether a row of the walk may be in the host or disk stage (false:
    /// those bitsets are zero, and a block only moves rows off device).
    lower_stage: bool,
    /// The current block's rows: device, host, disk.
    held: [Vec<u64>; 3],
}

impl KvOverlaps {
    /// Empty columns.
    pub fn new() -> Self {
        Self::default()
    }

    /// The last query's columns, as the service reads them (`None` before
    /// the first query).
    pub fn row_overlaps(&self) -> Option<RowOverlaps<'_>> {
        let layout = self.layout?;
        let columns = RowOverlaps::new(layout, &self.device).with_cached_tokens(&self.cached);
        // Host and disk columns of zeros credit nothing: they are left out
        // (the selection then takes its device-only loop).
        Some(if self.lower_tiers {
            columns.with_host_blocks(&self.host).with_disk_blocks(&self.disk)
        } else {
            columns
        })
    }

    /// Raises the last query's device blocks of each `(row, blocks)` to at
    /// least `blocks` (and its cached-token estimate to match, `blocks`
    /// times `block_size`), and returns the columns. Rows past the layout
    /// are skipped; the next query clears what this wrote. `None` before
    /// the first query.
    pub fn raise_device_blocks(
        &mut self,
        rows: impl IntoIterator<Item = (usize, u32)>,
        block_size: u32,
    ) -> Option<RowOverlaps<'_>> {
        self.layout?;
        for (row, blocks) in rows {
            let (Some(device), Some(cached)) = (self.device.get_mut(row), self.cached.get_mut(row)) else {
                continue;
            };
            let blocks = blocks as f32;
            if blocks > *device {
                *device = blocks;
                *cached = blocks * block_size as f32;
            }
            let word = row / 64;
            self.touched = if self.touched.0 == self.touched.1 {
                (word, word + 1)
            } else {
                (self.touched.0.min(word), self.touched.1.max(word + 1))
            };
        }
        self.row_overlaps()
    }

    /// Device, host and disk blocks of `row` in the last query.
    pub fn tiers(&self, row: usize) -> (u32, u32, u32) {
        let at = |c: &Vec<f32>| c.get(row).map_or(0, |&v| v as u32);
        (at(&self.device), at(&self.host), at(&self.disk))
    }

    /// Sizes the columns for `layout` and zeroes what the last query wrote.
    fn reset(&mut self, layout: RowLayout) {
        let rows = layout.rows();
        let (start, end) = std::mem::take(&mut self.touched);
        // Device and cached values are cleared once the next query's first
        // block is known (`clear_stale`); host and disk now, if written.
        self.stale = (start, end);
        if std::mem::take(&mut self.lower_tiers) {
            for column in [&mut self.host, &mut self.disk] {
                let end = (end * 64).min(column.len());
                if start * 64 < end {
                    column[start * 64..end].fill(0.0);
                }
            }
        }
        for column in [&mut self.device, &mut self.host, &mut self.disk, &mut self.cached] {
            column.resize(rows, 0.0);
        }
        let words = rows.div_ceil(64);
        for mask in self.stage.iter_mut().chain(self.held.iter_mut()) {
            mask.resize(words, 0);
        }
        self.layout = Some(layout);
    }

    /// Zeroes the device and cached values the last query left on the
    /// words holding a row outside this query's device stage (`stage[0]`,
    /// set from its first block). The walk writes both values of each row
    /// in that stage before the query ends (and reads neither before), so
    /// a word whose every row is in it is left as it is, and a word with
    /// any other row is zeroed whole: a fill costs less than clearing
    /// only the rows outside the stage. Repeated queries over the same
    /// rows clear nothing.
    fn clear_stale(&mut self) {
        let (start, end) = std::mem::take(&mut self.stale);
        let rows = self.device.len().min(self.cached.len());
        for w in start..end.min(rows.div_ceil(64)) {
            let valid = if (w + 1) * 64 <= rows {
                u64::MAX
            } else {
                (1u64 << (rows - w * 64)) - 1
            };
            if !self.stage[0].get(w).copied().unwrap_or(0) & valid != 0 {
                let word = w * 64..(w * 64 + 64).min(rows);
                self.device[word.clone()].fill(0.0);
                self.cached[word].fill(0.0);
            }
        }
    }
}

impl KvIndex {
    /// Writes, for every row, the leading blocks of the request named by
    /// `sequence_hashes` (its blocks' sequence hashes, in order) that the
    /// row holds on device, in host memory after those, and on disk after
    /// those, plus the cached-token estimate (device blocks times the block
    /// size), and returns the columns for a
    /// [`SelectionRequest`](crate::SelectionRequest).
    pub fn overlaps<'o>(
        &self,
        sequence_hashes: &[u64],
        out: &'o mut KvOverlaps,
    ) -> Result<RowOverlaps<'o>, KvQueryError> {
        let layout = self.layout.ok_or(KvQueryError::NoRowLayout)?;
        out.reset(layout);
        let mut next = sequence_hashes.iter().copied();
        self.walk(sequence_hashes.len(), || next.next().unwrap_or(0), out);
        Ok(out.row_overlaps().expect("reset sets the layout"))
    }

    /// [`overlaps`](Self::overlaps) for a request given by its local block
    /// hashes (Dynamo's `LocalBlockHash`es, from the first block on). The
    /// sequence hashes are chained as the walk goes: none past the first
    /// block no row holds, and at most 15 past the block where the walk
    /// stops otherwise (the rows holding the prefix hold no more of it).
    pub fn overlaps_for_local_hashes<'o>(
        &self,
        local_hashes: &[u64],
        out: &'o mut KvOverlaps,
    ) -> Result<RowOverlaps<'o>, KvQueryError> {
        let layout = self.layout.ok_or(KvQueryError::NoRowLayout)?;
        out.reset(layout);
        let (mut next, mut parent) = (local_hashes.iter().copied(), None);
        let chain = || {
            let local = next.next().unwrap_or(0);
            let seq = parent.map_or(local, |p| next_sequence_hash(p, local));
            parent = Some(seq);
            seq
        };
        self.walk(local_hashes.len(), chain, out);
        Ok(out.row_overlaps().expect("reset sets the layout"))
    }

    /// [`overlaps`](Self::overlaps) for a request given by its tokens,
    /// hashed by `hasher` (block size, LoRA adapter, namespace). Blocks are
    /// hashed as the walk goes, as by
    /// [`overlaps_for_local_hashes`](Self::overlaps_for_local_hashes): none
    /// past the first block no row holds (for a prompt nobody holds, only
    /// the first). A hasher of another block size than the index's is
    /// refused ([`KvQueryError::HasherBlockSize`]).
    pub fn overlaps_for_tokens<'o>(
        &self,
        hasher: &KvBlockHasher,
        tokens: &[u32],
        out: &'o mut KvOverlaps,
    ) -> Result<RowOverlaps<'o>, KvQueryError> {
        self.check_hasher(hasher)?;
        let layout = self.layout.ok_or(KvQueryError::NoRowLayout)?;
        out.reset(layout);
        let (mut block, mut parent) = (0, None);
        let chain = || {
            let local = hasher.block_local_hash(tokens, block);
            block += 1;
            let seq = parent.map_or(local, |p| next_sequence_hash(p, local));
            parent = Some(seq);
            seq
        };
        self.walk(hasher.block_count(tokens.len()), chain, out);
        Ok(out.row_overlaps().expect("reset sets the layout"))
    }

    /// [`overlaps`](Self::overlaps), returning how many of
    /// `sequence_hashes` the walk asked for.
    #[cfg(test)]
    pub(super) fn hashes_walked(&self, sequence_hashes: &[u64], out: &mut KvOverlaps) -> usize {
        out.reset(self.layout.expect("synced"));
        let mut next = sequence_hashes.iter().copied();
        let mut asked = 0;
        self.walk(
            sequence_hashes.len(),
            || {
                asked += 1;
                next.next().unwrap_or(0)
            },
            out,
        );
        asked
    }

    /// The walk over a request of `blocks` blocks, whose sequence hashes
    /// `next_hash` yields in order (called at most `blocks` times).
    fn walk(&self, blocks: usize, next_hash: impl FnMut() -> u64, out: &mut KvOverlaps) {
        // The scratch masks leave `out` for the walk, so that a step can
        // read them beside `out`'s columns; they are all zero between
        // blocks and come back zero.
        let mut held = std::mem::take(&mut out.held);
        self.walk_blocks(blocks, next_hash, out, &mut held);
        out.held = held;
        // The cached-token estimates, device blocks times the block size,
        // written once per query over the words the walk could give a
        // value (the others are zero in both columns), not each time rows
        // leave the device stage.
        let block_size = self.block_size as f32;
        let rows = out.device.len().min(out.cached.len());
        let (start, end) = ((out.touched.0 * 64).min(rows), (out.touched.1 * 64).min(rows));
        for (c, &d) in out.cached[start..end].iter_mut().zip(&out.device[start..end]) {
            *c = d * block_size;
        }
    }

    /// [`walk`](Self::walk), with the block masks' scratch apart.
    fn walk_blocks(
        &self,
        blocks: usize,
        mut next_hash: impl FnMut() -> u64,
        out: &mut KvOverlaps,
        held: &mut [Vec<u64>; 3],
    ) {
        let first_id = if blocks == 0 {
            NONE
        } else {
            self.blocks.set_id(next_hash())
        };
        if first_id == NONE {
            out.clear_stale();
            return;
        }
        let first = self.blocks.rows_of(first_id);
        let words = out.stage[0].len();
        let (lo, hi) = first.word_span();
        let (mut lo, mut hi) = (lo.min(words), hi.min(words));
        first.load(held, lo, hi);
        out.lower_stage = false;
        let [hd, hh, hk] = &*held;
        for w in lo..hi {
            let [d, h, k] = [hd[w], hh[w], hk[w]];
            out.stage[0][w] = d;
            out.stage[1][w] = h & !d;
            out.stage[2][w] = k & !d & !h;
            out.lower_stage |= (h | k) & !d != 0;
        }
        out.touched = (lo, hi);
        out.clear_stale();
        first.unload(held, lo, hi);
        // The blocks' row sets are looked up a chunk ahead: the lookups of
        // a chunk do not depend on one another, so their cache misses
        // overlap instead of queueing one behind the other. A chunk holds
        // the sets' ids; a set's rows are read only when its id differs
        // from the block before's.
        let mut ahead = [NONE; LOOKAHEAD];
        let mut prev = first_id;
        let mut i = 1;
        while i < blocks {
            // A block no row holds ends the walk (every row leaves its
            // stage there), so the chunk stops at it: no hash is chained
            // past the first such block.
            let end = LOOKAHEAD.min(blocks - i);
            let mut chunk = 0;
            for slot in &mut ahead[..end] {
                chunk += 1;
                match self.blocks.find_set_id(next_hash()) {
                    Some(id) => *slot = id,
                    None => {
                        *slot = NONE;
                        break;
                    }
                }
            }
            for &id in &ahead[..chunk] {
                let at = i;
                i += 1;
                // The same rows in the same tiers as the block before (the
                // index keeps each distinct set once, under one id): every
                // row still in a stage holds this block in its stage's
                // tier, so nothing moves (the common case inside a shared
                // prompt).
                if id == prev && id != NONE {
                    continue;
                }
                prev = id;
                let at = at as f32;
                let set = (id != NONE).then(|| self.blocks.rows_of(id));
                let (new_lo, new_hi) = match set.map(|set| (set, set.dense_tiers())) {
                    // A dense set's bitsets are read where they are; the
                    // words past them (rows added since the set was made)
                    // hold nothing, as the zero scratch says.
                    Some((_, Some(tiers))) => {
                        let end = hi.min(tiers[0].len()).max(lo);
                        let ours = tiers.map(|t| &t[lo..end]);
                        let (a_lo, a_hi) = step(at, out, ours, lo, end);
                        let (b_lo, b_hi) = step(at, out, held.each_ref().map(|h| &h[end..hi]), end, hi);
                        match (a_lo < a_hi, b_lo < b_hi) {
                            (true, true) => (a_lo, b_hi),
                            (true, false) => (a_lo, a_hi),
                            (false, _) => (b_lo, b_hi),
                        }
                    }
                    Some((set, None)) => step_sparse(at, out, set.sparse_entries(), lo, hi),
                    None => step(at, out, held.each_ref().map(|h| &h[lo..hi]), lo, hi),
                };
                if new_lo >= new_hi {
                    return;
                }
                (lo, hi) = (new_lo, new_hi);
            }
        }
        // Rows still in a stage hold the request to its end.
        let n = blocks as f32;
        for w in lo..hi {
            let [d, h, k] = [out.stage[0][w], out.stage[1][w], out.stage[2][w]];
            set_rows(&mut out.device, d, w, n);
            out.lower_tiers |= h | k != 0;
            for_rows(h, w, |r| out.host[r] = n - out.device[r]);
            for_rows(k, w, |r| out.disk[r] = n - out.device[r] - out.host[r]);
            for mask in out.stage.iter_mut() {
                mask[w] = 0;
            }
        }
    }
}

/// One block of the walk, over words `lo..hi`: moves the rows between
/// stages by the block's device, host and disk masks over those words
/// (`held`, word `lo` first), writes the overlaps of the rows that leave a
/// stage, and returns the words still holding a row in a stage (`lo >= hi`
/// when none does).
#[inline]
fn step(i: f32, out: &mut KvOverlaps, held: [&[u64]; 3], lo: usize, hi: usize) -> (usize, usize) {
    let n = hi.saturating_sub(lo);
    let (hd, hh, hk) = (&held[0][..n], &held[1][..n], &held[2][..n]);
    step_words(i, out, lo, hi, |o| [hd[o], hh[o], hk[o]])
}

/// [`step`] for a sparse set (`row << 3 | tiers`, by row), its masks built
/// word by word from its entries as the step reaches each word: no scratch
/// written and cleared.
#[inline]
fn step_sparse(i: f32, out: &mut KvOverlaps, entries: &[u32], lo: usize, hi: usize) -> (usize, usize) {
    let mut e = entries.partition_point(|&x| ((x >> 3) as usize) < lo * 64);
    step_words(i, out, lo, hi, |o| {
        let w = lo + o;
        let mut masks = [0u64; 3];
        while let Some(&x) = entries.get(e) {
            let row = (x >> 3) as usize;
            if row / 64 > w {
                break;
            }
            e += 1;
            if row / 64 < w {
                continue;
            }
            let bit = 1u64 << (row % 64);
            if x & 7 == u32::from(DEVICE) {
                // On device only: the common entry.
                masks[0] |= bit;
            } else {
                for (t, mask) in masks.iter_mut().enumerate() {
                    *mask |= bit & 0u64.wrapping_sub(u64::from((x >> t) & 1));
                }
            }
        }
        masks
    })
}

/// The step over words `lo..hi`, with the block's device, host and disk
/// masks of word `lo + o` from `held(o)` (called once per word, in order).
#[inline]
fn step_words(
    i: f32,
    out: &mut KvOverlaps,
    lo: usize,
    hi: usize,
    mut held: impl FnMut(usize) -> [u64; 3],
) -> (usize, usize) {
    let KvOverlaps {
        device,
        host,
        disk,
        stage,
        lower_tiers,
        lower_stage,
        ..
    } = out;
    let [sd, sh, sk] = stage;
    let (mut new_lo, mut new_hi) = (hi, lo);
    // Three slices of one length, indexed alike: no bounds check inside.
    let n = hi.saturating_sub(lo);
    let (sd, sh, sk) = (&mut sd[lo..lo + n], &mut sh[lo..lo + n], &mut sk[lo..lo + n]);
    if !*lower_stage {
        // Every row still in a stage is on device (the common case: host
        // and disk tiers are rare). Most words lose no row at a block: a
        // word costs a load, a mask and a test, and only the rows leaving
        // the device stage read the block's lower tiers.
        let mut moved = false;
        for o in 0..n {
            let [dv, hv, kv] = held(o);
            let d = sd[o];
            let left_device = d & !dv;
            if left_device == 0 {
                continue;
            }
            moved = true;
            let w = lo + o;
            sd[o] = d & dv;
            leave_device(device, left_device, d & dv, w, i);
            let (next_host, next_disk) = (left_device & hv, left_device & !hv & kv);
            if next_host | next_disk != 0 {
                sh[o] = next_host;
                sk[o] = next_disk;
                *lower_stage = true;
            }
        }
        if !moved {
            return (lo, hi);
        }
        // The words left holding a row in a stage, trimmed from both ends.
        let alive = |o: usize| sd[o] | sh[o] | sk[o] != 0;
        let (mut first, mut last) = (0, n);
        while first < last && !alive(first) {
            first += 1;
        }
        while last > first && !alive(last - 1) {
            last -= 1;
        }
        return if first < last {
            (lo + first, lo + last)
        } else {
            (hi, lo)
        };
    }
    for o in 0..n {
        let [dv, hv, kv] = held(o);
        let (d, h, k) = (sd[o], sh[o], sk[o]);
        if d | h | k == 0 {
            continue;
        }
        let w = lo + o;
        let left_device = d & !dv;
        let left_host = h & !hv;
        let done_disk = k & !kv;
        let next_host = (h & hv) | (left_device & hv);
        let next_disk = (k & kv) | ((left_device | left_host) & !hv & kv);
        let d = d & dv;
        sd[o] = d;
        if left_device != 0 {
            leave_device(device, left_device, d, w, i);
        }
        if left_host | done_disk != 0 {
            *lower_tiers = true;
            for_rows(left_host, w, |r| host[r] = i - device[r]);
            for_rows(done_disk, w, |r| disk[r] = i - device[r] - host[r]);
        }
        sh[o] = next_host;
        sk[o] = next_disk;
        if d | next_host | next_disk != 0 {
            new_lo = new_lo.min(w);
            new_hi = w + 1;
        }
    }
    (new_lo, new_hi)
}

/// Writes block `i` as the device overlap of the rows of word `w` that
/// leave the device stage (`left`; `stay` are the word's rows that remain
/// in it).
#[inline]
fn leave_device(device: &mut [f32], left: u64, stay: u64, w: usize, i: f32) {
    if left & (left - 1) == 0 {
        // One row leaves (the common case where each word holds one of the
        // prompt's rows): one store, no call.
        device[w * 64 + left.trailing_zeros() as usize] = i;
    } else if (stay | left) == u64::MAX && w * 64 + 64 <= device.len() {
        // Every row of the word was on device: the rows that stay get a
        // value they overwrite when they leave, so the word is written
        // whole, without masks.
        device[w * 64..w * 64 + 64].fill(i);
    } else {
        set_rows(device, left, w, i);
    }
}

/// Blocks whose row sets a query looks up at once.
const LOOKAHEAD: usize = 16;

/// Sets `column[r] = value` for every row `r` whose bit is set in word
/// `w`'s `bits`: row by row when few are, else the word's 64 rows in one
/// branch-free pass (a select per row, which the compiler vectorizes).
#[inline]
fn set_rows(column: &mut [f32], bits: u64, w: usize, value: f32) {
    // Up to eight rows one by one (no population count: the x86-64
    // baseline has no `popcnt`); past eight, the whole word, rewriting the
    // rows already written with the same value.
    let mut rest = bits;
    for _ in 0..8 {
        if rest == 0 {
            return;
        }
        column[w * 64 + rest.trailing_zeros() as usize] = value;
        rest &= rest - 1;
    }
    if rest == 0 {
        return;
    }
    let end = (w * 64 + 64).min(column.len());
    let value = value.to_bits();
    // Eight rows at a time, as bit operations on the floats' bits: the
    // compiler turns each group into a few vector instructions.
    let mut groups = column[w * 64..end].chunks_exact_mut(8);
    for (g, group) in (&mut groups).enumerate() {
        let byte = (bits >> (8 * g)) as u32 & 0xff;
        for (lane, v) in group.iter_mut().enumerate() {
            let keep = ((byte >> lane) & 1).wrapping_sub(1);
            *v = f32::from_bits((v.to_bits() & keep) | (value & !keep));
        }
    }
    let done = (end - w * 64) / 8 * 8;
    for (k, v) in groups.into_remainder().iter_mut().enumerate() {
        if (bits >> (done + k)) & 1 != 0 {
            *v = f32::from_bits(value);
        }
    }
}

/// Calls `f` with every row whose bit is set in word `w`'s `bits`.
#[inline]
fn for_rows(mut bits: u64, w: usize, mut f: impl FnMut(usize)) {
    while bits != 0 {
        f(w * 64 + bits.trailing_zeros() as usize);
        bits &= bits - 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `set_rows` writes exactly the rows of its bits, from none to all 64,
    /// in a full word and in the short last word of a column.
    #[test]
    fn set_rows_writes_exactly_the_rows_of_its_bits() {
        let mut rng = selkie_kernel::Rng::new(0x9e37_79b9_7f4a_7c15);
        for len in [128, 100] {
            for case in 0..2_000 {
                // Every count of bits from 0 to 64 (the writing changes
                // form past 8).
                let want_bits = (case % 66).min(64);
                let mut bits = 0u64;
                while (bits.count_ones() as usize) < want_bits {
                    bits |= 1 << rng.below(64);
                }
                let valid = if len == 128 { u64::MAX } else { (1u64 << (len - 64)) - 1 };
                let bits = bits & valid;
                let mut column: Vec<f32> = (0..len).map(|r| r as f32).collect();
                set_rows(&mut column, bits, 1, -1.0);
                for (r, &v) in column.iter().enumerate() {
                    let set = r >= 64 && (bits >> (r - 64)) & 1 != 0;
                    let want = if set { -1.0 } else { r as f32 };
                    assert_eq!(v, want, "row {r}, bits {bits:#x}, {len} rows");
                }
            }
        }
    }
}
