//! Scalar implementations that *define* the canonical operation order of every kernel.
//!
//! The SIMD paths must reproduce these bit for bit; the tests check that they do. The building
//! blocks:
//!
//! - **16-lane reduction** ([`dot`], [`sum`], [`sum_sq`]): element `i` goes to lane `i % 16`;
//!   each lane accumulates its elements in ascending order (fused multiply-add for products,
//!   starting from +0.0); short tails are padded with zeros that are still *operated on*
//!   (`fma(0, 0, acc)`), exactly as a masked vector load would; the 16 lanes are then summed by
//!   the fixed tree [`tree16`]: `l[i] + l[i+8]`, then `+ [i+4]`, then `+ [i+2]`, then `+ [i+1]`.
//! - **GEMM chains** ([`linear_panel`]): output `(i, j)` is `acc = fma(x[i][k], w[j][k], acc)`
//!   for `k = 0, 1, .., cols-1` from `acc = +0.0`: one chain per output, vectorised across `j`.
//! - **[`exp`]**: a Cephes-style range reduction and degree-5 polynomial from fused
//!   multiply-adds, with x86 `min`/`max` semantics for the clamps.
//!
//! Costs: without hardware FMA in the baseline target, `f32::mul_add` is a libm call; this path
//! is for correctness and portability, not speed.

use crate::weight::{PANEL_ROWS, Weight, load_elem};

/// Lanes of the canonical reduction layout.
pub(crate) const LANES: usize = 16;

