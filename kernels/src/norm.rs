//! RMSNorm over rows.
//!
//! Canonical order per row: sum of squares in 16 lanes (`fma(x, x, acc)`, element `i` in lane
//! `i % 16`) reduced by the fixed tree; `inv = 1 / sqrt(ss / n + eps)`; `out = (x * inv) * w`.
//! Rows are independent, so a row's result never depends on its neighbours or the split.
//!
//! Cost: two passes over each row; rows are spread over the pool only when the call has at
//! least `PAR_MIN_ELEMS` elements (a decode step's norm is a few KB: one thread is faster).

use crate::Exec;
use crate::error::assert_len;
use crate::linear::SyncPtr;
use crate::simd::{Isa, portable};

/// Calls with fewer elements than this run on one thread.
pub(crate) const PAR_MIN_ELEMS: usize = 1 << 15;

/// Row-wise RMSNorm over rows of len `weight.len()`: `out = x / sqrt(mean(x²) + eps) * weight`.
/// Panics if `x.len()` is not a multiple of `weight.len()` or `out.len() != x.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_on(&Exec::global(), x, weight, eps, out)
}

/// [`rms_norm`] on an explicit pool and ISA.
pub fn rms_norm_on(exec: &Exec<'_>, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    assert!(n > 0, "rms_norm: weight is empty");
    assert_len(
        "rms_norm",
        "x (a multiple of weight.len())",
        x.len().next_multiple_of(n),
        x.len(),
    );
    assert_len("rms_norm", "out", x.len(), out.len());
    let rows = x.len() / n;
    let isa = exec.isa();
    let optr = SyncPtr(out.as_mut_ptr());
    par_rows(exec, rows, n, &|r| {
        for row in r {
            let xr = &x[row * n..(row + 1) * n];
            // SAFETY: each row is written by exactly one task; `out` has `rows * n` floats.
            let or = unsafe { std::slice::from_raw_parts_mut(optr.get().add(row * n), n) };
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `Exec` only holds supported ISAs.
                Isa::Avx512 => unsafe { crate::simd::avx512::rms_norm_row(xr, weight, eps, or) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Isa::Avx2 => unsafe { crate::simd::avx2::rms_norm_row(xr, weight, eps, or) },
                _ => portable::rms_norm_row(xr, weight, eps, or),
            }
        }
    });
}

/// Runs `f` over ranges of `rows` rows of `row_len` elements: one range on the caller when the
/// call is small, otherwise a few ranges per pool thread.
pub(crate) fn par_rows(
    exec: &Exec<'_>,
    rows: usize,
    row_len: usize,
    f: &(dyn Fn(std::ops::Range<usize>) + Sync),
) {
    let threads = exec.pool().threads();
    if rows * row_len < PAR_MIN_ELEMS || threads == 1 || rows < 2 {
        f(0..rows);
    } else {
        exec.pool().run_ranges(rows, threads * 2, f);
    }
}
