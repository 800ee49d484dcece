//! Loopback ports for children that bind later: `tandem up`'s etcd, NATS, router and Prometheus,
//! the drills' and benchmarks' routers, and the tests that start `tandem up` themselves.
//!
//! Picking a port means binding it, reading it back and letting it go, so a child can bind it a
//! moment later. A port that the kernel chose (`bind(…:0)`) comes from the ephemeral range, which
//! is also where every outgoing connection and every other `bind(…:0)` on the machine draws from:
//! in the gap between letting it go and the child binding it, any of those can take it, and the
//! child fails with "Address already in use". (It did, in the observability suite.)
//!
//! Invariant: the ports handed out here lie *below* the kernel's ephemeral range
//! (`/proc/sys/net/ipv4/ip_local_port_range`), so nothing that lets the kernel choose can take
//! one; only another program that picks fixed ports could, and each is checked free by binding
//! it before it is returned.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};

/// The lowest port handed out (above the well-known and common registered services).
const FLOOR: u16 = 10_000;

/// How many random candidates are tried before falling back to a kernel-chosen port.
const TRIES: usize = 64;

/// A free loopback port (`127.0.0.1:<port>`) below the ephemeral range, free when returned.
///
/// Falls back to a kernel-chosen port where the range cannot be read or leaves no room below it.
pub fn free_loopback_addr() -> std::io::Result<SocketAddr> {
    let ephemeral_lo = ephemeral_range().map_or(FLOOR, |(lo, _)| lo);
    if ephemeral_lo > FLOOR + 100 {
        let span = u64::from(ephemeral_lo - FLOOR);
        for _ in 0..TRIES {
            let port = FLOOR + (next_random() % span) as u16;
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            if TcpListener::bind(addr).is_ok() {
                return Ok(addr);
            }
        }
    }
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()
}

/// `(lowest, highest)` of the kernel's ephemeral port range, where Linux says.
fn ephemeral_range() -> Option<(u16, u16)> {
    let s = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = s.split_whitespace().map(|p| p.parse::<u16>().ok());
    Some((it.next()??, it.next()??))
}

/// splitmix64 over the time, the pid and a counter: different in every call and every process,
/// so two programs picking at once rarely try the same port (and each checks by binding).
fn next_random() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut z = nanos
        ^ (u64::from(std::process::id()) << 32)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_below_the_ephemeral_range_distinct_and_bindable() {
        let (lo, _) = ephemeral_range().expect("Linux has an ephemeral range");
        let addrs: Vec<SocketAddr> = (0..20).map(|_| free_loopback_addr().unwrap()).collect();
        for a in &addrs {
            assert!(a.ip().is_loopback());
            assert!(
                (FLOOR..lo).contains(&a.port()),
                "{a} is not below the ephemeral range starting at {lo}"
            );
            TcpListener::bind(a).expect("free when returned");
        }
        let mut ports: Vec<u16> = addrs.iter().map(|a| a.port()).collect();
        ports.sort_unstable();
        ports.dedup();
        assert!(ports.len() >= 18, "20 picks gave only {} ports", ports.len());
    }
}
