//! Generated KV event streams for the index benches: what a fleet's engines
//! report when requests share branching prefixes of Zipf popularity, with
//! the queries a router asks and, from a per-block model of what every rank
//! holds, each query's expected answer.
//!
//! A stream holds, per rank and in event-id order:
//! - **stored requests**: a document's chain (a system prompt, then a
//!   document that may continue another document, then the user's own
//!   blocks), stored from the first block the rank does not hold, in parts
//!   of 1 to 16 blocks, each part under the one before; some start a few
//!   blocks early (duplicate stores of held blocks);
//! - **decode appends**: 1 to 4 blocks under the end of a chain the rank
//!   holds;
//! - **tail removals** (the last 1 to 8 blocks of a chain, last first),
//!   **middle removals** (one block inside a chain, its descendants kept)
//!   and **scattered removals** (2 to 8 held blocks anywhere);
//! - **duplicate removals** (a held block named twice in one event, or a
//!   block the rank does not hold);
//! - **unknown parents** (a store under a hash the rank never held: every
//!   index refuses it);
//! - **clears** (the rank drops every block).
//!
//! The model credits a rank with the longest prefix of a query's blocks it
//! holds. A block removed while the rank holds blocks under it is never
//! stored on that rank again (until the rank clears): were it stored again,
//! the model would credit the blocks under it, which an engine still holds,
//! while an index that dropped them (as Dynamo's radix trees do) would not.
//! Every other event is what an engine may send.

use std::collections::{HashMap, HashSet};

use selkie::kv_index::{next_sequence_hash, KvEvent, KvEventData, KvEventError, KvIndex, StoredBlock};
use selkie::{
    KvRouterConfig, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService, WorkerType,
    WorkerWithDpRank,
};

use crate::SplitMix64;

/// A rank: (worker id, DP rank).
pub type Rank = (u64, u32);

/// How often each kind of event is drawn, in parts per thousand.
#[derive(Clone, Copy, Debug)]
pub struct Mix {
    /// A request's chain stored (in parts).
    pub request: u32,
    /// Blocks appended under a held chain's end.
    pub decode: u32,
    /// A held chain's last blocks removed.
    pub tail_removal: u32,
    /// One block inside a held chain removed.
    pub middle_removal: u32,
    /// Held blocks anywhere removed.
    pub scattered_removal: u32,
    /// A removal naming a block twice, or one the rank does not hold.
    pub duplicate_removal: u32,
    /// A store under a parent the rank never held.
    pub unknown_parent: u32,
    /// Every block of the rank dropped.
    pub cleared: u32,
}

/// The branching streams' mix.
pub const BRANCHING: Mix = Mix {
    request: 420,
    decode: 300,
    tail_removal: 150,
    middle_removal: 40,
    scattered_removal: 40,
    duplicate_removal: 30,
    unknown_parent: 15,
    cleared: 5,
};

/// A decode-heavy mix: mostly short appends under held chains.
pub const DECODE_HEAVY: Mix = Mix {
    request: 150,
    decode: 700,
    tail_removal: 100,
    middle_removal: 10,
    scattered_removal: 10,
    duplicate_removal: 20,
    unknown_parent: 8,
    cleared: 2,
};

/// One stream of the family.
#[derive(Clone, Copy, Debug)]
pub struct StreamShape {
    /// Its name in the bench's tables.
    pub name: &'static str,
    /// Workers.
    pub workers: usize,
    /// DP ranks per worker.
    pub dp: u32,
    /// Events (the last request's parts may add up to 15 more).
    pub events: usize,
    /// Queries.
    pub queries: usize,
    /// A query after every this many events (its answer as the index
    /// stands then); 0: every event first, then the queries.
    pub query_every: usize,
    /// The events' kinds.
    pub mix: Mix,
    /// The generator's seed.
    pub seed: u64,
}

