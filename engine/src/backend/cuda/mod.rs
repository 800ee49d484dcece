//! The CUDA backend: the forward pass on one GPU (KV in device memory; logits, or greedy rows'
//! token ids, back to the host for the engine's sampler), and the device side of staged
//! disaggregation (layer-by-layer copies to a host mirror; adopted blocks copied up).
//!
//! Same operations, same order as the CPU forward ([`super::cpu`]): embedding; per layer
//! RMSNorm, the Q/K/V projections (three cuBLAS GEMMs on row ranges of the fused `[q; k; v]`
//! matrix, so q, k and v land in their own buffers), RoPE fused with the paged-KV write,
//! paged attention (the decode kernel when every sequence runs one token, the prefill kernel
//! otherwise), O projection and residual add, RMSNorm, gate|up GEMM, SiLU-mul, down GEMM and
//! residual add; then the final norm and the LM head on the rows that need logits (gathered with the
//! embedding kernel, which is a row gather).
//!
//! # Invariants
//! - Runs on the GPU or fails with a typed error; nothing here computes on the CPU.
//! - The KV pool ([`CudaKv`]) is in `tandem-kv-layout`'s bytes with the host pool's layout and
//!   fingerprint, so block ids, the block manager and the prefix cache are the CPU engine's.
//! - Host-side checks are the CPU forward's (context length, block tables, token ids), done
//!   before anything is queued, so a bad request changes nothing on the device.
//! - f32 weights: agrees with the CPU within float rounding (cuBLAS, RMSNorm and attention sum
//!   in other orders), so greedy tokens match except at near-ties. bf16: within bf16 rounding.
//!
//! Steps whose rows need only their pick (greedy, or sampled with temperature / top-k / top-p
//! and no penalties, grammar or log probabilities) pick their tokens on the device: the same
//! tokens the host's sampler picks from the same rows (tandem-kernels `sample`); only the ids
//! come back.
//! Decode steps (one token per sequence, no staging) replay CUDA graphs captured per bucket
//! (`graphs`); prefill steps, and whatever does not fit a bucket, are queued kernel by kernel
//! (`enqueue`, the same calls).
//!
//! The two residual adds of a layer are the epilogues of the O and down GEMMs (cuBLAS's
//! `beta = 1`). Weights, buffers and the KV pool are addressed per tensor-parallel rank
//! ([`shard`]): one rank of one today, with the all-reduces in place for NCCL.
//!
//! Not yet (issue 16): sampling with temperature on the device; prefill buffers sized once
//! (they are taken from the stream-ordered pool again when a step's token count changes).

mod enqueue;
mod graphs;
pub mod shard;
mod weights;

use tandem_kernels_cuda::{
    CudaDevice, CudaError, CudaKernels, DecodeWorkspace, DeviceKvPool, DeviceRopeTable, Gemm, PinnedHost, PtxCache,
    StreamMark, launch,
};
use tandem_kernels::sample::SampleSpec;
use tandem_kv_layout::KvLayout;

use self::enqueue::{Attn, HeadBufs, HeadPick, Parts, StepBufs};
use self::graphs::{DecodeGraphs, GraphOut};
use self::shard::{Collective, Shard, SingleRank};
use self::weights::DevWeights;
use super::staging::{self, HostMirror, StageOut};
use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::kv::KvPool;
use crate::loader::ModelWeights;
use crate::backend::{ForwardSeq, StepLogits};

/// A KV pool in one GPU's memory.
pub struct CudaKv {
    pool: DeviceKvPool,
    ordinal: usize,
}

