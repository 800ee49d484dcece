//! AVX2 + FMA + F16C row kernels and attention inner loops.
//!
//! A canonical 16-lane accumulator is a pair of 8-lane vectors `(lanes 0-7, lanes 8-15)`, so
//! the first step of the canonical tree (`l[i] + l[i+8]`) is one vector add; everything else
//! mirrors the AVX-512 and portable versions bit for bit. Tails go through zeroed buffers.

use super::VTiles;
use super::avx2_gemm::load8;
use super::avx512::DT_I8;
use super::avx512_gemm::{DT_BF16, DT_F16, DT_F32};
use super::portable::{EXP_HI, EXP_LO, EXP_P, LN2_HI, LN2_LO, LOG2E};
use std::arch::x86_64::*;

/// 8 KV elements of dtype `DT` at element `elem`, widened to f32 (exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn kv8<const DT: u8>(p: *const u8, elem: usize) -> __m256 {
    unsafe {
        match DT {
            DT_I8 => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(elem).cast()))),
            _ => load8::<DT>(p, elem),
        }
    }
}

const fn esize(dt: u8) -> usize {
    match dt {
        DT_F32 => 4,
        DT_F16 | DT_BF16 => 2,
        _ => 1,
    }
}

/// 16 KV elements as two halves, `n <= 16` of them real, the rest +0.0.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn kv16<const DT: u8>(p: *const u8, elem: usize, n: usize) -> (__m256, __m256) {
    unsafe {
        if n >= 16 {
            (kv8::<DT>(p, elem), kv8::<DT>(p, elem + 8))
        } else {
            let mut tmp = [0u8; 64];
            std::ptr::copy_nonoverlapping(p.add(elem * esize(DT)), tmp.as_mut_ptr(), n * esize(DT));
            (kv8::<DT>(tmp.as_ptr(), 0), kv8::<DT>(tmp.as_ptr(), 8))
        }
    }
}

/// 16 floats of `x` from `c` (zero-padded past the end) as two halves.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn ld16(x: &[f32], c: usize) -> (__m256, __m256) {
    let n = x.len() - c;
    // SAFETY: full loads only when 16 elements remain; otherwise via a padded copy.
    unsafe {
        if n >= 16 {
            (
                _mm256_loadu_ps(x.as_ptr().add(c)),
                _mm256_loadu_ps(x.as_ptr().add(c + 8)),
            )
        } else {
            let mut tmp = [0.0f32; 16];
            tmp[..n].copy_from_slice(&x[c..]);
            (
                _mm256_loadu_ps(tmp.as_ptr()),
                _mm256_loadu_ps(tmp.as_ptr().add(8)),
            )
        }
    }
}

/// Stores the first `min(16, out.len() - c)` lanes of `(lo, hi)` at `out[c..]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn st16(out: &mut [f32], c: usize, lo: __m256, hi: __m256) {
    let n = out.len() - c;
    // SAFETY: full stores only when 16 elements remain; otherwise via a buffer.
    unsafe {
        if n >= 16 {
            _mm256_storeu_ps(out.as_mut_ptr().add(c), lo);
            _mm256_storeu_ps(out.as_mut_ptr().add(c + 8), hi);
        } else {
            let mut tmp = [0.0f32; 16];
            _mm256_storeu_ps(tmp.as_mut_ptr(), lo);
            _mm256_storeu_ps(tmp.as_mut_ptr().add(8), hi);
            out[c..].copy_from_slice(&tmp[..n]);
        }
    }
}

/// The canonical 16 → 1 tree over lanes `(lo, hi)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tree16(lo: __m256, hi: __m256) -> f32 {
    let s8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// Canonical `e^x`, 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn exp8(x: __m256) -> __m256 {
    let xc = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(EXP_LO)),
        _mm256_set1_ps(EXP_HI),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        xc,
        _mm256_set1_ps(LOG2E),
    ));
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), xc);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_P[0]);
    for c in &EXP_P[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
    }
    let y = _mm256_add_ps(
        _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
        _mm256_set1_ps(1.0),
    );
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    let e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
    _mm256_blendv_ps(e, _mm256_setzero_ps(), under)
}

/// Canonical sum of squares.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn sum_sq(x: &[f32]) -> f32 {
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for c in (0..x.len()).step_by(16) {
        let (v0, v1) = ld16(x, c);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    tree16(a0, a1)
}

/// One RMSNorm row.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = _mm256_set1_ps(super::portable::rms_inv(sum_sq(x), x.len(), eps));
    for c in (0..x.len()).step_by(16) {
        let (x0, x1) = ld16(x, c);
        let (w0, w1) = ld16(w, c);
        let o0 = _mm256_mul_ps(_mm256_mul_ps(x0, inv), w0);
        let o1 = _mm256_mul_ps(_mm256_mul_ps(x1, inv), w1);
        st16(out, c, o0, o1);
    }
}

