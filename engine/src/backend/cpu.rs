//! The CPU backend: the forward pass on `tandem-kernels`, reading and writing a host
//! [`KvPool`]. This is the engine's forward as it was before the backend seam, moved here
//! unchanged (same kernels, same order, same buffers): its outputs are bitwise what they were.
//!
//! Cost per layer (T tokens in the batch): four weight-streaming matmuls (fused QKV, O, fused
//! gate|up, down), one paged-attention call, O(T · hidden) elementwise work; the LM head runs
//! only on rows that need logits. Scratch buffers grow to the largest batch seen and are reused.

use tandem_kernels::{self as k, AttnSeq, RopeTable};

use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::kv::KvPool;
use crate::loader::ModelWeights;
use super::ForwardSeq;

use super::staging::StageOut;

#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    positions: Vec<usize>,
    slots: Vec<usize>,
    last_rows: Vec<f32>,
    logits: Vec<f32>,
}

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

/// The CPU forward: the RoPE table and scratch buffers (weights stay the model's).
pub struct CpuForward {
    rope: RopeTable,
    scratch: Scratch,
}

impl CpuForward {
    /// Precomputes the RoPE table for the model's context length.
    pub fn new(c: &ModelConfig) -> CpuForward {
        let rope = RopeTable::new(c.head_dim(), c.max_position_embeddings, c.rope_theta);
        CpuForward { rope, scratch: Scratch::default() }
    }

    /// Runs `seqs` through `weights`, writing their KV into `kv`; see
    /// [`Model::forward_observed`](crate::Model::forward_observed).
    pub(crate) fn forward(
        &mut self,
        weights: &ModelWeights,
        seqs: &[ForwardSeq<'_>],
        kv: &mut KvPool,
        mut stage: Option<&mut StageOut<'_>>,
        on_layer: &mut dyn FnMut(usize),
    ) -> Result<&[f32], EngineError> {
        let c = &weights.config;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let (heads, kvh, hd) = (c.num_attention_heads, c.kv_heads(), c.head_dim());
        let (q_w, kv_w) = (heads * hd, kvh * hd);
        let bs = kv.layout().block_size_tokens;
        let eps = c.rms_norm_eps as f32;
        let t: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let s = &mut self.scratch;

        // Positions and cache slots of every token; validate against the block tables.
        s.positions.clear();
        s.slots.clear();
        let (positions, slots) = (&mut s.positions, &mut s.slots);
        super::token_slots(c, seqs, bs, |p, slot| {
            positions.push(p);
            slots.push(slot);
        })?;
        let mut attn_seqs = Vec::with_capacity(seqs.len());
        let mut row = 0;
        for seq in seqs {
            attn_seqs.push(AttnSeq {
                block_table: seq.block_table,
                q_row: row,
                q_len: seq.tokens.len(),
                first_pos: seq.first_pos,
            });
            row += seq.tokens.len();
        }

        // Embedding lookup.
        let x = sized(&mut s.x, t * h);
        let mut r = 0;
        for seq in seqs {
            for &tok in seq.tokens {
                if tok as usize >= c.vocab_size {
                    return Err(EngineError::InvalidRequest {
                        field: "token_ids",
                        value: tok.to_string(),
                        reason: format!("outside the vocabulary of {} tokens", c.vocab_size),
                    });
                }
                weights.embed.row_to_f32(tok as usize, &mut x[r * h..(r + 1) * h]);
                r += 1;
            }
        }

        let scale = 1.0 / (hd as f32).sqrt();
        for (li, layer) in weights.layers.iter().enumerate() {
            // Attention block.
            k::rms_norm(&s.x[..t * h], &layer.attn_norm, eps, sized(&mut s.xn, t * h));
            k::linear(&s.xn[..t * h], t, &layer.qkv, sized(&mut s.qkv, t * (q_w + 2 * kv_w)));
            let (q, kk, v) = (sized(&mut s.q, t * q_w), sized(&mut s.k, t * kv_w), sized(&mut s.v, t * kv_w));
            for (i, row) in s.qkv.chunks_exact(q_w + 2 * kv_w).enumerate() {
                q[i * q_w..(i + 1) * q_w].copy_from_slice(&row[..q_w]);
                kk[i * kv_w..(i + 1) * kv_w].copy_from_slice(&row[q_w..q_w + kv_w]);
                v[i * kv_w..(i + 1) * kv_w].copy_from_slice(&row[q_w + kv_w..]);
            }
            k::rope(q, heads, hd, &s.positions, &self.rope);
            k::rope(kk, kvh, hd, &s.positions, &self.rope);
            k::write_kv(&mut kv.view_mut(), li, kk, v, &s.slots)?;
            if let Some(st) = stage.as_deref_mut() {
                st.mirror.copy_layer_out_host(kv, li, &st.blocks);
            }
            on_layer(li);
            k::paged_attention(&kv.view(), li, q, heads, &attn_seqs, scale, sized(&mut s.attn, t * q_w))?;
            k::linear(&s.attn[..t * q_w], t, &layer.o_proj, sized(&mut s.proj, t * h));
            k::add_inplace(&mut s.x[..t * h], &s.proj[..t * h]);

            // MLP block.
            k::rms_norm(&s.x[..t * h], &layer.mlp_norm, eps, sized(&mut s.xn, t * h));
            k::linear(&s.xn[..t * h], t, &layer.gate_up, sized(&mut s.gate_up, t * 2 * inter));
            k::silu_mul(&s.gate_up[..t * 2 * inter], t, inter, sized(&mut s.act, t * inter));
            k::linear(&s.act[..t * inter], t, &layer.down, sized(&mut s.proj, t * h));
            k::add_inplace(&mut s.x[..t * h], &s.proj[..t * h]);
        }

        // Final norm + LM head, only for the rows that need logits.
        let mut want = Vec::new();
        let mut end = 0;
        for seq in seqs {
            end += seq.tokens.len();
            if seq.want_logits {
                want.push(end - 1);
            }
        }
        let rows = want.len();
        let last = sized(&mut s.last_rows, rows * h);
        for (i, &r) in want.iter().enumerate() {
            last[i * h..(i + 1) * h].copy_from_slice(&s.x[r * h..(r + 1) * h]);
        }
        k::rms_norm(&s.last_rows[..rows * h], &weights.final_norm, eps, sized(&mut s.xn, rows * h));
        let head = weights.lm_head.as_ref().unwrap_or(&weights.embed);
        let vocab = c.vocab_size;
        k::linear(&s.xn[..rows * h], rows, head, sized(&mut s.logits, rows * vocab));
        Ok(&s.logits[..rows * vocab])
    }
}
