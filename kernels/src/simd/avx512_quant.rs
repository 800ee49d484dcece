//! AVX-512F `linear` over quantized panels ([`crate::quant`]): the AVX2 kernels' method on
//! 16-lane vectors. Every weight is decoded in registers to its exact f32 value (`q * d`,
//! `(q - 8) * d`, or `q * d + m` with two roundings, never a fused multiply-add), then the canonical chain
//! `acc = fma(x[k], w, acc)` runs, so the bits equal the f32 path's and the AVX2 path's.
//!
//! - `m == 1` (decode of one sequence): [`GEMV_PANELS`] panels at a time, each panel's 32
//!   outputs in 2 accumulator vectors (8 independent chains in flight, enough to cover the FMA
//!   latency); per block the rows' scales (and minimums) are widened once, per column the
//!   16 (`Q4_1`, `Q4_0`: one byte holds rows `i` and `i + 16`) or 32 (`Q8_0`) bytes of quants become
//!   2 vectors of 16 weights.
//! - `m > 1`: [`DECODE_PANELS`] panels at a time are decoded into a thread-local f32 buffer that
//!   stays in L2, and `avx512_gemm`'s f32 tiles sweep every row block across them: the decode is
//!   paid once a call, not once a row.

use super::avx512_gemm::{DT_F32, sweep};
use crate::quant::kind::{self, Q4_0, Q4_1, Q8_0};
use crate::quant::{QK, quants_offset, record_bytes};
use crate::weight::{AlignedBytes, PANEL_ROWS, Weight};
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Panels per pass of the one-row kernel.
const GEMV_PANELS: usize = 4;
/// Panels decoded to f32 per sweep (`4 × cols × 128` bytes: 288 KiB at 576 columns, in L2).
const DECODE_PANELS: usize = 4;

thread_local! {
    /// Decoded f32 panels, reused across calls on this thread.
    static DECODED: RefCell<AlignedBytes> = RefCell::new(AlignedBytes::zeroed(0));
}

/// 32 f16 values at `p` widened to 2 vectors (exact).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_f16x32(p: *const u8) -> [__m512; 2] {
    unsafe {
        [
            _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32).cast())),
        ]
    }
}

/// Scales and minimums of a record (minimums zero for `Q8_0`).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn block_params<const Q: u8>(rec: *const u8) -> ([__m512; 2], [__m512; 2]) {
    unsafe {
        let d = load_f16x32(rec);
        let m = if Q == Q4_1 {
            load_f16x32(rec.add(2 * PANEL_ROWS))
        } else {
            [_mm512_setzero_ps(); 2]
        };
        (d, m)
    }
}

/// Column `k` of record `rec` (32 rows) as 2 vectors of exact f32 weights.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn decode<const Q: u8>(
    rec: *const u8,
    k: usize,
    d: &[__m512; 2],
    m: &[__m512; 2],
) -> [__m512; 2] {
    unsafe {
        if Q == Q8_0 {
            let qp = rec.add(quants_offset(kind::dtype(Q)) + k * PANEL_ROWS);
            let q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(qp.cast()));
            let q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(qp.add(16).cast()));
            [
                _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d[0]),
                _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d[1]),
            ]
        } else {
            let qp = rec.add(quants_offset(kind::dtype(Q)) + k * (PANEL_ROWS / 2));
            let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(qp.cast()));
            // rows 0-15 in the low nibbles, rows 16-31 in the high ones
            let lo = _mm512_and_si512(b, _mm512_set1_epi32(0x0f));
            let hi = _mm512_srli_epi32::<4>(b);
            if Q == Q4_1 {
                [
                    _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d[0]), m[0]),
                    _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), d[1]), m[1]),
                ]
            } else {
                // Q4_0: `(q - 8) * d`, the subtraction exact in integers
                let eight = _mm512_set1_epi32(8);
                [
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)), d[0]),
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)), d[1]),
                ]
            }
        }
    }
}

/// Stores the first `n` (at most 16) lanes of `v` at `dst`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_n(dst: *mut f32, v: __m512, n: usize) {
    unsafe {
        if n >= 16 {
            _mm512_storeu_ps(dst, v);
        } else {
            _mm512_mask_storeu_ps(dst, ((1u32 << n) - 1) as u16, v);
        }
    }
}

/// One row times `NP` consecutive panels (`pbytes` apart): outputs `out[j0..j0 + 32 * NP]`
/// (those `< rows`).
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv<const Q: u8, const NP: usize>(
    x: *const f32,
    cols: usize,
    pw: *const u8,
    pbytes: usize,
    rec_bytes: usize,
    out: *mut f32,
    rows: usize,
    j0: usize,
) {
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; NP];
        for b in 0..cols / QK {
            let mut rec = [pw; NP];
            let mut d = [[_mm512_setzero_ps(); 2]; NP];
            let mut m = [[_mm512_setzero_ps(); 2]; NP];
            for p in 0..NP {
                rec[p] = pw.add(p * pbytes + b * rec_bytes);
                (d[p], m[p]) = block_params::<Q>(rec[p]);
            }
            for k in 0..QK {
                let xb = _mm512_set1_ps(*x.add(b * QK + k));
                for p in 0..NP {
                    let w = decode::<Q>(rec[p], k, &d[p], &m[p]);
                    acc[p][0] = _mm512_fmadd_ps(xb, w[0], acc[p][0]);
                    acc[p][1] = _mm512_fmadd_ps(xb, w[1], acc[p][1]);
                }
            }
        }
        for (p, ap) in acc.iter().enumerate() {
            for (v, a) in ap.iter().enumerate() {
                let j = j0 + p * PANEL_ROWS + v * 16;
                if j < rows {
                    store_n(out.add(j), *a, rows - j);
                }
            }
        }
    }
}

