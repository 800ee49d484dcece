//! `linear` throughput on the SmolLM2-135M shapes.
//!
//! m = 1 (single-sequence decode) streams weights that are *not* in cache: the bench cycles
//! through enough copies of the matrix (≥ 384 MB) that each call reads from DRAM, as decode does
//! with a 269-538 MB model; its throughput is reported in bytes/s of weights (compare: 51 GB/s
//! DRAM read, sysbench with 2 threads on the project's 2 vCPU AMD EPYC reference host, see
//! bench/RESULTS.md). m ≥ 4 reports FLOP/s as "elem/s" (2·m·rows·cols per call; compare:
//! 422 GFLOP/s OpenBLAS f32 GEMM on both cores of that host).
//!
//! Run: `cargo bench -p tandem-kernels --bench linear` (filter: `-- f16/576x3072`); the
//! quantized dtypes (`q8_0`, `q4_1`) take their ISA's decode kernels, so
//! `TANDEM_KERNELS=avx2` against the default compares the AVX2 and AVX-512 decoders.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::time::Duration;
use tandem_kernels::{Weight, WeightDtype, linear};

/// (name, in features = cols, out features = rows).
const SHAPES: [(&str, usize, usize); 5] = [
    ("o_proj 576x576", 576, 576),
    ("qkv 576x960", 576, 960),
    ("gate_up 576x3072", 576, 3072),
    ("down 1536x576", 1536, 576),
    ("lm_head 576x49152", 576, 49152),
];

fn seeded(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect()
}

/// Sum of `x`, read as 8 concurrent streams (as the GEMV reads 8 panels) with AVX-512 where
/// available (one stream per thread measured ~30% slower on this machine).
fn sum(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        #[target_feature(enable = "avx512f")]
        fn sum512(x: &[f32]) -> f32 {
            use std::arch::x86_64::*;
            let part = x.len() / 8 / 16 * 16;
            let mut a = [_mm512_setzero_ps(); 8];
            for i in (0..part).step_by(16) {
                for (k, ak) in a.iter_mut().enumerate() {
                    // SAFETY: k * part + i + 16 <= 8 * part <= x.len().
                    *ak = _mm512_add_ps(*ak, unsafe {
                        _mm512_loadu_ps(x.as_ptr().add(k * part + i))
                    });
                }
            }
            a.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        // SAFETY: AVX-512F detected above.
        return unsafe { sum512(x) };
    }
    x.iter().sum()
}

/// Same-run DRAM baseline: the pool's threads sum a 384 MiB buffer in 8 MiB tasks, each read as
/// 8 streams with AVX-512 loads; reported in bytes/s beside the m = 1 GEMVs.
fn memread(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    let floats = (384usize << 20) / 4;
    let buf: Vec<f32> = (0..floats).map(|i| (i % 17) as f32).collect();
    let pool = tandem_kernels::global_pool();
    let chunk = 1usize << 21; // 8 MiB
    let n_chunks = floats / chunk;
    g.throughput(Throughput::Bytes((n_chunks * chunk * 4) as u64));
    g.bench_function("memread 384MiB (DRAM baseline)", |b| {
        b.iter(|| {
            let total = std::sync::atomic::AtomicU32::new(0);
            pool.run(n_chunks, &|c| {
                let s = sum(&buf[c * chunk..(c + 1) * chunk]);
                total.fetch_add(s.to_bits() & 1, std::sync::atomic::Ordering::Relaxed);
            });
            total.into_inner()
        })
    });
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("linear");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1200))
        .sample_size(10);
    memread(&mut g);
    for dtype in [
        WeightDtype::F32,
        WeightDtype::F16,
        WeightDtype::Q8_0,
        WeightDtype::Q4_1,
    ] {
        for (name, cols, rows) in SHAPES {
            let data = seeded(rows * cols, 7);
            let w = Weight::from_f32(rows, cols, data, dtype).unwrap();
            let copies = (384usize << 20).div_ceil(w.size_bytes()).max(1);
            let cold: Vec<Weight> = (0..copies).map(|_| w.clone()).collect();
            for m in [1usize, 4, 16, 32, 512] {
                if m == 512 && rows > 4096 {
                    continue; // the LM head only runs on last tokens
                }
                let x = seeded(m * cols, 9);
                let mut out = vec![0.0f32; m * rows];
                let id = format!("{dtype}/{name}/m{m}");
                if m == 1 {
                    g.throughput(Throughput::Bytes(w.size_bytes() as u64));
                    let mut i = 0;
                    g.bench_function(id, |b| {
                        b.iter(|| {
                            i = (i + 1) % cold.len();
                            linear(&x, m, &cold[i], &mut out)
                        })
                    });
                } else {
                    g.throughput(Throughput::Elements((2 * m * rows * cols) as u64));
                    g.bench_function(id, |b| b.iter(|| linear(&x, m, &w, &mut out)));
                }
            }
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
