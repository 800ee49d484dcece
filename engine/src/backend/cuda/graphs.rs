//! Decode steps as CUDA graphs: a step in which every sequence runs one token is queued as one
//! graph launch instead of ~15 kernels a layer. Small models' decode is launch-bound (SmolLM2's
//! 30 layers are ~450 launches a step), and this is what closes it.
//!
//! A graph is captured once per bucket, `(sequences, blocks, pick)`: sequences rounded up to a
//! power of two (at most [`MAX_GRAPH_SEQS`]), the widest block table rounded up to a power of two
//! (at least [`MIN_GRAPH_BLOCKS`]), and what the head leaves (logits, argmax, sampled tokens). A step
//! of `n` sequences runs in bucket `B ≥ n`: rows `n..B` are padding (token 0 at position 0, KV
//! slot -1 so nothing is written, context 0 so attention reads nothing), and only the first `n`
//! rows' results are read back. Each sequence bucket owns its buffers (allocated once, at its
//! first capture), shared by its graphs; the values that change (ids, positions, slots, block
//! tables, context lengths, sampling specs) are copied into them before each replay.
//!
//! # Invariants
//! - A replay runs the same kernels as the eager forward (`enqueue`), on the bucket's shapes:
//!   the split-decode plan is the bucket's (its block count), so a replay's sums may be split
//!   differently than an eager step's of the same batch (float rounding, not other math).
//! - Graphs hold the KV pool's and the weights' addresses: they are dropped when the forward
//!   sees another pool.
//! - A capture that fails turns graphs off for this forward, says so once (warn) and counts in
//!   [`DecodeGraphs::fallbacks`]; steps then run eagerly. `TANDEM_CUDA_GRAPHS=0` turns them off.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use cudarc::driver::{CudaSlice, DevicePtr};
use tandem_kernels::sample::SampleSpec;
use tandem_kernels_cuda::{CudaDevice, CudaError, DecodeWorkspace, DeviceGraph, launch};

use super::enqueue::{Attn, HeadBufs, HeadPick, Parts, StepBufs};
use super::{AttnIndex, CudaKv, StepIndex};

/// Most sequences a captured decode step holds (larger steps run eagerly).
pub const MAX_GRAPH_SEQS: usize = 256;
/// The narrowest block table a graph is captured for (256 tokens of 16-token blocks).
pub const MIN_GRAPH_BLOCKS: usize = 16;
/// Environment switch: `0` runs every step eagerly.
pub const ENV: &str = "TANDEM_CUDA_GRAPHS";

/// One sequence bucket's buffers: what its graphs read and write.
struct SeqBucket {
    ids: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    slots: CudaSlice<i64>,
    ctx_lens: CudaSlice<i32>,
    /// Block tables by width (blocks per row).
    tables: HashMap<usize, CudaSlice<u32>>,
    step: StepBufs,
    head: HeadBufs,
    ws: DecodeWorkspace,
}

impl SeqBucket {
    /// Zeroed buffers for `seqs` sequences (tables come per width, later).
    fn new(d: &CudaDevice, parts: &Parts<'_>, seqs: usize) -> Result<SeqBucket, CudaError> {
        let c = parts.c;
        Ok(SeqBucket {
            ids: d.alloc_zeros(seqs)?,
            positions: d.alloc_zeros(seqs)?,
            slots: d.alloc_zeros(seqs)?,
            ctx_lens: d.alloc_zeros(seqs)?,
            tables: HashMap::new(),
            step: StepBufs::new(d, c, parts.shard, parts.w.dtype, seqs)?,
            head: HeadBufs::new(d, c, parts.w.dtype, seqs)?,
            ws: DecodeWorkspace::new(d, seqs, parts.shard.heads(c), c.head_dim(), bucket_splits(seqs, parts.shard.heads(c)))?,
        })
    }
}

/// Most splits a bucket's decode workspace holds: the split plan asks for about two blocks of
/// threads per SM (`launch::decode_plan`), so a bucket of `seqs × heads` blocks needs at most
/// `2 × SMs / (seqs × heads)` splits; 256 SMs covers every GPU tandem targets. A 70B-shaped
/// bucket of 256 sequences then holds 1 split (8 MiB), not 64 (512 MiB).
fn bucket_splits(seqs: usize, heads: usize) -> usize {
    const SMS: usize = 256;
    (2 * SMS).div_ceil((seqs * heads).max(1)).clamp(1, launch::MAX_DECODE_SPLITS)
}

