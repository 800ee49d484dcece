//! Quick single-thread efficiency probe on a shared machine: times kernels by *CPU time* of
//! this process (so time stolen by other processes does not count) as well as wall time.
//! `TANDEM_THREADS=1 cargo run --release -p tandem-kernels --example probe -- linear f32 576 3072 512`

use std::time::Instant;
use tandem_kernels::{Weight, WeightDtype, linear};

fn cpu_secs() -> f64 {
    let mut ru: libc_rusage = unsafe { std::mem::zeroed() };
    unsafe { getrusage(0, &mut ru) };
    ru.ru_utime[0] as f64 + ru.ru_utime[1] as f64 * 1e-6 + ru.ru_stime[0] as f64 + ru.ru_stime[1] as f64 * 1e-6
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

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let dtype: WeightDtype = a.get(2).map_or("f32", |s| s).parse().unwrap();
    let cols: usize = a.get(3).map_or(576, |s| s.parse().unwrap());
    let rows: usize = a.get(4).map_or(3072, |s| s.parse().unwrap());
    let m: usize = a.get(5).map_or(512, |s| s.parse().unwrap());
    let w = Weight::from_f32(rows, cols, (0..rows * cols).map(|i| (i % 7) as f32 * 0.01).collect(), dtype).unwrap();
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