/// The family `vs_dynamo_index` measures.
pub const FAMILY: [StreamShape; 6] = [
    StreamShape {
        name: "branching, 8 workers",
        workers: 8,
        dp: 1,
        events: 20_000,
        queries: 5_000,
        query_every: 0,
        mix: BRANCHING,
        seed: 0x1d_0008,
    },
    StreamShape {
        name: "branching, 200 workers",
        workers: 200,
        dp: 1,
        events: 20_000,
        queries: 5_000,
        query_every: 0,
        mix: BRANCHING,
        seed: 0x1d_0200,
    },
    StreamShape {
        name: "branching, 1,000 workers",
        workers: 1_000,
        dp: 1,
        events: 20_000,
        queries: 5_000,
        query_every: 0,
        mix: BRANCHING,
        seed: 0x1d_1000,
    },
    StreamShape {
        name: "branching, 500 workers x DP 2",
        workers: 500,
        dp: 2,
        events: 20_000,
        queries: 5_000,
        query_every: 0,
        mix: BRANCHING,
        seed: 0x1d_0502,
    },
    StreamShape {
        name: "decode-heavy, 1,000 workers",
        workers: 1_000,
        dp: 1,
        events: 20_000,
        queries: 5_000,
        query_every: 0,
        mix: DECODE_HEAVY,
        seed: 0x1d_dec0,
    },
    StreamShape {
        name: "interleaved, 1,000 workers",
        workers: 1_000,
        dp: 1,
        events: 20_000,
        queries: 5_000,
        query_every: 4,
        mix: BRANCHING,
        seed: 0x1d_1417,
    },
];

/// What an event says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamData {
    /// `blocks` (engine hash, local hash) stored under `parent`.
    Stored {
        /// The engine hash of the first block's parent.
        parent: Option<u64>,
        /// (engine hash, local hash) of each block, in order.
        blocks: Vec<(u64, u64)>,
    },
    /// Blocks removed, by engine hash, in this order.
    Removed(Vec<u64>),
    /// Every block of the rank dropped.
    Cleared,
}

/// One engine event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamEvent {
    /// The rank that sent it.
    pub rank: Rank,
    /// The rank's event id (consecutive from 0).
    pub id: u64,
    /// What happened.
    pub data: StreamData,
}

/// An event, or the query of that index.
#[derive(Clone, Debug)]
pub enum StreamOp {
    /// An event to apply.
    Event(StreamEvent),
    /// A query (an index into [`Stream::queries`]).
    Query(usize),
}

/// Events of each kind in a stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KindCounts {
    /// Stored events of requests (parts included).
    pub stored: usize,
    /// Stored events of decode appends.
    pub appends: usize,
    /// Removal events.
    pub removals: usize,
    /// Removals of a block with held blocks under it.
    pub middle: usize,
    /// Stored events under an unknown parent.
    pub unknown_parent: usize,
    /// Clears.
    pub cleared: usize,
}

/// A generated stream, its queries and their expected answers.
pub struct Stream {
    /// Its shape.
    pub shape: StreamShape,
    /// Every rank, in the order of the model's answers.
    pub ranks: Vec<Rank>,
    /// The events and queries, in order.
    pub ops: Vec<StreamOp>,
    /// Each query's local block hashes.
    pub queries: Vec<Vec<u64>>,
    /// Each query's expected device overlaps: (position in `ranks`,
    /// blocks), nonzero only, by position.
    pub expected: Vec<Vec<(u32, u32)>>,
    /// Distinct blocks held at the end.
    pub distinct: usize,
    /// (rank, block) pairs held at the end.
    pub entries: usize,
    /// Events of each kind.
    pub kinds: KindCounts,
}

impl Stream {
    /// The events, in order.
    pub fn events(&self) -> impl Iterator<Item = &StreamEvent> {
        self.ops.iter().filter_map(|op| match op {
            StreamOp::Event(e) => Some(e),
            StreamOp::Query(_) => None,
        })
    }

    /// Events in the stream.
    pub fn event_count(&self) -> usize {
        self.events().count()
    }

    /// Ranks credited by a query's expected answer, the most of any query.
    pub fn most_credited(&self) -> usize {
        self.expected.iter().map(Vec::len).max().unwrap_or(0)
    }
}

/// A stream's event as selkie's index takes it (its blocks owned here,
/// borrowed by the [`KvEvent`] it applies).
pub struct IndexEvent {
    rank: WorkerWithDpRank,
    id: u64,
    data: IndexData,
}

enum IndexData {
    Stored(Option<u64>, Vec<StoredBlock>),
    Removed(Vec<u64>),
    Cleared,
}

impl IndexEvent {
    fn of(e: &StreamEvent) -> IndexEvent {
        let data = match &e.data {
            StreamData::Stored { parent, blocks } => IndexData::Stored(
                *parent,
                blocks
                    .iter()
                    .map(|&(block_hash, tokens_hash)| StoredBlock {
                        block_hash,
                        tokens_hash,
                    })
                    .collect(),
            ),
            StreamData::Removed(hashes) => IndexData::Removed(hashes.clone()),
            StreamData::Cleared => IndexData::Cleared,
        };
        IndexEvent {
            rank: WorkerWithDpRank::new(e.rank.0, e.rank.1),
            id: e.id,
            data,
        }
    }

