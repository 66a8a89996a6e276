//! What a run is judged by: [`PolicyReport`] computed from a [`RunRecord`],
//! and the comparison table printed for a set of policies.
//!
//! * where the prompt tokens came from, three shares adding up to 1: served
//!   from the chosen rank's cache (the hit rate), cached on another rank
//!   when the request was routed but missed, and cached nowhere;
//! * the hit rate as a share of the pooled bound ([`HitBounds`]): what one
//!   LRU cache holding the whole fleet's capacity would have served;
//! * time to first token p50 / p99, request latency p99 (arrival to last
//!   token), in milliseconds;
//! * load imbalance across ranks: the time-averaged in-flight requests of
//!   each rank, summarised by their coefficient of variation and max / mean;
//! * missed reuse: of the requests some rank held a cached prefix for, the
//!   share routed to a rank holding less of it than the longest (a policy
//!   that follows the cache keeps it low; one that ignores it cannot);
//! * selection time per request as measured around the router's selection
//!   call, p50 / p99.

use std::fmt::Write as _;

use super::cache::{BlockMap, KvCache};
use super::engine::output_parent;
use super::run::{FleetSpec, RunRecord};
use super::workload::Workload;

/// References for a workload's prompt-token hit rate, from its requests
/// alone (no timing, no routing): [`unlimited`](Self::unlimited) is an
/// upper bound no policy can beat; [`pooled`](Self::pooled) is what one
/// LRU cache of the fleet's capacity serves, which a policy can pass by a
/// little (LRU is not the best eviction), so a share of it can read above
/// 100%.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct HitBounds {
    /// One cache of unlimited size shared by the whole fleet: every block
    /// seen before is a hit.
    pub unlimited: f64,
    /// One LRU cache with the fleet's total capacity (every rank's blocks
    /// pooled), requests taken in arrival order: the bound a router that
    /// splits the fleet into separate caches approaches.
    pub pooled: f64,
    /// The pooled cache's capacity, in blocks.
    pub pooled_blocks: u64,
}

impl HitBounds {
    /// The bounds of `workload` on `fleet`. A prompt's hit is counted the
    /// way the simulated engines count it: whole cached blocks, at most the
    /// prompt less one token.
    pub fn of(workload: &Workload, fleet: &FleetSpec) -> Self {
        let bs = workload.block_size.max(1);
        let pooled_blocks = fleet.total_kv_blocks();
        let mut pool = KvCache::new(u32::try_from(pooled_blocks).unwrap_or(u32::MAX));
        let mut seen: BlockMap<()> = BlockMap::default();
        let (mut prompt, mut unlimited, mut pooled) = (0u64, 0u64, 0u64);
        let served =
            |blocks: usize, input: u32| (blocks as u64 * u64::from(bs)).min(u64::from(input.saturating_sub(1)));
        for r in &workload.requests {
            prompt += u64::from(r.input_tokens);
            let held = r.hash_ids.iter().take_while(|h| seen.contains_key(h)).count();
            unlimited += served(held, r.input_tokens);
            seen.extend(r.hash_ids.iter().chain(&r.output_hash_ids).map(|&h| (h, ())));
            let got = pool.acquire(&r.hash_ids, 0, true).map_or(0, |a| a.hit_blocks);
            pooled += served(got as usize, r.input_tokens);
            pool.release(&r.hash_ids, 0, &r.output_hash_ids, output_parent(r, bs));
        }
        let share = |tokens: u64| if prompt > 0 { tokens as f64 / prompt as f64 } else { 0.0 };
        HitBounds {
            unlimited: share(unlimited),
            pooled: share(pooled),
            pooled_blocks,
        }
    }
}

