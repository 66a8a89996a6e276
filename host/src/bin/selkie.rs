//! `selkie`: the command-line front end of the selkie library.
//!
//! `selkie simulate` answers "which policy and settings will serve my fleet
//! best?": it replays an embedded scenario or a Mooncake-style trace against
//! simulated inference workers, routes every request through selkie's real
//! selection service under each policy, and prints a comparison table (and,
//! with `--plots DIR`, SVG charts). Built with the `sim` feature.
//!
//! `selkie serve` runs an OpenAI-compatible HTTP router in front of
//! inference engines, every decision made by the selection service
//! (`selkie::router`). Built with the `serve` feature.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
#[cfg(feature = "sim")]
use {
    clap::Args,
    indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle},
    selkie::sim::compare::{run_policy_within, PolicyChoice, PolicyRun},
    selkie::sim::limits::{above_zero_option, MAX_BLOCK_SIZE, MAX_RATE_PER_S},
    selkie::sim::memory::{self, parse_bytes, MemoryLimit},
    selkie::sim::metrics::{render_table, wrap, HitBounds, PolicyReport, OUTPUT_WIDTH},
    selkie::sim::plot::{plot_load, plot_ttft},
    selkie::sim::run::TYPICAL_WORKER_KV_TOKENS,
    selkie::sim::scenario::{Scenario, ScenarioName},
    selkie::sim::trace::{read_trace_within, write_trace},
    selkie::sim::tune::{split_in_time_owned, tune as search, KvWeights, TuneSpace},
    selkie::sim::workload::{Workload, WorkloadSpec},
    selkie::sim::SimError,
    selkie::{AffinityMode, WorkerSelectionPolicyRegistry},
    std::fs::File,
    std::io::{BufReader, BufWriter, Write},
    std::path::{Path, PathBuf},
    std::time::{Duration, Instant},
};

/// The command's allocator: mimalloc. A tokenized request makes some
/// hundreds of small allocations in the `tokenizers` crate, and glibc's
/// allocator spends about half of that work in its own bookkeeping
/// (`malloc_consolidate` when a large buffer follows many small frees).
/// mimalloc is built with transparent huge pages off (`no_thp`): with them
/// on, a router tokenizing 4,000 requests/s had a p99 latency of 4.6-8.6 ms
/// where it has 1.6-1.7 ms without.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(feature = "serve")]
#[path = "selkie/serve.rs"]
mod serve;

#[derive(Parser, Debug)]
#[command(name = "selkie", version, about = "Worker selection for LLM request routers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Simulate a fleet under every policy and compare them.
    #[cfg(feature = "sim")]
    Simulate(SimulateArgs),
    /// Search the KV policy's weights with the simulator (trained on the
    /// first half of the requests, tested on the second) and write the
    /// winner as a worker-selection config file.
    #[cfg(feature = "sim")]
    Tune(TuneArgs),
    /// Route OpenAI-compatible requests to inference engines (an HTTP
    /// router whose every decision is selkie's).
    #[cfg(feature = "serve")]
    Serve(Box<serve::ServeArgs>),
}

#[cfg(feature = "sim")]
#[derive(Args, Debug)]
struct TuneArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Candidates simulated on the first half of the requests, the default
    /// weights included.
    #[arg(long, default_value_t = 48)]
    trials: usize,
    /// Where the winner is written, as a worker-selection config file that
    /// states the workload's block size (`block_size`): a router or a
    /// simulation of another block size converts its lengths in blocks.
    #[arg(long, value_name = "FILE", default_value = "tuned.yaml")]
    out: PathBuf,
}

