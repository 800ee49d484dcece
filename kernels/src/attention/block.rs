//! Per-block steps shared by both attention paths: the row map of a task, the scores of one
//! KV block for all its rows, and the V accumulation of one block.
//!
//! Both take raw pointers into buffers that several tasks of the split path share; every call
//! touches only its own (row, block) scores or (row, dims) accumulators.

use super::dispatch::{accumulate_v, scores};
use super::{AttnSeq, Task, V_GROUP};
use crate::kv::{KvCacheRef, KvPart, read_f32, scale_offset, tile_offset};
use crate::simd::{Isa, prefetch};
use tandem_kv_layout::KvDtype;

/// KV tiles prefetched ahead of the one being processed.
pub(super) const PREFETCH_BLOCKS: usize = 2;

/// The rows of one task: row `r` is query `j0 + r / heads`, head `h0 + r % heads`.
#[derive(Clone, Copy)]
pub(super) struct Rows<'a> {
    pub(super) seq: &'a AttnSeq<'a>,
    pub(super) task: Task,
    pub(super) n_heads: usize,
    pub(super) hd: usize,
    pub(super) bs: usize,
}

impl Rows<'_> {
    fn heads(&self) -> usize {
        self.task.h1 - self.task.h0
    }
    /// Number of rows.
    pub(super) fn len(&self) -> usize {
        (self.task.j1 - self.task.j0) * self.heads()
    }
    /// Position of row `r`'s query; it attends to `0..=pos`.
    pub(super) fn pos(&self, r: usize) -> usize {
        self.seq.first_pos + self.task.j0 + r / self.heads()
    }
    /// Positions the last row attends to (the score row stride).
    pub(super) fn ctx(&self) -> usize {
        self.pos(self.len() - 1) + 1
    }
    /// KV blocks the rows read.
    pub(super) fn blocks(&self) -> usize {
        self.ctx().div_ceil(self.bs)
    }
    /// Offset of row `r` in `q` and `out`.
    pub(super) fn at(&self, r: usize) -> usize {
        let h = self.heads();
        (self.seq.q_row + self.task.j0 + r / h) * self.n_heads * self.hd + (self.task.h0 + r % h) * self.hd
    }
    /// Tokens of block `b` that row `r` attends to.
    pub(super) fn valid(&self, r: usize, b: usize) -> usize {
        (self.pos(r) + 1).saturating_sub(b * self.bs).min(self.bs)
    }
}

/// Byte range of the K or V tile of block `b` (table index) for the task's KV head.
fn tile<'c>(cache: &KvCacheRef<'c>, layer: usize, rows: &Rows<'_>, b: usize, part: KvPart) -> (&'c [u8], Option<f32>) {
    let l = cache.layout;
    let block = rows.seq.block_table[b] as usize;
    let at = tile_offset(l, cache.num_blocks, layer, block, rows.task.kv_head, part);
    let scale = (l.dtype == KvDtype::Int8)
        .then(|| read_f32(cache.bytes, scale_offset(l, cache.num_blocks, layer, block, rows.task.kv_head, part)));
    (&cache.bytes[at..at + rows.bs * l.head_dim * l.dtype.elem_bytes()], scale)
}

/// Walks blocks `b0..b1`, prefetching the `part` tile `PREFETCH_BLOCKS` ahead of each.
pub(super) fn for_blocks(
    cache: &KvCacheRef<'_>,
    layer: usize,
    rows: &Rows<'_>,
    blocks: std::ops::Range<usize>,
    part: KvPart,
    mut f: impl FnMut(usize),
) {
    for b in blocks.start..(blocks.start + PREFETCH_BLOCKS).min(blocks.end) {
        prefetch(tile(cache, layer, rows, b, part).0);
    }
    for b in blocks.clone() {
        if b + PREFETCH_BLOCKS < blocks.end {
            prefetch(tile(cache, layer, rows, b + PREFETCH_BLOCKS, part).0);
        }
        f(b);
    }
}

