//! AVX-512 `linear` micro-kernels over panel-packed weights.
//!
//! A tile is `MR` input rows × `NV` 16-wide vectors of output features (`NV / 2` panels).
//! Per `k`: `NV` weight-vector loads (widened from f16/bf16 exactly), `MR` broadcasts of
//! `x[i][k]`, `MR * NV` FMAs into register accumulators. Each accumulator lane is one output's
//! chain `fma(x[i][k], w[j][k], acc)` over `k` ascending: the canonical order, for every tile
//! shape, so `m` and the tile choice never change a result.
//!
//! Shapes: `MR = 1` → 16 vectors (8 panels, 8 weight streams), `MR = 2` → 8 vectors,
//! `MR <= 4` → 4 vectors, up to `MR = 12` → 2 vectors (24 accumulators of 32 registers).
//! For `m >= CONVERT_MIN_M`, f16/bf16 panels are first widened into a thread-local f32
//! buffer, so the convert cost is paid once per panel rather than once per row block.

use crate::weight::{AlignedBytes, PANEL_ROWS, Weight, WeightDtype};
use std::arch::x86_64::*;
use std::cell::RefCell;

pub(crate) const DT_F32: u8 = 0;
pub(crate) const DT_F16: u8 = 1;
pub(crate) const DT_BF16: u8 = 2;

/// Panels handled per pass over the rows: 8 independent weight streams for GEMV (measured
/// ~10% more DRAM bandwidth than 4); half that when widened to f32, which must sit in L2.
const GROUP_PANELS: usize = 8;
/// Largest row block.
const MR_MAX: usize = 12;
/// Batch size from which f16/bf16 panels are widened once up front (below it, tiles widen
/// on the fly: `ceil(m / 12)` conversions per weight beat a widened copy's store and reload).
const CONVERT_MIN_M: usize = 64;

pub(crate) const fn dt_of(d: WeightDtype) -> u8 {
    match d {
        WeightDtype::F32 => DT_F32,
        WeightDtype::F16 => DT_F16,
        WeightDtype::Bf16 => DT_BF16,
        WeightDtype::Q8_0 | WeightDtype::Q4_1 | WeightDtype::Q4_0 => {
            panic!("dt_of: quantized weights take crate::quant's kernels")
        }
    }
}

/// 16 elements of dtype `DT` starting at element `elem` of `p`, widened to f32 (exact).
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn load16<const DT: u8>(p: *const u8, elem: usize) -> __m512 {
    unsafe {
        match DT {
            DT_F32 => _mm512_loadu_ps(p.cast::<f32>().add(elem)),
            DT_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<u16>().add(elem).cast())),
            _ => {
                let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast::<u16>().add(elem).cast()));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
            }
        }
    }
}

/// Where a tile's results go: `dst` (row stride `ld_dst`), of which only the first `n_dst`
/// columns exist (the last panel's padding rows are never stored).
#[derive(Clone, Copy)]
struct Dst {
    ptr: *mut f32,
    ld: usize,
    n: usize,
}

/// One register tile; see the module docs. `pw` points at the first of `NV / 2` panels,
/// `pstride` bytes apart; `x` at the tile's first row (row stride `ldx`).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile<const DT: u8, const MR: usize, const NV: usize>(
    x: *const f32,
    ldx: usize,
    pw: *const u8,
    pstride: usize,
    cols: usize,
    c: Dst,
) {
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        for k in 0..cols {
            let mut w = [_mm512_setzero_ps(); NV];
            for (v, wv) in w.iter_mut().enumerate() {
                *wv = load16::<DT>(pw.add((v / 2) * pstride), k * PANEL_ROWS + (v % 2) * 16);
            }
            for (i, ai) in acc.iter_mut().enumerate() {
                let xb = _mm512_set1_ps(*x.add(i * ldx + k));
                for v in 0..NV {
                    ai[v] = _mm512_fmadd_ps(xb, w[v], ai[v]);
                }
            }
        }
        for (i, ai) in acc.iter().enumerate() {
            for (v, a) in ai.iter().enumerate() {
                let j = v * 16;
                if j >= c.n {
                    continue;
                }
                let dst = c.ptr.add(i * c.ld + j);
                let n = c.n - j;
                if n >= 16 {
                    _mm512_storeu_ps(dst, *a);
                } else {
                    _mm512_mask_storeu_ps(dst, ((1u32 << n) - 1) as u16, *a);
                }
            }
        }
    }
}

macro_rules! dispatch_tile {
    ($dt:expr, $mr:expr, $nv:expr, $args:expr; $($m:literal => [$($n:literal),*]),* $(,)?) => {{
        let (x, ldx, pw, pstride, cols, c) = $args;
        match ($mr, $nv) {
            $($(
                ($m, $n) => match $dt {
                    DT_F32 => tile::<DT_F32, $m, $n>(x, ldx, pw, pstride, cols, c),
                    DT_F16 => tile::<DT_F16, $m, $n>(x, ldx, pw, pstride, cols, c),
                    _ => tile::<DT_BF16, $m, $n>(x, ldx, pw, pstride, cols, c),
                },
            )*)*
            _ => unreachable!("no tile for mr={} nv={}", $mr, $nv),
        }
    }};
}

