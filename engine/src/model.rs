//! The Llama-family decoder's forward pass over a batch of sequence chunks, reading and writing
//! the paged KV cache through block tables.
//!
//! The model owns weights and scratch buffers, never KV: the caller passes the [`KvPool`] and
//! each sequence's block table (candle's `qwen2.rs` keeps its cache inside `Attention`; a paged
//! server cannot).
//!
//! # Batch invariance
//! Every kernel computes each output row with a fixed sequence of float operations that depends
//! only on that row (see `tandem-kernels`), and tokens of different sequences never mix except
//! through the row dimension. So a token's hidden states, its KV and its logits are bitwise the
//! same whether its sequence runs alone or batched, chunked or not, on a prefill node or a
//! decode node. The tests in `engine/tests/` assert this on the real model.
//!
//! # Cost per layer (T tokens in the batch)
//! three weight-streaming matmuls (fused QKV, O, fused gate|up, down: four), one paged-attention
//! call, and O(T · hidden) elementwise work; the LM head runs only on rows that need logits.

use tandem_kernels::{self as k, AttnSeq, RopeTable, WeightDtype};
use tandem_kv_layout::{KvDtype, KvLayout};

use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::kv::KvPool;
use crate::loader::ModelWeights;

/// One sequence's part of a forward batch.
#[derive(Clone, Copy, Debug)]
pub struct ForwardSeq<'a> {
    /// Tokens to run (a prefill chunk, or the single last token for decode).
    pub tokens: &'a [u32],
    /// Absolute position of `tokens[0]`; KV for positions `0..first_pos` must already be cached.
    pub first_pos: usize,
    /// Physical blocks covering positions `0..first_pos + tokens.len()`, in order.
    pub block_table: &'a [u32],
    /// Whether to compute logits for the last token of this chunk.
    pub want_logits: bool,
}

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

/// A loaded Llama-family model ready to run.
pub struct Model {
    weights: ModelWeights,
    rope: RopeTable,
    scratch: Scratch,
}

impl Model {
    /// Wraps loaded weights; precomputes the RoPE table for the model's context length.
    pub fn new(weights: ModelWeights) -> Self {
        let c = &weights.config;
        let rope = RopeTable::new(c.head_dim(), c.max_position_embeddings, c.rope_theta);
        Model { weights, rope, scratch: Scratch::default() }
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    /// Weight identity hash (goes into the KV layout fingerprint).
    pub fn fingerprint(&self) -> u64 {
        self.weights.fingerprint
    }

    /// How the matrices are stored, largest share first: e.g. `q4_1+q8_0` for the default
    /// model under `--dtype auto` (Q4_1 layers, a Q8_0 embedding), `f32` for an f32 load.
    pub fn weight_storage(&self) -> String {
        let w = &self.weights;
        let mut by_dtype: Vec<(WeightDtype, usize)> = Vec::new();
        let mats = w.layers.iter().flat_map(|l| [&l.qkv, &l.o_proj, &l.gate_up, &l.down]);
        for m in mats.chain([&w.embed]).chain(w.lm_head.as_ref()) {
            match by_dtype.iter_mut().find(|(d, _)| *d == m.dtype()) {
                Some((_, b)) => *b += m.size_bytes(),
                None => by_dtype.push((m.dtype(), m.size_bytes())),
            }
        }
        by_dtype.sort_by(|a, b| b.1.cmp(&a.1));
        by_dtype.iter().map(|(d, _)| d.as_str()).collect::<Vec<_>>().join("+")
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        let w = &self.weights;
        let layers: usize = w
            .layers
            .iter()
            .map(|l| {
                l.qkv.size_bytes() + l.o_proj.size_bytes() + l.gate_up.size_bytes() + l.down.size_bytes()
                    + 4 * (l.attn_norm.len() + l.mlp_norm.len())
            })
            .sum();
        w.embed.size_bytes() + layers + w.lm_head.as_ref().map_or(0, |h| h.size_bytes())
    }

    /// Bytes of weights streamed per decoded token (everything but the embedding table, which is
    /// only indexed, plus the LM head, which is the embedding again when tied).
    pub fn weight_bytes_per_token(&self) -> usize {
        let w = &self.weights;
        let head = w.lm_head.as_ref().unwrap_or(&w.embed).size_bytes();
        self.weight_bytes() - w.embed.size_bytes() + head
    }

    /// The KV layout this model needs for `block_size_tokens` and `dtype`.
    pub fn kv_layout(&self, block_size_tokens: usize, dtype: KvDtype) -> Result<KvLayout, EngineError> {
        let c = self.config();
        Ok(KvLayout::new(
            c.num_hidden_layers,
            c.kv_heads(),
            c.head_dim(),
            block_size_tokens,
            dtype,
            self.weights.fingerprint,
        )?)
    }

    /// Runs `seqs` through the model, writing their KV into `kv`, and returns the logits of the
    /// last token of every sequence with `want_logits`, row by row in `seqs` order
    /// (`rows × vocab_size`).
    pub fn forward(&mut self, seqs: &[ForwardSeq<'_>], kv: &mut KvPool) -> Result<&[f32], EngineError> {
        self.forward_observed(seqs, kv, &mut |_| {})
    }

    /// [`forward`](Self::forward), calling `on_layer(l)` as soon as layer `l`'s KV of every
    /// sequence in the batch is in the pool (a prefill node streams it out from there while the
    /// later layers compute).
    pub fn forward_observed(
        &mut self,
        seqs: &[ForwardSeq<'_>],
        kv: &mut KvPool,
        on_layer: &mut dyn FnMut(usize),
    ) -> Result<&[f32], EngineError> {
        let c = &self.weights.config;
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
        for seq in seqs {
            let end = seq.first_pos + seq.tokens.len();
            if end > c.max_position_embeddings {
                return Err(EngineError::ContextOverflow {
                    prompt_tokens: end,
                    max_new_tokens: 0,
                    max_context_tokens: c.max_position_embeddings,
                });
            }
            assert!(
                seq.block_table.len() * bs >= end,
                "block table of {} blocks cannot hold {end} tokens. This is a bug.",
                seq.block_table.len()
            );
            for p in seq.first_pos..end {
                s.positions.push(p);
                s.slots.push(seq.block_table[p / bs] as usize * bs + p % bs);
            }
        }
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
                self.weights.embed.row_to_f32(tok as usize, &mut x[r * h..(r + 1) * h]);
                r += 1;
            }
        }

        let scale = 1.0 / (hd as f32).sqrt();
        for (li, layer) in self.weights.layers.iter().enumerate() {
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
        k::rms_norm(&s.last_rows[..rows * h], &self.weights.final_norm, eps, sized(&mut s.xn, rows * h));
        let head = self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed);
        let vocab = c.vocab_size;
        k::linear(&s.xn[..rows * h], rows, head, sized(&mut s.logits, rows * vocab));
        Ok(&s.logits[..rows * vocab])
    }
}
