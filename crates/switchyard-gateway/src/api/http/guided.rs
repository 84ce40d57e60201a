//! Structured output: the request's constraint on the answer, from whichever field the client
//! used — OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
//! (`json`, `json_object`, `regex`, `choice`, `grammar`) or its older `guided_json`,
//! `guided_regex`, `guided_choice`, `guided_grammar`. At most one may be given; each is checked
//! here and refused by name when it is malformed.

use serde_json::Value as Json;
use switchyard_core::Guided;

use crate::api::openai::SamplingFields;
use crate::error::ApiError;

/// The request's constraint, if any.
pub fn guided_of(s: &SamplingFields) -> Result<Option<Guided>, ApiError> {
    let mut found: Vec<(&'static str, Guided)> = Vec::new();
    if let Some(format) = &s.response_format
        && let Some(g) = response_format(format)?
    {
        found.push(("response_format", g));
    }
    if let Some(outputs) = &s.structured_outputs {
        found.push(("structured_outputs", structured_outputs(outputs)?));
    }
    if let Some(schema) = &s.guided_json {
        found.push((
            "guided_json",
            Guided::JsonSchema(schema_text("guided_json", schema)?),
        ));
    }
    if let Some(regex) = &s.guided_regex {
        found.push(("guided_regex", Guided::Regex(regex.clone())));
    }
    if let Some(choices) = &s.guided_choice {
        found.push(("guided_choice", Guided::Choice(choices.clone())));
    }
    if let Some(grammar) = &s.guided_grammar {
        found.push(("guided_grammar", Guided::Grammar(grammar.clone())));
    }
    match found.len() {
        0 => Ok(None),
        1 => {
            let (field, guided) = found.remove(0);
            guided
                .validate()
                .map_err(|rule| ApiError::bad_param(field, format!("`{field}` {rule}")))?;
            Ok(Some(guided))
        }
        _ => Err(ApiError::bad_param(
            found[1].0,
            format!(
                "`{}` and `{}` both constrain the output; give one",
                found[0].0, found[1].0
            ),
        )),
    }
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema` with
/// `json_schema.schema`.
fn response_format(format: &Json) -> Result<Option<Guided>, ApiError> {
    let bad = |m: &str| ApiError::bad_param("response_format", m.to_owned());
    match format.get("type").and_then(Json::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Guided::JsonObject)),
        Some("json_schema") => {
            let spec = format
                .get("json_schema")
                .ok_or_else(|| bad("`response_format.json_schema` is missing"))?;
            let schema = spec
                .get("schema")
                .ok_or_else(|| bad("`response_format.json_schema.schema` is missing"))?;
            Ok(Some(Guided::JsonSchema(schema_text(
                "response_format",
                schema,
            )?)))
        }
        Some(other) => Err(bad(&format!(
            "`response_format.type` {other:?} is not text, json_object or json_schema"
        ))),
        None => Err(bad("`response_format` needs a `type`")),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json`, `json_object`, `regex`, `choice`,
/// `grammar`; its other options are refused by name rather than dropped.
fn structured_outputs(outputs: &Json) -> Result<Guided, ApiError> {
    let bad = |m: String| ApiError::bad_param("structured_outputs", m);
    let Json::Object(fields) = outputs else {
        return Err(bad("`structured_outputs` must be an object".into()));
    };
    let mut constraints = Vec::new();
    for (key, value) in fields {
        let guided = match (key.as_str(), value) {
            (_, Json::Null) => continue,
            ("json", schema) => Guided::JsonSchema(schema_text("structured_outputs", schema)?),
            ("json_object", Json::Bool(true)) => Guided::JsonObject,
            ("json_object", Json::Bool(false)) => continue,
            ("regex", Json::String(r)) => Guided::Regex(r.clone()),
            ("grammar", Json::String(g)) => Guided::Grammar(g.clone()),
            ("choice", Json::Array(items)) => Guided::Choice(
                items
                    .iter()
                    .map(|c| c.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("`structured_outputs.choice` must be strings".into()))?,
            ),
            (other, _) => {
                return Err(bad(format!(
                    "`structured_outputs.{other}` is not taken (json, json_object, regex, choice, grammar are)"
                )));
            }
        };
        constraints.push(guided);
    }
    match constraints.len() {
        1 => Ok(constraints.remove(0)),
        0 => Err(bad("`structured_outputs` names no constraint".into())),
        _ => Err(bad(
            "`structured_outputs` names more than one constraint".into()
        )),
    }
}

/// A JSON Schema as text: an object (or boolean) schema, or text holding one.
fn schema_text(field: &'static str, schema: &Json) -> Result<String, ApiError> {
    let parsed = match schema {
        Json::String(text) => serde_json::from_str::<Json>(text).map_err(|e| {
            ApiError::bad_param(
                field,
                format!("`{field}` holds a schema that is not JSON: {e}"),
            )
        })?,
        other => other.clone(),
    };
    match parsed {
        Json::Object(_) | Json::Bool(_) => Ok(parsed.to_string()),
        _ => Err(ApiError::bad_param(
            field,
            format!("`{field}` must be a JSON Schema object"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn fields(v: Json) -> SamplingFields {
        serde_json::from_value(v).unwrap()
    }

    fn param(r: Result<Option<Guided>, ApiError>) -> String {
        match r {
            Err(ApiError::BadRequest { param, .. }) => param.unwrap_or_default(),
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn every_form_reads_into_one_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        for (body, want) in [
            (json!({}), None),
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some(Guided::JsonObject),
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some(Guided::JsonSchema(schema.to_string())),
            ),
            (
                json!({"structured_outputs": {"json": schema}}),
                Some(Guided::JsonSchema(schema.to_string())),
            ),
            (
                json!({"structured_outputs": {"choice": ["a", "b"]}}),
                Some(Guided::Choice(vec!["a".into(), "b".into()])),
            ),
            (
                json!({"guided_json": schema.to_string()}),
                Some(Guided::JsonSchema(schema.to_string())),
            ),
            (
                json!({"guided_regex": "[0-9]+"}),
                Some(Guided::Regex("[0-9]+".into())),
            ),
            (
                json!({"guided_grammar": "root ::= x"}),
                Some(Guided::Grammar("root ::= x".into())),
            ),
        ] {
            assert_eq!(guided_of(&fields(body.clone())).unwrap(), want, "{body}");
        }
    }

    #[test]
    fn malformed_or_doubled_constraints_are_refused_by_name() {
        for (body, want) in [
            (
                json!({"response_format": {"type": "xml"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
                "response_format",
            ),
            (
                json!({"structured_outputs": {"whitespace_pattern": "x"}}),
                "structured_outputs",
            ),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                "structured_outputs",
            ),
            (json!({"structured_outputs": {}}), "structured_outputs"),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_choice": []}), "guided_choice"),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
            ),
        ] {
            assert_eq!(param(guided_of(&fields(body.clone()))), want, "{body}");
        }
    }
}
