//! The routing simulator: which policy and settings will serve a fleet best?
//!
//! It replays a workload (generated, [`workload`], or read from a
//! Mooncake-style trace, [`trace`]) against simulated inference engines
//! ([`engine`]: continuous batching, chunked prefill, a prefix-hashed LRU KV
//! cache per data-parallel rank, [`cache`]) and routes every request through
//! selkie's real [`crate::WorkerSelectionService`] ([`service_router`]),
//! feeding it the per-worker overlaps the simulated caches report, as a
//! router fed by KV events would. [`compare`] runs one workload under many
//! policies; [`metrics`] turns each run into the comparison table and
//! [`plot`] into SVG charts.
//!
//! Compiled only with the `sim` feature, so routers that embed selkie do not
//! build the simulator's dependencies. The command-line front end is the
//! `selkie simulate` program (`src/bin/selkie.rs`).
//!
//! ```
//! use selkie::sim::{compare::{run_policy, PolicyChoice}, scenario::{Scenario, ScenarioName}};
//! use selkie::WorkerSelectionPolicyRegistry;
//!
//! let mut scenario = Scenario::embedded(ScenarioName::Default);
//! scenario.workload.requests = 200;
//! let workload = scenario.workload.generate(42);
//! let registry = WorkerSelectionPolicyRegistry::new();
//! let run = run_policy(&registry, &PolicyChoice::kv_at(0.0), &workload, &scenario.fleet, 42, &mut |_| {})?;
//! assert_eq!(run.report.routed, 200);
//! assert!(run.report.hit_rate > 0.0);
//! # Ok::<(), selkie::sim::SimError>(())
//! ```

pub mod cache;
pub mod compare;
pub mod dist;
pub mod engine;
pub mod index;
pub mod limits;
pub mod memory;
pub mod metrics;
pub mod plot;
pub mod router;
pub mod run;
pub mod scenario;
pub mod service_router;
pub mod trace;
pub mod tune;
pub mod workload;

#[cfg(test)]
mod tests;

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A policy could not be built.
    #[error(transparent)]
    Registry(#[from] crate::RegistryError),
    /// The simulated fleet could not be registered.
    #[error(transparent)]
    Discovery(#[from] crate::DiscoveryError),
    /// The worker-selection config file is invalid.
    #[error(transparent)]
    Config(#[from] crate::ConfigError),
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] trace::TraceError),
    /// A plot could not be written.
    #[error(transparent)]
    Plot(#[from] plot::PlotError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A bad command-line value.
    #[error("{0}")]
    Usage(String),
    /// The router's service counts blocks of another size than the
    /// workload's ([`simulate`](run::simulate) refuses it before routing
    /// any request).
    #[error(
        "the workload's blocks are of {workload} tokens but the router's service counts blocks of {router}: build \
         the service with the workload's block size"
    )]
    BlockSizeMismatch {
        /// The workload's block size.
        workload: u32,
        /// The router's ([`Router::block_size`](router::Router::block_size)).
        router: u32,
    },
    /// A number of the scenario, a trace or the command line outside what
    /// the simulator accepts (see [`limits`]).
    #[error("{field} = {value}: {bound}")]
    Invalid {
        /// The option (`--workers`) or scenario field (`fleet.workers`).
        field: String,
        /// The value given.
        value: String,
        /// What it must be.
        bound: String,
    },
    /// A run would need more memory than its bound (see [`memory`]).
    #[error(
        "{field}: {requests} requests need {need} (their prompts' hash ids, and one policy's records and bookings), \
         over the memory limit of {limit} ({limit_field}); lower {field} or raise {limit_field}"
    )]
    OverMemory {
        /// The option or field that sizes the run (`--requests`).
        field: String,
        /// The requests of the run.
        requests: usize,
        /// What they need (`about 23.4 GiB`, or `at least ...` when the
        /// run was stopped while its requests were counted).
        need: String,
        /// The bound.
        limit: String,
        /// The option or field that sets the bound (`--max-memory`).
        limit_field: String,
    },
    /// The simulated fleet has more ranks than the selection service's fleet
    /// has rows.
    #[error("{workers} workers x {dp_size} DP ranks is more than the fleet's {capacity} rows")]
    FleetTooLarge {
        /// Workers asked for.
        workers: u32,
        /// Ranks per worker asked for.
        dp_size: u32,
        /// Rows the fleet holds.
        capacity: usize,
    },
}
