//! A decode node's per-step prompt budget, sized from its measured step time.
//!
//! A decode node computes some prompts itself (conditional disaggregation: short prompts, or
//! every prompt when no prefill node is there). With the engine's whole `max_tokens_per_step`
//! (512) of prompt in one step, that step takes as long as a prefill of 512 tokens (2.5 s on a
//! 2-core CPU): every stream decoding on the node waits that long for its next token, and the
//! node's engine thread answers nothing (`Reserve` included) until the step ends.
//!
//! So the driver caps the prompt tokens per step ([`tandem_engine::Engine::set_prefill_token_cap`])
//! at what fits a target step time (`--max-step-ms`), from two running estimates:
//! - the step time with no prompt tokens (the decode batch alone), from such steps;
//! - the cost of one prompt token, from steps with some: (step − decode-alone) / prompt tokens.
//!
//! cap = (target − decode-alone) / per-token cost, kept within
//! [`MIN_PREFILL_TOKENS_PER_STEP`]..=`max_tokens_per_step` so prompts always progress. Before
//! the first measurement the cap is [`INITIAL_PREFILL_TOKENS_PER_STEP`]. Decode tokens are never
//! capped (the scheduler leaves them room), so the budget trades a local prompt's time to first
//! token for every other stream's inter-token latency, which is the point.

use std::time::Duration;

/// The cap never goes under this many prompt tokens a step (so local prompts progress even
/// when the decode batch alone takes the whole target).
pub const MIN_PREFILL_TOKENS_PER_STEP: usize = 16;

/// The cap before any step with prompt tokens was measured.
pub const INITIAL_PREFILL_TOKENS_PER_STEP: usize = 64;

/// Weight of the newest sample in the running estimates.
const EWMA_WEIGHT: f64 = 0.25;

fn ewma(old: Option<f64>, sample: f64) -> f64 {
    old.map_or(sample, |o| o + EWMA_WEIGHT * (sample - o))
}

/// The running estimates and the cap they give.
#[derive(Debug, Clone)]
pub struct StepBudget {
    target_ms: f64,
    max_tokens_per_step: usize,
    /// Step time with no prompt tokens, ms.
    decode_alone_ms: Option<f64>,
    /// Time one prompt token adds to a step, ms.
    per_prompt_token_ms: Option<f64>,
}

impl StepBudget {
    /// A budget aiming at steps of `target` under an engine step budget of
    /// `max_tokens_per_step` tokens.
    pub fn new(target: Duration, max_tokens_per_step: usize) -> Self {
        StepBudget {
            target_ms: target.as_secs_f64() * 1e3,
            max_tokens_per_step,
            decode_alone_ms: None,
            per_prompt_token_ms: None,
        }
    }

    /// Records a step of `elapsed` that ran `prompt_tokens` and `decode_tokens`.
    pub fn observe(&mut self, elapsed: Duration, prompt_tokens: usize, decode_tokens: usize) {
        let ms = elapsed.as_secs_f64() * 1e3;
        if prompt_tokens == 0 {
            if decode_tokens > 0 {
                self.decode_alone_ms = Some(ewma(self.decode_alone_ms, ms));
            }
            return;
        }
        // With no decode-alone estimate yet (or a batch that just grew), the whole step counts
        // against the prompt tokens: a smaller cap, the safe side.
        let alone = if decode_tokens > 0 {
            self.decode_alone_ms.unwrap_or(0.0)
        } else {
            0.0
        };
        let per_token = ((ms - alone) / prompt_tokens as f64).max(1e-6);
        self.per_prompt_token_ms = Some(ewma(self.per_prompt_token_ms, per_token));
    }

    /// Prompt tokens the next step may compute.
    pub fn cap(&self) -> usize {
        let fit = match self.per_prompt_token_ms {
            None => INITIAL_PREFILL_TOKENS_PER_STEP,
            Some(k) => {
                let room = self.target_ms - self.decode_alone_ms.unwrap_or(0.0);
                (room / k).max(0.0).min(usize::MAX as f64) as usize
            }
        };
        fit.clamp(
            MIN_PREFILL_TOKENS_PER_STEP.min(self.max_tokens_per_step),
            self.max_tokens_per_step,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn the_cap_fits_the_target_from_measured_steps() {
        let mut b = StepBudget::new(ms(200), 512);
        assert_eq!(b.cap(), INITIAL_PREFILL_TOKENS_PER_STEP, "unmeasured");
        // Decode alone: 40 ms a step. Prompt tokens: 3 ms each on top.
        for _ in 0..40 {
            b.observe(ms(40), 0, 16);
            b.observe(ms(40 + 3 * 64), 64, 16);
        }
        // (200 − 40) / 3 = 53.3 tokens.
        assert_eq!(b.cap(), 53);
        // Prompt tokens get dearer (6 ms each, say longer contexts): the cap follows, halved.
        for _ in 0..40 {
            b.observe(ms(40 + 6 * 53), 53, 16);
        }
        assert_eq!(b.cap(), 26);
    }

    #[test]
    fn the_cap_stays_within_its_bounds() {
        // Decode alone takes the whole target: prompts still get the minimum.
        let mut b = StepBudget::new(ms(50), 512);
        for _ in 0..10 {
            b.observe(ms(80), 0, 32);
            b.observe(ms(80 + 16), 16, 32);
        }
        assert_eq!(b.cap(), MIN_PREFILL_TOKENS_PER_STEP);
        // A fast engine (GPU-like: 0.01 ms a prompt token): the engine's own budget bounds it.
        let mut b = StepBudget::new(ms(100), 512);
        for _ in 0..10 {
            b.observe(Duration::from_micros(5_000 + 10 * 300), 300, 8);
        }
        assert_eq!(b.cap(), 512);
        // An engine budget under the minimum is the cap.
        let b = StepBudget::new(ms(100), 8);
        assert_eq!(b.cap(), 8);
    }

    #[test]
    fn a_prompt_only_step_charges_the_whole_step_to_its_tokens() {
        let mut b = StepBudget::new(ms(100), 512);
        b.observe(ms(40), 0, 16); // decode alone estimate: 40 ms
        b.observe(ms(200), 100, 0); // no stream decoding: 2 ms a token, not (200 − 40) / 100
        assert_eq!(b.cap(), ((100.0 - 40.0) / 2.0) as usize);
    }
}
