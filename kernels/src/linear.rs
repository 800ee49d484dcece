//! `linear`: `out = x · Wᵀ` for a batch of rows, the model's matmul.
//!
//! Canonical order: output `(i, j)` is the chain `acc = fma(x[i][k], W[j][k], acc)` over
//! `k = 0..cols` from `acc = +0.0`, whatever `m`, tile shape, thread split or ISA. Vectorising
//! across output features (the panel-packed weight layout, see [`crate::Weight`]) makes that
//! chain the natural one, with no horizontal reduction at all.
//!
//! Parallelism: output features are split into ranges of 32-row panels, one task each, several
//! tasks per thread for load balance; `k` is never split. Small products (< `PAR_MIN_FMAS`
//! multiply-adds) run on the caller alone, where a dispatch would cost more than it saves.
//!
//! Cost: `m * rows * cols` FMAs; the weights are read once per call (per 4-panel group for
//! large `m`, which then stays in L2 while all rows stream past it). Quantized weights
//! ([`crate::quant`]) are decoded in registers to the same f32 values, so the same chain runs.

use crate::error::assert_len;
use crate::simd::{Isa, portable};
use crate::{Exec, Weight};

/// Below this many multiply-adds a call runs on one thread.
const PAR_MIN_FMAS: usize = 1 << 16;
/// Tasks per pool thread (more tasks balance load on a noisy machine; fewer cut overhead).
const TASKS_PER_THREAD: usize = 4;

/// Raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub(crate) *mut f32);
// SAFETY: tasks only write disjoint elements through it, and `run` joins them all.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer (a method, so closures capture the `Sync` wrapper, not the raw field).
    #[inline]
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out[i*rows + j] = Σ_k x[i*cols + k] * W[j][k]` for `i < m`; `x` is `m × cols`, `out` is
/// `m × rows` (overwritten). Panics if the lengths do not match the shapes.
pub fn linear(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    linear_on(&Exec::global(), x, m, w, out)
}

/// [`linear`] on an explicit pool and ISA (same bits on any of them).
pub fn linear_on(exec: &Exec<'_>, x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_len("linear", "x (m * cols)", m * cols, x.len());
    assert_len("linear", "out (m * rows)", m * rows, out.len());
    if m == 0 || rows == 0 {
        return;
    }
    let panels = w.panels();
    let threads = exec.pool().threads();
    let n_tasks = if m * rows * cols < PAR_MIN_FMAS || threads == 1 {
        1
    } else {
        panels.min(threads * TASKS_PER_THREAD)
    };
    let isa = exec.isa();
    let optr = SyncPtr(out.as_mut_ptr());
    exec.pool().run_ranges(panels, n_tasks, &|r| {
        // SAFETY: `Exec` guarantees the ISA is supported; shapes were checked above; tasks own
        // disjoint panel ranges, hence disjoint output features.
        unsafe { linear_panels(isa, x, m, w, optr.get(), r.start, r.end) }
    });
}

/// # Safety
/// `isa` is supported; `x` and `out` match the shapes; no concurrent writer of these panels.
unsafe fn linear_panels(
    isa: Isa,
    x: &[f32],
    m: usize,
    w: &Weight,
    out: *mut f32,
    p0: usize,
    p1: usize,
) {
    if w.dtype().is_quantized() {
        return match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe {
                crate::simd::avx512_quant::linear_panels(x, m, w, out, p0, p1)
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { crate::simd::avx2_quant::linear_panels(x, m, w, out, p0, p1) },
            _ => unsafe { portable::linear_panels_quant(x, m, w, out, p0, p1) },
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { crate::simd::avx512_gemm::linear_panels(x, m, w, out, p0, p1) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { crate::simd::avx2_gemm::linear_panels(x, m, w, out, p0, p1) },
        _ => unsafe { portable::linear_panels(x, m, w, out, p0, p1) },
    }
}