/// Scores of block `b` for every row: `s[r * stride + b * bs ..][..valid(r, b)]`.
///
/// # Safety
/// `s` is valid for those writes and no one else touches them during the call.
pub(super) unsafe fn score_block(
    isa: Isa,
    cache: &KvCacheRef<'_>,
    layer: usize,
    rows: &Rows<'_>,
    b: usize,
    q: &[f32],
    scale: f32,
    s: *mut f32,
    stride: usize,
) {
    let (ktile, kscale) = tile(cache, layer, rows, b, KvPart::K);
    let (hd, esz) = (rows.hd, cache.layout.dtype.elem_bytes());
    for r in 0..rows.len() {
        let n = rows.valid(r, b);
        if n > 0 {
            // SAFETY: per the contract this (row, block) range is ours; `ktile` holds n tokens.
            unsafe {
                let srow = std::slice::from_raw_parts_mut(s.add(r * stride + b * rows.bs), n);
                scores(isa, cache.layout.dtype, &q[rows.at(r)..rows.at(r) + hd], &ktile[..n * hd * esz], n, kscale, scale, srow);
            }
        }
    }
}

/// Adds block `b`'s weighted V rows into the accumulators `acc[r * hd_pad + d]`, `d` in `dims`,
/// reading weights `e[r * stride + b * bs ..]`. Rows go `V_GROUP` at a time over the tokens
/// they all attend to; a row that attends to more (the diagonal block of a prefill) finishes
/// alone, continuing its chain in token order.
///
/// # Safety
/// `e` holds the rows' weights for this block; the `dims` of each accumulator row are ours
/// alone during the call; `acc` rows are `hd` rounded up to 16 floats apart.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn v_block(
    isa: Isa,
    cache: &KvCacheRef<'_>,
    layer: usize,
    rows: &Rows<'_>,
    b: usize,
    e: *const f32,
    stride: usize,
    acc: *mut f32,
    dims: std::ops::Range<usize>,
) {
    let (vtile, vscale) = tile(cache, layer, rows, b, KvPart::V);
    let (hd, bs, esz) = (rows.hd, rows.bs, cache.layout.dtype.elem_bytes());
    let hd_pad = hd.next_multiple_of(16);
    let n_rows = rows.len();
    for g0 in (0..n_rows).step_by(V_GROUP) {
        let g1 = (g0 + V_GROUP).min(n_rows);
        let n_min = (g0..g1).map(|r| rows.valid(r, b)).min().unwrap_or(0);
        let mut spans = [(0usize, 0usize, 0usize, 0usize); V_GROUP + 1];
        let mut n_spans = 0;
        if n_min > 0 {
            spans[0] = (g0, g1, 0, n_min);
            n_spans = 1;
        }
        for r in g0..g1 {
            if rows.valid(r, b) > n_min {
                spans[n_spans] = (r, r + 1, n_min, rows.valid(r, b));
                n_spans += 1;
            }
        }
        for &(r0, r1, from, to) in &spans[..n_spans] {
            let row = |i: usize| (r0 + i).min(r1 - 1);
            // SAFETY: the weights of (row, block) exist per the contract.
            let w: [&[f32]; V_GROUP] =
                std::array::from_fn(|i| unsafe { std::slice::from_raw_parts(e.add(row(i) * stride + b * bs + from), to - from) });
            // SAFETY: row < n_rows; accumulator rows are hd_pad apart.
            let a: [*mut f32; V_GROUP] = std::array::from_fn(|i| unsafe { acc.add(row(i) * hd_pad) });
            let t = &vtile[from * hd * esz..to * hd * esz];
            // SAFETY: `t` holds `to - from` tokens; only the first r1 - r0 (distinct) rows are used.
            unsafe { accumulate_v(isa, cache.layout.dtype, &w[..r1 - r0], t, to - from, hd, dims.clone(), vscale, &a[..r1 - r0]) };
        }
    }
}
