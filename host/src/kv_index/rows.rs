//! The set of rows that hold one block, with the storage tiers each row
//! holds it in: a short sorted list while few rows hold the block, one
//! bitset per tier once the list would take more memory than the bitsets.
//!
//! The query walk ([`super::query`]) reads a dense set's bitsets in place
//! and a sparse set's entries as they are; its first block's set is loaded
//! into three dense scratch masks (device, host, disk) and unloaded after.
//! Nothing here allocates on that path.

/// Tier bits of a row entry.
pub(crate) const DEVICE: u8 = 1;
pub(crate) const HOST: u8 = 2;
pub(crate) const DISK: u8 = 4;

/// Rows a set can name: the row is stored above three tier bits of a `u32`.
pub(crate) const MAX_ROWS: usize = 1 << 29;

/// A sparse list never shrinks to fewer than this many entries' worth of
/// bitsets: below it the list is always the smaller form.
const MIN_DENSE_ENTRIES: usize = 8;

/// Rows holding one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RowSet {
    /// `row << 3 | tiers`, sorted by row, each row once, tiers never 0.
    Sparse(Vec<u32>),
    /// Three bitsets of equal length, device then host then disk.
    Dense(Box<[u64]>),
}

impl RowSet {
    /// An empty set.
    pub(crate) fn new() -> Self {
        RowSet::Sparse(Vec::new())
    }

    /// Adds `tier` (one tier bit) for `row`; `rows` is the current row count
    /// (sizes a bitset when the set turns dense).
    pub(crate) fn insert(&mut self, row: u32, tier: u8, rows: usize) {
        match self {
            RowSet::Sparse(list) => {
                match list.binary_search_by_key(&row, |e| e >> 3) {
                    Ok(i) => list[i] |= u32::from(tier),
                    Err(i) => list.insert(i, row << 3 | u32::from(tier)),
                }
                let words = rows.max(row as usize + 1).div_ceil(64);
                if list.len() > MIN_DENSE_ENTRIES.max(6 * words) {
                    *self = RowSet::Dense(Self::densify(list, words));
                }
            }
            RowSet::Dense(bits) => {
                let (row, bit) = (row as usize / 64, 1u64 << (row % 64));
                let words = bits.len() / 3;
                if row >= words {
                    let grown = rows.max(row * 64 + 1).div_ceil(64);
                    let mut wider = vec![0u64; 3 * grown].into_boxed_slice();
                    for t in 0..3 {
                        wider[t * grown..t * grown + words].copy_from_slice(&bits[t * words..(t + 1) * words]);
                    }
                    *bits = wider;
                }
                let words = bits.len() / 3;
                bits[tier_index(tier) * words + row] |= bit;
            }
        }
    }

    /// Removes `tier` for `row`; returns whether the set is now empty.
    pub(crate) fn remove(&mut self, row: u32, tier: u8) -> bool {
        match self {
            RowSet::Sparse(list) => {
                if let Ok(i) = list.binary_search_by_key(&row, |e| e >> 3) {
                    list[i] &= !u32::from(tier);
                    if list[i] & 7 == 0 {
                        list.remove(i);
                    }
                }
                list.is_empty()
            }
            RowSet::Dense(bits) => {
                let words = bits.len() / 3;
                let (w, bit) = (row as usize / 64, 1u64 << (row % 64));
                if w < words {
                    bits[tier_index(tier) * words + w] &= !bit;
                }
                bits.iter().all(|&b| b == 0)
            }
        }
    }

    /// Whether `row` holds the block in `tier` (one tier bit).
    pub(crate) fn has(&self, row: u32, tier: u8) -> bool {
        self.tiers(row) & tier != 0
    }

    /// Whether both sets name the same rows in the same tiers, whatever
    /// their forms.
    pub(crate) fn same_rows(&self, other: &RowSet) -> bool {
        match (self, other) {
            (RowSet::Sparse(a), RowSet::Sparse(b)) => a == b,
            (RowSet::Dense(a), RowSet::Dense(b)) => {
                let (wa, wb) = (a.len() / 3, b.len() / 3);
                let common = wa.min(wb);
                (0..3).all(|t| {
                    let (ta, tb) = (&a[t * wa..(t + 1) * wa], &b[t * wb..(t + 1) * wb]);
                    ta[..common] == tb[..common]
                        && ta[common..].iter().all(|&x| x == 0)
                        && tb[common..].iter().all(|&x| x == 0)
                })
            }
            _ => self.entries().eq(other.entries()),
        }
    }

