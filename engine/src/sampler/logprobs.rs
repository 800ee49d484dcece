//! Log probabilities of sampled tokens (OpenAI `logprobs` / `top_logprobs`).
//!
//! Reported from the distribution the model gives after penalties and before temperature,
//! top-k and top-p (what vLLM calls processed logprobs with sampling-only transforms left
//! out): the same numbers whatever the sampling settings, comparable across requests. One
//! pass for the log-sum-exp, one partial selection for the top `n`. Computed only for
//! requests that ask.

use serde::{Deserialize, Serialize};

/// The largest `top_logprobs` accepted (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A sampled token's log probability and the most likely alternatives at its position.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// The sampled token.
    pub token: u32,
    /// Its natural-log probability.
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens with theirs, most likely first (ties by id).
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log probability under `logits` (one vocabulary row) and the `top` most likely.
pub fn token_logprob(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| ((l - max) as f64).exp())
        .sum();
    let log_z = max as f64 + sum.ln();
    let lp = |t: u32| match logits.get(t as usize) {
        Some(&l) if l.is_finite() => (l as f64 - log_z) as f32,
        _ => f32::NEG_INFINITY,
    };
    let mut best: Vec<u32> = Vec::new();
    if top > 0 {
        best = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize].is_finite())
            .collect();
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        if top < best.len() {
            best.select_nth_unstable_by(top - 1, by_logit);
            best.truncate(top);
        }
        best.sort_unstable_by(by_logit);
    }
    TokenLogprob {
        token,
        logprob: lp(token),
        top: best.into_iter().map(|t| (t, lp(t))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_and_the_top_are_ordered() {
        let logits = [0.0f32, 1.0, 2.0, 2.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let lp = token_logprob(&logits, 1, 3);
        assert!((lp.logprob as f64 - (1.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [2, 3, 1], "most likely first, ties by id");
        let total: f64 = logits
            .iter()
            .enumerate()
            .map(|(i, _)| (token_logprob(&logits, i as u32, 0).logprob as f64).exp())
            .sum();
        assert!(
            (total - 1.0).abs() < 1e-6,
            "probabilities sum to 1: {total}"
        );
    }

    #[test]
    fn masked_tokens_have_minus_infinity_and_never_rank() {
        let logits = [f32::NEG_INFINITY, 0.0, 0.0];
        let lp = token_logprob(&logits, 0, 5);
        assert_eq!(lp.logprob, f32::NEG_INFINITY);
        assert_eq!(lp.top.len(), 2);
        assert!((lp.top[0].1 - 0.5f32.ln()).abs() < 1e-6);
    }
}
