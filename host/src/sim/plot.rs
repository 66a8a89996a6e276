//! SVG plots of a comparison: the workers' load over time for each policy
//! (busiest, mean and least busy worker), and the distribution (CDF) of
//! time to first token per policy.
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

/// Draws the labels of `chart`'s series at `position`, on a white box.
fn draw_legend<'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
    position: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| x.to_string())
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

/// The load of a run's fleet at each of its load samples, summarised over
/// the workers (a worker's load: the requests in flight on its ranks).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadBands {
    /// When each sample was taken, in seconds.
    pub times_s: Vec<f64>,
    /// The busiest worker's load at each sample (not always the same
    /// worker).
    pub busiest: Vec<f64>,
    /// The mean load of the workers at each sample.
    pub mean: Vec<f64>,
    /// The least busy worker's load at each sample.
    pub least: Vec<f64>,
    /// The most requests any worker held at any sample.
    pub peak: u32,
}

impl LoadBands {
    /// The bands of `run` on `fleet`.
    pub fn of(fleet: &FleetSpec, run: &RunRecord) -> Self {
        let spans = worker_rows(fleet);
        let mut bands = LoadBands::default();
        for (&t, sample) in run.sample_times_ms.iter().zip(&run.load_samples) {
            let loads: Vec<u32> = spans
                .iter()
                .map(|span| sample.get(span.clone()).map_or(0, |s| s.iter().sum()))
                .collect();
            let busiest = loads.iter().copied().max().unwrap_or(0);
            bands.times_s.push(t / 1000.0);
            bands.busiest.push(f64::from(busiest));
            bands
                .mean
                .push(loads.iter().map(|&l| f64::from(l)).sum::<f64>() / loads.len().max(1) as f64);
            bands.least.push(f64::from(loads.iter().copied().min().unwrap_or(0)));
            bands.peak = bands.peak.max(busiest);
        }
        bands
    }
}

/// Writes the load of `run`'s workers over time to `path`: at each sample,
/// the busiest worker's requests in flight (its ranks summed), the mean
/// over the workers and the least busy worker's, as three labelled lines.
/// The gap between the top and bottom lines is the imbalance; the y axis
/// runs to this run's own peak (named in its description), so a policy
/// whose workers never hold more than 2 requests is drawn on a scale to 2,
/// not to another policy's peak.
pub fn plot_load(path: &Path, title: &str, fleet: &FleetSpec, run: &RunRecord) -> Result<(), PlotError> {
    let e = err(path);
    let bands = LoadBands::of(fleet, run);
    let t_max = bands.times_s.last().copied().unwrap_or(0.0);
    let y_max = f64::from(bands.peak.max(1));
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
        .y_desc(format!(
            "requests in flight per worker (axis to the peak of this run, {})",
            bands.peak
        ))
        .draw()
        .map_err(|x| e(x.to_string()))?;
    let workers = fleet.workers.max(1);
    let lines = [
        (&bands.busiest, "busiest worker".to_owned(), RED, 1),
        (&bands.mean, format!("mean of the {workers} workers"), BLACK, 2),
        (&bands.least, "least busy worker".to_owned(), BLUE, 1),
    ];
    for (values, label, color, width) in lines {
        let points = bands.times_s.iter().copied().zip(values.iter().copied());
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(width)))
            .map_err(|x| e(x.to_string()))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(width)));
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperRight).map_err(&e)?;
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
    draw_legend(&mut chart, SeriesLabelPosition::LowerRight).map_err(&e)?;
    root.present().map_err(|x| e(x.to_string()))
}
