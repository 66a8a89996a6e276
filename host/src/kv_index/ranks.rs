//! One worker rank's view of its cache: its blocks by engine hash, the
//! copies and aliases among them, its place in the fleet, and the rules
//! its event ids follow.
//!
//! This module holds a rank's own state; how a rank's blocks reach the
//! rows is the index's (`super`).

use rustc_hash::FxHashMap;

use super::block_rows::BlockRows;
use selkie_kernel::table::HashIndex;

/// The largest step between two consecutive event ids of a rank that the
/// index believes (2³²: more events than an engine could lose). An id
/// further ahead is refused ([`KvEventError::EventIdJump`](super::KvEventError::EventIdJump));
/// an id further behind starts a new incarnation, as an engine whose ids
/// start again does.
pub const MAX_EVENT_ID_JUMP: u64 = 1 << 32;

/// The tier bits of a [`HeldBlock`]'s stamp.
const TIERS: u64 = 0b111;
/// The stamp bit saying the block has extra copies in some tier.
const COPIES: u64 = 0b1000;
/// The stamp bits below `stored_at`.
const STAMP_SHIFT: u32 = 4;

/// A block a rank holds under one engine hash: its sequence hash, the
/// tiers it is in, whether it has extra copies, and when the rank last
/// stored it (a store counter, for eviction), the last three packed in one
/// word (16 bytes in all: the per-rank tables hold one per block per
/// rank).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct HeldBlock {
    pub(super) sequence: u64,
    /// `stored_at << 4 | COPIES? | tiers`.
    stamp: u64,
}

impl HeldBlock {
    pub(super) fn new(sequence: u64, tiers: u8, stored_at: u64) -> Self {
        HeldBlock {
            sequence,
            stamp: stored_at << STAMP_SHIFT | u64::from(tiers),
        }
    }

    pub(super) fn tiers(&self) -> u8 {
        (self.stamp & TIERS) as u8
    }

    pub(super) fn set_tiers(&mut self, tiers: u8) {
        self.stamp = self.stamp & !TIERS | u64::from(tiers);
    }

    /// Whether the rank may hold extra copies of the block (a hint: set
    /// when a copy was added, cleared when the last one went).
    pub(super) fn has_copies(&self) -> bool {
        self.stamp & COPIES != 0
    }

    pub(super) fn set_has_copies(&mut self, copies: bool) {
        self.stamp = if copies {
            self.stamp | COPIES
        } else {
            self.stamp & !COPIES
        };
    }

    /// The store counter when the rank last stored the block (60 bits: at
    /// a billion stores a second, 36 years).
    pub(super) fn stored_at(&self) -> u64 {
        self.stamp >> STAMP_SHIFT
    }

    pub(super) fn set_stored_at(&mut self, stored_at: u64) {
        self.stamp = stored_at << STAMP_SHIFT | (self.stamp & (TIERS | COPIES));
    }
}

/// The counts a rank rarely needs, allocated when first needed and freed
/// when empty.
#[derive(Debug, Default)]
pub(super) struct Extra {
    /// `(engine hash, tier bit)` -> copies beyond the first: an engine
    /// that caches a block twice stores it twice and removes each copy.
    copies: FxHashMap<(u64, u8), u32>,
    /// While the rank has a row: `(sequence hash, tier bit)` -> engine
    /// hashes beyond the first that hold it in that tier (the row holds
    /// the block until the last of them goes).
    aliases: FxHashMap<(u64, u8), u32>,
}

/// One worker rank's state.
#[derive(Debug, Default)]
pub(super) struct RankBlocks {
    /// The rank's row in the synced layout.
    pub(super) row: Option<u32>,
    /// The tenure it was placed under, when the sync's answers carry one.
    pub(super) tenure: Option<u64>,
    /// Its worker left the fleet after this incarnation began: the blocks
    /// it reports are dropped when the worker returns, unless a new
    /// incarnation (event id 0) began since it left.
    pub(super) departed: bool,
    /// The last event id applied in this incarnation.
    pub(super) last_event: Option<u64>,
    /// The index's sync count when this incarnation began.
    pub(super) began: u64,
    /// While the rank has no row: its ticket in the index's queue of ranks
    /// awaiting one (0: none).
    pub(super) awaiting: u64,
    /// Engine hash -> block: a dense table (grown past 7/8 full), as only
    /// events read it.
    pub(super) blocks: HashIndex<HeldBlock, true>,
    pub(super) extra: Option<Box<Extra>>,
}

