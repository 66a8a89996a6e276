//! Harness of the `kv_index_model` fuzz target, shared with the regression
//! replay in `host/tests/fuzz_regressions.rs`.
//!
//! Random sequences of engine KV events (stores under held, unknown or
//! self-naming parents, removals with unknown blocks, clears, in all three
//! tiers, with event ids that skip or repeat), fleet changes (workers
//! joining and leaving the service, `remove_worker` on the index) and
//! queries, applied to a plain [`KvIndex`] and to a [`shared`] one (whose
//! copies have their block table reserved for 24 blocks, 32 slots, which
//! inputs holding more blocks fill and grow past), against a plain model:
//! every event's outcome (applied, or which error) equals the model's, and
//! every query's device / host / disk overlap of every row equals the
//! model's for the rank on that row (0 on rows of no rank), on both
//! indexes.

use std::collections::HashMap;

use arbitrary::Arbitrary;
use selkie::kv_index::*;
use selkie::*;

/// Distinct blocks the shared index's block tables are reserved for: fewer
/// than the prompts hold (16, and 13, 10 and 7 more in the prompts sharing
/// prompt 0's first blocks, and more again stored under other parents).
const RESERVED_BLOCKS: usize = 24;

/// Workers 0..WORKERS, each with two ranks.
pub const WORKERS: u8 = 12;
/// Prompts of BLOCKS blocks; prompt `p > 0` shares its first `p * 3` blocks
/// with prompt 0.
pub const PROMPTS: u8 = 4;
pub const BLOCKS: u8 = 16;

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Op {
    /// Blocks `from..from + len` of a prompt, under the previous block (or
    /// under `parent` when set: a block elsewhere, maybe unknown).
    Store {
        worker: u8,
        rank: u8,
        tier: u8,
        id_step: u8,
        prompt: u8,
        from: u8,
        len: u8,
        parent: Option<u8>,
        self_parent: bool,
    },
    Remove {
        worker: u8,
        rank: u8,
        tier: u8,
        id_step: u8,
        prompt: u8,
        from: u8,
        len: u8,
        unknown: bool,
    },
    Clear {
        worker: u8,
        rank: u8,
        tier: u8,
        id_step: u8,
    },
    Join {
        worker: u8,
    },
    Leave {
        worker: u8,
    },
    Forget {
        worker: u8,
    },
    Query {
        prompt: u8,
        len: u8,
        change: Option<u8>,
    },
}

#[derive(Arbitrary, Debug, Clone)]
pub struct Input {
    pub ops: Vec<Op>,
}

fn tier(t: u8) -> StorageTier {
    [StorageTier::Device, StorageTier::Host, StorageTier::Disk][usize::from(t % 3)]
}

fn bit(t: StorageTier) -> u8 {
    match t {
        StorageTier::Device => 1,
        StorageTier::Host => 2,
        StorageTier::Disk => 4,
    }
}

fn local(prompt: u8, block: u8) -> u64 {
    let owner = if u16::from(block) < u16::from(prompt) * 3 {
        0
    } else {
        prompt
    };
    0x1000 + u64::from(owner) * 0x100 + u64::from(block)
}

/// The engine hash of a block: a function of its sequence hash.
fn engine(seq: u64) -> u64 {
    seq.rotate_left(17) ^ 0xa5a5
}

fn sequence(prompt: u8, upto: u8) -> Vec<u64> {
    let locals: Vec<u64> = (0..upto).map(|b| local(prompt, b)).collect();
    let mut seqs = Vec::new();
    sequence_hashes_of(&locals, &mut seqs);
    seqs
}

#[derive(Default)]
struct RankModel {
    last: Option<u64>,
    placed: bool,
    /// Engine hash -> (sequence hash, tiers).
    held: HashMap<u64, (u64, u8)>,
}

#[derive(Default)]
struct Model {
    ranks: HashMap<WorkerWithDpRank, RankModel>,
    in_fleet: [bool; WORKERS as usize],
}

