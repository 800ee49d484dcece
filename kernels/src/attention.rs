//! Causal paged attention with grouped-query heads, reading KV straight from the pool bytes.
//!
//! For each sequence, query `j` (position `p = first_pos + j`) of head `h` attends to KV
//! positions `0..=p` of KV head `h / (n_heads / kv_heads)`, found through the block table (no
//! gather into a contiguous copy). Canonical order per (query, head):
//!
//! 1. `s_t = dot(q, k_t) * scale` for `t = 0..=p` (16-lane dot + fixed tree; Int8:
//!    `(dot(q, k_t) * kscale_block) * scale`);
//! 2. `m = max_t s_t`; `e_t = exp(s_t - m)`; `sum` = 16-lane sum of `e_t`, lane `t % 16`;
//! 3. `acc = fma(e_t, v_t, acc)` over `t` ascending (Int8: weight `e_t * vscale_block`);
//! 4. `out = acc / sum`.
//!
//! So a query's output depends only on its position and the KV it reads: not on the other
//! queries, how the prompt was chunked, the batch, the threads, or the ISA.
//!
//! Parallelism: tasks are (sequence, KV head, tile of queries), or (…, single head) when there
//! are too few of those to keep every thread busy (decode of one sequence). A task computes the
//! scores of its rows block by block (one K tile, up to `block_size × head_dim`, shared by all
//! the rows of the group while it is in L1), then the weighted V sums with up to 4 rows sharing
//! each V load. Cost: `2 × rows × ctx × head_dim` FMAs; K and V are read once per task.

use crate::error::check_len;
use crate::kv::{KvCacheRef, KvPart, check_pool, read_f32, scale_offset, tile_offset};
use crate::linear::SyncPtr;
use crate::simd::{Isa, portable, prefetch};
use crate::{Exec, KernelError};
use std::cell::RefCell;
use tandem_kv_layout::KvDtype;

/// One sequence's slice of a batched attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<'a> {
    /// Physical block ids, in position order.
    pub block_table: &'a [u32],
    /// First row of this sequence's queries in `q`.
    pub q_row: usize,
    /// Number of query tokens (prefill chunk length, or 1 for decode).
    pub q_len: usize,
    /// Absolute position of the first query token.
    pub first_pos: usize,
}

/// Scores kept per task: query tiles shrink so `rows × context` stays near this many floats.
const SCRATCH_TARGET_FLOATS: usize = 1 << 16;
/// Largest query tile.
const MAX_QUERY_TILE: usize = 16;
/// KV tiles prefetched ahead of the one being processed.
const PREFETCH_BLOCKS: usize = 2;
/// Rows sharing one V load.
const V_GROUP: usize = 4;

/// Causal paged attention with GQA; see the module docs. `q` and `out` are
/// `[T × n_heads × head_dim]`; `scale` is usually `1/sqrt(head_dim)`.
pub fn paged_attention(
    cache: &KvCacheRef<'_>,
    layer: usize,
    q: &[f32],
    n_heads: usize,
    seqs: &[AttnSeq<'_>],
    scale: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    paged_attention_on(&Exec::global(), cache, layer, q, n_heads, seqs, scale, out)
}

#[derive(Clone, Copy)]
struct Task {
    seq: usize,
    kv_head: usize,
    j0: usize,
    j1: usize,
    h0: usize,
    h1: usize,
}

/// [`paged_attention`] on an explicit pool and ISA.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_on(
    exec: &Exec<'_>,
    cache: &KvCacheRef<'_>,
    layer: usize,
    q: &[f32],
    n_heads: usize,
    seqs: &[AttnSeq<'_>],
    scale: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "paged_attention";
    let l = cache.layout;
    check_pool(OP, l, cache.num_blocks, cache.bytes.len(), layer)?;
    if n_heads == 0 || n_heads % l.num_kv_heads != 0 {
        return Err(KernelError::NotDivisible {
            op: OP,
            what: "n_heads by kv_heads",
            numerator: n_heads,
            denominator: l.num_kv_heads,
        });
    }
    let row = n_heads * l.head_dim;
    check_len(OP, "q (a multiple of n_heads * head_dim)", q.len().next_multiple_of(row), q.len())?;
    check_len(OP, "out", q.len(), out.len())?;
    let total_rows = q.len() / row;
    validate_seqs(OP, cache, seqs, total_rows)?;

    let group = n_heads / l.num_kv_heads;
    let mut tasks = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        if s.q_len == 0 {
            continue;
        }
        let ctx = s.first_pos + s.q_len;
        let tile = (SCRATCH_TARGET_FLOATS / (group * ctx)).clamp(1, MAX_QUERY_TILE);
        for kv_head in 0..l.num_kv_heads {
            for j0 in (0..s.q_len).step_by(tile) {
                let (h0, h1) = (kv_head * group, (kv_head + 1) * group);
                tasks.push(Task { seq: si, kv_head, j0, j1: (j0 + tile).min(s.q_len), h0, h1 });
            }
        }
    }
    if tasks.len() < 2 * exec.pool().threads() && group > 1 {
        tasks = tasks
            .iter()
            .flat_map(|t| (t.h0..t.h1).map(move |h| Task { h0: h, h1: h + 1, ..*t }))
            .collect();
    }
    let isa = exec.isa();
    let optr = SyncPtr(out.as_mut_ptr());
    let run = |i: usize| {
        let optr = optr;
        let t = tasks[i];
        // SAFETY: validated shapes; tasks own disjoint (query row, head) outputs.
        unsafe { run_task(isa, cache, layer, q, n_heads, &seqs[t.seq], t, scale, optr.0) }
    };
    if tasks.len() == 1 || exec.pool().threads() == 1 {
        (0..tasks.len()).for_each(run);
    } else {
        exec.pool().run(tasks.len(), &run);
    }
    Ok(())
}

