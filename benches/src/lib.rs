//! Shared fixtures for selkie's benchmarks: fleets and requests built the
//! same way for the instruction-count benches, the wall-clock benches and the
//! side-by-side comparison with Dynamo. Building inputs happens here, outside
//! every measured region.

/// Dynamo's `worker_selection` fixture values for worker `id`:
/// cached tokens, active prefill tokens, active decode blocks, active requests.
pub fn dynamo_fixture_worker(id: u32) -> (u32, u32, u32, u32) {
    ((id % 32) * 64, id * 16, id % 127, id % 17)
}

/// In-flight request counts for `n` workers, Dynamo's fixture (`id % 17`).
pub fn fixture_active(n: usize) -> Vec<u32> {
    (0..n as u32).map(|id| dynamo_fixture_worker(id).3).collect()
}

/// An eligibility mask with every one of `n` rows set.
pub fn all_eligible(n: usize) -> Vec<u64> {
    let mut m = vec![0u64; n.div_ceil(64)];
    for r in 0..n {
        m[r / 64] |= 1 << (r % 64);
    }
    m
}

/// The benches' generated fleets come from the kernel's SplitMix64 streams:
/// the same on every run (`vs_dynamo_index` and the `ingest_profile`
/// example build the same events from the same seed).
pub use selkie_kernel::rng::SplitMix64;

/// The next `n` values of `stream`.
pub fn chain(stream: &mut SplitMix64, n: usize) -> Vec<u64> {
    (0..n).map(|_| stream.next_u64()).collect()
}

pub mod host_fixture;
pub mod index_fixture;
pub mod index_streams;
pub mod kernel_fixture;
pub mod timing;

#[cfg(feature = "dynamo")]
pub mod vs_dynamo;
