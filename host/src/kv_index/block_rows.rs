//! Block -> rows, with every distinct row set stored once.
//!
//! Blocks of one prompt are held by the same rows in the same tiers: the 64
//! blocks of a system prompt every worker holds share one set, the blocks of
//! a worker's own chain share another. Each block maps to the id of its set,
//! and a set is kept once however many blocks name it (hash-consing), so:
//!
//! * a query skips a block whose set is its predecessor's by comparing two
//!   ids, not the rows;
//! * a store or removal that moves many blocks from one set to the same next
//!   set (a rank storing a run of a shared prompt) computes that next set
//!   once and then only renames ids;
//! * memory grows with the distinct sets, not with the blocks.
//!
//! Sets are found by a fingerprint: the XOR of one 64-bit key per
//! `(row, tier)` entry (Zobrist hashing), updated with one XOR per change. A
//! fingerprint match is confirmed by comparing the rows, so an id always
//! names exactly its rows; two sets whose fingerprints collide are kept
//! apart, which only costs a missed skip.

use super::rows::RowSet;
use selkie_kernel::table::HashIndex;

/// The id of "no row holds the block" (such blocks are not in the table).
pub(crate) const NONE: u32 = u32::MAX;

/// One distinct set and the blocks naming it.
#[derive(Debug)]
struct SharedSet {
    rows: RowSet,
    /// XOR of [`entry_key`] over the set's `(row, tier)` entries.
    print: u64,
    /// Blocks whose set this is (0: free).
    blocks: u32,
}

/// A change computed: `from` with `(row, tier)` added or removed is `to`.
/// Valid while `generation` is the table's: a set changed in place or
/// freed starts a new generation.
#[derive(Clone, Copy, Debug, Default)]
struct Transition {
    generation: u64,
    from: u32,
    row: u32,
    tier: u8,
    add: bool,
    to: u32,
}

/// Changes remembered, by `from` (a rank placed on its row moves blocks of
/// several sets in turn, in no order).
const REMEMBERED: usize = 32;

/// Sequence hash -> the rows holding the block.
#[derive(Debug, Default)]
pub(crate) struct BlockRows {
    /// Sequence hash -> the id of its set.
    blocks: HashIndex<u32>,
    sets: Sets,
}

/// The distinct sets, by id.
#[derive(Debug)]
struct Sets {
    sets: Vec<SharedSet>,
    free: Vec<u32>,
    /// Fingerprint -> the set found under it.
    /// (Fx-hashed: fingerprints are already random.)
    by_print: rustc_hash::FxHashMap<u64, u32>,
    /// Changes computed, at `from % REMEMBERED`.
    remembered: [Transition; REMEMBERED],
    /// Starts at 1: a default entry never matches.
    generation: u64,
}

impl Default for Sets {
    fn default() -> Self {
        Sets {
            sets: Vec::new(),
            free: Vec::new(),
            by_print: rustc_hash::FxHashMap::default(),
            remembered: [Transition::default(); REMEMBERED],
            generation: 1,
        }
    }
}

impl BlockRows {
    /// Makes room for `blocks` distinct blocks (see
    /// [`KvIndex::with_block_capacity`](super::KvIndex::with_block_capacity)).
    pub(crate) fn reserve(&mut self, blocks: usize) {
        self.blocks.reserve(blocks.saturating_sub(self.blocks.len()));
    }

    /// Blocks the block table holds before it grows.
    #[cfg(test)]
    pub(crate) fn table_capacity(&self) -> usize {
        self.blocks.capacity()
    }

    /// Distinct blocks some row holds.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// The rows holding `sequence` (two blocks held by the same rows in the
    /// same tiers return the same reference, as [`set_id`](Self::set_id)
    /// says).
    #[cfg(test)]
    pub(crate) fn get(&self, sequence: &u64) -> Option<&RowSet> {
        let id = self.set_id(*sequence);
        (id != NONE).then(|| self.rows_of(id))
    }

    /// The id of the set of rows holding `sequence`'s block ([`NONE`] if no
    /// row holds it). Two blocks held by the same rows in the same tiers
    /// have the same id, except after a fingerprint collision; equal ids
    /// are always equal sets.
    #[inline]
    pub(crate) fn set_id(&self, sequence: u64) -> u32 {
        self.find_set_id(sequence).unwrap_or(NONE)
    }

    /// [`set_id`](Self::set_id), `None` where no row holds the block.
    #[inline]
    pub(crate) fn find_set_id(&self, sequence: u64) -> Option<u32> {
        self.blocks.get(sequence)
    }

