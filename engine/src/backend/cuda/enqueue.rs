//! What one forward step queues on the device, in the CPU forward's order, split where the
//! callers differ: the eager forward reports each layer (and stages its KV) between
//! [`Parts::qkv_rope`] and [`Parts::attend_mlp`], and a captured decode graph
//! (`graphs`) queues them back to back. Both run exactly these kernels, so a replayed graph
//! computes what the eager forward would for the same buffers.
//!
//! # Invariants
//! - Nothing here allocates, uploads or synchronizes: the buffers come in sized for `t` tokens
//!   (`StepBufs`) and `rows` rows (`HeadBufs`), so the calls can be captured into a graph.

use cudarc::driver::CudaSlice;
use tandem_kernels::WeightDtype;
use tandem_kernels::sample::SampleSpec;
use tandem_kernels_cuda::{CudaDevice, CudaError, CudaKernels, DecodeWorkspace, DeviceKvPool, DeviceRopeTable, Gemm, Out, SampleRow};

use super::shard::{Collective, Shard};
use super::weights::{DevElems, DevMatrix, DevWeights};
use crate::config::ModelConfig;

/// Activation buffers of one step's shape (`t` tokens).
pub(super) struct StepBufs {
    pub t: usize,
    pub x: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<f32>,
    /// bf16 copies of the GEMM inputs (one element for f32 weights): width hidden, q, intermediate.
    xb_h: CudaSlice<u16>,
    xb_q: CudaSlice<u16>,
    xb_i: CudaSlice<u16>,
}

impl StepBufs {
    /// Zeroed buffers for `t` tokens of `shard`'s slice of `c` (bf16 copies only for bf16
    /// weights).
    pub fn new(d: &CudaDevice, c: &ModelConfig, shard: Shard, dtype: WeightDtype, t: usize) -> Result<StepBufs, CudaError> {
        let (h, inter, q_w) = (c.hidden_size, shard.inter(c), shard.heads(c) * c.head_dim());
        let kv_w = shard.kv_heads(c) * c.head_dim();
        // One element otherwise: a zero-byte cuMemAllocAsync is an error.
        let bf = |n: usize| if dtype == WeightDtype::Bf16 { n } else { 1 };
        Ok(StepBufs {
            t,
            x: d.alloc_zeros(t * h)?,
            xn: d.alloc_zeros(t * h)?,
            q: d.alloc_zeros(t * q_w)?,
            k: d.alloc_zeros(t * kv_w)?,
            v: d.alloc_zeros(t * kv_w)?,
            attn: d.alloc_zeros(t * q_w)?,
            gate_up: d.alloc_zeros(t * 2 * inter)?,
            act: d.alloc_zeros(t * inter)?,
            xb_h: d.alloc_zeros(bf(t * h))?,
            xb_q: d.alloc_zeros(bf(t * q_w))?,
            xb_i: d.alloc_zeros(bf(t * inter))?,
        })
    }
}

/// Buffers of the LM head's rows.
pub(super) struct HeadBufs {
    pub rows: usize,
    last: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    xb: CudaSlice<u16>,
    pub logits: CudaSlice<f32>,
    /// Each row's sampling spec (steps that sample on the device).
    pub specs: CudaSlice<SampleRow>,
    /// Each row's picked token (steps that pick on the device).
    pub ids: CudaSlice<i32>,
}

/// What the LM head leaves for the host: the rows' logits, or only their picked tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum HeadPick {
    /// The logits (the host samples).
    Logits,
    /// Every row greedy: the argmax kernel.
    Argmax,
    /// The sampling kernel, by the specs in [`HeadBufs::specs`].
    Sample,
}

impl HeadPick {
    /// The head for a step with these device picks (`None`: the host needs the rows).
    pub fn of(picks: Option<&[SampleSpec]>) -> HeadPick {
        match picks {
            None => HeadPick::Logits,
            Some(p) if p.iter().all(SampleSpec::is_greedy) => HeadPick::Argmax,
            Some(_) => HeadPick::Sample,
        }
    }
}

impl HeadBufs {
    /// Zeroed buffers for `rows` > 0 rows.
    pub fn new(d: &CudaDevice, c: &ModelConfig, dtype: WeightDtype, rows: usize) -> Result<HeadBufs, CudaError> {
        let h = c.hidden_size;
        let bf = if dtype == WeightDtype::Bf16 { rows * h } else { 1 };
        Ok(HeadBufs {
            rows,
            last: d.alloc_zeros(rows * h)?,
            xn: d.alloc_zeros(rows * h)?,
            xb: d.alloc_zeros(bf)?,
            logits: d.alloc_zeros(rows * c.vocab_size)?,
            specs: d.alloc_zeros(rows)?,
            ids: d.alloc_zeros(rows)?,
        })
    }