/// Decodes `g` panels at `pw` (`pbytes` apart) into f32 panels at `dst` (`cols * 32` floats
/// each, layout `dst[k * 32 + lane]`).
#[target_feature(enable = "avx512f")]
unsafe fn decode_panels<const Q: u8>(
    pw: *const u8,
    g: usize,
    pbytes: usize,
    cols: usize,
    rec_bytes: usize,
    dst: *mut f32,
) {
    unsafe {
        for p in 0..g {
            let (src, o) = (pw.add(p * pbytes), dst.add(p * cols * PANEL_ROWS));
            for b in 0..cols / QK {
                let rec = src.add(b * rec_bytes);
                let (d, m) = block_params::<Q>(rec);
                for k in 0..QK {
                    let w = decode::<Q>(rec, k, &d, &m);
                    let at = o.add((b * QK + k) * PANEL_ROWS);
                    _mm512_storeu_ps(at, w[0]);
                    _mm512_storeu_ps(at.add(16), w[1]);
                }
            }
        }
    }
}

/// The one-row kernel over panels `p0..p1`, `GEMV_PANELS` at a time, then one at a time.
#[target_feature(enable = "avx512f")]
unsafe fn gemv_panels<const Q: u8>(x: &[f32], w: &Weight, out: *mut f32, p0: usize, p1: usize) {
    let (cols, rows) = (w.cols(), w.rows());
    let (packed, pbytes, rbytes) = (
        w.packed().as_ptr(),
        w.panel_bytes(),
        record_bytes(w.dtype()),
    );
    let mut p = p0;
    while p < p1 {
        // SAFETY: panels `p..p + n` exist (`n <= p1 - p`); the caller's contract covers `out`.
        unsafe {
            let pw = packed.add(p * pbytes);
            let j0 = p * PANEL_ROWS;
            if p1 - p >= GEMV_PANELS {
                gemv::<Q, GEMV_PANELS>(x.as_ptr(), cols, pw, pbytes, rbytes, out, rows, j0);
                p += GEMV_PANELS;
            } else {
                gemv::<Q, 1>(x.as_ptr(), cols, pw, pbytes, rbytes, out, rows, j0);
                p += 1;
            }
        }
    }
}

/// `out[i * rows + j]` for all rows `i < m` and the features of panels `p0..p1`.
///
/// # Safety
/// The CPU supports AVX-512F; `w` is quantized; `x` holds `m * cols` floats; `out` is valid
/// for writes of `m * rows` floats and no other thread writes these panels' features.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn linear_panels(
    x: &[f32],
    m: usize,
    w: &Weight,
    out: *mut f32,
    p0: usize,
    p1: usize,
) {
    let q = kind::of(w.dtype());
    if m == 1 {
        // SAFETY: as this function's contract.
        unsafe {
            match q {
                Q8_0 => gemv_panels::<Q8_0>(x, w, out, p0, p1),
                Q4_1 => gemv_panels::<Q4_1>(x, w, out, p0, p1),
                _ => gemv_panels::<Q4_0>(x, w, out, p0, p1),
            }
        }
        return;
    }
    let (cols, rows) = (w.cols(), w.rows());
    let (packed, pbytes, rbytes) = (
        w.packed().as_ptr(),
        w.panel_bytes(),
        record_bytes(w.dtype()),
    );
    let f32_panel_bytes = cols * PANEL_ROWS * 4;
    DECODED.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.as_bytes().len() < DECODE_PANELS * f32_panel_bytes {
            *buf = AlignedBytes::zeroed(DECODE_PANELS * f32_panel_bytes);
        }
        let dst = buf.as_bytes_mut().as_mut_ptr().cast::<f32>();
        let mut g0 = p0;
        while g0 < p1 {
            let g = DECODE_PANELS.min(p1 - g0);
            // SAFETY: panels `g0..g0 + g` exist; `dst` holds `DECODE_PANELS` f32 panels; the
            // caller's contract covers `x` and `out`.
            unsafe {
                let pw = packed.add(g0 * pbytes);
                match q {
                    Q8_0 => decode_panels::<Q8_0>(pw, g, pbytes, cols, rbytes, dst),
                    Q4_1 => decode_panels::<Q4_1>(pw, g, pbytes, cols, rbytes, dst),
                    _ => decode_panels::<Q4_0>(pw, g, pbytes, cols, rbytes, dst),
                };
                sweep(
                    x,
                    m,
                    cols,
                    rows,
                    out,
                    dst.cast_const().cast(),
                    f32_panel_bytes,
                    DT_F32,
                    g0,
                    g,
                );
            }
            g0 += g;
        }
    });
}