/// The outcome of one policy on one scenario.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PolicyReport {
    /// Policy label.
    pub policy: String,
    /// Requests routed.
    pub routed: usize,
    /// Requests the router refused.
    pub failed: usize,
    /// Prompt tokens served from the chosen rank's cache / prompt tokens,
    /// in `[0, 1]`.
    pub hit_rate: f64,
    /// Prompt tokens another rank held when the request was routed, beyond
    /// what the chosen rank served / prompt tokens.
    pub missed_elsewhere: f64,
    /// Prompt tokens no rank held / prompt tokens
    /// (`hit_rate + missed_elsewhere + cached_nowhere` is 1).
    pub cached_nowhere: f64,
    /// `hit_rate` / the pooled bound ([`HitBounds::pooled`]); NaN when that
    /// bound is 0 (the table shows `-`, JSON `null`).
    pub share_of_pooled: f64,
    /// Time to first token, median, ms.
    pub ttft_p50_ms: f64,
    /// Time to first token, 99th percentile, ms.
    pub ttft_p99_ms: f64,
    /// Request latency, 99th percentile, ms.
    pub latency_p99_ms: f64,
    /// Coefficient of variation of the ranks' time-averaged load.
    pub load_cv: f64,
    /// Max / mean of the ranks' time-averaged load.
    pub load_max_over_mean: f64,
    /// Of the requests some rank held a cached prefix for, the share routed
    /// to a rank holding less of it than the longest, in `[0, 1]`.
    pub missed_reuse: f64,
    /// Burst herding: the most requests routed to one rank within any
    /// window of [`RunRecord::herd_window_ms`](super::run::RunRecord::herd_window_ms)
    /// (the sync delay of synced router replicas).
    pub herd: u32,
    /// Selection time, median, ns.
    pub select_p50_ns: f64,
    /// Selection time, 99th percentile, ns.
    pub select_p99_ns: f64,
    /// Time to first token of every served request, sorted, ms.
    #[serde(skip)]
    pub ttft_sorted_ms: Vec<f64>,
}

/// The `q`-quantile (`0..=1`) of sorted values, by nearest rank; NaN if empty.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

impl PolicyReport {
    /// Summarises `run`, which replayed `workload` on a fleet whose hit
    /// rate bounds are `bounds`.
    pub fn new(policy: impl Into<String>, run: &RunRecord, bounds: &HitBounds) -> Self {
        let served: Vec<_> = run.requests.iter().filter(|r| r.row.is_some()).collect();
        let prompt: u64 = served.iter().map(|r| u64::from(r.input_tokens)).sum();
        let cached: u64 = served.iter().map(|r| u64::from(r.cached_tokens)).sum();
        // Tokens another rank held beyond what the chosen one served (a hit
        // above the routing-time best, the cache having grown before
        // admission, misses nothing).
        let elsewhere: u64 = served
            .iter()
            .map(|r| u64::from(r.best_cached_tokens.saturating_sub(r.cached_tokens)))
            .sum();
        let reusable = served.iter().filter(|r| r.best_cached_tokens > 0).count();
        let missed = served
            .iter()
            .filter(|r| r.routed_cached_tokens < r.best_cached_tokens)
            .count();
        let share = |tokens: u64| if prompt > 0 { tokens as f64 / prompt as f64 } else { 0.0 };
        let ttft = sorted(
            served
                .iter()
                .map(|r| r.first_token_ms - r.arrival_ms)
                .filter(|t| t.is_finite())
                .collect(),
        );
        let latency = sorted(
            served
                .iter()
                .map(|r| r.finish_ms - r.arrival_ms)
                .filter(|t| t.is_finite())
                .collect(),
        );
        let select = sorted(served.iter().map(|r| r.selection_ns as f64).collect());

        let span = run.makespan_ms.max(1e-9);
        let loads: Vec<f64> = run.load_area.iter().map(|a| a / span).collect();
        let n = loads.len().max(1) as f64;
        let mean = loads.iter().sum::<f64>() / n;
        let var = loads.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / n;
        let max = loads.iter().copied().fold(0.0, f64::max);
        let (load_cv, load_max_over_mean) = if mean > 0.0 {
            (var.sqrt() / mean, max / mean)
        } else {
            (0.0, 1.0)
        };

        PolicyReport {
            policy: policy.into(),
            routed: served.len(),
            failed: run.failures,
            hit_rate: share(cached),
            missed_elsewhere: share(elsewhere),
            cached_nowhere: share(prompt - cached - elsewhere.min(prompt - cached)),
            share_of_pooled: if bounds.pooled > 0.0 {
                share(cached) / bounds.pooled
            } else {
                f64::NAN
            },
            ttft_p50_ms: quantile(&ttft, 0.5),
            ttft_p99_ms: quantile(&ttft, 0.99),
            latency_p99_ms: quantile(&latency, 0.99),
            load_cv,
            load_max_over_mean,
            missed_reuse: if reusable > 0 {
                missed as f64 / reusable as f64
            } else {
                0.0
            },
            herd: herding(run),
            select_p50_ns: quantile(&select, 0.5),
            select_p99_ns: quantile(&select, 0.99),
            ttft_sorted_ms: ttft,
        }
    }
}