#[cfg(feature = "sim")]
/// The fleet and the workload: an embedded scenario, a scenario file or a
/// trace, with overrides (shared by `simulate` and `tune`).
#[derive(Args, Debug)]
struct WorkloadArgs {
    /// Embedded scenario: `default` (16 workers, Poisson, shared prompts,
    /// sessions), `skewed` (16 workers x 2 DP ranks, bursty, hot prompts) or
    /// `mixed` (the default workload on 4 fast, 8 default and 4 CPU
    /// workers).
    #[arg(long, default_value = "default")]
    scenario: ScenarioName,
    /// Read the fleet and workload from a YAML (or JSON) file instead; see
    /// `selkie simulate --print-scenario` for the layout.
    #[arg(long, value_name = "FILE", conflicts_with = "scenario")]
    scenario_file: Option<PathBuf>,
    /// Number of workers (overrides the scenario).
    #[arg(long)]
    workers: Option<u32>,
    /// Data-parallel ranks per worker (overrides the scenario).
    #[arg(long)]
    dp: Option<u32>,
    /// Number of requests (overrides the scenario; truncates a trace).
    #[arg(long)]
    requests: Option<usize>,
    /// Mean arrival rate in requests per second (generated workloads; a
    /// trace has its own arrivals).
    #[arg(long, conflicts_with = "trace")]
    rate: Option<f64>,
    /// Admission limit per rank (requests in flight) given to the selection
    /// service; refused requests are counted as failed.
    #[arg(long, value_name = "N")]
    max_active: Option<u32>,
    /// Router replicas, each with its own selection service; requests are
    /// spread over them in turn (default 1).
    #[arg(long, value_name = "N")]
    routers: Option<u32>,
    /// With --routers: how long a replica's bookings take to reach the
    /// others, in ms, or `never` (the default: replicas without sync). The
    /// `herd` column counts requests to one rank within this delay (10 ms
    /// without one).
    #[arg(long, value_name = "MS|never", requires = "routers")]
    sync_delay: Option<String>,
    /// KV cache capacity per rank, in blocks of the workload's block size.
    #[arg(long, conflicts_with = "kv_tokens")]
    kv_blocks: Option<u32>,
    /// KV cache capacity per rank, in tokens (whole blocks of the workload's
    /// block size). Default: the scenario's; replaying a trace, a typical GPU
    /// worker's (`TYPICAL_WORKER_KV_TOKENS`: an 8B model on an 80 GiB
    /// accelerator, about 437,000 tokens).
    #[arg(long, value_name = "TOKENS")]
    kv_tokens: Option<u64>,
    /// Seed of the workload and of every random choice.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Replay a JSON Lines trace (`timestamp` ms, `input_length`,
    /// `output_length`, `hash_ids`: the Mooncake layout) instead of
    /// generating a workload.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Tokens per hash id in the trace. Default: the block size the trace
    /// records (traces written by `--write-trace` do), else 512 (the
    /// Mooncake traces).
    #[arg(long, value_name = "TOKENS", requires = "trace")]
    trace_block_size: Option<u32>,
    /// The most memory the run's requests may take: the workload's hash ids
    /// and one policy's records (`4G`, `512M`, bytes). A run that would
    /// need more is refused before it starts, with what it needs.
    #[arg(long, value_name = "BYTES", default_value = "4G", value_parser = parse_bytes)]
    max_memory: u64,
}

#[cfg(feature = "sim")]
#[derive(Args, Debug)]
struct SimulateArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Print the scenario (after overrides) as YAML and exit: a starting
    /// point for `--scenario-file`.
    #[arg(long)]
    print_scenario: bool,
    /// Policies to compare (repeatable): a registry type name (`kv`,
    /// `least-loaded`, ...), `kv@TEMPERATURE`, or `TYPE:{PARAMETERS}` with
    /// inline YAML parameters (`kv:{overlap_score_credit: 2}`). Default: every built-in
    /// (except `direct`), `kv` at temperature 0 (`kv T=0`) and `kv` with a
    /// relative switching margin of 30% (`kv margin 30%`, spelled
    /// `kv:{switch_margin_relative: 0.3}`).
    #[arg(long = "policy", value_name = "NAME")]
    policies: Vec<String>,
    /// Also simulate every policy instance of this worker-selection config
    /// file (YAML, or TOML when the name ends in `.toml`); a file that
    /// states another `block_size` than the workload's has its lengths in
    /// blocks converted to the workload's.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Also simulate each policy with requests carrying their multi-turn
    /// session under this affinity (`soft`: prefer the session's worker;
    /// `hard`: always it).
    #[arg(long, value_name = "MODE", value_parser = ["soft", "hard"])]
    session_affinity: Option<String>,
    /// Write SVG plots into DIR: the TTFT distribution of every policy, and
    /// per policy the busiest, mean and least busy worker's load over time.
    #[arg(long, value_name = "DIR")]
    plots: Option<PathBuf>,
    /// Write the reports as JSON (one object per policy) to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write the workload as a trace (the replay format) to FILE.
    #[arg(long, value_name = "FILE")]
    write_trace: Option<PathBuf>,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        #[cfg(feature = "serve")]
        Command::Serve(args) => serve::main(*args),
        #[cfg(feature = "sim")]
        command => sim_main(command),
    }
}

