//! The generated streams of [`selkie_benches::index_streams`]: each applied
//! to selkie's index and Dynamo's two, every query's answer of the three
//! checked against the stream's per-block model, then ingestion, queries,
//! memory and (for the interleaved stream) events and queries in order
//! timed side by side.

use std::hint::black_box;
use std::time::Instant;

use dynamo_kv_router::indexer::{KvIndexerInterface, SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, LocalBlockHash, OverlapScores,
    RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};
use selkie::kv_index::{KvIndex, KvOverlaps, StoredBlock};
use selkie::WorkerSelectionService;
use selkie_benches::index_streams::{feed, IndexEvent, Stream, StreamData, StreamOp, StreamShape, FAMILY};
use selkie_benches::timing::batch;
use selkie_benches::vs_dynamo::dynamo_stored;

use super::{build_concurrent, live, progress, BLOCK_SIZE, INGEST_TURNS, TIMING};

/// One stream's figures.
pub struct FamilyRow {
    shape: StreamShape,
    events: usize,
    ranks: usize,
    distinct: usize,
    entries: usize,
    most_credited: usize,
    mean_credited: f64,
    refused: usize,
    /// Queries `ConcurrentRadixTreeCompressed` answered otherwise than the
    /// model (`None`: not asked, the interleaved stream).
    concurrent_differs: Option<usize>,
    selkie_eps: f64,
    radix_eps: f64,
    concurrent_eps: f64,
    selkie_query_ns: f64,
    radix_query_ns: f64,
    concurrent_query_ns: f64,
    selkie_bytes: isize,
    radix_bytes: isize,
    concurrent_bytes: isize,
    /// Events and queries in order, operations per second (interleaved
    /// streams): selkie, RadixTree.
    mixed_ops: Option<(f64, f64)>,
}

/// The stream's event as Dynamo's indexers take it.
fn dynamo_event(op: &StreamOp) -> Option<RouterEvent> {
    let StreamOp::Event(e) = op else {
        return None;
    };
    let data = match &e.data {
        StreamData::Stored { parent, blocks } => dynamo_stored(
            *parent,
            blocks.iter().map(|&(block_hash, tokens_hash)| StoredBlock {
                block_hash,
                tokens_hash,
            }),
        ),
        StreamData::Removed(hashes) => KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: hashes.iter().map(|&h| ExternalSequenceBlockHash(h)).collect(),
        }),
        StreamData::Cleared => KvCacheEventData::Cleared,
    };
    Some(RouterEvent::new(
        e.rank.0,
        KvCacheEvent {
            event_id: e.id,
            dp_rank: e.rank.1,
            data,
        },
    ))
}

/// The first rank whose overlap differs from query `q`'s expected one.
fn first_difference(stream: &Stream, q: usize, got: impl Fn(usize) -> u32) -> Option<(usize, u32, u32)> {
    let want = stream.expected_dense(q);
    (0..want.len()).find_map(|r| {
        let g = got(r);
        (g != want[r]).then_some((r, want[r], g))
    })
}

fn dynamo_score(scores: &OverlapScores, rank: (u64, u32)) -> u32 {
    let r = dynamo_kv_router::protocols::WorkerWithDpRank::new(rank.0, rank.1);
    scores.scores.get(&r).copied().unwrap_or(0)
}

