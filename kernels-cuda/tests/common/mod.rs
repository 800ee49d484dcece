//! Helpers shared by the test binaries.
#![allow(dead_code)]

use std::path::PathBuf;

/// A fresh, empty directory under the system temp dir, unique to this process and `tag`.
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tandem-kernels-cuda-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Seeded splitmix64: reproducible inputs without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Roughly normal, standard deviation about `sd`.
    pub fn normal(&mut self, sd: f32) -> f32 {
        ((0..4).map(|_| self.unit()).sum::<f32>() - 2.0) * sd * 1.73
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// A random permutation of 0..n.
    pub fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            v.swap(i, self.below(i + 1));
        }
        v
    }
}

/// Rows of `vocab` logits, each with the spec it is sampled with (`sample.cu` against
/// tandem-kernels `sample`): flat and peaked rows, many ties, all equal, NaN / ±inf / ±0.0,
/// one finite value, none, all NaN, a zero maximum of both signs; every temperature from 0 to
/// 1e4, top-k from none to past the row, top-p from 1 to 1e-4, the lowest and highest draws.
/// 10 rows × 12 specs.
pub fn sample_cases(vocab: usize, rng: &mut Rng) -> Vec<(Vec<f32>, tandem_kernels::sample::SampleSpec)> {
    use tandem_kernels::sample::{DRAW_BITS, SampleSpec};
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for sd in [0.5f32, 3.0, 10.0] {
        rows.push((0..vocab).map(|_| rng.normal(sd)).collect());
    }
    rows.push((0..vocab).map(|_| (rng.normal(2.0) * 2.0).round() / 2.0).collect());
    rows.push(vec![1.25; vocab]);
    rows.push(
        (0..vocab)
            .map(|i| match i % 7 {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 if i % 3 == 0 => f32::INFINITY,
                3 => -0.0,
                4 => 0.0,
                _ => rng.normal(1.0),
            })
            .collect(),
    );
    let mut one = vec![f32::NEG_INFINITY; vocab];
    one[vocab / 2] = -3.0;
    rows.push(one);
    rows.push((0..vocab).map(|i| if i % 2 == 0 { f32::NEG_INFINITY } else { f32::NAN }).collect());
    rows.push(vec![f32::NAN; vocab]);
    let mut zeros: Vec<f32> = (0..vocab).map(|_| -1.0 - rng.unit()).collect();
    zeros[3] = -0.0;
    zeros[1] = 0.0;
    rows.push(zeros);

    // -1 and 0 top-p are refused by request validation; both sides still agree on them.
    let temps = [0.0f32, 1e-4, 0.3, 0.7, 1.0, 1.5, 1e4, -1.0];
    let top_ks = [0u32, 1, 2, 5, 50, vocab as u32 + 1];
    let top_ps = [1.0f32, 0.95, 0.5, 1e-4, 0.0];
    let mut out = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        for j in 0..12 {
            let draw = match j {
                0 => 0,
                1 => (1u64 << DRAW_BITS) - 1,
                _ => rng.next_u64() >> (64 - DRAW_BITS),
            };
            let spec = SampleSpec {
                temperature: temps[(r + j) % temps.len()],
                top_k: if j % 3 == 0 { top_ks[(r + j / 3) % top_ks.len()] } else { 0 },
                top_p: top_ps[(r * 5 + j) % top_ps.len()],
                draw,
            };
            out.push((row.clone(), spec));
        }
    }
    out
}