/// What an event id means for a rank (see [`check_event_id`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EventOrder {
    /// The rank's first event in this incarnation.
    First,
    /// The next event.
    Next,
    /// `missing` events were lost.
    Gap { missing: u64 },
    /// At or below the last one: a duplicate or a late event.
    Stale { last: u64 },
    /// A new incarnation: id 0, or an id far below the last.
    Restart,
    /// Too far ahead to be believed.
    Jump { last: u64 },
}

/// The rules of a rank's event ids (see the module documentation of the
/// index): consecutive within an incarnation; 0, or an id more than
/// [`MAX_EVENT_ID_JUMP`] below the last, starts a new one; an id more than
/// that above the last is not believed.
pub(super) fn check_event_id(last: Option<u64>, id: u64) -> EventOrder {
    let Some(last) = last else {
        return EventOrder::First;
    };
    if id == 0 {
        return EventOrder::Restart;
    }
    if id > last {
        return match id - last {
            1 => EventOrder::Next,
            step if step > MAX_EVENT_ID_JUMP => EventOrder::Jump { last },
            step => EventOrder::Gap { missing: step - 1 },
        };
    }
    if last - id > MAX_EVENT_ID_JUMP {
        EventOrder::Restart
    } else {
        EventOrder::Stale { last }
    }
}

/// `sequence` in `tier` is held by one more engine hash of a rank than the
/// one that put it on the rank's row (`extra`: the rank's rare counts).
pub(super) fn add_alias(extra: &mut Option<Box<Extra>>, sequence: u64, tier: u8) {
    *extra
        .get_or_insert_with(Box::default)
        .aliases
        .entry((sequence, tier))
        .or_insert(0) += 1;
}

/// An engine hash of a rank holding `sequence` in `tier` is gone (`extra`:
/// the rank's rare counts): the rank's `row` keeps the block while another
/// engine hash holds it, else the block is taken off the row.
pub(super) fn unref(extra: &mut Option<Box<Extra>>, blocks: &mut BlockRows, sequence: u64, row: u32, tier: u8) {
    if let Some(counts) = extra.as_mut() {
        if let Some(n) = counts.aliases.get_mut(&(sequence, tier)) {
            *n -= 1;
            if *n == 0 {
                counts.aliases.remove(&(sequence, tier));
                if counts.copies.is_empty() && counts.aliases.is_empty() {
                    *extra = None;
                }
            }
            return;
        }
    }
    blocks.remove(sequence, row, tier);
}

impl RankBlocks {
    /// A rank first seen at sync count `syncs`.
    pub(super) fn new(syncs: u64) -> Self {
        RankBlocks {
            began: syncs,
            ..RankBlocks::default()
        }
    }

    fn extra(&mut self) -> &mut Extra {
        self.extra.get_or_insert_with(Box::default)
    }

    /// Frees the rare counts once none is left.
    fn tidy_extra(&mut self) {
        if self
            .extra
            .as_ref()
            .is_some_and(|e| e.copies.is_empty() && e.aliases.is_empty())
        {
            self.extra = None;
        }
    }

    /// One more copy of `hash` in `tier` (held there already). The count
    /// saturates (at 2³² copies, more than any engine's cache holds).
    pub(super) fn add_copy(&mut self, hash: u64, tier: u8) {
        let copies = self.extra().copies.entry((hash, tier)).or_insert(0);
        *copies = copies.saturating_add(1);
    }

    /// Takes one extra copy of `hash` in `tier`; `false` if it had none
    /// (the copy removed is the block's last in that tier).
    pub(super) fn take_copy(&mut self, hash: u64, tier: u8) -> bool {
        let Some(extra) = self.extra.as_mut() else {
            return false;
        };
        let Some(n) = extra.copies.get_mut(&(hash, tier)) else {
            return false;
        };
        *n -= 1;
        if *n == 0 {
            extra.copies.remove(&(hash, tier));
            let more = [1u8, 2, 4].iter().any(|&t| extra.copies.contains_key(&(hash, t)));
            if !more {
                if let Some(held) = self.blocks.get_mut(hash) {
                    held.set_has_copies(false);
                }
            }
            self.tidy_extra();
        }
        true
    }