    /// The rank's event id (0: its first event).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Applies it to `index` (a store under an unknown parent, or a
    /// removal naming a block the rank does not hold, is refused in whole
    /// or in part, as the stream means it to be).
    pub fn apply(&self, index: &mut KvIndex) -> Result<(), KvEventError> {
        let data = match &self.data {
            IndexData::Stored(parent, blocks) => KvEventData::Stored {
                parent: *parent,
                blocks,
            },
            IndexData::Removed(blocks) => KvEventData::Removed { blocks },
            IndexData::Cleared => KvEventData::Cleared,
        };
        index.apply(&KvEvent::new(self.rank, self.id, data))
    }
}

/// Applies `events` in order to `index` (queries' `None`s skipped),
/// syncing it to `service`'s rows after each rank's first event when a
/// service is given (so that blocks go onto rows as they are applied, as
/// in a router that syncs before each query); the events refused in whole
/// or in part.
///
/// # Panics
/// If `service`'s block size is not `index`'s.
pub fn feed(events: &[Option<IndexEvent>], index: &mut KvIndex, service: Option<&WorkerSelectionService>) -> usize {
    let mut refused = 0;
    for e in events.iter().flatten() {
        refused += usize::from(e.apply(index).is_err());
        if let (0, Some(service)) = (e.id, service) {
            index
                .sync_rows(service.row_layout(), |r| service.row_of(r))
                .expect("the index has the service's block size");
        }
    }
    refused
}

impl Stream {
    /// Each op's event as selkie's index takes it (`None` for a query).
    pub fn index_events(&self) -> Vec<Option<IndexEvent>> {
        self.ops
            .iter()
            .map(|op| match op {
                StreamOp::Event(e) => Some(IndexEvent::of(e)),
                StreamOp::Query(_) => None,
            })
            .collect()
    }

    /// A `kv` service over the stream's workers and DP ranks.
    ///
    /// # Panics
    /// If the service refuses the fleet.
    pub fn service(&self, block_size: u32) -> WorkerSelectionService {
        let service = WorkerSelectionService::new(
            WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
            ServiceConfig {
                block_size,
                seed: Some(7),
                ..ServiceConfig::default()
            },
        );
        service
            .sync(
                (0..self.shape.workers as u64)
                    .map(|w| WorkerRecord::new(w).with_dp(0, self.shape.dp))
                    .collect(),
            )
            .expect("the fleet has room");
        service
    }

    /// Each rank's row in `service`, in the order of [`Stream::ranks`].
    ///
    /// # Panics
    /// If a rank has no row (`service` is not [`Stream::service`]'s).
    pub fn rows(&self, service: &WorkerSelectionService) -> Vec<usize> {
        self.ranks
            .iter()
            .map(|&(w, d)| service.row_of(WorkerWithDpRank::new(w, d)).expect("a row per rank"))
            .collect()
    }

    /// Query `q`'s expected device overlap of every rank, in the order of
    /// [`Stream::ranks`].
    pub fn expected_dense(&self, q: usize) -> Vec<u32> {
        let mut want = vec![0u32; self.ranks.len()];
        for &(r, n) in &self.expected[q] {
            want[r as usize] = n;
        }
        want
    }
}

/// `0..n` from a 64-bit draw.
fn below(rng: &mut SplitMix64, n: usize) -> usize {
    ((u128::from(rng.next_u64()) * n as u128) >> 64) as usize
}

