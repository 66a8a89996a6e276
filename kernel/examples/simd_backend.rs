//! Prints the SIMD backend the kernel chose on this machine (CI logs it).
//!
//! ```text
//! cargo run -p selkie-kernel --example simd_backend
//! SELKIE_SIMD=portable cargo run -p selkie-kernel --example simd_backend
//! ```

fn main() {
    println!("selkie-kernel SIMD backend: {}", selkie_kernel::simd_backend());
}
