//! AVX2 + FMA + F16C `linear` over quantized panels ([`crate::quant`]): every weight decoded in
//! registers to its exact f32 value (`q * d`, `(q - 8) * d`, or `q * d + m` with two roundings),
//! then the canonical chain `acc = fma(x[k], w, acc)`, so the bits equal the f32 path's.
//!
//! - `m == 1` (decode of one sequence): one panel at a time, its 32 outputs in 4 accumulator
//!   vectors; per block the 32 rows' scales (and minimums) are widened once, per column the
//!   16 (`Q4_1`, `Q4_0`) or 32 (`Q8_0`) bytes of quants become 4 vectors of 8 weights. This
//!   reads the file's 4.5, 5 or 8.5 bits a weight, against 32 for f32.
//! - `m > 1`: each panel is decoded once into a thread-local f32 panel, and the f32 tiles of
//!   `avx2_gemm` run over every row block: the decode is paid once a call, not once a row.
//!
//! `avx512_quant` is the same method on 16-lane vectors; the bits are the same either way.

use super::avx2_gemm::{store_n, tile};
use super::avx512_gemm::DT_F32;
use crate::quant::kind::{self, Q4_0, Q4_1, Q8_0};
use crate::quant::{QK, quants_offset, record_bytes};
use crate::weight::{PANEL_ROWS, Weight};
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Largest row block of the f32 tiles (as avx2_gemm).
const MR_MAX: usize = 3;

thread_local! {
    /// One decoded panel (`cols * 32` floats), reused across calls on this thread.
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// 32 f16 values at `p` widened to 4 vectors (exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_f16x32(p: *const u8) -> [__m256; 4] {
    unsafe {
        [
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast())),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(32).cast())),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(48).cast())),
        ]
    }
}

/// Column `k` of record `rec` (32 rows) as 4 vectors of exact f32 weights.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn decode<const Q: u8>(
    rec: *const u8,
    k: usize,
    d: &[__m256; 4],
    m: &[__m256; 4],
) -> [__m256; 4] {
    unsafe {
        if Q == Q8_0 {
            let qp = rec.add(quants_offset(kind::dtype(Q)) + k * PANEL_ROWS);
            let mut w = [_mm256_setzero_ps(); 4];
            for (v, wv) in w.iter_mut().enumerate() {
                let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(qp.add(8 * v).cast()));
                *wv = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d[v]);
            }
            w
        } else {
            let qp = rec.add(quants_offset(kind::dtype(Q)) + k * (PANEL_ROWS / 2));
            let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qp.cast()));
            let hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qp.add(8).cast()));
            let mask = _mm256_set1_epi32(0x0f);
            // rows 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles)
            let q = [
                _mm256_and_si256(lo, mask),
                _mm256_and_si256(hi, mask),
                _mm256_srli_epi32::<4>(lo),
                _mm256_srli_epi32::<4>(hi),
            ];
            let mut w = [_mm256_setzero_ps(); 4];
            for v in 0..4 {
                w[v] = if Q == Q4_1 {
                    _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q[v]), d[v]), m[v])
                } else {
                    // Q4_0: `(q - 8) * d`, the subtraction exact in integers
                    _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_sub_epi32(q[v], _mm256_set1_epi32(8))),
                        d[v],
                    )
                };
            }
            w
        }
    }
}

/// Scales and minimums of a record (minimums zero for `Q8_0`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_params<const Q: u8>(rec: *const u8) -> ([__m256; 4], [__m256; 4]) {
    unsafe {
        let d = load_f16x32(rec);
        let m = if Q == Q4_1 {
            load_f16x32(rec.add(2 * PANEL_ROWS))
        } else {
            [_mm256_setzero_ps(); 4]
        };
        (d, m)
    }
}

