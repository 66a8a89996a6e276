//! The side-by-side bench's tables: Markdown pipe tables with padded
//! columns, so a run's output reads well in a terminal and pastes into
//! BENCHMARKS.md as is. The bench measures; this module only formats, and
//! judges each row against the targets in BENCHMARKS.md.
//!
//! Column names say which selkie path a figure belongs to: "public API" is
//! one select + book + release through `selkie::WorkerSelectionService`;
//! "kernel path" is the kernel calls alone on a kernel `Fleet` (and on plain
//! slices). Every ratio is Dynamo's median over selkie's, from one run.

use std::fmt::Write as _;

use super::Case;

/// Targets (BENCHMARKS.md), for 1,024 workers and more: (temperature, minimum
/// speed-up over Dynamo's `DefaultWorkerSelector`, maximum ns per worker).
pub const TARGETS: [(f32, f64, f64); 2] = [(0.0, 50.0, 0.5), (0.7, 30.0, 1.0)];
/// Smallest fleet the targets apply to.
pub const TARGET_MIN_WORKERS: usize = 1_024;
/// Speedup targets of the public API with worker-keyed overlaps: (temperature,
/// workers, speedup).
pub const KEYED_TARGETS: [(f32, usize, f64); 4] = [
    (0.0, 1_024, 30.0),
    (0.0, 10_000, 50.0),
    (0.7, 1_024, 20.0),
    (0.7, 10_000, 30.0),
];

/// One case of the selector comparison: median ns per call of each side.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectorRow {
    /// Dynamo's fixture or a random fleet.
    pub case: Case,
    /// Workers in the fleet.
    pub workers: usize,
    /// Router temperature.
    pub temperature: f32,
    /// Dynamo's `DefaultWorkerSelector::select_worker`.
    pub dynamo_ns: f64,
    /// selkie's public API: select + book + release, overlaps as row columns.
    pub public_ns: f64,
    /// The same with the overlaps keyed by worker, in a shuffled order.
    pub keyed_ns: f64,
    /// selkie's kernel path on a kernel `Fleet`.
    pub kernel_ns: f64,
    /// selkie's kernel path on plain slices.
    pub slices_ns: f64,
}

impl SelectorRow {
    /// Dynamo over selkie's public API.
    pub fn public_ratio(&self) -> f64 {
        self.dynamo_ns / self.public_ns
    }

    /// Dynamo over selkie's public API, overlaps keyed by worker.
    pub fn keyed_ratio(&self) -> f64 {
        self.dynamo_ns / self.keyed_ns
    }

    /// Dynamo over selkie's kernel path (fleet).
    pub fn kernel_ratio(&self) -> f64 {
        self.dynamo_ns / self.kernel_ns
    }
}

/// One case of the full-path comparison (the second anchor).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CoreRow {
    /// Workers registered.
    pub workers: u64,
    /// Dynamo's `SelectionCore::select_and_reserve` + `free_reservation`.
    pub dynamo_ns: f64,
    /// selkie's public API: select + book + release.
    pub public_ns: f64,
}

impl CoreRow {
    /// Dynamo over selkie.
    pub fn ratio(&self) -> f64 {
        self.dynamo_ns / self.public_ns
    }
}

/// A row's standing against the speed-up target: `-` below
/// [`TARGET_MIN_WORKERS`] or at a temperature without a target.
pub fn speedup_verdict(workers: usize, temperature: f32, ratio: f64) -> String {
    match target(workers, temperature) {
        None => "-".into(),
        Some((speedup, _)) if ratio >= speedup => format!(">= {speedup}x met"),
        Some((speedup, _)) => format!(">= {speedup}x MISSED ({:.1}x short)", speedup / ratio),
    }
}

/// A row's standing against the ns-per-worker target.
pub fn per_worker_verdict(workers: usize, temperature: f32, ns: f64) -> String {
    match target(workers, temperature) {
        None => "-".into(),
        Some((_, limit)) if ns / workers as f64 <= limit => format!("<= {limit} ns/wkr met"),
        Some((_, limit)) => format!("<= {limit} ns/wkr MISSED"),
    }
}

