//! Harness of the `discovery_file` fuzz target, shared with the regression
//! replay in `host/tests/fuzz_regressions.rs`.
//!
//! Arbitrary bytes as a discovery file (`.json` or `.toml`), read by the
//! real [`FileDiscovery`] from a file on disk and applied with
//! [`WorkerSelectionService::refresh`]: a typed [`DiscoveryError`], never a
//! panic; a record refused on its own is left out of the snapshot. A
//! service that already holds a worker with a booking on it is
//! unchanged by a refused snapshot; after an accepted one its workers equal
//! the parsed records, a least-loaded selection succeeds or fails with a
//! typed error and lands on a live rank of the file, and once every booking
//! is dropped every counter is zero.

use std::path::PathBuf;

use arbitrary::Arbitrary;
use selkie::*;

/// The fuzzer's bytes as they are: bit 0 of the first byte picks TOML, the
/// rest is the file (so a seed or regression file is `\x00` or `\x01`
/// followed by the text). `Debug` prints a pasteable reproducer.
pub struct Input {
    pub toml: bool,
    pub bytes: Vec<u8>,
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut arbitrary::Unstructured<'a>) -> arbitrary::Result<Self> {
        let toml = u8::arbitrary(u)? & 1 == 1;
        let bytes = u.bytes(u.len())?.to_vec();
        Ok(Input { toml, bytes })
    }
}

impl std::fmt::Debug for Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Input {{ toml: {}, bytes: b\"{}\".to_vec() }}",
            self.toml,
            self.bytes.escape_ascii()
        )
    }
}

fn file_path(toml: bool) -> PathBuf {
    let name = format!(
        "selkie-fuzz-discovery-{}-{:?}.{}",
        std::process::id(),
        std::thread::current().id(),
        if toml { "toml" } else { "json" }
    );
    std::env::temp_dir().join(name.replace(['(', ')'], ""))
}

fn zero_load(service: &WorkerSelectionService) {
    for w in service.workers() {
        for r in service.worker_status(w.worker_id).expect("registered").ranks {
            assert_eq!(
                (r.active_requests, r.active_prefill_tokens, r.active_decode_blocks),
                (0, 0, 0),
                "worker {} rank {} leaked load",
                w.worker_id,
                r.dp_rank
            );
        }
    }
}

