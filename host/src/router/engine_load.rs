//! Load and busy signals from the engines' own metrics
//! (`--engine-metrics-interval`), as the Gateway API Inference Extension's
//! model server protocol describes: every period, each worker's
//! Prometheus `GET /metrics` is read and three figures kept:
//!
//! | figure | vLLM | SGLang |
//! |---|---|---|
//! | requests waiting | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | requests running | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | KV cache usage (0 to 1) | `vllm:kv_cache_usage_perc` (or `vllm:gpu_cache_usage_perc`) | `sglang:token_usage` |
//!
//! (samples of one name are summed over their labels; the usage is the
//! largest sample). What the router does with them:
//!
//! * **Busy**: a worker whose engine has at least
//!   [`queue_threshold`](EngineMetricsConfig::queue_threshold) requests
//!   waiting, or a KV cache usage of at least
//!   [`kv_usage_threshold`](EngineMetricsConfig::kv_usage_threshold), is
//!   marked overloaded: the hard filters skip it until a later read says
//!   otherwise (every worker busy: 429).
//! * **Load**: the requests the engine holds (waiting and running) beyond
//!   the ones this router booked on it, from other routers or clients, are
//!   set as the worker's external load
//!   ([`WorkerSelectionService::set_external_load`](crate::WorkerSelectionService::set_external_load)):
//!   they count as in-flight requests, for the load policies and the
//!   admission limits (the `kv` cost reads in-flight requests only with a
//!   `decode_active_request_weight` above 0, and its default is 0). This
//!   router's own bookings are read as each engine's answer arrives.
//! * **Staleness**: a worker's figures older than
//!   [`staleness`](EngineMetricsConfig::staleness) (its reads fail, time
//!   out, or carry none of the names) stop counting: its busy mark and
//!   external load are cleared, and the router goes on with its own
//!   bookings only.
//!
//! Metrics: `selkie_engine_scrapes_total{worker,outcome}`,
//! `selkie_engine_requests_waiting{worker}`,
//! `selkie_engine_requests_running{worker}`,
//! `selkie_engine_kv_usage{worker}`, `selkie_engine_external_requests{worker}`
//! and `selkie_engine_busy{worker}`.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::route::RouterCore;
use super::upstream::Upstream;
use crate::{WorkerId, WorkerWithDpRank};

/// The largest `/metrics` answer read from an engine (4 MiB).
pub const MAX_ENGINE_METRICS_BYTES: usize = 4 << 20;

/// How the engines' metrics are read and used.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineMetricsConfig {
    /// How often each engine's `/metrics` is read (`--engine-metrics-interval`).
    pub interval: Duration,
    /// Figures older than this stop counting (`--engine-metrics-staleness`,
    /// default 2 s).
    pub staleness: Duration,
    /// Requests waiting at which an engine is busy
    /// (`--engine-queue-threshold`, default 128).
    pub queue_threshold: f64,
    /// KV cache usage (0 to 1) at which an engine is busy
    /// (`--engine-kv-usage-threshold`, default 0.98).
    pub kv_usage_threshold: f64,
}

impl EngineMetricsConfig {
    /// Reads every `interval`, with the default bounds.
    pub fn every(interval: Duration) -> Self {
        EngineMetricsConfig {
            interval,
            staleness: Duration::from_secs(2),
            queue_threshold: 128.0,
            kv_usage_threshold: 0.98,
        }
    }

    /// Whether `load` makes its engine busy.
    pub fn busy(&self, load: &EngineLoad) -> bool {
        load.waiting >= self.queue_threshold || load.kv_usage.is_some_and(|u| u >= self.kv_usage_threshold)
    }
}

/// What one read of an engine's metrics said.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    /// Requests waiting (queued).
    pub waiting: f64,
    /// Requests running.
    pub running: f64,
    /// KV cache usage, 0 to 1, when the engine reports it.
    pub kv_usage: Option<f64>,
}