/// The most requests routed to one rank whose arrivals fall within one
/// window of `run.herd_window_ms` (requests are recorded in arrival order).
fn herding(run: &RunRecord) -> u32 {
    let mut by_row: Vec<Vec<f64>> = Vec::new();
    for r in &run.requests {
        if let Some(row) = r.row {
            let row = row as usize;
            if by_row.len() <= row {
                by_row.resize_with(row + 1, Vec::new);
            }
            by_row[row].push(r.arrival_ms);
        }
    }
    let w = run.herd_window_ms;
    let mut most = 0;
    for times in &by_row {
        let mut first = 0;
        for (last, &t) in times.iter().enumerate() {
            while t - times[first] >= w {
                first += 1;
            }
            most = most.max(last + 1 - first);
        }
    }
    u32::try_from(most).unwrap_or(u32::MAX)
}

/// `value` with `decimals` decimals, or `-` when it is not a number (a
/// share of a bound of 0, a quantile of no requests).
fn num(value: f64, decimals: usize) -> String {
    if value.is_finite() {
        format!("{value:.decimals$}")
    } else {
        "-".into()
    }
}

/// The widest line, in characters, the simulator's text output is laid out
/// for: [`render_table`] spreads its columns over as many tables as it takes
/// to stay within it, and [`wrap`] breaks prose lines at it. A policy label
/// longer than the width less one column cannot fit; its rows are as wide as
/// it takes.
pub const OUTPUT_WIDTH: usize = 100;

/// One column of the comparison table: its header, on two lines, and its
/// cell of a report.
struct Column {
    /// The header's upper line (empty for a one-word header).
    top: &'static str,
    /// The header's lower line.
    bottom: &'static str,
    cell: fn(&PolicyReport) -> String,
}

/// A column headed `top` over `bottom`, its cells by `cell`.
const fn col(top: &'static str, bottom: &'static str, cell: fn(&PolicyReport) -> String) -> Column {
    Column { top, bottom, cell }
}

/// The columns, in groups kept in one table while the width allows: where
/// the prompt tokens came from, how fast requests were served, how evenly
/// the load spread, and selkie's own time (with the refusals).
static GROUPS: [&[Column]; 4] = [
    &[
        col("KV hit", "%", |r| num(r.hit_rate * 100.0, 1)),
        col("missed", "%", |r| num(r.missed_elsewhere * 100.0, 1)),
        col("uncached", "%", |r| num(r.cached_nowhere * 100.0, 1)),
        col("% of", "pooled", |r| num(r.share_of_pooled * 100.0, 1)),
        col("missed", "reuse %", |r| num(r.missed_reuse * 100.0, 1)),
    ],
    &[
        col("TTFT", "p50 ms", |r| num(r.ttft_p50_ms, 0)),
        col("TTFT", "p99 ms", |r| num(r.ttft_p99_ms, 0)),
        col("latency", "p99 ms", |r| num(r.latency_p99_ms, 0)),
    ],
    &[
        col("load", "CV", |r| num(r.load_cv, 3)),
        col("load", "max/mean", |r| num(r.load_max_over_mean, 2)),
        col("", "herd", |r| r.herd.to_string()),
    ],
    &[
        col("select", "p50 µs", |r| num(r.select_p50_ns / 1000.0, 2)),
        col("select", "p99 µs", |r| num(r.select_p99_ns / 1000.0, 2)),
        col("", "failed", |r| r.failed.to_string()),
    ],
];

