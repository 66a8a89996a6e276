//! The KV cost: SIMD against the scalar reference (bit for bit), both against
//! the `f64` formula (within the documented bound), and hand-worked costs for
//! every term and special case of the KV cost formula.

use super::{load_value, mask, rows, same_f32, Shifting};
use crate::kernels::kv_cost::*;
use crate::mask::contains;
use crate::simd::Backend;
use core::num::NonZeroU32;
use proptest::prelude::*;
use std::vec;
use std::vec::Vec;

/// Every input of one KV cost call, owned.
#[derive(Clone, Debug)]
struct Case {
    config: KvCostConfig,
    request: KvRequest,
    prefill: Vec<u32>,
    decode: Vec<u32>,
    requests: Vec<u32>,
    available: Option<Vec<u64>>,
    mask: Vec<u64>,
    device: Option<Vec<f32>>,
    cached: Option<Vec<f32>>,
    host: Option<Vec<f32>>,
    disk: Option<Vec<f32>>,
    shared: Option<Vec<f32>>,
    added: Option<Vec<u32>>,
    taint: Option<Vec<f32>>,
}

impl Case {
    /// A case of `rows` rows with every load 0 and no overlap columns.
    fn new(config: KvCostConfig, request: KvRequest, rows: usize) -> Self {
        Case {
            config,
            request,
            prefill: vec![0; rows],
            decode: vec![0; rows],
            requests: vec![0; rows],
            available: None,
            mask: vec![u64::MAX; rows.div_ceil(64)],
            device: None,
            cached: None,
            host: None,
            disk: None,
            shared: None,
            added: None,
            taint: None,
        }
    }

    fn load(&self) -> KvLoad<'_, [u32]> {
        KvLoad {
            load_available: self.available.as_deref(),
            ..KvLoad::new(&self.prefill[..], &self.decode[..], &self.requests[..])
        }
    }

    fn overlap(&self) -> KvOverlap<'_> {
        KvOverlap {
            device_blocks: self.device.as_deref(),
            cached_tokens: self.cached.as_deref(),
            host_blocks: self.host.as_deref(),
            disk_blocks: self.disk.as_deref(),
            shared_beyond_device: self.shared.as_deref(),
            added_decode_blocks: self.added.as_deref(),
            preferred_taint_multiplier: self.taint.as_deref(),
        }
    }

    /// The SIMD costs, checked to be the same bits on every backend.
    fn simd(&self) -> (Vec<f32>, CostRange) {
        let mut first: Option<(Vec<f32>, CostRange)> = None;
        for backend in Backend::available() {
            let mut out = vec![f32::NAN; self.prefill.len()];
            let range = kv_cost_on(
                backend,
                &self.config,
                &self.request,
                &self.load(),
                &self.overlap(),
                &self.mask,
                &mut out,
            )
            .unwrap();
            match &first {
                None => first = Some((out, range)),
                Some((o, r)) => {
                    let same = o.iter().zip(&out).all(|(&a, &b)| same_f32(a, b));
                    assert!(
                        same && same_f32(r.min, range.min) && same_f32(r.max, range.max),
                        "{backend:?}"
                    );
                }
            }
        }
        first.expect("the portable backend is always available")
    }

    fn reference(&self) -> (Vec<f32>, CostRange) {
        let mut out = vec![f32::NAN; self.prefill.len()];
        let range = kv_cost_reference(
            &self.config,
            &self.request,
            &self.load(),
            &self.overlap(),
            &self.mask,
            &mut out,
        )
        .unwrap();
        (out, range)
    }

    fn f64_reference(&self) -> Vec<KvCostF64> {
        let mut out = vec![KvCostF64::default(); self.prefill.len()];
        kv_cost_f64_reference(
            &self.config,
            &self.request,
            &self.load(),
            &self.overlap(),
            &self.mask,
            &mut out,
        )
        .unwrap();
        out
    }

    /// The case repeated to `19` rows (two full lane groups and a tail of
    /// three), row `i` a copy of row `i % n`, so the SIMD lanes are used.
    /// Minima over eligible rows do not change.
    fn tiled(&self) -> Case {
        let n = self.prefill.len();
        let rows = 19;
        let tile_u = |v: &Vec<u32>| (0..rows).map(|i| v[i % n]).collect::<Vec<_>>();
        let tile_f = |v: &Option<Vec<f32>>| v.as_ref().map(|v| (0..rows).map(|i| v[i % n]).collect::<Vec<_>>());
        let tile_m = |m: &Vec<u64>| {
            let mut out = vec![0u64; 1];
            for i in 0..rows {
                if contains(m, i % n) {
                    out[0] |= 1 << i;
                }
            }
            out
        };
        Case {
            config: self.config,
            request: self.request,
            prefill: tile_u(&self.prefill),
            decode: tile_u(&self.decode),
            requests: tile_u(&self.requests),
            available: self.available.as_ref().map(tile_m),
            mask: tile_m(&self.mask),
            device: tile_f(&self.device),
            cached: tile_f(&self.cached),
            host: tile_f(&self.host),
            disk: tile_f(&self.disk),
            shared: tile_f(&self.shared),
            added: self.added.as_ref().map(tile_u),
            taint: tile_f(&self.taint),
        }
    }

    /// Asserts that the SIMD kernel, the reference and the `f64` formula all
    /// give `expected` (within `tol` relative for the `f32` kernels).
    #[track_caller]
    fn assert_costs(&self, expected: &[f64], tol: f64) {
        let tiled = self.tiled();
        let (simd, range) = tiled.simd();
        let (reference, ref_range) = tiled.reference();
        let exact = tiled.f64_reference();
        assert_eq!(range, ref_range);
        for i in 0..simd.len() {
            let want = expected[i % expected.len()];
            assert!(
                same_f32(simd[i], reference[i]),
                "row {i}: simd {} reference {}",
                simd[i],
                reference[i]
            );
            if want.is_infinite() {
                assert_eq!(simd[i] as f64, want, "row {i}");
                assert_eq!(exact[i].cost, want, "row {i}");
            } else {
                let err = (simd[i] as f64 - want).abs();
                assert!(
                    err <= tol * want.abs().max(1.0),
                    "row {i}: kernel {} expected {want}",
                    simd[i]
                );
                assert!(
                    (exact[i].cost - want).abs() <= 1e-12 * want.abs().max(1.0),
                    "row {i}: f64 {}",
                    exact[i].cost
                );
                assert!(exact[i].admits(simd[i]), "row {i}: outside the parity bound");
            }
        }
    }
}