    /// `row << 3 | tiers` of every row holding the block, by row.
    pub(crate) fn entries(&self) -> impl Iterator<Item = u32> + '_ {
        let (list, bits): (&[u32], &[u64]) = match self {
            RowSet::Sparse(list) => (list, &[]),
            RowSet::Dense(bits) => (&[], bits),
        };
        let words = bits.len() / 3;
        let dense = (0..words).flat_map(move |w| {
            let [d, h, k] = [bits[w], bits[words + w], bits[2 * words + w]];
            let mut any = d | h | k;
            std::iter::from_fn(move || {
                if any == 0 {
                    return None;
                }
                let b = any.trailing_zeros();
                any &= any - 1;
                let tiers = ((d >> b) & 1) | ((h >> b) & 1) << 1 | ((k >> b) & 1) << 2;
                Some(((w as u32) * 64 + b) << 3 | tiers as u32)
            })
        });
        list.iter().copied().chain(dense)
    }

    /// The tiers `row` holds the block in (0: none).
    pub(crate) fn tiers(&self, row: u32) -> u8 {
        match self {
            RowSet::Sparse(list) => list
                .binary_search_by_key(&row, |e| e >> 3)
                .map_or(0, |i| (list[i] & 7) as u8),
            RowSet::Dense(bits) => {
                let words = bits.len() / 3;
                let (w, b) = (row as usize / 64, row % 64);
                if w >= words {
                    return 0;
                }
                (0..3).fold(0, |acc, t| acc | ((((bits[t * words + w] >> b) & 1) as u8) << t))
            }
        }
    }

    /// Whether the set is in its dense form.
    #[cfg(test)]
    pub(crate) fn is_dense(&self) -> bool {
        matches!(self, RowSet::Dense(_))
    }

    /// Heap bytes the set holds.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            RowSet::Sparse(list) => list.capacity() * 4,
            RowSet::Dense(bits) => bits.len() * 8,
        }
    }

    /// ORs the set's rows in words `lo..hi` into `masks` (device, host, disk
    /// scratch of at least `hi` words each).
    #[inline]
    pub(crate) fn load(&self, masks: &mut [Vec<u64>; 3], lo: usize, hi: usize) {
        match self {
            RowSet::Sparse(list) => {
                for &e in list {
                    let row = (e >> 3) as usize;
                    let w = row / 64;
                    if w < lo || w >= hi {
                        continue;
                    }
                    let bit = 1u64 << (row % 64);
                    for (t, mask) in masks.iter_mut().enumerate() {
                        if e & (1 << t) != 0 {
                            mask[w] |= bit;
                        }
                    }
                }
            }
            RowSet::Dense(bits) => {
                let words = bits.len() / 3;
                let end = hi.min(words);
                if lo < end {
                    for (t, mask) in masks.iter_mut().enumerate() {
                        mask[lo..end].copy_from_slice(&bits[t * words + lo..t * words + end]);
                    }
                }
            }
        }
    }

    /// A dense set's device, host and disk bitsets (word 0 first, of one
    /// length), for reading in place; `None` for a sparse set, which is
    /// read by [`load`](Self::load).
    #[inline]
    pub(crate) fn dense_tiers(&self) -> Option<[&[u64]; 3]> {
        match self {
            RowSet::Sparse(_) => None,
            RowSet::Dense(bits) => {
                let words = bits.len() / 3;
                let (device, rest) = bits.split_at(words);
                let (host, disk) = rest.split_at(words);
                Some([device, host, &disk[..words]])
            }
        }
    }

    /// A sparse set's entries, `row << 3 | tiers` by row (empty for a
    /// dense set, which [`dense_tiers`](Self::dense_tiers) reads).
    #[inline]
    pub(crate) fn sparse_entries(&self) -> &[u32] {
        match self {
            RowSet::Sparse(list) => list,
            RowSet::Dense(_) => &[],
        }
    }

    /// Undoes [`load`](Self::load) on the same words, leaving `masks` zero.
    #[inline]
    pub(crate) fn unload(&self, masks: &mut [Vec<u64>; 3], lo: usize, hi: usize) {
        match self {
            RowSet::Sparse(list) => {
                for &e in list {
                    let w = (e >> 3) as usize / 64;
                    if w >= lo && w < hi {
                        for mask in masks.iter_mut() {
                            mask[w] = 0;
                        }
                    }
                }
            }
            RowSet::Dense(_) => {
                for mask in masks.iter_mut() {
                    mask[lo..hi].fill(0);
                }
            }
        }
    }

    /// The word range `lo..hi` that holds every row of the set.
    pub(crate) fn word_span(&self) -> (usize, usize) {
        match self {
            RowSet::Sparse(list) => match (list.first(), list.last()) {
                (Some(&a), Some(&b)) => ((a >> 3) as usize / 64, (b >> 3) as usize / 64 + 1),
                _ => (0, 0),
            },
            RowSet::Dense(bits) => {
                let words = bits.len() / 3;
                let used = |w: usize| (0..3).any(|t| bits[t * words + w] != 0);
                match ((0..words).find(|&w| used(w)), (0..words).rev().find(|&w| used(w))) {
                    (Some(a), Some(b)) => (a, b + 1),
                    _ => (0, 0),
                }
            }
        }
    }

    fn densify(list: &[u32], words: usize) -> Box<[u64]> {
        let mut bits = vec![0u64; 3 * words].into_boxed_slice();
        for &e in list {
            let row = (e >> 3) as usize;
            for t in 0..3 {
                if e & (1 << t) != 0 {
                    bits[t * words + row / 64] |= 1u64 << (row % 64);
                }
            }
        }
        bits
    }
}

/// 0 for the device bit, 1 for host, 2 for disk.
#[inline]
fn tier_index(tier: u8) -> usize {
    tier.trailing_zeros() as usize
}
