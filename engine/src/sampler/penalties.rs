//! Repetition, presence and frequency penalties (OpenAI and vLLM semantics).
//!
//! - `presence_penalty` p and `frequency_penalty` f act on the request's *output* so far: a
//!   token generated c > 0 times has its logit lowered by `p + f × c`.
//! - `repetition_penalty` r acts on every token of the prompt and the output (as vLLM and
//!   Hugging Face do): a positive logit is divided by r, a negative one multiplied by it.
//!
//! Tokens that a migration resumes after (the request's earlier output, now at the end of the
//! prompt) count as output, so a migrated request is penalised exactly as before the move.
//! The state is empty and applying it is skipped when every penalty is neutral.

use std::collections::HashMap;

use super::SamplingParams;

/// The tokens a request's penalties look at.
#[derive(Clone, Debug, Default)]
pub(super) struct Penalties {
    presence: f32,
    frequency: f32,
    repetition: f32,
    /// Output token → times generated.
    output: HashMap<u32, u32>,
    /// Prompt tokens that are not output (for the repetition penalty), deduplicated.
    prompt: Vec<u32>,
}

impl Penalties {
    /// The state for `params` over `prompt` (whose last `params.resumed_output_tokens` tokens
    /// are earlier output); `None` when every penalty is neutral.
    pub(super) fn new(params: &SamplingParams, prompt: &[u32]) -> Option<Self> {
        if params.presence_penalty == 0.0
            && params.frequency_penalty == 0.0
            && params.repetition_penalty == 1.0
        {
            return None;
        }
        let split = prompt.len().saturating_sub(params.resumed_output_tokens);
        let mut p = Penalties {
            presence: params.presence_penalty,
            frequency: params.frequency_penalty,
            repetition: params.repetition_penalty,
            ..Default::default()
        };
        if p.repetition != 1.0 {
            let mut seen = prompt[..split].to_vec();
            seen.sort_unstable();
            seen.dedup();
            p.prompt = seen;
        }
        for &t in &prompt[split..] {
            p.observe(t);
        }
        Some(p)
    }

    /// Counts `token` as generated.
    pub(super) fn observe(&mut self, token: u32) {
        *self.output.entry(token).or_insert(0) += 1;
    }

    /// Applies the penalties to one row of logits in place. O(distinct tokens seen).
    pub(super) fn apply(&self, logits: &mut [f32]) {
        if self.repetition != 1.0 {
            let r = self.repetition;
            // Each token of prompt ∪ output once: the (deduplicated) prompt, then the output
            // tokens it does not hold.
            let output_only = self
                .output
                .keys()
                .filter(|t| self.prompt.binary_search(t).is_err());
            for &t in self.prompt.iter().chain(output_only) {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        if self.presence != 0.0 || self.frequency != 0.0 {
            for (&t, &c) in &self.output {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= self.presence + self.frequency * c as f32;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(presence: f32, frequency: f32, repetition: f32) -> SamplingParams {
        SamplingParams {
            presence_penalty: presence,
            frequency_penalty: frequency,
            repetition_penalty: repetition,
            ..Default::default()
        }
    }

    #[test]
    fn neutral_penalties_keep_no_state() {
        assert!(Penalties::new(&params(0.0, 0.0, 1.0), &[1, 2, 3]).is_none());
    }

    #[test]
    fn presence_and_frequency_act_on_output_counts_only() {
        let mut p = Penalties::new(&params(0.5, 0.25, 1.0), &[0, 0, 0]).unwrap();
        p.observe(1);
        p.observe(1);
        p.observe(2);
        let mut l = vec![1.0; 4];
        p.apply(&mut l);
        assert_eq!(
            l,
            [1.0, 1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 1.0],
            "prompt token 0 untouched"
        );
    }

    #[test]
    fn repetition_divides_positive_and_multiplies_negative_logits_once() {
        let mut p = Penalties::new(&params(0.0, 0.0, 2.0), &[0, 1, 1]).unwrap();
        p.observe(1); // in the prompt and the output: still penalised once
        p.observe(2);
        let mut l = vec![4.0, -4.0, 4.0, 4.0];
        p.apply(&mut l);
        assert_eq!(l, [2.0, -8.0, 2.0, 4.0]);
    }

    #[test]
    fn resumed_output_at_the_end_of_the_prompt_counts_as_output() {
        let mut with_resume = params(1.0, 0.0, 1.0);
        with_resume.resumed_output_tokens = 2;
        let p = Penalties::new(&with_resume, &[0, 3, 3]).unwrap();
        let mut l = vec![0.0; 4];
        p.apply(&mut l);
        assert_eq!(
            l,
            [0.0, 0.0, 0.0, -1.0],
            "token 3 was generated (twice), 0 was prompt"
        );
    }
}
