//! One generated stream of `vs_dynamo_index`'s family into selkie's KV
//! index alone, to profile ingestion and queries: each build applies every
//! event to an empty index, synced to the service's rows after each rank's
//! first event (as the bench times it), and prints its time and the
//! index's heap bytes per distinct block; then the stream's queries, in
//! turn, on the last build.
//!
//! ```text
//! cargo build --release -p selkie-benches --example stream_profile
//! target/release/examples/stream_profile 2 5 20000    # stream (0-5), builds, queries
//! valgrind --tool=callgrind --toggle-collect='*measured_build*' \
//!     target/release/examples/stream_profile 2 1
//! valgrind --tool=callgrind --toggle-collect='*measured_queries*' \
//!     target/release/examples/stream_profile 2 1 5000
//! ```
//!
//! A fourth argument, `late`, syncs the rows once, after every event: each
//! rank waits for its row until then, as when a fleet's engines report
//! before the router's first sync.
use std::hint::black_box;
use std::time::Instant;

use selkie::kv_index::{KvIndex, KvOverlaps};
use selkie::WorkerSelectionService;
use selkie_benches::index_streams::{feed, IndexEvent, Stream, FAMILY};

const BLOCK_SIZE: u32 = 16;

#[inline(never)]
fn measured_build(events: &[Option<IndexEvent>], service: &WorkerSelectionService, late: bool) -> KvIndex {
    let mut index = KvIndex::new(BLOCK_SIZE);
    feed(events, &mut index, (!late).then_some(service));
    if late {
        index
            .sync_rows(service.row_layout(), |r| service.row_of(r))
            .expect("the index has the service's block size");
    }
    index
}

#[inline(never)]
fn measured_queries(index: &KvIndex, stream: &Stream, n: usize, out: &mut KvOverlaps) {
    for i in 0..n {
        let q = &stream.queries[i % stream.queries.len()];
        let columns = index.overlaps_for_local_hashes(q, out).expect("rows are synced");
        black_box(columns.device_blocks.len());
    }
}

fn main() {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .map_or(default, |a| a.parse().expect("a number"))
    };
    let (which, builds, queries) = (arg(1, 2), arg(2, 1), arg(3, 0));
    let late = std::env::args().nth(4).as_deref() == Some("late");
    let shape = FAMILY
        .get(which)
        .unwrap_or_else(|| panic!("streams 0 to {}", FAMILY.len() - 1));
    let stream = Stream::generate(shape);
    let service = stream.service(BLOCK_SIZE);
    let events = stream.index_events();
    println!(
        "{}: {} events, {} distinct blocks held at the end, {} entries",
        shape.name,
        stream.event_count(),
        stream.distinct,
        stream.entries
    );
    let mut index = None;
    for _ in 0..builds.max(1) {
        drop(index.take());
        let start = Instant::now();
        let built = measured_build(&events, &service, late);
        let s = start.elapsed().as_secs_f64();
        println!(
            "build: {:.1} ms, {:.0} events/s, {:.0} heap bytes per distinct block",
            s * 1e3,
            stream.event_count() as f64 / s,
            built.heap_bytes() as f64 / stream.distinct as f64
        );
        index = Some(built);
    }
    let index = index.expect("a build");
    if queries > 0 {
        let mut out = KvOverlaps::new();
        let start = Instant::now();
        measured_queries(&index, &stream, queries, &mut out);
        println!(
            "queries: {:.0} ns each",
            start.elapsed().as_nanos() as f64 / queries as f64
        );
    }
}