    /// The rows of set `id` (an id from [`set_id`](Self::set_id), not
    /// [`NONE`], with no change to the table since).
    #[inline]
    pub(crate) fn rows_of(&self, id: u32) -> &RowSet {
        &self.sets.sets[id as usize].rows
    }

    /// Every block's rows (a set once per block naming it).
    #[cfg(test)]
    pub(crate) fn values(&self) -> impl Iterator<Item = &RowSet> {
        self.blocks.iter().map(|(_, id)| &self.sets.sets[id as usize].rows)
    }

    /// Distinct sets in use.
    #[cfg(test)]
    pub(crate) fn distinct_sets(&self) -> usize {
        self.sets.sets.iter().filter(|s| s.blocks > 0).count()
    }

    /// Adds `tier` of `row` to block `sequence`; `rows` is the layout's row
    /// count (sizes a bitset). Returns whether the row already held the
    /// block in that tier (nothing changed).
    pub(crate) fn insert(&mut self, sequence: u64, row: u32, tier: u8, rows: usize) -> bool {
        let (id, _) = self.blocks.get_or_insert(sequence, NONE);
        let from = *id;
        if from != NONE && self.sets.sets[from as usize].rows.has(row, tier) {
            return true;
        }
        let to = self.sets.next_set(from, row, tier, true, rows);
        *id = to;
        self.sets.settle(from, to, 1);
        false
    }

    /// Adds `tier` of `row` to each block of `sequences`, in order: what
    /// [`insert`](Self::insert) on each in turn does, with the set a
    /// streak of blocks moves to (blocks naming the same set one after
    /// another, as a stored run's blocks do) found once and the streak's
    /// counts moved at once. `already` is called with each block the row
    /// held in that tier already (in order; a block twice in `sequences`
    /// is reported the second time).
    pub(crate) fn insert_all(
        &mut self,
        sequences: &[u64],
        row: u32,
        tier: u8,
        rows: usize,
        mut already: impl FnMut(u64),
    ) {
        // The current streak: `moved` blocks renamed from `from` to `to`,
        // not counted yet (`next_set` reads the counts, so they are
        // settled before it is asked again); `held` if `from` has the row
        // in the tier already (then `to` is `from`).
        let (mut from, mut to, mut moved, mut held) = (NONE, NONE, 0u32, false);
        let mut streak = false;
        for &sequence in sequences {
            let (id, _) = self.blocks.get_or_insert(sequence, NONE);
            if !streak || *id != from {
                self.sets.settle(from, to, moved);
                (from, moved, streak) = (*id, 0, true);
                held = from != NONE && self.sets.sets[from as usize].rows.has(row, tier);
                to = if held {
                    from
                } else {
                    self.sets.next_set(from, row, tier, true, rows)
                };
            }
            if held {
                already(sequence);
            } else {
                *id = to;
                moved += 1;
                // A set changed in place (no other block named it) now has
                // the row: the streak's next blocks naming it hold it.
                held = to == from;
            }
        }
        self.sets.settle(from, to, moved);
    }

    /// Starts loading block `sequence`'s table entry into cache (see
    /// [`HashIndex::prefetch`]).
    #[inline]
    pub(crate) fn prefetch(&self, sequence: u64) {
        self.blocks.prefetch(sequence);
    }

    /// Takes `tier` of `row` off block `sequence`, dropping the block once
    /// no row holds it.
    pub(crate) fn remove(&mut self, sequence: u64, row: u32, tier: u8) {
        let Some(id) = self.blocks.get_mut(sequence) else {
            return;
        };
        let from = *id;
        let to = self.sets.next_set(from, row, tier, false, 0);
        if to == from {
            return;
        }
        if to == NONE {
            self.blocks.remove(sequence);
        } else {
            *id = to;
            self.sets.sets[to as usize].blocks += 1;
        }
        self.sets.release(from, 1);
    }

    /// Gives memory back once most blocks are gone (see
    /// [`HashIndex::shrink`]), keeping room for `keep` blocks.
    pub(crate) fn shrink(&mut self, keep: usize) {
        self.blocks.shrink(keep);
        if self.blocks.is_empty() {
            self.sets = Sets::default();
        }
    }

    /// Heap bytes, as allocated (hash tables: one control byte per slot).
    pub(crate) fn heap_bytes(&self) -> usize {
        let table = |cap: usize, entry: usize| cap * (entry + 1);
        self.blocks.heap_bytes()
            + table(self.sets.by_print.capacity(), std::mem::size_of::<(u64, u32)>())
            + self.sets.sets.capacity() * std::mem::size_of::<SharedSet>()
            + self.sets.free.capacity() * 4
            + self.sets.sets.iter().map(|s| s.rows.heap_bytes()).sum::<usize>()
    }
}