/// One row times one panel: the panel's 32 outputs `out[j0..j0 + 32]` (those `< rows`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_panel<const Q: u8>(
    x: *const f32,
    cols: usize,
    pw: *const u8,
    rec_bytes: usize,
    out: *mut f32,
    rows: usize,
    j0: usize,
) {
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        for b in 0..cols / QK {
            let rec = pw.add(b * rec_bytes);
            let (d, m) = block_params::<Q>(rec);
            for k in 0..QK {
                let xb = _mm256_set1_ps(*x.add(b * QK + k));
                let w = decode::<Q>(rec, k, &d, &m);
                for v in 0..4 {
                    acc[v] = _mm256_fmadd_ps(xb, w[v], acc[v]);
                }
            }
        }
        for (v, a) in acc.iter().enumerate() {
            let j = j0 + v * 8;
            if j < rows {
                store_n(out.add(j), *a, rows - j);
            }
        }
    }
}

/// Decodes one panel into `dst` (`cols * 32` floats, f32 panel layout `dst[k * 32 + lane]`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_panel<const Q: u8>(pw: *const u8, cols: usize, rec_bytes: usize, dst: *mut f32) {
    unsafe {
        for b in 0..cols / QK {
            let rec = pw.add(b * rec_bytes);
            let (d, m) = block_params::<Q>(rec);
            for k in 0..QK {
                let w = decode::<Q>(rec, k, &d, &m);
                let o = dst.add((b * QK + k) * PANEL_ROWS);
                for (v, wv) in w.iter().enumerate() {
                    _mm256_storeu_ps(o.add(8 * v), *wv);
                }
            }
        }
    }
}

/// `out[i * rows + j]` for all rows `i < m` and the features of panels `p0..p1`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `w` is quantized; `x` holds `m * cols` floats; `out`
/// is valid for writes of `m * rows` floats and no other thread writes these panels' features.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn linear_panels(
    x: &[f32],
    m: usize,
    w: &Weight,
    out: *mut f32,
    p0: usize,
    p1: usize,
) {
    let (cols, rows, dtype) = (w.cols(), w.rows(), w.dtype());
    let (packed, pbytes, rbytes) = (w.packed().as_ptr(), w.panel_bytes(), record_bytes(dtype));
    let q = kind::of(dtype);
    if m == 1 {
        for p in p0..p1 {
            unsafe {
                let pw = packed.add(p * pbytes);
                match q {
                    Q8_0 => {
                        gemv_panel::<Q8_0>(x.as_ptr(), cols, pw, rbytes, out, rows, p * PANEL_ROWS)
                    }
                    Q4_1 => {
                        gemv_panel::<Q4_1>(x.as_ptr(), cols, pw, rbytes, out, rows, p * PANEL_ROWS)
                    }
                    _ => {
                        gemv_panel::<Q4_0>(x.as_ptr(), cols, pw, rbytes, out, rows, p * PANEL_ROWS)
                    }
                };
            }
        }
        return;
    }
    PANEL.with(|cell| {
        let mut panel = cell.borrow_mut();
        panel.resize(cols * PANEL_ROWS, 0.0);
        let dst = panel.as_mut_ptr();
        for p in p0..p1 {
            // SAFETY: as the function's contract; `dst` holds one f32 panel.
            unsafe {
                let pw = packed.add(p * pbytes);
                match q {
                    Q8_0 => decode_panel::<Q8_0>(pw, cols, rbytes, dst),
                    Q4_1 => decode_panel::<Q4_1>(pw, cols, rbytes, dst),
                    _ => decode_panel::<Q4_0>(pw, cols, rbytes, dst),
                };
                let (src, j0) = (dst.cast_const().cast::<u8>(), p * PANEL_ROWS);
                let mut i = 0;
                while i < m {
                    let mr = MR_MAX.min(m - i);
                    let (xp, op) = (x.as_ptr().add(i * cols), out.add(i * rows));
                    match mr {
                        1 => tile::<DT_F32, 1, 4>(xp, cols, src, op, rows, j0),
                        2 => tile::<DT_F32, 2, 4>(xp, cols, src, op, rows, j0),
                        _ => tile::<DT_F32, 3, 4>(xp, cols, src, op, rows, j0),
                    }
                    i += mr;
                }
            }
        }
    });
}
