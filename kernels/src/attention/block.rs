//! Per-block steps shared by both attention paths: the row map of a task, the scores of one
//! KV block for all its rows, and the V accumulation of one block.
//!
//! Both take raw pointers into buffers that several tasks of the split path share; every call
//! touches only its own (row, block) scores or (row, dims) accumulators.

use super::dispatch::{MAX_TILES, accumulate_v, scores};
use super::{AttnSeq, Task, V_GROUP};
use crate::kv::{KvCacheRef, KvPart, read_f16, scales_offset, tile_offset};
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
        (self.seq.q_row + self.task.j0 + r / h) * self.n_heads * self.hd
            + (self.task.h0 + r % h) * self.hd
    }
    /// Tokens of block `b` that row `r` attends to.
    pub(super) fn valid(&self, r: usize, b: usize) -> usize {
        (self.pos(r) + 1).saturating_sub(b * self.bs).min(self.bs)
    }
}

/// The K or V tile of block `b` (table index) for the task's KV head, and for Int8 its f16
/// scales (K: one per channel; V: one per token).
fn tile<'c>(
    cache: &KvCacheRef<'c>,
    layer: usize,
    rows: &Rows<'_>,
    b: usize,
    part: KvPart,
) -> (&'c [u8], Option<&'c [u8]>) {
    let l = cache.layout;
    let slab = cache.slab(layer, rows.seq.block_table[b] as usize);
    let at = tile_offset(l, rows.task.kv_head, part);
    let scales = (l.dtype == KvDtype::Int8).then(|| {
        let s = scales_offset(l, rows.task.kv_head, part);
        let n = match part {
            KvPart::K => l.head_dim,
            KvPart::V => rows.bs,
        };
        &slab[s..s + 2 * n]
    });
    (
        &slab[at..at + rows.bs * l.head_dim * l.dtype.elem_bytes()],
        scales,
    )
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
#[allow(clippy::too_many_arguments)]
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
    let (ktile, kscales) = tile(cache, layer, rows, b, KvPart::K);
    let (hd, esz) = (rows.hd, cache.layout.dtype.elem_bytes());
    // Int8 keys carry one scale per channel: fold it into the query (q'_c = q_c · s_c), so the
    // score is dot(q', k_int8) with a unit scale.
    let mut qs = Vec::new();
    for r in 0..rows.len() {
        let n = rows.valid(r, b);
        if n > 0 {
            let qr = &q[rows.at(r)..rows.at(r) + hd];
            let (qr, kscale) = match kscales {
                Some(scales) => {
                    qs.clear();
                    qs.extend(
                        qr.iter()
                            .enumerate()
                            .map(|(c, &x)| x * read_f16(scales, 2 * c)),
                    );
                    (&qs[..], Some(1.0))
                }
                None => (qr, None),
            };
            // SAFETY: per the contract this (row, block) range is ours; `ktile` holds n tokens.
            unsafe {
                let srow = std::slice::from_raw_parts_mut(s.add(r * stride + b * rows.bs), n);
                scores(
                    isa,
                    cache.layout.dtype,
                    qr,
                    &ktile[..n * hd * esz],
                    n,
                    kscale,
                    scale,
                    srow,
                );
            }
        }
    }
}

