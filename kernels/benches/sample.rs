//! One sampled token from a row of SmolLM2's 49,152 logits: `sample::sample` (integer weights,
//! the definition the GPU repeats) beside two baselines in the same run: `argmax` (greedy, the
//! floor) and the textbook host sampler (f64 softmax over the candidates sorted by logit, then
//! the cumulative walk: what tandem's sampler did before the definition changed).
//!
//! Run: `cargo bench -p tandem-kernels --bench sample`.

use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::Duration;
use tandem_kernels::sample::{SampleSpec, sample};

/// The textbook sampler: f64 softmax of the finite logits sorted by (logit desc, index asc),
/// top-k, top-p by the cumulative probability, then the draw's cumulative walk.
fn softmax_sort_sample(logits: &[f32], t: f32, top_k: usize, top_p: f32, u: f64) -> usize {
    let mut idx: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    let by = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if top_k > 0 && top_k < idx.len() {
        idx.select_nth_unstable_by(top_k - 1, by);
        idx.truncate(top_k);
    }
    idx.sort_unstable_by(by);
    let max = logits[idx[0] as usize] as f64;
    let mut p: Vec<f64> = idx
        .iter()
        .map(|&i| ((logits[i as usize] as f64 - max) / t as f64).exp())
        .collect();
    let total: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= total);
    let mut keep = p.len();
    if top_p < 1.0 {
        let mut acc = 0.0;
        for (n, x) in p.iter().enumerate() {
            acc += x;
            if acc >= top_p as f64 {
                keep = n + 1;
                break;
            }
        }
    }
    let total: f64 = p[..keep].iter().sum();
    let mut acc = 0.0;
    for n in 0..keep {
        acc += p[n] / total;
        if u < acc {
            return idx[n] as usize;
        }
    }
    idx[keep - 1] as usize
}

fn bench(c: &mut Criterion) {
    let vocab = 49_152;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    // Roughly normal logits, sd ~3 (an LM head's spread).
    let row: Vec<f32> = (0..vocab)
        .map(|_| {
            ((0..4)
                .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32)
                .sum::<f32>()
                - 2.0)
                * 5.2
        })
        .collect();
    let mut g = c.benchmark_group("sample 49152");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1500));
    g.bench_function("argmax (greedy)", |b| {
        b.iter(|| tandem_kernels::argmax(black_box(&row)))
    });
    for (name, t, k, p) in [
        ("T 0.8 top-p 0.95", 0.8f32, 0u32, 0.95f32),
        ("T 1.0", 1.0, 0, 1.0),
        ("T 0.7 top-k 40", 0.7, 40, 1.0),
    ] {
        let spec = SampleSpec {
            temperature: t,
            top_k: k,
            top_p: p,
            draw: 0x0012_3456_789A_BCDE,
        };
        g.bench_function(format!("sample {name}"), |b| {
            b.iter(|| sample(black_box(&row), &spec))
        });
        g.bench_function(format!("softmax+sort {name}"), |b| {
            b.iter(|| softmax_sort_sample(black_box(&row), t, k as usize, p, 0.3))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