    /// Queues the copy of `picks` into [`specs`](Self::specs); rows past them (a graph bucket's
    /// padding) are greedy.
    pub fn set_specs(&mut self, d: &CudaDevice, picks: &[SampleSpec]) -> Result<(), CudaError> {
        let mut rows: Vec<SampleRow> = picks.iter().map(SampleRow::from).collect();
        rows.resize(self.rows, SampleRow::default());
        d.stream().memcpy_htod(&rows, &mut self.specs).map_err(|e| CudaError::driver("cuMemcpyHtoDAsync", e))
    }
}

/// The attention kernel a step runs, with its index buffers.
pub(super) enum Attn<'a> {
    /// One token per sequence: split over blocks (flash-decoding).
    Decode {
        tables: &'a CudaSlice<u32>,
        max_blocks: usize,
        ctx_lens: &'a CudaSlice<i32>,
        max_ctx: usize,
        ws: &'a mut DecodeWorkspace,
    },
    /// Query chunks (flash-attention tiles).
    Prefill {
        tables: &'a CudaSlice<u32>,
        max_blocks: usize,
        q_rows: &'a CudaSlice<i32>,
        q_lens: &'a CudaSlice<i32>,
        first_pos: &'a CudaSlice<i32>,
        max_q_len: usize,
    },
}

/// What a step's kernels need besides its buffers.
pub(super) struct Parts<'a> {
    pub k: &'a CudaKernels,
    pub g: &'a Gemm,
    pub rope: &'a DeviceRopeTable,
    pub w: &'a DevWeights,
    pub c: &'a ModelConfig,
    /// This rank's slice of the model (the whole of it today).
    pub shard: Shard,
    /// The group's all-reduce (a no-op for one rank).
    pub coll: &'a dyn Collective,
}

