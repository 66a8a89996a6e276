//! The host's layers run one way: no module names a module of a higher
//! layer (see the crate's architecture notes).
//!
//! From the bottom: the plain types (`types`, `error`, `request`,
//! `explain`); `fleet` (the kernel fleet handle and the row index) and
//! `kv_index` (engine KV events to per-row overlaps, beside it);
//! `discovery` and `replica` (booking sync between router replicas,
//! beside it); `filter` and `plugin`; `policy`; `service`; and on top
//! `config`, `sim`, `router` and the crate root. This test reads every file under
//! `src/` (but `src/bin/`, which uses the public API) and reports each
//! `crate::<module>` path, in code rather than comments, that points up.

use std::path::Path;

/// The layer of a top-level module, or `None` for a name that is not one.
fn layer(module: &str) -> Option<u8> {
    Some(match module {
        "types" | "error" | "request" | "explain" | "contain" => 0,
        "fleet" | "kv_index" => 1,
        // The engines' KV event messages, decoded into the index's tiers.
        "engine_events" => 1,
        // Credentials and TLS files for the connections of discovery and
        // replica sync: the plain types and the error only.
        "secure" => 1,
        // Replica sync sits beside discovery: plain types and its error only.
        "discovery" | "replica" => 2,
        "filter" | "plugin" => 3,
        "policy" => 4,
        "service" => 5,
        "config" | "sim" | "router" | "lib" => 6,
        _ => return None,
    })
}

/// The top-level modules that `code` names through `crate::`, including
/// inside `crate::{a::b, c}` groups.
fn named_modules(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `$crate::`, `selkie_crate::`, ...
        }
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level names of the group: after `{` or a `,` at depth 0.
            let (mut depth, mut start) = (0usize, true);
            let mut name = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && (c.is_alphanumeric() || c == '_') => name.push(c),
                    _ if start && !name.is_empty() => {
                        out.push(std::mem::take(&mut name));
                        start = false;
                    }
                    _ => {}
                }
            }
            if !name.is_empty() {
                out.push(name);
            }
        } else {
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            out.push(name);
        }
    }
    out
}

/// Every upward reference in one file, as `"file -> module"`.
fn upward(rel: &str, source: &str) -> Vec<String> {
    let top = rel.split('/').next().unwrap_or(rel).trim_end_matches(".rs");
    let Some(mine) = layer(top) else {
        return vec![format!("{rel}: not in any layer (add it to the test)")];
    };
    let code: String = source
        .lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found: Vec<String> = named_modules(&code)
        .into_iter()
        .filter(|m| m != top && layer(m).is_some_and(|l| l > mine))
        .map(|m| format!("{rel} -> {m}"))
        .collect();
    found.sort();
    found.dedup();
    found
}

fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        let rel = path
            .strip_prefix(root)
            .expect("under src")
            .to_string_lossy()
            .replace('\\', "/");
        if path.is_dir() {
            if rel != "bin" {
                walk(&path, root, out);
            }
        } else if rel.ends_with(".rs") {
            let source = std::fs::read_to_string(&path).expect("read file");
            out.extend(upward(&rel, &source));
        }
    }
}

#[test]
fn no_module_imports_from_a_higher_layer() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    walk(&root, &root, &mut found);
    assert!(found.is_empty(), "upward imports:\n{}", found.join("\n"));
}

/// The check itself catches what it is for (and ignores comments).
#[test]
fn the_check_sees_upward_imports() {
    assert_eq!(
        upward("policy/kv.rs", "use crate::service::WorkerSelectionService;"),
        ["policy/kv.rs -> service"]
    );
    assert_eq!(
        upward("fleet/mod.rs", "fn f(r: &crate::discovery::WorkerRecord) {}"),
        ["fleet/mod.rs -> discovery"]
    );
    assert_eq!(
        upward("error.rs", "use crate::{types::WorkerId, policy::{A, B}};"),
        ["error.rs -> policy"]
    );
    assert!(upward(
        "fleet/rows.rs",
        "// see crate::discovery::registry\nuse crate::types::DpRank;"
    )
    .is_empty());
    assert!(upward("service/mod.rs", "use crate::policy::Env;").is_empty());
}
