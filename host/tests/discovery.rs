//! Discovery: the registry's add / update / remove feeding the fleet, the
//! in-memory and file sources, the poller.

use std::time::Duration;

use selkie::*;

fn service(policy: WorkerSelectionPolicy) -> WorkerSelectionService {
    WorkerSelectionService::new(
        policy,
        ServiceConfig {
            seed: Some(7),
            ..ServiceConfig::default()
        },
    )
}

#[test]
fn add_update_remove_and_their_errors() {
    let s = service(WorkerSelectionPolicy::least_loaded());
    s.add_worker(WorkerRecord::new(1).with_dp(4, 2)).unwrap();
    assert!(matches!(
        s.add_worker(WorkerRecord::new(1)),
        Err(DiscoveryError::DuplicateWorker { worker_id: 1 })
    ));
    assert!(matches!(
        s.update_worker(WorkerRecord::new(9)),
        Err(DiscoveryError::UnknownWorker { worker_id: 9 })
    ));
    assert!(matches!(
        s.remove_worker(9),
        Err(DiscoveryError::UnknownWorker { worker_id: 9 })
    ));
    assert!(matches!(
        s.add_worker(WorkerRecord::new(2).with_dp(0, 0)),
        Err(DiscoveryError::InvalidWorker { worker_id: 2, .. })
    ));
    assert!(matches!(
        s.add_worker(WorkerRecord::new(3).with_capacity_weight(f32::NAN)),
        Err(DiscoveryError::InvalidWorker { worker_id: 3, .. })
    ));
    let st = s.worker_status(1).unwrap();
    assert_eq!(st.ranks.iter().map(|r| r.dp_rank).collect::<Vec<_>>(), vec![4, 5]);

    // Each rank is a row: two selections go to the two ranks.
    let req = SelectionRequest::new(16);
    let a = s.select(&req).unwrap();
    let b = s.select(&req).unwrap();
    assert_ne!(a.worker().dp_rank, b.worker().dp_rank);

    // Update keeping ranks keeps the load; changing ranks adds rows for the
    // new ranks only.
    s.update_worker(WorkerRecord::new(1).with_dp(4, 2).with_taint("x"))
        .unwrap();
    assert_eq!(
        s.worker_status(1)
            .unwrap()
            .ranks
            .iter()
            .map(|r| r.active_requests)
            .sum::<u32>(),
        2
    );
    s.update_worker(WorkerRecord::new(1).with_dp(0, 3)).unwrap();
    let st = s.worker_status(1).unwrap();
    assert_eq!(st.ranks.len(), 3);
    assert_eq!(st.ranks.iter().map(|r| r.active_requests).sum::<u32>(), 0);
    drop((a, b)); // guards of the old ranks release into their retired rows
    assert_eq!(
        s.worker_status(1)
            .unwrap()
            .ranks
            .iter()
            .map(|r| r.active_requests)
            .sum::<u32>(),
        0
    );

    s.remove_worker(1).unwrap();
    assert!(s.worker_status(1).is_none());
    assert_eq!(s.select(&req).unwrap_err(), SelectionError::NoEndpoints);
}

#[test]
fn removed_worker_slot_reuse_is_not_touched_by_old_guards() {
    let s = service(WorkerSelectionPolicy::least_loaded());
    s.add_worker(WorkerRecord::new(1)).unwrap();
    let old = s.select(&SelectionRequest::new(32)).unwrap();
    s.remove_worker(1).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap(); // likely reuses the row
    let new = s.select(&SelectionRequest::new(32)).unwrap();
    assert_eq!(new.worker().worker_id, 2);
    drop(old);
    assert_eq!(
        s.worker_status(2).unwrap().ranks[0].active_requests,
        1,
        "old guard must not release the new worker"
    );
    drop(new);
    assert_eq!(s.worker_status(2).unwrap().ranks[0].active_requests, 0);
}

