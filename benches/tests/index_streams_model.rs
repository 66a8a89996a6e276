//! selkie's KV index against the per-block model of the generated streams
//! (`vs_dynamo_index`'s family, small): every query's device overlap, for
//! every rank, equals the model's.

use selkie::kv_index::{KvIndex, KvOverlaps};
use selkie_benches::index_streams::{Mix, Stream, StreamOp, StreamShape, BRANCHING, DECODE_HEAVY};

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
    let service = stream.service(16);
    let rows = stream.rows(&service);
    let mut index = KvIndex::new(16);
    let mut out = KvOverlaps::new();
    let mut ask = |index: &mut KvIndex, q: usize| -> Result<(), String> {
        index.sync_rows(service.row_layout(), |r| service.row_of(r)).unwrap();
        let columns = index.overlaps_for_local_hashes(&stream.queries[q], &mut out).unwrap();
        let want = stream.expected_dense(q);
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
    for (op, event) in stream.ops.iter().zip(stream.index_events()) {
        match (op, event) {
            (StreamOp::Query(q), _) => ask(&mut index, *q)?,
            (StreamOp::Event(_), Some(e)) => {
                let _ = e.apply(&mut index);
            }
            (StreamOp::Event(_), None) => unreachable!("every event converts"),
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