impl EngineLoad {
    /// Reads the figures from Prometheus text; `None` when it has none of
    /// the names (see the module docs).
    ///
    /// ```
    /// use selkie::router::engine_load::EngineLoad;
    /// let text = "# HELP vllm:num_requests_waiting Waiting.\n\
    ///             vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
    ///             vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0\n\
    ///             vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n";
    /// let load = EngineLoad::parse(text).unwrap();
    /// assert_eq!((load.waiting, load.running, load.kv_usage), (3.0, 2.0, Some(0.5)));
    /// assert_eq!(EngineLoad::parse("other_metric 1\n"), None);
    /// ```
    pub fn parse(text: &str) -> Option<EngineLoad> {
        let mut load = EngineLoad::default();
        let mut seen = false;
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, rest) = match line.find(['{', ' ']) {
                Some(i) if line.as_bytes()[i] == b'{' => match line.rfind('}') {
                    Some(j) if j > i => (&line[..i], &line[j + 1..]),
                    _ => continue,
                },
                Some(i) => (&line[..i], &line[i..]),
                None => continue,
            };
            let Some(value) = rest.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) else {
                continue;
            };
            if !value.is_finite() || value < 0.0 {
                continue;
            }
            match name {
                "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => load.waiting += value,
                "vllm:num_requests_running" | "sglang:num_running_reqs" => load.running += value,
                "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                    load.kv_usage = Some(load.kv_usage.map_or(value, |u| u.max(value)));
                }
                _ => continue,
            }
            seen = true;
        }
        seen.then_some(load)
    }
}

type Labels = Vec<(&'static str, String)>;

/// What `/metrics` shows of the engines' figures.
#[derive(Clone, Default)]
pub struct EngineLoadMetrics {
    scrapes: Family<Vec<(&'static str, String)>, Counter>,
    waiting: Family<Labels, Gauge<f64, AtomicU64>>,
    running: Family<Labels, Gauge<f64, AtomicU64>>,
    kv_usage: Family<Labels, Gauge<f64, AtomicU64>>,
    external: Family<Labels, Gauge>,
    busy: Family<Labels, Gauge>,
}

impl EngineLoadMetrics {
    /// Registers them.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "selkie_engine_scrapes",
            "Reads of the engines' /metrics, by worker and outcome (ok, failed, no_figures)",
            self.scrapes.clone(),
        );
        registry.register(
            "selkie_engine_requests_waiting",
            "Requests waiting, as the engine last said",
            self.waiting.clone(),
        );
        registry.register(
            "selkie_engine_requests_running",
            "Requests running, as the engine last said",
            self.running.clone(),
        );
        registry.register(
            "selkie_engine_kv_usage",
            "KV cache usage (0 to 1), as the engine last said",
            self.kv_usage.clone(),
        );
        registry.register(
            "selkie_engine_external_requests",
            "Requests the engine holds beyond this router's bookings, counted as its load",
            self.external.clone(),
        );
        registry.register(
            "selkie_engine_busy",
            "1 while the engine's figures mark it busy",
            self.busy.clone(),
        );
    }
}

/// One worker's last figures and what was applied from them.
#[derive(Default)]
struct Applied {
    load: Option<(EngineLoad, Instant)>,
    busy: bool,
    external: u64,
    /// The worker's first rank's row when this was applied: a worker
    /// removed and added again (a new row, no busy mark, no outside load)
    /// starts over.
    row: Option<crate::RankRow>,
}