/// `simulate` and `tune`.
#[cfg(feature = "sim")]
fn sim_main(command: Command) -> ExitCode {
    let result = match command {
        Command::Simulate(args) => simulate(args),
        Command::Tune(args) => tune(args),
        #[cfg(feature = "serve")]
        Command::Serve(_) => unreachable!("dispatched by main"),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`selkie simulate | head`): nothing is left
        // to tell anyone.
        Err(SimError::Io { source, .. }) if source.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(feature = "sim")]
/// Standard output, as a [`SimError`] on failure (a closed pipe included).
fn stdout_err(source: std::io::Error) -> SimError {
    SimError::Io {
        path: PathBuf::from("<stdout>"),
        source,
    }
}

#[cfg(feature = "sim")]
/// The command-line overrides, each checked under its option's name.
fn check_options(args: &WorkloadArgs) -> Result<(), SimError> {
    let positive = |name: &str, v: Option<u64>| match v {
        Some(0) => Err(SimError::Invalid {
            field: name.into(),
            value: "0".into(),
            bound: "must be at least 1".into(),
        }),
        _ => Ok(()),
    };
    positive("--workers", args.workers.map(u64::from))?;
    positive("--dp", args.dp.map(u64::from))?;
    positive("--requests", args.requests.map(|n| n as u64))?;
    positive("--max-active", args.max_active.map(u64::from))?;
    positive("--routers", args.routers.map(u64::from))?;
    positive("--kv-blocks", args.kv_blocks.map(u64::from))?;
    positive("--kv-tokens", args.kv_tokens)?;
    positive("--trace-block-size", args.trace_block_size.map(u64::from))?;
    if let Some(b) = args.trace_block_size.filter(|&b| b > MAX_BLOCK_SIZE) {
        return Err(SimError::Invalid {
            field: "--trace-block-size".into(),
            value: b.to_string(),
            bound: format!("must be at most {MAX_BLOCK_SIZE}"),
        });
    }
    above_zero_option("--rate", args.rate, MAX_RATE_PER_S)
}

#[cfg(feature = "sim")]
fn io_err(path: &Path) -> impl Fn(std::io::Error) -> SimError + '_ {
    move |source| SimError::Io {
        path: path.to_owned(),
        source,
    }
}

#[cfg(feature = "sim")]
/// The scenario of `args`: the embedded or file scenario with the
/// command line's overrides, checked.
fn scenario_of(args: &WorkloadArgs) -> Result<Scenario, SimError> {
    check_options(args)?;
    let mut scenario = match &args.scenario_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(io_err(path))?;
            serde_saphyr::from_str(&text).map_err(|e| SimError::Usage(format!("{}: {e}", path.display())))?
        }
        None => Scenario::embedded(args.scenario),
    };
    if let Some(w) = args.workers {
        scenario.fleet.workers = w;
    }
    if let Some(dp) = args.dp {
        scenario.fleet.dp_size = dp;
    }
    if let Some(n) = args.requests {
        scenario.workload.requests = n;
    }
    if let Some(rate) = args.rate {
        scenario.workload.arrivals = scenario.workload.arrivals.with_rate(rate);
    }
    if let Some(kv) = args.kv_blocks {
        scenario.fleet.kv_blocks = kv;
    }
    if let Some(limit) = args.max_active {
        scenario.fleet.max_active_requests = Some(limit);
    }
    if let Some(n) = args.routers {
        scenario.fleet.routers = n;
    }
    if let Some(text) = &args.sync_delay {
        scenario.fleet.sync_delay_ms = match text.as_str() {
            "never" => None,
            t => match t.parse::<f64>() {
                Ok(ms) if ms.is_finite() && ms >= 0.0 => Some(ms),
                _ => {
                    return Err(SimError::Invalid {
                        field: "--sync-delay".into(),
                        value: t.into(),
                        bound: "must be a number of ms >= 0, or `never`".into(),
                    })
                }
            },
        };
    }
    scenario.validate()?;
    Ok(scenario)
}