/// The captured decode graphs of one forward, and their buffers.
pub(super) struct DecodeGraphs {
    enabled: bool,
    /// The KV pool the graphs were captured against (its device address).
    pool: u64,
    buckets: HashMap<usize, SeqBucket>,
    graphs: HashMap<(usize, usize, HeadPick), DeviceGraph>,
    /// Steps replayed from a graph.
    pub replays: u64,
    /// Captures that failed (graphs are off after the first).
    pub fallbacks: u64,
}

/// What a replayed step read back: the first `n` rows' ids or logits.
pub(super) enum GraphOut {
    Ids(Vec<i32>),
    Logits(Vec<f32>),
}

impl DecodeGraphs {
    /// Graphs on unless `TANDEM_CUDA_GRAPHS=0`.
    pub fn from_env() -> DecodeGraphs {
        let enabled = std::env::var(ENV).map_or(true, |v| v.trim() != "0");
        if !enabled {
            tracing::info!("{ENV}=0: decode steps run without CUDA graphs");
        }
        DecodeGraphs { enabled, pool: 0, buckets: HashMap::new(), graphs: HashMap::new(), replays: 0, fallbacks: 0 }
    }

    /// Runs a decode step of `n` sequences (one token each, every one wanting its row) from a
    /// graph; `Ok(None)` when it does not fit one (too many sequences or too wide a table) or
    /// graphs are off, and the caller runs it eagerly.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        d: &CudaDevice,
        parts: &Parts<'_>,
        kv: &mut CudaKv,
        ix: &StepIndex,
        attn_ix: &AttnIndex,
        pick: HeadPick,
        specs: &[SampleSpec],
    ) -> Result<Option<GraphOut>, CudaError> {
        let n = ix.ids.len();
        let bs = kv.pool.layout.block_size_tokens;
        let max_blocks = parts.c.max_position_embeddings.div_ceil(bs).next_power_of_two();
        let seqs = n.next_power_of_two();
        let blocks = attn_ix.max_blocks.next_power_of_two().max(MIN_GRAPH_BLOCKS).min(max_blocks);
        if !self.enabled || n == 0 || seqs > MAX_GRAPH_SEQS || attn_ix.max_blocks > blocks {
            return Ok(None);
        }
        let pool = {
            let (p, _guard) = kv.pool.bytes.device_ptr(d.stream());
            p
        };
        if pool != self.pool {
            self.graphs.clear();
            self.pool = pool;
        }
        let bucket = match self.buckets.entry(seqs) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => v.insert(SeqBucket::new(d, parts, seqs)?),
        };
        if let Entry::Vacant(v) = bucket.tables.entry(blocks) {
            v.insert(d.alloc_zeros(seqs * blocks)?);
        }
        let key = (seqs, blocks, pick);
        if let Entry::Vacant(v) = self.graphs.entry(key) {
            let t0 = std::time::Instant::now();
            match capture(d, parts, kv, bucket, blocks, pick) {
                Ok(g) => {
                    tracing::debug!(seqs, blocks, ?pick, us = t0.elapsed().as_micros() as u64, "decode graph captured");
                    v.insert(g);
                }
                Err(e) => {
                    self.enabled = false;
                    self.fallbacks += 1;
                    tracing::warn!(error = %e, seqs, blocks, "CUDA graph capture failed: decode steps run without graphs from now on");
                    return Ok(None);
                }
            }
        }

        // This step's values into the bucket's buffers, padded.
        let p = Padded::new(ix, attn_ix, seqs, blocks);
        let stream = d.stream();
        let copy = |e| CudaError::driver("cuMemcpyHtoDAsync", e);
        stream.memcpy_htod(&p.ids, &mut bucket.ids).map_err(copy)?;
        stream.memcpy_htod(&p.positions, &mut bucket.positions).map_err(copy)?;
        stream.memcpy_htod(&p.slots, &mut bucket.slots).map_err(copy)?;
        stream.memcpy_htod(&p.ctx_lens, &mut bucket.ctx_lens).map_err(copy)?;
        let table_buf = bucket.tables.get_mut(&blocks).expect("allocated above");
        stream.memcpy_htod(&p.tables, table_buf).map_err(copy)?;
        if pick == HeadPick::Sample {
            bucket.head.set_specs(d, specs)?;
        }
        self.graphs[&key].launch()?;
        self.replays += 1;
        // Only the step's own rows come back, not the padding.
        let back = |e| CudaError::driver("cuMemcpyDtoHAsync", e);
        Ok(Some(if pick != HeadPick::Logits {
            GraphOut::Ids(stream.clone_dtoh(&bucket.head.ids.slice(..n)).map_err(back)?)
        } else {
            let rows = n * parts.c.vocab_size;
            GraphOut::Logits(stream.clone_dtoh(&bucket.head.logits.slice(..rows)).map_err(back)?)
        }))
    }
}

