//! Differential target: every SIMD kernel against its scalar reference, on
//! arbitrary columns, masks, lengths, configs and seeds. Finite inputs must
//! agree exactly (same row, same costs bit for bit, same random draws);
//! inputs with NaN or infinity must be rejected the same way by both. The
//! softmax pick is the one kernel compared up to rounding: its picks may
//! differ only when the draw lies within `2e-5` of every cumulative
//! probability between them (the bound its module documents).
//!
//! Shared by `fuzz/fuzz_targets/kernels_diff.rs` and the regression replay in
//! `kernel/tests/fuzz_regressions.rs` (`#[path]`); see FUZZING.md.

use arbitrary::Arbitrary;
use core::num::NonZeroU32;
use selkie_kernel::kernels::device_aware::{device_aware, device_aware_reference, DeviceAwareConfig};
use selkie_kernel::kernels::index::{
    power_of_two, power_of_two_reference, random, random_reference, round_robin, round_robin_reference,
};
use selkie_kernel::kernels::keyed::{scatter_keyed, scatter_keyed_reference, DenseRows, KeyedOverlap, Scattered};
use selkie_kernel::kernels::kv_cost::{
    kv_cost, kv_cost_reference, KvCostConfig, KvLoad, KvOverlap, KvRequest, WorkerRole,
};
use selkie_kernel::kernels::pick::{
    first_non_finite, first_non_finite_reference, pick, pick_in_range, pick_min, pick_min_reference, pick_reference,
};
use selkie_kernel::mask::contains;
use selkie_kernel::Rng;

/// How far the SIMD softmax's cumulative probabilities may stray from the
/// `f64` reference's (pick module docs).
const CUMULATIVE_EPS: f64 = 2.0e-5;

#[derive(Arbitrary, Debug)]
pub struct Config {
    pub overlap_score_credit: f32,
    pub overlap_score_credit_decay: f32,
    pub prefill_load_scale: f32,
    pub decode_active_request_weight: f32,
    pub host_cache_hit_weight: f32,
    pub disk_cache_hit_weight: f32,
    pub shared_cache_multiplier: f32,
}

/// `Debug` prints a pasteable reproducer.
#[derive(Arbitrary, Debug)]
pub struct Input {
    pub rows: u16,
    pub loads: Vec<u32>,
    pub costs: Vec<f32>,
    pub mask: Vec<u64>,
    pub seed: u64,
    pub ticket: u64,
    pub config: Config,
    pub isl_tokens: u32,
    pub block_size: u16,
    pub track_prefill_tokens: bool,
    pub role: u8,
    pub with_host_disk: bool,
    pub required_cache_hits: u32,
    pub ratio: u32,
    pub temperature: f32,
}

/// A worker-keyed overlap entry, laid out as the host's is (padding after
/// the rank).
#[derive(Debug)]
struct Keyed {
    id: u64,
    rank: u32,
    tiers: [u32; 4],
    tokens: u32,
}

// SAFETY: every offset is that of the field its accessor returns, and every
// field is an integer.
unsafe impl KeyedOverlap for Keyed {
    const WORKER_ID_AT: usize = core::mem::offset_of!(Keyed, id);
    const DP_RANK_AT: usize = core::mem::offset_of!(Keyed, rank);
    const DEVICE_BLOCKS_AT: usize = core::mem::offset_of!(Keyed, tiers);
    const HOST_BLOCKS_AT: usize = core::mem::offset_of!(Keyed, tiers) + 4;
    const DISK_BLOCKS_AT: usize = core::mem::offset_of!(Keyed, tiers) + 8;
    const SHARED_BLOCKS_AT: usize = core::mem::offset_of!(Keyed, tiers) + 12;
    const CACHED_TOKENS_AT: usize = core::mem::offset_of!(Keyed, tokens);
    fn worker_id(&self) -> u64 {
        self.id
    }
    fn dp_rank(&self) -> u32 {
        self.rank
    }
    fn device_blocks(&self) -> u32 {
        self.tiers[0]
    }
    fn host_blocks(&self) -> u32 {
        self.tiers[1]
    }
    fn disk_blocks(&self) -> u32 {
        self.tiers[2]
    }
    fn shared_blocks(&self) -> u32 {
        self.tiers[3]
    }
    fn cached_tokens(&self) -> u32 {
        self.tokens
    }
}