impl CudaKv {
    /// The layout it holds.
    pub fn layout(&self) -> &KvLayout {
        &self.pool.layout
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

/// The CUDA forward: device, kernels, cuBLAS, uploaded weights and scratch.
pub struct CudaForward {
    dev: CudaDevice,
    kernels: CudaKernels,
    gemm: Gemm,
    rope: DeviceRopeTable,
    w: DevWeights,
    /// This rank's slice of the model, and the group's all-reduce (one rank of one today).
    shard: Shard,
    coll: Box<dyn Collective>,
    step: Option<StepBufs>,
    head: Option<HeadBufs>,
    /// The split-decode workspace and the sequences it has room for.
    ws: Option<(DecodeWorkspace, usize)>,
    graphs: DecodeGraphs,
    logits: Vec<f32>,
    ids: Vec<u32>,
}

/// The device-side index arrays of one step.
struct StepIndex {
    ids: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i64>,
    /// Rows whose logits are wanted.
    want: Vec<i32>,
}

impl CudaForward {
    /// Opens `cuda:ordinal`, loads the kernels (PTX cache: `TANDEM_PTX_CACHE` or the default
    /// directory) and cuBLAS, and uploads `weights` and the RoPE table.
    pub fn new(weights: &ModelWeights, ordinal: usize) -> Result<CudaForward, EngineError> {
        Self::with_collective(weights, ordinal, Box::new(SingleRank))
    }

    /// [`new`](Self::new) for one rank of a tensor-parallel group: uploads only `coll`'s
    /// shard of the weights (see [`shard`]) and all-reduces after the row-parallel GEMMs. A
    /// group of one ([`SingleRank`]) is the whole model.
    pub fn with_collective(weights: &ModelWeights, ordinal: usize, coll: Box<dyn Collective>) -> Result<CudaForward, EngineError> {
        let shard = coll.shard();
        // Refused before anything is opened or uploaded.
        Shard::new(shard.rank, shard.world, &weights.config)?;
        let t0 = std::time::Instant::now();
        let dev = CudaDevice::open(ordinal)?;
        let kernels = CudaKernels::load(&dev, &PtxCache::from_env())?;
        let gemm = Gemm::new(&dev)?;
        let c = &weights.config;
        let table = tandem_kernels::RopeTable::new(c.head_dim(), c.max_position_embeddings, c.rope_theta);
        let rope = DeviceRopeTable::new(&dev, &table)?;
        let w = DevWeights::upload(&dev, weights, shard)?;
        dev.synchronize()?;
        tracing::info!(
            device = %format_args!("cuda:{ordinal}"),
            name = dev.name(),
            weights = w.dtype.as_str(),
            free_mib = dev.free_bytes().unwrap_or(0) >> 20,
            ms = t0.elapsed().as_millis() as u64,
            "CUDA backend ready: kernels loaded, weights uploaded"
        );
        Ok(CudaForward {
            dev,
            kernels,
            gemm,
            rope,
            w,
            shard,
            coll,
            step: None,
            head: None,
            ws: None,
            graphs: DecodeGraphs::from_env(),
            logits: Vec::new(),
            ids: Vec::new(),
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.dev.ordinal()
    }

    /// This rank's slice of the model.
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// A zeroed KV pool of `num_blocks` blocks of `layout` in device memory (f32, f16 or bf16;
    /// int8 is `CudaError::Unsupported`; too large is `CudaError::OutOfMemory` with both sizes).
    pub fn new_kv(&self, layout: KvLayout, num_blocks: usize) -> Result<CudaKv, EngineError> {
        let pool = DeviceKvPool::new(&self.dev, layout, num_blocks)?;
        Ok(CudaKv { pool, ordinal: self.dev.ordinal() })
    }

    /// What a KV transport needs to reach `kv` directly (CUDA IPC): its memory, a stream of
    /// its own and the slab-hash kernel.
    pub fn kv_access(&self, kv: &CudaKv) -> Result<tandem_kernels_cuda::KvDeviceAccess, EngineError> {
        Ok(tandem_kernels_cuda::KvDeviceAccess::new(&self.dev, &kv.pool, &PtxCache::from_env())?)
    }

    /// Page-locks `host` (a KV mirror's pool) for DMA copies to and from this device.
    pub fn pin(&self, host: &KvPool) -> Result<PinnedHost, CudaError> {
        let (ptr, len) = host.raw_region();
        // SAFETY: the pool's region stays mapped while the pool lives, and the `HostMirror`
        // that owns both drops the registration first (its field order).
        unsafe { PinnedHost::register(&self.dev, ptr, len) }
    }

    /// Copies every layer of `blocks` from `mirror` into `kv` and waits until they are there
    /// (a decode node adopting pushed KV).
    pub fn stage_in(&mut self, kv: &mut CudaKv, mirror: &mut HostMirror, blocks: &[u32]) -> Result<(), EngineError> {
        self.dev.context().bind_to_thread().map_err(|e| CudaError::driver("cuCtxSetCurrent", e))?;
        let ranges = staging::all_layer_ranges(&kv.pool.layout, kv.pool.num_blocks, blocks);
        let (host, host_len) = mirror.host().raw_region();
        // SAFETY: the blocks are reserved for this sequence: the transport has finished writing
        // them and nothing writes them before the wait below returns.
        unsafe { kv.pool.copy_from_host(&self.dev, &ranges, host, host_len)? };
        self.dev.mark()?.wait()?;
        mirror.count_in(ranges.iter().map(|r| r.len()).sum());
        Ok(())
    }

    /// Host-side checks (the CPU forward's, in its order) and the step's index arrays.
    fn index(c: &ModelConfig, seqs: &[ForwardSeq<'_>], bs: usize) -> Result<StepIndex, EngineError> {
        let t: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let mut ix = StepIndex {
            ids: Vec::with_capacity(t),
            positions: Vec::with_capacity(t),
            slots: Vec::with_capacity(t),
            want: Vec::new(),
        };
        let (positions, slots) = (&mut ix.positions, &mut ix.slots);
        super::token_slots(c, seqs, bs, |p, slot| {
            // Both fit: positions are below the context limit (an i32 on the device), and
            // slots index a pool that was allocated.
            positions.push(p as i32);
            slots.push(slot as i64);
        })?;
        for seq in seqs {
            for &tok in seq.tokens {
                if tok as usize >= c.vocab_size {
                    return Err(EngineError::InvalidRequest {
                        field: "token_ids",
                        value: tok.to_string(),
                        reason: format!("outside the vocabulary of {} tokens", c.vocab_size),
                    });
                }
                ix.ids.push(tok as i32);
            }
        }
        let mut end = 0;
        for seq in seqs {
            end += seq.tokens.len();
            if seq.want_logits {
                ix.want.push(end as i32 - 1);
            }
        }
        Ok(ix)
    }

    fn step_bufs(&mut self, c: &ModelConfig, t: usize) -> Result<(), CudaError> {
        if self.step.as_ref().is_some_and(|b| b.t == t) {
            return Ok(());
        }
        self.step = None; // free the old shape first
        self.step = Some(StepBufs::new(&self.dev, c, self.shard, self.w.dtype, t)?);
        Ok(())
    }

    /// Sizes the LM head's buffers for `rows` > 0 rows.
    fn head_bufs(&mut self, c: &ModelConfig, rows: usize) -> Result<(), CudaError> {
        if self.head.as_ref().is_some_and(|b| b.rows == rows) {
            return Ok(());
        }
        self.head = None;
        self.head = Some(HeadBufs::new(&self.dev, c, self.w.dtype, rows)?);
        Ok(())
    }

    fn workspace(&mut self, num_seqs: usize, heads: usize, hd: usize) -> Result<(), CudaError> {
        if self.ws.as_ref().is_some_and(|(_, n)| *n >= num_seqs) {
            return Ok(());
        }
        self.ws = None;
        let n = num_seqs.next_power_of_two().max(8);
        let ws = DecodeWorkspace::new(&self.dev, n, heads, hd, launch::MAX_DECODE_SPLITS)?;
        self.ws = Some((ws, n));
        Ok(())
    }

    /// Steps replayed from a CUDA graph, and failed captures (graphs are off after one).
    pub fn graph_counts(&self) -> (u64, u64) {
        (self.graphs.replays, self.graphs.fallbacks)
    }

    /// Runs `seqs`, writing their KV into `kv`; returns the wanted rows' logits, or with `picks`
    /// (one spec per wanted row) their tokens picked on the device (host memory).
    pub(crate) fn forward(
        &mut self,
        c: &ModelConfig,
        seqs: &[ForwardSeq<'_>],
        kv: &mut CudaKv,
        mut stage: Option<&mut StageOut<'_>>,
        picks: Option<&[SampleSpec]>,
        on_layer: &mut dyn FnMut(usize),
    ) -> Result<StepLogits<'_>, EngineError> {
        let (heads, hd) = (self.shard.heads(c), c.head_dim());
        if kv.layout().num_kv_heads != self.shard.kv_heads(c) {
            return Err(EngineError::InvalidConfig {
                field: "kv_pool",
                value: format!("{} KV heads", kv.layout().num_kv_heads),
                reason: format!(
                    "rank {} of {} holds {} of the model's {} KV heads",
                    self.shard.rank,
                    self.shard.world,
                    self.shard.kv_heads(c),
                    c.kv_heads()
                ),
            });
        }
        let bs = kv.layout().block_size_tokens;
        let t: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let ix = Self::index(c, seqs, bs)?;
        let rows = ix.want.len();
        if picks.is_some_and(|p| p.len() != rows) {
            return Err(EngineError::InvalidConfig {
                field: "picks",
                value: format!("{} specs", picks.map_or(0, <[_]>::len)),
                reason: format!("one per wanted row: the step wants {rows}"),
            });
        }
        let pick = HeadPick::of(picks);
        if t == 0 {
            self.logits.clear();
            return Ok(StepLogits::Rows(&self.logits));
        }
        // The engine may step on another thread than the one that built it; cuBLAS calls do not
        // bind the context themselves.
        self.dev.context().bind_to_thread().map_err(|e| CudaError::driver("cuCtxSetCurrent", e))?;
        let decode = seqs.iter().all(|s| s.tokens.len() == 1);
        let attn_ix = AttnIndex::new(seqs, bs);
        let parts = Parts { k: &self.kernels, g: &self.gemm, rope: &self.rope, w: &self.w, c, shard: self.shard, coll: &*self.coll };

        if decode && stage.is_none() && rows == t && self.coll.capturable() {
            // Every sequence one token, every row wanted: a graph replay when it fits a bucket.
            if let Some(out) = self.graphs.run(&self.dev, &parts, kv, &ix, &attn_ix, pick, picks.unwrap_or_default())? {
                for li in 0..c.num_hidden_layers {
                    on_layer(li);
                }
                return Ok(match out {
                    GraphOut::Ids(ids) => {
                        self.ids.clear();
                        self.ids.extend(ids.iter().map(|&i| i as u32));
                        StepLogits::Picked(&self.ids)
                    }
                    GraphOut::Logits(l) => {
                        self.logits = l;
                        StepLogits::Rows(&self.logits)
                    }
                });
            }
        }

        if decode {
            self.workspace(seqs.len(), heads, hd)?;
        }
        self.step_bufs(c, t)?;
        if rows > 0 {
            self.head_bufs(c, rows)?;
        }
        let d = &self.dev;
        let ids = d.upload(&ix.ids)?;
        let positions = d.upload(&ix.positions)?;
        let slots = d.upload(&ix.slots)?;
        let tables = d.upload(&attn_ix.tables)?;
        let ctx_lens = d.upload(&attn_ix.ctx_lens)?;
        let q_rows = d.upload(&attn_ix.q_rows)?;
        let q_lens = d.upload(&attn_ix.q_lens)?;
        let first_pos = d.upload(&attn_ix.first_pos)?;

        let parts = Parts { k: &self.kernels, g: &self.gemm, rope: &self.rope, w: &self.w, c, shard: self.shard, coll: &*self.coll };
        let b = self.step.as_mut().expect("sized above");
        let mut attn = if decode {
            let (ws, _) = self.ws.as_mut().expect("sized above");
            let (max_blocks, max_ctx) = (attn_ix.max_blocks, attn_ix.max_ctx);
            Attn::Decode { tables: &tables, max_blocks, ctx_lens: &ctx_lens, max_ctx, ws }
        } else {
            Attn::Prefill {
                tables: &tables,
                max_blocks: attn_ix.max_blocks,
                q_rows: &q_rows,
                q_lens: &q_lens,
                first_pos: &first_pos,
                max_q_len: attn_ix.max_q_len,
            }
        };
        parts.embed(&ids, b)?;
        // Staged push: the layer whose copy to the host mirror was queued last, and the mark
        // after it; it is reported once the device is past the mark, while the next layer runs.
        let mut copied: Option<(usize, StreamMark)> = None;
        for li in 0..c.num_hidden_layers {
            parts.qkv_rope(li, b, &positions, &slots, &mut kv.pool)?;
            let previous = match stage.as_deref_mut() {
                None => {
                    on_layer(li);
                    None
                }
                Some(st) => {
                    let ranges = staging::layer_ranges(&kv.pool.layout, kv.pool.num_blocks, li, &st.blocks);
                    let (host, host_len) = st.mirror.host().raw_region();
                    // SAFETY: the mirror is the engine's and borrowed for this call; nothing
                    // reads the ranges (blocks this step writes) before the mark below is waited
                    // for, and the region outlives the call.
                    unsafe { kv.pool.copy_to_host(d, &ranges, host, host_len)? };
                    st.mirror.count_out(ranges.iter().map(|r| r.len()).sum());
                    copied.replace((li, d.mark()?))
                }
            };
            parts.attend_mlp(li, b, &mut attn, &kv.pool)?;
            // The previous layer's KV is in the mirror by now, or lands while this one runs.
            if let Some((pl, mark)) = previous {
                mark.wait()?;
                on_layer(pl);
            }
        }
        if let Some((pl, mark)) = copied.take() {
            mark.wait()?;
            on_layer(pl);
        }
        if rows == 0 {
            self.logits.clear();
            return Ok(StepLogits::Rows(&self.logits));
        }

        // Final norm + LM head, only for the rows that need logits.
        let hb = self.head.as_mut().expect("sized above");
        let all_rows = rows == t && ix.want.iter().enumerate().all(|(i, &r)| r as usize == i);
        let want = if all_rows { None } else { Some(d.upload(&ix.want)?) };
        if pick == HeadPick::Sample {
            hb.set_specs(d, picks.unwrap_or_default())?;
        }
        parts.head(b, want.as_ref(), hb, pick)?;
        if pick != HeadPick::Logits {
            // Picked on the device; only the ids come back (4 bytes a row, not the vocabulary's
            // logits).
            let ids = d.download(&hb.ids)?;
            self.ids.clear();
            self.ids.extend(ids.iter().map(|&i| i as u32));
            return Ok(StepLogits::Picked(&self.ids));
        }
        self.logits = d.download(&hb.logits)?;
        Ok(StepLogits::Rows(&self.logits))
    }
}

/// Block tables and per-sequence attention indices of a step, as the kernels take them.
struct AttnIndex {
    /// `[num_seqs × max_blocks]`, each row the sequence's blocks covering its context (0 past).
    tables: Vec<u32>,
    max_blocks: usize,
    /// Decode: context length (position + 1) of each sequence's one token.
    ctx_lens: Vec<i32>,
    max_ctx: usize,
    /// Prefill: first row, query count and first position of each sequence.
    q_rows: Vec<i32>,
    q_lens: Vec<i32>,
    first_pos: Vec<i32>,
    max_q_len: usize,
}

impl AttnIndex {
    fn new(seqs: &[ForwardSeq<'_>], bs: usize) -> AttnIndex {
        let ends = seqs.iter().map(|s| s.first_pos + s.tokens.len());
        let max_blocks = ends.clone().map(|e| e.div_ceil(bs)).max().unwrap_or(0).max(1);
        let mut tables = vec![0u32; seqs.len() * max_blocks];
        let mut ix = AttnIndex {
            tables: Vec::new(),
            max_blocks,
            ctx_lens: Vec::with_capacity(seqs.len()),
            max_ctx: ends.max().unwrap_or(0),
            q_rows: Vec::with_capacity(seqs.len()),
            q_lens: Vec::with_capacity(seqs.len()),
            first_pos: Vec::with_capacity(seqs.len()),
            max_q_len: seqs.iter().map(|s| s.tokens.len()).max().unwrap_or(0),
        };
        let mut row = 0;
        for (i, s) in seqs.iter().enumerate() {
            let end = s.first_pos + s.tokens.len();
            let n = end.div_ceil(bs);
            tables[i * max_blocks..i * max_blocks + n].copy_from_slice(&s.block_table[..n]);
            ix.ctx_lens.push(end as i32);
            ix.q_rows.push(row as i32);
            ix.q_lens.push(s.tokens.len() as i32);
            ix.first_pos.push(s.first_pos as i32);
            row += s.tokens.len();
        }
        ix.tables = tables;
        ix
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_indices_pad_block_tables_and_count_rows() {
        let (a, b) = ([7u32, 3, 9], [4u32]);
        let seqs = [
            ForwardSeq { tokens: &[1, 2, 3], first_pos: 30, block_table: &a, want_logits: true },
            ForwardSeq { tokens: &[5], first_pos: 2, block_table: &b, want_logits: false },
        ];
        let ix = AttnIndex::new(&seqs, 16);
        assert_eq!(ix.max_blocks, 3);
        assert_eq!(ix.tables, vec![7, 3, 9, 4, 0, 0]);
        assert_eq!((ix.ctx_lens.clone(), ix.max_ctx), (vec![33, 3], 33));
        assert_eq!((ix.q_rows.clone(), ix.q_lens.clone(), ix.first_pos.clone()), (vec![0, 3], vec![3, 1], vec![30, 2]));
        assert_eq!(ix.max_q_len, 3);
    }

    #[test]
    fn the_step_index_checks_what_the_cpu_forward_checks() {
        let c = super::shard::tiny_config(2, 2, 4, 16);
        let table = [5u32, 1];
        let ok = [ForwardSeq { tokens: &[1, 2], first_pos: 15, block_table: &table, want_logits: true }];
        let ix = CudaForward::index(&c, &ok, 16).unwrap();
        assert_eq!(ix.positions, vec![15, 16]);
        assert_eq!(ix.slots, vec![5 * 16 + 15, 16]);
        assert_eq!((ix.ids.clone(), ix.want.clone()), (vec![1, 2], vec![1]));
        let bad_tok = [ForwardSeq { tokens: &[10], first_pos: 0, block_table: &table, want_logits: true }];
        assert!(matches!(CudaForward::index(&c, &bad_tok, 16), Err(EngineError::InvalidRequest { .. })));
        let long = [ForwardSeq { tokens: &[1], first_pos: 64, block_table: &table, want_logits: true }];
        assert!(matches!(CudaForward::index(&c, &long, 16), Err(EngineError::ContextOverflow { .. })));
    }
}
