//! Differential target: SIMD least-loaded against its scalar reference, on
//! arbitrary columns, masks, lengths and seeds.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use selkie_kernel::kernels::least_loaded::{
    least_loaded, least_loaded_reference, least_loaded_weighted, least_loaded_weighted_reference,
};
use selkie_kernel::Rng;

/// `Debug` prints a pasteable reproducer.
#[derive(Arbitrary, Debug)]
struct Input {
    active: Vec<u32>,
    inv_weight: Vec<f32>,
    mask: Vec<u64>,
    seed: u64,
}

fuzz_target!(|input: Input| {
    let (mut a, mut b) = (Rng::new(input.seed), Rng::new(input.seed));
    let simd = least_loaded(&input.active[..], &input.mask, &mut a);
    let reference = least_loaded_reference(&input.active[..], &input.mask, &mut b);
    assert_eq!(simd, reference, "{input:?}");
    assert_eq!(a, b, "draws differ: {input:?}");

    // Weighted form: NaN weights are excluded by the fleet (weights are
    // validated finite and > 0), so only finite, non-negative weights here.
    if input.inv_weight.iter().all(|w| w.is_finite() && *w >= 0.0) {
        let simd = least_loaded_weighted(&input.active[..], &input.inv_weight[..], &input.mask, &mut a);
        let reference = least_loaded_weighted_reference(&input.active[..], &input.inv_weight[..], &input.mask, &mut b);
        assert_eq!(simd, reference, "{input:?}");
        assert_eq!(a, b, "draws differ: {input:?}");
    }
});