/// A uniform draw in `[0, 1)`.
fn unit(rng: &mut SplitMix64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// A local block hash no other draw gives (in practice).
fn fresh(rng: &mut SplitMix64) -> u64 {
    rng.next_u64() | 1
}

/// A chain's (sequence hash, local hash) pairs.
type Chain = Vec<(u64, u64)>;

/// The chain of `locals` from the first block of a request.
fn chain_of(locals: &[u64]) -> Chain {
    let mut parent = None;
    locals
        .iter()
        .map(|&l| {
            let seq = parent.map_or(l, |p| next_sequence_hash(p, l));
            parent = Some(seq);
            (seq, l)
        })
        .collect()
}

/// The documents requests start with: system prompts, then documents that
/// may continue another document, drawn by Zipf popularity.
struct Catalog {
    systems: Vec<Vec<u64>>,
    documents: Vec<Vec<u64>>,
    /// The documents' cumulative popularity.
    cdf: Vec<f64>,
}

const SYSTEMS: usize = 8;
const DOCUMENTS: usize = 256;
const ZIPF_S: f64 = 1.1;
const MAX_QUERY_BLOCKS: usize = 160;
/// Chains a rank remembers for appends and removals.
const TIPS: usize = 32;

impl Catalog {
    fn new(rng: &mut SplitMix64) -> Self {
        let systems: Vec<Vec<u64>> = (0..SYSTEMS)
            .map(|_| (0..8 + below(rng, 41)).map(|_| fresh(rng)).collect())
            .collect();
        let mut documents: Vec<Vec<u64>> = Vec::with_capacity(DOCUMENTS);
        for i in 0..DOCUMENTS {
            let mut d = if i >= 16 && unit(rng) < 0.35 {
                let base = &documents[below(rng, i)];
                let mut d = base.clone();
                d.extend((0..2 + below(rng, 15)).map(|_| fresh(rng)));
                d
            } else {
                let mut d = systems[i % SYSTEMS].clone();
                d.extend((0..4 + below(rng, 37)).map(|_| fresh(rng)));
                d
            };
            d.truncate(140);
            documents.push(d);
        }
        let mut total = 0.0;
        let mut cdf: Vec<f64> = (0..DOCUMENTS)
            .map(|k| {
                total += 1.0 / ((k + 1) as f64).powf(ZIPF_S);
                total
            })
            .collect();
        cdf.iter_mut().for_each(|c| *c /= total);
        Catalog {
            systems,
            documents,
            cdf,
        }
    }

    fn document(&self, rng: &mut SplitMix64) -> &[u64] {
        let u = unit(rng);
        let k = self.cdf.partition_point(|&c| c < u).min(DOCUMENTS - 1);
        &self.documents[k]
    }
}

/// What one rank holds, in the model.
#[derive(Default)]
struct RankState {
    next_id: u64,
    held: HashSet<u64>,
    /// Copies of a held block beyond the first (a block stored again while
    /// held is one copy more, removed by a removal of its own).
    copies: HashMap<u64, u32>,
    /// Held children of each block (held or not).
    children: HashMap<u64, u32>,
    /// Blocks removed while held blocks were under them: never stored
    /// again on this rank (see the module documentation).
    tainted: HashSet<u64>,
    /// Chains it stored lately, the latest last.
    tips: Vec<Chain>,
}

/// The per-block model of the whole fleet.
struct Model {
    ranks: Vec<Rank>,
    state: Vec<RankState>,
    /// Every sequence hash's parent.
    parent: HashMap<u64, Option<u64>>,
    /// Which ranks hold each block (a bit per rank position).
    holders: HashMap<u64, Vec<u64>>,
    words: usize,
}

impl Model {
    fn new(ranks: Vec<Rank>) -> Self {
        let words = ranks.len().div_ceil(64);
        Model {
            state: ranks.iter().map(|_| RankState::default()).collect(),
            ranks,
            parent: HashMap::new(),
            holders: HashMap::new(),
            words,
        }
    }

    /// Stores `chain[at]` on rank `r` (its parent `chain[at - 1]`).
    fn store(&mut self, r: usize, chain: &Chain, at: usize) {
        let (seq, _) = chain[at];
        let parent = at.checked_sub(1).map(|p| chain[p].0);
        self.parent.entry(seq).or_insert(parent);
        let state = &mut self.state[r];
        debug_assert!(!state.tainted.contains(&seq));
        if !state.held.insert(seq) {
            *state.copies.entry(seq).or_default() += 1;
        } else {
            if let Some(p) = parent {
                *state.children.entry(p).or_default() += 1;
            }
            let words = self.words;
            self.holders.entry(seq).or_insert_with(|| vec![0; words])[r / 64] |= 1 << (r % 64);
        }
    }

    /// Removes a copy of `seq` from rank `r`, if held; whether it was the
    /// last copy of a block with held blocks under it (a middle removal).
    fn remove(&mut self, r: usize, seq: u64) -> bool {
        let state = &mut self.state[r];
        if let Some(c) = state.copies.get_mut(&seq) {
            *c -= 1;
            if *c == 0 {
                state.copies.remove(&seq);
            }
            return false;
        }
        if !state.held.remove(&seq) {
            return false;
        }
        let middle = state.children.get(&seq).is_some_and(|&c| c > 0);
        if middle {
            state.tainted.insert(seq);
        }
        if let Some(Some(p)) = self.parent.get(&seq) {
            let c = state.children.get_mut(p).expect("a held child was counted");
            *c -= 1;
            if *c == 0 {
                state.children.remove(p);
            }
        }
        let h = self.holders.get_mut(&seq).expect("a held block has holders");
        h[r / 64] &= !(1 << (r % 64));
        if h.iter().all(|&w| w == 0) {
            self.holders.remove(&seq);
        }
        middle
    }

    fn clear(&mut self, r: usize) {
        let state = std::mem::take(&mut self.state[r]);
        for seq in state.held {
            let h = self.holders.get_mut(&seq).expect("a held block has holders");
            h[r / 64] &= !(1 << (r % 64));
            if h.iter().all(|&w| w == 0) {
                self.holders.remove(&seq);
            }
        }
        self.state[r].next_id = state.next_id;
    }

    /// Every rank's device overlap with `locals` (nonzero only, by rank
    /// position).
    fn answer(&self, locals: &[u64]) -> Vec<(u32, u32)> {
        let chain = chain_of(locals);
        let mut out = Vec::new();
        let Some(first) = chain.first().and_then(|(s, _)| self.holders.get(s)) else {
            return out;
        };
        let mut active = first.clone();
        let mut depth = 1;
        for (seq, _) in &chain[1..] {
            let next = self.holders.get(seq);
            let mut any = false;
            for (w, word) in active.iter_mut().enumerate() {
                let keep = next.map_or(0, |n| *word & n[w]);
                let mut gone = *word & !keep;
                while gone != 0 {
                    out.push(((w * 64) as u32 + gone.trailing_zeros(), depth));
                    gone &= gone - 1;
                }
                *word = keep;
                any |= keep != 0;
            }
            if !any {
                break;
            }
            depth += 1;
        }
        for (w, &word) in active.iter().enumerate() {
            let mut left = word;
            while left != 0 {
                out.push(((w * 64) as u32 + left.trailing_zeros(), depth));
                left &= left - 1;
            }
        }
        out.sort_unstable();
        out
    }

    fn event(&mut self, r: usize, data: StreamData) -> StreamEvent {
        let state = &mut self.state[r];
        let id = state.next_id;
        state.next_id += 1;
        StreamEvent {
            rank: self.ranks[r],
            id,
            data,
        }
    }

    /// Whether rank `r` holds the whole chain.
    fn holds(&self, r: usize, chain: &[(u64, u64)]) -> bool {
        chain.iter().all(|(s, _)| self.state[r].held.contains(s))
    }

    fn remember(&mut self, r: usize, chain: Chain) {
        let tips = &mut self.state[r].tips;
        if tips.len() == TIPS {
            tips.remove(0);
        }
        tips.push(chain);
    }
}

/// The generator's state.
struct Generator<'s> {
    shape: &'s StreamShape,
    rng: SplitMix64,
    catalog: Catalog,
    model: Model,
    ops: Vec<StreamOp>,
    kinds: KindCounts,
}

