//! Quick single-thread efficiency probe on a shared machine: times kernels by *CPU time* of
//! this process (so time stolen by other processes does not count) as well as wall time.
//! `TANDEM_THREADS=1 cargo run --release -p tandem-kernels --example probe -- linear f32 576 3072 512`

use std::time::Instant;
use tandem_kernels::{Weight, WeightDtype, linear};

fn cpu_secs() -> f64 {
    let mut ru: libc_rusage = unsafe { std::mem::zeroed() };
    unsafe { getrusage(0, &mut ru) };
    ru.ru_utime[0] as f64
        + ru.ru_utime[1] as f64 * 1e-6
        + ru.ru_stime[0] as f64
        + ru.ru_stime[1] as f64 * 1e-6
}

#[repr(C)]
#[allow(non_camel_case_types)]
struct libc_rusage {
    ru_utime: [i64; 2],
    ru_stime: [i64; 2],
    rest: [i64; 14],
}
unsafe extern "C" {
    fn getrusage(who: i32, usage: *mut libc_rusage) -> i32;
}

/// Best-of-30 timing of `f` (run `iters` times per trial): (best wall s/iter, mean CPU s/iter).
fn time(iters: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let (mut best, mut cpu) = (f64::MAX, 0.0);
    for _ in 0..30 {
        let (c0, t0) = (cpu_secs(), Instant::now());
        for _ in 0..iters {
            f();
        }
        best = best.min(t0.elapsed().as_secs_f64() / iters as f64);
        cpu += (cpu_secs() - c0) / (30 * iters) as f64;
    }
    (best, cpu)
}

fn attn(a: &[String]) {
    use tandem_kernels::{
        AttnSeq, KvCacheMut, KvCacheRef, KvDtype, KvLayout, paged_attention, write_kv,
    };
    let dtype: KvDtype = a.get(2).map_or("f32", |s| s).parse().unwrap();
    let ctx: usize = a.get(3).map_or(2048, |s| s.parse().unwrap());
    let batch: usize = a.get(4).map_or(16, |s| s.parse().unwrap());
    let q_len: usize = a.get(5).map_or(1, |s| s.parse().unwrap());
    let (heads, kvh, hd, bs) = (9, 3, 64, 16);
    let layout = KvLayout::new(1, kvh, hd, bs, dtype, 0).unwrap();
    let per = ctx.div_ceil(bs);
    let nb = per * batch;
    let mut bytes = vec![0u8; layout.pool_bytes(nb)];
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| (0..per).map(|b| (b * batch + s) as u32).collect())
        .collect();
    for t in &tables {
        let k: Vec<f32> = (0..ctx * kvh * hd)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let slots: Vec<usize> = (0..ctx).map(|p| t[p / bs] as usize * bs + p % bs).collect();
        write_kv(
            &mut KvCacheMut::new(&layout, nb, &mut bytes),
            0,
            &k,
            &k,
            &slots,
        )
        .unwrap();
    }
    let cache = KvCacheRef::new(&layout, nb, &bytes);
    let q: Vec<f32> = (0..batch * q_len * heads * hd)
        .map(|i| ((i * 31) % 100) as f32 * 0.01 - 0.5)
        .collect();
    let mut out = vec![0.0; q.len()];
    let seqs: Vec<AttnSeq<'_>> = (0..batch)
        .map(|s| AttnSeq {
            block_table: &tables[s],
            q_row: s * q_len,
            q_len,
            first_pos: ctx - q_len,
        })
        .collect();
    let t0 = Instant::now();
    paged_attention(&cache, 0, &q, heads, &seqs, 0.125, &mut out).unwrap();
    let iters = ((0.02 / t0.elapsed().as_secs_f64()) as usize).max(1);
    let (best, cpu) = time(iters, || {
        paged_attention(&cache, 0, &q, heads, &seqs, 0.125, &mut out).unwrap()
    });
    let kv = (batch * ctx * kvh * hd * 2 * dtype.elem_bytes()) as f64;
    println!(
        "attn {dtype} ctx={ctx} batch={batch} q_len={q_len}: best {:.1} us ({:.1} GB/s KV), mean CPU {:.1} us",
        best * 1e6,
        kv / best / 1e9,
        cpu * 1e6
    );
}

/// m = 1 over weights not in cache: cycles through copies totalling >= 400 MB.
fn gemv(a: &[String]) {
    let dtype: WeightDtype = a.get(2).map_or("f32", |s| s).parse().unwrap();
    let cols: usize = a.get(3).map_or(576, |s| s.parse().unwrap());
    let rows: usize = a.get(4).map_or(3072, |s| s.parse().unwrap());
    let w = Weight::from_f32(
        rows,
        cols,
        (0..rows * cols).map(|i| (i % 7) as f32 * 0.01).collect(),
        dtype,
    )
    .unwrap();
    let copies: Vec<Weight> = (0..(400usize << 20).div_ceil(w.size_bytes()))
        .map(|_| w.clone())
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut out = vec![0.0; rows];
    let mut i = 0;
    let (best, cpu) = time(copies.len(), || {
        i = (i + 1) % copies.len();
        linear(&x, 1, &copies[i], &mut out)
    });
    let gb = w.size_bytes() as f64 / 1e9;
    println!(
        "gemv {dtype} {cols}->{rows}: best {:.1} GB/s, mean CPU-time {:.1} GB/s per busy thread-second",
        gb / best,
        gb / cpu
    );
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.get(1).map(String::as_str) == Some("attn") {
        return attn(&a);
    }
    if a.get(1).map(String::as_str) == Some("gemv") {
        return gemv(&a);
    }
    let dtype: WeightDtype = a.get(2).map_or("f32", |s| s).parse().unwrap();
    let cols: usize = a.get(3).map_or(576, |s| s.parse().unwrap());
    let rows: usize = a.get(4).map_or(3072, |s| s.parse().unwrap());
    let m: usize = a.get(5).map_or(512, |s| s.parse().unwrap());
    let w = Weight::from_f32(
        rows,
        cols,
        (0..rows * cols).map(|i| (i % 7) as f32 * 0.01).collect(),
        dtype,
    )
    .unwrap();
    let x: Vec<f32> = (0..m * cols).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut out = vec![0.0; m * rows];
    let flops = 2.0 * (m * rows * cols) as f64;
    let iters = ((1e9 / flops) as usize).max(1);
    linear(&x, m, &w, &mut out);
    let mut best = 0.0f64;
    let mut total_cpu = 0.0;
    let mut total_wall = 0.0;
    for _ in 0..30 {
        let (c0, t0) = (cpu_secs(), Instant::now());
        for _ in 0..iters {
            linear(&x, m, &w, &mut out);
        }
        let wall = t0.elapsed().as_secs_f64();
        total_cpu += cpu_secs() - c0;
        total_wall += wall;
        best = best.max(flops * iters as f64 / wall / 1e9);
    }
    println!(
        "{dtype} {cols}->{rows} m={m}: best {best:.1} GFLOP/s wall, mean {:.1} per CPU-second, {:.1} wall",
        flops * 30.0 * iters as f64 / total_cpu / 1e9,
        flops * 30.0 * iters as f64 / total_wall / 1e9
    );
}