/// A decode step's index arrays padded to its bucket: `seqs` rows, tables `blocks` wide. Pad
/// rows are token 0 at position 0 with KV slot -1 (the RoPE/KV kernel writes nothing there)
/// and context 0 (attention reads nothing and writes zeros).
struct Padded {
    ids: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i64>,
    ctx_lens: Vec<i32>,
    tables: Vec<u32>,
}

impl Padded {
    fn new(ix: &StepIndex, attn_ix: &AttnIndex, seqs: usize, blocks: usize) -> Padded {
        let pad = |v: &[i32]| {
            let mut out = v.to_vec();
            out.resize(seqs, 0);
            out
        };
        let mut slots = ix.slots.clone();
        slots.resize(seqs, -1);
        let mut tables = vec![0u32; seqs * blocks];
        for (i, row) in attn_ix.tables.chunks_exact(attn_ix.max_blocks).enumerate() {
            tables[i * blocks..i * blocks + row.len()].copy_from_slice(row);
        }
        Padded { ids: pad(&ix.ids), positions: pad(&ix.positions), slots, ctx_lens: pad(&attn_ix.ctx_lens), tables }
    }
}

/// Captures a decode step of `bucket`'s shape over tables `blocks` wide.
fn capture(
    d: &CudaDevice,
    parts: &Parts<'_>,
    kv: &mut CudaKv,
    bucket: &mut SeqBucket,
    blocks: usize,
    pick: HeadPick,
) -> Result<DeviceGraph, CudaError> {
    let bs = kv.pool.layout.block_size_tokens;
    let SeqBucket { ids, positions, slots, ctx_lens, tables, step, head, ws } = bucket;
    let tables = &tables[&blocks];
    d.capture(|| {
        parts.embed(ids, step)?;
        let mut attn = Attn::Decode { tables, max_blocks: blocks, ctx_lens, max_ctx: blocks * bs, ws };
        for li in 0..parts.w.layers.len() {
            parts.qkv_rope(li, step, positions, slots, &mut kv.pool)?;
            parts.attend_mlp(li, step, &mut attn, &kv.pool)?;
        }
        parts.head(step, None, head, pick)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ForwardSeq;

    #[test]
    fn a_step_pads_to_its_bucket_with_rows_that_write_and_read_nothing() {
        let (a, b) = ([7u32, 3], [4u32]);
        let seqs = [
            ForwardSeq { tokens: &[11], first_pos: 20, block_table: &a, want_logits: true },
            ForwardSeq { tokens: &[12], first_pos: 2, block_table: &b, want_logits: true },
        ];
        let ix = StepIndex { ids: vec![11, 12], positions: vec![20, 2], slots: vec![3 * 16 + 4, 4 * 16 + 2], want: vec![0, 1] };
        let attn = AttnIndex::new(&seqs, 16);
        let p = Padded::new(&ix, &attn, 4, 16);
        assert_eq!(p.ids, vec![11, 12, 0, 0]);
        assert_eq!(p.positions, vec![20, 2, 0, 0]);
        assert_eq!(p.slots, vec![52, 66, -1, -1], "pad rows write no KV");
        assert_eq!(p.ctx_lens, vec![21, 3, 0, 0], "pad rows attend to nothing");
        assert_eq!(p.tables.len(), 4 * 16);
        assert_eq!((&p.tables[..3], &p.tables[16..18]), (&[7, 3, 0][..], &[4, 0][..]));
        assert!(p.tables[32..].iter().all(|&x| x == 0));
    }

    #[test]
    fn bucket_workspaces_hold_the_splits_small_batches_need_and_few_for_large_ones() {
        assert_eq!(bucket_splits(1, 9), 57, "SmolLM2, one sequence: many splits");
        assert_eq!(bucket_splits(1, 1), launch::MAX_DECODE_SPLITS, "capped");
        assert_eq!(bucket_splits(256, 64), 1, "70B shape, 256 sequences");
        assert_eq!(bucket_splits(8, 64), 1);
        assert_eq!(bucket_splits(2, 64), 4);
    }
}