impl Generator<'_> {
    fn rank(&mut self) -> usize {
        below(&mut self.rng, self.model.ranks.len())
    }

    /// A request: a document and the user's own blocks.
    fn request(&mut self) -> Vec<u64> {
        let mut locals = self.catalog.document(&mut self.rng).to_vec();
        let own = below(&mut self.rng, 25);
        locals.extend((0..own).map(|_| fresh(&mut self.rng)));
        locals.truncate(MAX_QUERY_BLOCKS);
        locals
    }

    fn push(&mut self, r: usize, data: StreamData) {
        let e = self.model.event(r, data);
        self.ops.push(StreamOp::Event(e));
    }

    /// Stores `chain[from..]` on `r` in parts of 1 to 16 blocks.
    fn store_parts(&mut self, r: usize, chain: &Chain, from: usize, appends: bool) {
        let mut at = from;
        while at < chain.len() {
            let end = (at + 1 + below(&mut self.rng, 16)).min(chain.len());
            for i in at..end {
                self.model.store(r, chain, i);
            }
            let parent = at.checked_sub(1).map(|p| chain[p].0);
            self.push(
                r,
                StreamData::Stored {
                    parent,
                    blocks: chain[at..end].to_vec(),
                },
            );
            if appends {
                self.kinds.appends += 1;
            } else {
                self.kinds.stored += 1;
            }
            at = end;
        }
    }

    /// A request stored on a rank that may take it; false if none of a few
    /// tried can (it passes a block removed from under held ones there).
    fn stored_request(&mut self) -> bool {
        let locals = self.request();
        let chain = chain_of(&locals);
        for _ in 0..4 {
            let r = self.rank();
            let state = &self.model.state[r];
            if chain.iter().any(|(s, _)| state.tainted.contains(s)) {
                continue;
            }
            let first_missing = chain.iter().position(|(s, _)| !state.held.contains(s));
            let from = match first_missing {
                // All held: the engine stores the last blocks again.
                None => chain.len() - (1 + below(&mut self.rng, 3)).min(chain.len()),
                // Some start a few blocks early: duplicate stores.
                Some(f) if f > 0 && below(&mut self.rng, 100) < 15 => f - (1 + below(&mut self.rng, 3)).min(f),
                Some(f) => f,
            };
            self.store_parts(r, &chain, from, false);
            self.model.remember(r, chain);
            return true;
        }
        false
    }

    /// A held chain of a rank, lately stored; `None` if the rank has none
    /// whole (chains no longer whole are forgotten).
    fn held_tip(&mut self, r: usize) -> Option<usize> {
        loop {
            let tips = &self.model.state[r].tips;
            if tips.is_empty() {
                return None;
            }
            let recent = tips.len().min(8);
            let t = tips.len() - 1 - below(&mut self.rng, recent);
            if self.model.holds(r, &self.model.state[r].tips[t]) {
                return Some(t);
            }
            self.model.state[r].tips.remove(t);
        }
    }

    fn decode_append(&mut self) -> bool {
        let r = self.rank();
        let Some(t) = self.held_tip(r) else {
            return false;
        };
        let mut chain = self.model.state[r].tips[t].clone();
        if chain.len() >= MAX_QUERY_BLOCKS + 40 {
            return false;
        }
        let from = chain.len();
        let n = if below(&mut self.rng, 4) == 0 {
            2 + below(&mut self.rng, 3)
        } else {
            1
        };
        let mut parent = chain.last().map(|&(s, _)| s);
        for _ in 0..n {
            let l = fresh(&mut self.rng);
            let seq = parent.map_or(l, |p| next_sequence_hash(p, l));
            chain.push((seq, l));
            parent = Some(seq);
        }
        self.store_parts(r, &chain, from, true);
        self.model.state[r].tips[t] = chain;
        true
    }

    /// Removes `blocks` from `r` in order, as one event: each named once
    /// per copy the rank holds (as engines do, all in one event here, so
    /// that an index that keeps one copy of a block answers alike between
    /// events).
    fn removal(&mut self, r: usize, blocks: Vec<u64>) {
        let mut hashes = Vec::with_capacity(blocks.len());
        for h in blocks {
            let copies = 1 + self.model.state[r].copies.get(&h).copied().unwrap_or(0);
            for _ in 0..copies {
                hashes.push(h);
                if self.model.remove(r, h) {
                    self.kinds.middle += 1;
                }
            }
        }
        self.kinds.removals += 1;
        self.push(r, StreamData::Removed(hashes));
    }

    fn tail_removal(&mut self) -> bool {
        let r = self.rank();
        let Some(t) = self.held_tip(r) else {
            return false;
        };
        let chain = &self.model.state[r].tips[t];
        let k = (1 + below(&mut self.rng, 8)).min(chain.len());
        let hashes: Vec<u64> = chain[chain.len() - k..].iter().rev().map(|&(s, _)| s).collect();
        let keep = chain.len() - k;
        self.removal(r, hashes);
        let tips = &mut self.model.state[r].tips;
        if keep == 0 {
            tips.remove(t);
        } else {
            tips[t].truncate(keep);
        }
        true
    }

    fn middle_removal(&mut self) -> bool {
        let r = self.rank();
        let Some(t) = self.held_tip(r) else {
            return false;
        };
        let chain = &self.model.state[r].tips[t];
        if chain.len() < 3 {
            return false;
        }
        let i = 1 + below(&mut self.rng, chain.len() - 2);
        let hash = chain[i].0;
        self.removal(r, vec![hash]);
        true
    }

    fn scattered_removal(&mut self) -> bool {
        let r = self.rank();
        let held = &self.model.state[r].held;
        if held.len() < 2 {
            return false;
        }
        // A deterministic pick: the held set's order depends on the hasher.
        let mut all: Vec<u64> = held.iter().copied().collect();
        all.sort_unstable();
        let k = (2 + below(&mut self.rng, 7)).min(all.len());
        let hashes = (0..k).map(|_| all[below(&mut self.rng, all.len())]).collect();
        self.removal(r, hashes);
        true
    }

    fn duplicate_removal(&mut self) -> bool {
        let r = self.rank();
        if below(&mut self.rng, 2) == 0 {
            // A held chain's last block, named twice in one event.
            let Some(t) = self.held_tip(r) else {
                return false;
            };
            // Named once per copy, then once more (no longer held then).
            let last = self.model.state[r].tips[t].last().expect("tips are not empty").0;
            self.removal(r, vec![last, last]);
            let tips = &mut self.model.state[r].tips;
            tips[t].pop();
            if tips[t].is_empty() {
                tips.remove(t);
            }
        } else {
            // A block another rank holds and this one does not.
            let other = self.rank();
            let Some(t) = self.held_tip(other) else {
                return false;
            };
            let chain = &self.model.state[other].tips[t];
            let seq = chain[below(&mut self.rng, chain.len())].0;
            if self.model.state[r].held.contains(&seq) {
                return false;
            }
            self.removal(r, vec![seq]);
        }
        true
    }

    fn unknown_parent(&mut self) -> bool {
        let r = self.rank();
        let parent = self.rng.next_u64();
        let n = 1 + below(&mut self.rng, 4);
        let blocks = (0..n)
            .map(|_| {
                let l = fresh(&mut self.rng);
                (next_sequence_hash(parent, l), l)
            })
            .collect();
        self.kinds.unknown_parent += 1;
        self.push(
            r,
            StreamData::Stored {
                parent: Some(parent),
                blocks,
            },
        );
        true
    }

    fn cleared(&mut self) -> bool {
        let r = self.rank();
        self.model.clear(r);
        self.kinds.cleared += 1;
        self.push(r, StreamData::Cleared);
        true
    }

    /// A query: a system prompt (credited to many ranks), a request, or a
    /// chain a rank holds with a few blocks more; 1 to 160 blocks.
    fn query(&mut self) -> Vec<u64> {
        let mut locals = match below(&mut self.rng, 10) {
            0..=2 => self.catalog.systems[below(&mut self.rng, SYSTEMS)].clone(),
            3..=6 => self.request(),
            _ => {
                let r = self.rank();
                match self.held_tip(r) {
                    Some(t) => self.model.state[r].tips[t].iter().map(|&(_, l)| l).collect(),
                    None => self.request(),
                }
            }
        };
        let extra = below(&mut self.rng, 9);
        locals.extend((0..extra).map(|_| fresh(&mut self.rng)));
        let len = 1 + below(&mut self.rng, MAX_QUERY_BLOCKS);
        locals.truncate(len.max(1));
        locals
    }
}

