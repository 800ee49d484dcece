//! Loading a [`Tokenizer`] from a Hugging Face `tokenizer.json` of a byte-level BPE model.
//!
//! Supported: `model.type = "BPE"` with `"a b"` or `["a", "b"]` merges and `ignore_merges`;
//! `added_tokens` (with `lstrip`/`rstrip`); no normalizer; a pre-tokenizer made of `ByteLevel`
//! (`add_prefix_space = false`), `Digits` and `Split(Regex, "Isolated")` steps, optionally in a
//! `Sequence` (this covers GPT-2, SmolLM/StarCoder and Llama-3). Anything else is rejected with
//! [`TokenizerError::UnsupportedConfig`] rather than tokenised differently from `tokenizers`.
//!
//! `tokenizer.json` does not name the EOS/BOS tokens or the chat template; they are read from a
//! `tokenizer_config.json` next to it when present (`eos_token`, `bos_token`, `chat_template`).
//! Without one, EOS is the first of `<|im_end|>`, `<|eot_id|>`, `<|endoftext|>`,
//! `<|end_of_text|>`, `</s>` in the vocabulary, and there is no BOS and no template (plain ChatML).

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::added::AddedToken;
use super::error::{BadMergeReason, TokenizerError};
use super::pretokenize::{GPT2_PATTERN, PreStep, PreTokenizer, SplitRegex};
use super::{Tokenizer, TokenizerSpec, parse_merge};

/// Largest token id accepted (a malformed file must not make us allocate gigabytes).
const MAX_TOKEN_ID: u64 = 1 << 24;

/// EOS candidates, in order, when no `tokenizer_config.json` names it.
const EOS_FALLBACKS: [&str; 5] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
];

#[derive(Deserialize)]
struct HfFile {
    model: HfModel,
    #[serde(default)]
    added_tokens: Vec<HfAddedToken>,
    #[serde(default)]
    normalizer: Value,
    #[serde(default)]
    pre_tokenizer: Value,
}

#[derive(Deserialize)]
struct HfModel {
    #[serde(rename = "type")]
    kind: Option<String>,
    vocab: HashMap<String, u64>,
    merges: Vec<HfMerge>,
    #[serde(default)]
    ignore_merges: bool,
    #[serde(default)]
    byte_fallback: bool,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum HfMerge {
    Joined(String),
    Pair(String, String),
}

#[derive(Deserialize)]
struct HfAddedToken {
    id: u64,
    content: String,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    #[serde(default)]
    single_word: bool,
}

#[derive(Deserialize, Default)]
struct HfConfig {
    #[serde(default)]
    eos_token: Value,
    #[serde(default)]
    bos_token: Value,
    #[serde(default)]
    chat_template: Value,
}

fn unsupported(field: &'static str, value: impl ToString) -> TokenizerError {
    TokenizerError::UnsupportedConfig {
        field,
        value: value.to_string(),
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
        path: path.to_owned(),
        source,
    })
}

/// Append the steps of one `pre_tokenizer` node; returns whether it contained a `ByteLevel`.
fn pre_steps(node: &Value, steps: &mut Vec<PreStep>) -> Result<bool, TokenizerError> {
    let kind = node.get("type").and_then(Value::as_str).unwrap_or("");
    let flag =
        |name: &str, default: bool| node.get(name).and_then(Value::as_bool).unwrap_or(default);
    match kind {
        "Sequence" => {
            let children = node.get("pretokenizers").and_then(Value::as_array);
            let mut byte_level = false;
            for child in children.map(Vec::as_slice).unwrap_or_default() {
                byte_level |= pre_steps(child, steps)?;
            }
            Ok(byte_level)
        }
        "ByteLevel" => {
            if flag("add_prefix_space", false) {
                return Err(unsupported("pre_tokenizer.add_prefix_space", true));
            }
            if flag("use_regex", true) {
                steps.push(PreStep::Split(SplitRegex::new(GPT2_PATTERN)?));
            }
            Ok(true)
        }
        "Digits" => {
            steps.push(PreStep::Digits {
                individual: flag("individual_digits", false),
            });
            Ok(false)
        }
        "Split" => {
            let behavior = node.get("behavior").and_then(Value::as_str).unwrap_or("");
            if behavior != "Isolated" || flag("invert", false) {
                return Err(unsupported("pre_tokenizer.behavior", behavior));
            }
            let pattern = node.get("pattern");
            let regex = match (
                pattern.and_then(|p| p.get("Regex")).and_then(Value::as_str),
                pattern
                    .and_then(|p| p.get("String"))
                    .and_then(Value::as_str),
            ) {
                (Some(re), _) => re.to_owned(),
                (None, Some(literal)) => regex::escape(literal),
                (None, None) => return Err(unsupported("pre_tokenizer.pattern", node)),
            };
            steps.push(PreStep::Split(SplitRegex::new(&regex)?));
            Ok(false)
        }
        _ => Err(unsupported("pre_tokenizer.type", kind)),
    }
}