impl Parts<'_> {
    fn bf16(&self) -> bool {
        self.w.dtype == WeightDtype::Bf16
    }

    /// The step's hidden states from its token ids.
    pub fn embed(&self, ids: &CudaSlice<i32>, b: &mut StepBufs) -> Result<(), CudaError> {
        let h = self.c.hidden_size;
        match &self.w.embed.elems {
            DevElems::F32(table) => self.k.embed_f32(ids, table, h, &mut b.x),
            DevElems::Bf16(table) => self.k.embed_bf16(ids, table, h, &mut b.x),
        }
    }

    /// Layer `li`'s RMSNorm, Q/K/V projections (three GEMMs on row ranges of the fused matrix),
    /// and RoPE fused with the KV write: after this, the layer's KV is queued into `pool`.
    pub fn qkv_rope(
        &self,
        li: usize,
        b: &mut StepBufs,
        positions: &CudaSlice<i32>,
        slots: &CudaSlice<i64>,
        pool: &mut DeviceKvPool,
    ) -> Result<(), CudaError> {
        let (c, k, g, bf16) = (self.c, self.k, self.g, self.bf16());
        let (heads, hd) = (self.shard.heads(c), c.head_dim());
        let (q_w, kv_w) = (heads * hd, self.shard.kv_heads(c) * hd);
        let layer = &self.w.layers[li];
        k.rms_norm(&b.x, &layer.attn_norm, c.rms_norm_eps as f32, &mut b.xn)?;
        if bf16 {
            k.f32_to_bf16(&b.xn, &mut b.xb_h)?;
        }
        let (qkv, t) = (&layer.qkv, b.t);
        mm(g, bf16, &b.xn, &b.xb_h, t, qkv, (0, q_w), &mut b.q, Out::Set)?;
        mm(g, bf16, &b.xn, &b.xb_h, t, qkv, (q_w, q_w + kv_w), &mut b.k, Out::Set)?;
        mm(g, bf16, &b.xn, &b.xb_h, t, qkv, (q_w + kv_w, q_w + 2 * kv_w), &mut b.v, Out::Set)?;
        k.rope_write_kv(&mut b.q, &b.k, &b.v, heads, self.rope, positions, slots, pool, li)
    }

    /// The rest of layer `li`: paged attention, O projection with the residual add, RMSNorm,
    /// gate|up GEMM, SiLU-mul, down GEMM with the residual add (each row-parallel GEMM followed
    /// by the group's all-reduce when there is more than one rank; see `shard`).
    pub fn attend_mlp(&self, li: usize, b: &mut StepBufs, attn: &mut Attn<'_>, pool: &DeviceKvPool) -> Result<(), CudaError> {
        let (c, k, g, bf16) = (self.c, self.k, self.g, self.bf16());
        let (h, inter, heads, hd) = (c.hidden_size, self.shard.inter(c), self.shard.heads(c), c.head_dim());
        let (row_out, reduce) = (self.shard.row_parallel_out(), self.shard.world > 1);
        let layer = &self.w.layers[li];
        let scale = 1.0 / (hd as f32).sqrt();
        match attn {
            Attn::Decode { tables, max_blocks, ctx_lens, max_ctx, ws } => {
                k.paged_attn_decode(&b.q, heads, pool, li, tables, *max_blocks, ctx_lens, *max_ctx, scale, ws, &mut b.attn)?;
            }
            Attn::Prefill { tables, max_blocks, q_rows, q_lens, first_pos, max_q_len } => {
                k.paged_attn_prefill(
                    &b.q, heads, pool, li, tables, *max_blocks, q_rows, q_lens, first_pos, *max_q_len, scale, &mut b.attn,
                )?;
            }
        }
        let t = b.t;
        if bf16 {
            k.f32_to_bf16(&b.attn, &mut b.xb_q)?;
        }
        // The residual adds are the GEMMs' epilogues (beta = 1): x += attn · W_oᵀ.
        mm(g, bf16, &b.attn, &b.xb_q, t, &layer.o_proj, (0, h), &mut b.x, row_out)?;
        if reduce {
            self.coll.all_reduce_sum(&mut b.x)?;
        }
        k.rms_norm(&b.x, &layer.mlp_norm, c.rms_norm_eps as f32, &mut b.xn)?;
        if bf16 {
            k.f32_to_bf16(&b.xn, &mut b.xb_h)?;
        }
        mm(g, bf16, &b.xn, &b.xb_h, t, &layer.gate_up, (0, 2 * inter), &mut b.gate_up, Out::Set)?;
        k.silu_mul(&b.gate_up, t, inter, &mut b.act)?;
        if bf16 {
            k.f32_to_bf16(&b.act, &mut b.xb_i)?;
        }
        mm(g, bf16, &b.act, &b.xb_i, t, &layer.down, (0, h), &mut b.x, row_out)?;
        if reduce {
            self.coll.all_reduce_sum(&mut b.x)?;
        }
        Ok(())
    }

    /// The final RMSNorm and the LM head on the step's rows `want` (a row gather: the
    /// embedding kernel with the hidden states as its table), or on every row in order when
    /// `want` is `None` (`hb.rows == b.t`); with a device `pick`, each row's token into `hb.ids`.
    pub fn head(&self, b: &StepBufs, want: Option<&CudaSlice<i32>>, hb: &mut HeadBufs, pick: HeadPick) -> Result<(), CudaError> {
        let (c, k, g, bf16) = (self.c, self.k, self.g, self.bf16());
        let eps = c.rms_norm_eps as f32;
        match want {
            None => k.rms_norm(&b.x, &self.w.final_norm, eps, &mut hb.xn)?,
            Some(rows) => {
                k.embed_f32(rows, &b.x, c.hidden_size, &mut hb.last)?;
                k.rms_norm(&hb.last, &self.w.final_norm, eps, &mut hb.xn)?;
            }
        }
        if bf16 {
            k.f32_to_bf16(&hb.xn, &mut hb.xb)?;
        }
        let head = self.w.head();
        mm(g, bf16, &hb.xn, &hb.xb, hb.rows, head, (0, head.rows), &mut hb.logits, Out::Set)?;
        match pick {
            HeadPick::Logits => Ok(()),
            HeadPick::Argmax => k.argmax(&hb.logits, c.vocab_size, &mut hb.ids),
            HeadPick::Sample => k.sample(&hb.logits, c.vocab_size, &hb.specs, &mut hb.ids),
        }
    }
}

/// `out = x · W[r0..r1]ᵀ` for `m` rows of `x`; with bf16 weights from `xb`, the bf16 copy of `x`.
#[allow(clippy::too_many_arguments)]
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
    mode: Out,
) -> Result<(), CudaError> {
    let n = r1 - r0;
    if bf16 {
        let wv = w.rows_bf16(r0, r1).expect("bf16 model, bf16 matrices (checked at upload)");
        g.linear_bf16(xb, m, &wv, n, w.cols, out, mode)
    } else {
        let wv = w.rows_f32(r0, r1).expect("f32 model, f32 matrices (checked at upload)");
        g.linear_f32(x, m, &wv, n, w.cols, out, mode)
    }
}
