//! Log probabilities in OpenAI's two shapes, rendered from the token ids and numbers the nodes
//! send (`TokenLogprob`) with the router's tokenizer.
//!
//! - chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
//!   "bytes"}]}]}`;
//! - completions (legacy): `{"tokens": [...], "token_logprobs": [...], "top_logprobs":
//!   [{token: logprob}] | null, "text_offset": [...]}`.
//!
//! A token's text is its bytes decoded as UTF-8 (lossily: a token may hold part of a
//! character; `bytes` carries them exactly). `-inf` (a token the sampler could not pick) is
//! sent as -9999.0, as OpenAI does, since JSON has no infinity.

use std::sync::Arc;

use serde_json::{Value, json};
use tandem_proto::v1 as pb;
use tandem_tokenizer::Tokenizer;

/// Renders and accumulates one choice's log probabilities.
#[derive(Clone, Debug)]
pub(super) struct LogprobWriter {
    tokenizer: Arc<Tokenizer>,
    /// Characters of output before the next token (completions' `text_offset`).
    offset: usize,
}

fn finite(lp: f32) -> f64 {
    if lp.is_finite() {
        f64::from(lp)
    } else {
        -9999.0
    }
}

impl LogprobWriter {
    pub(super) fn new(tokenizer: Arc<Tokenizer>) -> Self {
        LogprobWriter {
            tokenizer,
            offset: 0,
        }
    }

    fn bytes(&self, id: u32) -> &[u8] {
        self.tokenizer.token_bytes(id).unwrap_or(&[])
    }

    fn text(&self, id: u32) -> String {
        String::from_utf8_lossy(self.bytes(id)).into_owned()
    }

    /// Chat entries (`logprobs.content[..]`) for these tokens.
    pub(super) fn chat(&self, logprobs: &[pb::TokenLogprob]) -> Vec<Value> {
        logprobs
            .iter()
            .map(|l| {
                let top: Vec<Value> = l
                    .top
                    .iter()
                    .map(|t| {
                        json!({"token": self.text(t.token_id), "logprob": finite(t.logprob),
                               "bytes": self.bytes(t.token_id)})
                    })
                    .collect();
                json!({"token": self.text(l.token_id), "logprob": finite(l.logprob),
                       "bytes": self.bytes(l.token_id), "top_logprobs": top})
            })
            .collect()
    }

    /// The completions object for these tokens (offsets continue from the previous call).
    pub(super) fn completion(&mut self, logprobs: &[pb::TokenLogprob], with_top: bool) -> Value {
        let mut tokens = Vec::with_capacity(logprobs.len());
        let mut token_logprobs = Vec::with_capacity(logprobs.len());
        let mut tops = Vec::with_capacity(logprobs.len());
        let mut offsets = Vec::with_capacity(logprobs.len());
        for l in logprobs {
            let text = self.text(l.token_id);
            offsets.push(self.offset);
            self.offset += text.chars().count();
            tokens.push(text);
            token_logprobs.push(finite(l.logprob));
            let top: serde_json::Map<String, Value> = l
                .top
                .iter()
                .map(|t| (self.text(t.token_id), json!(finite(t.logprob))))
                .collect();
            tops.push(Value::Object(top));
        }
        json!({
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": if with_top { Value::Array(tops) } else { Value::Null },
            "text_offset": offsets,
        })
    }
}

/// Appends a completions logprobs object's lists to `acc` (the non-streamed answer).
pub(super) fn extend_completion(acc: &mut Value, more: Value) {
    if acc.is_null() {
        *acc = more;
        return;
    }
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(a), Some(b)) = (acc[key].as_array_mut(), more[key].as_array()) {
            a.extend(b.iter().cloned());
        }
    }
}
