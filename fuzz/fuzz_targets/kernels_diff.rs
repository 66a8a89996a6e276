//! Differential target: every SIMD kernel against its scalar reference, on
//! arbitrary columns, masks, lengths, configs and seeds. Finite inputs must
//! agree exactly (same row, same costs bit for bit, same random draws);
//! inputs with NaN or infinity must be rejected the same way by both.
#![no_main]

use arbitrary::Arbitrary;
use core::num::NonZeroU32;
use libfuzzer_sys::fuzz_target;
use selkie_kernel::kernels::device_aware::{device_aware, device_aware_reference, DeviceAwareConfig};
use selkie_kernel::kernels::index::{
    power_of_two, power_of_two_reference, random, random_reference, round_robin, round_robin_reference,
};
use selkie_kernel::kernels::kv_cost::{
    kv_cost, kv_cost_reference, KvCostConfig, KvLoad, KvOverlap, KvRequest, WorkerRole,
};
use selkie_kernel::kernels::pick::{first_non_finite, first_non_finite_reference, pick_min, pick_min_reference};
use selkie_kernel::Rng;

#[derive(Arbitrary, Debug)]
struct Config {
    overlap_score_credit: f32,
    overlap_score_credit_decay: f32,
    prefill_load_scale: f32,
    decode_active_request_weight: f32,
    host_cache_hit_weight: f32,
    disk_cache_hit_weight: f32,
    shared_cache_multiplier: f32,
}

/// `Debug` prints a pasteable reproducer.
#[derive(Arbitrary, Debug)]
struct Input {
    rows: u16,
    loads: Vec<u32>,
    costs: Vec<f32>,
    mask: Vec<u64>,
    seed: u64,
    ticket: u64,
    config: Config,
    isl_tokens: u32,
    block_size: u16,
    track_prefill_tokens: bool,
    role: u8,
    with_host_disk: bool,
    required_cache_hits: u32,
    ratio: u32,
}

fn column<T: Copy>(src: &[T], rows: usize, fill: T) -> Vec<T> {
    (0..rows).map(|i| if src.is_empty() { fill } else { src[i % src.len()] }).collect()
}

fn same_draws(a: &Rng, b: &Rng, what: &str, input: &Input) {
    assert_eq!(a, b, "{what}: random draws differ for {input:?}");
}

fuzz_target!(|input: Input| {
    let rows = (input.rows % 700) as usize;
    let mask = &input.mask;
    let load = column(&input.loads, rows, 0);
    let rot: Vec<u32> = load.iter().map(|v| v.rotate_left(7)).collect();
    let other: Vec<u32> = load.iter().map(|v| v.rotate_left(13) >> 8).collect();
    let costs = column(&input.costs, rows, 0.0);

    let (mut a, mut b) = (Rng::new(input.seed), Rng::new(input.seed));
    assert_eq!(random(rows, mask, &mut a), random_reference(rows, mask, &mut b), "random {input:?}");
    same_draws(&a, &b, "random", &input);
    assert_eq!(power_of_two(&load[..], mask, &mut a), power_of_two_reference(&load[..], mask, &mut b), "p2c {input:?}");
    same_draws(&a, &b, "power_of_two", &input);
    assert_eq!(round_robin(rows, mask, input.ticket), round_robin_reference(rows, mask, input.ticket), "rr {input:?}");

    assert_eq!(first_non_finite(&costs[..], mask), first_non_finite_reference(&costs[..], mask), "{input:?}");
    assert_eq!(pick_min(&costs[..], mask, &mut a), pick_min_reference(&costs[..], mask, &mut b), "pick_min {input:?}");
    same_draws(&a, &b, "pick_min", &input);

    let c = &input.config;
    let config = KvCostConfig {
        overlap_score_credit: c.overlap_score_credit,
        overlap_score_credit_decay: c.overlap_score_credit_decay,
        prefill_load_scale: c.prefill_load_scale,
        decode_active_request_weight: c.decode_active_request_weight,
        host_cache_hit_weight: c.host_cache_hit_weight,
        disk_cache_hit_weight: c.disk_cache_hit_weight,
        shared_cache_multiplier: c.shared_cache_multiplier,
        ..KvCostConfig::default()
    };
    let role = [WorkerRole::Aggregated, WorkerRole::Prefill, WorkerRole::Decode][input.role as usize % 3];
    let block_size = NonZeroU32::new(input.block_size.max(1) as u32).unwrap();
    let request = KvRequest::new(input.isl_tokens, block_size, input.track_prefill_tokens, role)
        .with_added_decode_blocks(input.ticket as u32 % 64);
    let device: Vec<f32> = costs.iter().map(|c| c.abs() % 4096.0).collect();
    let cached: Vec<f32> = device.iter().map(|d| d * block_size.get() as f32).collect();
    let host: Vec<f32> = device.iter().map(|d| d * 0.5).collect();
    let overlap = KvOverlap {
        device_blocks: Some(&device),
        cached_tokens: Some(&cached),
        host_blocks: input.with_host_disk.then_some(&host[..]),
        disk_blocks: input.with_host_disk.then_some(&device[..]),
        ..KvOverlap::default()
    };
    let kv_load = KvLoad::new(&load[..], &rot[..], &other[..]);
    let (mut simd_out, mut ref_out) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    let simd = kv_cost(&config, &request, &kv_load, &overlap, mask, &mut simd_out);
    let reference = kv_cost_reference(&config, &request, &kv_load, &overlap, mask, &mut ref_out);
    match (&simd, &reference) {
        (Ok(s), Ok(r)) => {
            assert_eq!(s.min.to_bits(), r.min.to_bits(), "kv min {input:?}");
            assert_eq!(s.max.to_bits(), r.max.to_bits(), "kv max {input:?}");
            for row in 0..rows {
                assert_eq!(simd_out[row].to_bits(), ref_out[row].to_bits(), "kv row {row}: {input:?}");
            }
        }
        _ => assert_eq!(simd, reference, "kv errors differ: {input:?}"),
    }

    let da = DeviceAwareConfig { required_cache_hits: input.required_cache_hits % 4, non_cpu_to_cpu_ratio: input.ratio % 16 };
    let hits: Vec<u32> = load.iter().map(|v| v % 5).collect();
    let is_cpu: Vec<u64> = mask.iter().map(|w| w.rotate_left(17)).collect();
    let simd = device_aware(&load[..], &hits[..], &is_cpu, mask, &da, &mut a);
    let reference = device_aware_reference(&load[..], &hits[..], &is_cpu, mask, &da, &mut b);
    assert_eq!(simd, reference, "device-aware {input:?}");
    same_draws(&a, &b, "device_aware", &input);
});