/// Checks every answer of selkie's index and of `RadixTree` against the
/// model (on the first difference, says which), and counts the queries
/// `ConcurrentRadixTreeCompressed` answers otherwise: after a block is
/// removed from under blocks its rank still holds, that tree still credits
/// the blocks under it (its source marks the case as a known gap).
fn check(
    stream: &Stream,
    service: &WorkerSelectionService,
    selkie_events: &[Option<IndexEvent>],
    runtime: &tokio::runtime::Runtime,
) -> Result<usize, String> {
    let rows = stream.rows(service);
    let name = stream.shape.name;
    let mut index = KvIndex::new(BLOCK_SIZE);
    let mut radix = RadixTree::new();
    let pool = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, BLOCK_SIZE);
    let mut out = KvOverlaps::new();
    let mut unsynced = false;
    let mut checked = 0;
    let mut ask = |index: &mut KvIndex, radix: &RadixTree, q: usize, unsynced: &mut bool| -> Result<(), String> {
        if std::mem::take(unsynced) {
            index
                .sync_rows(service.row_layout(), |r| service.row_of(r))
                .map_err(|e| format!("{name}: sync: {e}"))?;
        }
        let locals = &stream.queries[q];
        let columns = index
            .overlaps_for_local_hashes(locals, &mut out)
            .map_err(|e| format!("{name}: query {q}: {e}"))?;
        let local: Vec<LocalBlockHash> = locals.iter().map(|&h| LocalBlockHash(h)).collect();
        let a = radix.find_matches(local, false);
        if let Some((r, want, got)) = first_difference(stream, q, |r| columns.device_blocks[rows[r]] as u32) {
            return Err(format!(
                "{name}: query {q}: rank {:?}: the model says {want}, selkie {got} (RadixTree {})",
                stream.ranks[r],
                dynamo_score(&a, stream.ranks[r])
            ));
        }
        if let Some((r, want, got)) = first_difference(stream, q, |r| dynamo_score(&a, stream.ranks[r])) {
            return Err(format!(
                "{name}: query {q}: rank {:?}: the model says {want}, RadixTree {got}",
                stream.ranks[r]
            ));
        }
        Ok(())
    };
    for (op, selkie) in stream.ops.iter().zip(selkie_events) {
        match op {
            StreamOp::Query(q) => {
                ask(&mut index, &radix, *q, &mut unsynced)?;
                checked += 1;
            }
            StreamOp::Event(e) => {
                let selkie = selkie.as_ref().expect("an event");
                unsynced |= e.id == 0;
                let _ = selkie.apply(&mut index);
                let event = dynamo_event(op).expect("an event");
                let _ = radix.apply_event(event.clone());
                pool.enqueue_event(event).expect("the indexer thread runs");
            }
        }
    }
    let interleaved = stream.shape.query_every > 0;
    if !interleaved {
        for q in 0..stream.queries.len() {
            ask(&mut index, &radix, q, &mut unsynced)?;
            checked += 1;
        }
    }
    // The concurrent tree, once every event is in (its writers run on a
    // thread of their own).
    runtime.block_on(pool.flush_and_wait()).expect("the indexer flushes");
    let concurrent = pool.backend();
    let final_queries: Vec<usize> = if interleaved {
        Vec::new()
    } else {
        (0..stream.queries.len()).collect()
    };
    let mut concurrent_differs = 0;
    for q in final_queries {
        let local: Vec<LocalBlockHash> = stream.queries[q].iter().map(|&h| LocalBlockHash(h)).collect();
        let b = concurrent.find_matches(&local, false);
        concurrent_differs += usize::from(first_difference(stream, q, |r| dynamo_score(&b, stream.ranks[r])).is_some());
    }
    pool.shutdown();
    if checked != stream.queries.len() {
        return Err(format!("{name}: {checked} of {} queries checked", stream.queries.len()));
    }
    Ok(concurrent_differs)
}

/// Builds selkie's index from the stream's events, synced to the service's
/// rows after each rank's first event (so that blocks go onto rows as they
/// are applied, as in a router that syncs before each query); seconds and
/// refused events.
fn build_selkie(events: &[Option<IndexEvent>], service: &WorkerSelectionService) -> (KvIndex, f64, usize) {
    let start = Instant::now();
    let mut index = KvIndex::new(BLOCK_SIZE);
    let refused = feed(events, &mut index, Some(service));
    (index, start.elapsed().as_secs_f64(), refused)
}

