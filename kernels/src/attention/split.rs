//! The split path, for calls with too few (sequence, KV head) groups to occupy every thread
//! (decode of one or two sequences). Three pool jobs over shared buffers:
//!
//! 1. scores, split by (group, range of KV blocks): each score is independent;
//! 2. softmax weights and sums, one task per row;
//! 3. V sums, split by (group, range of head dimensions): each output dimension's chain over
//!    positions is independent of the others.
//!
//! Every element goes through exactly the operations of the grouped path, so results are
//! bitwise identical to it; only the work division differs. K and V are each read once per
//! group (the group's query heads share them) and every thread gets a share.

use super::block::{Rows, for_blocks, score_block, v_blocks};
use super::dispatch::softmax_weights;
use crate::kv::{KvCacheRef, KvPart};
use crate::linear::SyncPtr;
use crate::pool::split_range;
use crate::{Exec, pool::WorkerPool};

/// Work items per thread in each phase.
const ITEMS_PER_THREAD: usize = 4;

/// Runs every group's rows through the three phases.
///
/// # Safety
/// Validated call; `out` is valid for the whole output; the groups' rows are disjoint.
pub(super) unsafe fn run_split(
    exec: &Exec<'_>,
    cache: &KvCacheRef<'_>,
    layer: usize,
    q: &[f32],
    groups: &[Rows<'_>],
    scale: f32,
    out: *mut f32,
) {
    let isa = exec.isa();
    let pool: &WorkerPool = exec.pool();
    let hd = cache.layout.head_dim;
    let hd_pad = hd.next_multiple_of(16);
    // Buffer offsets per group: scores (rows × ctx), accumulators (rows × hd_pad), sums (rows).
    let mut s_off = vec![0usize; groups.len() + 1];
    let mut a_off = vec![0usize; groups.len() + 1];
    let mut r_off = vec![0usize; groups.len() + 1];
    for (i, g) in groups.iter().enumerate() {
        s_off[i + 1] = s_off[i] + g.len() * g.ctx();
        a_off[i + 1] = a_off[i] + g.len() * hd_pad;
        r_off[i + 1] = r_off[i] + g.len();
    }
    let mut sbuf = vec![0.0f32; s_off[groups.len()]];
    let mut abuf = vec![0.0f32; a_off[groups.len()]];
    let mut sums = vec![0.0f32; r_off[groups.len()]];
    let (sp, ap, up) = (
        SyncPtr(sbuf.as_mut_ptr()),
        SyncPtr(abuf.as_mut_ptr()),
        SyncPtr(sums.as_mut_ptr()),
    );
    let op = SyncPtr(out);
    let items = pool.threads() * ITEMS_PER_THREAD;

    // Phase 1: (group, block range) items.
    let per_group = items.div_ceil(groups.len()).max(1);
    let score_items: Vec<(usize, std::ops::Range<usize>)> = groups
        .iter()
        .enumerate()
        .flat_map(|(i, g)| {
            let n = per_group.min(g.blocks());
            (0..n).map(move |t| (i, split_range(g.blocks(), n, t)))
        })
        .collect();
    pool.run(score_items.len(), &|k| {
        let (i, ref blocks) = score_items[k];
        let g = &groups[i];
        // SAFETY: disjoint (row, block) score ranges per item; buffers sized above.
        for_blocks(cache, layer, g, blocks.clone(), KvPart::K, |b| unsafe {
            score_block(
                isa,
                cache,
                layer,
                g,
                b,
                q,
                scale,
                sp.get().add(s_off[i]),
                g.ctx(),
            )
        });
    });

    // Phase 2: one item per row.
    pool.run(r_off[groups.len()], &|row| {
        let i = r_off.partition_point(|&o| o <= row) - 1;
        let (g, r) = (&groups[i], row - r_off[i]);
        // SAFETY: each row's scores and sum belong to this item alone.
        unsafe {
            let s =
                std::slice::from_raw_parts_mut(sp.get().add(s_off[i] + r * g.ctx()), g.pos(r) + 1);
            *up.get().add(row) = softmax_weights(isa, s);
        }
    });

    // Phase 3: (group, dimension range) items; a range covers whole cache lines of V.
    let esz = cache.layout.dtype.elem_bytes();
    let chunk = (64 / esz).max(16);
    let n_chunks = hd.div_ceil(chunk);
    let v_items: Vec<(usize, std::ops::Range<usize>)> = (0..groups.len())
        .flat_map(|i| (0..n_chunks).map(move |c| (i, c * chunk..((c + 1) * chunk).min(hd))))
        .collect();
    pool.run(v_items.len(), &|k| {
        let (i, ref dims) = v_items[k];
        let g = &groups[i];
        // SAFETY: weights are final after phase 2; each item owns its dims of its group's
        // accumulators and output rows.
        unsafe {
            let acc = ap.get().add(a_off[i]);
            v_blocks(
                isa,
                cache,
                layer,
                g,
                0..g.blocks(),
                sp.get().add(s_off[i]),
                g.ctx(),
                acc,
                dims.clone(),
            );
            for r in 0..g.len() {
                let sum = *up.get().add(r_off[i] + r);
                for d in dims.clone() {
                    *op.get().add(g.at(r) + d) = *acc.add(r * hd_pad + d) / sum;
                }
            }
        }
    });
}