fn target(workers: usize, temperature: f32) -> Option<(f64, f64)> {
    if workers < TARGET_MIN_WORKERS {
        return None;
    }
    TARGETS
        .iter()
        .find(|(t, _, _)| *t == temperature)
        .map(|&(_, speedup, ns)| (speedup, ns))
}

/// A worker-keyed row's standing against [`KEYED_TARGETS`]; `-` for a fleet
/// size or temperature without one.
pub fn keyed_verdict(workers: usize, temperature: f32, ratio: f64) -> String {
    match KEYED_TARGETS
        .iter()
        .find(|&&(t, n, _)| t == temperature && n == workers)
    {
        None => "-".into(),
        Some(&(_, _, speedup)) if ratio >= speedup => format!(">= {speedup}x met"),
        Some(&(_, _, speedup)) => format!(">= {speedup}x MISSED ({:.1}x short)", speedup / ratio),
    }
}

/// The compact summary: every case, Dynamo against selkie's public API.
/// Full-path rows (`core`) have case `full path` and no target.
pub fn summary(rows: &[SelectorRow], core: &[CoreRow]) -> String {
    let mut t = Table::new(&[
        "case",
        "workers",
        "T",
        "Dynamo ns",
        "selkie ns (public API)",
        "ratio",
        "target (public API)",
        "selkie ns (public API, worker-keyed)",
        "ratio (worker-keyed)",
        "target (worker-keyed)",
    ]);
    for r in rows {
        let ratio = r.public_ratio();
        let keyed = r.keyed_ratio();
        t.row(vec![
            r.case.name().into(),
            r.workers.to_string(),
            format!("{:.1}", r.temperature),
            ns(r.dynamo_ns),
            ns(r.public_ns),
            times(ratio),
            speedup_verdict(r.workers, r.temperature, ratio),
            ns(r.keyed_ns),
            times(keyed),
            keyed_verdict(r.workers, r.temperature, keyed),
        ]);
    }
    for r in core {
        t.row(vec![
            "full path".into(),
            r.workers.to_string(),
            "0.0".into(),
            ns(r.dynamo_ns),
            ns(r.public_ns),
            times(r.ratio()),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
        ]);
    }
    t.render()
}

/// The selector comparison in full: both selkie paths, their ratios and
/// ns per worker, and the verdicts.
pub fn selector_details(rows: &[SelectorRow]) -> String {
    let mut t = Table::new(&[
        "case",
        "workers",
        "T",
        "Dynamo ns",
        "public API ns",
        "public API ratio",
        "public API ns/wkr",
        "kernel path ns",
        "kernel path ratio",
        "kernel path ns/wkr",
        "kernel on slices ns",
        "target (kernel path)",
    ]);
    for r in rows {
        let per_worker = |ns: f64| format!("{:.3}", ns / r.workers as f64);
        t.row(vec![
            r.case.name().into(),
            r.workers.to_string(),
            format!("{:.1}", r.temperature),
            ns(r.dynamo_ns),
            ns(r.public_ns),
            times(r.public_ratio()),
            per_worker(r.public_ns),
            ns(r.kernel_ns),
            times(r.kernel_ratio()),
            per_worker(r.kernel_ns),
            ns(r.slices_ns),
            format!(
                "{}, {}",
                speedup_verdict(r.workers, r.temperature, r.kernel_ratio()),
                per_worker_verdict(r.workers, r.temperature, r.kernel_ns)
            ),
        ]);
    }
    t.render()
}

/// The full-path comparison (the second anchor).
pub fn core_details(core: &[CoreRow]) -> String {
    let mut t = Table::new(&[
        "workers",
        "Dynamo select_and_reserve + free ns",
        "selkie public API ns",
        "ratio",
    ]);
    for r in core {
        t.row(vec![
            r.workers.to_string(),
            ns(r.dynamo_ns),
            ns(r.public_ns),
            times(r.ratio()),
        ]);
    }
    t.render()
}

fn ns(v: f64) -> String {
    format!("{v:.1}")
}

fn times(v: f64) -> String {
    format!("{v:.1}x")
}