/// Rotate-half RoPE of one head in place (unfused).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn rope_head(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (lo, hi) = x.split_at_mut(half);
    for c in (0..half).step_by(16) {
        let (a0, a1) = ld16(lo, c);
        let (b0, b1) = ld16(hi, c);
        let (c0, c1) = ld16(cos, c);
        let (s0, s1) = ld16(sin, c);
        let f = |a, b, cv, sv| {
            (
                _mm256_sub_ps(_mm256_mul_ps(a, cv), _mm256_mul_ps(b, sv)),
                _mm256_add_ps(_mm256_mul_ps(b, cv), _mm256_mul_ps(a, sv)),
            )
        };
        let (p0, q0) = f(a0, b0, c0, s0);
        let (p1, q1) = f(a1, b1, c1, s1);
        st16(lo, c, p0, p1);
        st16(hi, c, q0, q1);
    }
}

/// `out = (g / (1 + exp(-g))) * u`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn silu_mul_row(g: &[f32], u: &[f32], out: &mut [f32]) {
    let one = _mm256_set1_ps(1.0);
    for c in (0..g.len()).step_by(16) {
        let (g0, g1) = ld16(g, c);
        let (u0, u1) = ld16(u, c);
        let f = |gv, uv| {
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv)
        };
        st16(out, c, f(g0, u0), f(g1, u1));
    }
}

/// `a += b`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn add(a: &mut [f32], b: &[f32]) {
    for c in (0..a.len()).step_by(16) {
        let (a0, a1) = ld16(a, c);
        let (b0, b1) = ld16(b, c);
        st16(a, c, _mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1));
    }
}

/// Scores of one query row against `n` tokens of a head tile (see `portable::scores`).
///
/// # Safety
/// `tile` holds at least `n * q.len()` elements of dtype `DT`; `s` has room for `n`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn scores<const DT: u8>(
    q: &[f32],
    tile: *const u8,
    n: usize,
    kscale: Option<f32>,
    mul: f32,
    s: &mut [f32],
) {
    let hd = q.len();
    for (t, st) in s.iter_mut().enumerate().take(n) {
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for c in (0..hd).step_by(16) {
            let (q0, q1) = ld16(q, c);
            let (k0, k1) = unsafe { kv16::<DT>(tile, t * hd + c, hd - c) };
            a0 = _mm256_fmadd_ps(q0, k0, a0);
            a1 = _mm256_fmadd_ps(q1, k1, a1);
        }
        let d = tree16(a0, a1);
        *st = match kscale {
            Some(ks) => (d * ks) * mul,
            None => d * mul,
        };
    }
}

/// In-place softmax numerator; returns the canonical sum (see `portable::softmax_weights`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn softmax_weights(s: &mut [f32]) -> f32 {
    let m = s
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| super::portable::x86_max(v, m));
    let mv = _mm256_set1_ps(m);
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let n = s.len();
    for c in (0..n).step_by(16) {
        let (v0, v1) = ld16(s, c);
        let (mut e0, mut e1) = (exp8(_mm256_sub_ps(v0, mv)), exp8(_mm256_sub_ps(v1, mv)));
        if n - c < 16 {
            // Padding lanes must add +0.0, as in the canonical sum.
            let mut tmp = [0.0f32; 16];
            // SAFETY: 16 floats.
            unsafe {
                _mm256_storeu_ps(tmp.as_mut_ptr(), e0);
                _mm256_storeu_ps(tmp.as_mut_ptr().add(8), e1);
            }
            tmp[n - c..].fill(0.0);
            (e0, e1) = ld16(&tmp, 0);
        }
        st16(s, c, e0, e1);
        a0 = _mm256_add_ps(a0, e0);
        a1 = _mm256_add_ps(a1, e1);
    }
    tree16(a0, a1)
}

/// `acc[r][d] = fma(w_r(t), v_t[d], acc[r][d])` over the tokens of `tiles`, `G` rows at a
/// time (see `avx512::accumulate_v`; same contract).
///
/// # Safety
/// As `avx512::accumulate_v`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn accumulate_v<const DT: u8, const G: usize>(
    e: [&[f32]; G],
    tiles: VTiles<'_>,
    hd: usize,
    dims: std::ops::Range<usize>,
    acc: [*mut f32; G],
) {
    unsafe {
        for c in dims.step_by(8) {
            let mut a: [__m256; G] = std::array::from_fn(|g| _mm256_loadu_ps(acc[g].add(c)));
            for (i, &tile) in tiles.ptrs.iter().enumerate() {
                for t in 0..tiles.n {
                    let v = if hd - c >= 8 {
                        kv8::<DT>(tile, t * hd + c)
                    } else {
                        kv16::<DT>(tile, t * hd + c, hd - c).0
                    };
                    for g in 0..G {
                        let w = tiles.weight(i, t, e[g][i * tiles.n + t]);
                        a[g] = _mm256_fmadd_ps(_mm256_set1_ps(w), v, a[g]);
                    }
                }
            }
            for g in 0..G {
                _mm256_storeu_ps(acc[g].add(c), a[g]);
            }
        }
    }
}
