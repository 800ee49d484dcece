//! The tokenizer's error type: every way loading a vocabulary or rendering a chat can fail.
//!
//! Encoding and decoding cannot fail once a [`crate::Tokenizer`] exists, so every
//! variant here is raised while loading (bad metadata, bad merges, unsupported configuration) or
//! by [`crate::Tokenizer::apply_chat_template`].

use std::path::PathBuf;

/// Why a merge rule of the vocabulary was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadMergeReason {
    /// The rule is not two tokens separated by one space.
    NotAPair,
    /// The left token is not in the vocabulary.
    UnknownLeft,
    /// The right token is not in the vocabulary.
    UnknownRight,
    /// The concatenation of the two tokens is not in the vocabulary.
    UnknownMerged,
}

impl std::fmt::Display for BadMergeReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NotAPair => "not two tokens separated by a space",
            Self::UnknownLeft => "left token not in the vocabulary",
            Self::UnknownRight => "right token not in the vocabulary",
            Self::UnknownMerged => "merged token not in the vocabulary",
        })
    }
}

/// Errors raised while building a [`crate::Tokenizer`] or applying a chat template.
#[derive(thiserror::Error, Debug)]
pub enum TokenizerError {
    /// A required metadata key (GGUF key or tokenizer.json field) is absent.
    #[error("tokenizer metadata `{key}` is missing")]
    MissingMetadata {
        /// The key that was looked up.
        key: &'static str,
    },
    /// A metadata key holds a value of the wrong type or shape.
    #[error("tokenizer metadata `{key}` is malformed: expected {expected}")]
    BadMetadata {
        /// The key whose value was rejected.
        key: &'static str,
        /// What the value should have been.
        expected: &'static str,
    },
    /// The vocabulary is not a byte-level BPE model (e.g. SentencePiece `llama`, WordPiece).
    #[error(
        "unsupported tokenizer model `{0}`: only byte-level BPE (GGUF `gpt2`, tokenizer.json `BPE`)"
    )]
    UnknownModel(String),
    /// The GGUF names a pre-tokenizer (`tokenizer.ggml.pre`) this module does not implement.
    #[error("unsupported pre-tokenizer `{0}`")]
    UnknownPreTokenizer(String),
    /// A tokenizer.json setting this module does not implement.
    #[error("unsupported tokenizer setting `{field}` = {value}")]
    UnsupportedConfig {
        /// The JSON field, dotted from the document root.
        field: &'static str,
        /// The value found there, as JSON-ish text.
        value: String,
    },
    /// A merge rule names tokens that do not exist or is not a pair.
    #[error("merge #{index} `{merge}` is invalid: {reason}")]
    BadMerge {
        /// Position of the rule in the merge list (its rank).
        index: usize,
        /// The rule as written.
        merge: String,
        /// What is wrong with it.
        reason: BadMergeReason,
    },
    /// A token id in the vocabulary or added tokens is too large to index.
    #[error("token `{token}` has id {id}, beyond the supported vocabulary size")]
    TokenIdOutOfRange {
        /// The token's text.
        token: String,
        /// Its id.
        id: u64,
    },
    /// The special-token name (EOS, BOS) configured is not in the vocabulary.
    #[error("{role} token `{token}` is not in the vocabulary")]
    UnknownSpecialToken {
        /// Which special token (`"eos"`, `"bos"`).
        role: &'static str,
        /// The configured token text.
        token: String,
    },
    /// A pre-tokenizer regex could not be compiled (or uses lookaround beyond `\s+(?!\S)`).
    #[error("pre-tokenizer regex `{pattern}` is unsupported: {reason}")]
    BadRegex {
        /// The pattern as configured.
        pattern: String,
        /// Why it was rejected (the compiler's message or the unsupported construct).
        reason: String,
    },
    /// The chat template is not one this module can render (only ChatML is supported).
    #[error("chat template is not ChatML (no `<|im_start|>`); only ChatML templates are supported")]
    UnsupportedChatTemplate,
    /// Reading a tokenizer file failed.
    #[error("reading {path}: {source}")]
    Io {
        /// The file being read.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A tokenizer file is not valid JSON of the expected shape.
    #[error("parsing {path}: {source}")]
    Json {
        /// The file being parsed.
        path: PathBuf,
        /// The underlying error.
        source: serde_json::Error,
    },
}