/// A Markdown pipe table: the first column left-aligned, the rest right.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column names.
    pub fn new(header: &[&str]) -> Self {
        Table {
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row.
    ///
    /// # Panics
    /// If the row's length differs from the header's.
    pub fn row(&mut self, cells: Vec<String>) {
        assert_eq!(cells.len(), self.header.len(), "one cell per column");
        self.rows.push(cells);
    }

    /// The table, one line per row, each ending in a newline.
    pub fn render(&self) -> String {
        let widths: Vec<usize> = (0..self.header.len())
            .map(|c| {
                let cells = self.rows.iter().map(|r| r[c].len());
                cells.chain([self.header[c].len(), 3]).max().unwrap_or(3)
            })
            .collect();
        let mut out = String::new();
        let line = |out: &mut String, cells: &[String]| {
            for (c, cell) in cells.iter().enumerate() {
                let w = widths[c];
                if c == 0 {
                    let _ = write!(out, "| {cell:<w$} ");
                } else {
                    let _ = write!(out, "| {cell:>w$} ");
                }
            }
            out.push_str("|\n");
        };
        line(&mut out, &self.header);
        for (c, &w) in widths.iter().enumerate() {
            let dashes = "-".repeat(w);
            if c == 0 {
                let _ = write!(out, "|:{dashes}-");
            } else {
                let _ = write!(out, "|-{dashes}:");
            }
        }
        out.push_str("|\n");
        for r in &self.rows {
            line(&mut out, r);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_aligned_markdown() {
        let mut t = Table::new(&["case", "n"]);
        t.row(vec!["fixture".into(), "10000".into()]);
        t.row(vec!["random".into(), "2".into()]);
        assert_eq!(
            t.render(),
            "| case    |     n |\n\
             |:--------|------:|\n\
             | fixture | 10000 |\n\
             | random  |     2 |\n"
        );
    }

    #[test]
    fn verdicts_follow_the_targets() {
        assert_eq!(speedup_verdict(32, 0.0, 1.0), "-");
        assert_eq!(speedup_verdict(1_024, 0.0, 50.0), ">= 50x met");
        assert_eq!(speedup_verdict(10_000, 0.0, 25.0), ">= 50x MISSED (2.0x short)");
        assert_eq!(speedup_verdict(10_000, 0.7, 31.0), ">= 30x met");
        assert_eq!(per_worker_verdict(1_000, 0.7, 900.0), "-");
        assert_eq!(per_worker_verdict(2_000, 0.7, 2_000.0), "<= 1 ns/wkr met");
        assert_eq!(per_worker_verdict(2_000, 0.0, 2_000.0), "<= 0.5 ns/wkr MISSED");
        assert_eq!(keyed_verdict(32, 0.0, 100.0), "-");
        assert_eq!(keyed_verdict(1_024, 0.0, 30.0), ">= 30x met");
        assert_eq!(keyed_verdict(10_000, 0.0, 25.0), ">= 50x MISSED (2.0x short)");
        assert_eq!(keyed_verdict(10_000, 0.7, 31.0), ">= 30x met");
    }

    #[test]
    fn the_summary_has_one_line_per_case() {
        let row = SelectorRow {
            case: Case::Random { seed: 1 },
            workers: 1_024,
            temperature: 0.7,
            dynamo_ns: 3_000.0,
            public_ns: 100.0,
            keyed_ns: 200.0,
            kernel_ns: 50.0,
            slices_ns: 40.0,
        };
        let core = CoreRow {
            workers: 8,
            dynamo_ns: 9_000.0,
            public_ns: 300.0,
        };
        let s = summary(&[row], &[core]);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[2].starts_with("| random "), "{s}");
        assert!(lines[2].contains("30.0x") && lines[2].contains(">= 30x met"), "{s}");
        assert!(
            lines[2].contains("15.0x") && lines[2].contains(">= 20x MISSED (1.3x short)"),
            "{s}"
        );
        assert!(
            lines[3].starts_with("| full path ") && lines[3].ends_with(" - |"),
            "{s}"
        );
        assert_eq!(selector_details(&[row]).lines().count(), 3);
        assert_eq!(core_details(&[core]).lines().count(), 3);
    }
}
