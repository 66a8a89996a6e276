//! Decoder, hashing and ingestion tests on real vLLM 0.32 messages
//! (`tests/fixtures/vllm-0.32/`).

use std::sync::Arc;

use rmpv::Value;

use super::*;
use crate::kv_index::StorageTier;
use crate::{KvRouterConfig, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerType};

const SEQ0: &[u8] = include_bytes!("../../../tests/fixtures/vllm-0.32/seq-0.msgpack");
const SEQ1: &[u8] = include_bytes!("../../../tests/fixtures/vllm-0.32/seq-1.msgpack");
const SEQ2: &[u8] = include_bytes!("../../../tests/fixtures/vllm-0.32/seq-2.msgpack");
const SEQ13: &[u8] = include_bytes!("../../../tests/fixtures/vllm-0.32/seq-13.msgpack");
const SEQ14: &[u8] = include_bytes!("../../../tests/fixtures/vllm-0.32/seq-14.msgpack");

fn frames(seq: u64, payload: &[u8]) -> Vec<Vec<u8>> {
    vec![b"kv".to_vec(), seq.to_be_bytes().to_vec(), payload.to_vec()]
}

fn stored(batch: &EventBatch, i: usize) -> &StoredBlocks {
    match &batch.events[i] {
        EngineEvent::Stored(s) => s,
        other => panic!("event {i} is {other:?}, not a store"),
    }
}

#[test]
fn decodes_real_vllm_stores() {
    let b = decode_frames(&frames(0, SEQ0)).unwrap();
    assert_eq!((b.seq, b.dp_rank, b.events.len()), (0, 0, 1));
    let s = stored(&b, 0);
    assert_eq!(s.hashes.len(), 16);
    assert_eq!(s.hashes[0], 7016938561113329651);
    assert_eq!(s.hashes[15], 2285390191893585511);
    assert_eq!(s.parent, None);
    assert_eq!(s.token_ids.len(), 512);
    assert_eq!(&s.token_ids[..3], &[31671, 25501, 14444]);
    assert_eq!(
        (s.block_size, s.tier, s.lora_id, s.lora_name.as_deref()),
        (32, StorageTier::Device, None, None)
    );
    assert_eq!(s.extra_keys, vec![None; 16]);

    let b = decode_frames(&frames(1, SEQ1)).unwrap();
    let s = stored(&b, 0);
    assert_eq!(
        (s.parent, s.hashes.len(), s.token_ids.len()),
        (Some(8425546126898586422), 8, 256)
    );
}

#[test]
fn decodes_real_vllm_removals_with_repeats() {
    let b = decode_frames(&frames(13, SEQ13)).unwrap();
    let removed: Vec<u64> = b
        .events
        .iter()
        .filter_map(|e| match e {
            EngineEvent::Removed { hashes, tier } => {
                assert_eq!(*tier, StorageTier::Device);
                Some(hashes[0])
            }
            _ => None,
        })
        .collect();
    assert_eq!(removed.len(), 7);
    assert_eq!(removed.iter().filter(|&&h| h == 2285390191893585511).count(), 3);
    assert!(matches!(b.events.last(), Some(EngineEvent::Stored(_))));
    let b = decode_frames(&frames(14, SEQ14)).unwrap();
    assert_eq!(
        b.events,
        vec![EngineEvent::Removed {
            hashes: vec![14377724894557698010],
            tier: StorageTier::Device
        }]
    );
}

fn payload(events: Vec<Value>) -> Vec<u8> {
    payload_of_rank(events, 0)
}

fn payload_of_rank(events: Vec<Value>, rank: u32) -> Vec<u8> {
    let v = Value::Array(vec![Value::F64(1.5), Value::Array(events), Value::from(rank)]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).unwrap();
    out
}

#[test]
fn decodes_positional_events_digests_and_tiers() {
    let digest: Vec<u8> = (0u8..32).collect();
    let tokens: Vec<Value> = (0..8).map(Value::from).collect();
    let stored = Value::Array(vec![
        "BlockStored".into(),
        Value::Array(vec![Value::Binary(digest), 7.into()]),
        Value::Nil,
        Value::Array(tokens),
        4.into(),
        5.into(),
        "CPU".into(),
    ]);
    let removed = Value::Array(vec!["BlockRemoved".into(), Value::Array(vec![7.into()]), "DISK".into()]);
    let cleared = Value::Array(vec!["AllBlocksCleared".into()]);
    let b = decode_frames(&frames(9, &payload_of_rank(vec![stored, removed, cleared], 3))).unwrap();
    assert_eq!(b.dp_rank, 3);
    let s = stored_of(&b.events[0]);
    assert_eq!(
        s.hashes,
        vec![0x18191a1b1c1d1e1f, 7],
        "a digest's low 64 bits, big-endian"
    );
    assert_eq!((s.tier, s.lora_id, s.block_size), (StorageTier::Host, Some(5), 4));
    assert_eq!(
        b.events[1],
        EngineEvent::Removed {
            hashes: vec![7],
            tier: StorageTier::Disk
        }
    );
    assert_eq!(b.events[2], EngineEvent::Cleared);
}

