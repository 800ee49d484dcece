//! The hardware and model as the simulation sees them: a roofline of one H200 and the seed's
//! 70B GQA model, served by instances of `tp` GPUs (tensor parallel).
//!
//! ```text
//! prefill step  = max(FLOPs / (tp × peak × efficiency), bytes / (tp × HBM)) + TP all-reduces
//! decode step   = (weights + KV read) / (tp × HBM) + TP all-reduces           (bandwidth-bound)
//! KV transfer   = prompt × KV bytes per token / (tp × RDMA per GPU)  (each GPU sends its shard)
//! all-reduce    = 2 × layers × (latency + 2 (tp-1)/tp × tokens × hidden × 2 B / NVLink)
//! FLOPs         = 2 × params × tokens + 2 × layers × hidden × (attended context per token)
//! ```
//! Figures are the H200 datasheet's (HBM 4.8 TB/s peak, 989 TFLOP/s dense bf16, NVLink 900 GB/s,
//! 400 Gb/s RDMA) and ones measured on an H200 on 2026-12-04 (4.25 TB/s device-to-device copy of
//! 2 GiB, read + write counted; 881 TFLOP/s in a cuBLAS bf16 8192³ GEMM).

use serde::Serialize;

/// A dense decoder-only model's shape.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ModelShape {
    /// Parameters.
    pub params: f64,
    /// Layers.
    pub layers: u32,
    /// Hidden size.
    pub hidden: u32,
    /// KV heads (GQA).
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per weight and per KV element (2: bf16).
    pub dtype_bytes: u32,
}

impl ModelShape {
    /// The seed's model: 70B-class, 80 layers, hidden 8192, 8 KV heads of 128, bf16.
    pub fn seed_70b() -> ModelShape {
        ModelShape {
            params: 70.6e9,
            layers: 80,
            hidden: 8192,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
        }
    }

    /// KV bytes per token (K and V, every layer): 327,680 for the seed's model.
    pub fn kv_bytes_per_token(&self) -> f64 {
        (self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes) as f64
    }

    /// Weight bytes.
    pub fn weight_bytes(&self) -> f64 {
        self.params * self.dtype_bytes as f64
    }
}

/// One GPU, and how an instance of `tp` of them runs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Gpu {
    /// HBM bandwidth reached by streaming reads, B/s.
    pub hbm_bytes_per_s: f64,
    /// Dense bf16 peak, FLOP/s.
    pub peak_flops: f64,
    /// Fraction of peak a prefill step reaches.
    pub prefill_efficiency: f64,
    /// NVLink bandwidth per GPU, B/s.
    pub nvlink_bytes_per_s: f64,
    /// Latency of one all-reduce, s.
    pub allreduce_latency_s: f64,
    /// RDMA bandwidth per GPU, B/s.
    pub rdma_bytes_per_s: f64,
    /// Memory per GPU, bytes.
    pub memory_bytes: f64,
    /// Memory kept for activations and the runtime, bytes per GPU.
    pub reserve_bytes: f64,
}

impl Gpu {
    /// The H200 (141 GB HBM3e).
    pub fn h200() -> Gpu {
        Gpu {
            hbm_bytes_per_s: 4.25e12,
            peak_flops: 989e12,
            prefill_efficiency: 0.6,
            nvlink_bytes_per_s: 900e9,
            allreduce_latency_s: 8e-6,
            rdma_bytes_per_s: 400e9 / 8.0,
            memory_bytes: 141e9,
            reserve_bytes: 10e9,
        }
    }
}

/// Step and transfer times of one instance (`tp` GPUs serving `model`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Roofline {
    /// The model.
    pub model: ModelShape,
    /// The GPU.
    pub gpu: Gpu,
    /// GPUs per instance.
    pub tp: u32,
}

impl Roofline {
    fn allreduce_s(&self, tokens: f64) -> f64 {
        if self.tp <= 1 {
            return 0.0;
        }
        let tp = self.tp as f64;
        let bytes = tokens * self.model.hidden as f64 * self.model.dtype_bytes as f64;
        2.0 * self.model.layers as f64
            * (self.gpu.allreduce_latency_s + 2.0 * (tp - 1.0) / tp * bytes / self.gpu.nvlink_bytes_per_s)
    }

    /// One forward pass computing `new_tokens` tokens that attend to `attended` context tokens
    /// in all (summed over the new tokens), reading `kv_read_tokens` tokens of KV.
    pub fn step_s(&self, new_tokens: f64, attended: f64, kv_read_tokens: f64) -> f64 {
        let tp = self.tp as f64;
        let flops = 2.0 * self.model.params * new_tokens
            + 4.0 * self.model.layers as f64 * self.model.hidden as f64 * attended;
        let compute = flops / (tp * self.gpu.peak_flops * self.gpu.prefill_efficiency);
        let bytes = self.model.weight_bytes() + kv_read_tokens * self.model.kv_bytes_per_token();
        let memory = bytes / (tp * self.gpu.hbm_bytes_per_s);
        compute.max(memory) + self.allreduce_s(new_tokens)
    }

    /// A prefill chunk of `len` tokens whose first token sits at position `start`.
    pub fn prefill_chunk_s(&self, start: f64, len: f64) -> f64 {
        // Token i attends to start + i + 1 positions.
        let attended = len * start + len * (len + 1.0) / 2.0;
        self.step_s(len, attended, start + len)
    }