fn bs16() -> NonZeroU32 {
    NonZeroU32::new(16).unwrap()
}

/// Dynamo's own worked example: isl 64 with 96 cached tokens (isl < cached),
/// 6 device blocks, 16 active prefill tokens, decode 2 + 3 added, scale 2.
/// In `f32`'s subnormal range the bound is absolute: a row whose `f64` cost
/// is `5.6e-46` (a proptest case on the portable backend) computes to 0 in
/// `f32`, its nearest value; the relative bound alone (`6.7e-52`) refused it.
#[test]
fn the_parity_bound_has_f32s_smallest_step_as_a_floor() {
    let tiny = KvCostF64 {
        cost: 5.630_800_578_738_229e-46,
        magnitude: 5.630_800_578_738_229e-46,
        ..KvCostF64::default()
    };
    assert!(tiny.admits(0.0));
    assert!(tiny.admits(f32::from_bits(1)), "the smallest subnormal");
    assert!(!tiny.admits(1e-40));
    // In the normal range the bound stays relative.
    let one = KvCostF64 {
        cost: 1.0,
        magnitude: 1.0,
        ..KvCostF64::default()
    };
    assert!(one.admits(1.0 + 1e-6));
    assert!(!one.admits(1.0 + 1e-5));
}

#[test]
fn hand_worked_isl_below_cached_and_tracking_off() {
    let config = KvCostConfig {
        prefill_load_scale: 2.0,
        ..KvCostConfig::default()
    };
    let mut case = Case::new(config, KvRequest::new(64, bs16(), true, WorkerRole::Prefill), 1);
    case.prefill = vec![16];
    case.decode = vec![2];
    case.added = Some(vec![3]);
    case.device = Some(vec![6.0]);
    case.cached = Some(vec![96.0]);
    // raw = 16 + max(64, 96) = 112 tokens = 7 blocks; 2 * max(0, 7 - 6) + 5 = 7
    case.assert_costs(&[7.0], 0.0);
    // Not tracking prefill: raw = 0, cost = 2 * max(0, 0 - 6) + 5 = 5
    case.request = KvRequest::new(64, bs16(), false, WorkerRole::Prefill);
    case.assert_costs(&[5.0], 0.0);
    // The uniform added-blocks fallback gives the same as the per-row column.
    case.added = None;
    case.request = KvRequest::new(64, bs16(), true, WorkerRole::Prefill).with_added_decode_blocks(3);
    case.assert_costs(&[7.0], 0.0);
}

#[test]
fn hand_worked_isl_above_cached() {
    let mut case = Case::new(
        KvCostConfig::default(),
        KvRequest::new(320, bs16(), true, WorkerRole::Prefill),
        2,
    );
    case.prefill = vec![32, 0];
    case.decode = vec![1, 4];
    case.cached = Some(vec![64.0, 0.0]);
    case.device = Some(vec![4.0, 0.0]);
    // row 0: (32 + 320) / 16 = 22 blocks - 4 credit + 1 = 19; row 1: 20 + 4 = 24
    case.assert_costs(&[19.0, 24.0], 0.0);
}

