//! How events, row changes and the bounds change the index's state: a
//! rank's blocks onto and off its row, stores, removals, clears, new
//! incarnations, eviction, and the ranks awaiting a row.
//!
//! Every path keeps three things true: a rank with a row has each
//! `(sequence hash, tier)` it holds (under any engine hash) on that row,
//! and nothing else; [`KvIndex::held`] is the sum of the ranks' blocks;
//! a rank without a row is in the queue of ranks awaiting one.

use std::time::Instant;

use super::event::{KvEvent, KvEventError, StoredBlock};
use super::hash::next_sequence_hash;
use super::ranks::{add_alias, unref, HeldBlock};
use super::rows::{DEVICE, DISK, HOST};
use super::{Awaiting, KvIndex, FIRST_ROOM_AWAITING, RANK_FIRST_ROOM, STRIDE};
use crate::types::WorkerWithDpRank;

/// The three tier bits.
const TIER_BITS: [u8; 3] = [DEVICE, HOST, DISK];

impl KvIndex {
    pub(super) fn store(
        &mut self,
        rank: WorkerWithDpRank,
        event: &KvEvent<'_>,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), KvEventError> {
        let (worker_id, dp_rank, event_id) = (rank.worker_id, rank.dp_rank, event.event_id);
        let tier = event.tier.bit();
        if self.max_blocks != usize::MAX && blocks.len() > self.max_blocks {
            return Err(KvEventError::TooManyBlocks {
                worker_id,
                dp_rank,
                event_id,
                blocks: blocks.len(),
                max_blocks: self.max_blocks,
            });
        }
        if let Some(parent) = parent {
            if blocks.iter().any(|b| b.block_hash == parent) {
                return Err(KvEventError::SelfParent {
                    worker_id,
                    dp_rank,
                    event_id,
                    parent,
                });
            }
        }
        let rows = self.layout.map_or(0, |l| l.rows());
        // What the ranks hold, and how many they are, placed or awaiting a
        // row (read only while this one holds nothing, so counts nothing
        // in `held`).
        let (peers_hold, placed, awaiting) = (self.held, self.placed, self.awaiting_count);
        let few_awaiting = awaiting <= FIRST_ROOM_AWAITING;
        let bounded = self.max_blocks != usize::MAX;
        let state = self.ranks.get_mut(&rank).expect("the rank was created by apply");
        // A parent held in any tier: engines move blocks between tiers and
        // the two tiers' events are not ordered against each other.
        let mut chain = match parent {
            None => None,
            Some(parent) => match state.blocks.get(parent) {
                Some(held) => Some(held.sequence),
                None => {
                    return Err(KvEventError::UnknownParent {
                        worker_id,
                        dp_rank,
                        event_id,
                        parent,
                        blocks: blocks.len(),
                    })
                }
            },
        };
        // One growth of the rank's table for the whole run, if any; on the
        // rank's first, room for a few runs at once, or for what its peers
        // hold (a rank without a row only while few await one: a flood of
        // ranks that never get one takes only what it stores).
        let placed_here = state.row.is_some();
        let first_run = if state.blocks.is_empty() && !blocks.is_empty() && (placed_here || few_awaiting) {
            // The other ranks' average: `held` counts the ranks awaiting a
            // row too, so they count among the peers.
            let peers = placed - usize::from(placed_here) + awaiting - usize::from(state.awaiting != 0);
            RANK_FIRST_ROOM.max(peers_hold / peers.max(1)).min(self.max_blocks)
        } else {
            0
        };
        state.blocks.reserve(blocks.len().max(first_run));
        // The run in strides: first every block's sequence hash, with its
        // slots in the rank's table and the block table asked into cache,
        // then the blocks applied, so that the tables' cache misses overlap
        // instead of coming one after another. The blocks this rank now
        // holds in `tier` go onto its row a stride at a time (in order,
        // before any removal that follows them).
        let mut sequences = [0u64; STRIDE];
        let (mut fresh, mut fresh_len) = ([0u64; STRIDE], 0);
        for stride in blocks.chunks(STRIDE) {
            for (block, slot) in stride.iter().zip(&mut sequences) {
                let sequence = chain.map_or(block.tokens_hash, |p| next_sequence_hash(p, block.tokens_hash));
                chain = Some(sequence);
                *slot = sequence;
                state.blocks.prefetch(block.block_hash);
                if state.row.is_some() {
                    self.blocks.prefetch(sequence);
                }
            }
            for (block, &sequence) in stride.iter().zip(&sequences) {
                let (held, new) = state
                    .blocks
                    .get_or_insert(block.block_hash, HeldBlock::new(sequence, tier, 0));
                if bounded {
                    held.set_stored_at(self.stores);
                    self.coldest.push_back((self.stores, rank, block.block_hash));
                    self.stores += 1;
                }
                if !new {
                    if held.sequence != sequence {
                        // The engine reused a hash for another block: the old
                        // one is gone, every copy of it in every tier.
                        let old = *held;
                        *held = HeldBlock::new(sequence, tier, old.stored_at());
                        if old.has_copies() {
                            state.drop_copies(block.block_hash);
                        }
                        if let Some(row) = state.row {
                            let fresh_now = &fresh[..fresh_len];
                            self.blocks
                                .insert_all(fresh_now, row, tier, rows, |s| add_alias(&mut state.extra, s, tier));
                            fresh_len = 0;
                            for t in TIER_BITS.into_iter().filter(|&t| old.tiers() & t != 0) {
                                unref(&mut state.extra, &mut self.blocks, old.sequence, row, t);
                            }
                        }
                    } else if held.tiers() & tier == 0 {
                        held.set_tiers(held.tiers() | tier);
                    } else {
                        // A copy more of a block the rank holds in the tier.
                        held.set_has_copies(true);
                        state.add_copy(block.block_hash, tier);
                        continue;
                    }
                }
                if state.row.is_some() {
                    fresh[fresh_len] = sequence;
                    fresh_len += 1;
                }
            }
            if let Some(row) = state.row {
                let fresh_now = &fresh[..fresh_len];
                self.blocks
                    .insert_all(fresh_now, row, tier, rows, |s| add_alias(&mut state.extra, s, tier));
                fresh_len = 0;
            }
        }
        Ok(())
    }

