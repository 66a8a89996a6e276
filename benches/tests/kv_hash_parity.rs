//! selkie's request block hashes equal dynamo-kv-router 1.6.1's
//! (`compute_block_hash_for_seq` and `compute_seq_hash_for_block`) on
//! seeded random token sequences, block sizes, LoRA adapter names, cache
//! namespaces, Eagle mode and multimodal objects.
//!
//! ```text
//! cargo test -p selkie-benches --features dynamo --test kv_hash_parity
//! ```
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, compute_seq_hash_for_block, BlockExtraInfo, BlockHashOptions, BlockMmObjectInfo,
};
use selkie::kv_index::{sequence_hashes_of, KvBlockHasher};
use selkie_kernel::Rng;

/// Dynamo's local and sequence hashes.
fn dynamo_hashes(
    tokens: &[u32],
    block_size: u32,
    lora: Option<&str>,
    namespace: Option<&str>,
    eagle: bool,
    mm: Option<&[Option<BlockExtraInfo>]>,
) -> (Vec<u64>, Vec<u64>) {
    let options = BlockHashOptions {
        block_mm_infos: mm,
        lora_name: lora,
        cache_namespace: namespace,
        is_eagle: Some(eagle),
    };
    let local = compute_block_hash_for_seq(tokens, block_size, options);
    let seq = compute_seq_hash_for_block(&local);
    (local.into_iter().map(|h| h.0).collect(), seq)
}

/// selkie's local and sequence hashes.
fn selkie_hashes(
    tokens: &[u32],
    block_size: u32,
    lora: Option<&str>,
    namespace: Option<&str>,
    eagle: bool,
    mm: &[&[u64]],
) -> (Vec<u64>, Vec<u64>) {
    let mut hasher = KvBlockHasher::new(block_size).with_eagle(eagle);
    if let Some(lora) = lora {
        hasher = hasher.with_lora(lora);
    }
    if let Some(namespace) = namespace {
        hasher = hasher.with_cache_namespace(namespace);
    }
    let (mut local, mut seq, mut chained) = (Vec::new(), Vec::new(), Vec::new());
    hasher.local_hashes_with_mm(tokens, mm, &mut local);
    hasher.sequence_hashes_with_mm(tokens, mm, &mut seq);
    sequence_hashes_of(&local, &mut chained);
    assert_eq!(seq, chained, "sequence hashes from tokens and from local hashes differ");
    (local, seq)
}

fn name(rng: &mut Rng) -> Option<String> {
    match rng.below(4) {
        0 => None,
        1 => Some(String::new()),
        _ => Some(
            (0..1 + rng.below(24))
                .map(|_| (b'a' + rng.below(26) as u8) as char)
                .collect(),
        ),
    }
}

#[test]
fn block_hashes_equal_dynamo_on_random_requests() {
    let mut rng = Rng::new(0x5e1c_1e4a);
    let mut blocks_checked = 0usize;
    for case in 0..4_000 {
        let block_size = [1u32, 2, 3, 4, 7, 16, 32, 64][rng.below(8) as usize];
        let len = rng.below(40 * u64::from(block_size) + 3) as usize;
        let vocab = [2u64, 50, 1 << 17, 1 << 32][rng.below(4) as usize];
        let tokens: Vec<u32> = (0..len).map(|_| rng.below(vocab) as u32).collect();
        let lora = name(&mut rng);
        let namespace = name(&mut rng);
        let eagle = rng.below(5) == 0;
        let blocks = KvBlockHasher::new(block_size).with_eagle(eagle).block_count(len);
        // Multimodal objects on about a third of the requests.
        let with_mm = rng.below(3) == 0;
        let mm_hashes: Vec<Vec<u64>> = (0..blocks)
            .map(|_| {
                if with_mm && rng.below(3) == 0 {
                    (0..rng.below(4)).map(|_| rng.next_u64()).collect()
                } else {
                    Vec::new()
                }
            })
            .collect();
        let dynamo_mm: Vec<Option<BlockExtraInfo>> = mm_hashes
            .iter()
            .map(|hashes| {
                (!hashes.is_empty()).then(|| BlockExtraInfo {
                    mm_objects: hashes
                        .iter()
                        .map(|&mm_hash| BlockMmObjectInfo {
                            mm_hash,
                            offsets: vec![(0, 1)],
                        })
                        .collect(),
                })
            })
            .collect();
        let selkie_mm: Vec<&[u64]> = mm_hashes.iter().map(Vec::as_slice).collect();
        let d = dynamo_hashes(
            &tokens,
            block_size,
            lora.as_deref(),
            namespace.as_deref(),
            eagle,
            with_mm.then_some(dynamo_mm.as_slice()),
        );
        let s = selkie_hashes(
            &tokens,
            block_size,
            lora.as_deref(),
            namespace.as_deref(),
            eagle,
            &selkie_mm,
        );
        assert_eq!(
            s, d,
            "case {case}: block size {block_size}, {len} tokens, lora {lora:?}, namespace {namespace:?}, eagle {eagle}"
        );
        blocks_checked += d.0.len();
    }
    println!("4000 requests, {blocks_checked} blocks: local and sequence hashes equal Dynamo's");
}

/// The comparison is not vacuous: hashing with another seed (a LoRA name
/// dropped) or with the partial last block included differs from Dynamo.
#[test]
fn a_wrong_seed_or_a_partial_block_differs() {
    let tokens: Vec<u32> = (0..70).collect();
    let d = dynamo_hashes(&tokens, 16, Some("adapter"), None, false, None);
    let s = selkie_hashes(&tokens, 16, None, None, false, &[]);
    assert_ne!(s.0, d.0);
    let mut padded = tokens.clone();
    padded.resize(80, 0);
    let d = dynamo_hashes(&tokens, 16, None, None, false, None);
    let s = selkie_hashes(&padded, 16, None, None, false, &[]);
    assert_ne!(s.0.len(), d.0.len());
}

/// Prints the fixed vectors committed in selkie's own unit tests
/// (`kv_index::tests::hashes_equal_dynamo_vectors`), computed by Dynamo.
#[test]
fn print_fixed_vectors() {
    let tokens: Vec<u32> = (1..=40).collect();
    for (block_size, lora, namespace) in [
        (4u32, None, None),
        (16, None, None),
        (16, Some("sql-lora"), None),
        (16, None, Some("tenant-a")),
        (16, Some("sql-lora"), Some("tenant-a")),
    ] {
        let (local, seq) = dynamo_hashes(&tokens, block_size, lora, namespace, false, None);
        println!("({block_size}, {lora:?}, {namespace:?}, &{local:?}, &{seq:?}),");
    }
}
