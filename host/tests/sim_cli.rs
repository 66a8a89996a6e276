//! The `selkie simulate` program end to end: the table, plots, trace replay,
//! configured policies and errors (only with the `sim` feature).
#![cfg(feature = "sim")]

use std::path::PathBuf;
use std::process::{Command, Output};

fn selkie(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_selkie"))
        .args(args)
        .output()
        .expect("run selkie")
}

/// A worker-selection config file with one `kv` instance, `sticky` (twice
/// the default credit for cached blocks), in `dir`.
fn sticky_config(dir: &std::path::Path) -> PathBuf {
    let config = dir.join("policies.yaml");
    std::fs::write(
        &config,
        "aggregated: sticky\ninstances:\n  - name: sticky\n    type: kv\n    parameters: { overlap_score_credit: 2.0 }\n",
    )
    .unwrap();
    config
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("selkie-sim-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The README's main job, exactly: the embedded default scenario, every
/// policy, the table.
#[test]
fn readme_main_job_prints_the_comparison_table() {
    let out = selkie(&["simulate"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("16 workers") && stdout.contains("4000 requests"),
        "{stdout}"
    );
    let labels = [
        "kv T=0 ",
        "kv margin 30% ",
        "round-robin",
        "random",
        "least-loaded",
        "power-of-two",
        "device-aware-weighted",
        "prefix-hash",
    ];
    for label in labels {
        // Its rows, one per table; the last table ends with the refusals.
        let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with(label)).collect();
        assert_eq!(rows.len(), 2, "two tables, a row {label:?} in each:\n{stdout}");
        assert!(rows[1].trim_end().ends_with(" 0"), "requests refused: {}", rows[1]);
    }
    assert!(stdout.contains("best KV hit rate:      kv margin 30%\n"), "{stdout}");
}

#[test]
fn prints_the_table_and_writes_plots() {
    let dir = scratch("plots");
    let out = selkie(&[
        "simulate",
        "--requests",
        "300",
        "--workers",
        "4",
        "--policy",
        "round-robin",
        "--policy",
        "kv@0.5",
        "--plots",
        dir.to_str().unwrap(),
        "--json",
        dir.join("reports.json").to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every column, its header on two lines.
    for needle in [
        "KV hit  missed  uncached    % of   missed    TTFT    TTFT  latency",
        "     %       %         %  pooled  reuse %  p50 ms  p99 ms   p99 ms",
        "  load      load        select  select",
        "    CV  max/mean  herd  p50 µs  p99 µs  failed",
        "round-robin",
        "kv T=0.5",
        "best KV hit rate",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in\n{stdout}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reports.json")).unwrap()).unwrap();
    let reports = json.as_array().expect("an array");
    assert_eq!(reports.len(), 2);
    assert_eq!(reports[0]["policy"], "round-robin");
    assert_eq!(reports[0]["routed"], 300);
    assert!(reports[1]["hit_rate"]
        .as_f64()
        .is_some_and(|h| (0.0..=1.0).contains(&h)));
    for file in ["ttft.svg", "load-round-robin.svg", "load-kv_T_0.5.svg"] {
        let svg = std::fs::read_to_string(dir.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(svg.starts_with("<svg") && svg.contains("polyline"), "{file}");
        if file.starts_with("load") {
            for label in [
                "busiest worker",
                "mean of the 4 workers",
                "least busy worker",
                "peak of this run",
            ] {
                assert!(svg.contains(label), "{file}: no {label:?}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn replays_a_trace_with_configured_policies() {
    let dir = scratch("trace");
    let trace = dir.join("trace.jsonl");
    // 200 requests: eight 4-block shared prefixes, each with a private tail.
    let rows: String = (0..200)
        .map(|i| {
            let p = (i % 8) * 100;
            format!(
                "{{\"timestamp\": {}, \"input_length\": 2600, \"output_length\": 20, \"hash_ids\": [{}, {}, {}, {}, {}, {}]}}\n",
                i * 25,
                p,
                p + 1,
                p + 2,
                p + 3,
                10_000 + 2 * i,
                10_001 + 2 * i
            )
        })
        .collect();
    std::fs::write(&trace, rows).unwrap();
    let config = sticky_config(&dir);
    let out = selkie(&[
        "simulate",
        "--trace",
        trace.to_str().unwrap(),
        "--workers",
        "4",
        "--policy",
        "random",
        "--config",
        config.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("200 requests"), "{stdout}");
    assert!(stdout.contains("config:sticky"), "{stdout}");
    assert!(stdout.contains("best KV hit rate:      config:sticky"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let dir = scratch("bad");
    let trace = dir.join("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 1, \"input_length\": 9, \"output_length\": 1, \"hash_ids\": [1]}\nnot json\n",
    )
    .unwrap();
    let out = selkie(&["simulate", "--trace", trace.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("trace line 2"), "{out:?}");
    let out = selkie(&["simulate", "--requests", "10", "--policy", "fastest"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("fastest") && stderr.contains("least-loaded"),
        "{stderr}"
    );
    // A bad policy is reported before anything is simulated.
    let out = selkie(&[
        "simulate",
        "--requests",
        "10",
        "--policy",
        "kv",
        "--policy",
        "kv:{bogus: 1}",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bogus"), "{out:?}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("KV hit"), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `selkie simulate` with `args` and checks that it refused before
/// simulating: a non-zero exit, an `error:` naming `needle`, no panic and
/// no table.
fn refused(args: &[&str], needle: &str) {
    let mut all = vec!["simulate", "--policy", "random"];
    all.extend_from_slice(args);
    let out = selkie(&all);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{args:?} ran:\n{stdout}");
    assert!(
        stderr.contains("error") && stderr.contains(needle),
        "{args:?}: {needle:?} not in {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(!stdout.contains("KV hit"), "{args:?} simulated:\n{stdout}");
}

/// Every number the simulator used to raise silently, run anyway, loop on
/// or crash with is refused with its option's or field's name.
#[test]
fn every_bad_number_is_refused_before_the_run() {
    for (args, needle) in [
        (&["--rate=-5"][..], "--rate = -5"),
        (&["--rate", "0"], "--rate = 0"),
        (&["--rate", "inf"], "--rate = inf"),
        (&["--rate", "1e9"], "--rate = 1000000000"),
        (&["--workers", "0"], "--workers = 0"),
        (&["--requests", "0"], "--requests = 0"),
        (&["--max-active", "0"], "--max-active = 0"),
        (&["--kv-blocks", "0"], "--kv-blocks = 0"),
        (&["--dp", "0"], "--dp = 0"),
        (&["--dp", "4294967295"], "4294967295 DP ranks"),
        (&["--requests", "18446744073709551615"], "workload.requests"),
        (&["--requests", "1000000000"], "workload.requests"),
        (&["--routers", "0"], "--routers = 0"),
        (&["--routers", "65"], "fleet.routers"),
        (&["--routers", "4", "--sync-delay=-1"], "--sync-delay = -1"),
        (&["--routers", "4", "--sync-delay", "soon"], "--sync-delay = soon"),
    ] {
        refused(args, needle);
    }
    // A sync delay needs replicas.
    let out = selkie(&["simulate", "--sync-delay", "5"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--routers"), "{out:?}");
    // `direct` would fail every request: refused by name.
    let out = selkie(&["simulate", "--requests", "10", "--policy", "direct"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("pinned"), "{out:?}");
    // A rate cannot apply to a trace's arrivals.
    let out = selkie(&["simulate", "--trace", "t.jsonl", "--rate", "5"]);
    assert!(!out.status.success());
}

/// Scenario files: a misspelled field, an infinite think time, engines
/// that never step, and inverted or NaN distributions are refused.
#[test]
fn every_bad_scenario_field_is_refused_before_the_run() {
    let dir = scratch("scenario");
    let good = "name: x\n\
        fleet: {workers: 2, dp_size: 1, kv_blocks: 10, timing: {step_overhead_ms: 6, prefill_ms_per_token: 0.02, \
        decode_ms_per_seq: 0.08, max_batched_tokens: 64, max_running: 4}}\n\
        workload: {requests: 20, block_size: 16, arrivals: !poisson {rate_per_s: 5}, system_prompts: 1, \
        system_prompt_tokens: !fixed 10, zipf_s: 1, session_fraction: 0.5, session_turns: !fixed 2, \
        think_time_ms: 5, user_tokens: !uniform {lo: 3, hi: 9}, output_tokens: !fixed 5}\n";
    let file = dir.join("s.yaml");
    std::fs::write(&file, good).unwrap();
    let out = selkie(&[
        "simulate",
        "--policy",
        "random",
        "--scenario-file",
        file.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    for (from, to, needle) in [
        ("think_time_ms: 5", "think_time_ms: 5, typo: 1", "unknown field `typo`"),
        (
            "think_time_ms: 5",
            "think_time_ms: .inf",
            "workload.think_time_ms = inf",
        ),
        ("max_running: 4", "max_running: 0", "fleet.timing.max_running = 0"),
        (
            "max_batched_tokens: 64",
            "max_batched_tokens: 0",
            "fleet.timing.max_batched_tokens = 0",
        ),
        (
            "step_overhead_ms: 6",
            "step_overhead_ms: .nan",
            "fleet.timing.step_overhead_ms = NaN",
        ),
        ("workers: 2", "workers: 0", "fleet.workers = 0"),
        (
            "max_running: 4}",
            "max_running: 4}, classes: [{workers: 3}]",
            "fleet.classes = 3 workers",
        ),
        (
            "max_running: 4}",
            "max_running: 4}, classes: [{workers: 1, speed: 0}]",
            "fleet.classes[0].speed = 0",
        ),
        ("lo: 3, hi: 9", "lo: 9, hi: 3", "workload.user_tokens.lo = 9"),
        (
            "rate_per_s: 5",
            "rate_per_s: .nan",
            "workload.arrivals.rate_per_s = NaN",
        ),
        (
            "output_tokens: !fixed 5",
            "output_tokens: !fixed 100000000",
            "workload.output_tokens = 100000000",
        ),
    ] {
        assert!(good.contains(from), "{from}");
        std::fs::write(&file, good.replace(from, to)).unwrap();
        refused(&["--scenario-file", file.to_str().unwrap()], needle);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Output paths are checked before the run; a trace written by selkie reads
/// back with its own block size; a long output's load samples stay bounded.
#[test]
fn outputs_are_checked_first_and_traces_read_back_exactly() {
    let dir = scratch("outputs");
    let missing = dir.join("no-such-dir").join("r.json");
    refused(
        &["--requests", "50", "--json", missing.to_str().unwrap()],
        "no-such-dir",
    );
    let trace = dir.join("written.jsonl");
    let (generated_json, replayed_json) = (dir.join("generated.json"), dir.join("replayed.json"));
    let generated = selkie(&[
        "simulate",
        "--policy",
        "random",
        "--write-trace",
        trace.to_str().unwrap(),
        "--requests",
        "300",
        "--workers",
        "4",
        "--json",
        generated_json.to_str().unwrap(),
    ]);
    assert!(generated.status.success(), "{generated:?}");
    // The scenario's cache (a replayed trace would default to a real
    // worker's).
    let replayed = selkie(&[
        "simulate",
        "--policy",
        "random",
        "--workers",
        "4",
        "--kv-tokens",
        "65536",
        "--trace",
        trace.to_str().unwrap(),
        "--json",
        replayed_json.to_str().unwrap(),
    ]);
    assert!(replayed.status.success(), "{replayed:?}");
    // The same requests at the same times: the same report, up to the
    // measured selection times.
    let report = |path: &PathBuf| {
        let text = std::fs::read_to_string(path).unwrap();
        let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let report = json[0].as_object_mut().expect("one report");
        assert!(report.remove("select_p50_ns").is_some() && report.remove("select_p99_ns").is_some());
        json
    };
    let (generated, replayed) = (report(&generated_json), report(&replayed_json));
    assert_eq!(generated, replayed);
    assert_eq!(generated[0]["routed"], 300);
    // Read with another block size, it is refused, not misread.
    refused(
        &["--trace", trace.to_str().unwrap(), "--trace-block-size", "512"],
        "records block_size 16",
    );
    // One request generating 4 million tokens: bounded memory, finishes.
    let long = dir.join("long.jsonl");
    std::fs::write(
        &long,
        "{\"timestamp\": 5, \"input_length\": 100, \"output_length\": 4000000, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let out = selkie(&[
        "simulate",
        "--policy",
        "random",
        "--workers",
        "2",
        "--trace",
        long.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `selkie simulate | head -1`: the closed pipe ends the program quietly.
#[test]
fn a_closed_pipe_is_a_quiet_exit() {
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_selkie"))
        .args(["simulate", "--requests", "300", "--workers", "4", "--policy", "random"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run selkie");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("selkie ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked") && !stderr.contains("error"), "{stderr}");
}

/// Cache capacity in tokens; a replayed trace defaults to a typical GPU
/// worker's cache, not the embedded scenario's small one.
#[test]
fn cache_capacity_is_given_in_tokens_and_traces_default_to_a_real_worker() {
    let dir = scratch("capacity");
    let trace = dir.join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 5, \"hash_ids\": [1, 2]}\n",
    )
    .unwrap();
    let t = trace.to_str().unwrap();
    let header = |args: &[&str]| {
        let mut all = vec!["simulate", "--policy", "random", "--workers", "2"];
        all.extend_from_slice(args);
        let out = selkie(&all);
        assert!(out.status.success(), "{out:?}");
        // The lines above the table, a wrapped line's continuation joined.
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        stdout.split("\n\n").next().unwrap_or_default().replace("\n  ", " ")
    };
    let typical = selkie::sim::run::TYPICAL_WORKER_KV_TOKENS;
    let h = header(&["--trace", t]);
    assert!(
        h.contains(&format!(
            "a KV cache of {} tokens per rank ({} blocks of 512; a typical GPU worker's",
            typical / 512 * 512,
            typical / 512
        )),
        "{h}"
    );
    let h = header(&["--trace", t, "--kv-tokens", "100000"]);
    assert!(
        h.contains("a KV cache of 99840 tokens per rank (195 blocks of 512)"),
        "{h}"
    );
    let h = header(&["--requests", "50", "--kv-tokens", "100000"]);
    assert!(
        h.contains("a KV cache of 100000 tokens per rank (6250 blocks of 16)"),
        "{h}"
    );
    refused(&["--trace", t, "--kv-tokens", "100"], "--kv-tokens = 100");
    let out = selkie(&["simulate", "--kv-tokens", "1000", "--kv-blocks", "10"]);
    assert!(!out.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--session-affinity` runs the config file's policies with sessions too.
#[test]
fn session_affinity_applies_to_config_policies() {
    let dir = scratch("affinity");
    let config = sticky_config(&dir);
    let out = selkie(&[
        "simulate",
        "--requests",
        "200",
        "--workers",
        "4",
        "--policy",
        "random",
        "--config",
        config.to_str().unwrap(),
        "--session-affinity",
        "soft",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    for label in ["random ", "random +soft", "config:sticky ", "config:sticky +soft"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(label)),
            "no row {label:?}:\n{stdout}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `selkie tune` searches, reports both halves and writes a config file the
/// simulator (and a router) reads, every line of its output within 100
/// columns; bad arguments are refused before it runs.
#[test]
fn tune_writes_a_config_the_simulator_reads() {
    let dir = scratch("tune");
    let out_path = dir.join("tuned.yaml");
    let out = selkie(&[
        "tune",
        "--requests",
        "400",
        "--workers",
        "4",
        "--trials",
        "6",
        "--out",
        out_path.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let wide = wide_lines(&stdout);
    assert!(wide.is_empty(), "lines over 100 characters: {wide:#?}");
    for needle in [
        "6 candidate weights of the kv policy on the first 200 requests",
        "(default)",
        "on the second half",
        "written to",
    ] {
        assert!(stdout.contains(needle), "{needle:?} not in\n{stdout}");
    }
    let yaml = std::fs::read_to_string(&out_path).unwrap();
    assert!(
        yaml.contains("type: kv") && yaml.contains("overlap_score_credit:"),
        "{yaml}"
    );
    let sim = selkie(&[
        "simulate",
        "--requests",
        "100",
        "--workers",
        "4",
        "--policy",
        "random",
        "--config",
        out_path.to_str().unwrap(),
    ]);
    assert!(sim.status.success(), "{sim:?}");
    assert!(String::from_utf8_lossy(&sim.stdout).contains("config:tuned"));
    let bad = selkie(&["tune", "--trials", "0", "--out", out_path.to_str().unwrap()]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--trials = 0"));
    let nowhere = dir.join("missing").join("t.yaml");
    let bad = selkie(&["tune", "--out", nowhere.to_str().unwrap()]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("missing"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// How a bounded run of `selkie` ended.
#[derive(Debug)]
struct Bounded {
    /// The exit status, if it exited (not killed by the watchdog or at the
    /// deadline).
    status: Option<std::process::ExitStatus>,
    /// Its highest resident set seen (`VmHWM`), in MiB.
    peak_mib: u64,
    /// Killed because its resident set passed the limit.
    over_limit: bool,
    /// How long it ran.
    took: std::time::Duration,
    stdout: String,
    stderr: String,
}

/// Runs `selkie` with `args` while a watchdog reads its resident set from
/// `/proc` every 10 ms: it is killed as soon as that passes `limit_mib`
/// (`over_limit`) or once `deadline` has passed (then `status` is `None`).
fn selkie_bounded(args: &[&str], limit_mib: u64, deadline: std::time::Duration) -> Bounded {
    use std::io::Read;
    let started = std::time::Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_selkie"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run selkie");
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let readers = (
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        }),
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        }),
    );
    let status_file = format!("/proc/{}/status", child.id());
    let kib = |text: &str, key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let (mut peak_mib, mut over_limit) = (0, false);
    let status = loop {
        if let Ok(text) = std::fs::read_to_string(&status_file) {
            peak_mib = peak_mib.max(kib(&text, "VmHWM:") / 1024);
        }
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if peak_mib > limit_mib || started.elapsed() > deadline {
            over_limit = peak_mib > limit_mib;
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    Bounded {
        status,
        peak_mib,
        over_limit,
        took: started.elapsed(),
        stdout: readers.0.join().unwrap(),
        stderr: readers.1.join().unwrap(),
    }
}

/// Request counts and rates inside the documented limits used to exhaust
/// memory (10,000,000 requests at 10,000,000 per second: 23 GB and killed).
/// A run that cannot fit is refused at once, naming the option and the
/// memory it would need, in bounded memory.
#[test]
fn a_run_that_cannot_fit_in_memory_is_refused_in_bounded_memory() {
    for args in [
        &["simulate", "--requests", "10000000", "--rate", "10000000"][..],
        &["simulate", "--requests", "10000000"],
        &["tune", "--requests", "10000000", "--out", "/dev/null"],
    ] {
        let run = selkie_bounded(args, 1024, std::time::Duration::from_secs(60));
        assert!(
            !run.over_limit && run.status.is_some(),
            "{args:?}: resident set {} MiB after {:?} (limit 1024 MiB); {}",
            run.peak_mib,
            run.took,
            run.stderr
        );
        assert!(!run.status.unwrap().success(), "{args:?} ran: {}", run.stdout);
        assert!(
            run.stderr.contains("error") && run.stderr.contains("--requests") && run.stderr.contains("--max-memory"),
            "{args:?}: {}",
            run.stderr
        );
        assert!(
            run.stderr.contains("GiB"),
            "{args:?}: the memory it needs: {}",
            run.stderr
        );
        assert!(!run.stderr.contains("panicked"), "{args:?}: {}", run.stderr);
    }
}

/// `selkie tune --trials 1000000000` used to allocate every candidate up
/// front (23.6 GB in 122 s); candidates are drawn as they are needed, so
/// memory stays bounded however many there are.
#[test]
fn tune_draws_its_candidates_as_it_goes() {
    let dir = scratch("tune-many");
    let out = dir.join("tuned.yaml");
    let args = [
        "tune",
        "--trials",
        "1000000000",
        "--requests",
        "40",
        "--workers",
        "2",
        "--out",
        out.to_str().unwrap(),
    ];
    let run = selkie_bounded(&args, 160, std::time::Duration::from_secs(6));
    assert!(
        !run.over_limit,
        "resident set {} MiB after {:?} (limit 160 MiB): {}",
        run.peak_mib, run.took, run.stderr
    );
    assert!(run.status.is_none(), "it should still be searching: {run:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Numbers inside the flags' types but outside what the simulator takes,
/// and messages that said something else than the input.
#[test]
fn trace_block_sizes_and_lengths_are_checked_by_name() {
    let dir = scratch("trace-limits");
    let trace = dir.join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 20, \"output_length\": 2, \"hash_ids\": [1, 2]}\n",
    )
    .unwrap();
    let t = trace.to_str().unwrap();
    refused(
        &["--trace", t, "--trace-block-size", "4294967295"],
        "--trace-block-size = 4294967295",
    );
    refused(&["--trace", t, "--trace-block-size", "65537"], "at most 65536");
    // A prompt of 0 tokens is named as such, not as "1 prompt tokens".
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 2, \"hash_ids\": []}\n",
    )
    .unwrap();
    refused(&["--trace", t], "input_length 0");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A workload no cache can help (one request) has a pooled bound of 0: the
/// share of it is not a number, and the table says so without a NaN.
#[test]
fn a_pooled_bound_of_zero_prints_no_nan() {
    let out = selkie(&["simulate", "--requests", "1", "--policy", "random"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("%  pooled  reuse %"),
        "the share of pooled column: {stdout}"
    );
    assert!(!stdout.contains("NaN"), "{stdout}");
}

/// Every line `selkie simulate` prints (the default scenario and policy
/// set) fits a terminal of 100 columns.
#[test]
fn simulate_output_fits_in_100_columns() {
    let out = selkie(&["simulate", "--requests", "200"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let wide = wide_lines(&stdout);
    assert!(wide.is_empty(), "lines over 100 characters: {wide:#?}\nin\n{stdout}");
}

/// The lines of `text` over 100 characters, with their lengths.
fn wide_lines(text: &str) -> Vec<(usize, &str)> {
    text.lines()
        .map(|l| (l.chars().count(), l))
        .filter(|(n, _)| *n > 100)
        .collect()
}
