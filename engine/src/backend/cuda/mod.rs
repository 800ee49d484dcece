//! The CUDA backend: the forward pass on one GPU, colocated (KV in device memory, logits back
//! to the host for the engine's sampler).
//!
//! Same operations, same order as the CPU forward ([`super::cpu`]): embedding; per layer
//! RMSNorm, the Q/K/V projections (three cuBLAS GEMMs on row ranges of the fused `[q; k; v]`
//! matrix, so q, k and v land in their own buffers), RoPE fused with the paged-KV write,
//! paged attention (the decode kernel when every sequence runs one token, the prefill kernel
//! otherwise), O projection, residual add, RMSNorm, gate|up GEMM, SiLU-mul, down GEMM, residual
//! add; then the final norm and the LM head on the rows that need logits (gathered with the
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
//! Greedy steps pick their tokens on the device (`argmax_only`: only the ids come back).
//!
//! Not yet (issue 16): sampling with temperature on the device, CUDA graphs for decode, fused epilogues,
//! buffers sized once for the largest batch (today they are reallocated when the step's token
//! count changes, and the small per-step index arrays are uploaded fresh).

mod weights;

use cudarc::driver::CudaSlice;
use tandem_kernels::WeightDtype;
use tandem_kernels_cuda::{
    CudaDevice, CudaError, CudaKernels, DecodeWorkspace, DeviceKvPool, DeviceRopeTable, Gemm, PinnedHost, PtxCache,
    StreamMark, launch,
};
use tandem_kv_layout::KvLayout;

use self::weights::{DevMatrix, DevWeights};
use super::staging::{self, HostMirror, StageOut};
use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::kv::KvPool;
use crate::loader::ModelWeights;
use crate::model::{ForwardSeq, StepLogits};

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

/// Activation buffers of one step's shape (`t` tokens), reallocated when it changes.
struct StepBufs {
    t: usize,
    x: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<f32>,
    /// bf16 copies of the GEMM inputs (empty for f32 weights): width hidden, q, intermediate.
    xb_h: CudaSlice<u16>,
    xb_q: CudaSlice<u16>,
    xb_i: CudaSlice<u16>,
}

/// Buffers of the LM head's rows.
struct HeadBufs {
    rows: usize,
    last: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    xb: CudaSlice<u16>,
    logits: CudaSlice<f32>,
    /// Each row's argmax (greedy steps).
    ids: CudaSlice<i32>,
}

