//! The baselines a transfer is compared with, measured in the same run on the same machine:
//! Debian's `ucx_perftest` (`ucp_put_bw`), a plain loopback socket copy, and `memcpy`.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use super::{Stats, median};
use crate::peer::{PeerCommand, PeerProcess};
use crate::pool::KvPool;

/// `ucx_perftest -t <test>` (`ucp_put_bw` or `tag_bw`) at `message_bytes`, between two
/// processes on this host. Returns GB/s (1e9 bytes/s) from its "Final" overall bandwidth (which
/// it prints in MiB/s).
pub async fn perftest_bw(
    test: &str,
    message_bytes: usize,
    iterations: usize,
    tls: Option<&str>,
) -> anyhow::Result<f64> {
    let port = {
        // Ask the kernel for a free port; the tiny race with another process is acceptable here.
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let env: Vec<(&str, &str)> = tls.map(|t| vec![("UCX_TLS", t)]).unwrap_or_default();
    let mut server = Command::new("ucx_perftest")
        .args(["-p", &port.to_string()])
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("run ucx_perftest (Debian package ucx-utils)")?;
    let mut last_err = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let out = Command::new("ucx_perftest")
            .args(["127.0.0.1", "-p", &port.to_string(), "-t", test])
            .args([
                "-s",
                &message_bytes.to_string(),
                "-n",
                &iterations.to_string(),
            ])
            .envs(env.iter().copied())
            .output()
            .await?;
        let text = String::from_utf8_lossy(&out.stdout);
        match parse_final_mib_per_s(&text) {
            Some(mib) => {
                let _ = server.wait().await;
                return Ok(mib * 1_048_576.0 / 1e9);
            }
            None => last_err = Some(format!("{}{}", text, String::from_utf8_lossy(&out.stderr))),
        }
    }
    let _ = server.kill().await;
    bail!(
        "ucx_perftest gave no result: {}",
        last_err.unwrap_or_default()
    )
}

/// The overall bandwidth (MiB/s, perftest's "MB/s") from perftest's `Final:` line.
pub fn parse_final_mib_per_s(out: &str) -> Option<f64> {
    let line = out.lines().find(|l| l.trim_start().starts_with("Final:"))?;
    let nums: Vec<f64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    // iterations, lat 50%, lat avg, lat overall, bw avg, bw overall, msg/s avg, msg/s overall
    (nums.len() >= 6).then(|| nums[5])
}

/// A plain loopback socket copy of `bytes` per iteration from `src` to the `sink` peer, written
/// in `write_bytes` pieces: the TCP transport's baseline, measured the same way.
pub async fn socket_copy(
    peer: &PeerCommand,
    src: &KvPool,
    bytes: usize,
    write_bytes: usize,
    iterations: usize,
    warmup: usize,
) -> anyhow::Result<Stats> {
    let sink = PeerProcess::spawn_command(peer, &["sink".to_string()]).await?;
    let addr = sink.addr.clone().context("sink address")?;
    let mut s = tokio::net::TcpStream::connect(&addr).await?;
    s.set_nodelay(true)?;
    // SAFETY: the bench owns `src` and nothing writes it while the baseline runs.
    let data = unsafe { std::slice::from_raw_parts(src.as_ptr(), bytes.min(src.len_bytes())) };
    let mut times = Vec::with_capacity(iterations);
    for i in 0..warmup + iterations {
        let t0 = Instant::now();
        s.write_all(&(data.len() as u64).to_le_bytes()).await?;
        for piece in data.chunks(write_bytes) {
            s.write_all(piece).await?;
        }
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).await?;
        if i >= warmup {
            times.push(t0.elapsed());
        }
    }
    drop(s);
    drop(sink);
    Ok(Stats::from_times(data.len() as u64, &times))
}

/// `memcpy` of `bytes` from `src` into a fresh buffer, median of `iterations` (GB/s).
pub fn memcpy_gb_per_s(src: &KvPool, bytes: usize, iterations: usize) -> f64 {
    let bytes = bytes.min(src.len_bytes());
    // SAFETY: the bench owns `src` and nothing writes it while the baseline runs.
    let data = unsafe { std::slice::from_raw_parts(src.as_ptr(), bytes) };
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(data); // fault the pages in first
    let times: Vec<Duration> = (0..iterations.max(1))
        .map(|_| {
            let t0 = Instant::now();
            dst.copy_from_slice(std::hint::black_box(data));
            std::hint::black_box(&dst);
            t0.elapsed()
        })
        .collect();
    bytes as f64 / median(&times).as_secs_f64() / 1e9
}

/// Cumulative CPU time of all CPUs (Linux `/proc/stat`), to tell how much of a run the
/// hypervisor gave to other guests ("steal"): a two-process transfer needs both cores at once and
/// suffers more from it than a one-core baseline does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuTimes {
    steal: u64,
    total: u64,
}

impl CpuTimes {
    /// Now, or `None` where `/proc/stat` is missing or unreadable.
    pub fn now() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// From the text of `/proc/stat`: the aggregate `cpu` line's fields are user, nice, system,
    /// idle, iowait, irq, softirq, steal, ... (in clock ticks).
    fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let ticks: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        // guest and guest_nice (fields 9 and 10) are already counted in user and nice.
        let total = ticks.iter().take(8).sum();
        Some(Self {
            steal: *ticks.get(7)?,
            total,
        })
    }

    /// Percent of all CPU time stolen between `earlier` and `self`.
    pub fn steal_pct_since(&self, earlier: &Self) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        let steal = self.steal.checked_sub(earlier.steal)?;
        (total > 0).then(|| 100.0 * steal as f64 / total as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perftest_final_line_yields_overall_bandwidth() {
        let out = "+-----+\nFinal:                  1000   3125.692  3152.981  3154.249     5074.56    5072.52         317         317\n";
        assert_eq!(parse_final_mib_per_s(out), Some(5072.52));
        assert_eq!(parse_final_mib_per_s("no result"), None);
    }

    #[test]
    fn steal_is_the_eighth_field_as_a_share_of_the_first_eight() {
        let a = CpuTimes::parse("cpu  100 0 50 800 0 0 0 50 0 0\ncpu0 1 2 3\n").unwrap();
        let b = CpuTimes::parse("cpu  200 0 50 850 0 0 0 100 7 0\n").unwrap();
        assert_eq!(b.steal_pct_since(&a), Some(25.0));
        assert_eq!(a.steal_pct_since(&b), None);
        assert_eq!(CpuTimes::parse("intr 1 2\n"), None);
    }
}
