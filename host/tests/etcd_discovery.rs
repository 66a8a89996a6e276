//! Discovery from etcd against real servers (feature `etcd`).
//!
//! Most tests use the etcd named by `SELKIE_ETCD_ENDPOINTS` (`.ci/run`
//! starts one), each under a prefix of its own; the restart test runs its
//! own `etcd` (`SELKIE_ETCD_BIN`, or `etcd` on the PATH) so that it can
//! stop and start it. Without them a test prints a `SKIPPED:` line (to the
//! real stderr, past the test harness's capture) and returns.

mod servers;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use etcd_client::{Client, CompactionOptions, GetOptions};
use selkie::*;

/// The shared server's endpoints, or `None` after printing why the test is
/// skipped.
fn endpoints(test: &str) -> Option<Vec<String>> {
    let v = servers::server_env(
        "SELKIE_ETCD_ENDPOINTS",
        test,
        "etcd tests need SELKIE_ETCD_ENDPOINTS (a running etcd; .ci/run starts one)",
    )?;
    Some(v.split(',').map(|e| e.trim().to_owned()).collect())
}

/// A prefix no other test (or earlier run) uses.
fn unique_prefix(test: &str) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    format!("/selkie-test/{test}/{}-{nanos}/", std::process::id())
}

fn service() -> Arc<WorkerSelectionService> {
    Arc::new(WorkerSelectionService::new(
        WorkerSelectionPolicy::least_loaded(),
        ServiceConfig::default(),
    ))
}

fn ids(service: &WorkerSelectionService) -> Vec<u64> {
    service.workers().iter().map(|w| w.worker_id).collect()
}

/// Waits up to `limit` for `done`, checking every 20 ms.
fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A plain etcd client for the test's own writes (bad records, deletes,
/// compaction), on a runtime of its own.
struct Raw {
    rt: tokio::runtime::Runtime,
    client: Client,
}

impl Raw {
    fn connect(endpoints: &[String]) -> Raw {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let client = rt.block_on(Client::connect(endpoints, None)).unwrap();
        Raw { rt, client }
    }

    /// Puts `value` at `key`; returns the revision it made.
    fn put(&mut self, key: &str, value: impl Into<Vec<u8>>) -> i64 {
        let r = self.rt.block_on(self.client.put(key, value, None)).unwrap();
        r.header().unwrap().revision()
    }

    fn put_record(&mut self, prefix: &str, record: &WorkerRecord) -> i64 {
        self.put(
            &format!("{prefix}{}", record.worker_id),
            serde_json::to_vec(record).unwrap(),
        )
    }

    fn delete(&mut self, key: &str) -> i64 {
        let r = self.rt.block_on(self.client.delete(key, None)).unwrap();
        r.header().unwrap().revision()
    }

    fn get(&mut self, key: &str) -> Option<Vec<u8>> {
        let r = self.rt.block_on(self.client.get(key, None)).unwrap();
        r.kvs().first().map(|kv| kv.value().to_vec())
    }

    fn count(&mut self, prefix: &str) -> usize {
        let r = self
            .rt
            .block_on(self.client.get(prefix, Some(GetOptions::new().with_prefix())))
            .unwrap();
        r.kvs().len()
    }

    fn compact(&mut self, revision: i64) {
        self.rt
            .block_on(
                self.client
                    .compact(revision, Some(CompactionOptions::new().with_physical())),
            )
            .unwrap();
    }
}

/// Refreshes `service` from `source` until `done` holds, collecting the
/// errors the refreshes returned and the refused records they reported.
fn refresh_until(
    service: &WorkerSelectionService,
    source: &mut EtcdDiscovery,
    what: &str,
    mut done: impl FnMut(&WorkerSelectionService, &[DiscoveryError]) -> bool,
) -> Vec<DiscoveryError> {
    let mut errors = Vec::new();
    wait_until(what, Duration::from_secs(30), || {
        match service.refresh(source) {
            Ok(report) => errors.extend(report.refused),
            Err(e) => errors.push(e),
        }
        done(service, &errors)
    });
    errors
}