#[test]
fn hand_worked_decay() {
    let config = KvCostConfig {
        overlap_score_credit_decay: 1.0,
        ..KvCostConfig::default()
    };
    // isl 64: request_blocks 4. Every row has 4 device blocks.
    let mut case = Case::new(config, KvRequest::new(64, bs16(), true, WorkerRole::Prefill), 3);
    case.prefill = vec![0, 64, 128];
    case.device = Some(vec![4.0; 3]);
    // min prefill 0. row 0: decay 1, 4 - 4 = 0.
    // row 1: excess 64 tokens = 4 blocks, / 4 request blocks = 1, decay 1/2, credit 2, (64 + 64)/16 - 2 = 6.
    // row 2: excess 8 blocks / 4 = 2, decay 1/3, credit 4/3, 192/16 - 4/3 = 32/3.
    case.assert_costs(&[0.0, 6.0, 32.0 / 3.0], 1e-6);
    // The minimum is over eligible rows only: without row 0 it is 64.
    // row 1: decay 1, 8 - 4 = 4; row 2: excess 4 blocks, decay 1/2, 12 - 2 = 10.
    case.mask = vec![0b110];
    case.assert_costs(&[f64::INFINITY, 4.0, 10.0], 1e-6);
    // Decay off (k = 0): full credit everywhere.
    case.mask = vec![0b111];
    case.config.overlap_score_credit_decay = 0.0;
    case.assert_costs(&[0.0, 4.0, 8.0], 0.0);
    // Decay on but prefill not tracked: no decay, raw 0, cost = decode = 0.
    case.config.overlap_score_credit_decay = 1.0;
    case.request = KvRequest::new(64, bs16(), false, WorkerRole::Prefill);
    case.assert_costs(&[0.0, 0.0, 0.0], 0.0);
}

#[test]
fn hand_worked_host_disk_and_shared_credit() {
    let mut case = Case::new(
        KvCostConfig::default(),
        KvRequest::new(160, bs16(), true, WorkerRole::Prefill),
        2,
    );
    case.decode = vec![3, 3];
    case.device = Some(vec![2.0, 0.0]);
    case.host = Some(vec![4.0, 0.0]);
    case.disk = Some(vec![4.0, 8.0]);
    // row 0: credit 2 + 0.75*4 + 0.25*4 = 6, 10 - 6 + 3 = 7; row 1: credit 2, 10 - 2 + 3 = 11
    case.assert_costs(&[7.0, 11.0], 0.0);
    case.config.shared_cache_multiplier = 0.5;
    case.shared = Some(vec![6.0, 2.0]);
    // + 0.5 * shared: row 0 credit 9, 10 - 9 + 3 = 4; row 1 credit 3, 10 - 3 + 3 = 10
    case.assert_costs(&[4.0, 10.0], 0.0);
    // Credit beyond the prefill blocks clamps at 0: row 0 with 40 host blocks.
    case.host = Some(vec![40.0, 0.0]);
    case.assert_costs(&[3.0, 10.0], 0.0);
}

#[test]
fn hand_worked_active_request_weight() {
    // Dynamo's example: weight 32, decode 100, 4 requests, empty prompt: 0 + 100 + 128 = 228.
    let config = KvCostConfig {
        decode_active_request_weight: 32.0,
        ..KvCostConfig::default()
    };
    let mut case = Case::new(config, KvRequest::new(0, bs16(), true, WorkerRole::Prefill), 2);
    case.decode = vec![100, 0];
    case.requests = vec![4, 1];
    case.assert_costs(&[228.0, 32.0], 0.0);
}

#[test]
fn hand_worked_decode_formula() {
    // Dynamo's example: device 3, decode 10, credit 1, decode pool, not tracking: max(10 - 3, 0) = 7.
    let config = KvCostConfig {
        decode_active_request_weight: 0.5,
        ..KvCostConfig::default()
    };
    let mut case = Case::new(config, KvRequest::new(64, bs16(), false, WorkerRole::Decode), 2);
    case.decode = vec![10, 10];
    case.requests = vec![2, 2];
    case.device = Some(vec![3.0, 30.0]);
    // row 0: 7 + 0.5 * 2 = 8; row 1: max(10 - 30, 0) + 1 = 1
    case.assert_costs(&[8.0, 1.0], 0.0);
    // Aggregated pools carry Dynamo's "decode" label too.
    case.request = KvRequest::new(64, bs16(), false, WorkerRole::Aggregated);
    case.assert_costs(&[8.0, 1.0], 0.0);
    // A prefill pool uses the prefill formula: raw 0, 1 * max(0, 0 - credit) + 10 + 1 = 11.
    case.request = KvRequest::new(64, bs16(), false, WorkerRole::Prefill);
    case.assert_costs(&[11.0, 11.0], 0.0);
    // Tracking prefill turns the decode formula off: (0 + 64)/16 = 4 blocks; 4 - 3 + 11 = 12, 0 + 11.
    case.request = KvRequest::new(64, bs16(), true, WorkerRole::Decode);
    case.assert_costs(&[12.0, 11.0], 0.0);
    // So does a zero overlap credit: 0 + 10 + 1.
    case.request = KvRequest::new(64, bs16(), false, WorkerRole::Decode);
    case.config.overlap_score_credit = 0.0;
    case.assert_costs(&[11.0, 11.0], 0.0);
}