impl Sets {
    /// Counts `moved` blocks renamed from set `from` to set `to`.
    fn settle(&mut self, from: u32, to: u32, moved: u32) {
        if moved == 0 || from == to {
            return;
        }
        self.sets[to as usize].blocks += moved;
        if from != NONE {
            self.release(from, moved);
        }
    }

    /// The set `from` becomes with `(row, tier)` added or removed (`NONE`
    /// when empty), creating it if no block names it yet.
    fn next_set(&mut self, from: u32, row: u32, tier: u8, add: bool, rows: usize) -> u32 {
        let slot = from as usize % REMEMBERED;
        let t = self.remembered[slot];
        if (t.generation, t.from, t.row, t.tier, t.add) == (self.generation, from, row, tier, add) {
            return t.to;
        }
        let had = from != NONE && self.sets[from as usize].rows.has(row, tier);
        if had == add {
            return from;
        }
        let (print, only_block) = match from {
            NONE => (entry_key(row, tier), false),
            id => {
                let s = &self.sets[id as usize];
                (s.print ^ entry_key(row, tier), s.blocks == 1)
            }
        };
        if only_block {
            // No other block names `from`: change it in place.
            self.generation += 1;
            let old_print = self.sets[from as usize].print;
            if self.by_print.get(&old_print) == Some(&from) {
                self.by_print.remove(&old_print);
            }
            let set = &mut self.sets[from as usize];
            let empty = if add {
                set.rows.insert(row, tier, rows);
                false
            } else {
                set.rows.remove(row, tier)
            };
            set.print = print;
            if empty {
                return NONE;
            }
            if let Some(&other) = self.by_print.get(&print) {
                if self.sets[other as usize].rows.same_rows(&self.sets[from as usize].rows) {
                    return other;
                }
            } else {
                self.by_print.insert(print, from);
            }
            return from;
        }
        let mut next = match from {
            NONE => RowSet::new(),
            id => self.sets[id as usize].rows.clone(),
        };
        let empty = if add {
            next.insert(row, tier, rows);
            false
        } else {
            next.remove(row, tier)
        };
        let to = if empty {
            NONE
        } else {
            match self.by_print.get(&print).copied() {
                Some(other) if self.sets[other as usize].rows.same_rows(&next) => other,
                found => {
                    let id = self.allocate(next, print);
                    if found.is_none() {
                        self.by_print.insert(print, id);
                    }
                    id
                }
            }
        };
        self.remembered[slot] = Transition {
            generation: self.generation,
            from,
            row,
            tier,
            add,
            to,
        };
        to
    }

    fn allocate(&mut self, rows: RowSet, print: u64) -> u32 {
        let set = SharedSet { rows, print, blocks: 0 };
        match self.free.pop() {
            Some(id) => {
                self.sets[id as usize] = set;
                id
            }
            None => {
                self.sets.push(set);
                u32::try_from(self.sets.len() - 1).expect("fewer distinct row sets than blocks")
            }
        }
    }

    /// `blocks` blocks fewer name `id`; frees it when none does.
    fn release(&mut self, id: u32, blocks: u32) {
        let set = &mut self.sets[id as usize];
        set.blocks -= blocks;
        if set.blocks > 0 {
            return;
        }
        let print = set.print;
        set.rows = RowSet::new();
        if self.by_print.get(&print) == Some(&id) {
            self.by_print.remove(&print);
        }
        // Remembered changes may name `id`, as their start or their result.
        self.generation += 1;
        self.free.push(id);
    }
}

