//! Loading a [`Tokenizer`] from GGUF metadata (`tokenizer.ggml.*`), as llama.cpp writes it.
//!
//! Keys read: `model` (must be `gpt2`, i.e. byte-level BPE), `pre` (pre-tokenizer name),
//! `tokens` (vocabulary strings in byte-level form), `token_type` (3 = control and 4 =
//! user-defined tokens are matched literally in text), `merges` (`"left right"` in rank order),
//! `eos_token_id`, `bos_token_id` and `tokenizer.chat_template`. `add_bos_token` and
//! `add_space_prefix` are not read: `encode` never adds a BOS, and llama.cpp applies the space
//! prefix only to SentencePiece vocabularies. Cost: one pass over the ~49k tokens and merges.

use crate::gguf_meta::{GgufMetadata as Content, Value};

use super::added::AddedToken;
use super::error::{BadMergeReason, TokenizerError};
use super::pretokenize::PreTokenizer;
use super::{Tokenizer, TokenizerSpec, parse_merge};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// llama.cpp's `LLAMA_TOKEN_TYPE_CONTROL`.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// llama.cpp's `LLAMA_TOKEN_TYPE_USER_DEFINED`.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

fn get<'a>(content: &'a Content, key: &'static str) -> Result<&'a Value, TokenizerError> {
    content
        .metadata
        .get(key)
        .ok_or(TokenizerError::MissingMetadata { key })
}

fn string<'a>(value: &'a Value, key: &'static str) -> Result<&'a str, TokenizerError> {
    match value {
        Value::String(s) => Ok(s),
        _ => Err(TokenizerError::BadMetadata {
            key,
            expected: "a string",
        }),
    }
}

fn integer(value: &Value, key: &'static str) -> Result<i64, TokenizerError> {
    let bad = || TokenizerError::BadMetadata {
        key,
        expected: "an integer",
    };
    Ok(match *value {
        Value::U8(v) => v.into(),
        Value::I8(v) => v.into(),
        Value::U16(v) => v.into(),
        Value::I16(v) => v.into(),
        Value::U32(v) => v.into(),
        Value::I32(v) => v.into(),
        Value::U64(v) => i64::try_from(v).map_err(|_| bad())?,
        Value::I64(v) => v,
        _ => return Err(bad()),
    })
}

fn token_id(value: &Value, key: &'static str) -> Result<u32, TokenizerError> {
    u32::try_from(integer(value, key)?).map_err(|_| TokenizerError::BadMetadata {
        key,
        expected: "a token id",
    })
}

fn array<'a>(content: &'a Content, key: &'static str) -> Result<&'a [Value], TokenizerError> {
    match get(content, key)? {
        Value::Array(items) => Ok(items),
        _ => Err(TokenizerError::BadMetadata {
            key,
            expected: "an array",
        }),
    }
}

/// The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` name (absent: GPT-2's), and
/// whether that vocabulary ignores merges for whole-token pieces.
fn pre_tokenizer(name: Option<&str>) -> Result<(PreTokenizer, bool), TokenizerError> {
    match name {
        Some("smollm" | "starcoder") => Ok((PreTokenizer::smollm(), false)),
        None | Some("gpt-2" | "gpt2") => Ok((PreTokenizer::gpt2(), false)),
        Some("llama-bpe" | "llama3") => Ok((PreTokenizer::llama3(), true)),
        Some(other) => Err(TokenizerError::UnknownPreTokenizer(other.to_owned())),
    }
}