/// Runs the family; its rows, or what differed from the model.
pub fn run(runtime: &tokio::runtime::Runtime) -> Result<Vec<FamilyRow>, String> {
    let mut rows_out = Vec::new();
    for shape in &FAMILY {
        progress(format_args!("family: {}: generating", shape.name));
        let stream = Stream::generate(shape);
        let service = stream.service(BLOCK_SIZE);
        let selkie_events = stream.index_events();
        progress(format_args!("family: {}: checking every answer", shape.name));
        let concurrent_differs = check(&stream, &service, &selkie_events, runtime)?;

        progress(format_args!("family: {}: ingestion", shape.name));
        let (mut selkie_s, mut radix_s, mut concurrent_s) = (f64::MAX, f64::MAX, f64::MAX);
        let mut built = None;
        let mut refused = 0;
        for _ in 0..INGEST_TURNS {
            drop(built.take());
            let before = live();
            let (index, s, r) = build_selkie(&selkie_events, &service);
            selkie_s = selkie_s.min(s);
            refused = r;
            let selkie_bytes = live() - before;

            let before = live();
            let events: Vec<RouterEvent> = stream.ops.iter().filter_map(dynamo_event).collect();
            let start = Instant::now();
            let mut radix = RadixTree::new();
            for e in events {
                let _ = radix.apply_event(e);
            }
            radix_s = radix_s.min(start.elapsed().as_secs_f64());
            let radix_bytes = live() - before;

            let before = live();
            let (pool, s) = build_concurrent(stream.ops.iter().filter_map(dynamo_event).collect(), runtime);
            concurrent_s = concurrent_s.min(s);
            let concurrent_bytes = live() - before;
            built = Some((index, radix, pool, [selkie_bytes, radix_bytes, concurrent_bytes]));
        }
        let (index, radix, pool, [selkie_bytes, radix_bytes, concurrent_bytes]) = built.expect("a turn");

        let interleaved = shape.query_every > 0;
        let (selkie_query_ns, radix_query_ns, concurrent_query_ns) = if interleaved {
            // Its queries were asked of the index as it stood then.
            (f64::NAN, f64::NAN, f64::NAN)
        } else {
            progress(format_args!("family: {}: queries", shape.name));
            let locals: Vec<Vec<LocalBlockHash>> = stream
                .queries
                .iter()
                .map(|q| q.iter().map(|&h| LocalBlockHash(h)).collect())
                .collect();
            let concurrent = pool.backend();
            let n = stream.queries.len();
            let (mut i, mut j, mut k) = (0, 0, 0);
            let mut out = KvOverlaps::new();
            let [s, r, c] = TIMING.interleaved([
                &mut batch(|| {
                    i = (i + 1) % n;
                    let columns = index
                        .overlaps_for_local_hashes(black_box(&stream.queries[i]), &mut out)
                        .expect("rows are synced");
                    black_box(columns.device_blocks.len());
                }),
                &mut batch(|| {
                    j = (j + 1) % n;
                    black_box(radix.find_matches(black_box(locals[j].clone()), false));
                }),
                &mut batch(|| {
                    k = (k + 1) % n;
                    black_box(concurrent.find_matches(black_box(&locals[k]), false));
                }),
            ]);
            (s, r, c)
        };
        pool.shutdown();

        let mixed_ops = interleaved.then(|| {
            progress(format_args!("family: {}: events and queries in order", shape.name));
            mixed(&stream, &service, &selkie_events)
        });
        let credited: usize = stream.expected.iter().map(Vec::len).sum();
        rows_out.push(FamilyRow {
            shape: *shape,
            events: stream.event_count(),
            ranks: stream.ranks.len(),
            distinct: stream.distinct,
            entries: stream.entries,
            most_credited: stream.most_credited(),
            mean_credited: credited as f64 / stream.queries.len() as f64,
            refused,
            concurrent_differs: (!interleaved).then_some(concurrent_differs),
            selkie_eps: stream.event_count() as f64 / selkie_s,
            radix_eps: stream.event_count() as f64 / radix_s,
            concurrent_eps: stream.event_count() as f64 / concurrent_s,
            selkie_query_ns,
            radix_query_ns,
            concurrent_query_ns,
            selkie_bytes,
            radix_bytes,
            concurrent_bytes,
            mixed_ops,
        });
    }
    Ok(rows_out)
}

