//! `sample.cu` (sampling on the device) picks exactly the token tandem-kernels `sample::sample`
//! picks on the CPU. Here the kernel runs as host C++ (`g++`, which scripts/setup.sh installs):
//! each thread of a block is a thread, `__syncthreads` a barrier, shared memory static storage,
//! the atomics the compiler's. Rows cover what the selection can get wrong: ties at every cut,
//! NaN and ±inf, +0.0 and -0.0, flat and peaked rows, the smallest and largest temperatures,
//! top-k and top-p at their edges, the lowest and highest draws, and block sizes below, between
//! and above the histogram's 256 buckets. The GPU test (`tests/gpu.rs`) runs the same source on
//! the device against the same reference.

use std::process::Command;

use crate::common;

use common::{Rng, sample_cases};
use tandem_kernels::sample::{SampleSpec, sample};
use tandem_kernels_cuda::SAMPLE_SOURCE;

/// What the CUDA source expects around it: its prelude's types and the CUDA built-ins it uses.
const PRELUDE: &str = r#"
#include <pthread.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
struct Dim3 { unsigned x, y, z; };
static thread_local Dim3 threadIdx;
static Dim3 blockIdx, blockDim;
static pthread_barrier_t tandem_barrier;
#define __syncthreads() pthread_barrier_wait(&tandem_barrier)
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline u32 __float_as_uint(float f) { u32 u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
static inline double __longlong_as_double(long long x) { double d; memcpy(&d, &x, 8); return d; }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline u32 atomicAdd(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline u32 atomicMax(u32* p, u32 v) {
    u32 o = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (o < v && !__atomic_compare_exchange_n(p, &o, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return o;
}
static inline u32 atomicMin(u32* p, u32 v) {
    u32 o = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (o > v && !__atomic_compare_exchange_n(p, &o, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return o;
}
"#;

/// Runs each row as one block of `argv[2]` threads over the rows in `argv[1]`; or, given
/// `weights`, the weight of each logit distance on stdin.
const DRIVER: &str = r#"
struct Launch { const float* logits; const SampleRow* specs; int vocab; int shift; int* out; unsigned tid; };
static void* run_thread(void* arg) {
    Launch* l = (Launch*)arg;
    threadIdx.x = l->tid;
    sample_rows(l->logits, l->specs, l->vocab, l->shift, l->out);
    return nullptr;
}
int main(int argc, char** argv) {
    if (strcmp(argv[1], "weights") == 0) {
        // Lines of "shift d-as-hex-bits": the weight of each.
        int shift;
        unsigned long long bits;
        while (scanf("%d %llx", &shift, &bits) == 2) {
            printf("%llu\n", tandem_sample_weight(__longlong_as_double((long long)bits), shift));
        }
        return 0;
    }
    FILE* f = fopen(argv[1], "rb");
    if (!f) return 2;
    unsigned threads = (unsigned)atoi(argv[2]);
    int rows, vocab, shift;
    if (fread(&rows, 4, 1, f) != 1 || fread(&vocab, 4, 1, f) != 1 || fread(&shift, 4, 1, f) != 1) return 3;
    float* logits = (float*)malloc(sizeof(float) * (size_t)rows * vocab);
    SampleRow* specs = (SampleRow*)malloc(sizeof(SampleRow) * rows);
    if (fread(logits, sizeof(float), (size_t)rows * vocab, f) != (size_t)rows * vocab) return 4;
    if (fread(specs, sizeof(SampleRow), rows, f) != (size_t)rows) return 5;
    int* out = (int*)malloc(sizeof(int) * rows);
    blockDim.x = threads;
    Launch* ls = (Launch*)malloc(sizeof(Launch) * threads);
    pthread_t* ts = (pthread_t*)malloc(sizeof(pthread_t) * threads);
    for (int r = 0; r < rows; ++r) {
        blockIdx.x = (unsigned)r;
        pthread_barrier_init(&tandem_barrier, nullptr, threads);
        for (unsigned t = 0; t < threads; ++t) {
            ls[t] = Launch{logits, specs, vocab, shift, out, t};
            if (pthread_create(&ts[t], nullptr, run_thread, &ls[t]) != 0) return 6;
        }
        for (unsigned t = 0; t < threads; ++t) pthread_join(ts[t], nullptr);
        pthread_barrier_destroy(&tandem_barrier);
        printf("%d\n", out[r]);
    }
    return 0;
}
"#;

/// The kernel and [`DRIVER`] compiled as host C++ in a fresh directory for `tag`: (dir, exe).
fn compile(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = common::temp_dir(tag);
    let src = dir.join("sample_check.cpp");
    let exe = dir.join("sample_check");
    std::fs::write(&src, format!("{PRELUDE}\n{SAMPLE_SOURCE}\n{DRIVER}")).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let out = Command::new(&cxx)
        .args(["-x", "c++", "-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Werror", "-pthread", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("`{cxx}` (g++, which scripts/setup.sh installs) did not run: {e}"));
    assert!(out.status.success(), "sample.cu does not compile as host C++:\n{}", String::from_utf8_lossy(&out.stderr));
    (dir, exe)
}

fn run(exe: &std::path::Path, dir: &std::path::Path, vocab: usize, cases: &[(Vec<f32>, SampleSpec)], threads: u32) -> Vec<usize> {
    let mut bytes = Vec::new();
    let shift = tandem_kernels::sample::weight_shift(vocab);
    for v in [cases.len() as u32, vocab as u32, shift] {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    for (row, _) in cases {
        row.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
    }
    for (_, s) in cases {
        bytes.extend_from_slice(&s.temperature.to_le_bytes());
        bytes.extend_from_slice(&s.top_p.to_le_bytes());
        bytes.extend_from_slice(&s.top_k.to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&s.draw.to_le_bytes());
    }
    let input = dir.join(format!("rows-{vocab}-{threads}.bin"));
    std::fs::write(&input, bytes).unwrap();
    let out = Command::new(exe).arg(&input).arg(threads.to_string()).output().unwrap();
    assert!(out.status.success(), "the emulated kernel failed: {out:?}");
    String::from_utf8(out.stdout).unwrap().lines().map(|l| l.parse().unwrap()).collect()
}

#[test]
fn the_device_weight_is_the_cpus_bit_for_bit() {
    let (dir, exe) = compile("sample-weight");
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut ds: Vec<(u32, f64)> = Vec::new();
    for shift in [32u32, 45, 46, 61] {
        ds.extend([0.0, -0.0, -1e-300, -0.5, -1.0, -2.0 * std::f64::consts::LN_2].map(|d| (shift, d)));
        // The cut-off at -(shift + 2) ln 2, and either side of it.
        let cut = -((shift + 2) as f64) * std::f64::consts::LN_2;
        ds.extend([cut, f64::from_bits(cut.to_bits() - 1), f64::from_bits(cut.to_bits() + 1)].map(|d| (shift, d)));
        ds.extend((0..2000).map(|_| (shift, -(rng.unit() as f64) * 48.0 - rng.unit() as f64 * 1e-7)));
    }
    let input: String = ds.iter().map(|(s, d)| format!("{s} {:x}\n", d.to_bits())).collect();
    let mut child = Command::new(&exe)
        .arg("weights")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let got: Vec<u64> = String::from_utf8(out.stdout).unwrap().lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(got.len(), ds.len());
    for ((shift, d), g) in ds.iter().zip(got) {
        assert_eq!(g, tandem_kernels::sample::weight(*d, *shift), "d {d:e}, shift {shift}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_device_sampler_picks_the_cpu_samplers_token_on_every_row_spec_and_block_size() {
    let (dir, exe) = compile("sample-host");
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut checked = 0;
    for (vocab, threads) in [(7usize, 32u32), (1000, 96), (3001, 300), (49_152, 512)] {
        let cases = sample_cases(vocab, &mut rng);
        let got = run(&exe, &dir, vocab, &cases, threads);
        assert_eq!(got.len(), cases.len());
        for (n, ((row, spec), &g)) in cases.iter().zip(&got).enumerate() {
            let want = sample(row, spec);
            assert_eq!(g, want, "vocab {vocab}, {threads} threads, case {n}: {spec:?}");
            checked += 1;
        }
    }
    assert_eq!(checked, 4 * 10 * 12);
    let _ = std::fs::remove_dir_all(&dir);
}