/// Reads the engines' metrics every `config.interval` and applies them,
/// until the task is aborted.
pub async fn run(core: Arc<RouterCore>, upstream: Upstream, config: EngineMetricsConfig, metrics: EngineLoadMetrics) {
    let mut applied: HashMap<WorkerId, Applied> = HashMap::new();
    // The URL of each worker read last time, to drop its gauges when it
    // leaves.
    let mut urls: HashMap<WorkerId, String> = HashMap::new();
    let timeout = config.interval.max(Duration::from_millis(100)).min(config.staleness);
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let view = core.table.view();
        let mut reads = Vec::with_capacity(view.workers().len());
        for worker in view.workers() {
            let (worker, upstream) = (worker.clone(), upstream.clone());
            let service = core.service.clone();
            reads.push(tokio::spawn(async move {
                let read = upstream
                    .get(&worker, "/metrics", timeout, MAX_ENGINE_METRICS_BYTES)
                    .await;
                // The requests held on the worker now, as the engine's
                // figures arrive (not after every other read).
                let held: Option<u64> = service
                    .worker_status(worker.id)
                    .map(|s| s.ranks.iter().map(|r| u64::from(r.active_requests)).sum());
                (worker, read, held)
            }));
        }
        let now = Instant::now();
        let mut present = Vec::with_capacity(reads.len());
        for r in reads {
            let Ok((worker, read, held)) = r.await else { continue };
            present.push(worker.id);
            let label = || vec![("worker", worker.url.as_str().to_owned())];
            let state = applied.entry(worker.id).or_default();
            let row = core.service.rank_row(WorkerWithDpRank::new(worker.id, worker.dp.0));
            if row != state.row {
                state.busy = false;
                state.external = 0;
                state.row = row;
            }
            let outcome = match read.as_deref().map(|b| EngineLoad::parse(&String::from_utf8_lossy(b))) {
                Ok(Some(load)) => {
                    state.load = Some((load, now));
                    metrics.waiting.get_or_create(&label()).set(load.waiting);
                    metrics.running.get_or_create(&label()).set(load.running);
                    if let Some(u) = load.kv_usage {
                        metrics.kv_usage.get_or_create(&label()).set(u);
                    }
                    "ok"
                }
                Ok(None) => "no_figures",
                Err(why) => {
                    tracing::debug!(worker = worker.url.as_str(), %why, "cannot read the engine's metrics");
                    "failed"
                }
            };
            metrics
                .scrapes
                .get_or_create(&vec![
                    ("worker", worker.url.as_str().to_owned()),
                    ("outcome", outcome.to_owned()),
                ])
                .inc();
            let fresh = state
                .load
                .filter(|(_, at)| now.saturating_duration_since(*at) <= config.staleness)
                .map(|(l, _)| l);
            let busy = fresh.is_some_and(|l| config.busy(&l));
            if busy != state.busy && core.service.set_overloaded(worker.id, busy).is_ok() {
                state.busy = busy;
                metrics.busy.get_or_create(&label()).set(i64::from(busy));
            }
            let external = match (fresh, held) {
                (Some(l), Some(held)) => {
                    let own = held.saturating_sub(state.external);
                    ((l.waiting + l.running) as u64).saturating_sub(own)
                }
                _ => 0,
            };
            if external != state.external {
                // Ranks written or not, what they now hold is `external`
                // where written and 0 where the rank is gone.
                set_external(&core, worker.id, worker.dp, external);
                state.external = external;
                metrics
                    .external
                    .get_or_create(&label())
                    .set(i64::try_from(state.external).unwrap_or(i64::MAX));
            }
        }
        applied.retain(|id, _| {
            let keep = present.contains(id);
            if !keep {
                if let Some(url) = urls.get(id) {
                    let labels = vec![("worker", url.clone())];
                    for family in [&metrics.waiting, &metrics.running, &metrics.kv_usage] {
                        family.remove(&labels);
                    }
                    metrics.external.remove(&labels);
                    metrics.busy.remove(&labels);
                }
            }
            keep
        });
        for id in &present {
            if let Some(w) = view.get(*id) {
                urls.insert(*id, w.url.as_str().to_owned());
            }
        }
        urls.retain(|id, _| present.contains(id));
    }
}

/// Spreads `requests` over the worker's ranks (`dp`: first rank, count).
fn set_external(core: &RouterCore, worker: WorkerId, dp: (u32, u32), requests: u64) {
    let (start, count) = (dp.0, dp.1.max(1));
    for i in 0..count {
        let share = requests / u64::from(count) + u64::from(u64::from(i) < requests % u64::from(count));
        core.service
            .set_external_load(WorkerWithDpRank::new(worker, start + i), share);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_names_and_sums_over_labels_are_read() {
        let text = "sglang:num_queue_reqs{dp=\"0\"} 4\nsglang:num_queue_reqs{dp=\"1\"} 6\n\
                    sglang:num_running_reqs{dp=\"0\"} 1 1712345678\nsglang:token_usage{dp=\"0\"} 0.25\n\
                    sglang:token_usage{dp=\"1\"} 0.75\n";
        let load = EngineLoad::parse(text).unwrap();
        assert_eq!(load.waiting, 10.0);
        assert_eq!(load.running, 1.0);
        assert_eq!(load.kv_usage, Some(0.75));
    }

    #[test]
    fn labels_with_spaces_and_bad_values_do_not_confuse_the_reader() {
        let text = "vllm:num_requests_waiting{model_name=\"a b } c\"} 2\n\
                    vllm:num_requests_running{x=\"1\"} NaN\nvllm:num_requests_running -3\n\
                    vllm:num_requests_running{broken 5\n";
        let load = EngineLoad::parse(text).unwrap();
        assert_eq!(load.waiting, 2.0);
        assert_eq!(load.running, 0.0);
    }

    #[test]
    fn busy_by_queue_or_by_cache_usage() {
        let c = EngineMetricsConfig::every(Duration::from_secs(1));
        let load = |waiting, kv_usage| EngineLoad {
            waiting,
            running: 0.0,
            kv_usage,
        };
        assert!(!c.busy(&load(127.0, Some(0.5))));
        assert!(c.busy(&load(128.0, None)));
        assert!(c.busy(&load(0.0, Some(0.99))));
        assert!(!c.busy(&load(0.0, None)));
    }
}