/// The comparison, one row per policy in each table, followed by which
/// policy is best on each measure; a value that is not a number is shown as
/// `-`.
///
/// Every column is shown, in tables of at most [`OUTPUT_WIDTH`] characters
/// with the policy label repeated in each: with labels of up to 28
/// characters, two (where the prompt tokens came from, time to first token
/// and latency; then load, herding, selection time and refusals); with
/// longer labels, more. Headers take two lines, read down (`KV hit` over
/// `%`, `% of` over `pooled`).
pub fn render_table(reports: &[PolicyReport]) -> String {
    let label_width = reports
        .iter()
        .map(|r| r.policy.chars().count())
        .fold("policy".len(), usize::max);
    let room = OUTPUT_WIDTH.saturating_sub(label_width);
    // Each column with its cells and width, packed into tables: a group
    // moves to a new table whole when it fits there, else column by column.
    let mut tables: Vec<Vec<(&Column, Vec<String>, usize)>> = vec![Vec::new()];
    let mut used = 0;
    for group in &GROUPS {
        let columns: Vec<(&Column, Vec<String>, usize)> = group
            .iter()
            .map(|c| {
                let cells: Vec<String> = reports.iter().map(c.cell).collect();
                let width = cells
                    .iter()
                    .map(|s| s.chars().count())
                    .chain([c.top.chars().count(), c.bottom.chars().count()])
                    .max()
                    .unwrap_or(0);
                (c, cells, width)
            })
            .collect();
        let group_width: usize = columns.iter().map(|c| 2 + c.2).sum();
        if used > 0 && used + group_width > room {
            tables.push(Vec::new());
            used = 0;
        }
        for column in columns {
            if used > 0 && used + 2 + column.2 > room {
                tables.push(Vec::new());
                used = 0;
            }
            used += 2 + column.2;
            tables.last_mut().expect("one table at least").push(column);
        }
    }

    let mut out = String::new();
    for (i, table) in tables.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let line = |out: &mut String, label: &str, cells: &mut dyn Iterator<Item = (&str, usize)>| {
            let mut text = format!("{label}{}", " ".repeat(label_width - label.chars().count()));
            for (cell, width) in cells {
                let _ = write!(text, "  {}{cell}", " ".repeat(width - cell.chars().count()));
            }
            out.push_str(text.trim_end());
            out.push('\n');
        };
        if table.iter().any(|c| !c.0.top.is_empty()) {
            line(&mut out, "", &mut table.iter().map(|c| (c.0.top, c.2)));
        }
        line(&mut out, "policy", &mut table.iter().map(|c| (c.0.bottom, c.2)));
        let total = label_width + table.iter().map(|c| 2 + c.2).sum::<usize>();
        out.push_str(&"-".repeat(total));
        out.push('\n');
        for (row, report) in reports.iter().enumerate() {
            line(
                &mut out,
                &report.policy,
                &mut table.iter().map(|c| (c.1[row].as_str(), c.2)),
            );
        }
    }
    if reports.len() > 1 {
        out.push('\n');
        // Only the policies that refused the fewest requests can be best: a
        // policy that fails requests would otherwise win on the requests it
        // kept.
        let fewest_failed = reports.iter().map(|r| r.failed).min().unwrap_or(0);
        let best = |key: &dyn Fn(&PolicyReport) -> f64, higher: bool| -> &str {
            let cmp = |a: &&PolicyReport, b: &&PolicyReport| key(a).total_cmp(&key(b));
            let it = reports
                .iter()
                .filter(|r| r.failed == fewest_failed && key(r).is_finite());
            let r = if higher { it.max_by(cmp) } else { it.min_by(cmp) };
            r.map_or("-", |r| r.policy.as_str())
        };
        let _ = writeln!(out, "best KV hit rate:      {}", best(&|r| r.hit_rate, true));
        let _ = writeln!(out, "best TTFT p50:         {}", best(&|r| r.ttft_p50_ms, false));
        let _ = writeln!(out, "best TTFT p99:         {}", best(&|r| r.ttft_p99_ms, false));
        let _ = writeln!(out, "best latency p99:      {}", best(&|r| r.latency_p99_ms, false));
        let _ = writeln!(out, "most even load (CV):   {}", best(&|r| r.load_cv, false));
        let _ = writeln!(out, "least missed reuse:    {}", best(&|r| r.missed_reuse, false));
        let _ = writeln!(out, "least herding:         {}", best(&|r| f64::from(r.herd), false));
        let _ = writeln!(out, "fastest selection p50: {}", best(&|r| r.select_p50_ns, false));
    }
    out
}

/// `text` with each of its lines broken at spaces into lines of at most
/// `width` characters, the continuations indented two spaces more than the
/// line; a word longer than the width stays whole on a line of its own.
///
/// ```
/// use selkie::sim::metrics::wrap;
/// assert_eq!(wrap("one two three\n four five", 8), "one two\n  three\n four\n   five");
/// assert_eq!(wrap("short", 8), "short");
/// ```
pub fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    for (i, line) in text.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let words = line.trim_start_matches(' ');
        let indent = line.len() - words.len();
        out.push_str(&line[..indent]);
        let mut len = indent;
        for (k, word) in words.split(' ').enumerate() {
            let word_len = word.chars().count();
            if k > 0 && len + 1 + word_len > width {
                out.push('\n');
                out.push_str(&" ".repeat(indent + 2));
                len = indent + 2;
            } else if k > 0 {
                out.push(' ');
                len += 1;
            }
            out.push_str(word);
            len += word_len;
        }
    }
    out
}

/// Reports to test with.
#[cfg(test)]
pub(crate) mod tests_support {
    use super::PolicyReport;