#[test]
fn full_fleet_is_an_error() {
    let s = service(WorkerSelectionPolicy::random());
    let cap = FLEET_GROUPS * 8;
    s.add_worker(WorkerRecord::new(1).with_dp(0, cap as u32 - 1)).unwrap();
    let e = s.add_worker(WorkerRecord::new(2).with_dp(0, 2)).unwrap_err();
    assert!(
        matches!(
            e,
            DiscoveryError::FleetFull {
                worker_id: 2,
                needed: 2,
                ..
            }
        ),
        "{e}"
    );
    // The failed add rolled back its partial row: one row is still free.
    s.add_worker(WorkerRecord::new(3)).unwrap();
}

#[test]
fn sync_diffs_snapshots_and_rejects_bad_ones_atomically() {
    let s = service(WorkerSelectionPolicy::random());
    let r = s.sync(vec![WorkerRecord::new(1), WorkerRecord::new(2)]).unwrap();
    assert_eq!(r.added, vec![1, 2]);
    let r = s
        .sync(vec![WorkerRecord::new(2).with_taint("t"), WorkerRecord::new(3)])
        .unwrap();
    assert_eq!((r.added, r.updated, r.removed), (vec![3], vec![2], vec![1]));
    assert!(s
        .sync(vec![WorkerRecord::new(2).with_taint("t"), WorkerRecord::new(3)])
        .unwrap()
        .is_empty());
    let e = s.sync(vec![WorkerRecord::new(5), WorkerRecord::new(5)]).unwrap_err();
    assert!(matches!(e, DiscoveryError::DuplicateInSnapshot { worker_id: 5 }));
    assert_eq!(
        s.workers().iter().map(|w| w.worker_id).collect::<Vec<_>>(),
        vec![2, 3],
        "bad snapshot changed nothing"
    );
}

#[test]
fn in_memory_source_feeds_the_service() {
    let s = service(WorkerSelectionPolicy::random());
    let mut src = InMemoryDiscovery::with_workers(vec![WorkerRecord::new(1)]);
    let handle = src.clone();
    assert_eq!(s.refresh(&mut src).unwrap().applied.unwrap().added, vec![1]);
    assert!(s.refresh(&mut src).unwrap().applied.is_none());
    handle.upsert(WorkerRecord::new(2));
    handle.remove(1);
    let r = s.refresh(&mut src).unwrap().applied.unwrap();
    assert_eq!((r.added, r.removed), (vec![2], vec![1]));
}