/// The fingerprint key of `row` holding a block in `tier` (murmur3's 64-bit
/// finaliser of the entry).
fn entry_key(row: u32, tier: u8) -> u64 {
    let mut k = (u64::from(row) << 2 | u64::from(tier.trailing_zeros())) + 1;
    k = (k ^ (k >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    k = (k ^ (k >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

#[cfg(test)]
impl BlockRows {
    /// Panics unless every live set's fingerprint is its rows', its count
    /// is the blocks naming it, and no two live sets the fingerprint table
    /// names hold the same rows.
    pub(crate) fn check(&self) {
        let sets = &self.sets;
        let mut named = vec![0u32; sets.sets.len()];
        for (_, id) in self.blocks.iter() {
            named[id as usize] += 1;
        }
        for (id, set) in sets.sets.iter().enumerate() {
            assert_eq!(set.blocks, named[id], "set {id}: blocks naming it");
            if set.blocks == 0 {
                assert!(sets.free.contains(&(id as u32)), "set {id} unused but not free");
                continue;
            }
            let print = set.rows.entries().fold(0, |acc, e| {
                (0..3)
                    .filter(|t| e & (1 << t) != 0)
                    .fold(acc, |acc, t| acc ^ entry_key(e >> 3, 1 << t))
            });
            assert_eq!(set.print, print, "set {id}: fingerprint");
        }
        for (&print, &id) in &sets.by_print {
            let set = &sets.sets[id as usize];
            assert!(
                set.blocks > 0 && set.print == print,
                "fingerprint table names set {id} wrongly"
            );
        }
        for (a, x) in sets.sets.iter().enumerate().filter(|(_, s)| s.blocks > 0) {
            for (b, y) in sets.sets.iter().enumerate().skip(a + 1).filter(|(_, s)| s.blocks > 0) {
                assert!(
                    x.print != y.print || !x.rows.same_rows(&y.rows),
                    "sets {a} and {b} hold the same rows"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::rows::{DEVICE, DISK, HOST};
    use super::*;

    /// Blocks held by the same rows share one set however they got there:
    /// in one run, in runs apart, by rows added in another order, and after
    /// rows leave again.
    #[test]
    fn blocks_with_the_same_rows_share_one_set() {
        let mut t = BlockRows::default();
        for b in 0..64 {
            t.insert(b, 250, DEVICE, 16);
        }
        t.check();
        assert_eq!(t.distinct_sets(), 1);
        // A second run of the same row, after other changes cleared the
        // last transition: found by fingerprint.
        t.insert(1000, 3, HOST, 16);
        t.remove(1000, 3, HOST);
        for b in 64..96 {
            t.insert(b, 250, DEVICE, 16);
        }
        t.check();
        assert_eq!(t.distinct_sets(), 1);
        assert!(std::ptr::eq(t.get(&0).unwrap(), t.get(&95).unwrap()));
        // Rows 1..=200 join blocks 0..32 in one order and blocks 32..64 in
        // the reverse order; the sets turn dense on the way.
        for r in 1..=200 {
            for b in 0..32 {
                t.insert(b, r, DEVICE, 256);
            }
        }
        for r in (1..=200).rev() {
            for b in 32..64 {
                t.insert(b, r, DEVICE, 256);
            }
        }
        t.check();
        assert!(t.get(&0).unwrap().is_dense());
        assert!(std::ptr::eq(t.get(&0).unwrap(), t.get(&63).unwrap()));
        assert_eq!(t.distinct_sets(), 2);
        // They leave blocks 0..64 again: back to the first set (dense, yet
        // the same rows as the sparse one of blocks 64..96).
        for r in 1..=200 {
            for b in 0..64 {
                t.remove(b, r, DEVICE);
            }
        }
        t.check();
        assert!(std::ptr::eq(t.get(&0).unwrap(), t.get(&80).unwrap()));
        assert_eq!(t.distinct_sets(), 1);
        // Tiers are part of a set.
        t.insert(5, 250, DISK, 16);
        t.check();
        assert!(!std::ptr::eq(t.get(&5).unwrap(), t.get(&6).unwrap()));
        for b in 0..96 {
            t.remove(b, 250, DEVICE);
        }
        t.check();
        assert_eq!(t.len(), 1);
        assert_eq!(t.get(&5).unwrap().tiers(250), DISK);
    }

    /// The remembered last change is only reused for the same change of the
    /// same set: not for the opposite change, not once its set was freed
    /// and its id given to other rows, not once its result changed in place.
    #[test]
    fn the_last_change_is_reused_only_while_it_holds() {
        // Opposite change: blocks 0..3 hold rows {1, 2}; removing row 2
        // from block 0 must not make adding it to block 1 a removal.
        let mut t = BlockRows::default();
        for b in 0..3 {
            t.insert(b, 1, DEVICE, 64);
            t.insert(b, 2, DEVICE, 64);
        }
        t.remove(0, 2, DEVICE);
        t.insert(1, 2, DEVICE, 64);
        assert_eq!(t.get(&1).unwrap().tiers(2), DEVICE);
        t.check();

        // Freed and reused: blocks 0, 1 hold {1}; both gain row 5 (the set
        // {1} is freed); block 2's new set {9} takes the freed id and then
        // gains row 5: {5, 9}, not {1, 5}.
        let mut t = BlockRows::default();
        for b in 0..2 {
            t.insert(b, 1, DEVICE, 64);
        }
        t.insert(0, 5, DEVICE, 64);
        t.insert(1, 5, DEVICE, 64);
        t.insert(2, 9, DEVICE, 64);
        t.insert(2, 5, DEVICE, 64);
        assert_eq!(t.get(&2).unwrap().tiers(1), 0);
        assert_eq!(t.get(&2).unwrap().tiers(9), DEVICE);
        t.check();

        // Freed through a remembered change: blocks 0..3 hold {1}; blocks 0
        // and 1 gain row 2 ({1, 2}), then row 3, the second time through the
        // remembered change, which frees {1, 2}; block 2 gaining row 2 must
        // not reuse the remembered, freed {1, 2}.
        let mut t = BlockRows::default();
        for b in 0..3 {
            t.insert(b, 1, DEVICE, 64);
        }
        t.insert(0, 2, DEVICE, 64);
        t.insert(1, 2, DEVICE, 64);
        t.insert(0, 3, DEVICE, 64);
        t.insert(1, 3, DEVICE, 64);
        t.insert(2, 2, DEVICE, 64);
        assert_eq!(t.get(&2).unwrap().tiers(1), DEVICE);
        assert_eq!(t.get(&2).unwrap().tiers(2), DEVICE);
        t.check();

        // Changed in place: blocks 0..3 hold {1}; block 0 gains row 5 (a
        // new set only block 0 names), then row 7 in place; block 1
        // gaining row 5 gets {1, 5}, not {1, 5, 7}.
        let mut t = BlockRows::default();
        for b in 0..3 {
            t.insert(b, 1, DEVICE, 64);
        }
        t.insert(0, 5, DEVICE, 64);
        t.insert(0, 7, DEVICE, 64);
        t.insert(1, 5, DEVICE, 64);
        assert_eq!(t.get(&1).unwrap().tiers(7), 0);
        assert_eq!(t.get(&0).unwrap().tiers(7), DEVICE);
        t.check();
    }

    /// Random changes against a plain map of sets: same rows for every
    /// block, and the table's invariants after every step.
    #[test]
    fn random_changes_match_plain_sets() {
        use std::collections::BTreeMap;
        let mut seed = 0x5eed_u64;
        let mut next = move |n: u64| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        let mut t = BlockRows::default();
        let mut plain: BTreeMap<u64, BTreeMap<u32, u8>> = BTreeMap::new();
        for step in 0..6_000 {
            let (block, row) = (next(24), next(12) as u32);
            let tier = [DEVICE, HOST, DISK][next(3) as usize];
            // Runs: the same change over neighbouring blocks.
            let run = 1 + next(6);
            let add = next(5) < 3;
            if add && next(2) == 0 {
                // The run at once (a block of it sometimes twice), as a
                // stored run's blocks go onto their row.
                let mut blocks: Vec<u64> = (block..block + run).collect();
                if next(3) == 0 {
                    blocks.push(blocks[next(run) as usize]);
                }
                // The blocks the row holds in the tier already, in order (a
                // block twice in the run: the second time).
                let mut expected = Vec::new();
                for &b in &blocks {
                    let tiers = plain.entry(b).or_default().entry(row).or_default();
                    if *tiers & tier != 0 {
                        expected.push(b);
                    }
                    *tiers |= tier;
                }
                let mut reported = Vec::new();
                t.insert_all(&blocks, row, tier, 12, |b| reported.push(b));
                assert_eq!(reported, expected, "step {step}: blocks held already");
            } else {
                for b in block..block + run {
                    let tiers = plain.entry(b).or_default().entry(row).or_default();
                    if add {
                        assert_eq!(t.insert(b, row, tier, 12), *tiers & tier != 0, "step {step}");
                        *tiers |= tier;
                    } else {
                        t.remove(b, row, tier);
                        *tiers &= !tier;
                    }
                    plain.values_mut().for_each(|m| m.retain(|_, v| *v != 0));
                    plain.retain(|_, m| !m.is_empty());
                }
            }
            if step % 97 == 0 {
                t.check();
            }
            for (b, rows) in plain.range(block..block + run) {
                let set = t.get(b).unwrap_or_else(|| panic!("step {step}: block {b} lost"));
                for r in 0..12 {
                    assert_eq!(
                        set.tiers(r),
                        rows.get(&r).copied().unwrap_or(0),
                        "step {step} block {b} row {r}"
                    );
                }
            }
            assert_eq!(t.len(), plain.len(), "step {step}");
            if step % 50 == 0 {
                for (b, rows) in &plain {
                    let set = t.get(b).expect("held");
                    assert!(
                        rows.iter().all(|(&r, &tiers)| set.tiers(r) == tiers),
                        "step {step} block {b}"
                    );
                }
            }
        }
        t.check();
    }
}