fn validate_seqs(
    op: &'static str,
    cache: &KvCacheRef<'_>,
    seqs: &[AttnSeq<'_>],
    total_rows: usize,
) -> Result<(), KernelError> {
    let bs = cache.layout.block_size_tokens;
    for (si, s) in seqs.iter().enumerate() {
        if s.q_row + s.q_len > total_rows {
            return Err(KernelError::QueryRowsOutOfRange {
                op,
                seq: si,
                first_row: s.q_row,
                end_row: s.q_row + s.q_len,
                total_rows,
            });
        }
        if s.q_len == 0 {
            continue;
        }
        let last_pos = s.first_pos + s.q_len - 1;
        let needed = last_pos / bs + 1;
        if needed > s.block_table.len() {
            return Err(KernelError::BlockTableTooShort {
                op,
                seq: si,
                last_pos,
                needed_blocks: needed,
                table_blocks: s.block_table.len(),
            });
        }
        if let Some(&b) = s.block_table[..needed].iter().find(|&&b| b as usize >= cache.num_blocks) {
            return Err(KernelError::BlockOutOfRange { op, block: b as usize, num_blocks: cache.num_blocks });
        }
    }
    let mut spans: Vec<(usize, usize, usize)> =
        seqs.iter().enumerate().filter(|(_, s)| s.q_len > 0).map(|(i, s)| (s.q_row, s.q_row + s.q_len, i)).collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(KernelError::QueryRowsOverlap { op, seq_a: w[0].2, seq_b: w[1].2 });
        }
    }
    Ok(())
}

