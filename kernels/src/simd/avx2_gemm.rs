//! AVX2 + FMA + F16C `linear` micro-kernels over panel-packed weights.
//!
//! Same scheme as the AVX-512 kernels with 8-wide vectors (a 32-row panel is 4 vectors) and
//! 16 registers: `MR = 1` → 8 vectors (2 panels), `MR <= 3` → 4 vectors (1 panel). Every
//! accumulator lane is one output's canonical chain `fma(x[i][k], w[j][k], acc)`, `k` ascending.

use super::avx512_gemm::{DT_BF16, DT_F16, DT_F32, dt_of};
use crate::weight::{PANEL_ROWS, Weight};
use std::arch::x86_64::*;

const MR_MAX: usize = 3;

/// 8 elements of dtype `DT` starting at element `elem` of `p`, widened to f32 (exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn load8<const DT: u8>(p: *const u8, elem: usize) -> __m256 {
    unsafe {
        match DT {
            DT_F32 => _mm256_loadu_ps(p.cast::<f32>().add(elem)),
            DT_F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<u16>().add(elem).cast())),
            _ => {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast::<u16>().add(elem).cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
            }
        }
    }
}

/// Stores the first `n` (< 8 allowed) lanes of `v` at `dst`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn store_n(dst: *mut f32, v: __m256, n: usize) {
    unsafe {
        if n >= 8 {
            _mm256_storeu_ps(dst, v);
        } else {
            let mut tmp = [0.0f32; 8];
            _mm256_storeu_ps(tmp.as_mut_ptr(), v);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, n);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn tile<const DT: u8, const MR: usize, const NV: usize>(
    x: *const f32,
    cols: usize,
    pw: *const u8,
    out: *mut f32,
    rows: usize,
    j0: usize,
) {
    // NV / 4 panels, consecutive in the packed buffer (`pstride` = one panel).
    let pstride_elems = cols * PANEL_ROWS;
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); NV]; MR];
        for k in 0..cols {
            let mut w = [_mm256_setzero_ps(); NV];
            for (v, wv) in w.iter_mut().enumerate() {
                *wv = load8::<DT>(pw, (v / 4) * pstride_elems + k * PANEL_ROWS + (v % 4) * 8);
            }
            for (i, ai) in acc.iter_mut().enumerate() {
                let xb = _mm256_set1_ps(*x.add(i * cols + k));
                for v in 0..NV {
                    ai[v] = _mm256_fmadd_ps(xb, w[v], ai[v]);
                }
            }
        }
        for (i, ai) in acc.iter().enumerate() {
            for (v, a) in ai.iter().enumerate() {
                let j = j0 + v * 8;
                if j < rows {
                    store_n(out.add(i * rows + j), *a, rows - j);
                }
            }
        }
    }
}

/// `out[i * rows + j]` for all rows `i < m` and the features of panels `p0..p1`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `x` holds `m * cols` floats; `out` is valid for writes
/// of `m * rows` floats and no other thread writes the features of panels `p0..p1`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn linear_panels(
    x: &[f32],
    m: usize,
    w: &Weight,
    out: *mut f32,
    p0: usize,
    p1: usize,
) {
    let (cols, rows) = (w.cols(), w.rows());
    let esz = w.dtype().elem_bytes();
    let packed = w.packed().as_ptr();
    let dt = dt_of(w.dtype());
    let mut i = 0;
    while i < m {
        let mr = MR_MAX.min(m - i);
        let mut p = p0;
        while p < p1 {
            let two = mr == 1 && p + 1 < p1;
            let (xp, op) = unsafe { (x.as_ptr().add(i * cols), out.add(i * rows)) };
            let pw = unsafe { packed.add(p * cols * PANEL_ROWS * esz) };
            let j0 = p * PANEL_ROWS;
            unsafe {
                match (mr, two, dt) {
                    (1, true, DT_F32) => tile::<DT_F32, 1, 8>(xp, cols, pw, op, rows, j0),
                    (1, true, DT_F16) => tile::<DT_F16, 1, 8>(xp, cols, pw, op, rows, j0),
                    (1, true, _) => tile::<DT_BF16, 1, 8>(xp, cols, pw, op, rows, j0),
                    (1, false, DT_F32) => tile::<DT_F32, 1, 4>(xp, cols, pw, op, rows, j0),
                    (1, false, DT_F16) => tile::<DT_F16, 1, 4>(xp, cols, pw, op, rows, j0),
                    (1, false, _) => tile::<DT_BF16, 1, 4>(xp, cols, pw, op, rows, j0),
                    (2, _, DT_F32) => tile::<DT_F32, 2, 4>(xp, cols, pw, op, rows, j0),
                    (2, _, DT_F16) => tile::<DT_F16, 2, 4>(xp, cols, pw, op, rows, j0),
                    (2, _, _) => tile::<DT_BF16, 2, 4>(xp, cols, pw, op, rows, j0),
                    (_, _, DT_F32) => tile::<DT_F32, 3, 4>(xp, cols, pw, op, rows, j0),
                    (_, _, DT_F16) => tile::<DT_F16, 3, 4>(xp, cols, pw, op, rows, j0),
                    (_, _, _) => tile::<DT_BF16, 3, 4>(xp, cols, pw, op, rows, j0),
                }
            }
            p += if two { 2 } else { 1 };
        }
        i += mr;
    }
}
