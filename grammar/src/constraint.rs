//! One output's grammar state: which tokens may come next, and what has come.

use llguidance::Matcher;

use crate::GrammarError;

/// A compiled grammar following one output, token by token. Cloning copies the state (`n` > 1
/// choices each own one).
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    eos_ids: Vec<u32>,
    vocab_size: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .field("error", &self.matcher.get_error())
            .finish()
    }
}

impl Constraint {
    pub(crate) fn new(matcher: Matcher, eos_ids: Vec<u32>, vocab_size: usize) -> Self {
        Constraint { matcher, eos_ids, vocab_size }
    }

    /// Sets every logit the grammar forbids next to `-inf` (`logits` is one vocabulary-sized
    /// row). When the output is a complete value, every end-of-sequence id is allowed; when the
    /// grammar allows nothing more, only they are. On a matcher failure only end-of-sequence is
    /// left and the error is returned (the caller ends the output and reports it).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        debug_assert_eq!(logits.len(), self.vocab_size);
        let allowed = match self.matcher.compute_mask_or_eos() {
            Ok(m) => m,
            Err(e) => {
                self.only_eos(logits);
                return Err(GrammarError::Matcher(format!("{e:#}")));
            }
        };
        // The grammar's mask names only its own end-of-sequence id; the others follow it.
        let eos_ok = allowed.is_allowed(self.eos_ids[0]);
        let eos_logits: Vec<f32> = self.eos_ids.iter().map(|&e| logits[e as usize]).collect();
        let words = allowed.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if eos_ok {
            for (&e, &l) in self.eos_ids.iter().zip(&eos_logits) {
                logits[e as usize] = l;
            }
        }
        Ok(())
    }

    fn only_eos(&self, logits: &mut [f32]) {
        logits.fill(f32::NEG_INFINITY);
        for &e in &self.eos_ids {
            logits[e as usize] = 0.0;
        }
    }

    /// Advances past `token` (sampled under [`mask`](Self::mask), or replayed after a
    /// migration). End-of-sequence ids end the output and are not fed to the grammar.
    pub fn commit(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.eos_ids.contains(&token) {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Matcher(format!("token {token}: {e:#}")))
    }

    /// Whether the output so far is a complete value (end of sequence would be allowed).
    pub fn is_complete(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }
}