    /// Drops every extra copy of `hash`.
    pub(super) fn drop_copies(&mut self, hash: u64) {
        if let Some(extra) = self.extra.as_mut() {
            for t in [1u8, 2, 4] {
                extra.copies.remove(&(hash, t));
            }
            self.tidy_extra();
        }
    }

    /// Drops the counts of every block in the tiers of `tiers` (bits).
    pub(super) fn drop_counts(&mut self, tiers: u8) {
        if let Some(extra) = self.extra.as_mut() {
            extra.copies.retain(|&(_, t), _| t & tiers == 0);
            extra.aliases.retain(|&(_, t), _| t & tiers == 0);
            if tiers == 0b111 {
                self.extra = None;
            } else {
                self.tidy_extra();
            }
        }
    }

    /// Drops the aliases (the rank leaves its row).
    pub(super) fn drop_aliases(&mut self) {
        if let Some(extra) = self.extra.as_mut() {
            extra.aliases = FxHashMap::default();
            self.tidy_extra();
        }
    }

    /// Gives memory back once most of the rank's blocks are gone, keeping
    /// the room a placed rank makes at its first run.
    pub(super) fn shrink(&mut self) {
        let keep = if self.row.is_some() { super::RANK_FIRST_ROOM } else { 0 };
        self.blocks.shrink(keep);
    }

    /// Heap bytes of the rank's tables (the rare counts estimated: one
    /// control byte per slot).
    pub(super) fn heap_bytes(&self) -> usize {
        let counts = self.extra.as_ref().map_or(0, |e| {
            let entry = std::mem::size_of::<((u64, u8), u32)>() + 1;
            std::mem::size_of::<Extra>() + (e.copies.capacity() + e.aliases.capacity()) * entry
        });
        self.blocks.heap_bytes() + counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_ids_are_consecutive_within_an_incarnation() {
        use EventOrder::*;
        assert_eq!(check_event_id(None, 77), First);
        assert_eq!(check_event_id(None, u64::MAX), First);
        assert_eq!(check_event_id(Some(4), 5), Next);
        assert_eq!(check_event_id(Some(4), 8), Gap { missing: 3 });
        assert_eq!(check_event_id(Some(4), 4), Stale { last: 4 });
        assert_eq!(check_event_id(Some(4), 1), Stale { last: 4 });
        assert_eq!(check_event_id(Some(4), 0), Restart);
        assert_eq!(check_event_id(Some(0), 0), Restart);
        let far = MAX_EVENT_ID_JUMP;
        assert_eq!(check_event_id(Some(4), 4 + far), Gap { missing: far - 1 });
        assert_eq!(check_event_id(Some(4), 5 + far), Jump { last: 4 });
        assert_eq!(check_event_id(Some(4), u64::MAX), Jump { last: 4 });
        assert_eq!(check_event_id(Some(u64::MAX), 44), Restart);
        assert_eq!(check_event_id(Some(far + 5), 5), Stale { last: far + 5 });
        assert_eq!(check_event_id(Some(far + 5), 4), Restart);
        assert_eq!(check_event_id(Some(u64::MAX - 1), u64::MAX), Next);
    }

    #[test]
    fn a_stamp_keeps_its_fields_apart() {
        let mut b = HeldBlock::new(9, 0b101, (1 << 60) - 1);
        assert_eq!(
            (b.tiers(), b.has_copies(), b.stored_at()),
            (0b101, false, (1 << 60) - 1)
        );
        b.set_has_copies(true);
        b.set_tiers(0b010);
        assert_eq!((b.tiers(), b.has_copies(), b.stored_at()), (0b010, true, (1 << 60) - 1));
        b.set_stored_at(3);
        b.set_has_copies(false);
        assert_eq!((b.tiers(), b.has_copies(), b.stored_at()), (0b010, false, 3));
    }
}
