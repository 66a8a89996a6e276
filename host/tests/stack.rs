//! A selection fits in a small thread stack, in every build profile: the
//! kernels' scratch (least keys per mask word, tie lanes, softmax word sums)
//! lives on the stack, and an unoptimised build must not multiply it (a
//! `cargo test` of a router spawns its threads with the default 2 MiB).

use selkie::*;

/// The stack given to the selecting thread: a quarter of Rust's default for
/// spawned threads.
const STACK: usize = 512 * 1024;

fn select_on_a_small_stack(policy: WorkerSelectionPolicy, workers: u64) {
    let name = policy.name();
    let picked = std::thread::Builder::new()
        .stack_size(STACK)
        .spawn(move || {
            let s = WorkerSelectionService::new(policy, ServiceConfig::default());
            for id in 0..workers {
                s.add_worker(WorkerRecord::new(id).with_dp(0, 1 + (id % 2) as u32))
                    .unwrap();
            }
            let ov: Vec<WorkerOverlap> = (0..workers / 2)
                .map(|i| WorkerOverlap::device(WorkerWithDpRank::new(i * 2, 0), i as u32 % 5, 16))
                .collect();
            let req = SelectionRequest::new(4096).with_overlaps(&ov);
            let mut picked = 0;
            for _ in 0..20 {
                let sel = s.select(&req).unwrap();
                assert!(sel.worker().worker_id < workers);
                picked += 1;
            }
            picked
        })
        .unwrap()
        .join()
        .unwrap_or_else(|_| panic!("{name}: the selecting thread panicked"));
    assert_eq!(picked, 20, "{name}");
}

#[test]
fn every_built_in_policy_selects_on_a_512_kib_stack() {
    for workers in [8, 2_048] {
        select_on_a_small_stack(
            WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
            workers,
        );
        select_on_a_small_stack(
            WorkerSelectionPolicy::kv(
                KvRouterConfig {
                    router_temperature: 0.7,
                    ..KvRouterConfig::default()
                },
                WorkerType::Prefill,
            ),
            workers,
        );
        select_on_a_small_stack(WorkerSelectionPolicy::least_loaded(), workers);
        select_on_a_small_stack(WorkerSelectionPolicy::power_of_two(), workers);
        select_on_a_small_stack(WorkerSelectionPolicy::random(), workers);
        select_on_a_small_stack(WorkerSelectionPolicy::round_robin(), workers);
    }
}
