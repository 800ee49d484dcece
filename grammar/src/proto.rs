//! [`ResponseFormat`] on the wire (`tandem.v1.ResponseFormat`): what the router sends the nodes
//! and what gRPC callers send the router. The schema travels as JSON text.

use serde_json::{Value, json};
use tandem_proto::v1 as pb;

use crate::{GrammarError, ResponseFormat};

impl ResponseFormat {
    /// The wire form.
    pub fn to_proto(&self) -> pb::ResponseFormat {
        use pb::response_format::{Format, JsonObject, JsonSchema};
        let format = match self {
            ResponseFormat::JsonObject => Format::JsonObject(JsonObject {}),
            ResponseFormat::JsonSchema { name, schema } => Format::JsonSchema(JsonSchema {
                name: name.clone(),
                schema: schema.to_string(),
                strict: true,
            }),
        };
        pb::ResponseFormat { format: Some(format) }
    }

    /// Reads the wire form, checked as [`from_openai`](Self::from_openai) checks OpenAI's
    /// (parts are named as OpenAI's: `response_format.json_schema.schema`, ...). No `format`
    /// set is free text.
    pub fn from_proto(p: &pb::ResponseFormat) -> Result<Option<ResponseFormat>, GrammarError> {
        use pb::response_format::Format;
        let openai = match &p.format {
            None => return Ok(None),
            Some(Format::JsonObject(_)) => json!({"type": "json_object"}),
            Some(Format::JsonSchema(s)) => {
                let mut js = json!({"name": s.name, "strict": s.strict});
                if !s.schema.is_empty() {
                    let schema: Value = serde_json::from_str(&s.schema).map_err(|e| GrammarError::Invalid {
                        part: "response_format.json_schema.schema".into(),
                        reason: format!("is not JSON: {e}"),
                    })?;
                    js["schema"] = schema;
                }
                json!({"type": "json_schema", "json_schema": js})
            }
        };
        ResponseFormat::from_openai(&openai)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_names_bad_parts() {
        for f in [
            ResponseFormat::JsonObject,
            ResponseFormat::JsonSchema { name: "n".into(), schema: json!({"type": "array", "items": {"type": "integer"}}) },
        ] {
            assert_eq!(ResponseFormat::from_proto(&f.to_proto()).unwrap(), Some(f));
        }
        assert_eq!(ResponseFormat::from_proto(&pb::ResponseFormat::default()).unwrap(), None);
        let bad = |name: &str, schema: &str| {
            let p = pb::ResponseFormat {
                format: Some(pb::response_format::Format::JsonSchema(pb::response_format::JsonSchema {
                    name: name.into(),
                    schema: schema.into(),
                    strict: false,
                })),
            };
            match ResponseFormat::from_proto(&p) {
                Err(GrammarError::Invalid { part, .. }) => part,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(bad("n", "{not json"), "response_format.json_schema.schema");
        assert_eq!(bad("", "{}"), "response_format.json_schema.name");
    }
}