/// Vectors per tile for a row block of `mr` rows, given `left` panels remaining.
fn nv_for(mr: usize, left: usize) -> usize {
    let max_panels = if mr == 1 {
        8
    } else if mr <= 2 {
        4
    } else if mr <= 4 {
        2
    } else {
        1
    };
    let p = max_panels.min(left);
    2 * if p >= 8 {
        8
    } else if p >= 4 {
        4
    } else if p >= 2 {
        2
    } else {
        1
    }
}

thread_local! {
    /// Widened f32 panels, reused across calls on this thread.
    static WIDE: RefCell<AlignedBytes> = RefCell::new(AlignedBytes::zeroed(0));
}

/// Every row block of `x` (`m` rows of `cols`) across `g` panels of dtype `dt` at `base`,
/// `stride` bytes apart, the first of which is panel `g0` of a `rows`-row weight: row blocks
/// of up to [`MR_MAX`] rows, each swept across the panels while its `x` rows sit in L1.
///
/// # Safety
/// The CPU supports AVX-512F; `base` holds `g` panels as described; `x` holds `m * cols`
/// floats; `out` is valid for writes of `m * rows` floats and no other thread writes the
/// features of these panels.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sweep(
    x: &[f32],
    m: usize,
    cols: usize,
    rows: usize,
    out: *mut f32,
    base: *const u8,
    stride: usize,
    dt: u8,
    g0: usize,
    g: usize,
) {
    let mut i = 0;
    while i < m {
        let mr = MR_MAX.min(m - i);
        let mut p = 0;
        while p < g {
            let nv = nv_for(mr, g - p);
            let j0 = (g0 + p) * PANEL_ROWS;
            let dst = Dst {
                ptr: unsafe { out.add(i * rows + j0) },
                ld: rows,
                n: rows - j0,
            };
            let xi = unsafe { x.as_ptr().add(i * cols) };
            let args = (xi, cols, unsafe { base.add(p * stride) }, stride, cols, dst);
            unsafe {
                dispatch_tile!(dt, mr, nv, args;
                    1 => [2, 4, 8, 16], 2 => [2, 4, 8], 3 => [2, 4], 4 => [2, 4],
                    5 => [2], 6 => [2], 7 => [2], 8 => [2], 9 => [2], 10 => [2],
                    11 => [2], 12 => [2]);
            }
            p += nv / 2;
        }
        i += mr;
    }
}

/// Widens `n` packed panels starting at `src` into f32 panels at `dst` (same layout).
#[target_feature(enable = "avx512f")]
unsafe fn widen<const DT: u8>(src: *const u8, elems: usize, dst: *mut f32) {
    unsafe {
        for e in (0..elems).step_by(16) {
            _mm512_storeu_ps(dst.add(e), load16::<DT>(src, e));
        }
    }
}

/// `out[i * rows + j]` for all rows `i < m` and the features of panels `p0..p1`.
///
/// Loop order: groups of `GROUP_PANELS` panels (widened to f32 once when `m` is large); within
/// a group, row blocks of up to `MR_MAX` rows, each swept across the group's panels while its
/// `x` rows sit in L1 and the group's weights in L2. (Blocking `k` so a weight slice stays in
/// L1 measured slower here: the `x` block then streams from L2 in 12 short strided runs.)
///
/// # Safety
/// The CPU supports AVX-512F; `x` holds `m * cols` floats; `out` is valid for writes of
/// `m * rows` floats and no other thread writes the features of panels `p0..p1`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn linear_panels(
    x: &[f32],
    m: usize,
    w: &Weight,
    out: *mut f32,
    p0: usize,
    p1: usize,
) {
    let (cols, rows) = (w.cols(), w.rows());
    let convert = w.dtype() != WeightDtype::F32 && m >= CONVERT_MIN_M;
    WIDE.with(|wide| {
        let mut wide = wide.borrow_mut();
        if convert && wide.as_bytes().len() < GROUP_PANELS / 2 * cols * PANEL_ROWS * 4 {
            *wide = AlignedBytes::zeroed(GROUP_PANELS / 2 * cols * PANEL_ROWS * 4);
        }
        let pbytes = w.panel_bytes();
        let mut g0 = p0;
        while g0 < p1 {
            // Wide groups give GEMV more independent streams; widened f32 groups must fit L2.
            let g = if convert {
                GROUP_PANELS / 2
            } else {
                GROUP_PANELS
            }
            .min(p1 - g0);
            let src = unsafe { w.packed().as_ptr().add(g0 * pbytes) };
            let (base, stride, dt) = if convert {
                let dst = wide.as_bytes_mut().as_mut_ptr().cast::<f32>();
                let elems = g * cols * PANEL_ROWS;
                unsafe {
                    if w.dtype() == WeightDtype::F16 {
                        widen::<DT_F16>(src, elems, dst)
                    } else {
                        widen::<DT_BF16>(src, elems, dst)
                    }
                }
                (dst.cast_const().cast::<u8>(), cols * PANEL_ROWS * 4, DT_F32)
            } else {
                (src, pbytes, dt_of(w.dtype()))
            };
            // SAFETY: as this function's contract; `base` holds `g` panels of `dt`, `stride` apart.
            unsafe { sweep(x, m, cols, rows, out, base, stride, dt, g0, g) };
            g0 += g;
        }
    });
}
