//! selkie's KV index against the per-block model of the generated streams
//! (`vs_dynamo_index`'s family, small): every query's device overlap, for
//! every rank, equals the model's.

use selkie::kv_index::{KvEvent, KvEventData, KvIndex, KvOverlaps, StoredBlock};
use selkie::{
    KvRouterConfig, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService, WorkerType,
    WorkerWithDpRank,
};
use selkie_benches::index_streams::{Mix, Stream, StreamData, StreamOp, StreamShape, BRANCHING, DECODE_HEAVY};

fn shape(mix: Mix, query_every: usize, seed: u64) -> StreamShape {
    StreamShape {
        name: "small",
        workers: 12,
        dp: 2,
        events: 4_000,
        queries: 600,
        query_every,
        mix,
        seed,
    }
}

/// Applies the stream to a fresh index and checks every answer; the first
/// difference, if any.
fn check(stream: &Stream) -> Result<(), String> {
    let service = WorkerSelectionService::new(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        ServiceConfig {
            block_size: 16,
            ..ServiceConfig::default()
        },
    );
    service
        .sync(
            (0..stream.shape.workers as u64)
                .map(|w| WorkerRecord::new(w).with_dp(0, stream.shape.dp))
                .collect(),
        )
        .unwrap();
    let rows: Vec<usize> = stream
        .ranks
        .iter()
        .map(|&(w, d)| service.row_of(WorkerWithDpRank::new(w, d)).unwrap())
        .collect();
    let mut index = KvIndex::new(16);
    let mut out = KvOverlaps::new();
    let mut ask = |index: &mut KvIndex, q: usize| -> Result<(), String> {
        index.sync_rows(service.row_layout(), |r| service.row_of(r)).unwrap();
        let columns = index.overlaps_for_local_hashes(&stream.queries[q], &mut out).unwrap();
        let mut want = vec![0u32; rows.len()];
        for &(r, n) in &stream.expected[q] {
            want[r as usize] = n;
        }
        for (r, &row) in rows.iter().enumerate() {
            let got = columns.device_blocks[row] as u32;
            if got != want[r] {
                return Err(format!(
                    "query {q} ({} blocks): rank {:?}: the model says {}, selkie {got}",
                    stream.queries[q].len(),
                    stream.ranks[r],
                    want[r]
                ));
            }
        }
        Ok(())
    };
    for op in &stream.ops {
        match op {
            StreamOp::Query(q) => ask(&mut index, *q)?,
            StreamOp::Event(e) => {
                let rank = WorkerWithDpRank::new(e.rank.0, e.rank.1);
                let blocks: Vec<StoredBlock>;
                let data = match &e.data {
                    StreamData::Stored { parent, blocks: b } => {
                        blocks = b
                            .iter()
                            .map(|&(block_hash, tokens_hash)| StoredBlock {
                                block_hash,
                                tokens_hash,
                            })
                            .collect();
                        KvEventData::Stored {
                            parent: *parent,
                            blocks: &blocks,
                        }
                    }
                    StreamData::Removed(h) => KvEventData::Removed { blocks: h },
                    StreamData::Cleared => KvEventData::Cleared,
                };
                let _ = index.apply(&KvEvent::new(rank, e.id, data));
            }
        }
    }
    if stream.shape.query_every == 0 {
        for q in 0..stream.queries.len() {
            ask(&mut index, q)?;
        }
    }
    Ok(())
}

#[test]
fn branching_streams_answer_as_the_model() {
    for seed in 0..4 {
        let stream = Stream::generate(&shape(BRANCHING, 0, seed));
        check(&stream).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
}

#[test]
fn decode_heavy_streams_answer_as_the_model() {
    let stream = Stream::generate(&shape(DECODE_HEAVY, 0, 9));
    check(&stream).unwrap();
}

#[test]
fn interleaved_streams_answer_as_the_model_at_every_query() {
    let stream = Stream::generate(&shape(BRANCHING, 5, 11));
    check(&stream).unwrap();
}