#[test]
fn hand_worked_without_load_observation() {
    let config = KvCostConfig {
        decode_active_request_weight: 1.0,
        overlap_score_credit_decay: 2.0,
        ..KvCostConfig::default()
    };
    let mut case = Case::new(
        config,
        KvRequest::new(64, bs16(), true, WorkerRole::Prefill).with_added_decode_blocks(5),
        2,
    );
    case.prefill = vec![1000, 320];
    case.decode = vec![50, 7];
    case.requests = vec![9, 1];
    case.cached = Some(vec![640.0, 0.0]);
    case.device = Some(vec![1.0, 2.0]);
    case.available = Some(vec![0b10]);
    // Row 0 has no observation: all its loads read 0 (so min prefill is 0), raw = isl = 4 blocks,
    // cached tokens ignored: 4 - 1 = 3.
    // Row 1: excess 320 tokens = 20 blocks / 4 = 5, decay 1/(1 + 2*5) = 1/11, credit 2/11,
    // raw (320 + 64)/16 = 24, 24 - 2/11 + (7 + 5) + 1 = 36.8181...
    case.assert_costs(&[3.0, 24.0 - 2.0 / 11.0 + 13.0], 1e-6);
}

#[test]
fn hand_worked_taint_multiplier() {
    let m = preferred_taint_multiplier(0.5);
    assert!((m as f64 - 0.629_948_532_574_438_6).abs() < 1e-7);
    assert!((preferred_taint_multiplier(-1.25) as f64 - 2.335_634_619_758_268).abs() < 1e-6);
    assert_eq!(preferred_taint_multiplier(0.0), 1.0);
    let mut case = Case::new(
        KvCostConfig::default(),
        KvRequest::new(160, bs16(), true, WorkerRole::Prefill),
        2,
    );
    case.taint = Some(vec![m, 1.0]);
    // 10 blocks each; row 0 scaled by m.
    case.assert_costs(&[10.0 * m as f64, 10.0], 1e-7);
}

#[test]
fn ineligible_rows_cost_infinity_and_range_skips_them() {
    let mut case = Case::new(
        KvCostConfig::default(),
        KvRequest::new(16, bs16(), true, WorkerRole::Prefill),
        20,
    );
    case.decode = (0..20).collect();
    case.mask = vec![0b0110_0000_0000_0000_0100];
    let (out, range) = case.simd();
    for (r, &c) in out.iter().enumerate() {
        if contains(&case.mask, r) {
            assert_eq!(c, 1.0 + r as f32);
        } else {
            assert_eq!(c, f32::INFINITY);
        }
    }
    assert_eq!(range, CostRange { min: 3.0, max: 19.0 });
    case.mask = vec![0];
    assert_eq!(
        case.simd().1,
        CostRange {
            min: f32::INFINITY,
            max: f32::NEG_INFINITY
        }
    );
}

#[test]
fn bad_config_and_short_columns_are_refused() {
    let base = Case::new(
        KvCostConfig::default(),
        KvRequest::new(16, bs16(), true, WorkerRole::Prefill),
        9,
    );
    let mut out = vec![0.0f32; 9];
    type BadField = (fn(&mut KvCostConfig), KvConfigField, KvConfigProblem);
    let cases: [BadField; 5] = [
        (
            |c| c.overlap_score_credit = f32::NAN,
            KvConfigField::OverlapScoreCredit,
            KvConfigProblem::NotFinite,
        ),
        (
            |c| c.prefill_load_scale = -1.0,
            KvConfigField::PrefillLoadScale,
            KvConfigProblem::Negative,
        ),
        (
            |c| c.host_cache_hit_weight = 1.5,
            KvConfigField::HostCacheHitWeight,
            KvConfigProblem::AboveOne,
        ),
        (
            |c| c.shared_cache_multiplier = f32::INFINITY,
            KvConfigField::SharedCacheMultiplier,
            KvConfigProblem::NotFinite,
        ),
        (
            |c| c.router_temperature = -0.1,
            KvConfigField::RouterTemperature,
            KvConfigProblem::Negative,
        ),
    ];
    for (set, field, problem) in cases {
        let mut config = KvCostConfig::default();
        set(&mut config);
        let err = KvConfigError { field, problem };
        assert_eq!(config.validate(), Err(err));
        let got = kv_cost(
            &config,
            &base.request,
            &base.load(),
            &base.overlap(),
            &base.mask,
            &mut out,
        );
        assert_eq!(got, Err(KvCostError::Config(err)));
    }
    assert_eq!(KvCostConfig::default().validate(), Ok(()));
    let short = vec![1.0f32; 8];
    let overlap = KvOverlap {
        host_blocks: Some(&short),
        ..KvOverlap::default()
    };
    let config = KvCostConfig::default();
    let err = kv_cost(&config, &base.request, &base.load(), &overlap, &base.mask, &mut out);
    assert_eq!(
        err,
        Err(KvCostError::ColumnTooShort {
            column: KvColumn::HostBlocks,
            rows: 9,
            len: 8
        })
    );
    let err = kv_cost_reference(
        &config,
        &base.request,
        &base.load(),
        &base.overlap(),
        &base.mask,
        &mut out[..3],
    );
    assert_eq!(
        err,
        Err(KvCostError::ColumnTooShort {
            column: KvColumn::Output,
            rows: 9,
            len: 3
        })
    );
}

