//! AVX-512 row kernels (RMSNorm, RoPE, SiLU-gating, add) and attention inner loops.
//!
//! Each function reproduces its `portable` twin bit for bit: the 16-lane accumulators *are*
//! the canonical lanes, tails are zero-padded, and [`tree16`] is the canonical reduction tree.

use super::VTiles;
use super::avx512_gemm::{DT_BF16, DT_F16, DT_F32};
use super::portable::{EXP_HI, EXP_LO, EXP_P, LN2_HI, LN2_LO, LOG2E};
use std::arch::x86_64::*;

/// KV element codes (`DT_F32`, `DT_F16`, `DT_BF16` shared with the GEMM) plus Int8.
pub(crate) const DT_I8: u8 = 3;

/// 16 KV elements of dtype `DT` at element `elem`, widened to f32 (exact).
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn kv16<const DT: u8>(p: *const u8, elem: usize) -> __m512 {
    unsafe {
        match DT {
            DT_I8 => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(elem).cast()))),
            _ => super::avx512_gemm::load16::<DT>(p, elem),
        }
    }
}

/// Like [`kv16`] but only `n < 16` elements exist; the rest read as +0.0.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn kv16_tail<const DT: u8>(p: *const u8, elem: usize, n: usize) -> __m512 {
    let esz = match DT {
        DT_F32 => 4,
        DT_F16 | DT_BF16 => 2,
        _ => 1,
    };
    let mut tmp = [0u8; 64];
    unsafe {
        std::ptr::copy_nonoverlapping(p.add(elem * esz), tmp.as_mut_ptr(), n * esz);
        kv16::<DT>(tmp.as_ptr(), 0)
    }
}

#[inline]
fn mask(n: usize) -> u16 {
    if n >= 16 {
        u16::MAX
    } else {
        ((1u32 << n) - 1) as u16
    }
}

/// The canonical 16 → 1 tree: `l[i] + l[i+8]`, `+ [i+4]`, `+ [i+2]`, `+ [i+1]`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn tree16(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// Canonical `e^x`, 16 lanes.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn exp16(x: __m512) -> __m512 {
    let xc = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(EXP_LO)),
        _mm512_set1_ps(EXP_HI),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
    );
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), xc);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_P[0]);
    for c in &EXP_P[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let y = _mm512_add_ps(
        _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
        _mm512_set1_ps(1.0),
    );
    let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    let e = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_LO));
    _mm512_mask_blend_ps(under, e, _mm512_setzero_ps())
}

/// Canonical sum of squares.
#[target_feature(enable = "avx512f")]
pub(crate) fn sum_sq(x: &[f32]) -> f32 {
    let mut acc = _mm512_setzero_ps();
    for c in (0..x.len()).step_by(16) {
        // SAFETY: the mask keeps the load inside `x`.
        let v = unsafe { _mm512_maskz_loadu_ps(mask(x.len() - c), x.as_ptr().add(c)) };
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    tree16(acc)
}

/// One RMSNorm row.
#[target_feature(enable = "avx512f")]
pub(crate) fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = _mm512_set1_ps(super::portable::rms_inv(sum_sq(x), x.len(), eps));
    for c in (0..x.len()).step_by(16) {
        let k = mask(x.len() - c);
        // SAFETY: masked to the slices' common length (checked by the caller).
        unsafe {
            let xv = _mm512_maskz_loadu_ps(k, x.as_ptr().add(c));
            let wv = _mm512_maskz_loadu_ps(k, w.as_ptr().add(c));
            _mm512_mask_storeu_ps(
                out.as_mut_ptr().add(c),
                k,
                _mm512_mul_ps(_mm512_mul_ps(xv, inv), wv),
            );
        }
    }
}

/// Rotate-half RoPE of one head in place (unfused, as the portable twin).
#[target_feature(enable = "avx512f")]
pub(crate) fn rope_head(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let p = x.as_mut_ptr();
    for c in (0..half).step_by(16) {
        let k = mask(half - c);
        // SAFETY: masked to `half`; `x` has `2 * half` elements (checked by the caller).
        unsafe {
            let a = _mm512_maskz_loadu_ps(k, p.add(c));
            let b = _mm512_maskz_loadu_ps(k, p.add(half + c));
            let cv = _mm512_maskz_loadu_ps(k, cos.as_ptr().add(c));
            let sv = _mm512_maskz_loadu_ps(k, sin.as_ptr().add(c));
            let o1 = _mm512_sub_ps(_mm512_mul_ps(a, cv), _mm512_mul_ps(b, sv));
            let o2 = _mm512_add_ps(_mm512_mul_ps(b, cv), _mm512_mul_ps(a, sv));
            _mm512_mask_storeu_ps(p.add(c), k, o1);
            _mm512_mask_storeu_ps(p.add(half + c), k, o2);
        }
    }
}