#[cfg(feature = "sim")]
/// The requests of `args` (the trace's, else generated from `scenario`),
/// where they come from, and a note on where the cache size comes from;
/// sets `scenario`'s cache size for them.
///
/// `runs` policies are simulated at once (`tune`'s threads). A generated
/// workload is sized first from a sample of it ([`memory::estimate`]);
/// generating or reading stops as soon as the requests pass
/// `--max-memory` (see [`selkie::sim::memory`]).
fn workload_of(
    args: &WorkloadArgs,
    scenario: &mut Scenario,
    runs: usize,
) -> Result<(Workload, String, &'static str), SimError> {
    let mut capacity_note = "";
    let limit = MemoryLimit::cli(args.max_memory);
    let (workload, source) = match &args.trace {
        Some(path) => {
            let file = File::open(path).map_err(io_err(path))?;
            let limit = if args.requests.is_some() {
                limit
            } else {
                limit.for_field(format!("--trace {}", path.display()))
            };
            let w = read_trace_within(BufReader::new(file), args.trace_block_size, args.requests, &limit)?;
            memory::estimate(&w, w.requests.len(), runs, &limit)?;
            // A scenario file's cache keeps its size in tokens; the embedded
            // scenarios' small caches are not a model of a real worker.
            let tokens = match &args.scenario_file {
                Some(_) => u64::from(scenario.fleet.kv_blocks) * u64::from(scenario.workload.block_size),
                None => {
                    capacity_note = "; a typical GPU worker's: an 8B model on an 80 GiB accelerator";
                    TYPICAL_WORKER_KV_TOKENS
                }
            };
            scenario.fleet.kv_blocks = u32::try_from(tokens / u64::from(w.block_size))
                .unwrap_or(u32::MAX)
                .max(1);
            (w, format!("trace {}", path.display()))
        }
        None => {
            let spec = &scenario.workload;
            let sample = WorkloadSpec {
                requests: spec.requests.min(memory::SAMPLE_REQUESTS),
                ..spec.clone()
            };
            let limit = if args.requests.is_some() {
                limit
            } else {
                limit.for_field("workload.requests")
            };
            memory::estimate(&sample.generate(args.seed), spec.requests, runs, &limit)?;
            (
                spec.generate_within(args.seed, &limit)?,
                format!("scenario {}", scenario.name),
            )
        }
    };
    if let Some(kv) = args.kv_blocks {
        scenario.fleet.kv_blocks = kv;
        capacity_note = "";
    }
    if let Some(tokens) = args.kv_tokens {
        let blocks = tokens / u64::from(workload.block_size);
        if blocks == 0 || blocks > u64::from(u32::MAX) {
            return Err(SimError::Invalid {
                field: "--kv-tokens".into(),
                value: tokens.to_string(),
                bound: format!(
                    "must hold from one block ({} tokens) to {} blocks",
                    workload.block_size,
                    u32::MAX
                ),
            });
        }
        scenario.fleet.kv_blocks = blocks as u32;
        capacity_note = "";
    }
    Ok((workload, source, capacity_note))
}