/// A configuration Dynamo accepts.
fn config() -> impl Strategy<Value = KvCostConfig> {
    let free = || prop_oneof![Just(0.0f32), Just(1.0f32), super::uniform_f32(0.0, 4.0, false)];
    let unit = || prop_oneof![Just(0.0f32), Just(1.0f32), super::uniform_f32(0.0, 1.0, true)];
    ((free(), free(), free(), free()), (unit(), unit(), unit())).prop_map(|((credit, decay, scale, req), (h, d, s))| {
        KvCostConfig {
            overlap_score_credit: credit,
            overlap_score_credit_decay: decay,
            prefill_load_scale: scale,
            decode_active_request_weight: req,
            host_cache_hit_weight: h,
            disk_cache_hit_weight: d,
            shared_cache_multiplier: s,
            router_temperature: 0.0,
        }
    })
}

fn request() -> impl Strategy<Value = KvRequest> {
    (
        prop_oneof![0u32..5000, Just(0u32), Just(u32::MAX)],
        prop_oneof![Just(16u32), 1u32..128, Just(u32::MAX)],
        any::<bool>(),
        prop_oneof![
            Just(WorkerRole::Aggregated),
            Just(WorkerRole::Prefill),
            Just(WorkerRole::Decode)
        ],
        load_value(),
    )
        .prop_map(|(isl, bs, track, role, added)| {
            KvRequest::new(isl, NonZeroU32::new(bs).unwrap(), track, role).with_added_decode_blocks(added)
        })
}

/// An overlap value: finite, non-negative; `huge` adds `f32::MAX` and values
/// whose sums overflow `f32` (the SIMD and reference must still agree).
fn overlap_value(huge: bool) -> BoxedStrategy<f32> {
    let normal = prop_oneof![
        3 => Just(0.0f32),
        3 => (0u32..100).prop_map(|v| v as f32),
        2 => super::uniform_f32(0.0, 1.0e6, false),
        1 => Just(1.0e-45f32),
        1 => any::<u32>().prop_map(|v| v as f32),
        1 => Just(1.0e30f32),
    ];
    if huge {
        prop_oneof![8 => normal, 1 => Just(f32::MAX), 1 => Just(3.0e38f32)].boxed()
    } else {
        normal.boxed()
    }
}

fn optional_column(n: usize, value: BoxedStrategy<f32>) -> impl Strategy<Value = Option<Vec<f32>>> {
    prop::option::of(prop::collection::vec(value, n))
}

fn case(huge: bool) -> impl Strategy<Value = Case> {
    (config(), request(), rows()).prop_flat_map(move |(config, request, n)| {
        let u = || prop::collection::vec(load_value(), n);
        let taint = prop::collection::vec(
            super::uniform_f32(-3.0, 3.0, false).prop_map(preferred_taint_multiplier),
            n,
        );
        (
            (u(), u(), u(), prop::option::of(mask(n)), mask(n)),
            (
                optional_column(n, overlap_value(huge)),
                optional_column(n, overlap_value(huge)),
                optional_column(n, overlap_value(huge)),
                optional_column(n, overlap_value(huge)),
                optional_column(n, overlap_value(huge)),
                prop::option::of(u()),
                prop::option::of(taint),
            ),
        )
            .prop_map(
                move |((prefill, decode, requests, available, mask), (d, c, h, k, s, a, t))| Case {
                    config,
                    request,
                    prefill,
                    decode,
                    requests,
                    available,
                    mask,
                    device: d,
                    cached: c,
                    host: h,
                    disk: k,
                    shared: s,
                    added: a,
                    taint: t,
                },
            )
    })
}

