//! Replays the minimized inputs committed under `fuzz/regressions/<target>/`
//! through a fuzz target's check. Shared (`#[path]`) by
//! `kernel/tests/fuzz_regressions.rs` and `host/tests/fuzz_regressions.rs`.

use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use arbitrary::{Arbitrary, Unstructured};

fn regression_files(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/regressions")
        .join(target);
    let mut files: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries
            .map(|e| e.expect("read regressions dir").path())
            .filter(|p| p.is_file())
            .collect(),
        Err(_) => Vec::new(),
    };
    files.retain(|p| p.file_name().is_some_and(|n| !n.to_string_lossy().starts_with('.')));
    files.sort();
    files
}

/// Decodes each file as libFuzzer's `fuzz_target!` does
/// (`arbitrary_take_rest`) and runs `check`; reports every failing file.
pub fn replay<T: for<'a> Arbitrary<'a> + Debug>(target: &str, check: fn(&T)) {
    let mut failures = Vec::new();
    for path in regression_files(target) {
        let bytes = std::fs::read(&path).expect("read regression file");
        let Ok(input) = T::arbitrary_take_rest(Unstructured::new(&bytes)) else {
            // libFuzzer skips inputs that do not decode; so do we.
            continue;
        };
        if catch_unwind(AssertUnwindSafe(|| check(&input))).is_err() {
            failures.push(format!("{}: {input:?}", path.display()));
        }
    }
    assert!(failures.is_empty(), "regressions failed:\n{}", failures.join("\n"));
}