fn stored_of(e: &EngineEvent) -> &StoredBlocks {
    match e {
        EngineEvent::Stored(s) => s,
        other => panic!("{other:?}"),
    }
}

fn map_event(kind: &str, fields: Vec<(&str, Value)>) -> Value {
    let mut m = vec![(Value::from("type"), Value::from(kind))];
    m.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
    Value::Map(m)
}

#[test]
fn refuses_bad_frames_with_reasons() {
    let reason = |f: &[Vec<u8>]| decode_frames(f).unwrap_err().reason();
    assert_eq!(reason(&frames(0, SEQ0)[..2]), "frame_count");
    assert_eq!(reason(&[b"kv".to_vec(), vec![0; 7], SEQ0.to_vec()]), "sequence_frame");
    assert_eq!(reason(&frames(0, &SEQ0[..100])), "msgpack");
    assert_eq!(reason(&frames(0, &[0xd9])), "msgpack");
    assert_eq!(
        reason(&frames(0, &payload(vec![map_event("BlockMoved", vec![])]))),
        "unknown_event"
    );
    let hashes = |n: u64| Value::Array((0..n).map(Value::from).collect());
    let tokens = |n: u64| Value::Array((0..n).map(|_| Value::from(1)).collect());
    let store = |h: u64, t: u64, medium: &str| {
        payload(vec![map_event(
            "BlockStored",
            vec![
                ("block_hashes", hashes(h)),
                ("token_ids", tokens(t)),
                ("block_size", 4.into()),
                ("medium", medium.into()),
            ],
        )])
    };
    assert!(decode_frames(&frames(0, &store(2, 8, "GPU"))).is_ok());
    assert_eq!(reason(&frames(0, &store(2, 7, "GPU"))), "token_count");
    assert_eq!(reason(&frames(0, &store(2, 8, "NVME"))), "medium");
    assert_eq!(
        reason(&frames(
            0,
            &store(crate::engine_events::MAX_BLOCKS_PER_EVENT as u64 + 1, 0, "GPU")
        )),
        "too_many_blocks"
    );
    assert_eq!(
        reason(&frames(0, &vec![0x90; crate::engine_events::MAX_PAYLOAD_BYTES + 1])),
        "too_large"
    );
    // Deep nesting is refused, not a stack overflow.
    let mut deep = vec![0x91; 100_000];
    deep.push(0xc0);
    assert_eq!(reason(&frames(0, &deep)), "msgpack");
}

/// vLLM's `sha256_cbor` chain over the first sample's 512 tokens, as
/// vLLM's algorithm computes it in Python (`hashlib.sha256` of canonical
/// CBOR `[parent digest, [tokens], None]`, first parent the digest of CBOR
/// `"vllm-none-hash"` or of the `PYTHONHASHSEED` text).
const CBOR_CHAIN: [u64; 16] = [
    5627697702181365110,
    4951240671860997671,
    1199395083739420214,
    14111539687743190747,
    5118053131632369023,
    7618655085583753798,
    15383809780974716480,
    14254407582771040235,
    4702472631184560839,
    6864393828814654247,
    17515070709343461575,
    2837582585126391667,
    10356032534748636109,
    15892692929952253714,
    5940528928381991538,
    8100177800858333943,
];
const CBOR_CHAIN_SEED_12345: [u64; 4] = [
    11488906354528426854,
    18399101135999544860,
    6479725787821239959,
    1054127915539166446,
];

#[test]
fn sha256_cbor_chain_matches_vllm() {
    let b = decode_frames(&frames(0, SEQ0)).unwrap();
    let tokens = &stored(&b, 0).token_ids;
    let mut out = Vec::new();
    Sha256CborChain::new(32, None).block_hashes(tokens, &mut out);
    assert_eq!(out, CBOR_CHAIN);
    Sha256CborChain::new(32, Some("12345")).block_hashes(&tokens[..128 + 5], &mut out);
    assert_eq!(
        out, CBOR_CHAIN_SEED_12345,
        "whole blocks only, from the seeded NONE_HASH"
    );
    assert_eq!(
        KvHashing::parse("engine-sha256-cbor:12345"),
        Some(KvHashing::EngineSha256Cbor {
            seed: Some("12345".into())
        })
    );
    assert_eq!(KvHashing::parse("tokens"), Some(KvHashing::Tokens));
    assert_eq!(KvHashing::parse("sha256"), None);
}

