//! `adversarial_policy`: see `host/tests/fuzz_harness/adversarial_policy.rs` (the check, shared with
//! the regression replay in `host/tests/fuzz_regressions.rs`) and FUZZING.md.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../host/tests/fuzz_harness/adversarial_policy.rs"]
#[allow(dead_code)]
mod harness;

fuzz_target!(|input: harness::Input| harness::check(&input));
