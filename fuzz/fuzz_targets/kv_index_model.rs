//! `kv_index_model`: see `host/tests/fuzz_harness/kv_index_model.rs` (the check, shared
//! with the regression replay in `host/tests/fuzz_regressions.rs`) and FUZZING.md.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../host/tests/fuzz_harness/kv_index_model.rs"]
#[allow(dead_code)]
mod harness;

fuzz_target!(|input: harness::Input| harness::check(&input));