#[test]
fn specs_parse_with_the_bind_rule() {
    let s = KvEventsSpec::parse("http://e1:8000=tcp://*:5557,replay=tcp://e1:5558,topic=kv").unwrap();
    assert_eq!(s.endpoint, "tcp://*:5557");
    assert!(s.bind, "host * binds");
    assert_eq!((s.replay.as_deref(), s.topic.as_str()), (Some("tcp://e1:5558"), "kv"));
    let s = KvEventsSpec::parse("http://e1:8000=tcp://e1:5557").unwrap();
    assert!(!s.bind, "a named host connects");
    assert!(
        KvEventsSpec::parse("http://e1:8000=tcp://127.0.0.1:5557,mode=bind")
            .unwrap()
            .bind
    );
    for bad in [
        "http://e1:8000",
        "e1=tcp://x:1",
        "http://e1:8000=http://x:1",
        "http://e1:8000=tcp://x:1,foo=1",
    ] {
        assert!(KvEventsSpec::parse(bad).is_err(), "{bad}");
    }
}

const URL: &str = "http://127.0.0.1:9";

fn ingester(
    hashing: KvHashing,
    block_size: u32,
) -> (
    EventIngester,
    EventOverlaps,
    Arc<WorkerSelectionService>,
    KvEventMetrics,
) {
    let service = Arc::new(WorkerSelectionService::new(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        ServiceConfig {
            block_size,
            ..ServiceConfig::default()
        },
    ));
    let id = WorkerUrl::parse(URL).unwrap().default_id();
    service.add_worker(WorkerRecord::new(id)).unwrap();
    let metrics = KvEventMetrics::default();
    let (i, o) = EventIngester::new(
        hashing,
        1 << 20,
        service.clone(),
        Arc::new(WorkerTable::new()),
        metrics.clone(),
    );
    (i, o, service, metrics)
}

fn feed(i: &mut EventIngester, seq: u64, payload: &[u8], continuity: Continuity) {
    let batch = decode_frames(&frames(seq, payload)).unwrap();
    i.ingest(&Ingested {
        worker: URL.into(),
        batch,
        continuity,
    });
}

fn device_overlap(o: &EventOverlaps, service: &WorkerSelectionService, sequence: &[u64]) -> f32 {
    let mut out = KvOverlaps::new();
    let row = service
        .row_of(WorkerWithDpRank::new(WorkerUrl::parse(URL).unwrap().default_id(), 0))
        .unwrap();
    let cols = o.overlaps(service, sequence, &mut out).expect("overlaps");
    cols.device_blocks[row]
}

fn prompt_sequence(hashing: &KvHashing, tokens: &[u32]) -> Vec<u64> {
    let mut p = PromptHasherForTest::new(hashing);
    p.blocks(tokens)
}

struct PromptHasherForTest(super::super::prompt::PromptHasher);

impl PromptHasherForTest {
    fn new(hashing: &KvHashing) -> Self {
        let p = super::super::prompt::PromptHasher::new(32, None, None, 1 << 20, 1 << 20);
        Self(match hashing {
            KvHashing::Tokens => p,
            KvHashing::EngineSha256Cbor { seed } => p.with_engine_chain(Sha256CborChain::new(32, seed.as_deref())),
        })
    }
    fn blocks(&mut self, tokens: &[u32]) -> Vec<u64> {
        self.0.blocks_of(tokens).sequence
    }
}

#[test]
fn real_events_feed_overlaps_removals_resolve() {
    let hashing = KvHashing::Tokens;
    let (mut i, o, service, metrics) = ingester(hashing.clone(), 32);
    let b0 = decode_frames(&frames(0, SEQ0)).unwrap();
    let prompt = stored(&b0, 0).token_ids.clone();
    let seq = prompt_sequence(&hashing, &prompt);
    assert_eq!(device_overlap(&o, &service, &seq), 0.0);
    feed(&mut i, 0, SEQ0, Continuity::Next);
    assert_eq!(device_overlap(&o, &service, &seq), 16.0);
    feed(&mut i, 1, SEQ1, Continuity::Next);
    assert_eq!(device_overlap(&o, &service, &seq), 16.0, "after seq 1");
    // seq 2 stores the last block of seq 0's prompt again (same hash).
    feed(&mut i, 2, SEQ2, Continuity::Next);
    assert_eq!(device_overlap(&o, &service, &seq), 16.0);
    // seq 13 removes that block three times (two copies held): gone.
    feed(&mut i, 13, SEQ13, Continuity::Next);
    assert_eq!(device_overlap(&o, &service, &seq), 15.0);
    assert_eq!(metrics.refused_count(URL, "block_size"), 0);
    // A restart at 0 starts the rank clean.
    feed(&mut i, 0, SEQ14, Continuity::Restart);
    assert_eq!(device_overlap(&o, &service, &seq), 0.0);
}