#[cfg(feature = "sim")]
fn simulate(args: SimulateArgs) -> Result<(), SimError> {
    let started = Instant::now();
    let mut scenario = scenario_of(&args.workload)?;
    let mut out = std::io::stdout().lock();
    if args.print_scenario {
        let text = serde_saphyr::to_string(&scenario).map_err(|e| SimError::Usage(e.to_string()))?;
        return out.write_all(text.as_bytes()).map_err(stdout_err);
    }
    // Every output path is opened before the run, so a bad one fails in
    // milliseconds, not after the simulation.
    let mut json = match &args.json {
        Some(path) => Some((path, File::create(path).map_err(io_err(path))?)),
        None => None,
    };
    if let Some(dir) = &args.plots {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let probe = dir.join("ttft.svg");
        File::create(&probe).map_err(io_err(&probe))?;
    }
    let trace_out = match &args.write_trace {
        Some(path) => Some((path, File::create(path).map_err(io_err(path))?)),
        None => None,
    };
    let (workload, source, capacity_note) = workload_of(&args.workload, &mut scenario, 1)?;
    if let Some((path, file)) = trace_out {
        write_trace(&workload, BufWriter::new(file)).map_err(io_err(path))?;
    }

    let mut choices = if args.policies.is_empty() {
        PolicyChoice::builtins()
    } else {
        args.policies
            .iter()
            .map(|p| PolicyChoice::parse(p))
            .collect::<Result<_, _>>()?
    };
    if let Some(path) = &args.config {
        choices.extend(PolicyChoice::from_config(path, workload.block_size)?);
    }
    // Every policy, the config file's included, also runs with sessions.
    if let Some(mode) = args.session_affinity.as_deref() {
        let mode = if mode == "hard" {
            AffinityMode::Hard
        } else {
            AffinityMode::Soft
        };
        let with: Vec<PolicyChoice> = choices.iter().map(|c| c.clone().with_session_affinity(mode)).collect();
        choices.extend(with);
    }
    let registry = WorkerSelectionPolicyRegistry::new();
    for choice in &choices {
        choice.validate(&registry)?;
    }
    let fleet = scenario.fleet;
    let n = workload.requests.len();
    let span_s = workload.requests.last().map_or(0.0, |r| r.arrival_ms) / 1000.0;
    let prompt_tokens: u64 = workload.requests.iter().map(|r| u64::from(r.input_tokens)).sum();
    writeln!(
        out,
        "{}",
        fleet_lines(
            "simulate",
            &source,
            args.workload.seed,
            &fleet,
            workload.block_size,
            capacity_note
        )
    )
    .map_err(stdout_err)?;
    let line = format!(
        "{n} requests over {span_s:.1} s ({:.0} req/s), mean prompt {:.0} tokens\nrouted through the selection service \
         by {}",
        n as f64 / span_s.max(1e-9),
        prompt_tokens as f64 / n.max(1) as f64,
        match choices.len() {
            1 => "1 policy".to_owned(),
            k => format!("each of {k} policies"),
        }
    );
    writeln!(out, "{}", wrap(&line, OUTPUT_WIDTH)).map_err(stdout_err)?;
    let bounds = HitBounds::of(&workload, &fleet);
    let line = format!(
        "hit-rate bounds: {:.1}% with one unlimited cache for the fleet,\n                 {:.1}% pooled (one LRU cache \
         of the fleet's {} blocks)",
        bounds.unlimited * 100.0,
        bounds.pooled * 100.0,
        bounds.pooled_blocks
    );
    writeln!(out, "{}", wrap(&line, OUTPUT_WIDTH)).map_err(stdout_err)?;
    out.flush().map_err(stdout_err)?;

    // The bar appears only once the run has taken more than a second.
    let bar = ProgressBar::with_draw_target(Some((n * choices.len()) as u64), ProgressDrawTarget::hidden());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg:24} [{bar:40}] {pos}/{len} requests ({eta} left)")
            .expect("static template")
            .progress_chars("=> "),
    );
    let mut shown = false;
    let mut runs: Vec<PolicyRun> = Vec::with_capacity(choices.len());
    for (i, choice) in choices.iter().enumerate() {
        bar.set_message(choice.label.clone());
        let base = (i * n) as u64;
        let mut progress = |done: usize| {
            if !shown && started.elapsed() > Duration::from_secs(1) {
                bar.set_draw_target(ProgressDrawTarget::stderr());
                shown = true;
            }
            bar.set_position(base + done as u64);
        };
        let mut run = run_policy_within(
            &registry,
            choice,
            &workload,
            &fleet,
            &bounds,
            args.workload.seed,
            &mut progress,
        )?;
        // Per request, only the plot of times to first token reads on:
        // the next policy's run gets the memory.
        run.record.requests = Vec::new();
        if args.plots.is_none() {
            run.report.ttft_sorted_ms = Vec::new();
        }
        runs.push(run);
    }
    bar.finish_and_clear();

    let reports: Vec<PolicyReport> = runs.iter().map(|r| r.report.clone()).collect();
    write!(out, "\n{}", render_table(&reports)).map_err(stdout_err)?;
    if let Some(first) = runs.iter().find_map(|r| r.record.first_failure.as_ref()) {
        writeln!(out, "{}", wrap(&format!("first refusal: {first}"), OUTPUT_WIDTH)).map_err(stdout_err)?;
    }
    if let Some((path, file)) = json.take() {
        serde_json::to_writer_pretty(BufWriter::new(file), &reports)
            .map_err(|e| io_err(path)(std::io::Error::other(e)))?;
    }
    if let Some(dir) = &args.plots {
        let ttft = dir.join("ttft.svg");
        plot_ttft(&ttft, &format!("time to first token, {source}"), &reports)?;
        for run in &runs {
            let name: String = run
                .report
                .policy
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            plot_load(
                &dir.join(format!("load-{name}.svg")),
                &format!("requests in flight per worker, {}", run.report.policy),
                &fleet,
                &run.record,
            )?;
        }
        writeln!(out, "plots written to {}", dir.display()).map_err(stdout_err)?;
    }
    writeln!(out, "simulated in {:.1} s", started.elapsed().as_secs_f64()).map_err(stdout_err)?;
    out.flush().map_err(stdout_err)
}

