//! Causal paged attention with grouped-query heads, reading KV straight from the pool bytes.
//!
//! For each sequence, query `j` (position `p = first_pos + j`) of head `h` attends to KV
//! positions `0..=p` of KV head `h / (n_heads / kv_heads)`, found through the block table (no
//! gather into a contiguous copy). Canonical order per (query, head):
//!
//! 1. `s_t = dot(q, k_t) * scale` for `t = 0..=p` (16-lane dot + fixed tree; Int8:
//!    `(dot(q ⊙ kscales, k_t) * 1) * scale`, the per-channel key scales folded into the query);
//! 2. `m = max_t s_t`; `e_t = exp(s_t - m)`; `sum` = 16-lane sum of `e_t`, lane `t % 16`;
//! 3. `acc = fma(e_t, v_t, acc)` over `t` ascending (Int8: weight `e_t * vscale_t`, the token's scale);
//! 4. `out = acc / sum`.
//!
//! So a query's output depends only on its position and the KV it reads: not on the other
//! queries, how the prompt was chunked, the batch, the threads, or the ISA.
//!
//! Parallelism: work is cut into (sequence, KV head, tile of queries) groups, whose rows share
//! every K and V load. With enough groups to occupy the pool, each is one task
//! ([`grouped`]); with fewer (decode of one or two sequences), the groups are split across
//! threads by KV block for the scores and by head dimension for the V sums ([`split`]).
//! Neither split touches a reduction order. Cost: `2 × rows × ctx × head_dim` FMAs; K and V
//! are read from memory once per group.

mod block;
mod dispatch;
mod grouped;
mod split;

use crate::error::check_len;
use crate::kv::{KvCacheRef, check_pool};
use crate::linear::SyncPtr;
use crate::{Exec, KernelError};
use block::Rows;

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

/// A unit of work: queries `j0..j1` of sequence `seq`, heads `h0..h1` (all of KV head
/// `kv_head`'s group).
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
    check_pool(OP, l, cache.num_blocks, cache.len_bytes(), layer)?;
    if n_heads == 0 || !n_heads.is_multiple_of(l.num_kv_heads) {
        return Err(KernelError::NotDivisible {
            op: OP,
            what: "n_heads by kv_heads",
            numerator: n_heads,
            denominator: l.num_kv_heads,
        });
    }
    let row = n_heads * l.head_dim;
    check_len(
        OP,
        "q (a multiple of n_heads * head_dim)",
        q.len().next_multiple_of(row),
        q.len(),
    )?;
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
                tasks.push(Task {
                    seq: si,
                    kv_head,
                    j0,
                    j1: (j0 + tile).min(s.q_len),
                    h0,
                    h1,
                });
            }
        }
    }
    let (hd, bs) = (l.head_dim, l.block_size_tokens);
    let rows: Vec<Rows<'_>> = tasks
        .iter()
        .map(|&task| Rows {
            seq: &seqs[task.seq],
            task,
            n_heads,
            hd,
            bs,
        })
        .collect();
    let threads = exec.pool().threads();
    if threads > 1 && rows.len() < 2 * threads {
        // SAFETY: validated shapes; the groups' rows are disjoint.
        unsafe { split::run_split(exec, cache, layer, q, &rows, scale, out.as_mut_ptr()) };
        return Ok(());
    }
    let isa = exec.isa();
    let optr = SyncPtr(out.as_mut_ptr());
    let run = |i: usize| {
        // SAFETY: validated shapes; tasks own disjoint (query row, head) outputs.
        unsafe { grouped::run_task(isa, cache, layer, q, &rows[i], scale, optr.get()) }
    };
    if rows.len() == 1 || threads == 1 {
        (0..rows.len()).for_each(run);
    } else {
        exec.pool().run(rows.len(), &run);
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
        if let Some(&b) = s.block_table[..needed]
            .iter()
            .find(|&&b| b as usize >= cache.num_blocks)
        {
            return Err(KernelError::BlockOutOfRange {
                op,
                block: b as usize,
                num_blocks: cache.num_blocks,
            });
        }
    }
    let mut spans: Vec<(usize, usize, usize)> = seqs
        .iter()
        .enumerate()
        .filter(|(_, s)| s.q_len > 0)
        .map(|(i, s)| (s.q_row, s.q_row + s.q_len, i))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(KernelError::QueryRowsOverlap {
                op,
                seq_a: w[0].2,
                seq_b: w[1].2,
            });
        }
    }
    Ok(())
}
