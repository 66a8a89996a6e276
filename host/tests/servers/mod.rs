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

#[path = "../support/ports.rs"]
pub mod ports;

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
            port: ports::free_port(),
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

/// A bare NATS client speaking the text protocol over a `TcpStream`: what
/// a forger on the subject has (no selkie, no key), to publish arbitrary
/// messages and read what the replicas publish.
pub struct RawNats {
    writer: std::net::TcpStream,
    reader: std::io::BufReader<std::net::TcpStream>,
}

/// One message a [`RawNats`] read: its headers block (if any) and payload.
pub struct RawMessage {
    pub headers: Option<String>,
    pub payload: Vec<u8>,
}

impl RawNats {
    /// Connects to `url` (`nats://host:port`) and waits for the server's
    /// answer to a ping.
    pub fn connect(url: &str) -> RawNats {
        use std::io::BufRead;
        let addr = url.trim().trim_start_matches("nats://");
        let writer = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
        writer.set_nodelay(true).unwrap();
        let mut reader = std::io::BufReader::new(writer.try_clone().unwrap());
        let mut info = String::new();
        reader.read_line(&mut info).unwrap();
        assert!(info.starts_with("INFO "), "{info}");
        let mut raw = RawNats { writer, reader };
        raw.send(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"no_responders\":false,\"protocol\":1}\r\n");
        raw.flush();
        raw
    }

    fn send(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).unwrap();
    }

    /// Publishes `payload` on `subject`, without headers.
    pub fn publish(&mut self, subject: &str, payload: &[u8]) {
        let mut frame = format!("PUB {subject} {}\r\n", payload.len()).into_bytes();
        frame.extend_from_slice(payload);
        frame.extend_from_slice(b"\r\n");
        self.send(&frame);
    }

    /// Publishes `payload` on `subject` with a headers block (`headers`
    /// as received, or built by [`header`](Self::header)).
    pub fn publish_with_headers(&mut self, subject: &str, headers: &str, payload: &[u8]) {
        let total = headers.len() + payload.len();
        let mut frame = format!("HPUB {subject} {} {total}\r\n", headers.len()).into_bytes();
        frame.extend_from_slice(headers.as_bytes());
        frame.extend_from_slice(payload);
        frame.extend_from_slice(b"\r\n");
        self.send(&frame);
    }

    /// A headers block with one header.
    pub fn header(name: &str, value: &str) -> String {
        format!("NATS/1.0\r\n{name}: {value}\r\n\r\n")
    }

    /// Subscribes to `subject` (as subscription 1).
    pub fn subscribe(&mut self, subject: &str) {
        self.send(format!("SUB {subject} 1\r\n").as_bytes());
        self.flush();
    }

    /// Waits until the server has processed everything sent so far.
    pub fn flush(&mut self) {
        self.send(b"PING\r\n");
        while self.next_frame(Duration::from_secs(10)).is_some() {}
    }

    /// The next message on a subscription, within `limit`.
    pub fn next_message(&mut self, limit: Duration) -> Option<RawMessage> {
        let start = Instant::now();
        loop {
            let left = limit.checked_sub(start.elapsed())?;
            if let Some(m) = self.next_frame(left.max(Duration::from_millis(1)))? {
                return Some(m);
            }
        }
    }

    /// Reads one frame: `Some(Some(message))`, `Some(None)` for anything
    /// else (a PONG ends a flush: `None`), `None` at the time limit or a
    /// PONG.
    fn next_frame(&mut self, limit: Duration) -> Option<Option<RawMessage>> {
        use std::io::{BufRead, Read};
        self.reader.get_ref().set_read_timeout(Some(limit)).unwrap();
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => panic!("the server closed the connection"),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => return None,
            Err(e) => panic!("reading from the server: {e}"),
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let mut body = |len: usize| {
            let mut bytes = vec![0; len + 2];
            self.reader.read_exact(&mut bytes).unwrap();
            bytes.truncate(len);
            bytes
        };
        match words.first().copied() {
            Some("PONG") => None,
            Some("PING") => {
                self.send(b"PONG\r\n");
                Some(None)
            }
            // MSG <subject> <sid> [reply] <bytes>
            Some("MSG") => {
                let len: usize = words.last().unwrap().parse().unwrap();
                Some(Some(RawMessage {
                    headers: None,
                    payload: body(len),
                }))
            }
            // HMSG <subject> <sid> [reply] <header bytes> <total bytes>
            Some("HMSG") => {
                let total: usize = words[words.len() - 1].parse().unwrap();
                let head: usize = words[words.len() - 2].parse().unwrap();
                let mut bytes = body(total);
                let payload = bytes.split_off(head);
                Some(Some(RawMessage {
                    headers: Some(String::from_utf8(bytes).unwrap()),
                    payload,
                }))
            }
            Some("-ERR") => panic!("the server refused: {line}"),
            _ => Some(None),
        }
    }
}