proptest! {
    #[test]
    fn kv_cost_matches_reference_bit_for_bit(case in case(true)) {
        let (simd, range) = case.simd();
        let (reference, ref_range) = case.reference();
        for r in 0..simd.len() {
            prop_assert!(same_f32(simd[r], reference[r]), "row {}: simd {} reference {}", r, simd[r], reference[r]);
        }
        prop_assert_eq!(range, ref_range);
    }

    /// Each row's terms sum to its `f64` cost, and the listed rows' costs
    /// and terms are the whole column's.
    #[test]
    fn kv_cost_terms_sum_to_the_f64_cost(case in case(false)) {
        let exact = case.f64_reference();
        for (r, e) in exact.iter().enumerate() {
            if e.cost.is_infinite() {
                prop_assert_eq!(e.terms, KvCostTerms::default(), "row {}", r);
            } else {
                let err = (e.terms.sum() - e.cost).abs();
                prop_assert!(err <= 1e-12 * e.magnitude.max(1.0), "row {}: terms {:?} cost {}", r, e.terms, e.cost);
                prop_assert!(e.terms.credit <= 0.0, "row {}: credit {}", r, e.terms.credit);
            }
        }
        let rows: Vec<usize> = (0..exact.len() + 2).rev().collect();
        let mut listed = vec![KvCostF64::default(); rows.len()];
        kv_cost_f64_rows(&case.config, &case.request, &case.load(), &case.overlap(), &case.mask, &rows, &mut listed).unwrap();
        for (&r, got) in rows.iter().zip(&listed) {
            let want = exact.get(r).copied().unwrap_or(KvCostF64 { cost: f64::INFINITY, ..KvCostF64::default() });
            prop_assert_eq!(*got, want, "row {}", r);
        }
        let short = kv_cost_f64_rows(&case.config, &case.request, &case.load(), &case.overlap(), &case.mask, &rows, &mut listed[..1]);
        let refused = matches!(short, Err(KvCostError::ColumnTooShort { column: KvColumn::Output, .. }));
        prop_assert!(refused, "{:?}", short);
    }

    #[test]
    fn kv_cost_is_within_the_parity_bound_of_f64(case in case(false)) {
        let (simd, _) = case.simd();
        let exact = case.f64_reference();
        for r in 0..simd.len() {
            prop_assert!(
                exact[r].admits(simd[r]),
                "row {}: f32 {} f64 {} tolerance {}", r, simd[r], exact[r].cost, exact[r].tolerance()
            );
        }
    }
}

/// The fused cost-and-argmin returns what the cost column and the
/// temperature-0 pick over it return (row, draw, error), on every backend,
/// and so does its scalar reference.
fn check_fused(case: &Case, seed: u64) -> Result<(), TestCaseError> {
    let (costs, range) = case.simd();
    let mut a = crate::Rng::new(seed);
    let unfused = crate::kernels::pick::pick_in_range(&costs[..], &case.mask, range, 0.0, &mut a);
    let expect = match unfused {
        Ok(Some(row)) => Ok(Some(row)),
        Ok(None) => Ok(None),
        Err(crate::kernels::KernelError::NonFiniteCost { row }) => Err(KvCostError::NonFiniteCost { row }),
        Err(e) => panic!("unexpected {e:?}"),
    };
    let (load, overlap) = (case.load(), case.overlap());
    let mut b = crate::Rng::new(seed);
    let reference = kv_cost_argmin_reference(&case.config, &case.request, &load, &overlap, &case.mask, &mut b);
    prop_assert_eq!(reference.map(|c| c.map(|c| c.row)), expect);
    prop_assert_eq!(a.state(), b.state());
    for backend in Backend::available() {
        let mut c = crate::Rng::new(seed);
        let fused = kv_cost_argmin_on(
            backend,
            &case.config,
            &case.request,
            &load,
            &overlap,
            &case.mask,
            &mut c,
        );
        prop_assert_eq!(fused.map(|c| c.map(|c| c.row)), expect, "{:?}", backend);
        if let Ok(Some(choice)) = fused {
            prop_assert!(
                choice.cost == costs[choice.row],
                "{:?} cost {} column {}",
                backend,
                choice.cost,
                costs[choice.row]
            );
        }
        prop_assert_eq!(c.state(), a.state(), "{:?}", backend);
    }
    Ok(())
}

/// Lane groups of the fleet-like columns of [`check_fused_on_counters`].
const COUNTER_GROUPS: usize = 128;

