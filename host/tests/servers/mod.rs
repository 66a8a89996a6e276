//! What the tests against real servers (etcd, nats-server) share: a free
//! loopback port and the server binary to start.
//!
//! Each test crate that includes it uses a part of it.
#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;

/// Says why a test is skipped, straight to stderr (the harness captures
/// `eprintln!` of passing tests).
pub fn skip(why: &str) {
    let _ = writeln!(std::io::stderr(), "\nSKIPPED: {why}");
}

/// The non-empty, trimmed value of the environment variable `var`, or
/// `None` after printing `SKIPPED: {test}: {need}`.
pub fn server_env(var: &str, test: &str, need: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v.trim().to_owned()),
        _ => {
            skip(&format!("{test}: {need}"));
            None
        }
    }
}

/// A loopback port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The server binary: the path in the environment variable `var`, else
/// `name` on the `PATH`; `None` if neither is there.
pub fn server_binary(var: &str, name: &str) -> Option<PathBuf> {
    match std::env::var_os(var) {
        Some(b) => Some(PathBuf::from(b)),
        None => {
            std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|p| p.is_file()))
        }
    }
}