#[test]
fn engine_chain_mode_keys_by_engine_hash() {
    // A store whose hashes are the sha256_cbor chain of its tokens meets a
    // request hashed the same way.
    let hashing = KvHashing::EngineSha256Cbor { seed: None };
    let (mut i, o, service, _) = ingester(hashing.clone(), 32);
    let b0 = decode_frames(&frames(0, SEQ0)).unwrap();
    let prompt = stored(&b0, 0).token_ids.clone();
    let event = map_event(
        "BlockStored",
        vec![
            (
                "block_hashes",
                Value::Array(CBOR_CHAIN[..4].iter().map(|&h| Value::from(h)).collect()),
            ),
            (
                "token_ids",
                Value::Array(prompt[..128].iter().map(|&t| Value::from(t)).collect()),
            ),
            ("block_size", 32.into()),
        ],
    );
    feed(&mut i, 0, &payload(vec![event]), Continuity::Next);
    let seq = prompt_sequence(&hashing, &prompt);
    assert_eq!(device_overlap(&o, &service, &seq), 4.0);
    // The same store in tokens mode does not key by these hashes.
    let seq_tokens = prompt_sequence(&KvHashing::Tokens, &prompt);
    assert_eq!(device_overlap(&o, &service, &seq_tokens), 0.0);
}

#[test]
fn block_size_mismatch_is_refused_and_counted() {
    let (mut i, o, service, metrics) = ingester(KvHashing::Tokens, 16);
    feed(&mut i, 0, SEQ0, Continuity::Next);
    assert_eq!(metrics.refused_count(URL, "block_size"), 1);
    let b0 = decode_frames(&frames(0, SEQ0)).unwrap();
    let mut local = Vec::new();
    crate::kv_index::KvBlockHasher::new(16).local_hashes(&stored(&b0, 0).token_ids, &mut local);
    let mut seq = Vec::new();
    crate::kv_index::sequence_hashes_of(&local, &mut seq);
    assert_eq!(
        device_overlap(&o, &service, &seq),
        0.0,
        "nothing stored from the mismatched engine"
    );
}

#[test]
fn lost_messages_drop_the_rank() {
    let hashing = KvHashing::Tokens;
    let (mut i, o, service, _) = ingester(hashing.clone(), 32);
    let b0 = decode_frames(&frames(0, SEQ0)).unwrap();
    let seq = prompt_sequence(&hashing, &stored(&b0, 0).token_ids);
    feed(&mut i, 0, SEQ0, Continuity::Next);
    assert_eq!(device_overlap(&o, &service, &seq), 16.0);
    feed(&mut i, 5, SEQ14, Continuity::Lost);
    assert_eq!(
        device_overlap(&o, &service, &seq),
        0.0,
        "blocks stop counting after a lost gap"
    );
    // Rebuilt as the engine reports: the prefix stored again counts.
    feed(&mut i, 6, SEQ0, Continuity::Next);
    assert_eq!(device_overlap(&o, &service, &seq), 16.0);
}

#[test]
fn a_prompt_being_prefilled_counts_for_its_rank_until_its_first_token() {
    let (mut i, o, service, _) = ingester(KvHashing::Tokens, 32);
    feed(
        &mut i,
        0,
        b"\x93\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x90\x00",
        Continuity::Next,
    );
    let rank = WorkerWithDpRank::new(WorkerUrl::parse(URL).unwrap().default_id(), 0);
    let prompt = PromptBlocks {
        tokens: 4 * 32,
        local: vec![1, 2, 3, 4],
        sequence: vec![11, 12, 13, 14],
    };
    assert_eq!(
        device_overlap(&o, &service, &prompt.sequence),
        0.0,
        "nothing reported yet"
    );
    let ticket = o.in_flight(rank, &prompt);
    assert!(ticket.is_some());
    // A prompt sharing the first three blocks: credited three while the
    // first prefills, though no event has told them.
    assert_eq!(device_overlap(&o, &service, &[11, 12, 13, 99]), 3.0);
    assert_eq!(
        device_overlap(&o, &service, &[12, 13]),
        0.0,
        "only a shared prefix counts"
    );
    drop(ticket);
    assert_eq!(
        device_overlap(&o, &service, &[11, 12, 13, 99]),
        0.0,
        "the credit ends with the ticket"
    );
}