/// The device and cached columns (as bits), the result, and the probe's
/// calls.
type KeyedRun = (Vec<u32>, Vec<u32>, Scattered, Vec<(u64, u32)>);

/// The keyed-overlap scatter against its reference: entries made from the
/// loads (ids mostly inside the dense table, some far outside), the table
/// from the rotated loads, the probe answering from the table's rows.
fn check_keyed(input: &Input, rows: usize, load: &[u32], rot: &[u32]) {
    let ranks = 1 + input.ratio % 3;
    let workers = 1 + (input.required_cache_hits % 64) as usize;
    let table: Vec<u32> = (0..workers * ranks as usize)
        .map(|i| {
            let v = rot.get(i).copied().unwrap_or(i as u32);
            if v % 17 == 0 {
                DenseRows::EMPTY
            } else {
                v % (rows as u32 + 2)
            }
        })
        .collect();
    let entries: Vec<Keyed> = load
        .iter()
        .map(|&v| {
            let big = |x: u32| if x.is_multiple_of(23) { x | 1 << 31 } else { x % 300 };
            Keyed {
                id: if v % 41 == 0 {
                    u64::from(v) << 32
                } else {
                    u64::from(v % (workers as u32 + 1))
                },
                rank: (v >> 7) % (ranks + u32::from(v % 5 == 0)),
                tiers: [big(v >> 3), (v >> 9) % 2, 0, u32::from(v % 13 == 0)],
                tokens: big(v.rotate_left(11)),
            }
        })
        .collect();
    let dense = DenseRows::new(&table, ranks).expect("a small table");
    let run = |fast: bool| -> KeyedRun {
        let (mut device, mut cached) = (vec![-1.0f32; rows], vec![-2.0f32; rows]);
        let mut calls = Vec::new();
        let mut probe = |id: u64, rank: u32| {
            calls.push((id, rank));
            (id as u32 ^ rank) % (rows as u32 + 1)
        };
        let out = if fast {
            scatter_keyed(&entries, dense, &mut probe, &mut device, &mut cached)
        } else {
            scatter_keyed_reference(&entries, dense, &mut probe, &mut device, &mut cached)
        };
        let bits = |c: Vec<f32>| c.into_iter().map(f32::to_bits).collect();
        (bits(device), bits(cached), out, calls)
    };
    assert_eq!(run(true), run(false), "keyed scatter {input:?}");
}

fn column<T: Copy>(src: &[T], rows: usize, fill: T) -> Vec<T> {
    (0..rows)
        .map(|i| if src.is_empty() { fill } else { src[i % src.len()] })
        .collect()
}

fn same_draws(a: &Rng, b: &Rng, what: &str, input: &Input) {
    assert_eq!(a, b, "{what}: random draws differ for {input:?}");
}

/// Whether two softmax picks made with the same draw `u` can both be right:
/// the same row, or rows between which every cumulative probability of the
/// reference (Dynamo's procedure in `f64`) lies within `CUMULATIVE_EPS` of
/// `u`.
fn softmax_consistent(simd: usize, reference: usize, costs: &[f32], mask: &[u64], t: f32, u: f64) -> bool {
    if simd == reference {
        return true;
    }
    let rows: Vec<usize> = (0..costs.len()).filter(|&r| contains(mask, r)).collect();
    let lo = rows.iter().map(|&r| costs[r]).fold(f32::INFINITY, f32::min) as f64;
    let hi = rows.iter().map(|&r| costs[r]).fold(f32::NEG_INFINITY, f32::max) as f64;
    let weight = |c: f32| {
        if lo == hi {
            1.0
        } else {
            (-(c as f64 - lo) / ((hi - lo) * t as f64)).exp()
        }
    };
    let sum: f64 = rows.iter().map(|&r| weight(costs[r])).sum();
    let mut cumulative = 0.0;
    let boundaries: Vec<f64> = rows
        .iter()
        .map(|&r| {
            cumulative += weight(costs[r]) / sum;
            cumulative
        })
        .collect();
    let pos = |row| rows.iter().position(|&r| r == row);
    let (Some(a), Some(b)) = (pos(simd), pos(reference)) else {
        return false;
    };
    boundaries[a.min(b)..a.max(b)]
        .iter()
        .all(|c| (u - c).abs() <= CUMULATIVE_EPS)
}

