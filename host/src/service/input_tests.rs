//! What meets the service from outside: a KV index and a block hasher
//! (each with its own block size), a request's block hashes.

use std::time::Instant;

use crate::kv_index::{
    ApproxKvIndex, KvBlockHasher, KvEvent, KvEventData, KvIndex, KvOverlaps, KvQueryError, StoredBlock,
};
use crate::{
    KvRouterConfig, PrefixHashConfig, RowOverlaps, SelectionError, SelectionRequest, ServiceConfig, WorkerOverlap,
    WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService, WorkerType, WorkerWithDpRank,
};

/// A kv service (block size 16) with workers 1 and 2.
fn kv_service() -> WorkerSelectionService {
    let service = WorkerSelectionService::new(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        ServiceConfig::default(),
    );
    service.add_worker(WorkerRecord::new(1)).unwrap();
    service.add_worker(WorkerRecord::new(2)).unwrap();
    service
}

/// `index` learns that worker 2 holds `tokens`, hashed by `hasher`.
fn store(index: &mut KvIndex, hasher: &KvBlockHasher, tokens: &[u32]) {
    let (mut local, mut seq) = (Vec::new(), Vec::new());
    hasher.local_hashes(tokens, &mut local);
    hasher.sequence_hashes(tokens, &mut seq);
    let blocks: Vec<StoredBlock> = seq
        .iter()
        .zip(&local)
        .map(|(&block_hash, &tokens_hash)| StoredBlock {
            block_hash,
            tokens_hash,
        })
        .collect();
    let stored = KvEventData::Stored {
        parent: None,
        blocks: &blocks,
    };
    index
        .apply(&KvEvent::new(WorkerWithDpRank::new(2, 0), 0, stored))
        .unwrap();
}

/// A kv service of 16, and an index and hasher of `block_size` in which
/// worker 2 holds the first 256 tokens of a 512-token prompt.
fn half_held(block_size: u32) -> (WorkerSelectionService, KvBlockHasher, KvIndex, Vec<u32>) {
    let (hasher, mut index) = (KvBlockHasher::new(block_size), KvIndex::new(block_size));
    let prompt: Vec<u32> = (0..512).collect();
    store(&mut index, &hasher, &prompt[..256]);
    (kv_service(), hasher, index, prompt)
}

/// Worker 2's KV cost for a 512-token prompt whose first 256 tokens it
/// holds, as an index and hasher of 16 report them to a service of 16.
#[test]
fn an_index_of_the_service_block_size_counts_its_blocks() {
    let (service, hasher, mut index, prompt) = half_held(16);
    index.sync_rows(service.row_layout(), |r| service.rank_row(r)).unwrap();
    let mut out = KvOverlaps::new();
    let columns = index.overlaps_for_tokens(&hasher, &prompt, &mut out).unwrap();
    let req = SelectionRequest::new(prompt.len()).with_row_overlaps(columns);
    service.check_request(&req).unwrap();
    let costs = service.costs(&req).unwrap();
    // 16 of the prompt's 32 blocks left to prefill, and its 32 decode
    // blocks (an index of 32 behind this service once gave 24 + 32).
    assert_eq!(costs.iter().find(|(w, _)| w.worker_id == 2).unwrap().1, 48.0);
}

#[test]
fn an_index_of_another_block_size_is_refused() {
    let (service, hasher, mut index, prompt) = half_held(32);
    let err = index
        .sync_rows(service.row_layout(), |r| service.rank_row(r))
        .unwrap_err();
    assert_eq!(err, KvQueryError::BlockSizeMismatch { index: 32, service: 16 });
    assert_eq!(
        err.to_string(),
        "the KV index counts blocks of 32 tokens but the service blocks of 16: build the index with the service's \
         block size"
    );
    // Refused whole: the index has no layout, so no query counts anything.
    let mut out = KvOverlaps::new();
    assert_eq!(
        index.overlaps_for_tokens(&hasher, &prompt, &mut out).unwrap_err(),
        KvQueryError::NoRowLayout
    );
    // The shared index and the approximate one refuse it too.
    let (mut writer, _reader) = crate::kv_index::shared(32);
    assert_eq!(
        writer.sync_rows(service.row_layout(), |r| service.rank_row(r)),
        Err(KvQueryError::BlockSizeMismatch { index: 32, service: 16 })
    );
    let mut approx = ApproxKvIndex::new(8);
    assert_eq!(
        approx.sync_rows(service.row_layout(), |r| service.row_of(r)),
        Err(KvQueryError::BlockSizeMismatch { index: 8, service: 16 })
    );
}