/// `out = (g / (1 + exp(-g))) * u`.
#[target_feature(enable = "avx512f")]
pub(crate) fn silu_mul_row(g: &[f32], u: &[f32], out: &mut [f32]) {
    for c in (0..g.len()).step_by(16) {
        let k = mask(g.len() - c);
        // SAFETY: masked to the common length (checked by the caller).
        unsafe {
            let gv = _mm512_maskz_loadu_ps(k, g.as_ptr().add(c));
            let uv = _mm512_maskz_loadu_ps(k, u.as_ptr().add(c));
            let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            let s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0), e));
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(c), k, _mm512_mul_ps(s, uv));
        }
    }
}

/// `a += b`.
#[target_feature(enable = "avx512f")]
pub(crate) fn add(a: &mut [f32], b: &[f32]) {
    for c in (0..a.len()).step_by(16) {
        let k = mask(a.len() - c);
        // SAFETY: masked to the common length (checked by the caller).
        unsafe {
            let av = _mm512_maskz_loadu_ps(k, a.as_ptr().add(c));
            let bv = _mm512_maskz_loadu_ps(k, b.as_ptr().add(c));
            _mm512_mask_storeu_ps(a.as_mut_ptr().add(c), k, _mm512_add_ps(av, bv));
        }
    }
}

/// Reduces 16 canonical accumulators (one per token) to one vector of their 16 sums, token
/// `u` in lane `u`, performing for every token exactly the additions of [`tree16`]
/// (`l[i] + l[i+8]`, `+ [i+4]`, `+ [i+2]`, `+ [i+1]`), just interleaved across tokens.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn tree16x16(a: &[__m512; 16]) -> __m512 {
    // 16 -> 8: lanes 0-7 = token 2k's s8, lanes 8-15 = token 2k+1's s8.
    let b: [__m512; 8] = std::array::from_fn(|k| {
        let (x, y) = (a[2 * k], a[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(x, y),
            _mm512_shuffle_f32x4::<0xEE>(x, y),
        )
    });
    // 8 -> 4: 128-bit block j of c[m] = token 4m + j's s4.
    let c: [__m512; 4] = std::array::from_fn(|m| {
        let (x, y) = (b[2 * m], b[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xDD>(x, y),
        )
    });
    // 4 -> 2: block j of d[n] = [s2 of token 8n + j, s2 of token 8n + 4 + j].
    let d: [__m512; 2] = std::array::from_fn(|n| {
        let (x, y) = (c[2 * n], c[2 * n + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x, y),
            _mm512_shuffle_ps::<0xEE>(x, y),
        )
    });
    // 2 -> 1: lane 4j + q = sum of token j + 4q.
    let e = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(d[0], d[1]),
        _mm512_shuffle_ps::<0xDD>(d[0], d[1]),
    );
    // Token t sits in lane 4 * (t % 4) + t / 4.
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(idx, e)
}

/// Scores of one query row against `n` tokens of a head tile (see `portable::scores`).
/// Sixteen tokens at a time share the query loads and one interleaved reduction.
///
/// # Safety
/// `tile` holds at least `n * q.len()` elements of dtype `DT`; `s` has room for `n`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn scores<const DT: u8>(
    q: &[f32],
    tile: *const u8,
    n: usize,
    kscale: Option<f32>,
    mul: f32,
    s: &mut [f32],
) {
    let hd = q.len();
    let full = hd / 16 * 16;
    // SAFETY: masked to the `hd - full` elements that exist.
    let qtail = unsafe { _mm512_maskz_loadu_ps(mask(hd - full), q.as_ptr().add(full)) };
    let mut t = 0;
    while t + 16 <= n {
        let mut acc = [_mm512_setzero_ps(); 16];
        unsafe {
            for c in (0..full).step_by(16) {
                let qv = _mm512_loadu_ps(q.as_ptr().add(c));
                for (u, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(qv, kv16::<DT>(tile, (t + u) * hd + c), *a);
                }
            }
            if full < hd {
                for (u, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(
                        qtail,
                        kv16_tail::<DT>(tile, (t + u) * hd + full, hd - full),
                        *a,
                    );
                }
            }
        }
        let mut d = tree16x16(&acc);
        if let Some(ks) = kscale {
            d = _mm512_mul_ps(d, _mm512_set1_ps(ks));
        }
        d = _mm512_mul_ps(d, _mm512_set1_ps(mul));
        // SAFETY: `s` has room for `n >= t + 16`.
        unsafe { _mm512_storeu_ps(s.as_mut_ptr().add(t), d) };
        t += 16;
    }
    let t_batched = t;
    for (t, st) in s.iter_mut().enumerate().take(n).skip(t_batched) {
        let mut acc = _mm512_setzero_ps();
        let base = t * hd;
        unsafe {
            for c in (0..full).step_by(16) {
                acc = _mm512_fmadd_ps(
                    _mm512_loadu_ps(q.as_ptr().add(c)),
                    kv16::<DT>(tile, base + c),
                    acc,
                );
            }
            if full < hd {
                acc = _mm512_fmadd_ps(qtail, kv16_tail::<DT>(tile, base + full, hd - full), acc);
            }
        }
        let d = tree16(acc);
        *st = match kscale {
            Some(ks) => (d * ks) * mul,
            None => d * mul,
        };
    }
}

