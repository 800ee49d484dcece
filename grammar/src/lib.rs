//! Structured output: a request's `response_format` (any JSON object, or a JSON schema) compiled
//! by [llguidance](https://github.com/guidance-ai/llguidance) into a per-token mask over
//! tandem's vocabulary, so a sampler can only pick tokens that keep the output valid.
//!
//! ```text
//! ResponseFormat ──compile(&Vocabulary)──► Constraint ──mask(logits)──► sampler picks ──commit(token)──┐
//!                                             ▲                                                      │
//!                                             └──────────────────────────────────────────────────────┘
//! ```
//!
//! - [`ResponseFormat::from_openai`] reads OpenAI's `response_format` object and names the part
//!   that is wrong ([`GrammarError::Invalid`]); `{"type": "text"}` is no constraint at all.
//! - [`Vocabulary`] is built once per tokenizer (a token trie over every token's bytes; ~0.1 s
//!   for 49k tokens) and shared by every request.
//! - [`Vocabulary::compile`] turns a format into a fresh [`Constraint`]; a schema llguidance
//!   cannot compile (invalid, or using a keyword it does not support) is
//!   [`GrammarError::Invalid`] naming the schema and llguidance's reason, before any token.
//!
//! Invariants:
//! - A mask never allows a token the grammar rejects, and always allows at least one token: when
//!   the grammar is complete (or the matcher failed), only end-of-sequence is allowed.
//! - End of sequence is allowed exactly when the output so far is a complete value; every
//!   end-of-sequence id the caller names is treated alike.
//! - Added tokens (`<|im_start|>`, ...) are special to the grammar, never their literal text, so
//!   a JSON string cannot smuggle a control token in.
//! - JSON is compact (`", "` between items, `": "` after keys, no free whitespace): a small
//!   model cannot loop on newlines inside an object.

mod constraint;
mod format;
mod proto;
mod vocab;

pub use constraint::Constraint;
pub use format::ResponseFormat;
pub use vocab::Vocabulary;

/// What can go wrong compiling or following a grammar.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The request's format is malformed or unsupported; `part` names where
    /// (`response_format.json_schema.schema`, ...).
    #[error("{part}: {reason}")]
    Invalid { part: String, reason: String },
    /// The tokenizer's vocabulary could not be turned into a token trie.
    #[error("grammar vocabulary: {0}")]
    Vocabulary(String),
    /// The matcher failed on a token (a grammar that exceeded llguidance's limits, or a token
    /// that was not allowed).
    #[error("grammar matcher: {0}")]
    Matcher(String),
}
