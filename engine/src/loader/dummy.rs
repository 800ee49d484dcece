//! Random weights of any shape, for performance work (as vLLM's `--load-format dummy`).
//!
//! Values are uniform in ±1/√fan_in from a seeded generator, so activations stay bounded through
//! many layers and two runs with the same config and seed build bit-identical weights (and the
//! same fingerprint). Norm weights are 1.

use tandem_kernels::WeightDtype;

use super::{LayerWeights, ModelWeights, fingerprint, weight};
use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::rng::Rng;

fn uniform(rng: &mut Rng, n: usize, fan_in: usize) -> Vec<f32> {
    let bound = 1.0 / (fan_in as f32).sqrt();
    (0..n).map(|_| (rng.next_f32() * 2.0 - 1.0) * bound).collect()
}

/// Builds seeded random weights for `config` in `dtype`.
pub fn build(config: ModelConfig, seed: u64, dtype: WeightDtype) -> Result<ModelWeights, EngineError> {
    config.validate()?;
    let mut rng = Rng::new(seed);
    let (h, inter, vocab) = (config.hidden_size, config.intermediate_size, config.vocab_size);
    let attn_width = config.num_attention_heads * config.head_dim();
    let embed = weight("embed", vocab, h, uniform(&mut rng, vocab * h, 1), dtype)?;
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for _ in 0..config.num_hidden_layers {
        layers.push(LayerWeights {
            attn_norm: vec![1.0; h],
            qkv: weight("qkv", config.qkv_rows(), h, uniform(&mut rng, config.qkv_rows() * h, h), dtype)?,
            o_proj: weight("o_proj", h, attn_width, uniform(&mut rng, h * attn_width, attn_width), dtype)?,
            mlp_norm: vec![1.0; h],
            gate_up: weight("gate_up", 2 * inter, h, uniform(&mut rng, 2 * inter * h, h), dtype)?,
            down: weight("down", h, inter, uniform(&mut rng, h * inter, inter), dtype)?,
        });
    }
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(weight("lm_head", vocab, h, uniform(&mut rng, vocab * h, h), dtype)?)
    };
    let fingerprint = fingerprint(seed ^ 0xD0_77_D0_77, &config, dtype);
    Ok(ModelWeights { config, embed, layers, final_norm: vec![1.0; h], lm_head, fingerprint })
}