#[test]
fn an_unreachable_etcd_is_a_typed_error_naming_it() {
    // Needs no server: a loopback port nothing listens on.
    let dead = [format!("http://127.0.0.1:{}", servers::ports::free_port())];
    let options = EtcdOptions::default().with_timeout(Duration::from_millis(300));
    let started = Instant::now();
    let e = EtcdDiscovery::connect_with(&dead, "/w/", options.clone())
        .err()
        .unwrap();
    assert!(
        matches!(&e, DiscoveryError::EtcdUnavailable { endpoints, .. } if *endpoints == dead[0]),
        "{e:?}"
    );
    assert_eq!(e.reason(), "etcd_unavailable");
    let e = EtcdRegistration::register_with(&dead, "/w/", WorkerRecord::new(1), Duration::from_secs(5), options)
        .err()
        .unwrap();
    assert!(matches!(e, DiscoveryError::EtcdUnavailable { .. }), "{e:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    // An invalid record is refused before any connection is tried.
    let e = EtcdRegistration::register(&dead, "/w/", WorkerRecord::new(2).with_dp(0, 0), Duration::from_secs(5))
        .err()
        .unwrap();
    assert!(matches!(e, DiscoveryError::InvalidWorker { worker_id: 2, .. }), "{e:?}");
}

#[test]
fn registered_workers_join_update_and_leave_the_fleet() {
    let Some(endpoints) = endpoints("registered_workers_join_update_and_leave_the_fleet") else {
        return;
    };
    let prefix = unique_prefix("register");
    let service = service();
    let source = EtcdDiscovery::connect(&endpoints, prefix.as_str()).unwrap();
    let poller = DiscoveryPoller::spawn(service.clone(), Box::new(source), Duration::from_millis(20)).unwrap();
    let ttl = Duration::from_secs(10);
    let one = EtcdRegistration::register(&endpoints, &prefix, WorkerRecord::new(1).with_dp(0, 2), ttl).unwrap();
    let two =
        EtcdRegistration::register(&endpoints, &prefix, WorkerRecord::new(2).with_taint("gpu=h200"), ttl).unwrap();
    assert_eq!(one.key(), format!("{prefix}1"));
    wait_until("both workers are in the fleet", Duration::from_secs(10), || {
        ids(&service) == [1, 2]
    });
    assert_eq!(service.worker_status(1).unwrap().ranks.len(), 2);

    // The stored value is a discovery file's record.
    let mut raw = Raw::connect(&endpoints);
    let stored: WorkerRecord = serde_json::from_slice(&raw.get(one.key()).unwrap()).unwrap();
    assert_eq!(stored, WorkerRecord::new(1).with_dp(0, 2));

    // An update reaches the fleet; a record of another worker is refused.
    let draining = WorkerRecord::new(1)
        .with_dp(0, 2)
        .with_state(WorkerState::Draining)
        .with_lora("sql");
    one.update(draining.clone()).unwrap();
    wait_until("worker 1's update is in the fleet", Duration::from_secs(10), || {
        service.workers().first() == Some(&draining)
    });
    assert!(matches!(
        one.update(WorkerRecord::new(3)),
        Err(DiscoveryError::EtcdKeyMismatch { worker_id: 3, .. })
    ));
    assert!(matches!(
        one.update(WorkerRecord::new(1).with_dp(0, 0)),
        Err(DiscoveryError::InvalidWorker { worker_id: 1, .. })
    ));

    // Revoking deletes the key at once; the worker leaves.
    let key_two = two.key().to_owned();
    two.revoke().unwrap();
    assert_eq!(raw.get(&key_two), None);
    wait_until("worker 2 has left the fleet", Duration::from_secs(10), || {
        ids(&service) == [1]
    });

    // Dropping a registration revokes it too.
    drop(one);
    assert_eq!(raw.count(&prefix), 0);
    wait_until("worker 1 has left the fleet", Duration::from_secs(10), || {
        ids(&service).is_empty()
    });
    assert!(poller.health().is_healthy(), "{:?}", poller.health());
    poller.stop();
}

#[test]
fn an_expired_lease_removes_the_worker() {
    let Some(endpoints) = endpoints("an_expired_lease_removes_the_worker") else {
        return;
    };
    let prefix = unique_prefix("lease");
    let service = service();
    let source = EtcdDiscovery::connect(&endpoints, prefix.as_str()).unwrap();
    let poller = DiscoveryPoller::spawn(service.clone(), Box::new(source), Duration::from_millis(20)).unwrap();
    let ttl = Duration::from_secs(2);
    let stays = EtcdRegistration::register(&endpoints, &prefix, WorkerRecord::new(1), Duration::from_secs(30)).unwrap();
    let dies = EtcdRegistration::register(&endpoints, &prefix, WorkerRecord::new(2), ttl).unwrap();
    wait_until("both workers are in the fleet", Duration::from_secs(10), || {
        ids(&service) == [1, 2]
    });

    // Kept alive, the short lease outlives its TTL several times over.
    std::thread::sleep(3 * ttl);
    assert_eq!(ids(&service), [1, 2], "the kept-alive lease expired");

    // No longer renewed, it expires and takes the worker with it.
    let abandoned = Instant::now();
    dies.abandon();
    wait_until("the expired worker has left the fleet", Duration::from_secs(20), || {
        ids(&service) == [1]
    });
    assert!(
        abandoned.elapsed() >= Duration::from_millis(500),
        "removed after {:?}: before its lease could expire",
        abandoned.elapsed()
    );
    drop(stays);
    poller.stop();
}

#[test]
fn a_bad_record_is_refused_by_key_and_the_fleet_is_unchanged() {
    let Some(endpoints) = endpoints("a_bad_record_is_refused_by_key_and_the_fleet_is_unchanged") else {
        return;
    };
    let prefix = unique_prefix("bad-record");
    let mut raw = Raw::connect(&endpoints);
    let one = WorkerRecord::new(1).with_dp(0, 2);
    let two = WorkerRecord::new(2);
    raw.put_record(&prefix, &one);
    raw.put_record(&prefix, &two);
    // A bad record already there when the source starts is refused too.
    raw.put(&format!("{prefix}9"), "{not json");
    let service = service();
    let mut source = EtcdDiscovery::connect(&endpoints, prefix.as_str()).unwrap();
    // The first refresh applies the good records and reports the bad one.
    let first = service.refresh(&mut source).unwrap();
    assert!(
        matches!(&first.refused[..], [DiscoveryError::EtcdRecordParse { key, .. }] if *key == format!("{prefix}9")),
        "{first:?}"
    );
    assert_eq!(first.applied.unwrap().added, [1, 2]);
    assert_eq!(service.workers(), [one.clone(), two.clone()]);
    let again = service.refresh(&mut source).unwrap();
    assert!(
        again.applied.is_none() && again.refused.is_empty(),
        "a refusal is reported once: {again:?}"
    );

    // Not JSON, at a new key, next to a good change: the key is refused by
    // name, the good change applies.
    let key3 = format!("{prefix}3");
    raw.put(&key3, "{\"worker_id\": 3,");
    let two_tainted = two.clone().with_taint("x");
    raw.put_record(&prefix, &two_tainted);
    let errors = refresh_until(&service, &mut source, "worker 2's update applies", |s, _| {
        s.workers().get(1) == Some(&two_tainted)
    });
    let errors = if errors.is_empty() {
        service.refresh(&mut source).unwrap().refused
    } else {
        errors
    };
    assert!(
        matches!(&errors[..], [DiscoveryError::EtcdRecordParse { key, .. }] if *key == key3),
        "{errors:?}"
    );
    assert_eq!(ids(&service), [1, 2]);

    // Invalid fields at a known worker's key: it keeps its last good record.
    let key1 = format!("{prefix}1");
    raw.put(&key1, r#"{"worker_id": 1, "data_parallel_size": 0}"#);
    let errors = refresh_until(&service, &mut source, "the invalid record is refused", |_, e| {
        !e.is_empty()
    });
    match &errors[..] {
        [DiscoveryError::EtcdRecordInvalid { key, source }] => {
            assert_eq!(*key, key1);
            assert!(
                matches!(**source, DiscoveryError::InvalidWorker { worker_id: 1, .. }),
                "{source:?}"
            );
            assert!(errors[0].to_string().contains(&key1), "{}", errors[0]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(service.workers(), [one.clone(), two_tainted.clone()]);

    // An unknown field, and a record at another worker's key.
    raw.put(&key1, r#"{"worker_id": 1, "colour": "blue"}"#);
    let errors = refresh_until(&service, &mut source, "the unknown field is refused", |_, e| {
        !e.is_empty()
    });
    assert!(
        matches!(&errors[..], [DiscoveryError::EtcdRecordParse { key, message }] if *key == key1 && message.contains("colour")),
        "{errors:?}"
    );
    let key4 = format!("{prefix}4");
    raw.put(&key4, serde_json::to_vec(&WorkerRecord::new(5)).unwrap());
    let errors = refresh_until(&service, &mut source, "the misplaced record is refused", |_, e| {
        !e.is_empty()
    });
    assert!(
        matches!(&errors[..], [DiscoveryError::EtcdKeyMismatch { key, worker_id: 5 }] if *key == key4),
        "{errors:?}"
    );
    assert_eq!(service.workers(), [one.clone(), two_tainted.clone()]);
    let quiet = service.refresh(&mut source).unwrap();
    assert!(quiet.applied.is_none() && quiet.refused.is_empty(), "{quiet:?}");

    // Good values at the refused keys take effect as usual.
    let three = WorkerRecord::new(3).with_taint("gpu=h200");
    raw.put_record(&prefix, &three);
    raw.put_record(&prefix, &WorkerRecord::new(1));
    raw.delete(&key4);
    refresh_until(&service, &mut source, "the fixed records apply", |s, _| {
        s.workers() == [WorkerRecord::new(1), two_tainted.clone(), three.clone()]
    });
}

#[test]
fn a_key_rewritten_with_bad_values_does_not_hold_back_good_changes() {
    let Some(endpoints) = endpoints("a_key_rewritten_with_bad_values_does_not_hold_back_good_changes") else {
        return;
    };
    let prefix = unique_prefix("bad-writer");
    let mut raw = Raw::connect(&endpoints);
    raw.put_record(&prefix, &WorkerRecord::new(1));
    let service = service();
    let source = EtcdDiscovery::connect(&endpoints, prefix.as_str()).unwrap();
    let poller = DiscoveryPoller::spawn(service.clone(), Box::new(source), Duration::from_millis(200)).unwrap();
    wait_until("worker 1 is in the fleet", Duration::from_secs(10), || {
        ids(&service) == [1]
    });

    // A writer puts a bad value at one key every 50 ms, four per poll.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (endpoints, bad_key, stop) = (endpoints.clone(), format!("{prefix}9"), stop.clone());
        std::thread::spawn(move || {
            let mut raw = Raw::connect(&endpoints);
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                raw.put(&bad_key, format!("{{\"worker_id\": 9, \"n\": {n}"));
                n += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            n
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    raw.put_record(&prefix, &WorkerRecord::new(2));
    raw.delete(&format!("{prefix}1"));
    let changed = Instant::now();
    let applied = (|| {
        while changed.elapsed() < Duration::from_secs(5) {
            if ids(&service) == [2] {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    })();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes = writer.join().unwrap();
    let health = poller.health();
    poller.stop();
    assert!(
        applied,
        "adding worker 2 and removing worker 1 did not apply within 5 s while {prefix}9 was rewritten \
         with bad values ({writes} writes); fleet {:?}, {health:?}",
        ids(&service)
    );
    // Applied within a poll or two; the bad key was reported by name, and
    // no poll failed for it.
    assert!(
        changed.elapsed() < Duration::from_secs(2),
        "applied after {:?}",
        changed.elapsed()
    );
    assert!(health.records_refused >= 2, "{health:?}");
    assert!(
        health
            .last_refused
            .as_deref()
            .is_some_and(|e| e.contains(&format!("{prefix}9"))),
        "{health:?}"
    );
    assert_eq!((health.consecutive_failures, health.last_error), (0, None));
}

#[test]
fn a_thousand_bad_keys_do_not_delay_a_good_change() {
    let Some(endpoints) = endpoints("a_thousand_bad_keys_do_not_delay_a_good_change") else {
        return;
    };
    let prefix = unique_prefix("bad-keys");
    let mut raw = Raw::connect(&endpoints);
    raw.put_record(&prefix, &WorkerRecord::new(1));
    let service = service();
    let mut source = EtcdDiscovery::connect(&endpoints, prefix.as_str()).unwrap();
    service.refresh(&mut source).unwrap();
    assert_eq!(ids(&service), [1]);
    for k in 0..1_000 {
        raw.put(&format!("{prefix}{}", 1_000 + k), "{not json");
    }
    let last = raw.put_record(&prefix, &WorkerRecord::new(2));
    wait_until("the watch has seen every put", Duration::from_secs(10), || {
        source.status().revision >= last
    });
    // One refresh applies the good change, whatever the bad keys, and
    // reports every bad key by name, once.
    let outcome = service.refresh(&mut source);
    assert_eq!(ids(&service), [1, 2], "the first refresh returned {outcome:?}");
    let report = outcome.unwrap();
    assert_eq!(report.applied.unwrap().added, [2]);
    let mut refused: Vec<String> = report
        .refused
        .iter()
        .map(|e| match e {
            DiscoveryError::EtcdRecordParse { key, .. } => key.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    refused.sort();
    let mut want: Vec<String> = (0..1_000).map(|k| format!("{prefix}{}", 1_000 + k)).collect();
    want.sort();
    assert_eq!(refused, want);
    let again = service.refresh(&mut source).unwrap();
    assert!(again.applied.is_none() && again.refused.is_empty(), "{again:?}");
}

/// An `etcd` process of the test's own, on loopback ports chosen now, with
/// a data directory that survives restarts; killed and removed on drop.
struct OwnEtcd {
    bin: PathBuf,
    dir: PathBuf,
    peer_port: u16,
    child: Option<Child>,
}

impl OwnEtcd {
    fn find() -> Option<OwnEtcd> {
        let bin = servers::server_binary("SELKIE_ETCD_BIN", "etcd")?;
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
        let dir = std::env::temp_dir().join(format!("selkie-etcd-test-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Some(OwnEtcd {
            bin,
            dir,
            peer_port: servers::ports::free_port(),
            child: None,
        })
    }

    /// Starts the server on client port `port` and waits until it answers.
    fn start(&mut self, port: u16) -> Vec<String> {
        assert!(self.child.is_none());
        let client = format!("http://127.0.0.1:{port}");
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .unwrap();
        let child = Command::new(&self.bin)
            .args(["--name", "selkie-test", "--data-dir"])
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("selkie-test={peer}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        self.child = Some(child);
        let endpoints = vec![client];
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        wait_until("the test's etcd answers", Duration::from_secs(30), || {
            rt.block_on(async {
                let Ok(mut c) = Client::connect(&endpoints, None).await else {
                    return false;
                };
                tokio::time::timeout(Duration::from_millis(500), c.get("health", None))
                    .await
                    .is_ok_and(|r| r.is_ok())
            })
        });
        endpoints
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }
}

impl Drop for OwnEtcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn the_watch_resumes_after_a_restart_without_losing_or_doubling_changes() {
    let Some(mut etcd) = OwnEtcd::find() else {
        servers::skip("the_watch_resumes_after_a_restart_without_losing_or_doubling_changes: needs an etcd binary (SELKIE_ETCD_BIN or `etcd` on the PATH; Debian: etcd-server)");
        return;
    };
    // The source watches port `a`; the changes it must not miss are made
    // while the server listens on `b` only, so they are history when it
    // comes back.
    let (a, b) = (servers::ports::free_port(), servers::ports::free_port());
    let endpoints = etcd.start(a);
    let prefix = "/workers/";
    let mut raw = Raw::connect(&endpoints);
    for id in 1..=3 {
        raw.put_record(prefix, &WorkerRecord::new(id));
    }
    let service = service();
    let options = EtcdOptions::default()
        .with_timeout(Duration::from_secs(1))
        .with_max_backoff(Duration::from_millis(200));
    let mut source = EtcdDiscovery::connect_with(&endpoints, prefix, options).unwrap();
    service.refresh(&mut source).unwrap();
    assert_eq!(ids(&service), [1, 2, 3]);
    assert!(source.status().connected);

    // Down: the source says so, the fleet stays.
    etcd.kill();
    let errors = refresh_until(&service, &mut source, "the outage is reported", |_, e| !e.is_empty());
    assert!(
        matches!(errors[0], DiscoveryError::EtcdUnavailable { .. }),
        "{:?}",
        errors[0]
    );
    assert!(!source.status().connected);
    assert_eq!(ids(&service), [1, 2, 3]);

    // Changes while the source cannot see them.
    let elsewhere = etcd.start(b);
    let mut raw = Raw::connect(&elsewhere);
    raw.delete(&format!("{prefix}1"));
    let two = WorkerRecord::new(2).with_state(WorkerState::Cordoned);
    raw.put_record(prefix, &two);
    raw.put_record(prefix, &WorkerRecord::new(4));
    let last = raw.put_record(prefix, &WorkerRecord::new(4).with_taint("late"));
    drop(raw);
    etcd.kill();

    // Back on `a`: the watch resumes from its revision and replays them.
    etcd.start(a);
    let four = WorkerRecord::new(4).with_taint("late");
    refresh_until(&service, &mut source, "the missed changes apply", |s, _| {
        s.workers() == [two.clone(), WorkerRecord::new(3), four.clone()]
    });
    let status = source.status();
    assert!(status.connected, "{status:?}");
    // Resumed (not listed again), at the revision of the last change.
    assert!(status.reconnects >= 1, "{status:?}");
    assert_eq!((status.relists, status.revision), (0, last), "{status:?}");
    assert!(
        service.refresh(&mut source).unwrap().applied.is_none(),
        "nothing left to deliver"
    );

    // Again, but the revision to resume from is compacted away meanwhile:
    // the source lists the prefix again, and still nothing is lost.
    etcd.kill();
    refresh_until(&service, &mut source, "the second outage is reported", |_, e| {
        !e.is_empty()
    });
    let elsewhere = etcd.start(b);
    let mut raw = Raw::connect(&elsewhere);
    raw.delete(&format!("{prefix}3"));
    let five = WorkerRecord::new(5).with_dp(2, 2);
    let last = raw.put_record(prefix, &five);
    raw.compact(last);
    drop(raw);
    etcd.kill();
    etcd.start(a);
    refresh_until(
        &service,
        &mut source,
        "the changes behind the compaction apply",
        |s, _| s.workers() == [two.clone(), four.clone(), five.clone()],
    );
    let status = source.status();
    assert!(status.reconnects >= 2, "{status:?}");
    assert_eq!((status.relists, status.revision), (1, last), "{status:?}");
    assert_eq!(
        service
            .worker_status(5)
            .unwrap()
            .ranks
            .iter()
            .map(|r| r.dp_rank)
            .collect::<Vec<_>>(),
        [2, 3]
    );
}