/// Adds the weighted V rows of blocks `blocks` into the accumulators `acc[r * hd_pad + d]`,
/// `d` in `dims`, reading weights `e[r * stride + position]`.
///
/// Blocks every row attends to in full go `MAX_TILES` at a time (one call, accumulators kept
/// in registers across them), rows `V_GROUP` at a time sharing each V load. The remaining
/// blocks (the diagonal of a prefill, the last partial block) go one by one; within one, rows
/// share the tokens they all attend to, and a row that attends to more finishes alone. Every
/// row's chain stays in token order throughout.
///
/// # Safety
/// `e` holds the rows' weights for these blocks; the `dims` of each accumulator row are ours
/// alone during the call; `acc` rows are `hd` rounded up to 16 floats apart.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn v_blocks(
    isa: Isa,
    cache: &KvCacheRef<'_>,
    layer: usize,
    rows: &Rows<'_>,
    blocks: std::ops::Range<usize>,
    e: *const f32,
    stride: usize,
    acc: *mut f32,
    dims: std::ops::Range<usize>,
) {
    let (hd, bs, dt) = (rows.hd, rows.bs, cache.layout.dtype);
    let hd_pad = hd.next_multiple_of(16);
    let n_rows = rows.len();
    let full_end = (0..n_rows)
        .map(|r| (rows.pos(r) + 1) / bs)
        .min()
        .unwrap_or(0)
        .clamp(blocks.start, blocks.end);
    let chunks: Vec<std::ops::Range<usize>> = (blocks.start..full_end)
        .step_by(MAX_TILES)
        .map(|c0| c0..(c0 + MAX_TILES).min(full_end))
        .chain((full_end..blocks.end).map(|b| b..b + 1))
        .collect();
    for (ci, chunk) in chunks.iter().enumerate() {
        if let Some(next) = chunks.get(ci + 1) {
            for b in next.clone() {
                prefetch(tile(cache, layer, rows, b, KvPart::V).0);
            }
        }
        let mut tiles: [&[u8]; MAX_TILES] = [&[]; MAX_TILES];
        // Int8: every token's value scale, tile by tile (`bs` per tile).
        let mut vscales = Vec::new();
        for (i, b) in chunk.clone().enumerate() {
            let (t, s) = tile(cache, layer, rows, b, KvPart::V);
            tiles[i] = t;
            if let Some(scales) = s {
                vscales.extend((0..bs).map(|t| read_f16(scales, 2 * t)));
            }
        }
        let k = chunk.len();
        // Spans (first row, end row, first token, end token) of this chunk, relative to it.
        let mut spans = [(0usize, 0usize, 0usize, 0usize); V_GROUP + 1];
        for g0 in (0..n_rows).step_by(V_GROUP) {
            let g1 = (g0 + V_GROUP).min(n_rows);
            let n_spans = if k > 1 {
                spans[0] = (g0, g1, 0, k * bs);
                1
            } else {
                let b = chunk.start;
                let n_min = (g0..g1).map(|r| rows.valid(r, b)).min().unwrap_or(0);
                let mut n = 0;
                if n_min > 0 {
                    spans[0] = (g0, g1, 0, n_min);
                    n = 1;
                }
                for r in g0..g1 {
                    if rows.valid(r, b) > n_min {
                        spans[n] = (r, r + 1, n_min, rows.valid(r, b));
                        n += 1;
                    }
                }
                n
            };
            for &(r0, r1, from, to) in &spans[..n_spans] {
                let row = |i: usize| (r0 + i).min(r1 - 1);
                let base = chunk.start * bs + from;
                // SAFETY: the weights of these (row, position) pairs exist per the contract.
                let w: [&[f32]; V_GROUP] = std::array::from_fn(|i| unsafe {
                    std::slice::from_raw_parts(e.add(row(i) * stride + base), to - from)
                });
                // SAFETY: row < n_rows; accumulator rows are hd_pad apart.
                let a: [*mut f32; V_GROUP] =
                    std::array::from_fn(|i| unsafe { acc.add(row(i) * hd_pad) });
                let esz = dt.elem_bytes();
                let one = if k == 1 {
                    [&tiles[0][from * hd * esz..to * hd * esz]]
                } else {
                    [&[][..]]
                };
                let (ts, n): (&[&[u8]], usize) = if k > 1 {
                    (&tiles[..k], bs)
                } else {
                    (&one, to - from)
                };
                // Scales of exactly the tokens passed: all of each tile, or `from..to` of one.
                let scales = match (dt == KvDtype::Int8, k > 1) {
                    (false, _) => &[][..],
                    (true, true) => &vscales[..],
                    (true, false) => &vscales[from..to],
                };
                // SAFETY: each tile holds n tokens; only the first r1 - r0 (distinct) rows are used.
                unsafe {
                    accumulate_v(
                        isa,
                        dt,
                        &w[..r1 - r0],
                        ts,
                        n,
                        scales,
                        hd,
                        dims.clone(),
                        &a[..r1 - r0],
                    )
                };
            }
        }
    }
}