impl Stream {
    /// Generates `shape`'s stream (the same on every run).
    pub fn generate(shape: &StreamShape) -> Stream {
        let ranks: Vec<Rank> = (0..shape.workers as u64)
            .flat_map(|w| (0..shape.dp).map(move |d| (w, d)))
            .collect();
        let mut rng = SplitMix64::new(shape.seed);
        let catalog = Catalog::new(&mut rng);
        let mut g = Generator {
            shape,
            rng,
            catalog,
            model: Model::new(ranks.clone()),
            ops: Vec::with_capacity(shape.events + shape.queries),
            kinds: KindCounts::default(),
        };
        let (mut queries, mut expected) = (Vec::new(), Vec::new());
        let m = g.shape.mix;
        let weights = [
            m.request,
            m.decode,
            m.tail_removal,
            m.middle_removal,
            m.scattered_removal,
            m.duplicate_removal,
            m.unknown_parent,
            m.cleared,
        ];
        let total: u32 = weights.iter().sum();
        let (mut events, mut stuck) = (0, 0);
        while events < shape.events {
            let mut draw = below(&mut g.rng, total as usize) as u32;
            let kind = weights
                .iter()
                .position(|&w| {
                    let hit = draw < w;
                    draw = draw.saturating_sub(w);
                    hit
                })
                .expect("the draw is below the total");
            let before = g.ops.len();
            let done = match kind {
                0 => g.stored_request(),
                1 => g.decode_append(),
                2 => g.tail_removal(),
                3 => g.middle_removal(),
                4 => g.scattered_removal(),
                5 => g.duplicate_removal(),
                6 => g.unknown_parent(),
                _ => g.cleared(),
            };
            if !done {
                // Nothing of the kind drawn can happen (every rank holds a
                // block removed from under others on every document's
                // chain, say): after a while, a rank clears.
                stuck += 1;
                if stuck < 64 {
                    continue;
                }
                g.cleared();
            }
            stuck = 0;
            let added = g.ops.len() - before;
            for _ in 0..added {
                events += 1;
                if shape.query_every > 0 && events % shape.query_every == 0 && queries.len() < shape.queries {
                    let q = g.query();
                    expected.push(g.model.answer(&q));
                    g.ops.push(StreamOp::Query(queries.len()));
                    queries.push(q);
                }
            }
        }
        while queries.len() < shape.queries {
            let q = g.query();
            expected.push(g.model.answer(&q));
            if shape.query_every > 0 {
                g.ops.push(StreamOp::Query(queries.len()));
            }
            queries.push(q);
        }
        let distinct = g.model.holders.len();
        let entries = g.model.state.iter().map(|s| s.held.len()).sum();
        Stream {
            shape: *shape,
            ranks,
            ops: g.ops,
            queries,
            expected,
            distinct,
            entries,
            kinds: g.kinds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(query_every: usize) -> StreamShape {
        StreamShape {
            name: "small",
            workers: 6,
            dp: 2,
            events: 3_000,
            queries: 400,
            query_every,
            mix: BRANCHING,
            seed: 5,
        }
    }

    #[test]
    fn a_stream_is_the_same_on_every_run_and_has_every_kind() {
        let (a, b) = (Stream::generate(&small(0)), Stream::generate(&small(0)));
        assert!((3_000..3_016).contains(&a.event_count()), "{}", a.event_count());
        assert!(a.events().eq(b.events()));
        assert_eq!(a.queries, b.queries);
        let k = a.kinds;
        assert!(
            k.stored > 0 && k.appends > 0 && k.removals > 0 && k.middle > 0 && k.unknown_parent > 0 && k.cleared > 0,
            "{k:?}"
        );
        // Event ids are consecutive per rank.
        let mut next: HashMap<Rank, u64> = HashMap::new();
        for e in a.events() {
            let n = next.entry(e.rank).or_default();
            assert_eq!(e.id, *n, "{:?}", e.rank);
            *n += 1;
        }
        assert!(a.queries.iter().all(|q| (1..=MAX_QUERY_BLOCKS).contains(&q.len())));
        assert!(a.most_credited() > 6, "some query is credited to most ranks");
    }

    #[test]
    fn the_model_credits_the_longest_held_prefix() {
        let mut m = Model::new(vec![(0, 0), (1, 0)]);
        let locals = [11, 12, 13, 14];
        let chain = chain_of(&locals);
        for i in 0..4 {
            m.store(0, &chain, i);
        }
        for i in 0..2 {
            m.store(1, &chain, i);
        }
        assert_eq!(m.answer(&locals), vec![(0, 4), (1, 2)]);
        assert_eq!(m.answer(&[11, 12, 99]), vec![(0, 2), (1, 2)]);
        // A block stored twice is held until removed twice.
        m.store(1, &chain, 1);
        assert!(!m.remove(1, chain[1].0));
        assert_eq!(m.answer(&locals), vec![(0, 4), (1, 2)]);
        assert!(m.remove(0, chain[1].0), "a middle removal");
        assert!(m.state[0].tainted.contains(&chain[1].0));
        assert_eq!(m.answer(&locals), vec![(0, 1), (1, 2)]);
        assert!(!m.remove(1, chain[1].0), "its last block");
        assert!(!m.remove(1, chain[1].0), "not held any more");
        assert_eq!(m.answer(&locals), vec![(0, 1), (1, 1)]);
        m.clear(0);
        assert_eq!(m.answer(&locals), vec![(1, 1)]);
        assert!(m.state[0].tainted.is_empty());
    }

    #[test]
    fn interleaved_queries_follow_their_events() {
        let s = Stream::generate(&small(4));
        let positions: Vec<usize> = s
            .ops
            .iter()
            .enumerate()
            .filter_map(|(i, op)| matches!(op, StreamOp::Query(_)).then_some(i))
            .collect();
        assert_eq!(positions.len(), 400);
        for (j, &at) in positions.iter().enumerate() {
            let events_before = at - j;
            assert!(events_before >= 4 * (j + 1), "query {j} after {events_before} events");
            assert!(
                events_before < 4 * (j + 1) + 16,
                "query {j} after {events_before} events"
            );
        }
    }
}
