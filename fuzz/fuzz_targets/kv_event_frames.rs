//! `kv_event_frames`: the decoder of the engines' KV event messages
//! (`selkie::engine_events`) on arbitrary frames. The first
//! byte picks how many frames (0-4) the rest is cut into; every split is
//! decoded, and the payload alone too. Never a panic; a decoded message
//! keeps its documented bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use selkie::engine_events::{self as decode, EngineEvent};

fn check_events(events: &[EngineEvent]) {
    assert!(events.len() <= decode::MAX_EVENTS_PER_MESSAGE);
    for e in events {
        match e {
            EngineEvent::Stored(s) => {
                assert!(s.hashes.len() <= decode::MAX_BLOCKS_PER_EVENT);
                assert_eq!(s.token_ids.len() as u64, s.hashes.len() as u64 * u64::from(s.block_size));
                assert!(s.block_size > 0);
                assert!(s.extra_keys.is_empty() || s.extra_keys.len() == s.hashes.len());
            }
            EngineEvent::Removed { hashes, .. } => assert!(hashes.len() <= decode::MAX_BLOCKS_PER_EVENT),
            EngineEvent::Cleared => {}
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 5);
    // Frames: the topic (up to 4 bytes), the sequence number (8 bytes when
    // there is room), the payload (the rest), as many as `n` says.
    let mut frames: Vec<&[u8]> = Vec::new();
    let mut at = 0;
    for i in 0..n {
        let len = match i {
            0 => rest.len().min(2),
            1 => rest.len().saturating_sub(at).min(8),
            _ if i + 1 == n => rest.len() - at,
            _ => rest.len().saturating_sub(at).min(1),
        };
        frames.push(&rest[at..at + len]);
        at += len;
    }
    if let Ok(batch) = decode::decode_frames(&frames) {
        assert_eq!(n, 3);
        check_events(&batch.events);
    }
    if let Ok((_, events)) = decode::decode_payload(rest) {
        check_events(&events);
    }
});
