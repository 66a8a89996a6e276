//! Stub OpenAI-compatible engines, as processes: what the end-to-end test
//! and the router benchmark put behind `selkie serve` (and behind
//! vllm-router and smg). The same engine the Rust tests start in process
//! (`host/tests/support/stub_engine.rs`): deterministic answers, one SSE
//! event per token.
//!
//! ```sh
//! cargo run --release -p selkie --features serve --example stub_engine -- \
//!     --listen 127.0.0.1:8101 --listen 127.0.0.1:8102 [--tokens 16] [--chunk-delay-ms 0]
//! cargo run -p selkie --features serve --example stub_engine -- --write-tokenizer DIR
//! ```
//!
//! Each `--listen` starts one engine (named `e0`, `e1`, ...). It prints
//! `stub engine eN on http://ADDR` per engine and serves until killed.
//! `--hold-after N` holds every stream after N events (until the client
//! leaves): open streams for memory measurements.
//! `--write-tokenizer DIR` writes the tests' word-level `tokenizer.json` and
//! chat template (`template.jinja`) into DIR and exits.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::Duration;

use support::stub_engine::{StubConfig, StubEngine};

fn main() {
    let mut listens = Vec::new();
    let mut tokens = 8usize;
    let mut delay = Duration::ZERO;
    let mut threads = 2usize;
    let mut hold_after = None;
    let mut args = std::env::args().skip(1);
    let usage = "usage: stub_engine --listen ADDR [--listen ADDR ...] [--tokens N] [--chunk-delay-ms MS] [--threads N] [--hold-after N] | --write-tokenizer DIR";
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{a} needs a value\n{usage}"));
        match a.as_str() {
            "--listen" => listens.push(value().parse().expect("--listen ADDR:PORT")),
            "--tokens" => tokens = value().parse().expect("--tokens N"),
            "--chunk-delay-ms" => delay = Duration::from_millis(value().parse().expect("--chunk-delay-ms MS")),
            "--threads" => threads = value().parse().expect("--threads N"),
            "--hold-after" => hold_after = Some(value().parse().expect("--hold-after N")),
            "--write-tokenizer" => {
                let dir = std::path::PathBuf::from(value());
                std::fs::create_dir_all(&dir).expect("create the directory");
                let (t, c) = support::tokenizer_and_template(&dir);
                println!("{}\n{}", t.display(), c.display());
                return;
            }
            _ => panic!("unknown option {a}\n{usage}"),
        }
    }
    assert!(!listens.is_empty(), "{usage}");
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let mut engines = Vec::new();
        for (i, addr) in listens.into_iter().enumerate() {
            let mut config = StubConfig::new(&format!("e{i}"));
            config.default_tokens = tokens;
            config.chunk_delay = delay;
            let e = StubEngine::start_on(addr, config).await;
            if let Some(n) = hold_after {
                e.set_fault(support::stub_engine::Fault::HoldAfter(n));
            }
            println!("stub engine e{i} on {}", e.url());
            engines.push(e);
        }
        std::future::pending::<()>().await;
    });
}
