//! A router's selection path end to end, the way a router embeds selkie:
//! workers from a discovery file, a KV index fed with the engines' cache
//! events, and per request: overlaps from the index, select (which books),
//! prefill done, decode blocks, release. Then an engine evicts the cached
//! prefix, and the next request goes by load.
//!
//! ```sh
//! cargo run -p selkie --example router
//! ```
//!
//! It checks its own outcomes and exits non-zero if one is wrong.

use std::error::Error;

use selkie::kv_index::{KvBlockHasher, KvEvent, KvEventData, KvIndex, KvOverlaps, StoredBlock};
use selkie::*;

/// The engines' KV block size, in tokens: the service, the hasher and the
/// index all use it.
const BLOCK_SIZE: u32 = 16;

fn main() -> Result<(), Box<dyn Error>> {
    // 1. The service: one per model, with the default KV policy.
    let policy = WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated);
    let service = WorkerSelectionService::new(
        policy,
        ServiceConfig {
            block_size: BLOCK_SIZE,
            ..Default::default()
        },
    );

    // 2. Workers from a discovery file, read once (a `DiscoveryPoller`
    //    re-reads it on a thread; here one refresh is enough).
    let dir = std::env::temp_dir().join(format!("selkie-example-router-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let workers_file = dir.join("workers.json");
    std::fs::write(
        &workers_file,
        r#"{ "workers": [
             { "worker_id": 1 },
             { "worker_id": 2 },
             { "worker_id": 3, "data_parallel_size": 2 }
           ] }"#,
    )?;
    let report = service.refresh(&mut FileDiscovery::new(&workers_file))?;
    let added = report.applied.map_or(0, |applied| applied.added.len());
    println!(
        "discovery: {added} workers added, {} records refused",
        report.refused.len()
    );
    assert_eq!(added, 3);

    // 3. The KV index, fed by the engines' events. Worker 3's rank 1
    //    stored the first 8 blocks (128 tokens) of a long system prompt.
    let hasher = KvBlockHasher::new(BLOCK_SIZE);
    let mut index = KvIndex::new(BLOCK_SIZE);
    let system_prompt: Vec<u32> = (0..128).map(|t| 1_000 + t).collect();
    let mut local = Vec::new();
    hasher.local_hashes(&system_prompt, &mut local);
    let blocks: Vec<StoredBlock> = local
        .iter()
        .enumerate()
        .map(|(i, &tokens_hash)| StoredBlock {
            block_hash: 0xE000 + i as u64,
            tokens_hash,
        })
        .collect();
    let cached_rank = WorkerWithDpRank::new(3, 1);
    let stored = KvEventData::Stored {
        parent: None,
        blocks: &blocks,
    };
    index.apply(&KvEvent::new(cached_rank, 0, stored))?;

    // 4. A request: the system prompt and a question. Sync the index to
    //    the service's rows (cheap when nothing changed), query it, select.
    let mut prompt = system_prompt.clone();
    prompt.extend(5_000..5_040);
    let mut overlaps = KvOverlaps::new();
    index.sync_rows(service.row_layout(), |rank| service.rank_row(rank))?;
    let request_overlaps = index.overlaps_for_tokens(&hasher, &prompt, &mut overlaps)?;
    let request = SelectionRequest::new(prompt.len()).with_row_overlaps(request_overlaps);
    let mut selection = service.select(&request)?;
    let cost_with_cache = selection.explanation().cost;
    println!("request 1 -> {}: {}", selection.worker(), selection.explanation());
    assert_eq!(selection.worker(), cached_rank, "the rank holding the prefix serves it");

    // 5. The request's life: the first token came back (prefill done), two
    //    blocks of output were generated, then it ended.
    selection.prefill_complete();
    selection.add_output_block()?;
    selection.add_output_block()?;
    let rank = |s: &WorkerSelectionService| s.worker_status(3).expect("worker 3 is known").ranks[1];
    let booked = rank(&service);
    println!(
        "while decoding, worker 3 rank 1: {} request, {} prefill tokens, {} decode blocks",
        booked.active_requests, booked.active_prefill_tokens, booked.active_decode_blocks
    );
    assert_eq!((booked.active_requests, booked.active_prefill_tokens), (1, 0));
    drop(selection); // released: nothing of it stays booked
    let released = rank(&service);
    assert_eq!((released.active_requests, released.active_decode_blocks), (0, 0));

    // 6. The engine evicted the prefix: the same prompt now costs its 8
    //    blocks more to prefill on every rank, and goes by load alone.
    let evicted: Vec<u64> = blocks.iter().map(|b| b.block_hash).collect();
    index.apply(&KvEvent::new(cached_rank, 1, KvEventData::Removed { blocks: &evicted }))?;
    index.sync_rows(service.row_layout(), |rank| service.rank_row(rank))?;
    let request_overlaps = index.overlaps_for_tokens(&hasher, &prompt, &mut overlaps)?;
    let request = SelectionRequest::new(prompt.len()).with_row_overlaps(request_overlaps);
    let selection = service.select(&request)?;
    println!(
        "request 2 (after the eviction) -> {}: {}",
        selection.worker(),
        selection.explanation()
    );
    assert_eq!(
        selection.explanation().cost - cost_with_cache,
        blocks.len() as f64,
        "no block is cached any more"
    );
    drop(selection);

    std::fs::remove_dir_all(&dir)?;
    println!("ok");
    Ok(())
}