thread_local! {
    /// (scores, accumulators, softmax sums), reused across calls on the same thread.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// # Safety
/// Validated call; `out` valid for the whole output; no other task writes this task's rows.
#[allow(clippy::too_many_arguments)]
unsafe fn run_task(
    isa: Isa,
    cache: &KvCacheRef<'_>,
    layer: usize,
    q: &[f32],
    n_heads: usize,
    s: &AttnSeq<'_>,
    t: Task,
    scale: f32,
    out: *mut f32,
) {
    let l = cache.layout;
    let (hd, bs, nb) = (l.head_dim, l.block_size_tokens, cache.num_blocks);
    let hd_pad = hd.next_multiple_of(16);
    let esz = l.dtype.elem_bytes();
    let heads = t.h1 - t.h0;
    let n_rows = (t.j1 - t.j0) * heads;
    // Row r = (query j0 + r / heads, head h0 + r % heads); it attends to positions 0..=pos(r).
    let pos = |r: usize| s.first_pos + t.j0 + r / heads;
    let ctx = pos(n_rows - 1) + 1;
    let q_of = |r: usize| {
        let at = (s.q_row + t.j0 + r / heads) * n_heads * hd + (t.h0 + r % heads) * hd;
        &q[at..at + hd]
    };
    let valid = |r: usize, b: usize| (pos(r) + 1).saturating_sub(b * bs).min(bs);
    SCRATCH.with(|sc| {
        let mut sc = sc.borrow_mut();
        let (sbuf, abuf, sums) = &mut *sc;
        sbuf.clear();
        sbuf.resize(n_rows * ctx, 0.0);
        abuf.clear();
        abuf.resize(n_rows * hd_pad, 0.0);
        let n_blocks = ctx.div_ceil(bs);
        let tile_bytes = bs * hd * esz;
        let tile_of = |b: usize, part: KvPart| {
            let at = tile_offset(l, nb, layer, s.block_table[b] as usize, t.kv_head, part);
            &cache.bytes[at..at + tile_bytes]
        };
        for b in 0..n_blocks.min(PREFETCH_BLOCKS) {
            prefetch(tile_of(b, KvPart::K));
        }
        for b in 0..n_blocks {
            if b + PREFETCH_BLOCKS < n_blocks {
                prefetch(tile_of(b + PREFETCH_BLOCKS, KvPart::K));
            }
            let block = s.block_table[b] as usize;
            let tile_at = tile_offset(l, nb, layer, block, t.kv_head, KvPart::K);
            let kscale = (l.dtype == KvDtype::Int8)
                .then(|| read_f32(cache.bytes, scale_offset(l, nb, layer, block, t.kv_head, KvPart::K)));
            for r in 0..n_rows {
                let n = valid(r, b);
                if n > 0 {
                    let tile = &cache.bytes[tile_at..tile_at + n * hd * esz];
                    let srow = &mut sbuf[r * ctx + b * bs..r * ctx + b * bs + n];
                    // SAFETY: `tile` holds n tokens; `srow` has room for n.
                    unsafe { scores(isa, l.dtype, q_of(r), tile, n, kscale, scale, srow) };
                }
            }
        }
        sums.clear();
        sums.extend((0..n_rows).map(|r| softmax_weights(isa, &mut sbuf[r * ctx..r * ctx + pos(r) + 1])));
        for b in 0..n_blocks.min(PREFETCH_BLOCKS) {
            prefetch(tile_of(b, KvPart::V));
        }
        for b in 0..n_blocks {
            if b + PREFETCH_BLOCKS < n_blocks {
                prefetch(tile_of(b + PREFETCH_BLOCKS, KvPart::V));
            }
            let block = s.block_table[b] as usize;
            let tile_at = tile_offset(l, nb, layer, block, t.kv_head, KvPart::V);
            let vscale = (l.dtype == KvDtype::Int8)
                .then(|| read_f32(cache.bytes, scale_offset(l, nb, layer, block, t.kv_head, KvPart::V)));
            for g0 in (0..n_rows).step_by(V_GROUP) {
                let g1 = (g0 + V_GROUP).min(n_rows);
                // Tokens all rows of the group attend to go through one call sharing V loads;
                // a row that attends to more (prefill, diagonal block) finishes alone. The chain
                // per row stays in token order: the second call continues where the first ended.
                let n_min = (g0..g1).map(|r| valid(r, b)).min().unwrap_or(0);
                let mut spans = [(0usize, 0usize, 0usize, 0usize); V_GROUP + 1];
                let mut n_spans = 0;
                if n_min > 0 {
                    spans[0] = (g0, g1, 0, n_min);
                    n_spans = 1;
                }
                for r in g0..g1 {
                    if valid(r, b) > n_min {
                        spans[n_spans] = (r, r + 1, n_min, valid(r, b));
                        n_spans += 1;
                    }
                }
                for &(r0, r1, from, to) in &spans[..n_spans] {
                    let tile = &cache.bytes[tile_at + from * hd * esz..tile_at + to * hd * esz];
                    let e: [&[f32]; V_GROUP] = std::array::from_fn(|i| {
                        let r = (r0 + i).min(r1 - 1);
                        &sbuf[r * ctx + b * bs + from..r * ctx + b * bs + to]
                    });
                    let ap = abuf.as_mut_ptr();
                    let acc: [*mut f32; V_GROUP] = std::array::from_fn(|i| {
                        // SAFETY: row r < n_rows; abuf holds n_rows * hd_pad floats.
                        unsafe { ap.add((r0 + i).min(r1 - 1) * hd_pad) }
                    });
                    // SAFETY: tile holds `to - from` tokens, each e row as many weights, acc rows
                    // hd_pad floats; only the first r1 - r0 (distinct) rows are used.
                    unsafe { accumulate_v(isa, l.dtype, &e[..r1 - r0], tile, to - from, hd, vscale, &acc[..r1 - r0]) };
                }
            }
        }
        for r in 0..n_rows {
            let at = (s.q_row + t.j0 + r / heads) * n_heads * hd + (t.h0 + r % heads) * hd;
            for d in 0..hd {
                // SAFETY: this task owns output (row, head); `at + d` is inside `out`.
                unsafe { *out.add(at + d) = abuf[r * hd_pad + d] / sums[r] };
            }
        }
    });
}

/// # Safety
/// `tile` holds `n` tokens of `q.len()` elements; `s` has room for `n`.
#[allow(clippy::too_many_arguments)]
unsafe fn scores(isa: Isa, dt: KvDtype, q: &[f32], tile: &[u8], n: usize, ks: Option<f32>, mul: f32, s: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    use crate::simd::{avx512::DT_I8, avx512_gemm::{DT_BF16, DT_F16, DT_F32}};
    #[cfg(target_arch = "x86_64")]
    macro_rules! go {
        ($m:ident) => {
            unsafe {
                match dt {
                    KvDtype::F32 => crate::simd::$m::scores::<DT_F32>(q, tile.as_ptr(), n, ks, mul, s),
                    KvDtype::F16 => crate::simd::$m::scores::<DT_F16>(q, tile.as_ptr(), n, ks, mul, s),
                    KvDtype::Bf16 => crate::simd::$m::scores::<DT_BF16>(q, tile.as_ptr(), n, ks, mul, s),
                    KvDtype::Int8 => crate::simd::$m::scores::<DT_I8>(q, tile.as_ptr(), n, ks, mul, s),
                }
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => go!(avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => go!(avx2),
        _ => portable::scores(q, tile, kv_loader(dt), n, ks, mul, s),
    }
}

fn kv_loader(dt: KvDtype) -> portable::KvLoad {
    match dt {
        KvDtype::F32 => portable::kv_load_f32,
        KvDtype::F16 => portable::kv_load_f16,
        KvDtype::Bf16 => portable::kv_load_bf16,
        KvDtype::Int8 => portable::kv_load_i8,
    }
}

fn softmax_weights(isa: Isa, s: &mut [f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Exec` only holds supported ISAs.
        Isa::Avx512 => unsafe { crate::simd::avx512::softmax_weights(s) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { crate::simd::avx2::softmax_weights(s) },
        _ => portable::softmax_weights(s),
    }
}

/// # Safety
/// `tile` holds `n` tokens of `hd` elements; each `e` row has `n` weights; each `acc` row points
/// at `hd` rounded up to 16 floats, not aliased elsewhere during the call. `e.len() <= 4`.
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_v(
    isa: Isa,
    dt: KvDtype,
    e: &[&[f32]],
    tile: &[u8],
    n: usize,
    hd: usize,
    vs: Option<f32>,
    acc: &[*mut f32],
) {
    #[cfg(target_arch = "x86_64")]
    use crate::simd::{avx512::DT_I8, avx512_gemm::{DT_BF16, DT_F16, DT_F32}};
    #[cfg(target_arch = "x86_64")]
    macro_rules! go_g {
        ($m:ident, $g:literal) => {{
            let er: [&[f32]; $g] = std::array::from_fn(|i| e[i]);
            let ar: [*mut f32; $g] = std::array::from_fn(|i| acc[i]);
            let p = tile.as_ptr();
            unsafe {
                match dt {
                    KvDtype::F32 => crate::simd::$m::accumulate_v::<DT_F32, $g>(er, p, n, hd, vs, ar),
                    KvDtype::F16 => crate::simd::$m::accumulate_v::<DT_F16, $g>(er, p, n, hd, vs, ar),
                    KvDtype::Bf16 => crate::simd::$m::accumulate_v::<DT_BF16, $g>(er, p, n, hd, vs, ar),
                    KvDtype::Int8 => crate::simd::$m::accumulate_v::<DT_I8, $g>(er, p, n, hd, vs, ar),
                }
            }
        }};
    }
    #[cfg(target_arch = "x86_64")]
    macro_rules! go {
        ($m:ident) => {
            match e.len() {
                1 => go_g!($m, 1),
                2 => go_g!($m, 2),
                3 => go_g!($m, 3),
                _ => go_g!($m, 4),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => go!(avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => go!(avx2),
        _ => {
            // SAFETY: per the contract each row is `hd` floats, unaliased.
            let mut rows: Vec<&mut [f32]> =
                acc.iter().map(|&p| unsafe { std::slice::from_raw_parts_mut(p, hd) }).collect();
            portable::accumulate_v(e, tile, kv_loader(dt), n, vs, &mut rows)
        }
    }
}
