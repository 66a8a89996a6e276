//! Loopback ports for servers a test starts as processes (or on addresses
//! it must know before they bind).
//!
//! A port taken by binding port 0 and letting go comes from the kernel's
//! ephemeral range, the range every outgoing connection draws its local
//! port from: with tests connecting in parallel, one of them can hold the
//! port before the server binds it. These come from below that range, at
//! random, each one handed out once per process.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};
use std::net::TcpListener;
use std::sync::Mutex;

/// A loopback port nothing listens on now, below the ephemeral range and
/// not handed out before by this process.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (10_000u16, ephemeral_low.max(20_000));
    let random = RandomState::new();
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    for attempt in 0u64..10_000 {
        let port = low + (random.hash_one(attempt) % u64::from(high - low)) as u16;
        if given.contains(&port) || TcpListener::bind(("127.0.0.1", port)).is_err() {
            continue;
        }
        given.insert(port);
        return port;
    }
    panic!("no free loopback port in {low}..{high} after 10,000 tries");
}