/// [`check_fused`]'s fused call on the case's load held as tagged fleet
/// counters (`value << 8 | tag`, read with a decode shift): the same row,
/// cost and draw as on plain slices. Loads are cut to 24 bits, as a counter
/// holds them.
fn check_fused_on_counters(case: &Case, seed: u64) -> Result<(), TestCaseError> {
    use crate::lanes::{Column, Decode};
    let rows = case.prefill.len();
    prop_assume!(rows <= COUNTER_GROUPS * crate::lanes::LANES);
    let mut case = case.clone();
    let columns = [
        Column::<COUNTER_GROUPS>::new(0),
        Column::<COUNTER_GROUPS>::new(0),
        Column::<COUNTER_GROUPS>::new(0),
    ];
    for (column, values) in columns
        .iter()
        .zip([&mut case.prefill, &mut case.decode, &mut case.requests])
    {
        for (row, v) in values.iter_mut().enumerate() {
            *v &= 0xFF_FFFF;
            column
                .at(row)
                .store(*v << 8 | (row as u32 & 0xFF), core::sync::atomic::Ordering::Relaxed);
        }
    }
    let views = columns.each_ref().map(|c| c.view(rows, Decode::Shift(8)));
    let load = KvLoad {
        load_available: case.available.as_deref(),
        ..KvLoad::new(&views[0], &views[1], &views[2])
    };
    let overlap = case.overlap();
    for backend in Backend::available() {
        let (mut on_slices, mut on_counters) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
        let slices_range = kv_cost_on(
            backend,
            &case.config,
            &case.request,
            &case.load(),
            &overlap,
            &case.mask,
            &mut on_slices,
        );
        let counters_range = kv_cost_on(
            backend,
            &case.config,
            &case.request,
            &load,
            &overlap,
            &case.mask,
            &mut on_counters,
        );
        prop_assert_eq!(slices_range, counters_range, "{:?}", backend);
        for r in 0..rows {
            prop_assert!(
                same_f32(on_slices[r], on_counters[r]),
                "{:?} row {}: slices {} counters {}",
                backend,
                r,
                on_slices[r],
                on_counters[r]
            );
        }
        let (mut a, mut b) = (crate::Rng::new(seed), crate::Rng::new(seed));
        let on_slices = kv_cost_argmin_on(
            backend,
            &case.config,
            &case.request,
            &case.load(),
            &overlap,
            &case.mask,
            &mut a,
        );
        let on_counters = kv_cost_argmin_on(
            backend,
            &case.config,
            &case.request,
            &load,
            &overlap,
            &case.mask,
            &mut b,
        );
        prop_assert_eq!(on_slices, on_counters, "{:?}", backend);
        prop_assert_eq!(a, b, "{:?}", backend);
    }
    Ok(())
}

/// A case in one of the shapes the fused kernel compiles a loop for (see
/// `kv_cost::fast`): device overlap and cached tokens given, no other
/// optional column, no load-availability mask, no decay; whole mask words.
fn fast_case() -> impl Strategy<Value = Case> {
    let rows = prop_oneof![3 => 64usize..=300, 1 => Just(1000usize)];
    (case(true), rows, any::<bool>(), any::<u64>()).prop_map(|(mut c, rows, tracked, fill)| {
        let resize = |v: &mut Vec<u32>| v.resize(rows, (fill % 7) as u32);
        resize(&mut c.prefill);
        resize(&mut c.decode);
        resize(&mut c.requests);
        c.mask.resize(
            rows.div_ceil(64) + 1,
            if fill % 3 == 0 { 0x0F0F_F0F0_0000_FFFF } else { u64::MAX },
        );
        c.config.overlap_score_credit_decay = 0.0;
        c.request = KvRequest::new(
            c.request.isl_tokens(),
            c.request.block_size(),
            tracked,
            c.request.role(),
        )
        .with_added_decode_blocks(c.request.added_decode_blocks());
        let column = |col: Option<Vec<f32>>| {
            let mut col = col.unwrap_or_default();
            col.resize(rows, (fill % 11) as f32 * 4.0);
            Some(col)
        };
        c.device = column(c.device.take());
        c.cached = column(c.cached.take());
        (c.available, c.host, c.disk, c.shared, c.added, c.taint) = (None, None, None, None, None, None);
        c
    })
}

proptest! {
    #[test]
    fn kv_cost_argmin_equals_kv_cost_then_pick(case in case(true), seed in any::<u64>()) {
        check_fused(&case, seed)?;
        check_fused_on_counters(&case, seed)?;
    }

    /// The same in the shapes of the specialised loops (`kv_cost::fast`),
    /// on slices and on fleet counters, and `kv_cost` against its reference
    /// in them.
    #[test]
    fn kv_cost_argmin_fast_shapes_equal_kv_cost_then_pick(case in fast_case(), seed in any::<u64>()) {
        let (simd, range) = case.simd();
        let (reference, ref_range) = case.reference();
        for r in 0..simd.len() {
            prop_assert!(same_f32(simd[r], reference[r]), "row {}: simd {} reference {}", r, simd[r], reference[r]);
        }
        prop_assert_eq!(range, ref_range);
        check_fused(&case, seed)?;
        check_fused_on_counters(&case, seed)?;
    }
}