/// A special-token name from `tokenizer_config.json`: a string or `{"content": ...}`.
fn config_token(value: &Value) -> Option<&str> {
    value.as_str().or_else(|| value.get("content")?.as_str())
}

/// The chat template from `tokenizer_config.json`: a string, or a list of named templates
/// (the one named `default`).
fn config_template(value: &Value) -> Option<&str> {
    value.as_str().or_else(|| {
        value.as_array()?.iter().find_map(|t| {
            (t.get("name")?.as_str()? == "default").then(|| t.get("template")?.as_str())?
        })
    })
}

impl Tokenizer {
    /// A Hugging Face tokenizer.json of a byte-level BPE model (GPT-2 / SmolLM / Llama-3 style),
    /// with EOS/BOS and chat template from a sibling `tokenizer_config.json` if there is one.
    ///
    /// # Errors
    /// I/O and JSON errors, a model that is not byte-level BPE, unsupported normalizer or
    /// pre-tokenizer settings, invalid merges, or an EOS that cannot be determined.
    pub fn from_hf_json(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let file: HfFile = read_json(path)?;
        let config_path = path.with_file_name("tokenizer_config.json");
        let config: HfConfig = if config_path.is_file() {
            read_json(&config_path)?
        } else {
            HfConfig::default()
        };
        let model = file.model;
        if let Some(kind) = model.kind.as_deref().filter(|k| *k != "BPE") {
            return Err(TokenizerError::UnknownModel(kind.to_owned()));
        }
        if model.byte_fallback {
            return Err(unsupported("model.byte_fallback", true));
        }
        for (field, affix) in [
            (
                "model.continuing_subword_prefix",
                &model.continuing_subword_prefix,
            ),
            ("model.end_of_word_suffix", &model.end_of_word_suffix),
        ] {
            if let Some(affix) = affix.as_deref().filter(|a| !a.is_empty()) {
                return Err(unsupported(field, affix));
            }
        }
        if !file.normalizer.is_null() {
            return Err(unsupported("normalizer", &file.normalizer));
        }
        let mut steps = Vec::new();
        if !pre_steps(&file.pre_tokenizer, &mut steps)? {
            return Err(unsupported("pre_tokenizer", "no ByteLevel step"));
        }

        let ids = model.vocab.iter().map(|(t, &id)| (t, id));
        let added_ids = file.added_tokens.iter().map(|t| (&t.content, t.id));
        let mut tokens: Vec<Option<String>> = Vec::new();
        for (text, id) in ids.chain(added_ids) {
            if id >= MAX_TOKEN_ID {
                return Err(TokenizerError::TokenIdOutOfRange {
                    token: text.clone(),
                    id,
                });
            }
            let id = id as usize;
            if tokens.len() <= id {
                tokens.resize(id + 1, None);
            }
            tokens[id] = Some(text.clone());
        }
        let mut added = Vec::with_capacity(file.added_tokens.len());
        for t in &file.added_tokens {
            if t.single_word {
                return Err(unsupported("added_tokens.single_word", &t.content));
            }
            added.push(AddedToken {
                content: t.content.clone(),
                id: t.id as u32,
                lstrip: t.lstrip,
                rstrip: t.rstrip,
            });
        }
        let merges = model
            .merges
            .iter()
            .enumerate()
            .map(|(index, merge)| match merge {
                HfMerge::Pair(l, r) => Ok((l.as_str(), r.as_str())),
                HfMerge::Joined(rule) => {
                    parse_merge(rule).ok_or_else(|| TokenizerError::BadMerge {
                        index,
                        merge: rule.clone(),
                        reason: BadMergeReason::NotAPair,
                    })
                }
            })
            .collect::<Result<Vec<_>, _>>()?;

        let find = |text: &str| tokens.iter().position(|t| t.as_deref() == Some(text));
        let lookup = |role: &'static str, value: &Value| -> Result<Option<u32>, TokenizerError> {
            let Some(text) = config_token(value) else {
                return Ok(None);
            };
            let id = find(text).ok_or_else(|| TokenizerError::UnknownSpecialToken {
                role,
                token: text.to_owned(),
            })?;
            Ok(Some(id as u32))
        };
        let eos = match lookup("eos", &config.eos_token)? {
            Some(id) => id,
            None => EOS_FALLBACKS
                .iter()
                .find_map(|t| find(t))
                .ok_or(TokenizerError::MissingMetadata { key: "eos_token" })?
                as u32,
        };
        let bos = lookup("bos", &config.bos_token)?;
        Tokenizer::from_spec(TokenizerSpec {
            tokens,
            added,
            merges,
            pre: PreTokenizer::new(steps),
            ignore_merges: model.ignore_merges,
            eos,
            bos,
            chat_template: config_template(&config.chat_template),
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::byte_level::byte_to_char;
    use super::*;

    /// A GPT-2-style tokenizer.json: 256 byte tokens, "Ġt" and "Ġth" merges (old and new merge
    /// syntax), one added token; `pre_tokenizer` and `normalizer` as given.
    fn tokenizer_json(pre_tokenizer: Value, normalizer: Value) -> Value {
        let mut vocab: serde_json::Map<String, Value> = (0..=255u8)
            .map(|b| (byte_to_char(b).to_string(), json!(b)))
            .collect();
        vocab.insert("Ġt".into(), json!(256));
        vocab.insert("Ġth".into(), json!(257));
        json!({
            "added_tokens": [{"id": 300, "content": "<|eot|>", "lstrip": false, "rstrip": false,
                              "single_word": false, "normalized": false, "special": true}],
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "model": {"type": "BPE", "vocab": vocab, "merges": ["Ġ t", ["Ġt", "h"]],
                      "ignore_merges": false, "byte_fallback": false},
        })
    }

    /// Write `files` into a fresh temp dir and load its tokenizer.json.
    fn load(name: &str, files: &[(&str, &Value)]) -> Result<Tokenizer, TokenizerError> {
        let dir =
            std::env::temp_dir().join(format!("tandem-hf-json-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (file, value) in files {
            std::fs::write(dir.join(file), value.to_string()).unwrap();
        }
        let result = Tokenizer::from_hf_json(&dir.join("tokenizer.json"));
        std::fs::remove_dir_all(&dir).unwrap();
        result
    }

    fn byte_level() -> Value {
        json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})
    }

    #[test]
    fn gpt2_style_json_loads_with_config_tokens_and_template() {
        let config = json!({"eos_token": {"content": "<|eot|>"}, "bos_token": "!",
                            "chat_template": "{{ '<|im_start|>' + m }}"});
        let json = tokenizer_json(byte_level(), Value::Null);
        let t = load(
            "config",
            &[
                ("tokenizer.json", &json),
                ("tokenizer_config.json", &config),
            ],
        )
        .unwrap();
        assert_eq!(t.vocab_size(), 301);
        assert_eq!(t.eos_token_id(), 300);
        assert_eq!(t.bos_token_id(), Some(33), "`!` is byte 0x21");
        assert_eq!(t.encode("a the<|eot|>"), [97, 257, 101, 300]);
        assert_eq!(t.token_bytes(299), None, "ids 258..300 are holes");
        assert!(t.apply_chat_template(&[], true).is_ok());
    }

    #[test]
    fn eos_falls_back_to_a_known_end_token_without_config() {
        let mut json = tokenizer_json(byte_level(), Value::Null);
        json["added_tokens"][0]["content"] = json!("<|endoftext|>");
        let t = load("fallback", &[("tokenizer.json", &json)]).unwrap();
        assert_eq!(t.eos_token_id(), 300);
        assert_eq!(t.bos_token_id(), None);
    }

    #[test]
    fn sequence_with_digits_and_split_is_understood() {
        let pre = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "Split", "pattern": {"String": "-"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]});
        let mut json = tokenizer_json(pre, Value::Null);
        json["added_tokens"][0]["content"] = json!("<|im_end|>");
        let t = load("sequence", &[("tokenizer.json", &json)]).unwrap();
        // Without the ByteLevel regex " th" is not split from "a", but digits and "-" are.
        assert_eq!(t.encode("a th12-"), [97, 257, 49, 50, 45]);
    }

    #[test]
    fn unsupported_settings_are_rejected_not_approximated() {
        let nfc = json!({"type": "NFC"});
        let err = load(
            "nfc",
            &[("tokenizer.json", &tokenizer_json(byte_level(), nfc))],
        );
        assert!(matches!(
            err,
            Err(TokenizerError::UnsupportedConfig {
                field: "normalizer",
                ..
            })
        ));

        let metaspace = json!({"type": "Metaspace", "replacement": "▁"});
        let err = load(
            "metaspace",
            &[("tokenizer.json", &tokenizer_json(metaspace, Value::Null))],
        );
        assert!(matches!(err, Err(TokenizerError::UnsupportedConfig { .. })));

        let mut wordpiece = tokenizer_json(byte_level(), Value::Null);
        wordpiece["model"]["type"] = json!("WordPiece");
        let err = load("wordpiece", &[("tokenizer.json", &wordpiece)]);
        assert!(matches!(err, Err(TokenizerError::UnknownModel(m)) if m == "WordPiece"));
    }

    #[test]
    fn missing_file_is_an_io_error_naming_the_path() {
        let path = Path::new("/nonexistent/tokenizer.json");
        let err = Tokenizer::from_hf_json(path).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::Io { path: p, .. } if p == path),
            "{err}"
        );
    }
}
