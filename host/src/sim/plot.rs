//! SVG plots of a comparison: per-worker load over time for each policy, and
//! the distribution (CDF) of time to first token per policy.
//!
//! Uses `plotters` with only its SVG backend and line series, so no font or
//! image libraries are built. This module only draws what it is given.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::metrics::PolicyReport;
use super::run::{FleetSpec, RunRecord};

/// Why a plot could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write plot {path}: {message}")]
pub struct PlotError {
    /// The file.
    pub path: PathBuf,
    /// What went wrong.
    pub message: String,
}

fn err(path: &Path) -> impl Fn(String) -> PlotError + '_ {
    move |message| PlotError {
        path: path.to_owned(),
        message,
    }
}

/// The most requests any worker (its ranks summed) held at a load sample of
/// any of `runs`: the common y scale of their load plots, so that policies
/// compare at a glance.
pub fn load_y_max<'a>(fleet: &FleetSpec, runs: impl IntoIterator<Item = &'a RunRecord>) -> f64 {
    let spans = worker_rows(fleet);
    runs.into_iter()
        .flat_map(|r| &r.load_samples)
        .flat_map(|s| spans.iter().map(|span| s[span.clone()].iter().sum::<u32>()))
        .fold(1, u32::max) as f64
}

/// The rows of each worker of `fleet`.
fn worker_rows(fleet: &FleetSpec) -> Vec<std::ops::Range<usize>> {
    (0..fleet.workers.max(1))
        .map(|w| {
            let first = fleet.first_row(w);
            first..first + fleet.worker_model(w).dp_size as usize
        })
        .collect()
}

/// Writes the in-flight requests of every worker (its ranks summed) over
/// time during `run` to `path`, on a y axis up to `y_max` (see
/// [`load_y_max`]; the run's own maximum if smaller values would be cut).
pub fn plot_load(path: &Path, title: &str, fleet: &FleetSpec, run: &RunRecord, y_max: f64) -> Result<(), PlotError> {
    let e = err(path);
    let series: Vec<Vec<(f64, f64)>> = worker_rows(fleet)
        .into_iter()
        .map(|span| {
            run.sample_times_ms
                .iter()
                .zip(&run.load_samples)
                .map(|(&t, s)| (t / 1000.0, s[span.clone()].iter().sum::<u32>() as f64))
                .collect()
        })
        .collect();
    let t_max = run.sample_times_ms.last().copied().unwrap_or(0.0) / 1000.0;
    let y_max = series.iter().flatten().map(|p| p.1).fold(y_max.max(1.0), f64::max);
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..t_max.max(1e-3), 0.0..y_max * 1.05)
        .map_err(|x| e(x.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc("requests in flight per worker")
        .draw()
        .map_err(|x| e(x.to_string()))?;
    for (w, points) in series.into_iter().enumerate() {
        let color = Palette99::pick(w).stroke_width(1);
        chart
            .draw_series(LineSeries::new(points, color))
            .map_err(|x| e(x.to_string()))?;
    }
    root.present().map_err(|x| e(x.to_string()))
}

/// Writes the cumulative distribution of time to first token of every
/// policy in `reports` to `path`, on a logarithmic time axis up to the
/// largest p99 (tails and bodies both readable). Policies whose
/// distributions are identical share one curve, labelled with all their
/// names, so that none hides under another.
pub fn plot_ttft(path: &Path, title: &str, reports: &[PolicyReport]) -> Result<(), PlotError> {
    let e = err(path);
    let x_max = reports
        .iter()
        .map(|r| r.ttft_p99_ms)
        .filter(|v| v.is_finite())
        .fold(1.0, f64::max)
        * 1.1;
    let x_min = reports
        .iter()
        .flat_map(|r| r.ttft_sorted_ms.first())
        .copied()
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold(x_max, f64::min)
        .clamp(0.01, x_max / 2.0);
    // One curve per distinct distribution.
    let mut curves: Vec<(String, &[f64])> = Vec::new();
    for r in reports {
        match curves.iter_mut().find(|(_, t)| *t == r.ttft_sorted_ms.as_slice()) {
            Some((label, _)) => {
                label.push_str(" = ");
                label.push_str(&r.policy);
            }
            None => curves.push((r.policy.clone(), &r.ttft_sorted_ms)),
        }
    }
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((x_min..x_max).log_scale(), 0.0..1.0)
        .map_err(|x| e(x.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("time to first token (ms, log scale)")
        .y_desc("share of requests")
        .draw()
        .map_err(|x| e(x.to_string()))?;
    for (i, (label, ttft)) in curves.into_iter().enumerate() {
        let n = ttft.len().max(1) as f64;
        let step = (ttft.len() / 400).max(1);
        let points: Vec<(f64, f64)> = ttft
            .iter()
            .enumerate()
            .filter(|(k, _)| (k + 1) % step == 0 || k + 1 == ttft.len())
            .map(|(k, &t)| (t.clamp(x_min, x_max), (k + 1) as f64 / n))
            .collect();
        let color = Palette99::pick(i).stroke_width(2);
        chart
            .draw_series(LineSeries::new(points, color))
            .map_err(|x| e(x.to_string()))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], Palette99::pick(i).stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(x.to_string()))?;
    root.present().map_err(|x| e(x.to_string()))
}
