//! Prints the SIMD backend the kernel chose on this machine, and what the
//! build itself assumes of the CPU (CI logs both).
//!
//! ```text
//! cargo run -p selkie-kernel --example simd_backend
//! SELKIE_SIMD=portable cargo run -p selkie-kernel --example simd_backend
//! ```

fn main() {
    println!("selkie-kernel SIMD backend: {}", selkie_kernel::simd_backend());
    // A build made without flags targets the x86-64 baseline and picks AVX2
    // at run time; `-C target-cpu=native` (or any CPU with AVX2) compiles
    // AVX2 in everywhere.
    let built_for = if cfg!(target_feature = "avx2") {
        "a CPU with AVX2 (the baseline path is not what runs)"
    } else if cfg!(target_arch = "x86_64") {
        "the x86-64 baseline (no AVX2 at compile time)"
    } else {
        std::env::consts::ARCH
    };
    println!("built for: {built_for}");
}