    pub(super) fn remove(
        &mut self,
        rank: WorkerWithDpRank,
        event: &KvEvent<'_>,
        hashes: &[u64],
    ) -> Result<(), KvEventError> {
        let tier = event.tier.bit();
        let state = self.ranks.get_mut(&rank).expect("the rank was created by apply");
        let (mut unknown, mut first) = (0usize, None);
        for &hash in hashes {
            let Some(held) = state.blocks.get_mut(hash).filter(|h| h.tiers() & tier != 0) else {
                unknown += 1;
                first.get_or_insert(hash);
                continue;
            };
            if held.has_copies() && state.take_copy(hash, tier) {
                continue; // another copy is left
            }
            let held = state.blocks.get_mut(hash).expect("just seen");
            held.set_tiers(held.tiers() & !tier);
            let (sequence, gone) = (held.sequence, held.tiers() == 0);
            if gone {
                state.blocks.remove(hash);
            }
            if let Some(row) = state.row {
                unref(&mut state.extra, &mut self.blocks, sequence, row, tier);
            }
        }
        state.shrink();
        match first {
            None => Ok(()),
            Some(first) => Err(KvEventError::UnknownBlocks {
                worker_id: rank.worker_id,
                dp_rank: rank.dp_rank,
                event_id: event.event_id,
                tier: event.tier,
                unknown,
                first,
            }),
        }
    }

    /// Drops the rank's blocks in the tiers of `tiers` (bits), every copy
    /// under every engine hash (the caller counts them off `held`).
    pub(super) fn clear_rank(&mut self, rank: WorkerWithDpRank, tiers: u8) {
        let Some(state) = self.ranks.get_mut(&rank) else { return };
        let row = state.row;
        let blocks = &mut self.blocks;
        state.blocks.retain(|_, held| {
            if let Some(row) = row {
                for t in TIER_BITS.into_iter().filter(|&t| held.tiers() & tiers & t != 0) {
                    blocks.remove(held.sequence, row, t);
                }
            }
            held.set_tiers(held.tiers() & !tiers);
            held.tiers() != 0
        });
        state.drop_counts(tiers);
        state.shrink();
    }

    /// Ends the rank's incarnation: its blocks are dropped (the caller
    /// counts them off `held`) and its event ids forgotten.
    pub(super) fn restart(&mut self, rank: WorkerWithDpRank, report: bool) {
        self.clear_rank(rank, 0b111);
        let syncs = self.syncs;
        if let Some(state) = self.ranks.get_mut(&rank) {
            state.last_event = None;
            state.departed = false;
            state.began = syncs;
        }
        self.stats.restarts += 1;
        if report {
            self.counters.restart.increment(1);
        }
    }

    /// Takes the rank's blocks off its row (the rank keeps them).
    fn unindex_rank(&mut self, rank: WorkerWithDpRank) {
        let Some(state) = self.ranks.get_mut(&rank) else { return };
        let Some(row) = state.row.take() else { return };
        self.placed -= 1;
        for (_, held) in state.blocks.iter() {
            for t in TIER_BITS.into_iter().filter(|&t| held.tiers() & t != 0) {
                self.blocks.remove(held.sequence, row, t);
            }
        }
        state.drop_aliases();
    }