impl Tokenizer {
    /// Load the tokenizer embedded in a GGUF file's metadata (read with
    /// [`GgufMetadata::read`](crate::GgufMetadata::read)).
    ///
    /// # Errors
    /// A missing or malformed `tokenizer.ggml.*` key, a model other than `gpt2`, an unknown
    /// pre-tokenizer name, or a merge naming unknown tokens. (A byte with no token of its own
    /// is not an error: `encode` drops it, see the crate docs.)
    pub fn from_gguf(content: &Content) -> Result<Tokenizer, TokenizerError> {
        let model = string(get(content, KEY_MODEL)?, KEY_MODEL)?;
        if model != "gpt2" {
            return Err(TokenizerError::UnknownModel(model.to_owned()));
        }
        let pre_name = match content.metadata.get(KEY_PRE) {
            Some(v) => Some(string(v, KEY_PRE)?),
            None => None,
        };
        let (pre, ignore_merges) = pre_tokenizer(pre_name)?;
        let tokens = array(content, KEY_TOKENS)?
            .iter()
            .map(|v| string(v, KEY_TOKENS).map(|s| Some(s.to_owned())))
            .collect::<Result<Vec<_>, _>>()?;
        let types = match content.metadata.get(KEY_TOKEN_TYPE) {
            Some(_) => array(content, KEY_TOKEN_TYPE)?,
            None => &[],
        };
        if !types.is_empty() && types.len() != tokens.len() {
            return Err(TokenizerError::BadMetadata {
                key: KEY_TOKEN_TYPE,
                expected: "one entry per token",
            });
        }
        let mut added = Vec::new();
        for (id, ty) in types.iter().enumerate() {
            let ty = integer(ty, KEY_TOKEN_TYPE)?;
            if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
                let content = tokens[id].clone().unwrap_or_default();
                added.push(AddedToken {
                    content,
                    id: id as u32,
                    lstrip: false,
                    rstrip: false,
                });
            }
        }
        let merges = array(content, KEY_MERGES)?
            .iter()
            .enumerate()
            .map(|(index, v)| {
                let rule = string(v, KEY_MERGES)?;
                parse_merge(rule).ok_or_else(|| TokenizerError::BadMerge {
                    index,
                    merge: rule.to_owned(),
                    reason: BadMergeReason::NotAPair,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let eos = token_id(get(content, KEY_EOS)?, KEY_EOS)?;
        let bos = match content.metadata.get(KEY_BOS) {
            Some(v) => Some(token_id(v, KEY_BOS)?),
            None => None,
        };
        let chat_template = match content.metadata.get(KEY_CHAT_TEMPLATE) {
            Some(v) => Some(string(v, KEY_CHAT_TEMPLATE)?),
            None => None,
        };
        Tokenizer::from_spec(TokenizerSpec {
            tokens,
            added,
            merges,
            pre,
            ignore_merges,
            eos,
            bos,
            chat_template,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::byte_level::byte_to_char;
    use super::*;

    /// GGUF metadata for a 256-byte vocabulary plus `<|im_end|>` (control) and one merge.
    fn metadata() -> HashMap<String, Value> {
        let mut tokens: Vec<Value> = (0..=255u8)
            .map(|b| Value::String(byte_to_char(b).to_string()))
            .collect();
        tokens.push(Value::String("<|im_end|>".into()));
        tokens.push(Value::String("hi".into()));
        let mut types = vec![Value::I32(1); 258];
        types[256] = Value::I32(3);
        HashMap::from([
            (KEY_MODEL.to_owned(), Value::String("gpt2".into())),
            (KEY_PRE.to_owned(), Value::String("smollm".into())),
            (KEY_TOKENS.to_owned(), Value::Array(tokens)),
            (KEY_TOKEN_TYPE.to_owned(), Value::Array(types)),
            (
                KEY_MERGES.to_owned(),
                Value::Array(vec![Value::String("h i".into())]),
            ),
            (KEY_EOS.to_owned(), Value::U32(256)),
        ])
    }

    fn load(metadata: HashMap<String, Value>) -> Result<Tokenizer, TokenizerError> {
        let content = Content {
            version: 3,
            tensor_count: 0,
            metadata,
        };
        Tokenizer::from_gguf(&content)
    }

    #[test]
    fn minimal_gguf_vocabulary_loads() {
        let t = load(metadata()).unwrap();
        assert_eq!(t.encode("hi<|im_end|>"), [257, 256]);
        assert_eq!(t.eos_token_id(), 256);
        assert_eq!(t.bos_token_id(), None);
    }

    #[test]
    fn non_bpe_model_is_rejected() {
        let mut md = metadata();
        md.insert(KEY_MODEL.into(), Value::String("llama".into()));
        assert!(matches!(load(md), Err(TokenizerError::UnknownModel(m)) if m == "llama"));
    }

    #[test]
    fn unknown_pre_tokenizer_is_rejected() {
        let mut md = metadata();
        md.insert(KEY_PRE.into(), Value::String("qwen2".into()));
        assert!(matches!(load(md), Err(TokenizerError::UnknownPreTokenizer(p)) if p == "qwen2"));
    }

    #[test]
    fn missing_and_mistyped_keys_are_named() {
        let mut md = metadata();
        md.remove(KEY_TOKENS);
        assert!(matches!(
            load(md),
            Err(TokenizerError::MissingMetadata { key: KEY_TOKENS })
        ));
        let mut md = metadata();
        md.insert(KEY_EOS.into(), Value::String("2".into()));
        assert!(matches!(
            load(md),
            Err(TokenizerError::BadMetadata { key: KEY_EOS, .. })
        ));
        let mut md = metadata();
        md.insert(
            KEY_MERGES.into(),
            Value::Array(vec![Value::String("hi".into())]),
        );
        let err = load(md);
        assert!(matches!(
            err,
            Err(TokenizerError::BadMerge {
                index: 0,
                reason: BadMergeReason::NotAPair,
                ..
            })
        ));
    }
}
