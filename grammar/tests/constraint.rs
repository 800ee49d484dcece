//! The grammar over the real model's vocabulary: masks allow exactly what keeps the output
//! valid, a walk through allowed tokens always ends in a value the schema accepts, and bad
//! schemas are refused before any token.
//!
//! Needs the model's tokenizer (`$TANDEM_MODEL`, else the default cache; scripts/setup.sh).

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Value, json};
use tandem_grammar::{GrammarError, ResponseFormat, Vocabulary};
use tandem_tokenizer::{GgufMetadata, Tokenizer};

fn tokenizer() -> Arc<Tokenizer> {
    let path = std::env::var_os("TANDEM_MODEL").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        PathBuf::from,
    );
    let meta = GgufMetadata::read(&path)
        .unwrap_or_else(|e| panic!("the grammar tests need the model ({e}); run scripts/setup.sh"));
    Arc::new(Tokenizer::from_gguf(&meta).expect("the model's tokenizer loads"))
}

/// The model's logit rows are the tokenizer's vocabulary; `<|endoftext|>` (0) also ends.
fn vocab(t: &Arc<Tokenizer>) -> Vocabulary {
    let eos = t.eos_token_id();
    Vocabulary::new(t.clone(), t.vocab_size(), &[eos, 0]).expect("vocabulary builds")
}

fn schema(s: Value) -> ResponseFormat {
    ResponseFormat::JsonSchema { name: "t".into(), schema: s }
}

/// Greedy over a preference: at step `i` the allowed token with the highest `score(i, token)`.
/// Stands in for a model that keeps wanting things the grammar forbids.
fn walk(v: &Vocabulary, t: &Tokenizer, f: &ResponseFormat, score: impl Fn(usize, u32) -> f32, max: usize) -> (String, bool) {
    let mut c = v.compile(f).expect("compiles");
    let eos = [t.eos_token_id(), 0];
    let mut out = Vec::new();
    for step in 0..max {
        let mut row: Vec<f32> = (0..t.vocab_size() as u32).map(|id| score(step, id)).collect();
        c.mask(&mut row).expect("mask");
        let (best, l) = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
            .unwrap();
        assert!(l.is_finite(), "the mask left no token");
        let best = best as u32;
        if eos.contains(&best) {
            return (t.decode(&out), true);
        }
        c.commit(best).expect("an allowed token commits");
        out.push(best);
    }
    (t.decode(&out), false)
}

#[test]
fn json_mode_forces_an_object_even_when_the_model_prefers_prose() {
    let t = tokenizer();
    let v = vocab(&t);
    let hello = t.encode("Hello")[0];
    let quote = t.encode("\"")[0];
    let close = t.encode("}")[0];
    // Wants "Hello" at first, then a quote, then closing: never `{` on its own.
    let score = |step: usize, id: u32| match id {
        _ if id == hello && step < 3 => 10.0,
        _ if id == quote => 5.0,
        _ if id == close => 4.0,
        _ => -(id as f32) / 1e5,
    };
    let (text, ended) = walk(&v, &t, &ResponseFormat::JsonObject, score, 64);
    assert!(ended, "never ended: {text:?}");
    let parsed: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(parsed.is_object(), "{text}");
}

#[test]
fn a_schema_walk_ends_in_a_value_the_schema_accepts() {
    let t = tokenizer();
    let v = vocab(&t);
    let f = schema(json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    }));
    // A pseudo-random preference: whatever it likes, the grammar steers.
    let score = |_: usize, id: u32| ((id.wrapping_mul(2_654_435_761)) % 1000) as f32;
    let (text, ended) = walk(&v, &t, &f, score, 200);
    assert!(ended, "never ended: {text:?}");
    let parsed: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let o = parsed.as_object().unwrap();
    assert_eq!(o.len(), 3, "{text}");
    assert!(o["name"].as_str().is_some_and(|s| s.chars().count() <= 8), "{text}");
    assert!(o["age"].as_u64().is_some_and(|a| a <= 150), "{text}");
    assert!(o["tags"].as_array().is_some_and(|a| a.len() <= 2 && a.iter().all(|x| x == "a" || x == "b")), "{text}");
}

#[test]
fn end_of_sequence_is_allowed_only_once_the_value_is_complete() {
    let t = tokenizer();
    let v = vocab(&t);
    let mut c = v.compile(&schema(json!({"type": "boolean"}))).unwrap();
    let eos = t.eos_token_id();
    let mut row = vec![0.0f32; t.vocab_size()];
    c.mask(&mut row).unwrap();
    assert_eq!(row[eos as usize], f32::NEG_INFINITY, "nothing generated yet");
    assert_eq!(row[0], f32::NEG_INFINITY);
    let allowed: Vec<String> = (0..row.len() as u32)
        .filter(|&i| row[i as usize].is_finite())
        .map(|i| t.decode(&[i]))
        .collect();
    assert!(allowed.iter().all(|s| "true".starts_with(s.as_str()) || "false".starts_with(s.as_str())), "{allowed:?}");
    for tok in t.encode("true") {
        c.commit(tok).unwrap();
    }
    assert!(c.is_complete());
    let mut row = vec![1.5f32; t.vocab_size()];
    row[0] = 0.25;
    c.mask(&mut row).unwrap();
    let finite: Vec<usize> = (0..row.len()).filter(|&i| row[i].is_finite()).collect();
    assert_eq!(finite, vec![0, eos as usize], "only the end-of-sequence ids, each with its own logit");
    assert_eq!((row[0], row[eos as usize]), (0.25, 1.5));
}

#[test]
fn control_tokens_are_never_allowed_inside_a_string() {
    let t = tokenizer();
    let v = vocab(&t);
    let mut c = v.compile(&schema(json!({"type": "string"}))).unwrap();
    c.commit(t.encode("\"")[0]).unwrap();
    let mut row = vec![0.0f32; t.vocab_size()];
    c.mask(&mut row).unwrap();
    let im_start = t.token_id("<|im_start|>").expect("ChatML vocabulary");
    assert_eq!(row[im_start as usize], f32::NEG_INFINITY);
    assert!(row[t.encode("hello")[0] as usize].is_finite());
}

#[test]
fn a_token_outside_the_grammar_is_refused_and_a_replay_of_valid_ones_is_accepted() {
    let t = tokenizer();
    let v = vocab(&t);
    let f = schema(json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}));
    let mut c = v.compile(&f).unwrap();
    assert!(matches!(c.commit(t.encode("hello")[0]), Err(GrammarError::Matcher(_))));
    // A migration replays the output so far into a fresh constraint.
    let mut c = v.compile(&f).unwrap();
    for tok in t.encode("{\"a\": 12") {
        c.commit(tok).unwrap();
    }
    assert!(!c.is_complete());
    c.commit(t.encode("}")[0]).unwrap();
    assert!(c.is_complete());
}

#[test]
fn invalid_and_unsupported_schemas_are_refused_naming_the_schema() {
    let t = tokenizer();
    let v = vocab(&t);
    for (bad, why) in [
        (json!({"type": "nonsense"}), "nonsense"),
        (json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing"),
        (json!({"type": "integer", "minimum": 5, "maximum": 1}), ""),
    ] {
        match v.compile(&schema(bad.clone())) {
            Err(GrammarError::Invalid { part, reason }) => {
                assert_eq!(part, "response_format.json_schema.schema", "{bad}");
                assert!(reason.contains(why), "{bad}: {reason}");
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
}