    /// Takes a rank off its row before a sync's placements. `back`: `None`
    /// if the rank has no row any more (its worker left, or was removed),
    /// else the tenure it gets a row under (placed by [`place`](Self::place)
    /// after). A rank whose worker left drops its blocks and awaits a row,
    /// marked departed; one whose tenure changed (it left and came back
    /// since the last sync) starts a new incarnation, unless its current
    /// one began since the last sync (the new engine's first events may
    /// arrive before the sync that sees it back).
    pub(super) fn unplace(&mut self, rank: WorkerWithDpRank, back: Option<Option<u64>>, report: bool) {
        let Some(state) = self.ranks.get(&rank) else { return };
        let came_back = back.flatten().zip(state.tenure).is_some_and(|(new, old)| new != old);
        let began_before_last_sync = state.began + 1 < self.syncs;
        self.unindex_rank(rank);
        let held_before = self.ranks.get(&rank).map_or(0, |s| s.blocks.len());
        match back {
            None => {
                let state = self.ranks.get_mut(&rank).expect("seen above");
                if !state.departed {
                    state.departed = true;
                    self.clear_rank(rank, 0b111);
                    self.stats.ranks_removed += 1;
                }
                let state = self.ranks.get_mut(&rank).expect("seen above");
                state.tenure = None;
                if state.awaiting == 0 {
                    self.await_row(rank, report);
                }
            }
            Some(_) if came_back => {
                self.stats.ranks_removed += 1;
                if began_before_last_sync {
                    self.restart(rank, report);
                }
            }
            Some(_) => {}
        }
        let held_after = self.ranks.get(&rank).map_or(0, |s| s.blocks.len());
        self.held -= held_before - held_after;
    }

    /// Puts a rank without a row on `row` (under `tenure`, if known). A
    /// rank marked departed starts a new incarnation first: what it
    /// reported since its worker left was its old engine's.
    pub(super) fn place(&mut self, rank: WorkerWithDpRank, row: u32, tenure: Option<u64>, report: bool) {
        let rows = self.layout.map_or(0, |l| l.rows());
        let Some(state) = self.ranks.get_mut(&rank) else { return };
        debug_assert!(state.row.is_none(), "placing a placed rank");
        if state.awaiting != 0 {
            state.awaiting = 0;
            self.awaiting_count -= 1;
        }
        if state.departed {
            let held = state.blocks.len();
            self.restart(rank, report);
            self.held -= held;
        }
        // The other ranks, placed or awaiting a row (`held` counts both).
        let (held, peers, max_blocks) = (self.held, self.placed + self.awaiting_count, self.max_blocks);
        let state = self.ranks.get_mut(&rank).expect("seen above");
        state.row = Some(row);
        state.tenure = tenure;
        self.placed += 1;
        // A rank that stored blocks while it awaited its row makes the room
        // a placed rank's first run makes (see `RANK_FIRST_ROOM`) now: the
        // other ranks' average, so that a fleet whose ranks all awaited
        // their rows (their engines reported before the first sync) does
        // not make each the room of the whole fleet's blocks.
        let own = state.blocks.len();
        if own > 0 {
            let room = RANK_FIRST_ROOM.max((held - own) / peers.max(1)).min(max_blocks);
            if state.blocks.capacity() < room {
                state.blocks.reserve(room - own);
            }
        }
        // Device blocks a stride at a time, the lower tiers block by block;
        // a block another engine hash of the rank already put on the row
        // is counted as an alias.
        let (mut device, mut n) = ([0u64; STRIDE], 0);
        for (_, held) in state.blocks.iter() {
            if held.tiers() & DEVICE != 0 {
                device[n] = held.sequence;
                n += 1;
                if n == STRIDE {
                    self.blocks
                        .insert_all(&device, row, DEVICE, rows, |s| add_alias(&mut state.extra, s, DEVICE));
                    n = 0;
                }
            }
            for t in [HOST, DISK].into_iter().filter(|&t| held.tiers() & t != 0) {
                if self.blocks.insert(held.sequence, row, t, rows) {
                    add_alias(&mut state.extra, held.sequence, t);
                }
            }
        }
        self.blocks.insert_all(&device[..n], row, DEVICE, rows, |s| {
            add_alias(&mut state.extra, s, DEVICE)
        });
    }

