//! Replays the minimized inputs committed under `fuzz/regressions/<target>/`
//! for the kernel's fuzz targets through the same checks the targets run
//! (`fuzz_harness/`, shared with `fuzz/fuzz_targets/` by `#[path]`), so a
//! fixed crash stays fixed without nightly or libFuzzer (see FUZZING.md).

#[path = "fuzz_harness/fleet_model.rs"]
#[allow(dead_code)]
mod fleet_model;
#[path = "fuzz_harness/kernels_diff.rs"]
#[allow(dead_code)]
mod kernels_diff;
#[path = "fuzz_harness/least_loaded_diff.rs"]
#[allow(dead_code)]
mod least_loaded_diff;
#[path = "fuzz_harness/replay.rs"]
mod replay;

use replay::replay;

#[test]
fn least_loaded_diff_regressions() {
    replay("least_loaded_diff", least_loaded_diff::check);
}

#[test]
fn kernels_diff_regressions() {
    replay("kernels_diff", kernels_diff::check);
}

#[test]
fn fleet_model_regressions() {
    replay("fleet_model", fleet_model::check);
}

// Inputs written as their `Debug` prints them: they keep the reproducer
// format pasteable and run each harness in every `cargo test`, including
// the targets that have no committed regression yet.

#[test]
fn least_loaded_diff_reproducer() {
    // 150 workers: two whole 64-row blocks of the fleet's columns and a
    // tail; ties on the minimum in both; weights from 0.25 to 4.25.
    least_loaded_diff::check(&least_loaded_diff::Input {
        active: (0..150u32).map(|i| i.wrapping_mul(7919) % 13 + 4).collect(),
        inv_weight: (0..150).map(|i| 0.25 + (i % 5) as f32).collect(),
        mask: vec![u64::MAX, 0xF0F0_F0F0_F0F0_F0F0, u64::MAX],
        seed: 7,
    });
}

#[test]
fn kernels_diff_reproducer() {
    kernels_diff::check(&kernels_diff::Input {
        rows: 77,
        loads: vec![3, 1, 4, 1, 5, 9, 2, 6],
        costs: vec![2.5, 1.0, 7.0, 1.0, 3.25],
        mask: vec![0xFFFF_FFFF_FFFF_FF7F, 0x1FFF],
        seed: 11,
        ticket: 5,
        config: kernels_diff::Config {
            overlap_score_credit: 1.0,
            overlap_score_credit_decay: 0.0,
            prefill_load_scale: 1.0,
            decode_active_request_weight: 1.0,
            host_cache_hit_weight: 0.5,
            disk_cache_hit_weight: 0.25,
            shared_cache_multiplier: 0.0,
        },
        isl_tokens: 1000,
        block_size: 16,
        track_prefill_tokens: true,
        role: 0,
        with_host_disk: true,
        required_cache_hits: 1,
        ratio: 3,
        temperature: 0.7,
    });
}

#[test]
fn fleet_model_reproducer() {
    use fleet_model::Op::*;
    fleet_model::check(&fleet_model::Input {
        ops: vec![
            // Weights 1 and 4: with 1 and 2 requests booked, the weighted
            // scan must choose row 1 (2 / 4 < 1 / 1), the plain one row 0.
            Add {
                worker_id: 1,
                limit: 6,
                weight: 16,
            },
            Add {
                worker_id: 2,
                limit: 6,
                weight: 64,
            },
            Book {
                row: 0,
                prefill: 1,
                decode: 0,
            },
            Book {
                row: 1,
                prefill: 1,
                decode: 0,
            },
            Book {
                row: 1,
                prefill: 1,
                decode: 0,
            },
            Select {
                filter: 0xFFFF,
                prefill: 0,
                decode: 0,
                seed: 9,
                weighted: true,
            },
            Select {
                filter: 0xFFFF,
                prefill: 0,
                decode: 0,
                seed: 9,
                weighted: false,
            },
            SetLimit { slot: 0, limit: 2 },
            Add {
                worker_id: 3,
                limit: 1,
                weight: 0,
            },
            Select {
                filter: 0xFFFF,
                prefill: 100,
                decode: 2,
                seed: 1,
                weighted: false,
            },
            Select {
                filter: 0xFFFF,
                prefill: 10,
                decode: 1,
                seed: 2,
                weighted: true,
            },
            Book {
                row: 0,
                prefill: 5,
                decode: 0,
            },
            Book {
                row: 0,
                prefill: 5,
                decode: 0,
            },
            SetWeight { slot: 1, weight: 0 },
            SetWeight { slot: 1, weight: 8 },
            Retarget { guard: 0, row: 1 },
            OutputBlock { guard: 1 },
            PrefillComplete { guard: 2 },
            SetState { slot: 0, state: 1 },
            Select {
                filter: 0xFFFF,
                prefill: 0,
                decode: 0,
                seed: 3,
                weighted: true,
            },
            Remove { slot: 0 },
            Add {
                worker_id: 4,
                limit: 3,
                weight: 1,
            },
            Release { guard: 0 },
            Book {
                row: 17,
                prefill: 0,
                decode: 0,
            },
        ],
    });
}
