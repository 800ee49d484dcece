//! The tokenizer's vocabulary as llguidance sees it: a token trie over every token's bytes, and
//! the parser factory every request's grammar is compiled by.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use tandem_tokenizer::Tokenizer;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::{Constraint, GrammarError, ResponseFormat};

/// `toktrie`'s view of a [`Tokenizer`]: the trie, and BPE encoding for what llguidance needs to
/// tokenize (forced text).
struct Env {
    tokenizer: Arc<Tokenizer>,
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode(text),
            // Part of a character: BPE needs whole text, the trie does bytes.
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// One model's vocabulary, compiled once and shared by every constrained request (`Send + Sync`).
pub struct Vocabulary {
    factory: ParserFactory,
    /// Every id that ends a sequence (allowed together when the grammar is complete).
    eos_ids: Vec<u32>,
    /// Logit rows are this long (the model's vocabulary, ≥ the tokenizer's).
    vocab_size: usize,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("vocab_size", &self.vocab_size)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

impl Vocabulary {
    /// The vocabulary of `tokenizer` for logit rows of `vocab_size` entries (ids the tokenizer
    /// lacks are never allowed); `eos_ids` are the ids that end a sequence (the first is the
    /// grammar's end-of-sequence).
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize, eos_ids: &[u32]) -> Result<Self, GrammarError> {
        let Some(&eos) = eos_ids.first() else {
            return Err(GrammarError::Vocabulary("no end-of-sequence token".into()));
        };
        if vocab_size < tokenizer.vocab_size() || eos as usize >= vocab_size {
            return Err(GrammarError::Vocabulary(format!(
                "logit rows of {vocab_size} cannot hold the tokenizer's {} tokens (eos {eos})",
                tokenizer.vocab_size()
            )));
        }
        let words: Vec<Vec<u8>> = (0..vocab_size as u32)
            .map(|id| match tokenizer.token_bytes(id) {
                Some(b) if tokenizer.is_added_token(id) => {
                    let mut w = Vec::with_capacity(b.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(b);
                    w
                }
                Some(b) => b.to_vec(),
                None => Vec::new(),
            })
            .collect();
        let info = TokRxInfo {
            tok_bos: tokenizer.bos_token_id(),
            ..TokRxInfo::new(vocab_size as u32, eos)
        };
        let trie = TokTrie::from(&info, &words);
        let env: toktrie::TokEnv = Arc::new(Env { tokenizer, trie });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Vocabulary { factory, eos_ids: eos_ids.to_vec(), vocab_size })
    }

    /// A fresh constraint for one output in `format`; an invalid or unsupported schema is
    /// [`GrammarError::Invalid`] naming it, with llguidance's reason.
    pub fn compile(&self, format: &ResponseFormat) -> Result<Constraint, GrammarError> {
        let mut schema = match format.schema() {
            serde_json::Value::Bool(true) => serde_json::json!({}),
            s => s,
        };
        // Compact JSON, no free whitespace (see the crate docs); replaces any x-guidance of the
        // caller's.
        let options = JsonCompileOptions {
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            whitespace_flexible: false,
            ..JsonCompileOptions::default()
        };
        options.apply_to(&mut schema);
        let invalid = |reason: String| GrammarError::Invalid { part: format.schema_part().into(), reason };
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_json_schema(schema))
            .map_err(|e| invalid(format!("{e:#}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(e));
        }
        Ok(Constraint::new(matcher, self.eos_ids.clone(), self.vocab_size))
    }
}