/// Writes the file, polls it, syncs it; panics on any deviation.
pub fn check(input: &Input) {
    let path = file_path(input.toml);
    std::fs::write(&path, &input.bytes).expect("write the discovery file");
    let mut source = FileDiscovery::new(&path);
    let parsed = source.poll();
    // Records refused on their own name a worker the snapshot leaves out
    // (a fresh source has no last good record to keep for it).
    for e in source.take_refused() {
        let worker_id = match &e {
            DiscoveryError::FileRecordParse { worker_id, .. } => *worker_id,
            DiscoveryError::FileRecordInvalid { source, .. } => match **source {
                DiscoveryError::InvalidWorker { worker_id, .. }
                | DiscoveryError::TooManyRanks { worker_id, .. }
                | DiscoveryError::DuplicateInSnapshot { worker_id } => worker_id,
                ref other => panic!("a record refused for {other:?}"),
            },
            other => panic!("a record refused with {other:?}"),
        };
        let Ok(Some(records)) = &parsed else {
            panic!("refusals without a snapshot: {parsed:?}")
        };
        assert!(
            records.iter().all(|r| r.worker_id != worker_id),
            "worker {worker_id} was refused but delivered"
        );
    }
    let service = WorkerSelectionService::new(
        WorkerSelectionPolicy::least_loaded(),
        ServiceConfig {
            seed: Some(5),
            ..ServiceConfig::default()
        },
    );
    let baseline = WorkerRecord::new(u64::MAX).with_dp(0, 2);
    service.add_worker(baseline.clone()).unwrap();
    let held = service.select(&SelectionRequest::new(32)).expect("baseline selects");
    let refreshed = service.refresh(&mut FileDiscovery::new(&path));
    let _ = std::fs::remove_file(&path);
    let records = match (parsed, refreshed) {
        (Err(DiscoveryError::Parse { path: p, .. }), Err(DiscoveryError::Parse { .. })) => {
            assert_eq!(p, path);
            assert_eq!(service.workers(), vec![baseline], "a refused file changes nothing");
            return;
        }
        (Err(DiscoveryError::FormatNotBuilt { path: p, .. }), Err(DiscoveryError::FormatNotBuilt { .. })) => {
            assert!(
                input.toml && !cfg!(feature = "toml"),
                "only TOML is ever left out of a build"
            );
            assert_eq!(p, path);
            assert_eq!(service.workers(), vec![baseline], "a file not read changes nothing");
            return;
        }
        (Err(DiscoveryError::EmptyFile { path: p }), Err(DiscoveryError::EmptyFile { .. })) => {
            assert_eq!(p, path);
            assert_eq!(
                service.workers(),
                vec![baseline],
                "a file without a workers list changes nothing"
            );
            return;
        }
        (Err(DiscoveryError::Io { .. }), Err(DiscoveryError::Io { .. })) => {
            assert!(
                std::str::from_utf8(&input.bytes).is_err(),
                "only non-UTF-8 files fail to read"
            );
            return;
        }
        (Ok(Some(records)), Err(e)) => {
            // The source delivers only valid records of distinct workers:
            // what the service can still refuse is a snapshot too big for
            // the fleet.
            let mut ids: Vec<_> = records.iter().map(|r| r.worker_id).collect();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), records.len(), "a worker delivered twice");
            assert!(
                records.iter().all(|r| r.validate().is_ok()),
                "an invalid record delivered"
            );
            match e {
                DiscoveryError::FleetFull { worker_id, .. } => {
                    assert!(records.iter().any(|r| r.worker_id == worker_id));
                    let ranks: u64 = records.iter().map(|r| u64::from(r.data_parallel_size)).sum();
                    assert!(
                        ranks > FLEET_GROUPS as u64 * 8 - 2,
                        "{ranks} ranks do not fill the fleet"
                    );
                    assert_eq!(
                        service.workers(),
                        vec![baseline],
                        "a snapshot that does not fit changes nothing"
                    );
                }
                e => panic!("sync: unexpected error kind {e:?}"),
            }
            drop(held);
            zero_load(&service);
            return;
        }
        (
            Ok(Some(records)),
            Ok(RefreshReport {
                applied: Some(report), ..
            }),
        ) => {
            assert_eq!(
                report.removed.contains(&u64::MAX),
                !records.iter().any(|r| r.worker_id == u64::MAX)
            );
            records
        }
        (parsed, refreshed) => panic!("poll gave {parsed:?} but refresh gave {refreshed:?}"),
    };
    let mut want = records.clone();
    want.sort_by_key(|r| r.worker_id);
    assert_eq!(service.workers(), want, "workers after sync equal the file's records");
    // Select until the fleet refuses; every choice is a live rank of the file.
    let mut bookings = vec![held];
    for _ in 0..8 {
        match service.select(&SelectionRequest::new(100)) {
            Ok(s) => {
                let w = s.worker();
                let r = want
                    .iter()
                    .find(|r| r.worker_id == w.worker_id)
                    .expect("chose a worker of the file");
                assert!(r.dp_ranks().contains(&w.dp_rank), "{w} is not a rank of {r:?}");
                assert_eq!(r.state, WorkerState::Live, "chose {w}, which is {:?}", r.state);
                assert!(!s.explanation().cost.is_nan(), "NaN cost: {:?}", s.explanation());
                bookings.push(s);
            }
            Err(
                SelectionError::NoEndpoints
                | SelectionError::AllEligibleWorkersOverloaded
                | SelectionError::NoEligibleWorkers { .. },
            ) => break,
            Err(e) => panic!("least-loaded selection: unexpected error {e:?}"),
        }
    }
    drop(bookings);
    zero_load(&service);
}
