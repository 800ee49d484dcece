//! The grouped path: each task does everything for its rows (scores block by block, with the
//! K tile shared by the rows while in L1; softmax; V sums with rows sharing V loads) in
//! thread-local scratch. Used whenever there are enough tasks to keep every thread busy.

use super::block::{Rows, for_blocks, score_block, v_blocks};
use super::dispatch::softmax_weights;
use crate::kv::{KvCacheRef, KvPart};
use crate::simd::Isa;
use std::cell::RefCell;

thread_local! {
    /// (scores, accumulators, softmax sums), reused across calls on the same thread.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Computes the outputs of `rows`.
///
/// # Safety
/// Validated call; `out` is valid for the whole output; no other task writes these rows.
pub(super) unsafe fn run_task(
    isa: Isa,
    cache: &KvCacheRef<'_>,
    layer: usize,
    q: &[f32],
    rows: &Rows<'_>,
    scale: f32,
    out: *mut f32,
) {
    let (n_rows, ctx, n_blocks, hd) = (rows.len(), rows.ctx(), rows.blocks(), rows.hd);
    let hd_pad = hd.next_multiple_of(16);
    SCRATCH.with(|sc| {
        let mut sc = sc.borrow_mut();
        let (sbuf, abuf, sums) = &mut *sc;
        sbuf.clear();
        sbuf.resize(n_rows * ctx, 0.0);
        abuf.clear();
        abuf.resize(n_rows * hd_pad, 0.0);
        let sp = sbuf.as_mut_ptr();
        // SAFETY: sbuf holds n_rows × ctx floats, all ours.
        for_blocks(cache, layer, rows, 0..n_blocks, KvPart::K, |b| unsafe {
            score_block(isa, cache, layer, rows, b, q, scale, sp, ctx)
        });
        sums.clear();
        sums.extend(
            (0..n_rows)
                .map(|r| softmax_weights(isa, &mut sbuf[r * ctx..r * ctx + rows.pos(r) + 1])),
        );
        let (ep, ap) = (sbuf.as_ptr(), abuf.as_mut_ptr());
        // SAFETY: weights computed above; abuf holds n_rows × hd_pad floats, all ours.
        unsafe { v_blocks(isa, cache, layer, rows, 0..n_blocks, ep, ctx, ap, 0..hd) };
        for r in 0..n_rows {
            let at = rows.at(r);
            for d in 0..hd {
                // SAFETY: this task owns output row r; `at + d` is inside `out`.
                unsafe { *out.add(at + d) = abuf[r * hd_pad + d] / sums[r] };
            }
        }
    });
}
