//! `kernels_diff`: see `kernel/tests/fuzz_harness/kernels_diff.rs` (the check, shared with
//! the regression replay in `kernel/tests/fuzz_regressions.rs`) and FUZZING.md.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../kernel/tests/fuzz_harness/kernels_diff.rs"]
#[allow(dead_code)]
mod harness;

fuzz_target!(|input: harness::Input| harness::check(&input));
