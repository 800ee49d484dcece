//! Launch shapes of every kernel, in one place, as pure functions of the problem's shape.
//!
//! The constants mirror the `#define`s of the CUDA sources (a unit test reads the sources and
//! checks they agree). Grid dimensions y and z are limited to 65,535 by the hardware; the
//! callers ([`crate::kernels`]) check the shapes that feed them.

use cudarc::driver::LaunchConfig;

/// Threads of the attention kernels (`TANDEM_ATTN_THREADS`, 4 warps).
pub const ATTN_THREADS: u32 = 128;
/// Largest head dimension the attention kernels handle (`TANDEM_MAX_HD`).
pub const MAX_HEAD_DIM: usize = 256;
/// Queries per prefill thread block (`PF_QT`).
pub const PREFILL_QUERY_TILE: usize = 16;
/// KV tokens per prefill tile (`PF_TK`, one per lane).
pub const PREFILL_KV_TILE: usize = 32;
/// Most splits of one decode (bounds the workspace).
pub const MAX_DECODE_SPLITS: usize = 64;
/// Threads of the elementwise kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Most blocks of a grid-stride elementwise launch.
pub const ELEMENTWISE_MAX_BLOCKS: u32 = 1 << 16;
/// Largest grid y / z dimension.
pub const MAX_GRID_YZ: usize = 65_535;

fn cfg(grid: (u32, u32, u32), block: u32, shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes,
    }
}

/// `n` rounded up to a whole number of warps, at least one warp and at most `max`.
pub fn warp_threads(n: usize, max: u32) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, max as usize) as u32
}

/// Grid-stride elementwise kernels over `n` elements (silu_mul, add, embed, conversions).
pub fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n
        .div_ceil(ELEMENTWISE_THREADS as usize)
        .clamp(1, ELEMENTWISE_MAX_BLOCKS as usize);
    cfg((blocks as u32, 1, 1), ELEMENTWISE_THREADS, 0)
}

/// One block per row of `row_len` elements (rms_norm: at most 256 threads; argmax: 1024).
pub fn per_row(rows: usize, row_len: usize, max_threads: u32) -> LaunchConfig {
    cfg((rows as u32, 1, 1), warp_threads(row_len, max_threads), 0)
}

/// RMSNorm of `rows` rows of `n`.
pub fn rms_norm(rows: usize, n: usize) -> LaunchConfig {
    per_row(rows, n, 256)
}

/// Argmax of `rows` rows of `vocab` logits.
pub fn argmax(rows: usize, vocab: usize) -> LaunchConfig {
    per_row(rows, vocab, 1024)
}

/// Threads of a sampling block (`sample.cu`, at most its `TANDEM_SAMPLE_MAX_THREADS`).
pub const SAMPLE_THREADS: u32 = 512;

/// Sampling of `rows` rows of `vocab` logits: one block per row.
pub fn sample(rows: usize, vocab: usize) -> LaunchConfig {
    per_row(rows, vocab, SAMPLE_THREADS)
}

/// RoPE + KV write of `tokens` tokens: one block per token, threads over rotation pairs.
pub fn rope_write_kv(
    tokens: usize,
    n_heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> LaunchConfig {
    cfg(
        (tokens as u32, 1, 1),
        warp_threads((n_heads + kv_heads) * head_dim / 2, 256),
        0,
    )
}

/// How a decode is cut over the context (flash-decoding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    /// KV blocks per split.
    pub blocks_per_split: usize,
    /// Splits of the longest sequence (the grid's z).
    pub num_splits: usize,
}

/// The split of a decode over `num_seqs` sequences of at most `max_ctx` tokens, `n_heads` query
/// heads, on a device with `sm_count` multiprocessors: enough thread blocks for about two per
/// multiprocessor, never more than `max_splits` splits nor fewer than one block per split.
pub fn decode_plan(
    max_ctx: usize,
    block_size: usize,
    num_seqs: usize,
    n_heads: usize,
    sm_count: usize,
    max_splits: usize,
) -> DecodePlan {
    let max_blocks = max_ctx.div_ceil(block_size).max(1);
    let ctas = (num_seqs * n_heads).max(1);
    let want = (2 * sm_count.max(1))
        .div_ceil(ctas)
        .clamp(1, max_splits.max(1));
    let blocks_per_split = max_blocks.div_ceil(want).max(1);
    DecodePlan {
        blocks_per_split,
        num_splits: max_blocks.div_ceil(blocks_per_split),
    }
}

/// The split kernel of a decode: grid (heads, sequences, splits).
pub fn decode(plan: DecodePlan, num_seqs: usize, n_heads: usize) -> LaunchConfig {
    cfg(
        (n_heads as u32, num_seqs as u32, plan.num_splits as u32),
        ATTN_THREADS,
        0,
    )
}

/// The reduce kernel of a decode: grid (heads, sequences), threads over dims.
pub fn decode_reduce(num_seqs: usize, n_heads: usize, head_dim: usize) -> LaunchConfig {
    cfg(
        (n_heads as u32, num_seqs as u32, 1),
        warp_threads(head_dim, 256),
        0,
    )
}