/// Partly eligible mask words in a one-shape loop whose ineligible rows cost
/// `+inf` (and NaN): the pick ignores them as `kv_cost` + pick does, with
/// no `NonFiniteCost`, on every backend and on fleet counters.
#[test]
fn kv_cost_argmin_ignores_non_finite_costs_on_ineligible_rows() {
    let rows = 256;
    let request = KvRequest::new(4096, bs16(), true, WorkerRole::Aggregated);
    let mut case = Case::new(KvCostConfig::default(), request, rows);
    case.mask = std::vec![0x5555_5555_5555_5555; rows / 64];
    // Eligible (even) rows tie in pairs of loads, so the pick draws.
    case.prefill = (0..rows as u32).map(|r| (r % 4) * 10).collect();
    let mut cached: Vec<f32> = std::vec![0.0; rows];
    for r in (1..rows).step_by(2) {
        cached[r] = if r % 4 == 1 { f32::INFINITY } else { f32::NAN };
    }
    case.cached = Some(cached);
    case.device = Some(std::vec![0.0; rows]);
    let (costs, range) = case.simd();
    assert!(range.min.is_finite() && range.max.is_finite(), "{range:?}");
    assert!(costs[1].is_infinite(), "ineligible rows cost +inf in the column");
    for seed in 0..50 {
        check_fused(&case, seed).unwrap();
        check_fused_on_counters(&case, seed).unwrap();
    }
}

/// Every row tied (an idle fleet): more tie groups than the pass remembers,
/// so the k-th tie is found by recomputing; every draw agrees with the
/// unfused path.
#[test]
fn kv_cost_argmin_with_every_row_tied() {
    let rows = 1500;
    let request = KvRequest::new(64, bs16(), true, WorkerRole::Prefill);
    let case = Case::new(KvCostConfig::default(), request, rows);
    let (costs, range) = case.simd();
    for seed in 0..200 {
        let mut a = crate::Rng::new(seed);
        let want = crate::kernels::pick::pick_in_range(&costs[..], &case.mask, range, 0.0, &mut a).unwrap();
        for backend in Backend::available() {
            let mut b = crate::Rng::new(seed);
            let (load, overlap) = (case.load(), case.overlap());
            let got = kv_cost_argmin_on(
                backend,
                &case.config,
                &case.request,
                &load,
                &overlap,
                &case.mask,
                &mut b,
            );
            assert_eq!(got.unwrap().map(|c| c.row), want, "{backend:?} seed {seed}");
            assert_eq!(a, b);
        }
    }
}

/// An idle fleet in a one-shape loop's shape (device overlap and cached
/// tokens given, nothing cached): every eligible row ties, so the search
/// hands the scan to its tie loop after its first folds, starting inside a
/// mask word; some words whole, some partly eligible, one empty, and one
/// row below the others far into the scan. Every row and draw agrees with
/// the unfused path on every backend and on fleet counters.
#[test]
fn kv_cost_argmin_when_idle_rows_tie_in_a_one_shape_loop() {
    let rows = 1000;
    let request = KvRequest::new(64, bs16(), true, WorkerRole::Aggregated);
    for lower in [None, Some(3), Some(700), Some(999)] {
        let mut case = Case::new(KvCostConfig::default(), request, rows);
        case.device = Some(std::vec![0.0; rows]);
        case.cached = Some(std::vec![0.0; rows]);
        for (w, word) in case.mask.iter_mut().enumerate() {
            *word = match w % 4 {
                1 => 0x0F0F_F0F0_0000_FFFF,
                3 if w == 3 => 0,
                _ => u64::MAX,
            };
        }
        if let Some(row) = lower {
            case.device.as_mut().unwrap()[row] = 2.0;
            case.mask[row / 64] |= 1 << (row % 64);
        }
        for seed in 0..100 {
            check_fused(&case, seed).unwrap();
            check_fused_on_counters(&case, seed).unwrap();
        }
    }
}

/// Loads that change between the fused kernel's passes (more tied groups
/// than it remembers, so the ties are found again by recomputing) must
/// never panic nor return a row outside the mask while a row is eligible.
#[test]
fn fused_argmin_on_loads_changing_under_the_scan_returns_an_eligible_row() {
    let rows = 4_000;
    let column = || Shifting::new(rows, rows as u32, 3);
    let (prefill, decode, active) = (column(), column(), column());
    let device: Vec<f32> = (0..rows).map(|r| (r % 2) as f32).collect();
    let cached: Vec<f32> = device.iter().map(|d| d * 16.0).collect();
    let request = KvRequest::new(64, NonZeroU32::new(16).unwrap(), true, WorkerRole::Prefill);
    let config = KvCostConfig::default();
    let words: Vec<u64> = (0..rows.div_ceil(64))
        .map(|w| if w % 5 == 4 { 0 } else { u64::MAX })
        .collect();
    for backend in Backend::available() {
        for seed in 0..50 {
            let load = KvLoad::new(&prefill, &decode, &active);
            let overlap = KvOverlap {
                device_blocks: Some(&device[..]),
                cached_tokens: Some(&cached[..]),
                ..KvOverlap::default()
            };
            let got = kv_cost_argmin_on(
                backend,
                &config,
                &request,
                &load,
                &overlap,
                &words,
                &mut crate::Rng::new(seed),
            );
            match got {
                Ok(Some(choice)) => assert!(contains(&words, choice.row), "{backend:?}: row {}", choice.row),
                other => panic!("{backend:?}: {other:?}"),
            }
        }
    }
}