/// In-place softmax numerator; returns the canonical sum (see `portable::softmax_weights`).
#[target_feature(enable = "avx512f")]
pub(crate) fn softmax_weights(s: &mut [f32]) -> f32 {
    let n = s.len();
    let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
    for c in (0..n).step_by(16) {
        // SAFETY: masked to `n`; masked-off lanes keep the running max.
        let v = unsafe { _mm512_mask_loadu_ps(mv, mask(n - c), s.as_ptr().add(c)) };
        mv = _mm512_max_ps(v, mv);
    }
    let mut lanes = [0.0f32; 16];
    // SAFETY: 16 floats.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), mv) };
    let m = lanes
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| super::portable::x86_max(b, a));
    let mvec = _mm512_set1_ps(m);
    let mut acc = _mm512_setzero_ps();
    for c in (0..n).step_by(16) {
        let k = mask(n - c);
        // SAFETY: masked to `n`.
        unsafe {
            let v = _mm512_maskz_loadu_ps(k, s.as_ptr().add(c));
            let e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(v, mvec)));
            _mm512_mask_storeu_ps(s.as_mut_ptr().add(c), k, e);
            acc = _mm512_add_ps(acc, e);
        }
    }
    tree16(acc)
}

/// `acc[r][d] = fma(w_r(t), v_t[d], acc[r][d])` over the tokens `t` of `tiles`, in order, and
/// `d` in `dims` (see `portable::accumulate_v`), `G` rows at a time. `acc` rows have a stride
/// of `hd` rounded up to 16; `dims.start` is a multiple of 16 and `dims.end` is one too, or `hd`.
///
/// Up to 4 chunks of 16 dimensions are carried at once in registers across all the tiles, so
/// `G × 4` independent FMA chains hide the FMA latency even for one row, and each V load feeds
/// all `G` rows.
///
/// # Safety
/// Each tile holds `tiles.n * hd` elements of dtype `DT`; each `e[r]` has `tiles.tokens()`
/// weights; the `dims` of each `acc[r]` (`hd.next_multiple_of(16)` floats) are ours alone.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn accumulate_v<const DT: u8, const G: usize>(
    e: [&[f32]; G],
    tiles: VTiles<'_>,
    hd: usize,
    dims: std::ops::Range<usize>,
    acc: [*mut f32; G],
) {
    for er in &e {
        assert!(
            er.len() >= tiles.tokens(),
            "accumulate_v: {} weights for {} tokens",
            er.len(),
            tiles.tokens()
        );
    }
    let mut c0 = dims.start;
    while c0 < dims.end {
        // SAFETY: forwarded contract; the pass covers dims c0..c0 + 16 * NC (padded).
        unsafe {
            match (dims.end - c0).div_ceil(16) {
                1 => v_pass::<DT, G, 1>(&e, tiles, hd, c0, &acc),
                2 => v_pass::<DT, G, 2>(&e, tiles, hd, c0, &acc),
                3 => v_pass::<DT, G, 3>(&e, tiles, hd, c0, &acc),
                _ => v_pass::<DT, G, 4>(&e, tiles, hd, c0, &acc),
            }
        }
        c0 += 64;
    }
}

/// One pass of [`accumulate_v`] over dims `c0..c0 + 16 * NC`, accumulators in registers.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn v_pass<const DT: u8, const G: usize, const NC: usize>(
    e: &[&[f32]; G],
    tiles: VTiles<'_>,
    hd: usize,
    c0: usize,
    acc: &[*mut f32; G],
) {
    let full = hd / 16 * 16;
    unsafe {
        let mut a = [[_mm512_setzero_ps(); NC]; G];
        for g in 0..G {
            for (c, ac) in a[g].iter_mut().enumerate() {
                *ac = _mm512_loadu_ps(acc[g].add(c0 + 16 * c));
            }
        }
        for (i, &tile) in tiles.ptrs.iter().enumerate() {
            for t in 0..tiles.n {
                let mut v = [_mm512_setzero_ps(); NC];
                if c0 + 16 * NC <= full {
                    for (c, vc) in v.iter_mut().enumerate() {
                        *vc = kv16::<DT>(tile, t * hd + c0 + 16 * c);
                    }
                } else {
                    for (c, vc) in v.iter_mut().enumerate() {
                        let d = c0 + 16 * c;
                        *vc = if d < full {
                            kv16::<DT>(tile, t * hd + d)
                        } else {
                            kv16_tail::<DT>(tile, t * hd + d, hd - d)
                        };
                    }
                }
                for g in 0..G {
                    let w =
                        _mm512_set1_ps(tiles.weight(i, t, *e[g].get_unchecked(i * tiles.n + t)));
                    for c in 0..NC {
                        a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
                    }
                }
            }
        }
        for g in 0..G {
            for (c, ac) in a[g].iter().enumerate() {
                _mm512_storeu_ps(acc[g].add(c0 + 16 * c), *ac);
            }
        }
    }
}
