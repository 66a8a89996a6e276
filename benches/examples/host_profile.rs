//! Runs one host case's measured call (select + book + release through the
//! public service) in a loop, for a profiler: `valgrind --tool=callgrind
//! --toggle-collect='*host_profile*measured*'` counts its instructions.
//!
//! `cargo run --release -p selkie-benches --example host_profile -- random 1024 1000`
//! (mode: random, round-robin, power-of-two, least-loaded, kv, kv-keyed,
//! kv-keyed-shuffled (the keyed overlaps in a fixed shuffled order), or
//! kv-index: tokens hashed, the KV index queried, then the selection; then
//! workers and calls). It prints the time a call.

use std::hint::black_box;

use selkie_benches::host_fixture::{HostFixture, Mode};
use selkie_benches::index_fixture::IndexFixture;

#[inline(never)]
fn measured(f: &HostFixture, calls: usize) {
    for _ in 0..calls {
        black_box(f.select_and_release());
    }
}

#[inline(never)]
fn measured_plain(f: &HostFixture, calls: usize) {
    for _ in 0..calls {
        black_box(f.select_plain_and_release());
    }
}

#[inline(never)]
fn measured_index(f: &mut IndexFixture, calls: usize) {
    for _ in 0..calls {
        black_box(f.select_and_release());
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "random".into());
    let workers: usize = args.next().map_or(1024, |s| s.parse().expect("workers is a number"));
    let calls: usize = args.next().map_or(1000, |s| s.parse().expect("calls is a number"));
    if mode == "kv-index" {
        let mut fixture = IndexFixture::new(workers);
        measured_index(&mut fixture, calls);
        println!("{mode}: {calls} calls at {workers} workers");
        return;
    }
    let fixture = match mode.as_str() {
        "kv-keyed" => HostFixture::new(Mode::Kv, workers, 0.0).worker_keyed(),
        "kv-keyed-shuffled" => HostFixture::new(Mode::Kv, workers, 0.0).worker_keyed().shuffled(),
        name => {
            let mode = Mode::ALL
                .into_iter()
                .find(|m| m.name() == name)
                .unwrap_or_else(|| panic!("unknown mode {name}"));
            HostFixture::new(mode, workers, 0.0)
        }
    };
    let start = std::time::Instant::now();
    if fixture.mode().plain() {
        measured_plain(&fixture, calls);
    } else {
        measured(&fixture, calls);
    }
    let ns = start.elapsed().as_nanos() as f64 / calls.max(1) as f64;
    println!("{mode}: {calls} calls at {workers} workers, {ns:.0} ns a call");
}
