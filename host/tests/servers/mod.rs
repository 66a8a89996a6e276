//! What the tests against real servers (etcd, nats-server) share: a free
//! loopback port and the server binary to start.
//!
//! Each test crate that includes it uses a part of it. `secured` starts
//! servers with authentication and TLS.
//!
//! With `SELKIE_REQUIRE_SERVERS=1` (as `.ci/run` sets it, where the
//! servers exist) a test that would be skipped fails instead.
#![allow(dead_code)]

pub mod secured;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Says why a test is skipped, straight to stderr (the harness captures
/// `eprintln!` of passing tests).
pub fn skip(why: &str) {
    if std::env::var("SELKIE_REQUIRE_SERVERS").is_ok_and(|v| v == "1") {
        panic!("SELKIE_REQUIRE_SERVERS=1 but the test would be skipped: {why}");
    }
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

/// The shared nats-server's URL (`SELKIE_NATS_URL`), or `None` after
/// printing why `test` is skipped.
pub fn nats_url(test: &str) -> Option<String> {
    server_env(
        "SELKIE_NATS_URL",
        test,
        "replica sync tests need SELKIE_NATS_URL (a running nats-server; .ci/run starts one)",
    )
}

/// A NATS subject no other test (or earlier run) uses.
pub fn unique_subject(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("selkie-test.{test}.{}-{nanos}", std::process::id())
}

/// Waits up to `limit` for `done`, checking every 5 ms.
pub fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
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

/// A `nats-server` process of the test's own on a loopback port; killed on
/// drop.
pub struct OwnNats {
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl OwnNats {
    pub fn find() -> Option<OwnNats> {
        let bin = server_binary("SELKIE_NATS_BIN", "nats-server")?;
        Some(OwnNats {
            bin,
            port: free_port(),
            child: None,
        })
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server on its port and waits until it accepts
    /// connections.
    pub fn start(&mut self) {
        assert!(self.child.is_none());
        let child = Command::new(&self.bin)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        self.child = Some(child);
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        let start = Instant::now();
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the test's nats-server does not accept connections"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }
}

impl Drop for OwnNats {
    fn drop(&mut self) {
        self.kill();
    }
}
