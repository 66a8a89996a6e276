//! Discovery under faults: records that cannot fit, snapshots that must
//! apply whole, files that are empty or rewritten in place, sources that
//! panic, and configs built to be slow to parse.

use std::sync::Arc;
use std::time::{Duration, Instant};

use selkie::*;

const CAPACITY: u32 = FLEET_GROUPS as u32 * 8;

/// Whether this build reads the file `name` (TOML needs the `toml`
/// feature).
fn toml_built(name: &str) -> bool {
    cfg!(feature = "toml") || !name.ends_with(".toml")
}

fn service() -> WorkerSelectionService {
    WorkerSelectionService::new(
        WorkerSelectionPolicy::least_loaded(),
        ServiceConfig {
            seed: Some(3),
            ..ServiceConfig::default()
        },
    )
}

fn ids(s: &WorkerSelectionService) -> Vec<WorkerId> {
    s.workers().iter().map(|w| w.worker_id).collect()
}

fn in_flight(s: &WorkerSelectionService, worker_id: WorkerId) -> u32 {
    s.worker_status(worker_id)
        .map_or(0, |st| st.ranks.iter().map(|r| r.active_requests).sum())
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("selkie-faults-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

// ---- finding 2: a record larger than the fleet -----------------------------

#[test]
fn a_record_larger_than_the_fleet_is_refused_before_allocating() {
    let s = service();
    let huge = WorkerRecord::new(9).with_dp(0, u32::MAX);
    let too_many = |e: DiscoveryError| {
        assert!(
            matches!(
                e,
                DiscoveryError::TooManyRanks {
                    worker_id: 9,
                    data_parallel_size: u32::MAX,
                    capacity,
                } if capacity == CAPACITY as usize
            ),
            "{e}"
        );
    };
    too_many(s.add_worker(huge.clone()).unwrap_err());
    s.add_worker(WorkerRecord::new(9)).unwrap();
    too_many(s.update_worker(huge.clone()).unwrap_err());
    too_many(s.sync(vec![huge]).unwrap_err());
    // One rank more than the fleet has rows is refused the same way.
    let e = s
        .add_worker(WorkerRecord::new(10).with_dp(0, CAPACITY + 1))
        .unwrap_err();
    assert!(matches!(e, DiscoveryError::TooManyRanks { worker_id: 10, .. }), "{e}");
    // And from a discovery file.
    let dir = temp_dir("huge");
    let path = dir.join("workers.json");
    std::fs::write(
        &path,
        r#"{"workers": [{"worker_id": 9, "data_parallel_size": 4294967295}]}"#,
    )
    .unwrap();
    // The file's source refuses that record on its own; worker 9 keeps the
    // record the source last delivered for it: none, so it leaves.
    let mut source = FileDiscovery::new(&path);
    let mut report = s.refresh(&mut source).unwrap();
    assert_eq!(report.applied.unwrap().removed, [9]);
    match report.refused.pop() {
        Some(DiscoveryError::FileRecordInvalid { path: p, source }) if p == path => too_many(*source),
        other => panic!("{other:?}"),
    }
    assert!(report.refused.is_empty());
    assert_eq!(ids(&s), Vec::<WorkerId>::new());
    let _ = std::fs::remove_dir_all(dir);
}

// ---- finding 3: a snapshot that validates but does not fit -----------------

#[test]
fn a_snapshot_that_does_not_fit_changes_nothing() {
    let s = service();
    s.sync((1..=4).map(WorkerRecord::new).collect()).unwrap();
    let held = s.select(&SelectionRequest::new(32)).unwrap();
    let booked = held.worker().worker_id;
    let e = s
        .sync(vec![
            WorkerRecord::new(3),
            WorkerRecord::new(4),
            WorkerRecord::new(5).with_dp(0, 10_000),
            WorkerRecord::new(6).with_dp(0, 10_000),
        ])
        .unwrap_err();
    assert!(matches!(e, DiscoveryError::FleetFull { .. }), "{e}");
    assert_eq!(ids(&s), vec![1, 2, 3, 4], "a refused snapshot changes nothing");
    assert_eq!(in_flight(&s, booked), 1, "the booking is still counted");
    drop(held);
    assert_eq!(in_flight(&s, booked), 0);
}

/// A full fleet whose snapshot grows one worker by a rank and shrinks the
/// other by one fits, and must apply in either order of the records (the
/// shrink frees the row the growth needs).
#[test]
fn a_snapshot_that_fits_applies_whatever_the_order_of_its_records() {
    let half = CAPACITY / 2;
    for order in [[1, 2], [2, 1]] {
        let s = service();
        s.sync(vec![
            WorkerRecord::new(1).with_dp(0, half),
            WorkerRecord::new(2).with_dp(0, half),
        ])
        .unwrap();
        let snapshot = order
            .iter()
            .map(|&id| match id {
                1 => WorkerRecord::new(1).with_dp(0, half + 1),
                _ => WorkerRecord::new(2).with_dp(0, half - 1),
            })
            .collect();
        let report = s.sync(snapshot).unwrap_or_else(|e| panic!("order {order:?}: {e}"));
        assert_eq!(report.updated, vec![1, 2]);
        let ranks = |id| s.worker_status(id).unwrap().ranks.len() as u32;
        assert_eq!((ranks(1), ranks(2)), (half + 1, half - 1));
    }
}

/// Ordering by the rows really freed: a worker whose dropped ranks are
/// still booked frees nothing (its rows are retired), so it must wait for
/// the worker that does free a row, whatever their ids.
#[test]
fn a_snapshot_frees_rows_before_taking_them_when_dropped_ranks_are_booked() {
    let s = service();
    s.sync(vec![
        WorkerRecord::new(1).with_dp(0, 3),
        WorkerRecord::new(2).with_dp(0, 2),
        WorkerRecord::new(3).with_dp(0, CAPACITY - 6),
    ])
    .unwrap();
    let held: Vec<_> = (0..3)
        .map(|rank| {
            s.select(&SelectionRequest::new(16).pinned_to_rank(WorkerWithDpRank::new(1, rank)))
                .unwrap()
        })
        .collect();
    // One row free. Worker 1 moves to ranks 3..5 (two new rows; its booked
    // rows are retired), worker 2 drops a rank (one row freed): it fits.
    let report = s
        .sync(vec![
            WorkerRecord::new(1).with_dp(3, 2),
            WorkerRecord::new(2).with_dp(0, 1),
            WorkerRecord::new(3).with_dp(0, CAPACITY - 6),
        ])
        .unwrap_or_else(|e| panic!("the snapshot fits: {e}"));
    assert_eq!(report.updated, vec![1, 2]);
    drop(held);
}

#[test]
fn a_refused_snapshot_is_delivered_again() {
    let s = service();
    s.add_worker(WorkerRecord::new(1).with_dp(0, CAPACITY)).unwrap();
    let held = s.select(&SelectionRequest::new(32)).unwrap();
    let mut source = InMemoryDiscovery::with_workers(vec![WorkerRecord::new(2).with_dp(0, CAPACITY)]);
    // Worker 1's booked row stays until the booking ends: no room for 2 yet.
    let e = s.refresh(&mut source).unwrap_err();
    assert!(matches!(e, DiscoveryError::FleetFull { worker_id: 2, .. }), "{e}");
    assert_eq!(ids(&s), vec![1]);
    let again = s.refresh(&mut source);
    assert!(again.is_err(), "the refused snapshot is polled again: {again:?}");
    drop(held);
    let report = s.refresh(&mut source).unwrap().applied.expect("delivered again");
    assert_eq!((report.added, report.removed), (vec![2], vec![1]));
    assert_eq!(ids(&s), vec![2]);
}

/// A custom source that delivers its snapshot once and then reports no
/// change (and does nothing when told of a refusal).
struct Once(Option<Vec<WorkerRecord>>);
impl Discovery for Once {
    fn poll(&mut self) -> Result<Option<Vec<WorkerRecord>>, DiscoveryError> {
        Ok(self.0.take())
    }
}

#[test]
fn the_service_retries_a_refused_snapshot_of_any_source() {
    let s = service();
    s.add_worker(WorkerRecord::new(1).with_dp(0, CAPACITY)).unwrap();
    let held = s.select(&SelectionRequest::new(32)).unwrap();
    let mut source = Once(Some(vec![WorkerRecord::new(2).with_dp(0, CAPACITY)]));
    assert!(
        s.refresh(&mut source).is_err(),
        "no room while worker 1's row is booked"
    );
    assert!(s.refresh(&mut source).is_err(), "retried, still no room");
    assert_eq!(ids(&s), vec![1]);
    drop(held);
    let report = s
        .refresh(&mut source)
        .unwrap()
        .applied
        .expect("the kept snapshot applies");
    assert_eq!((report.added, report.removed), (vec![2], vec![1]));
    assert_eq!(
        s.refresh(&mut source).unwrap().applied,
        None,
        "applied: nothing left to retry"
    );
}

#[test]
fn a_refused_file_is_read_again() {
    let dir = temp_dir("refused-file");
    let path = dir.join("workers.json");
    let s = service();
    s.add_worker(WorkerRecord::new(1).with_dp(0, CAPACITY)).unwrap();
    let held = s.select(&SelectionRequest::new(32)).unwrap();
    std::fs::write(
        &path,
        format!(r#"{{"workers": [{{"worker_id": 2, "data_parallel_size": {CAPACITY}}}]}}"#),
    )
    .unwrap();
    let mut source = FileDiscovery::new(&path);
    assert!(s.refresh(&mut source).is_err());
    drop(held);
    let report = s.refresh(&mut source).unwrap().applied.expect("the file is read again");
    assert_eq!(report.added, vec![2]);
    let _ = std::fs::remove_dir_all(dir);
}

// ---- one bad record in a file holds back no other change ------------------

#[test]
fn a_bad_record_in_a_discovery_file_holds_back_no_other_change() {
    let dir = temp_dir("bad-record");
    for (name, before, after) in [
        (
            "workers.json",
            r#"{"workers": [{"worker_id": 1}, {"worker_id": 3, "taints": ["old"]}]}"#,
            "{\"workers\": [\n  {\"worker_id\": 2},\n  {\"worker_id\": 3, \"colour\": \"blue\"},\n  \
             {\"worker_id\": 4, \"capacity_weight\": 0.0}\n]}",
        ),
        (
            "workers.toml",
            "[[workers]]\nworker_id = 1\n[[workers]]\nworker_id = 3\ntaints = [\"old\"]\n",
            "[[workers]]\nworker_id = 2\n[[workers]]\nworker_id = 3\ncolour = \"blue\"\n\
             [[workers]]\nworker_id = 4\ncapacity_weight = 0.0\n",
        ),
    ]
    .into_iter()
    .filter(|(name, ..)| toml_built(name))
    {
        let path = dir.join(name);
        let s = service();
        let mut source = FileDiscovery::new(&path);
        std::fs::write(&path, before).unwrap();
        s.refresh(&mut source).unwrap();
        assert_eq!(ids(&s), [1, 3], "{name}");
        // Worker 1 leaves and worker 2 joins; worker 3's record does not
        // parse and worker 4's is out of range: those two are refused, the
        // rest applies, and worker 3 keeps its last good record.
        std::fs::write(&path, after).unwrap();
        let outcome = s.refresh(&mut source);
        assert_eq!(ids(&s), [2, 3], "{name}: the refresh returned {outcome:?}");
        assert!(s.workers()[1].taints.contains("old"), "{name}");
        // Each refusal names the file, the worker and (for a parse) the
        // line its record starts on; each is reported once.
        let report = outcome.unwrap();
        assert_eq!(
            report.applied.unwrap(),
            SyncReport {
                added: vec![2],
                updated: vec![],
                removed: vec![1]
            }
        );
        match &report.refused[..] {
            [DiscoveryError::FileRecordParse {
                path: p,
                worker_id: 3,
                line,
                message,
            }, DiscoveryError::FileRecordInvalid { path: q, source }] => {
                assert_eq!((p, q), (&path, &path));
                assert!(message.contains("colour"), "{message}");
                assert_eq!(*line, 3);
                assert!(
                    matches!(**source, DiscoveryError::InvalidWorker { worker_id: 4, .. }),
                    "{source:?}"
                );
            }
            other => panic!("{name}: {other:?}"),
        }
        let again = s.refresh(&mut source).unwrap();
        assert!(again.applied.is_none() && again.refused.is_empty(), "{name}: {again:?}");
        // A repeated id is refused once, by id, and keeps its last record.
        let twice = if name.ends_with("json") {
            r#"[{"worker_id": 2}, {"worker_id": 3}, {"worker_id": 2, "taints": ["b"]}]"#
        } else {
            "[[workers]]\nworker_id = 2\n[[workers]]\nworker_id = 3\n[[workers]]\nworker_id = 2\ntaints = [\"b\"]\n"
        };
        std::fs::write(&path, twice).unwrap();
        let report = s.refresh(&mut source).unwrap();
        assert!(
            matches!(&report.refused[..], [DiscoveryError::FileRecordInvalid { source, .. }]
                if matches!(**source, DiscoveryError::DuplicateInSnapshot { worker_id: 2 })),
            "{name}: {report:?}"
        );
        assert_eq!(report.applied.unwrap().updated, [3], "{name}");
        assert_eq!(s.workers(), [WorkerRecord::new(2), WorkerRecord::new(3)], "{name}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_poller_counts_refused_records_and_stays_healthy() {
    let dir = temp_dir("poller-refused");
    let path = dir.join("workers.json");
    std::fs::write(
        &path,
        r#"[{"worker_id": 1}, {"worker_id": 2, "capacity_weight": -1.0}]"#,
    )
    .unwrap();
    let s = Arc::new(service());
    let poller =
        DiscoveryPoller::spawn(s.clone(), Box::new(FileDiscovery::new(&path)), Duration::from_millis(2)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while ids(&s) != [1] || poller.health().polls < 3 {
        assert!(Instant::now() < deadline, "worker 1 did not apply");
        std::thread::sleep(Duration::from_millis(2));
    }
    let health = poller.health();
    // Reported once (the file is unchanged since), and no poll failed.
    assert_eq!(health.records_refused, 1, "{health:?}");
    let last = health.last_refused.as_deref().unwrap();
    assert!(last.contains("workers.json") && last.contains("worker 2"), "{last}");
    assert!(health.is_healthy() && health.last_error.is_none(), "{health:?}");
    poller.stop();
    let _ = std::fs::remove_dir_all(dir);
}

// ---- finding 7: empty files, and workers that leave and come back ----------

#[test]
fn an_empty_discovery_file_is_refused_and_an_explicit_empty_list_is_not() {
    let dir = temp_dir("empty");
    for (name, text) in [
        ("a.toml", ""),
        ("b.toml", "  \n# nothing\n"),
        ("c.json", "{}"),
        ("d.json", " \n"),
    ]
    .into_iter()
    .filter(|(name, _)| toml_built(name))
    {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let got = FileDiscovery::new(&path).poll();
        assert!(
            matches!(&got, Err(DiscoveryError::EmptyFile { path: p }) if *p == path),
            "{name}: {got:?}"
        );
    }
    for (name, text) in [
        ("e.toml", "workers = []\n"),
        ("f.json", r#"{"workers": []}"#),
        ("g.json", "[]"),
    ]
    .into_iter()
    .filter(|(name, _)| toml_built(name))
    {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        assert_eq!(FileDiscovery::new(&path).poll().unwrap(), Some(vec![]), "{name}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_worker_that_leaves_and_comes_back_keeps_its_requests() {
    let s = service();
    let w = WorkerRecord::new(1).with_max_active_requests(1);
    s.add_worker(w.clone()).unwrap();
    let first = s.select(&SelectionRequest::new(32)).unwrap();
    s.remove_worker(1).unwrap();
    s.add_worker(w.clone()).unwrap();
    assert_eq!(in_flight(&s, 1), 1, "the revived rank still counts the request");
    let second = s.select(&SelectionRequest::new(32));
    assert!(
        matches!(second, Err(SelectionError::AllEligibleWorkersOverloaded)),
        "{second:?}"
    );
    // The same through a snapshot that drops the worker and one that restores it.
    assert_eq!(s.sync(vec![]).unwrap().removed, vec![1]);
    assert_eq!(s.sync(vec![w]).unwrap().added, vec![1]);
    let third = s.select(&SelectionRequest::new(32));
    assert!(
        matches!(third, Err(SelectionError::AllEligibleWorkersOverloaded)),
        "{third:?}"
    );
    drop(first);
    assert_eq!(in_flight(&s, 1), 0, "the old booking released into the revived row");
    s.select(&SelectionRequest::new(32)).unwrap();
}

#[test]
fn a_removed_worker_frees_its_rows_once_its_bookings_end() {
    let s = service();
    s.add_worker(WorkerRecord::new(1).with_dp(0, CAPACITY)).unwrap();
    let held = s.select(&SelectionRequest::new(32)).unwrap();
    s.remove_worker(1).unwrap();
    // One row is still held by the booking.
    assert!(matches!(
        s.add_worker(WorkerRecord::new(2).with_dp(0, CAPACITY)),
        Err(DiscoveryError::FleetFull { worker_id: 2, .. })
    ));
    s.add_worker(WorkerRecord::new(2).with_dp(0, CAPACITY - 1)).unwrap();
    drop(held);
    s.remove_worker(2).unwrap();
    s.add_worker(WorkerRecord::new(3).with_dp(0, CAPACITY)).unwrap();
    assert!(s.worker_status(1).is_none());
    assert_eq!(s.worker_status(3).unwrap().ranks.len(), CAPACITY as usize);
}

// ---- finding 8: a panicking source -----------------------------------------

struct PanicsFirst {
    left: u32,
}

impl Discovery for PanicsFirst {
    fn poll(&mut self) -> Result<Option<Vec<WorkerRecord>>, DiscoveryError> {
        if self.left > 0 {
            self.left -= 1;
            panic!("discovery backend exploded");
        }
        Ok(Some(vec![WorkerRecord::new(1)]))
    }
}

#[test]
fn a_panicking_source_is_contained_and_polled_again() {
    let s = Arc::new(service());
    let poller =
        DiscoveryPoller::spawn(s.clone(), Box::new(PanicsFirst { left: 3 }), Duration::from_millis(2)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    // The health is recorded just after the snapshot applies: wait for both.
    while ids(&s) != [1] || poller.health().polls < 4 {
        assert!(Instant::now() < deadline, "the poller stopped polling");
        std::thread::sleep(Duration::from_millis(2));
    }
    let health = poller.health();
    assert_eq!(health.panics, 3, "{health:?}");
    assert!(health.polls >= 4, "{health:?}");
    assert!(
        health.last_success.is_some() && health.consecutive_failures == 0,
        "{health:?}"
    );
    assert!(health.is_healthy());
    let last = health.last_error.expect("the panics were recorded");
    assert!(last.contains("discovery backend exploded"), "{last}");
    poller.stop();
}

// ---- finding 13: a same-length rewrite with the old mtime ------------------

#[test]
fn a_same_length_rewrite_with_the_old_mtime_is_seen() {
    let dir = temp_dir("same-mtime");
    let path = dir.join("workers.json");
    std::fs::write(&path, r#"[{"worker_id": 1}]"#).unwrap();
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let mut source = FileDiscovery::new(&path);
    assert_eq!(source.poll().unwrap().unwrap()[0].worker_id, 1);
    assert_eq!(source.poll().unwrap(), None);
    std::fs::write(&path, r#"[{"worker_id": 2}]"#).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let got = source.poll().unwrap().expect("the new content");
    assert_eq!(got[0].worker_id, 2);
    assert_eq!(source.poll().unwrap(), None, "unchanged since");
    let _ = std::fs::remove_dir_all(dir);
}

// ---- finding 14: error messages and parse bounds ---------------------------

#[test]
fn a_bare_list_with_a_bad_record_names_the_field() {
    let dir = temp_dir("bare-list");
    let path = dir.join("workers.json");
    std::fs::write(
        &path,
        "[\n  {\"worker_id\": 1},\n  {\"worker_id\": 2, \"colour\": 3}\n]",
    )
    .unwrap();
    // The record is refused on its own, by worker, field and line (and
    // column, counted in the file).
    let refused = |path: &std::path::Path| {
        let mut source = FileDiscovery::new(path);
        assert_eq!(source.poll().unwrap(), Some(vec![WorkerRecord::new(1)]));
        let refused = source.take_refused();
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(
            matches!(
                refused[0],
                DiscoveryError::FileRecordParse {
                    worker_id: 2,
                    line: 3,
                    ..
                }
            ),
            "{refused:?}"
        );
        refused[0].to_string()
    };
    let e = refused(&path);
    assert!(
        e.contains("worker 2") && e.contains("colour") && e.contains("at line 3 column 27"),
        "{e}"
    );
    // The wrapped form names it the same way.
    std::fs::write(
        &path,
        "{\"workers\": [\n  {\"worker_id\": 1},\n  {\"worker_id\": 2, \"colour\": 3}\n]}",
    )
    .unwrap();
    let e = refused(&path);
    assert!(
        e.contains("worker 2") && e.contains("colour") && e.contains("at line 3 column 27"),
        "{e}"
    );
    // A record that names no worker refuses the whole file, by line.
    std::fs::write(&path, "[\n  {\"worker_id\": 1},\n  {\"id\": 2}\n]").unwrap();
    let e = FileDiscovery::new(&path).poll().unwrap_err();
    assert!(
        matches!(&e, DiscoveryError::Parse { message, .. } if message.contains("line 3") && message.contains("names no worker")),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_deeply_nested_config_fails_fast() {
    // Tags, anchors, and quoted strings holding ` #` or an open quote
    // must not hide a level from the count (they did from a scanner that
    // interpreted them).
    for text in [
        "[".repeat(80_000),
        "{a: ".repeat(80_000),
        "- ".repeat(80_000),
        "!t [".repeat(40_000),
        (0..40_000).map(|i| format!("&a{i} [")).collect::<String>(),
        "[\" #\", ".repeat(40_000),
        format!("a: |\n  '\nb: {}", "[".repeat(40_000)),
    ] {
        let started = Instant::now();
        let e = WorkerSelectionConfig::from_yaml_str(&text).unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "took {:?}: {e}",
            started.elapsed()
        );
        assert!(
            matches!(e, ConfigError::TooDeep { depth, limit: MAX_CONFIG_DEPTH } if depth == MAX_CONFIG_DEPTH + 1),
            "{}: {e}",
            &text[..40]
        );
    }
    // Closing brackets inside strings cannot hide real nesting: the count
    // of brackets bounds the parser's work whatever the depth count says.
    let hidden = format!("{}\"{}\", ", "[".repeat(50), "]".repeat(50)).repeat(9_000);
    let started = Instant::now();
    let e = WorkerSelectionConfig::from_yaml_str(&hidden).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        matches!(e, ConfigError::TooManyCollections { count, limit: MAX_CONFIG_COLLECTIONS } if count == MAX_CONFIG_COLLECTIONS + 1),
        "{e}"
    );
    #[cfg(feature = "toml")]
    {
        let toml = format!("a = {}", "[".repeat(80_000));
        let e = WorkerSelectionConfig::from_toml_str(&toml).unwrap_err();
        assert!(matches!(e, ConfigError::TooDeep { .. }), "{e}");
    }
    // Over the size limit, whatever the content.
    let big = format!("# {}\n", "x".repeat(MAX_CONFIG_BYTES));
    let e = WorkerSelectionConfig::from_yaml_str(&big).unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::TooLarge {
                limit: MAX_CONFIG_BYTES,
                ..
            }
        ),
        "{e}"
    );
    // Real configs, quotes, comments and brackets inside values still parse.
    let yaml = "# roles\ndecode: 'b[al'\ninstances:\n  - name: 'b[al'   # a [ in a comment\n    type: least-loaded\n    parameters: {}\n";
    WorkerSelectionConfig::from_yaml_str(yaml).unwrap();
    let nested = format!(
        "decode: b\ninstances:\n  - {{ name: b, type: least-loaded, parameters: {{ x: {}1{} }} }}\n",
        "[".repeat(40),
        "]".repeat(40)
    );
    WorkerSelectionConfig::from_yaml_str(&nested).unwrap();
}
