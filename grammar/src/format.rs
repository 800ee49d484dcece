//! `response_format` as OpenAI's API spells it, checked part by part.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::GrammarError;

/// A constraint on the output's shape (`{"type": "text"}` is none, so it has no variant).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Any JSON object (OpenAI's "JSON mode").
    JsonObject,
    /// A JSON value matching `schema` (OpenAI's "structured outputs").
    JsonSchema {
        /// The schema's name (letters, digits, `_` and `-`, at most 64), as OpenAI requires.
        name: String,
        /// The JSON schema itself.
        schema: Value,
    },
}

/// OpenAI's limit on `json_schema.name`.
const MAX_NAME_LEN: usize = 64;

impl ResponseFormat {
    /// Reads OpenAI's `response_format` object: `{"type": "text"}` (→ `None`),
    /// `{"type": "json_object"}`, or `{"type": "json_schema", "json_schema": {"name": ...,
    /// "schema": {...}, "strict": bool, "description": ...}}`. Anything else is
    /// [`GrammarError::Invalid`] naming the part.
    pub fn from_openai(v: &Value) -> Result<Option<ResponseFormat>, GrammarError> {
        let bad = |part: &str, reason: String| {
            Err(GrammarError::Invalid { part: format!("response_format{part}"), reason })
        };
        let Some(obj) = v.as_object() else {
            return bad("", "must be an object with a `type`".into());
        };
        match obj.get("type").and_then(Value::as_str) {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(ResponseFormat::JsonObject)),
            Some("json_schema") => {
                let Some(js) = obj.get("json_schema").and_then(Value::as_object) else {
                    return bad(".json_schema", "required with type json_schema, an object".into());
                };
                for key in js.keys() {
                    if !matches!(key.as_str(), "name" | "schema" | "strict" | "description") {
                        return bad(&format!(".json_schema.{key}"), "unknown field".into());
                    }
                }
                let name = match js.get("name").and_then(Value::as_str) {
                    Some(n)
                        if !n.is_empty()
                            && n.len() <= MAX_NAME_LEN
                            && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
                    {
                        n.to_string()
                    }
                    _ => {
                        return bad(
                            ".json_schema.name",
                            format!("required: 1 to {MAX_NAME_LEN} letters, digits, `_` or `-`"),
                        );
                    }
                };
                if js.get("strict").is_some_and(|s| !s.is_boolean()) {
                    return bad(".json_schema.strict", "must be a boolean".into());
                }
                let schema = match js.get("schema") {
                    None => Value::Object(Default::default()), // OpenAI: no schema = any JSON
                    Some(s @ (Value::Object(_) | Value::Bool(true))) => s.clone(),
                    Some(_) => {
                        return bad(".json_schema.schema", "must be a JSON schema object".into());
                    }
                };
                Ok(Some(ResponseFormat::JsonSchema { name, schema }))
            }
            Some(other) => bad(
                ".type",
                format!("{other:?} is not one of \"text\", \"json_object\", \"json_schema\""),
            ),
            None => bad(".type", "required, a string".into()),
        }
    }

    /// The schema handed to llguidance: `{"type": "object"}` for JSON mode.
    pub(crate) fn schema(&self) -> Value {
        match self {
            ResponseFormat::JsonObject => serde_json::json!({"type": "object"}),
            ResponseFormat::JsonSchema { schema, .. } => schema.clone(),
        }
    }

    /// Where a schema error points in the request.
    pub(crate) fn schema_part(&self) -> &'static str {
        match self {
            ResponseFormat::JsonObject => "response_format",
            ResponseFormat::JsonSchema { .. } => "response_format.json_schema.schema",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn part(v: Value) -> String {
        match ResponseFormat::from_openai(&v) {
            Err(GrammarError::Invalid { part, .. }) => part,
            other => panic!("{v}: {other:?}"),
        }
    }

    #[test]
    fn reads_the_three_types() {
        assert_eq!(ResponseFormat::from_openai(&json!({"type": "text"})).unwrap(), None);
        assert_eq!(
            ResponseFormat::from_openai(&json!({"type": "json_object"})).unwrap(),
            Some(ResponseFormat::JsonObject)
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let v = json!({"type": "json_schema", "json_schema": {"name": "a_b-1", "strict": true, "schema": schema}});
        assert_eq!(
            ResponseFormat::from_openai(&v).unwrap(),
            Some(ResponseFormat::JsonSchema { name: "a_b-1".into(), schema })
        );
    }

    #[test]
    fn a_bad_format_names_its_part() {
        assert_eq!(part(json!("json")), "response_format");
        assert_eq!(part(json!({})), "response_format.type");
        assert_eq!(part(json!({"type": "yaml"})), "response_format.type");
        assert_eq!(part(json!({"type": "json_schema"})), "response_format.json_schema");
        assert_eq!(
            part(json!({"type": "json_schema", "json_schema": {"schema": {}}})),
            "response_format.json_schema.name"
        );
        assert_eq!(
            part(json!({"type": "json_schema", "json_schema": {"name": "has space"}})),
            "response_format.json_schema.name"
        );
        assert_eq!(
            part(json!({"type": "json_schema", "json_schema": {"name": "n", "schema": 3}})),
            "response_format.json_schema.schema"
        );
        assert_eq!(
            part(json!({"type": "json_schema", "json_schema": {"name": "n", "strict": "yes"}})),
            "response_format.json_schema.strict"
        );
        assert_eq!(
            part(json!({"type": "json_schema", "json_schema": {"name": "n", "schemas": {}}})),
            "response_format.json_schema.schemas"
        );
    }
}
