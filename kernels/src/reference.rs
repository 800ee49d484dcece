//! Plain scalar oracles for every kernel: the obvious loops, in f64 where it helps, with none of
//! the fast paths' layout or ordering tricks. Tests compare the fast kernels against these with
//! tolerances (the oracles sum in a different order and precision, so bits differ); they are
//! also a readable statement of what each kernel computes. Slow by design.

use crate::kv::{KvCacheRef, KvPart, read_kv};
use crate::{AttnSeq, Weight};

/// `out[i][j] = Σ_k x[i][k] * W[j][k]`, accumulated in f64.
pub fn linear(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    let mut wr = vec![0.0f32; cols];
    for j in 0..rows {
        w.row_to_f32(j, &mut wr);
        for i in 0..m {
            let s: f64 = (0..cols)
                .map(|k| x[i * cols + k] as f64 * wr[k] as f64)
                .sum();
            out[i * rows + j] = s as f32;
        }
    }
}

/// Row-wise RMSNorm in f64.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (xr, or) in x.chunks(n).zip(out.chunks_mut(n)) {
        let ms: f64 = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for i in 0..n {
            or[i] = (xr[i] as f64 * inv * weight[i] as f64) as f32;
        }
    }
}

/// Rotate-half RoPE with angles computed here in f64 (independent of `RopeTable`).
pub fn rope(x: &mut [f32], n_heads: usize, head_dim: usize, positions: &[usize], theta: f64) {
    let half = head_dim / 2;
    for (t, &p) in positions.iter().enumerate() {
        for h in 0..n_heads {
            let base = (t * n_heads + h) * head_dim;
            for i in 0..half {
                let ang = p as f64 * theta.powf(-((2 * i) as f64) / head_dim as f64);
                let (a, b) = (x[base + i] as f64, x[base + i + half] as f64);
                x[base + i] = (a * ang.cos() - b * ang.sin()) as f32;
                x[base + i + half] = (b * ang.cos() + a * ang.sin()) as f32;
            }
        }
    }
}

/// `out = silu(gate) * up` in f64.
pub fn silu_mul(gate_up: &[f32], m: usize, inter: usize, out: &mut [f32]) {
    for i in 0..m {
        for d in 0..inter {
            let g = gate_up[i * 2 * inter + d] as f64;
            let u = gate_up[i * 2 * inter + inter + d] as f64;
            out[i * inter + d] = (g / (1.0 + (-g).exp()) * u) as f32;
        }
    }
}

/// Causal attention over KV gathered with [`read_kv`] into contiguous copies, softmax in f64.
pub fn paged_attention(
    cache: &KvCacheRef<'_>,
    layer: usize,
    q: &[f32],
    n_heads: usize,
    seqs: &[AttnSeq<'_>],
    scale: f32,
    out: &mut [f32],
) {
    let l = cache.layout;
    let (hd, bs) = (l.head_dim, l.block_size_tokens);
    let group = n_heads / l.num_kv_heads;
    let mut kv = vec![0.0f32; hd];
    for s in seqs {
        for j in 0..s.q_len {
            let p = s.first_pos + j;
            for h in 0..n_heads {
                let g = h / group;
                let qa = (s.q_row + j) * n_heads * hd + h * hd;
                let qh = &q[qa..qa + hd];
                let mut scores = Vec::with_capacity(p + 1);
                for t in 0..=p {
                    let block = s.block_table[t / bs] as usize;
                    read_kv(cache, layer, block, t % bs, g, KvPart::K, &mut kv);
                    let d: f64 = qh.iter().zip(&kv).map(|(&a, &b)| a as f64 * b as f64).sum();
                    scores.push(d * scale as f64);
                }
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                let mut acc = vec![0.0f64; hd];
                for (t, &et) in e.iter().enumerate() {
                    let block = s.block_table[t / bs] as usize;
                    read_kv(cache, layer, block, t % bs, g, KvPart::V, &mut kv);
                    for d in 0..hd {
                        acc[d] += et * kv[d] as f64;
                    }
                }
                for d in 0..hd {
                    out[qa + d] = (acc[d] / sum) as f32;
                }
            }
        }
    }
}