/// The check the fuzz target runs on every input (panics on a finding).
pub fn check(input: &Input) {
    let rows = (input.rows % 700) as usize;
    let mask = &input.mask;
    let load = column(&input.loads, rows, 0);
    let rot: Vec<u32> = load.iter().map(|v| v.rotate_left(7)).collect();
    let other: Vec<u32> = load.iter().map(|v| v.rotate_left(13) >> 8).collect();
    let costs = column(&input.costs, rows, 0.0);

    let (mut a, mut b) = (Rng::new(input.seed), Rng::new(input.seed));
    assert_eq!(
        random(rows, mask, &mut a),
        random_reference(rows, mask, &mut b),
        "random {input:?}"
    );
    same_draws(&a, &b, "random", input);
    assert_eq!(
        power_of_two(&load[..], mask, &mut a),
        power_of_two_reference(&load[..], mask, &mut b),
        "p2c {input:?}"
    );
    same_draws(&a, &b, "power_of_two", input);
    assert_eq!(
        round_robin(rows, mask, input.ticket),
        round_robin_reference(rows, mask, input.ticket),
        "rr {input:?}"
    );

    assert_eq!(
        first_non_finite(&costs[..], mask),
        first_non_finite_reference(&costs[..], mask),
        "{input:?}"
    );
    assert_eq!(
        pick_min(&costs[..], mask, &mut a),
        pick_min_reference(&costs[..], mask, &mut b),
        "pick_min {input:?}"
    );
    same_draws(&a, &b, "pick_min", input);

    // `pick` at the input's temperature: 0 exactly; above 0 the softmax up to
    // rounding; a bad temperature or a non-finite cost refused alike.
    let t = input.temperature;
    let u = a.clone().unit_f64();
    let fast = pick(&costs[..], mask, t, &mut a);
    let slow = pick_reference(&costs[..], mask, t, &mut b);
    same_draws(&a, &b, "pick", input);
    match (fast, slow) {
        (Ok(Some(f)), Ok(Some(s))) if t != 0.0 => {
            assert!(contains(mask, f), "softmax picked ineligible row {f}: {input:?}");
            assert!(
                softmax_consistent(f, s, &costs, mask, t, u),
                "softmax simd {f} reference {s} u {u}: {input:?}"
            );
        }
        (f, s) => assert_eq!(f, s, "pick at T = {t}: {input:?}"),
    }

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
                assert_eq!(
                    simd_out[row].to_bits(),
                    ref_out[row].to_bits(),
                    "kv row {row}: {input:?}"
                );
            }
            // The KV policy's pick: with the range the cost kernel returned it
            // must choose what the checked pick chooses, with the same draws.
            let (mut c, mut d) = (Rng::new(input.seed), Rng::new(input.seed));
            let fast = pick_in_range(&simd_out[..], mask, *s, t, &mut c);
            assert_eq!(
                fast,
                pick(&simd_out[..], mask, t, &mut d),
                "pick_in_range at T = {t}: {input:?}"
            );
            same_draws(&c, &d, "pick_in_range", input);
        }
        _ => assert_eq!(simd, reference, "kv errors differ: {input:?}"),
    }

    let da = DeviceAwareConfig {
        required_cache_hits: input.required_cache_hits % 4,
        non_cpu_to_cpu_ratio: input.ratio % 16,
    };
    let hits: Vec<u32> = load.iter().map(|v| v % 5).collect();
    let is_cpu: Vec<u64> = mask.iter().map(|w| w.rotate_left(17)).collect();
    let simd = device_aware(&load[..], &hits[..], &is_cpu, mask, &da, &mut a);
    let reference = device_aware_reference(&load[..], &hits[..], &is_cpu, mask, &da, &mut b);
    assert_eq!(simd, reference, "device-aware {input:?}");
    same_draws(&a, &b, "device_aware", input);

    check_keyed(input, rows, &load, &rot);
}
