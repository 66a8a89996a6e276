//! Harness of the `kv_index_model` fuzz target, shared with the regression
//! replay in `host/tests/fuzz_regressions.rs`.
//!
//! Random sequences of engine KV events (stores under held, unknown or
//! self-naming parents, removals with unknown blocks, clears, in all three
//! tiers; a block stored under either of two engine hashes (aliases of one
//! sequence hash), stored again while held (a copy more) and removed
//! several times in one event; event ids that skip, repeat, start again
//! at 0 or jump out of belief), fleet changes (workers joining and leaving
//! the service, also leaving and coming back between two syncs;
//! `remove_worker` on the index) and queries, applied to a plain
//! [`KvIndex`] and to a [`shared`] one (whose copies have their block table
//! reserved for 24 blocks, 32 slots, which inputs holding more blocks fill
//! and grow past), against a plain model: every event's outcome (applied,
//! or which error) equals the model's, and every query's device / host /
//! disk overlap of every row equals the model's for the rank on that row
//! (0 on rows of no rank), on both indexes. The indexes sync with the
//! ranks' tenures (`rank_row`).

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
        /// The blocks under their second engine hash.
        alias: bool,
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
        /// The blocks under their second engine hash.
        alias: bool,
        /// The first hash named this many more times.
        repeat: u8,
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
    /// The worker leaves the service and joins it again (between two
    /// syncs, unless a query came in between).
    Rejoin {
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

/// The engine hash of a block: a function of its sequence hash, and of
/// `alias` (an engine that keys blocks by more than the router hashes).
fn engine(seq: u64, alias: bool) -> u64 {
    seq.rotate_left(17) ^ if alias { 0x5a5a_0000 } else { 0xa5a5 }
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
    /// Placed on a row (at the last sync), and under which tenure.
    placed: bool,
    tenure: Option<u64>,
    /// Its worker left after this incarnation began.
    departed: bool,
    /// The sync count when this incarnation began.
    began: u64,
    /// Engine hash -> (sequence hash, copies per tier).
    held: HashMap<u64, (u64, [u32; 3])>,
}

impl RankModel {
    fn restart(&mut self, syncs: u64) {
        self.held.clear();
        self.last = None;
        self.departed = false;
        self.began = syncs;
    }
}

#[derive(Default)]
struct Model {
    ranks: HashMap<WorkerWithDpRank, RankModel>,
    in_fleet: [bool; WORKERS as usize],
    /// Each worker's tenure in the service (new at every join).
    tenure: [u64; WORKERS as usize],
    syncs: u64,
}

fn tier_index(t: StorageTier) -> usize {
    bit(t).trailing_zeros() as usize
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
        let syncs = self.syncs;
        let state = self.ranks.entry(rank).or_insert_with(|| RankModel {
            began: syncs,
            ..RankModel::default()
        });
        let mut gap = false;
        match state.last {
            None => state.began = syncs,
            Some(_) if id == 0 => state.restart(syncs),
            Some(last) if id > last && id - last > MAX_EVENT_ID_JUMP => return Err("event_id_jump"),
            Some(last) if id < last && last - id > MAX_EVENT_ID_JUMP => state.restart(syncs),
            Some(last) if id <= last => return Err("stale_event"),
            Some(last) => gap = id != last + 1,
        }
        state.last = Some(id);
        if gap {
            state.held.clear();
        }
        let k = tier_index(t);
        let outcome = match *data {
            KvEventData::Stored { parent, blocks } => {
                if parent.is_some_and(|p| blocks.iter().any(|x| x.block_hash == p)) {
                    Err("self_parent")
                } else {
                    // A parent held in any tier.
                    match parent.map(|p| state.held.get(&p).map(|h| h.0)) {
                        Some(None) => Err("unknown_parent"),
                        chain => {
                            let mut chain = chain.flatten();
                            for x in blocks {
                                let seq = chain.map_or(x.tokens_hash, |p| next_sequence_hash(p, x.tokens_hash));
                                chain = Some(seq);
                                let e = state.held.entry(x.block_hash).or_insert((seq, [0; 3]));
                                if e.0 != seq {
                                    *e = (seq, [0; 3]);
                                }
                                e.1[k] += 1;
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
                        Some(e) if e.1[k] > 0 => {
                            e.1[k] -= 1;
                            if e.1 == [0; 3] {
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
                    e.1[k] = 0;
                    e.1 != [0; 3]
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

    /// The worker left (`remove_worker`): its ranks drop their blocks and
    /// are marked departed. Returns how many were not already.
    fn forget(&mut self, worker: u64) -> usize {
        let mut dropped = 0;
        for (_, state) in self.ranks.iter_mut().filter(|(r, _)| r.worker_id == worker) {
            state.placed = false;
            state.tenure = None;
            if !state.departed {
                state.departed = true;
                state.held.clear();
                dropped += 1;
            }
        }
        dropped
    }

    /// A sync: a placed rank whose worker left drops its blocks (departed);
    /// one that left and came back (a new tenure) starts a new incarnation
    /// unless its current one began since the last sync; a rank that gets
    /// a row starts a new incarnation if it is departed.
    fn sync(&mut self) {
        self.syncs += 1;
        let syncs = self.syncs;
        for (rank, state) in &mut self.ranks {
            let w = rank.worker_id as usize;
            let answer = self.in_fleet[w].then_some(self.tenure[w]);
            match (state.placed, answer) {
                (true, None) => {
                    state.placed = false;
                    state.tenure = None;
                    if !state.departed {
                        state.departed = true;
                        state.held.clear();
                    }
                }
                (true, Some(t)) => {
                    if state.tenure != Some(t) {
                        if state.began + 1 < syncs {
                            state.restart(syncs);
                        }
                        state.tenure = Some(t);
                    }
                }
                (false, Some(t)) => {
                    if state.departed {
                        state.restart(syncs);
                    }
                    state.placed = true;
                    state.tenure = Some(t);
                }
                (false, None) => {}
            }
        }
    }

    fn overlap(&self, rank: WorkerWithDpRank, seqs: &[u64]) -> (u32, u32, u32) {
        let Some(state) = self.ranks.get(&rank).filter(|s| s.placed) else {
            return (0, 0, 0);
        };
        let holds = |s: u64, k: usize| state.held.values().any(|&(q, c)| q == s && c[k] > 0);
        let mut i = 0;
        let mut run = |k: usize| {
            let start = i;
            while i < seqs.len() && holds(seqs[i], k) {
                i += 1;
            }
            (i - start) as u32
        };
        (run(0), run(1), run(2))
    }
}

/// Worker `w` joins the service (if out of it), with a new tenure.
fn join(service: &WorkerSelectionService, model: &mut Model, tenures: &mut u64, w: u8) {
    if !model.in_fleet[usize::from(w)] {
        service
            .add_worker(WorkerRecord::new(u64::from(w)).with_dp(0, 2))
            .expect("a new worker");
        *tenures += 1;
        model.in_fleet[usize::from(w)] = true;
        model.tenure[usize::from(w)] = *tenures;
    }
}

/// Worker `w` leaves the service (if in it).
fn leave(service: &WorkerSelectionService, model: &mut Model, w: u8) {
    if model.in_fleet[usize::from(w)] {
        service.remove_worker(u64::from(w)).expect("a known worker");
        model.in_fleet[usize::from(w)] = false;
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
    let mut tenures = 0;
    let (mut out, mut shared_out) = (KvOverlaps::new(), KvOverlaps::new());
    for op in input.ops.iter().take(400) {
        let event_rank = |worker: u8, rank: u8| WorkerWithDpRank::new(u64::from(worker % WORKERS), u32::from(rank % 2));
        let mut next_id = |rank: WorkerWithDpRank, step: u8| {
            let id = ids.entry(rank).or_insert(0);
            // Mostly the next id; sometimes a repeat, a skip, a new
            // incarnation (0), or an id too far ahead to believe (sent
            // once; the engine's ids go on from before).
            match step % 16 {
                0 | 8 => *id,
                1 | 9 => {
                    *id += 2 + u64::from(step / 16);
                    *id
                }
                15 if step > 128 => {
                    *id = 0;
                    0
                }
                14 if step > 128 => *id + MAX_EVENT_ID_JUMP + 1 + u64::from(step),
                _ => {
                    *id += 1;
                    *id
                }
            }
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
                alias,
            } => {
                let (rank, t, prompt) = (event_rank(worker, rank), tier(t), prompt % PROMPTS);
                let from = from % BLOCKS;
                let to = (from + 1 + len % 4).min(BLOCKS);
                let seqs = sequence(prompt, to);
                let mut blocks: Vec<StoredBlock> = (from..to)
                    .map(|b| StoredBlock {
                        block_hash: engine(seqs[usize::from(b)], alias),
                        tokens_hash: local(prompt, b),
                    })
                    .collect();
                let parent = match parent {
                    Some(other) if other % 4 == 0 => Some(0xdead),
                    Some(other) => {
                        let p = other % PROMPTS;
                        let b = other % BLOCKS;
                        Some(engine(sequence(p, b + 1)[usize::from(b)], other % 2 == 1))
                    }
                    None => (from > 0).then(|| engine(seqs[usize::from(from) - 1], alias)),
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
                alias,
                repeat,
            } => {
                let (rank, t, prompt) = (event_rank(worker, rank), tier(t), prompt % PROMPTS);
                let from = from % BLOCKS;
                let to = (from + 1 + len % 4).min(BLOCKS);
                let seqs = sequence(prompt, to);
                let mut hashes: Vec<u64> = (from..to).map(|b| engine(seqs[usize::from(b)], alias)).collect();
                for _ in 0..repeat % 3 {
                    hashes.push(hashes[0]);
                }
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
            Op::Join { worker } => join(&service, &mut model, &mut tenures, worker % WORKERS),
            Op::Leave { worker } => leave(&service, &mut model, worker % WORKERS),
            Op::Rejoin { worker } => {
                leave(&service, &mut model, worker % WORKERS);
                join(&service, &mut model, &mut tenures, worker % WORKERS);
            }
            Op::Forget { worker } => {
                let w = u64::from(worker % WORKERS);
                let dropped = model.forget(w);
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
                plain
                    .sync_rows(layout, |r| service.rank_row(r))
                    .expect("the index has the service's block size");
                writer
                    .sync_rows(layout, |r| service.rank_row(r))
                    .expect("the index has the service's block size");
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