#[cfg(feature = "sim")]
/// The first lines of a run's output: what runs on which fleet (and its
/// worker classes), wrapped at [`OUTPUT_WIDTH`].
fn fleet_lines(
    command: &str,
    source: &str,
    seed: u64,
    fleet: &selkie::sim::run::FleetSpec,
    block_size: u32,
    capacity_note: &str,
) -> String {
    let mut text = format!(
        "selkie {command}: {source}, seed {seed}\n{} workers x {} DP ranks, a KV cache of {} tokens per rank ({} blocks of \
         {block_size}{capacity_note}){}",
        fleet.workers,
        fleet.dp_size,
        u64::from(fleet.kv_blocks) * u64::from(block_size),
        fleet.kv_blocks,
        fleet
            .max_active_requests
            .map_or(String::new(), |n| format!(", at most {n} requests in flight per rank"))
    );
    if !fleet.classes.is_empty() {
        let classes: Vec<String> = fleet
            .classes
            .iter()
            .map(|c| {
                format!(
                    "{} {}workers at {}x speed, {} blocks, {} DP ranks, weight {}",
                    c.workers,
                    if c.cpu { "CPU " } else { "" },
                    c.speed,
                    c.kv_blocks.unwrap_or(fleet.kv_blocks),
                    c.dp_size.unwrap_or(fleet.dp_size),
                    c.capacity_weight
                )
            })
            .collect();
        text.push_str(&format!("\nmixed fleet: {}", classes.join("; ")));
    }
    if fleet.routers > 1 {
        text.push_str(&format!(
            "\n{} router replicas, requests spread over them in turn; bookings reach the other replicas {}; herd: the \
             most requests to one rank within {} ms",
            fleet.routers,
            fleet
                .sync_delay_ms
                .map_or("never".to_owned(), |d| format!("after {d} ms")),
            fleet.herd_window_ms()
        ));
    }
    wrap(&text, OUTPUT_WIDTH)
}

#[cfg(feature = "sim")]
/// A label for `weights` in a table.
fn weights_label(w: &KvWeights) -> String {
    let mut label = format!(
        "kv credit {:.2} prefill {:.2} decode {:.2} T {:.2}",
        w.overlap_score_credit, w.prefill_load_scale, w.decode_active_request_weight, w.router_temperature
    );
    if w.switch_margin > 0.0 || w.switch_margin_relative > 0.0 {
        label.push_str(&format!(
            " margin {:.1}+{:.0}% dwell {}",
            w.switch_margin,
            w.switch_margin_relative * 100.0,
            w.max_dwell
        ));
    }
    label
}