    /// A decode step of `batch` sequences holding `context` tokens in all.
    pub fn decode_step_s(&self, batch: f64, context: f64) -> f64 {
        self.step_s(batch, context, context)
    }

    /// Moving a prompt's KV (`tokens`) to a decode instance.
    pub fn transfer_s(&self, tokens: f64) -> f64 {
        tokens * self.model.kv_bytes_per_token() / (self.tp as f64 * self.gpu.rdma_bytes_per_s)
    }

    /// KV tokens one instance holds.
    pub fn kv_capacity_tokens(&self) -> f64 {
        let per_gpu = self.gpu.memory_bytes - self.gpu.reserve_bytes
            - self.model.weight_bytes() / self.tp as f64;
        (per_gpu.max(0.0) * self.tp as f64 / self.model.kv_bytes_per_token()).floor()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_model_holds_320_kib_per_token_and_an_h200_instance_a_few_million_tokens() {
        let r = Roofline { model: ModelShape::seed_70b(), gpu: Gpu::h200(), tp: 8 };
        assert_eq!(r.model.kv_bytes_per_token(), 327_680.0);
        // (141 - 10 - 17.65) GB × 8 / 320 KiB ≈ 2.77 M tokens.
        let cap = r.kv_capacity_tokens();
        assert!((2.7e6..2.8e6).contains(&cap), "{cap}");
    }

    #[test]
    fn decode_is_bandwidth_bound_and_prefill_compute_bound() {
        let r = Roofline { model: ModelShape::seed_70b(), gpu: Gpu::h200(), tp: 8 };
        // One decode step at batch 1: 141 GB / (8 × 4.25 TB/s) ≈ 4.2 ms, plus all-reduces.
        let d = r.decode_step_s(1.0, 2048.0);
        assert!((0.0042..0.0065).contains(&d), "{d}");
        // A 2,048-token prefill: ≈ 2.9e14 FLOP / (8 × 989e12 × 0.6) ≈ 61 ms.
        let p = r.prefill_chunk_s(0.0, 2048.0);
        assert!((0.055..0.075).contains(&p), "{p}");
        // Batching decode is almost free until KV reads dominate.
        assert!(r.decode_step_s(64.0, 64.0 * 2048.0) < 2.5 * d);
        // The KV of 2,048 tokens crosses 8 × 400 Gb/s in about 1.7 ms.
        assert!((0.0015..0.0019).contains(&r.transfer_s(2048.0)));
    }
}

/// Step times measured on a real engine (`tandem bench-engine --format json`), for checking
/// the simulation against a real cluster of the same engines: prefill at the measured
/// tokens/s, a decode step at batch `b` taking `b / tokens_per_s(b)` (linear between the
/// measured batch sizes, flat beyond them), and a fixed KV-transfer tail.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MeasuredSteps {
    /// Prefill tokens per second.
    pub prefill_tokens_per_s: f64,
    /// `(batch, step seconds)`, by batch.
    pub decode_step_s: Vec<(f64, f64)>,
    /// Time from a prompt's last chunk to its KV at the decode node, s.
    pub transfer_s: f64,
    /// KV tokens one instance holds.
    pub kv_capacity_tokens: f64,
    /// Per-request time outside the engines, from the request's arrival to its prefill being
    /// queued (ingress parsing, tokenization, routing, the decode reservation, the hops), s:
    /// measured on the real cluster with a prompt of a few tokens.
    pub overhead_s: f64,
}

impl MeasuredSteps {
    /// From `tandem bench-engine --format json` output.
    pub fn from_bench_engine(
        json: &str,
        transfer_s: f64,
        kv_capacity_tokens: f64,
        overhead_s: f64,
    ) -> Result<MeasuredSteps, String> {
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("not bench-engine JSON: {e}"))?;
        let prefill = v["prefill_tok_s"].as_f64().ok_or("no prefill_tok_s")?;
        let mut decode: Vec<(f64, f64)> = v["decode_tok_s"]
            .as_object()
            .ok_or("no decode_tok_s")?
            .iter()
            .filter_map(|(b, t)| Some((b.parse::<f64>().ok()?, t.as_f64()?)))
            .filter(|(b, t)| *b > 0.0 && *t > 0.0)
            .map(|(b, t)| (b, b / t))
            .collect();
        decode.sort_by(|a, b| a.0.total_cmp(&b.0));
        if decode.is_empty() || prefill.is_nan() || prefill <= 0.0 {
            return Err("bench-engine JSON without positive prefill and decode figures".into());
        }
        Ok(MeasuredSteps {
            prefill_tokens_per_s: prefill,
            decode_step_s: decode,
            transfer_s,
            kv_capacity_tokens,
            overhead_s,
        })
    }

    /// A decode step of `batch` sequences.
    pub fn decode_s(&self, batch: f64) -> f64 {
        let d = &self.decode_step_s;
        if batch <= d[0].0 {
            return d[0].1;
        }
        for w in d.windows(2) {
            let ((b0, s0), (b1, s1)) = (w[0], w[1]);
            if batch <= b1 {
                return s0 + (s1 - s0) * (batch - b0) / (b1 - b0);
            }
        }
        d[d.len() - 1].1
    }

    /// A prefill step of `tokens` tokens.
    pub fn prefill_s(&self, tokens: f64) -> f64 {
        tokens / self.prefill_tokens_per_s
    }
}