    /// A report of `policy` with the given hit rate and refusals.
    pub(crate) fn report(policy: &str, hit_rate: f64, failed: usize) -> PolicyReport {
        PolicyReport {
            policy: policy.into(),
            routed: 100 - failed,
            failed,
            hit_rate,
            missed_elsewhere: 0.0,
            cached_nowhere: 1.0 - hit_rate,
            share_of_pooled: hit_rate,
            ttft_p50_ms: 10.0,
            ttft_p99_ms: 20.0,
            latency_p99_ms: 30.0,
            load_cv: 0.1,
            load_max_over_mean: 1.1,
            missed_reuse: 0.5,
            herd: 3,
            select_p50_ns: 100.0,
            select_p99_ns: 200.0,
            ttft_sorted_ms: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::report;
    use super::*;

    /// A policy that refused requests is never "best", however well it
    /// served the ones it kept.
    #[test]
    fn best_lines_skip_policies_that_failed_more() {
        let table = render_table(&[report("greedy", 0.9, 40), report("steady", 0.5, 0)]);
        assert!(table.contains("best KV hit rate:      steady\n"), "{table}");
        let table = render_table(&[report("greedy", 0.9, 0), report("steady", 0.5, 0)]);
        assert!(table.contains("best KV hit rate:      greedy\n"), "{table}");
    }

    /// Every line of every table is at most `OUTPUT_WIDTH` characters and
    /// every policy's row shows all 14 values across the tables: two tables
    /// with the default set's labels, more with longer ones.
    #[test]
    fn tables_fit_the_width_and_keep_every_column() {
        let values_per_row = |table: &str, label: &str| -> usize {
            table
                .lines()
                .filter_map(|l| l.strip_prefix(label))
                .filter(|rest| rest.starts_with("  "))
                .map(|rest| rest.split_whitespace().count())
                .sum()
        };
        for (label, tables) in [
            ("device-aware-weighted", 2),
            ("device-aware-weighted +soft", 2),
            ("kv margin 30%", 2),
            ("kv:{switch_margin_relative: 0.3, max_dwell: 2}", 3),
            ("kv:{switch_margin_relative: 0.3, router_temperature: 0.11}", 4),
        ] {
            let reports = [report(label, 0.625, 0), report("random", 1.0, 40)];
            let table = render_table(&reports);
            let wide: Vec<&str> = table.lines().filter(|l| l.chars().count() > OUTPUT_WIDTH).collect();
            assert!(wide.is_empty(), "{label}: {wide:#?}");
            assert_eq!(
                table.matches("\npolicy ").count() + usize::from(table.starts_with("policy ")),
                tables,
                "{table}"
            );
            for l in [label, "random"] {
                assert_eq!(values_per_row(&table, l), 14, "{l}:\n{table}");
            }
            for needle in ["KV hit", "reuse %", "p99 ms", "max/mean", "herd", "p50 µs", "failed"] {
                assert!(table.contains(needle), "{needle:?} not in\n{table}");
            }
            assert!(table.contains(&format!("best KV hit rate:      {label}\n")), "{table}");
        }
        // A label too long for any column beside it still shows them all.
        let long = "x".repeat(OUTPUT_WIDTH);
        let table = render_table(&[report(&long, 0.5, 0)]);
        assert_eq!(values_per_row(&table, &long), 14, "{table}");
    }

    /// Herding counts, per rank, the arrivals within one window.
    #[test]
    fn herding_is_the_densest_window_of_one_rank() {
        let record = |row: u32, at: f64| crate::sim::run::RequestRecord {
            row: Some(row),
            arrival_ms: at,
            first_token_ms: f64::NAN,
            finish_ms: f64::NAN,
            cached_tokens: 0,
            best_cached_tokens: 0,
            routed_cached_tokens: 0,
            input_tokens: 1,
            selection_ns: 0,
        };
        let run = RunRecord {
            requests: vec![
                record(0, 0.0),
                record(1, 1.0),
                record(0, 5.0),
                record(0, 9.9),
                record(0, 10.0),
                record(1, 2.0),
            ],
            makespan_ms: 20.0,
            load_area: vec![0.0; 2],
            sample_times_ms: Vec::new(),
            load_samples: Vec::new(),
            failures: 0,
            first_failure: None,
            herd_window_ms: 10.0,
        };
        // Rank 0 takes 0, 5 and 9.9 within 10 ms (10.0 starts a new window
        // without 0); rank 1 takes two.
        assert_eq!(herding(&run), 3);
        assert_eq!(
            herding(&RunRecord {
                herd_window_ms: 10.5,
                ..run
            }),
            4
        );
    }

    #[test]
    fn quantile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