fn temp_path(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("selkie-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_atomic(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[test]
fn file_source_json_and_toml_reload_on_change() {
    let dir = temp_path("file");
    let json = dir.join("workers.json");
    write_atomic(
        &json,
        r#"{"workers": [{"worker_id": 1, "data_parallel_size": 2, "taints": ["gpu=h200"], "lora_adapters": ["sql"],
            "busy_thresholds": {"active_decode_blocks": 100}, "labels": {"zone": "a"}}]}"#,
    );
    let mut src = FileDiscovery::new(&json);
    let snap = src.poll().unwrap().unwrap();
    assert_eq!(snap[0].data_parallel_size, 2);
    assert_eq!(snap[0].busy_thresholds.unwrap().active_decode_blocks, Some(100));
    assert!(src.poll().unwrap().is_none(), "unchanged file is not re-read");
    std::thread::sleep(Duration::from_millis(20));
    write_atomic(&json, r#"[{"worker_id": 1}, {"worker_id": 2, "device": "cpu"}]"#);
    let snap = src.poll().unwrap().unwrap();
    assert_eq!(snap.len(), 2);
    assert_eq!(snap[1].device, DeviceKind::Cpu);

    // A malformed file is an error; the next good version is picked up.
    std::thread::sleep(Duration::from_millis(20));
    write_atomic(&json, r#"{"workers": [{"worker_id": "x"}]}"#);
    assert!(matches!(src.poll(), Err(DiscoveryError::Parse { .. })));
    std::thread::sleep(Duration::from_millis(20));
    write_atomic(&json, r#"{"workers": []}"#);
    assert!(src.poll().unwrap().unwrap().is_empty());

    let toml = dir.join("workers.toml");
    write_atomic(
        &toml,
        "[[workers]]\nworker_id = 7\ndata_parallel_start_rank = 2\ncapacity_weight = 2.0\n",
    );
    #[cfg(feature = "toml")]
    {
        let snap = FileDiscovery::new(&toml).poll().unwrap().unwrap();
        assert_eq!(
            (
                snap[0].worker_id,
                snap[0].data_parallel_start_rank,
                snap[0].capacity_weight
            ),
            (7, 2, 2.0)
        );
    }
    // Without the `toml` feature, a TOML file is refused, naming it.
    #[cfg(not(feature = "toml"))]
    {
        let got = FileDiscovery::new(&toml).poll();
        assert!(
            matches!(&got, Err(DiscoveryError::FormatNotBuilt { path, feature: "toml", .. }) if *path == toml),
            "{got:?}"
        );
    }

    assert!(matches!(
        FileDiscovery::new(dir.join("missing.json")).poll(),
        Err(DiscoveryError::Io { .. })
    ));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn poller_applies_file_changes() {
    let dir = temp_path("poller");
    let path = dir.join("w.json");
    write_atomic(&path, r#"[{"worker_id": 1}]"#);
    let s = std::sync::Arc::new(service(WorkerSelectionPolicy::random()));
    let poller =
        DiscoveryPoller::spawn(s.clone(), Box::new(FileDiscovery::new(&path)), Duration::from_millis(5)).unwrap();
    let wait_for = |ids: &[u64]| {
        for _ in 0..400 {
            if s.workers().iter().map(|w| w.worker_id).collect::<Vec<_>>() == ids {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("workers never became {ids:?}: {:?}", s.workers());
    };
    wait_for(&[1]);
    std::thread::sleep(Duration::from_millis(20));
    write_atomic(&path, r#"[{"worker_id": 2}, {"worker_id": 3}]"#);
    wait_for(&[2, 3]);
    poller.stop();
    let _ = std::fs::remove_dir_all(dir);
}

/// A discovery file's `state` is the kernel's worker state, written in
/// lowercase; a worker without one is live, and the fleet takes the state the
/// file gives (a draining worker is not selected).
#[test]
fn discovery_files_give_workers_their_state() {
    let dir = std::env::temp_dir().join(format!("selkie-states-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("w.json");
    std::fs::write(
        &json,
        r#"{"workers": [{"worker_id": 1, "state": "draining"}, {"worker_id": 2, "state": "cordoned"}, {"worker_id": 3}]}"#,
    )
    .unwrap();
    let toml = dir.join("w.toml");
    std::fs::write(&toml, "[[workers]]\nworker_id = 1\nstate = \"draining\"\n[[workers]]\nworker_id = 2\nstate = \"cordoned\"\n[[workers]]\nworker_id = 3\n").unwrap();
    let paths = if cfg!(feature = "toml") {
        vec![&json, &toml]
    } else {
        vec![&json]
    };
    for path in paths {
        let records = FileDiscovery::new(path).poll().unwrap().unwrap();
        let states: Vec<_> = records.iter().map(|r| r.state).collect();
        assert_eq!(
            states,
            [WorkerState::Draining, WorkerState::Cordoned, WorkerState::Live],
            "{path:?}"
        );
        let s = service(WorkerSelectionPolicy::least_loaded());
        s.sync(records).unwrap();
        for _ in 0..4 {
            assert_eq!(s.select(&SelectionRequest::new(16)).unwrap().worker().worker_id, 3);
        }
    }
    // A state spelled otherwise refuses that record, naming the worker.
    std::fs::write(&json, r#"{"workers": [{"worker_id": 1, "state": "Draining"}]}"#).unwrap();
    let mut source = FileDiscovery::new(&json);
    assert_eq!(source.poll().unwrap(), Some(vec![]));
    assert!(matches!(
        &source.take_refused()[..],
        [DiscoveryError::FileRecordParse { worker_id: 1, line: 1, message, .. }] if message.contains("Draining")
    ));
    let _ = std::fs::remove_dir_all(dir);
}