/// The CUDA forward: device, kernels, cuBLAS, uploaded weights and scratch.
pub struct CudaForward {
    dev: CudaDevice,
    kernels: CudaKernels,
    gemm: Gemm,
    rope: DeviceRopeTable,
    w: DevWeights,
    step: Option<StepBufs>,
    head: Option<HeadBufs>,
    /// The split-decode workspace and the sequences it has room for.
    ws: Option<(DecodeWorkspace, usize)>,
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
        let t0 = std::time::Instant::now();
        let dev = CudaDevice::open(ordinal)?;
        let kernels = CudaKernels::load(&dev, &PtxCache::from_env())?;
        let gemm = Gemm::new(&dev)?;
        let c = &weights.config;
        let table = tandem_kernels::RopeTable::new(c.head_dim(), c.max_position_embeddings, c.rope_theta);
        let rope = DeviceRopeTable::new(&dev, &table)?;
        let w = DevWeights::upload(&dev, weights)?;
        dev.synchronize()?;
        tracing::info!(
            device = %format_args!("cuda:{ordinal}"),
            name = dev.name(),
            weights = w.dtype.as_str(),
            free_mib = dev.free_bytes().unwrap_or(0) >> 20,
            ms = t0.elapsed().as_millis() as u64,
            "CUDA backend ready: kernels loaded, weights uploaded"
        );
        Ok(CudaForward { dev, kernels, gemm, rope, w, step: None, head: None, ws: None, logits: Vec::new(), ids: Vec::new() })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.dev.ordinal()
    }

    /// A zeroed KV pool of `num_blocks` blocks of `layout` in device memory (f32, f16 or bf16;
    /// int8 is `CudaError::Unsupported`; too large is `CudaError::OutOfMemory` with both sizes).
    pub fn new_kv(&self, layout: KvLayout, num_blocks: usize) -> Result<CudaKv, EngineError> {
        let pool = DeviceKvPool::new(&self.dev, layout, num_blocks)?;
        Ok(CudaKv { pool, ordinal: self.dev.ordinal() })
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
        let d = &self.dev;
        let (h, inter, q_w) = (c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim());
        let kv_w = c.kv_heads() * c.head_dim();
        // bf16 copies only for bf16 weights; one element otherwise (a zero-byte cuMemAllocAsync
        // is an error).
        let bf = |n: usize| if self.w.dtype == WeightDtype::Bf16 { n } else { 1 };
        self.step = Some(StepBufs {
            t,
            x: d.alloc_zeros(t * h)?,
            xn: d.alloc_zeros(t * h)?,
            q: d.alloc_zeros(t * q_w)?,
            k: d.alloc_zeros(t * kv_w)?,
            v: d.alloc_zeros(t * kv_w)?,
            attn: d.alloc_zeros(t * q_w)?,
            proj: d.alloc_zeros(t * h)?,
            gate_up: d.alloc_zeros(t * 2 * inter)?,
            act: d.alloc_zeros(t * inter)?,
            xb_h: d.alloc_zeros(bf(t * h))?,
            xb_q: d.alloc_zeros(bf(t * q_w))?,
            xb_i: d.alloc_zeros(bf(t * inter))?,
        });
        Ok(())
    }

    /// Sizes the LM head's buffers for `rows` > 0 rows.
    fn head_bufs(&mut self, c: &ModelConfig, rows: usize) -> Result<(), CudaError> {
        if self.head.as_ref().is_some_and(|b| b.rows == rows) {
            return Ok(());
        }
        self.head = None;
        let d = &self.dev;
        let h = c.hidden_size;
        let bf = if self.w.dtype == WeightDtype::Bf16 { rows * h } else { 1 };
        self.head = Some(HeadBufs {
            rows,
            last: d.alloc_zeros(rows * h)?,
            xn: d.alloc_zeros(rows * h)?,
            xb: d.alloc_zeros(bf)?,
            logits: d.alloc_zeros(rows * c.vocab_size)?,
            ids: d.alloc_zeros(rows)?,
        });
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

    /// Runs `seqs`, writing their KV into `kv`; returns the wanted rows' logits (host memory).
    pub(crate) fn forward(
        &mut self,
        c: &ModelConfig,
        seqs: &[ForwardSeq<'_>],
        kv: &mut CudaKv,
        mut stage: Option<&mut StageOut<'_>>,
        argmax_only: bool,
        on_layer: &mut dyn FnMut(usize),
    ) -> Result<StepLogits<'_>, EngineError> {
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let (heads, kvh, hd) = (c.num_attention_heads, c.kv_heads(), c.head_dim());
        let (q_w, kv_w) = (heads * hd, kvh * hd);
        let bs = kv.layout().block_size_tokens;
        let eps = c.rms_norm_eps as f32;
        let t: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let ix = Self::index(c, seqs, bs)?;
        let rows = ix.want.len();
        if t == 0 {
            self.logits.clear();
            return Ok(StepLogits::Rows(&self.logits));
        }
        // The engine may step on another thread than the one that built it; cuBLAS calls do not
        // bind the context themselves.
        self.dev.context().bind_to_thread().map_err(|e| CudaError::driver("cuCtxSetCurrent", e))?;
        let decode = seqs.iter().all(|s| s.tokens.len() == 1);
        let attn_ix = AttnIndex::new(seqs, bs);
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

        let (k, g, w) = (&self.kernels, &self.gemm, &self.w);
        let b = self.step.as_mut().expect("sized above");
        let bf16 = w.dtype == WeightDtype::Bf16;
        match &w.embed.elems {
            weights::DevElems::F32(table) => k.embed_f32(&ids, table, h, &mut b.x)?,
            weights::DevElems::Bf16(table) => k.embed_bf16(&ids, table, h, &mut b.x)?,
        }
        let scale = 1.0 / (hd as f32).sqrt();
        // Staged push: the layer whose copy to the host mirror was queued last, and the mark
        // after it; it is reported once the device is past the mark, while the next layer runs.
        let mut copied: Option<(usize, StreamMark)> = None;
        for (li, layer) in w.layers.iter().enumerate() {
            // Attention block.
            k.rms_norm(&b.x, &layer.attn_norm, eps, &mut b.xn)?;
            if bf16 {
                k.f32_to_bf16(&b.xn, &mut b.xb_h)?;
            }
            let qkv = &layer.qkv;
            mm(g, bf16, &b.xn, &b.xb_h, t, qkv, (0, q_w), &mut b.q)?;
            mm(g, bf16, &b.xn, &b.xb_h, t, qkv, (q_w, q_w + kv_w), &mut b.k)?;
            mm(g, bf16, &b.xn, &b.xb_h, t, qkv, (q_w + kv_w, q_w + 2 * kv_w), &mut b.v)?;
            k.rope_write_kv(&mut b.q, &b.k, &b.v, heads, &self.rope, &positions, &slots, &mut kv.pool, li)?;
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
            if decode {
                let (ws, _) = self.ws.as_mut().expect("sized above");
                k.paged_attn_decode(
                    &b.q, heads, &kv.pool, li, &tables, attn_ix.max_blocks, &ctx_lens, attn_ix.max_ctx, scale, ws,
                    &mut b.attn,
                )?;
            } else {
                k.paged_attn_prefill(
                    &b.q, heads, &kv.pool, li, &tables, attn_ix.max_blocks, &q_rows, &q_lens, &first_pos,
                    attn_ix.max_q_len, scale, &mut b.attn,
                )?;
            }
            if bf16 {
                k.f32_to_bf16(&b.attn, &mut b.xb_q)?;
            }
            mm(g, bf16, &b.attn, &b.xb_q, t, &layer.o_proj, (0, h), &mut b.proj)?;
            k.add_inplace(&mut b.x, &b.proj)?;

            // MLP block.
            k.rms_norm(&b.x, &layer.mlp_norm, eps, &mut b.xn)?;
            if bf16 {
                k.f32_to_bf16(&b.xn, &mut b.xb_h)?;
            }
            mm(g, bf16, &b.xn, &b.xb_h, t, &layer.gate_up, (0, 2 * inter), &mut b.gate_up)?;
            k.silu_mul(&b.gate_up, t, inter, &mut b.act)?;
            if bf16 {
                k.f32_to_bf16(&b.act, &mut b.xb_i)?;
            }
            mm(g, bf16, &b.act, &b.xb_i, t, &layer.down, (0, h), &mut b.proj)?;
            k.add_inplace(&mut b.x, &b.proj)?;
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

        // Final norm + LM head, only for the rows that need logits.
        if rows == 0 {
            self.logits.clear();
            return Ok(StepLogits::Rows(&self.logits));
        }
        let hb = self.head.as_mut().expect("sized above");
        let all_rows = rows == t && ix.want.iter().enumerate().all(|(i, &r)| r as usize == i);
        if all_rows {
            k.rms_norm(&b.x, &w.final_norm, eps, &mut hb.xn)?;
        } else {
            // The embedding kernel is a row gather: "table" = the step's hidden states.
            let want = d.upload(&ix.want)?;
            k.embed_f32(&want, &b.x, h, &mut hb.last)?;
            k.rms_norm(&hb.last, &w.final_norm, eps, &mut hb.xn)?;
        }
        if bf16 {
            k.f32_to_bf16(&hb.xn, &mut hb.xb)?;
        }
        let head = w.head();
        mm(g, bf16, &hb.xn, &hb.xb, rows, head, (0, head.rows), &mut hb.logits)?;
        if argmax_only {
            // Greedy rows: pick on the device, bring back only the ids (4 bytes a row, not
            // the vocabulary's logits).
            k.argmax(&hb.logits, c.vocab_size, &mut hb.ids)?;
            let ids = d.download(&hb.ids)?;
            self.ids.clear();
            self.ids.extend(ids.iter().map(|&i| i as u32));
            return Ok(StepLogits::Argmax(&self.ids));
        }
        self.logits = d.download(&hb.logits)?;
        Ok(StepLogits::Rows(&self.logits))
    }
}

/// `out = x · W[r0..r1]ᵀ` for `m` rows of `x`; with bf16 weights from `xb`, the bf16 copy of `x`.
#[allow(clippy::too_many_arguments)]
fn mm(
    g: &Gemm,
    bf16: bool,
    x: &CudaSlice<f32>,
    xb: &CudaSlice<u16>,
    m: usize,
    w: &DevMatrix,
    (r0, r1): (usize, usize),
    out: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let n = r1 - r0;
    if bf16 {
        let wv = w.rows_bf16(r0, r1).expect("bf16 model, bf16 matrices (checked at upload)");
        g.linear_bf16(xb, m, &wv, n, w.cols, out)
    } else {
        let wv = w.rows_f32(r0, r1).expect("f32 model, f32 matrices (checked at upload)");
        g.linear_f32(x, m, &wv, n, w.cols, out)
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
        let c = ModelConfig {
            hidden_size: 8,
            intermediate_size: 16,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: None,
            head_dim: None,
            vocab_size: 10,
            rope_theta: 1e4,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 64,
            tie_word_embeddings: true,
            bos_token_id: None,
            eos_token_id: vec![],
        };
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
