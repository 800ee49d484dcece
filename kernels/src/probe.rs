//! A memory read-bandwidth probe: the machine limit that single-sequence decode (which streams
//! every weight once per token) is measured against, taken in the same run as the benchmark.
//!
//! It reads a buffer much larger than the last-level cache on every thread of the kernel pool,
//! each thread walking its range as 8 interleaved streams (one stream per core leaves DRAM
//! parallelism unused: the GEMV reads 8 weight panels at once for the same reason) with 16
//! independent f32 lanes per stream, and reports the best of several passes in GB/s (1e9 B/s).

use crate::pool::WorkerPool;

/// Best read bandwidth over `passes` passes over `bytes` bytes (rounded down to 256-byte lines),
/// using every thread of `pool`.
pub fn read_bandwidth_gbs(pool: &WorkerPool, bytes: usize, passes: usize) -> f64 {
    let n = (bytes / 4) & !63;
    // Non-zero contents so the pages are really backed (a zeroed allocation may map one page).
    let buf: Vec<f32> = (0..n).map(|i| (i & 1023) as f32).collect();
    let sums: Vec<std::sync::atomic::AtomicU32> =
        (0..pool.threads()).map(|_| Default::default()).collect();
    let mut best = 0f64;
    for _ in 0..passes.max(1) {
        let t0 = std::time::Instant::now();
        pool.run_ranges(n / 64, pool.threads(), &|r| {
            const STREAMS: usize = 8;
            let mine = &buf[r.start * 64..r.end * 64];
            let per = mine.len() / STREAMS / 16 * 16;
            let mut acc = [[0f32; 16]; STREAMS];
            for i in (0..per).step_by(16) {
                for (s, a) in acc.iter_mut().enumerate() {
                    let x = &mine[s * per + i..s * per + i + 16];
                    for (a, x) in a.iter_mut().zip(x) {
                        *a += x;
                    }
                }
            }
            let s: f32 = acc.iter().flatten().sum();
            sums[r.start % sums.len()]
                .fetch_add(s.to_bits() & 1, std::sync::atomic::Ordering::Relaxed);
        });
        best = best.max((n * 4) as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    std::hint::black_box(&sums);
    best
}