impl Model {
    /// What the index answers (`Ok` or the error's label).
    fn apply(
        &mut self,
        rank: WorkerWithDpRank,
        id: u64,
        t: StorageTier,
        data: &KvEventData<'_>,
    ) -> Result<(), &'static str> {
        let state = self.ranks.entry(rank).or_default();
        let mut gap = false;
        if let Some(last) = state.last {
            if id <= last {
                return Err("stale_event");
            }
            gap = id != last + 1;
        }
        state.last = Some(id);
        if gap {
            state.held.clear();
        }
        let b = bit(t);
        let outcome = match *data {
            KvEventData::Stored { parent, blocks } => {
                if parent.is_some_and(|p| blocks.iter().any(|x| x.block_hash == p)) {
                    Err("self_parent")
                } else {
                    let need = if t == StorageTier::Device { 1 } else { 7 };
                    match parent.map(|p| state.held.get(&p).filter(|h| h.1 & need != 0).map(|h| h.0)) {
                        Some(None) => Err("unknown_parent"),
                        chain => {
                            let mut chain = chain.flatten();
                            for x in blocks {
                                let seq = chain.map_or(x.tokens_hash, |p| next_sequence_hash(p, x.tokens_hash));
                                chain = Some(seq);
                                let e = state.held.entry(x.block_hash).or_insert((seq, 0));
                                if e.0 != seq {
                                    *e = (seq, 0);
                                }
                                e.1 |= b;
                            }
                            Ok(())
                        }
                    }
                }
            }
            KvEventData::Removed { blocks } => {
                let mut ok = true;
                for h in blocks {
                    match state.held.get_mut(h) {
                        Some(e) if e.1 & b != 0 => {
                            e.1 &= !b;
                            if e.1 == 0 {
                                state.held.remove(h);
                            }
                        }
                        _ => ok = false,
                    }
                }
                if ok {
                    Ok(())
                } else {
                    Err("unknown_blocks")
                }
            }
            KvEventData::Cleared => {
                state.held.retain(|_, e| {
                    e.1 &= !b;
                    e.1 != 0
                });
                Ok(())
            }
        };
        if gap {
            Err("event_gap")
        } else {
            outcome
        }
    }

    /// A sync: ranks in the fleet are placed, placed ranks outside it are dropped.
    fn sync(&mut self) {
        let in_fleet = self.in_fleet;
        self.ranks.retain(|rank, state| {
            if in_fleet[rank.worker_id as usize] {
                state.placed = true;
                true
            } else {
                !state.placed
            }
        });
    }

    fn overlap(&self, rank: WorkerWithDpRank, seqs: &[u64]) -> (u32, u32, u32) {
        let Some(state) = self.ranks.get(&rank) else {
            return (0, 0, 0);
        };
        let holds = |s: u64, b: u8| state.held.values().any(|&(q, t)| q == s && t & b != 0);
        let mut i = 0;
        let mut run = |b: u8| {
            let start = i;
            while i < seqs.len() && holds(seqs[i], b) {
                i += 1;
            }
            (i - start) as u32
        };
        (run(1), run(2), run(4))
    }
}

fn label(r: &Result<(), KvEventError>) -> Result<(), &'static str> {
    r.as_ref().map(|_| ()).map_err(KvEventError::as_str)
}