#[test]
fn a_hasher_of_another_block_size_is_refused() {
    let service = kv_service();
    let mut index = KvIndex::new(16);
    index.sync_rows(service.row_layout(), |r| service.rank_row(r)).unwrap();
    let prompt: Vec<u32> = (0..512).collect();
    let mut out = KvOverlaps::new();
    let err = index
        .overlaps_for_tokens(&KvBlockHasher::new(32), &prompt, &mut out)
        .unwrap_err();
    assert_eq!(err, KvQueryError::HasherBlockSize { hasher: 32, index: 16 });
    let mut approx = ApproxKvIndex::new(16);
    assert_eq!(
        approx.record_tokens(
            WorkerWithDpRank::new(2, 0),
            &KvBlockHasher::new(32),
            &prompt,
            Instant::now()
        ),
        Err(KvQueryError::HasherBlockSize { hasher: 32, index: 16 })
    );
    assert_eq!(approx.index().block_count(), 0, "nothing recorded");
}

#[test]
fn block_hashes_cut_at_a_smaller_block_size_are_refused_by_check_request() {
    let service = kv_service();
    let prompt: Vec<u32> = (0..512).collect();
    let (mut at_16, mut at_8) = (Vec::new(), Vec::new());
    KvBlockHasher::new(16).sequence_hashes(&prompt, &mut at_16);
    KvBlockHasher::new(8).sequence_hashes(&prompt, &mut at_8);
    let req = |blocks| SelectionRequest::new(prompt.len()).with_prompt_blocks(blocks);
    assert_eq!(service.check_request(&req(&at_16)), Ok(()));
    assert_eq!(
        service.check_request(&req(&at_8)),
        Err(SelectionError::PromptBlocksPastPrompt {
            hashes: 64,
            limit: 32,
            block_size: 16
        })
    );
}

#[test]
fn kv_refuses_block_hashes_it_cannot_look_up() {
    let service = kv_service();
    let blocks = [11u64, 12, 13, 14];
    let bare = SelectionRequest::new(64).with_prompt_blocks(&blocks);
    let refused = SelectionError::PromptBlocksUnused { policy: "kv" };
    assert_eq!(service.costs(&bare).unwrap_err(), refused);
    assert_eq!(service.select(&bare).err(), Some(refused.clone()));
    assert_eq!(service.peek(&bare).err(), Some(refused.clone()));
    assert_eq!(
        refused.to_string(),
        "the kv policy reads cache overlaps, not block hashes: look the request's prompt_blocks up in a KV index \
         and pass its overlaps (with_row_overlaps or with_overlaps), or leave prompt_blocks off"
    );
    // With overlaps (even none on any worker's row, or a column of zeros)
    // the hashes are merely unused; without hashes, nothing is refused.
    let nobody = [WorkerOverlap::device(WorkerWithDpRank::new(99, 0), 4, 16)];
    assert!(service.select(&bare.with_overlaps(&nobody)).is_ok());
    let layout = service.row_layout();
    let zeros = vec![0.0f32; layout.rows()];
    assert!(service
        .select(&bare.with_row_overlaps(RowOverlaps::new(layout, &zeros)))
        .is_ok());
    assert!(service.select(&SelectionRequest::new(64)).is_ok());
    // Policies that read block hashes take them.
    for policy in [
        WorkerSelectionPolicy::prefix_hash(PrefixHashConfig::default()).unwrap(),
        WorkerSelectionPolicy::least_loaded(),
    ] {
        let service = WorkerSelectionService::new(policy, ServiceConfig::default());
        service.add_worker(WorkerRecord::new(1)).unwrap();
        assert!(service.select(&bare).is_ok());
    }
}