/// Events and queries in the stream's order, from empty indexes, the
/// fastest of a few turns taking turns: operations per second, selkie and
/// RadixTree. selkie syncs its rows before a query when a rank is new
/// since the last sync, as a router does when its fleet changes.
fn mixed(stream: &Stream, service: &WorkerSelectionService, selkie_events: &[Option<IndexEvent>]) -> (f64, f64) {
    let locals: Vec<Vec<LocalBlockHash>> = stream
        .queries
        .iter()
        .map(|q| q.iter().map(|&h| LocalBlockHash(h)).collect())
        .collect();
    let (mut best_selkie, mut best_radix) = (f64::MAX, f64::MAX);
    let mut out = KvOverlaps::new();
    for _ in 0..INGEST_TURNS {
        let start = Instant::now();
        let mut index = KvIndex::new(BLOCK_SIZE);
        let mut unsynced = false;
        for (op, e) in stream.ops.iter().zip(selkie_events) {
            match (op, e) {
                (StreamOp::Query(q), _) => {
                    if std::mem::take(&mut unsynced) {
                        index
                            .sync_rows(service.row_layout(), |r| service.row_of(r))
                            .expect("the index has the service's block size");
                    }
                    let columns = index
                        .overlaps_for_local_hashes(&stream.queries[*q], &mut out)
                        .expect("rows are synced");
                    black_box(columns.device_blocks.len());
                }
                (StreamOp::Event(_), Some(e)) => {
                    unsynced |= e.id() == 0;
                    let _ = black_box(e.apply(&mut index));
                }
                (StreamOp::Event(_), None) => unreachable!("every event was converted"),
            }
        }
        best_selkie = best_selkie.min(start.elapsed().as_secs_f64());
        drop(index);

        let events: Vec<Option<RouterEvent>> = stream.ops.iter().map(dynamo_event).collect();
        let start = Instant::now();
        let mut radix = RadixTree::new();
        for (op, e) in stream.ops.iter().zip(events) {
            match (op, e) {
                (StreamOp::Query(q), _) => {
                    black_box(radix.find_matches(locals[*q].clone(), false));
                }
                (StreamOp::Event(_), Some(e)) => {
                    let _ = black_box(radix.apply_event(e));
                }
                (StreamOp::Event(_), None) => unreachable!("every event was converted"),
            }
        }
        best_radix = best_radix.min(start.elapsed().as_secs_f64());
    }
    let ops = stream.ops.len() as f64;
    (ops / best_selkie, ops / best_radix)
}

/// Prints the family's tables.
pub fn report(rows: &[FamilyRow]) {
    println!("## Generated streams: branching prefixes, removals, duplicates, clears");
    println!();
    println!(
        "Each stream: requests of Zipf-popular documents (branching from {} system prompts, documents \
         continuing other documents) stored in parts from the first block a rank lacks, decode appends, \
         tail, middle and scattered removals, duplicate stores and removals, stores under unknown parents \
         (refused by every index) and clears; queries of 1 to 160 blocks (system prompts, requests, \
         chains a rank holds). Every answer of the three indexers was checked against a per-block model \
         of what each rank holds before anything was timed (interleaved stream: each query as the index \
         stood then): selkie's and RadixTree's equal. ConcurrentRadixTreeCompressed was asked the \
         queries once every event was in; \"Concurrent differs\" counts the queries it answered otherwise: \
         after a block is removed from under blocks its rank still holds, it still credits those (its \
         source marks that case as a known gap). Ingestion: every event into an empty index, the fastest of {INGEST_TURNS} \
         builds taking turns (selkie's includes syncing its rows at the end). Query: the stream's \
         queries in turn, median of {} interleaved batches. Bytes: live heap per distinct block held at \
         the end.",
        8, TIMING.rounds
    );
    println!();
    println!(
        "| stream | ranks | events | refused | distinct blocks | entries | ranks credited, mean / most | \
         Concurrent differs | selkie query ns | RadixTree ns | Concurrent ns | query ratio to the faster | selkie events/s | \
         RadixTree events/s | Concurrent events/s | ingestion ratio to RadixTree | selkie B/block | \
         RadixTree B/block | Concurrent B/block |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let per = |b: isize| b as f64 / r.distinct.max(1) as f64;
        let query = if r.selkie_query_ns.is_nan() {
            "- | - | - | -".to_string()
        } else {
            format!(
                "{:.0} | {:.0} | {:.0} | {:.1}x",
                r.selkie_query_ns,
                r.radix_query_ns,
                r.concurrent_query_ns,
                r.radix_query_ns.min(r.concurrent_query_ns) / r.selkie_query_ns
            )
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.0} / {} | {} | {query} | {:.0} | {:.0} | {:.0} | {:.2}x | {:.0} | {:.0} | {:.0} |",
            r.shape.name,
            r.ranks,
            r.events,
            r.refused,
            r.distinct,
            r.entries,
            r.mean_credited,
            r.most_credited,
            r.concurrent_differs
                .map_or("-".to_string(), |d| format!("{d} of {}", r.shape.queries)),
            r.selkie_eps,
            r.radix_eps,
            r.concurrent_eps,
            r.selkie_eps / r.radix_eps,
            per(r.selkie_bytes),
            per(r.radix_bytes),
            per(r.concurrent_bytes),
        );
    }
    for r in rows {
        if let Some((s, d)) = r.mixed_ops {
            println!();
            println!(
                "{}: a query after every {} events, in order from empty indexes: selkie {s:.0} operations/s, \
                 RadixTree {d:.0} ({:.2}x).",
                r.shape.name,
                r.shape.query_every,
                s / d
            );
        }
    }
    println!();
}