    /// Evicts the blocks stored longest ago until at most `max_blocks` are
    /// held.
    pub(super) fn evict_coldest(&mut self, report: bool) {
        while self.held > self.max_blocks {
            let Some((stored_at, rank, hash)) = self.coldest.pop_front() else {
                break;
            };
            let Some(state) = self.ranks.get_mut(&rank) else {
                continue;
            };
            if state.blocks.get(hash).is_none_or(|h| h.stored_at() != stored_at) {
                continue; // stored again since, or gone
            }
            let held = state.blocks.remove(hash).expect("just seen");
            if held.has_copies() {
                state.drop_copies(hash);
            }
            if let Some(row) = state.row {
                for t in TIER_BITS.into_iter().filter(|&t| held.tiers() & t != 0) {
                    unref(&mut state.extra, &mut self.blocks, held.sequence, row, t);
                }
            }
            state.shrink();
            self.held -= 1;
            self.stats.evicted_blocks += 1;
            if report {
                self.counters.evicted.increment(1);
            }
        }
        // Skipped entries pile up when blocks are stored again or removed:
        // rebuild the queue from the blocks held once it is twice too long.
        if self.max_blocks != usize::MAX && self.coldest.len() > 2 * self.held + 1024 {
            let mut live: Vec<(u64, WorkerWithDpRank, u64)> = self
                .ranks
                .iter()
                .flat_map(|(&rank, state)| state.blocks.iter().map(move |(hash, h)| (h.stored_at(), rank, hash)))
                .collect();
            live.sort_unstable_by_key(|e| e.0);
            self.coldest = live.into();
        }
    }

    /// Queues a rank without a row; past the bound, the rank without a row
    /// longest goes (never the one just queued: the bound is at least 1).
    pub(super) fn await_row(&mut self, rank: WorkerWithDpRank, report: bool) {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        if let Some(state) = self.ranks.get_mut(&rank) {
            state.awaiting = ticket;
        }
        self.awaiting.push_back(Awaiting {
            ticket,
            since: None,
            rank,
        });
        self.awaiting_count += 1;
        while self.awaiting_count > self.max_awaiting {
            let Some(oldest) = self.awaiting.pop_front() else { break };
            if self.is_awaiting(&oldest) {
                self.drop_awaiting(oldest.rank, report);
            }
        }
    }

    fn is_awaiting(&self, entry: &Awaiting) -> bool {
        self.ranks.get(&entry.rank).is_some_and(|s| s.awaiting == entry.ticket)
    }

    /// Drops a rank without a row and its blocks.
    fn drop_awaiting(&mut self, rank: WorkerWithDpRank, report: bool) {
        let Some(state) = self.ranks.remove(&rank) else { return };
        self.held -= state.blocks.len();
        self.awaiting_count -= 1;
        self.stats.awaiting_ranks_dropped += 1;
        if report {
            self.counters.awaiting_dropped.increment(1);
        }
    }

    /// The ranks first without a row since the last sync, oldest first.
    pub(super) fn awaiting_since_last_sync(&self) -> Vec<WorkerWithDpRank> {
        let fresh = self.awaiting.iter().rev().take_while(|e| e.since.is_none()).count();
        let start = self.awaiting.len() - fresh;
        self.awaiting
            .range(start..)
            .filter(|e| self.is_awaiting(e))
            .map(|e| e.rank)
            .collect()
    }

    /// Stamps the ranks first without a row since the last sync with this
    /// sync's time.
    pub(super) fn stamp_awaiting(&mut self, now: Instant) {
        for entry in self.awaiting.iter_mut().rev() {
            if entry.since.is_some() {
                break;
            }
            entry.since = Some(now);
        }
    }

    /// Drops the ranks without a row for the time to live or longer, and
    /// compacts the queue.
    pub(super) fn expire_awaiting(&mut self, now: Instant, report: bool) {
        while let Some(&front) = self.awaiting.front() {
            let valid = self.is_awaiting(&front);
            let expired = front
                .since
                .is_some_and(|since| now.saturating_duration_since(since) >= self.awaiting_ttl);
            if valid && !expired {
                break;
            }
            self.awaiting.pop_front();
            if valid {
                self.drop_awaiting(front.rank, report);
            }
        }
        if self.awaiting.len() > 2 * self.awaiting_count + 64 {
            let live: Vec<Awaiting> = self.awaiting.iter().copied().filter(|e| self.is_awaiting(e)).collect();
            self.awaiting = live.into();
        }
        self.shrink_ranks();
    }

    /// Gives the rank map's memory back once most ranks are gone.
    pub(super) fn shrink_ranks(&mut self) {
        let (len, capacity) = (self.ranks.len(), self.ranks.capacity());
        if capacity > 64 && len < capacity / 8 {
            self.ranks.shrink_to(2 * len);
        }
    }
}