/// Dynamic shared memory of the prefill kernel: Q tile, padded K tile, V tile, all f32.
pub const fn prefill_smem_bytes(head_dim: usize) -> usize {
    4 * (PREFILL_QUERY_TILE * head_dim
        + PREFILL_KV_TILE * (head_dim + 1)
        + PREFILL_KV_TILE * head_dim)
}

/// The prefill kernel: grid (query tiles of the longest chunk, heads, sequences).
pub fn prefill(max_q_len: usize, n_heads: usize, num_seqs: usize, head_dim: usize) -> LaunchConfig {
    cfg(
        (
            max_q_len.div_ceil(PREFILL_QUERY_TILE).max(1) as u32,
            n_heads as u32,
            num_seqs as u32,
        ),
        ATTN_THREADS,
        prefill_smem_bytes(head_dim) as u32,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warp_threads_round_up_and_clamp() {
        assert_eq!(warp_threads(0, 256), 32);
        assert_eq!(warp_threads(1, 256), 32);
        assert_eq!(warp_threads(33, 256), 64);
        assert_eq!(warp_threads(576, 256), 256);
        assert_eq!(warp_threads(49_152, 1024), 1024);
    }

    #[test]
    fn elementwise_covers_small_and_caps_large() {
        assert_eq!(elementwise(1).grid_dim, (1, 1, 1));
        assert_eq!(elementwise(0).grid_dim, (1, 1, 1));
        assert_eq!(elementwise(257).grid_dim, (2, 1, 1));
        assert_eq!(elementwise(1 << 30).grid_dim.0, ELEMENTWISE_MAX_BLOCKS);
    }

    #[test]
    fn rows_get_one_block_each() {
        let c = rms_norm(7, 576);
        assert_eq!((c.grid_dim, c.block_dim), ((7, 1, 1), (256, 1, 1)));
        let c = argmax(3, 49_152);
        assert_eq!((c.grid_dim, c.block_dim), ((3, 1, 1), (1024, 1, 1)));
        let c = rope_write_kv(5, 9, 3, 64);
        assert_eq!((c.grid_dim, c.block_dim), ((5, 1, 1), (256, 1, 1)));
    }

    #[test]
    fn decode_plan_fills_the_device_and_covers_the_context() {
        // One sequence, 9 heads, 2048 tokens in 16-token blocks (128 blocks), 132 SMs.
        let p = decode_plan(2048, 16, 1, 9, 132, MAX_DECODE_SPLITS);
        assert!(p.num_splits * 9 >= 132, "{p:?}");
        assert!(p.num_splits * p.blocks_per_split >= 128);
        assert!(
            (p.num_splits - 1) * p.blocks_per_split < 128,
            "no empty split: {p:?}"
        );
        // Many sequences: no split at all.
        let p = decode_plan(96, 16, 256, 9, 132, MAX_DECODE_SPLITS);
        assert_eq!(
            p,
            DecodePlan {
                blocks_per_split: 6,
                num_splits: 1
            }
        );
        // Short context: never more splits than blocks.
        let p = decode_plan(5, 16, 1, 1, 132, MAX_DECODE_SPLITS);
        assert_eq!(
            p,
            DecodePlan {
                blocks_per_split: 1,
                num_splits: 1
            }
        );
        // The cap holds.
        let p = decode_plan(1 << 20, 16, 1, 1, 1000, 8);
        assert!(p.num_splits <= 8);
        for ctx in 1..300 {
            let p = decode_plan(ctx, 16, 2, 4, 132, 16);
            let blocks = ctx.div_ceil(16);
            assert!(
                p.num_splits * p.blocks_per_split >= blocks && p.num_splits <= 16,
                "{ctx} {p:?}"
            );
        }
    }

    #[test]
    fn prefill_grid_and_shared_memory() {
        let c = prefill(33, 9, 2, 64);
        assert_eq!(c.grid_dim, (3, 9, 2));
        assert_eq!(c.block_dim, (ATTN_THREADS, 1, 1));
        assert_eq!(
            c.shared_mem_bytes as usize,
            4 * (16 * 64 + 32 * 65 + 32 * 64)
        );
        assert!(
            prefill_smem_bytes(128) <= 48 * 1024,
            "hd 128 fits without opt-in"
        );
        assert!(
            prefill_smem_bytes(MAX_HEAD_DIM) <= 99 * 1024,
            "hd 256 fits sm_80+ after opt-in"
        );
    }

    #[test]
    fn constants_match_the_cuda_sources() {
        let attn = include_str!("cu/attention.cu");
        for (define, value) in [
            ("TANDEM_MAX_HD", MAX_HEAD_DIM),
            ("TANDEM_ATTN_THREADS", ATTN_THREADS as usize),
            ("PF_QT", PREFILL_QUERY_TILE),
            ("PF_TK", PREFILL_KV_TILE),
        ] {
            let line = format!("#define {define} {value}\n");
            assert!(attn.contains(&line), "attention.cu lacks `{}`", line.trim());
        }
    }
}
