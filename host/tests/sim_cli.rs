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
        "kv T=0.5",
        "kv T=1",
        "round-robin",
        "random",
        "least-loaded",
        "power-of-two",
        "device-aware-weighted",
    ];
    for label in labels {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no row {label:?}\n{stdout}"));
        assert!(row.trim_end().ends_with(" 0"), "requests refused: {row}");
    }
    assert!(stdout.contains("best KV hit rate:      kv T=0\n"), "{stdout}");
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
    for needle in [
        "KV hit %",
        "TTFT p99 ms",
        "flicker %",
        "select p50 µs",
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
    let config = dir.join("policies.yaml");
    std::fs::write(
        &config,
        "aggregated: sticky\ninstances:\n  - name: sticky\n    type: kv\n    parameters: { overlap_score_credit: 2.0 }\n",
    )
    .unwrap();
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
    assert!(!String::from_utf8_lossy(&out.stdout).contains("KV hit %"), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
