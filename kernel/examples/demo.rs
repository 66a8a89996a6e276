//! A demo fleet and one selection by each kernel, with the chosen worker and
//! why. Run: `cargo run --release -p selkie-kernel --example demo`.
use core::num::NonZeroU32;
use selkie_kernel::fleet::{BookLoad, Booking, Fleet, WorkerSpec};
use selkie_kernel::kernels::device_aware::{device_aware, DeviceAwareConfig};
use selkie_kernel::kernels::index::{power_of_two, random, round_robin};
use selkie_kernel::kernels::kv_cost::{kv_cost, KvCostConfig, KvLoad, KvOverlap, KvRequest, WorkerRole};
use selkie_kernel::kernels::least_loaded::{least_loaded, least_loaded_weighted};
use selkie_kernel::kernels::pick::{explain, pick};
use selkie_kernel::lanes::U32Source;
use selkie_kernel::{Rng, RowMask};

const WORKERS: usize = 12;

fn main() {
    // 12 workers; worker 100 + i has capacity weight 1 or 2 and carries
    // (i * 5) % 7 requests in flight, each with some prefill and decode load.
    let fleet: Box<Fleet<2>> = Box::new(Fleet::new());
    let mut bookings = Vec::new();
    for i in 0..WORKERS {
        let weight = if i % 4 == 0 { 2.0 } else { 1.0 };
        let spec = WorkerSpec {
            capacity_weight: weight,
            ..WorkerSpec::new(100 + i as u64)
        };
        let slot = fleet.add(spec).expect("demo fleet fits");
        for _ in 0..(i * 5) % 7 {
            let load = BookLoad {
                prefill_tokens: 256 * i as u32,
                decode_blocks: 3,
            };
            bookings.push(Booking::new(&*fleet, slot.row as usize, load).expect("unlimited admission"));
        }
    }
    let mut mask = RowMask::<1>::new();
    fleet.selectable(mask.words_mut());
    let rows = fleet.scan_rows();
    let active = fleet.active_requests();
    let worker = |row: usize| fleet.worker_id(row).expect("occupied");
    let mut rng = Rng::new(2026);

    println!(
        "selkie demo: {WORKERS} workers (ids 100..{}), in-flight requests per worker:",
        100 + WORKERS - 1
    );
    println!("  {:?}\n", (0..WORKERS).map(|r| active.value(r)).collect::<Vec<_>>());

    let row = least_loaded(&active, mask.words(), &mut rng).expect("eligible");
    println!(
        "least-loaded          -> worker {} ({} in flight: the fewest; ties broken uniformly)",
        worker(row),
        active.value(row)
    );
    let row = least_loaded_weighted(&active, &fleet.inv_capacity_weight(), mask.words(), &mut rng).expect("eligible");
    let w = fleet.worker(row).expect("occupied").capacity_weight;
    println!(
        "least-loaded weighted -> worker {} ({} in flight / weight {w} = {})",
        worker(row),
        active.value(row),
        active.value(row) as f32 / w
    );
    let row = power_of_two(&active, mask.words(), &mut rng).expect("eligible");
    println!(
        "power-of-two          -> worker {} (lower load of two uniform draws: {})",
        worker(row),
        active.value(row)
    );
    let row = random(rows, mask.words(), &mut rng).expect("eligible");
    println!(
        "random                -> worker {} (uniform over {} eligible rows)",
        worker(row),
        mask.count(rows)
    );
    for _ in 0..3 {
        let ticket = fleet.next_ticket() as u64;
        let row = round_robin(rows, mask.words(), ticket).expect("eligible");
        println!(
            "round-robin           -> worker {} (ticket {ticket}: eligible row #{} in order)",
            worker(row),
            ticket % mask.count(rows) as u64
        );
    }

    // Default KV cost: a 2,048-token prompt; workers 104 and 109 hold 96
    // and 64 of its blocks on device.
    let mut device = vec![0.0f32; rows];
    let mut cached = vec![0.0f32; rows];
    for (row, blocks) in [(4usize, 96.0f32), (9, 64.0)] {
        device[row] = blocks;
        cached[row] = blocks * 16.0;
    }
    let request = KvRequest::new(2048, NonZeroU32::new(16).expect("non-zero"), true, WorkerRole::Prefill);
    let (prefill, decode) = (fleet.active_prefill_tokens(), fleet.active_decode_blocks());
    let load = KvLoad::new(&prefill, &decode, &active);
    let overlap = KvOverlap {
        device_blocks: Some(&device),
        cached_tokens: Some(&cached),
        ..KvOverlap::default()
    };
    let mut costs = vec![0.0f32; rows];
    kv_cost(
        &KvCostConfig::default(),
        &request,
        &load,
        &overlap,
        mask.words(),
        &mut costs,
    )
    .expect("valid config");
    println!("\nKV costs (prefill blocks - cache credit + decode blocks):");
    println!("  {:?}", costs[..WORKERS].iter().map(|c| *c as u32).collect::<Vec<_>>());
    for temperature in [0.0f32, 0.7] {
        let row = pick(&costs[..], mask.words(), temperature, &mut rng)
            .expect("finite")
            .expect("eligible");
        let why = explain(&costs[..], mask.words(), row).expect("eligible");
        let runner_up = why
            .runner_up
            .map_or("none".to_string(), |(r, c)| format!("worker {} at {c}", worker(r)));
        println!(
            "kv pick T={temperature:<3}         -> worker {} (cost {}, runner-up {runner_up})",
            worker(row),
            why.cost
        );
    }

    // Device-aware weighted: rows 0-3 are CPU workers, no cache hits.
    let is_cpu = [0b1111u64];
    let hits = vec![0u32; rows];
    let choice = device_aware(
        &active,
        &hits[..],
        &is_cpu,
        mask.words(),
        &DeviceAwareConfig::default(),
        &mut rng,
    )
    .expect("valid")
    .expect("eligible");
    println!(
        "device-aware weighted -> worker {} ({:?} group, {} in flight)",
        worker(choice.row),
        choice.group,
        active.value(choice.row)
    );

    drop(bookings);
    let left: u32 = (0..rows).map(|r| fleet.outstanding(r).expect("row").requests).sum();
    println!("\nall bookings released: {left} requests left in flight");
}