pub fn check(input: &Input) {
    let service = WorkerSelectionService::new(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        ServiceConfig::default(),
    );
    let mut plain = KvIndex::new(16);
    let (mut writer, reader) = shared_with(|| KvIndex::new(16).with_block_capacity(RESERVED_BLOCKS));
    let mut model = Model::default();
    let mut ids: HashMap<WorkerWithDpRank, u64> = HashMap::new();
    let (mut out, mut shared_out) = (KvOverlaps::new(), KvOverlaps::new());
    for op in input.ops.iter().take(400) {
        let event_rank = |worker: u8, rank: u8| WorkerWithDpRank::new(u64::from(worker % WORKERS), u32::from(rank % 2));
        let mut next_id = |rank: WorkerWithDpRank, step: u8| {
            let id = ids.entry(rank).or_insert(0);
            // Mostly the next id; sometimes a repeat (0) or a skip.
            *id = match step % 8 {
                0 => *id,
                1 => *id + 2 + u64::from(step / 8),
                _ => *id + 1,
            };
            *id
        };
        match *op {
            Op::Store {
                worker,
                rank,
                tier: t,
                id_step,
                prompt,
                from,
                len,
                parent,
                self_parent,
            } => {
                let (rank, t, prompt) = (event_rank(worker, rank), tier(t), prompt % PROMPTS);
                let from = from % BLOCKS;
                let to = (from + 1 + len % 4).min(BLOCKS);
                let seqs = sequence(prompt, to);
                let mut blocks: Vec<StoredBlock> = (from..to)
                    .map(|b| StoredBlock {
                        block_hash: engine(seqs[usize::from(b)]),
                        tokens_hash: local(prompt, b),
                    })
                    .collect();
                let parent = match parent {
                    Some(other) if other % 4 == 0 => Some(0xdead),
                    Some(other) => {
                        let p = other % PROMPTS;
                        let b = other % BLOCKS;
                        Some(engine(sequence(p, b + 1)[usize::from(b)]))
                    }
                    None => (from > 0).then(|| engine(seqs[usize::from(from) - 1])),
                };
                if self_parent {
                    if let Some(p) = parent {
                        blocks.push(StoredBlock {
                            block_hash: p,
                            tokens_hash: 1,
                        });
                    }
                }
                let id = next_id(rank, id_step);
                let data = KvEventData::Stored {
                    parent,
                    blocks: &blocks,
                };
                let event = KvEvent::new(rank, id, data).in_tier(t);
                let expected = model.apply(rank, id, t, &data);
                assert_eq!(label(&plain.apply(&event)), expected, "{event:?}");
                assert_eq!(label(&writer.apply(&event)), expected, "{event:?} (shared)");
            }
            Op::Remove {
                worker,
                rank,
                tier: t,
                id_step,
                prompt,
                from,
                len,
                unknown,
            } => {
                let (rank, t, prompt) = (event_rank(worker, rank), tier(t), prompt % PROMPTS);
                let from = from % BLOCKS;
                let to = (from + 1 + len % 4).min(BLOCKS);
                let seqs = sequence(prompt, to);
                let mut hashes: Vec<u64> = (from..to).map(|b| engine(seqs[usize::from(b)])).collect();
                if unknown {
                    hashes.push(0xbeef);
                }
                let id = next_id(rank, id_step);
                let data = KvEventData::Removed { blocks: &hashes };
                let event = KvEvent::new(rank, id, data).in_tier(t);
                let expected = model.apply(rank, id, t, &data);
                assert_eq!(label(&plain.apply(&event)), expected, "{event:?}");
                assert_eq!(label(&writer.apply(&event)), expected, "{event:?} (shared)");
            }
            Op::Clear {
                worker,
                rank,
                tier: t,
                id_step,
            } => {
                let (rank, t) = (event_rank(worker, rank), tier(t));
                let id = next_id(rank, id_step);
                let event = KvEvent::new(rank, id, KvEventData::Cleared).in_tier(t);
                let expected = model.apply(rank, id, t, &KvEventData::Cleared);
                assert_eq!(label(&plain.apply(&event)), expected, "{event:?}");
                assert_eq!(label(&writer.apply(&event)), expected, "{event:?} (shared)");
            }
            Op::Join { worker } => {
                let w = worker % WORKERS;
                if !model.in_fleet[usize::from(w)] {
                    service
                        .add_worker(WorkerRecord::new(u64::from(w)).with_dp(0, 2))
                        .expect("a new worker");
                    model.in_fleet[usize::from(w)] = true;
                }
            }
            Op::Leave { worker } => {
                let w = worker % WORKERS;
                if model.in_fleet[usize::from(w)] {
                    service.remove_worker(u64::from(w)).expect("a known worker");
                    model.in_fleet[usize::from(w)] = false;
                }
            }
            Op::Forget { worker } => {
                let w = u64::from(worker % WORKERS);
                let dropped = model.ranks.keys().filter(|r| r.worker_id == w).count();
                model.ranks.retain(|r, _| r.worker_id != w);
                ids.retain(|r, _| r.worker_id != w);
                assert_eq!(plain.remove_worker(w), dropped);
                assert_eq!(writer.remove_worker(w), dropped);
            }
            Op::Query { prompt, len, change } => {
                let prompt = prompt % PROMPTS;
                let mut locals: Vec<u64> = (0..len % (BLOCKS + 1)).map(|b| local(prompt, b)).collect();
                if let Some(c) = change {
                    if !locals.is_empty() {
                        let at = usize::from(c) % locals.len();
                        locals[at] ^= 0x77;
                    }
                }
                let mut seqs = Vec::new();
                sequence_hashes_of(&locals, &mut seqs);
                let layout = service.row_layout();
                plain.sync_rows(layout, |r| service.row_of(r));
                writer.sync_rows(layout, |r| service.row_of(r));
                writer.publish();
                model.sync();
                let got = plain.overlaps_for_local_hashes(&locals, &mut out).expect("synced");
                let got_shared = reader.overlaps(&seqs, &mut shared_out).expect("synced");
                assert_eq!(got, got_shared, "the shared index differs from the plain one");
                let mut expected = vec![(0, 0, 0); layout.rows()];
                for w in 0..WORKERS {
                    for r in 0..2 {
                        let rank = WorkerWithDpRank::new(u64::from(w), r);
                        if let Some(row) = service.row_of(rank) {
                            expected[row] = model.overlap(rank, &seqs);
                        }
                    }
                }
                for (row, want) in expected.iter().enumerate() {
                    assert_eq!(out.tiers(row), *want, "row {row}, query {locals:?}");
                }
            }
        }
    }
}