/// The canonical 16 → 1 reduction tree.
#[inline]
pub(crate) fn tree16(l: &[f32; LANES]) -> f32 {
    let mut s8 = [0.0f32; 8];
    for i in 0..8 {
        s8[i] = l[i] + l[i + 8];
    }
    let s4 = [s8[0] + s8[4], s8[1] + s8[5], s8[2] + s8[6], s8[3] + s8[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// `maxps(a, b)`: `a > b ? a : b` (returns `b` when either is NaN), as x86 does.
#[inline]
pub(crate) fn x86_max(a: f32, b: f32) -> f32 {
    if a > b { a } else { b }
}

/// `minps(a, b)`: `a < b ? a : b` (returns `b` when either is NaN), as x86 does.
#[inline]
pub(crate) fn x86_min(a: f32, b: f32) -> f32 {
    if a < b { a } else { b }
}

pub(crate) const EXP_LO: f32 = -87.0;
pub(crate) const EXP_HI: f32 = 88.0;
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
pub(crate) const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// Canonical `e^x` (≈1 ulp on `[-87, 88]`; 0 below -87; `e^88` above 88).
#[inline]
pub(crate) fn exp(x: f32) -> f32 {
    let xc = x86_min(x86_max(x, EXP_LO), EXP_HI);
    let n = (xc * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, xc);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_P[0];
    for c in &EXP_P[1..] {
        p = p.mul_add(r, *c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    let pow2 = f32::from_bits(((n as i32 + 127) as u32) << 23);
    let e = y * pow2;
    if x < EXP_LO { 0.0 } else { e }
}

/// Canonical dot product of two equal-length slices.
pub(crate) fn dot(a: &[f32], b: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    for c in 0..a.len().div_ceil(LANES) {
        for (l, lane) in acc.iter_mut().enumerate() {
            let i = c * LANES + l;
            let (x, y) = if i < a.len() {
                (a[i], b(i))
            } else {
                (0.0, 0.0)
            };
            *lane = x.mul_add(y, *lane);
        }
    }
    tree16(&acc)
}

/// Canonical sum of squares.
pub(crate) fn sum_sq(x: &[f32]) -> f32 {
    dot(x, |i| x[i])
}

/// Canonical sum (plain adds per lane).
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for c in 0..x.len().div_ceil(LANES) {
        for (l, lane) in acc.iter_mut().enumerate() {
            let i = c * LANES + l;
            *lane += if i < x.len() { x[i] } else { 0.0 };
        }
    }
    tree16(&acc)
}

/// One RMSNorm row: `out = (x * (1 / sqrt(sum_sq / n + eps))) * w`.
pub(crate) fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = rms_inv(sum_sq(x), x.len(), eps);
    for i in 0..x.len() {
        out[i] = (x[i] * inv) * w[i];
    }
}

/// The canonical RMS scale from a canonical sum of squares.
#[inline]
pub(crate) fn rms_inv(sum_sq: f32, n: usize, eps: f32) -> f32 {
    1.0 / (sum_sq / n as f32 + eps).sqrt()
}

/// Rotate-half RoPE of one head in place: `(a, b) -> (a*c - b*s, b*c + a*s)`, unfused.
pub(crate) fn rope_head(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

/// `out = silu(g) * u` with `silu(g) = g / (1 + exp(-g))`.
pub(crate) fn silu_mul_row(g: &[f32], u: &[f32], out: &mut [f32]) {
    for i in 0..g.len() {
        out[i] = (g[i] / (1.0 + exp(-g[i]))) * u[i];
    }
}

/// `a += b`.
pub(crate) fn add(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += *y;
    }
}

/// Index of the first maximum; NaN never wins (all-NaN or empty → 0).
pub(crate) fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    let mut seen = false;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v || (!seen && !v.is_nan()) {
            best = i;
            best_v = v;
            seen = true;
        }
    }
    best
}

/// `out[i * ldo + j]` for rows `i < m` and features `j` of panels `p0..p1`.
///
/// # Safety
/// `out` is valid for writes of `m * rows` floats; no other thread writes these panels' features.
pub(crate) unsafe fn linear_panels(
    x: &[f32],
    m: usize,
    w: &Weight,
    out: *mut f32,
    p0: usize,
    p1: usize,
) {
    let (cols, esz, bytes) = (w.cols(), w.dtype().elem_bytes(), w.packed());
    for p in p0..p1 {
        let base = p * cols * PANEL_ROWS;
        // SAFETY: as this function's contract.
        unsafe {
            panel_chains(x, m, w, out, p, |k, r| {
                load_elem(w.dtype(), bytes, (base + k * PANEL_ROWS + r) * esz)
            })
        };
    }
}

/// One panel's outputs for rows `i < m`: lane `r`'s chain `acc = fma(x[i][k], weight(k, r), acc)`
/// over `k` ascending, stored where the feature exists (`< rows`).
///
/// # Safety
/// As [`linear_panels`], for panel `p`.
unsafe fn panel_chains(
    x: &[f32],
    m: usize,
    w: &Weight,
    out: *mut f32,
    p: usize,
    weight: impl Fn(usize, usize) -> f32,
) {
    let (cols, rows) = (w.cols(), w.rows());
    let mut acc = [0.0f32; PANEL_ROWS];
    for i in 0..m {
        acc.fill(0.0);
        for (k, &xk) in x[i * cols..(i + 1) * cols].iter().enumerate() {
            for (r, a) in acc.iter_mut().enumerate() {
                *a = xk.mul_add(weight(k, r), *a);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let j = p * PANEL_ROWS + r;
            if j < rows {
                // SAFETY: in bounds (i < m, j < rows); exclusive per the contract.
                unsafe { *out.add(i * rows + j) = *a };
            }
        }
    }
}

/// KV element decoders for the attention loops: `f(bytes, elem_index) -> f32`, exact.
pub(crate) type KvLoad = fn(&[u8], usize) -> f32;

pub(crate) fn kv_load_f32(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}
pub(crate) fn kv_load_f16(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes(
        b[2 * i..2 * i + 2].try_into().expect("2 bytes"),
    ))
    .to_f32()
}
pub(crate) fn kv_load_bf16(b: &[u8], i: usize) -> f32 {
    half::bf16::from_bits(u16::from_le_bytes(
        b[2 * i..2 * i + 2].try_into().expect("2 bytes"),
    ))
    .to_f32()
}
pub(crate) fn kv_load_i8(b: &[u8], i: usize) -> f32 {
    b[i] as i8 as f32
}

/// Attention scores of one query row against `n` tokens of one head tile:
/// `s[t] = dot(q, k_t) * mul` (float KV) or `(dot(q, k_t) * kscale) * mul` (Int8, `Some`).
pub(crate) fn scores(
    q: &[f32],
    tile: &[u8],
    load: KvLoad,
    n: usize,
    kscale: Option<f32>,
    mul: f32,
    s: &mut [f32],
) {
    let hd = q.len();
    for (t, st) in s.iter_mut().enumerate().take(n) {
        let d = dot(q, |i| load(tile, t * hd + i));
        *st = match kscale {
            Some(ks) => (d * ks) * mul,
            None => d * mul,
        };
    }
}

/// In-place softmax numerator over one row's scores; returns the canonical sum of the weights.
/// `s[t] = exp(s[t] - max)`.
pub(crate) fn softmax_weights(s: &mut [f32]) -> f32 {
    let mut m = f32::NEG_INFINITY;
    for &v in s.iter() {
        m = x86_max(v, m);
    }
    for v in s.iter_mut() {
        *v = exp(*v - m);
    }
    sum(s)
}

/// `acc[r][d] = fma(w_r(t), v_t[d], acc[r][d])` over the tokens `t` of `tiles` in order, `d`
/// in `dims` (`acc[r]` holds just those dims), rows `r` of `e` (each `e[r][t]`), where
/// `w_r(t) = e[r][t]` (float KV) or `e[r][t] * vscale[i * n + t]` (Int8: the token's value scale).
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate_v(
    e: &[&[f32]],
    tiles: &[&[u8]],
    n: usize,
    scales: &[f32],
    load: KvLoad,
    hd: usize,
    dims: std::ops::Range<usize>,
    acc: &mut [&mut [f32]],
) {
    for (i, tile) in tiles.iter().enumerate() {
        for t in 0..n {
            for (er, ar) in e.iter().zip(acc.iter_mut()) {
                let et = er[i * n + t];
                let w = if scales.is_empty() {
                    et
                } else {
                    et * scales[i * n + t]
                };
                for d in dims.clone() {
                    ar[d - dims.start] = w.mul_add(load(tile, t * hd + d), ar[d - dims.start]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm_on_the_softmax_range() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), (x as f64).exp());
            let rel = ((got as f64 - want) / want).abs();
            assert!(rel < 2.5e-7, "exp({x}) = {got}, libm {want}, rel {rel}");
            x += 0.173;
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(100.0).is_finite());
    }

    #[test]
    fn tree16_adds_lane_i_to_lane_i_plus_8_first() {
        // 1e8 + 1 - 1e8 differs by association: lanes 0 and 8 meet first.
        let mut l = [0.0f32; 16];
        l[0] = 1e8;
        l[8] = -1e8;
        l[1] = 1.0;
        assert_eq!(tree16(&l), 1.0);
    }

    #[test]
    fn argmax_prefers_the_lowest_index_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -5.0, f32::NAN, -1.0]), 3);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[]), 0);
    }
}

/// [`linear_panels`] for a quantized weight: each panel decoded to its exact f32 values
/// ([`crate::quant::dequant_panel`]), then the same chains.
///
/// # Safety
/// As [`linear_panels`].
pub(crate) unsafe fn linear_panels_quant(
    x: &[f32],
    m: usize,
    w: &Weight,
    out: *mut f32,
    p0: usize,
    p1: usize,
) {
    let cols = w.cols();
    let mut panel = vec![0f32; cols * PANEL_ROWS];
    for p in p0..p1 {
        crate::quant::dequant_panel(w.dtype(), w.packed(), cols, p, &mut panel);
        // SAFETY: as this function's contract.
        unsafe { panel_chains(x, m, w, out, p, |k, r| panel[k * PANEL_ROWS + r]) };
    }
}
