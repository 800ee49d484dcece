//! Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.
//!
//! Reproducibility: a request's generator is seeded from its `seed` (or from its request id when
//! none is given) and draws exactly one number per sampled token, so the same seed gives the
//! same tokens on any node, in any batch, and after a migration that replays the token count.
//! Greedy (`temperature == 0`) draws nothing and picks the lowest index among equal maxima.
//!
//! Cost: greedy is one pass over the vocabulary; top-k/top-p sort only the candidates that
//! survive (a partial selection for top-k, a full sort of at most the vocabulary otherwise).

use serde::{Deserialize, Serialize};

use crate::error::EngineError;
use crate::rng::Rng;

/// Sampling parameters of one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy; otherwise logits are divided by this before softmax.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1.0 = no limit).
    pub top_p: f32,
    /// Generator seed; `None` derives one from the request id.
    pub seed: Option<u64>,
    /// Generate at most this many tokens.
    pub max_new_tokens: usize,
    /// Stop when the generated text contains any of these (the stop string is not returned).
    pub stop: Vec<String>,
    /// Keep going past the end-of-sequence token (benchmarks).
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_new_tokens: 64,
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> Self {
        SamplingParams { max_new_tokens, ..Default::default() }
    }

    /// Rejects values no sampler could honour, naming the field.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |field: &'static str, value: String, reason: &str| {
            Err(EngineError::InvalidRequest { field, value, reason: reason.into() })
        };
        // `!is_finite` also catches NaN, which no comparison does.
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", self.temperature.to_string(), "must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p.to_string(), "must be in (0, 1]");
        }
        if self.max_new_tokens == 0 {
            return bad("max_tokens", "0".into(), "must be at least 1");
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return bad("stop", "\"\"".into(), "stop strings must not be empty");
        }
        Ok(())
    }
}

/// Per-request sampling state: the parameters and the request's own generator.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    /// A sampler for one request; `request_id` seeds the generator when the params give no seed.
    pub fn new(params: SamplingParams, request_id: u64) -> Self {
        let seed = params.seed.unwrap_or(request_id ^ 0x5EED_5EED_5EED_5EED);
        Sampler { params, rng: Rng::new(seed) }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Skips the random draws of `tokens` already-sampled tokens (sampled elsewhere: the first
    /// token on a prefill node, or the tokens before a migration), so the rest of the stream is
    /// what one sampler would have produced. Greedy sampling draws nothing.
    pub fn advance(&mut self, tokens: usize) {
        if !self.is_greedy() {
            for _ in 0..tokens {
                self.rng.next_f64();
            }
        }
    }

    fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 || self.params.top_k == 1
    }

    /// Picks the next token from `logits` (one row, vocabulary-sized).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return tandem_kernels::argmax(logits) as u32;
        }
        let p = &self.params;
        // Candidates sorted by descending logit, ties by ascending index (deterministic).
        let mut idx: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize].is_finite()).collect();
        if idx.is_empty() {
            return tandem_kernels::argmax(logits) as u32;
        }
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b))
        };
        if p.top_k > 0 && p.top_k < idx.len() {
            idx.select_nth_unstable_by(p.top_k - 1, by_logit);
            idx.truncate(p.top_k);
        }
        idx.sort_unstable_by(by_logit);
        let max = logits[idx[0] as usize] as f64;
        let inv_t = 1.0 / p.temperature as f64;
        let mut probs: Vec<f64> = idx.iter().map(|&i| ((logits[i as usize] as f64 - max) * inv_t).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (n, pr) in probs.iter().enumerate() {
                acc += pr;
                if acc >= p.top_p as f64 {
                    keep = n + 1;
                    break;
                }
            }
            probs.truncate(keep);
            idx.truncate(keep);
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= total);
        }
        let u = self.rng.next_f64();
        let mut acc = 0.0;
        for (n, pr) in probs.iter().enumerate() {
            acc += pr;
            if u < acc {
                return idx[n];
            }
        }
        *idx.last().expect("at least one candidate")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![0.1, 2.0, 1.5, -1.0, 2.0, 0.3]
    }

    #[test]
    fn greedy_picks_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy(4), 1);
        assert_eq!(s.sample(&logits()), 1);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let params = SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone(), 99);
            (0..64).map(|_| s.sample(&logits())).collect::<Vec<_>>()
        };
        assert_eq!(draw(&params), draw(&params));
        assert_ne!(draw(&params), draw(&SamplingParams { seed: Some(8), ..params.clone() }));
    }

    #[test]
    fn advancing_past_tokens_sampled_elsewhere_continues_the_same_stream() {
        let params = SamplingParams { temperature: 0.8, seed: Some(3), ..Default::default() };
        let mut whole = Sampler::new(params.clone(), 5);
        let all: Vec<u32> = (0..10).map(|_| whole.sample(&logits())).collect();
        let mut rest = Sampler::new(params, 5);
        rest.advance(4);
        let tail: Vec<u32> = (0..6).map(|_| rest.sample(&logits())).collect();
        assert_eq!(tail, all[4..]);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let top2 = SamplingParams { temperature: 5.0, top_k: 2, seed: Some(1), ..Default::default() };
        let mut s = Sampler::new(top2, 0);
        for _ in 0..200 {
            assert!(matches!(s.sample(&logits()), 1 | 4));
        }
        // Two equal maxima hold ~2 × 0.3 of the mass at T=1: top_p 0.5 keeps only them.
        let nucleus = SamplingParams { temperature: 1.0, top_p: 0.5, seed: Some(1), ..Default::default() };
        let mut s = Sampler::new(nucleus, 0);
        for _ in 0..200 {
            assert!(matches!(s.sample(&logits()), 1 | 4));
        }
    }

    #[test]
    fn validation_names_the_field() {
        let bad = SamplingParams { max_new_tokens: 0, ..Default::default() };
        assert!(matches!(bad.validate(), Err(EngineError::InvalidRequest { field: "max_tokens", .. })));
        let bad = SamplingParams { temperature: -1.0, ..Default::default() };
        assert!(matches!(bad.validate(), Err(EngineError::InvalidRequest { field: "temperature", .. })));
        let bad = SamplingParams { top_p: 0.0, ..Default::default() };
        assert!(matches!(bad.validate(), Err(EngineError::InvalidRequest { field: "top_p", .. })));
    }
}
