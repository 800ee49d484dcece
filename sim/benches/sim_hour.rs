//! How fast the simulation runs: simulated seconds of the default 1,000-GPU cluster (seed
//! model, TP 8, 70 % load, Poisson) per wall second. `tandem sim` prints the wall time of a
//! whole simulated hour beside its results; this measures a simulated 5 minutes, repeatedly.

use criterion::{Criterion, criterion_group, criterion_main};
use tandem_sim::{Arrivals, Gpu, Lengths, Mode, ModelShape, Roofline, Sim, SimConfig};

fn config(duration_s: f64) -> SimConfig {
    let mut c = SimConfig {
        gpus: 1000,
        roofline: Roofline { model: ModelShape::seed_70b(), gpu: Gpu::h200(), tp: 8 },
        duration_s,
        arrivals: Arrivals::Poisson { rate: 1.0 },
        lengths: Lengths { prompt: 1792, output: 256, spread: 0.5 },
        seed: 1,
        mode: Mode::Colocated,
        max_batch: 256,
        max_tokens_per_step: 8192,
        ttft_slo_s: 1.0,
        tpot_slo_s: 0.05,
        planner: None,
        warmup_s: 120.0,
        gpu_hour_usd: 3.5,
        sample_s: 60.0,
        measured: None,
    };
    c.arrivals = Arrivals::Poisson { rate: 0.7 * c.capacity_rps() };
    c.mode = Mode::Disaggregated { prefill: c.balanced_prefill_instances() };
    c
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("sim");
    g.sample_size(10);
    g.bench_function("disaggregated_1000_gpus_300_simulated_s", |b| {
        b.iter(|| Sim::new(config(300.0)).run())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