#[cfg(feature = "sim")]
fn tune(args: TuneArgs) -> Result<(), SimError> {
    let started = Instant::now();
    if args.trials == 0 {
        return Err(SimError::Invalid {
            field: "--trials".into(),
            value: "0".into(),
            bound: "must be at least 1".into(),
        });
    }
    let mut scenario = scenario_of(&args.workload)?;
    let file = File::create(&args.out).map_err(io_err(&args.out))?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (workload, source, capacity_note) =
        workload_of(&args.workload, &mut scenario, threads.min(args.trials).max(1))?;
    if workload.requests.len() < 2 {
        return Err(SimError::Usage(
            "tuning needs at least 2 requests (one half trains, the other tests)".into(),
        ));
    }
    let (train, test) = split_in_time_owned(workload);
    let fleet = scenario.fleet;
    let registry = WorkerSelectionPolicyRegistry::new();
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{}",
        fleet_lines(
            "tune",
            &source,
            args.workload.seed,
            &fleet,
            train.block_size,
            capacity_note
        )
    )
    .map_err(stdout_err)?;
    let line = format!(
        "{} candidate weights of the kv policy on the first {} requests, on {threads} threads;\nthe winner and the \
         defaults on the last {}",
        args.trials,
        train.requests.len(),
        test.requests.len()
    );
    writeln!(out, "{}", wrap(&line, OUTPUT_WIDTH)).map_err(stdout_err)?;
    out.flush().map_err(stdout_err)?;
    let bar = ProgressBar::with_draw_target(Some(args.trials as u64), ProgressDrawTarget::hidden());
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{bar:40}] {pos}/{len} candidates ({eta} left)")
            .expect("static template")
            .progress_chars("=> "),
    );
    let shown = std::sync::atomic::AtomicBool::new(false);
    let progress = |done: usize| {
        if started.elapsed() > Duration::from_secs(1) && !shown.swap(true, std::sync::atomic::Ordering::Relaxed) {
            bar.set_draw_target(ProgressDrawTarget::stderr());
        }
        bar.set_position(done as u64);
    };
    let trials = search(
        &registry,
        &train,
        &fleet,
        &TuneSpace::default(),
        args.trials,
        args.workload.seed,
        threads,
        &progress,
    )?;
    bar.finish_and_clear();

    // The five best, and the defaults below them when they are not among
    // them, each named in the table by its rank: the weights are listed
    // above it, a table row has no room for them.
    let shown: Vec<(usize, &selkie::sim::tune::Trial)> = trials
        .iter()
        .enumerate()
        .take(5)
        .chain(trials.iter().enumerate().skip(5).filter(|(_, t)| t.is_default))
        .collect();
    let rank =
        |i: usize, t: &selkie::sim::tune::Trial| format!("#{}{}", i + 1, if t.is_default { " (default)" } else { "" });
    writeln!(
        out,
        "\nbest candidates on the first half (score {:.3} .. {:.3}; the defaults score 2):",
        trials[0].score,
        trials[shown.len().min(5) - 1].score
    )
    .map_err(stdout_err)?;
    for &(i, t) in &shown {
        let line = format!(
            "{:<4} {}{}",
            format!("#{}", i + 1),
            weights_label(&t.weights),
            if t.is_default { " (default)" } else { "" }
        );
        writeln!(out, "{}", wrap(&line, OUTPUT_WIDTH)).map_err(stdout_err)?;
    }
    let best: Vec<PolicyReport> = shown
        .iter()
        .map(|&(i, t)| PolicyReport {
            policy: rank(i, t),
            ..t.report.clone()
        })
        .collect();
    write!(out, "\n{}", render_table(&best)).map_err(stdout_err)?;

    let winner = trials[0].weights;
    let bounds = HitBounds::of(&test, &fleet);
    let mut tested = Vec::new();
    for (label, w) in [("defaults", KvWeights::default()), ("tuned", winner)] {
        let run = run_policy_within(
            &registry,
            &w.choice(label),
            &test,
            &fleet,
            &bounds,
            args.workload.seed,
            &mut |_| {},
        )?;
        tested.push(run.report);
    }
    writeln!(out, "\non the second half (requests the search did not see):").map_err(stdout_err)?;
    write!(out, "{}", render_table(&tested)).map_err(stdout_err)?;
    let mut file = BufWriter::new(file);
    file.write_all(winner.config_yaml("tuned", train.block_size).as_bytes())
        .and_then(|()| file.flush())
        .map_err(io_err(&args.out))?;
    let line = format!(
        "{} written to {} (`selkie simulate --config {}`, or a router's worker-selection config)",
        weights_label(&winner),
        args.out.display(),
        args.out.display()
    );
    writeln!(out, "\n{}", wrap(&line, OUTPUT_WIDTH)).map_err(stdout_err)?;
    writeln!(out, "tuned in {:.1} s", started.elapsed().as_secs_f64()).map_err(stdout_err)?;
    out.flush().map_err(stdout_err)
}
