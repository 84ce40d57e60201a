//! Guided decoding in the simulator: the text a constrained request must produce.
//!
//! The simulator has no model, so instead of masking logits it writes a valid answer outright:
//! an instance of the requested JSON Schema (or any JSON object, or one of the choices), chosen
//! deterministically from the request's seed, which the engine then emits token by token. What it
//! cannot write (a regular expression, a grammar, a schema keyword it does not know) is refused
//! with an error naming it, never ignored.

use std::sync::OnceLock;

use serde_json::{Map, Value as Json, json};
use switchyard_core::rng::SplitMix64;
use switchyard_core::{Guided, TokenId};
use switchyard_tokenize::Tokenizer;

/// Deepest schema nesting followed.
const MAX_DEPTH: usize = 32;

/// The tokens of [`answer`], in the built-in model's vocabulary (`builtin:cl100k`, the
/// simulated model's tokenizer at the gateway).
pub fn script(guided: &Guided, seed: u64) -> Result<Vec<TokenId>, String> {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    let text = answer(guided, seed)?;
    TOKENIZER
        .get_or_init(Tokenizer::builtin_cl100k)
        .encode(&text)
        .map_err(|e| format!("cannot tokenize the guided answer: {e}"))
}

/// The text a request constrained by `guided` produces, from `seed`.
pub fn answer(guided: &Guided, seed: u64) -> Result<String, String> {
    let mut draw = Draw(SplitMix64::new(seed ^ 0x005E_ED0F_5C4E_3A00));
    match guided {
        Guided::JsonObject => Ok(json!({"answer": draw.word()}).to_string()),
        Guided::JsonSchema(text) => {
            let schema: Json = serde_json::from_str(text)
                .map_err(|e| format!("the JSON schema does not parse: {e}"))?;
            let value = Instance {
                root: &schema,
                draw: &mut draw,
            }
            .of(&schema, 0)?;
            Ok(value.to_string())
        }
        Guided::Choice(choices) => {
            let i = draw.below(choices.len() as u64) as usize;
            choices
                .get(i)
                .cloned()
                .ok_or_else(|| "guided choice needs at least one choice".to_owned())
        }
        Guided::Regex(_) => Err("the simulator cannot generate text for a regular expression (guided regex); use a JSON schema or choices".into()),
        Guided::Grammar(_) => Err("the simulator cannot generate text for a grammar (guided grammar); use a JSON schema or choices".into()),
    }
}

/// A deterministic stream of numbers: the workspace's seeded generator
/// (`switchyard_core::rng`), drawn from by remainder as the simulator always has, so a seed
/// gives the same guided output as before.
struct Draw(SplitMix64);

impl Draw {
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.0.next_u64() % n }
    }

    fn word(&mut self) -> String {
        const WORDS: [&str; 8] = [
            "switch", "yard", "rail", "signal", "wagon", "track", "depot", "junction",
        ];
        WORDS[self.below(WORDS.len() as u64) as usize].to_owned()
    }
}

struct Instance<'a, 'd> {
    root: &'a Json,
    draw: &'d mut Draw,
}

impl Instance<'_, '_> {
    fn of(&mut self, schema: &Json, depth: usize) -> Result<Json, String> {
        if depth > MAX_DEPTH {
            return Err(format!(
                "the JSON schema nests deeper than {MAX_DEPTH} levels"
            ));
        }
        let object = match schema {
            Json::Bool(true) => return Ok(json!({})),
            Json::Bool(false) => return Err("the JSON schema `false` admits nothing".into()),
            Json::Object(o) => o,
            _ => return Err("a JSON schema must be an object or a boolean".into()),
        };
        if let Some(reference) = object.get("$ref").and_then(Json::as_str) {
            let target = resolve(self.root, reference)?;
            return self.of(target, depth + 1);
        }
        if let Some(value) = object.get("const") {
            return Ok(value.clone());
        }
        if let Some(options) = object.get("enum").and_then(Json::as_array) {
            let i = self.draw.below(options.len() as u64) as usize;
            return options
                .get(i)
                .cloned()
                .ok_or_else(|| "a JSON schema `enum` is empty".into());
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(options) = object.get(key).and_then(Json::as_array) {
                let i = self.draw.below(options.len() as u64) as usize;
                let option = options
                    .get(i)
                    .ok_or_else(|| format!("a JSON schema `{key}` is empty"))?;
                // Sibling keywords (properties beside anyOf, say) apply too.
                let merged = merge(object, option, key);
                return self.of(&merged, depth + 1);
            }
        }
        if let Some(all) = object.get("allOf").and_then(Json::as_array) {
            let mut merged = object.clone();
            merged.remove("allOf");
            let mut merged = Json::Object(merged);
            for part in all {
                if let (Json::Object(m), Json::Object(p)) = (&mut merged, part) {
                    for (k, v) in p {
                        m.entry(k.clone()).or_insert_with(|| v.clone());
                    }
                }
            }
            return self.of(&merged, depth + 1);
        }
        for unknown in [
            "pattern",
            "patternProperties",
            "not",
            "if",
            "dependentSchemas",
        ] {
            if object.contains_key(unknown) {
                return Err(format!(
                    "the simulator cannot generate JSON for the schema keyword `{unknown}`"
                ));
            }
        }
        let kind = match object.get("type") {
            Some(Json::String(t)) => t.as_str(),
            // ["string", "null"]: the first that is not null.
            Some(Json::Array(types)) => types
                .iter()
                .filter_map(Json::as_str)
                .find(|t| *t != "null")
                .unwrap_or("null"),
            _ if object.contains_key("properties") => "object",
            _ if object.contains_key("items") => "array",
            _ => "object",
        };
        match kind {
            "object" => self.object(object, depth),
            "array" => self.array(object, depth),
            "string" => Ok(Json::String(self.string(object))),
            "integer" => Ok(json!(self.integer(object))),
            "number" => Ok(json!(self.integer(object) as f64 + 0.5)),
            "boolean" => Ok(Json::Bool(self.draw.below(2) == 1)),
            "null" => Ok(Json::Null),
            other => Err(format!("unknown JSON schema type `{other}`")),
        }
    }

    fn object(&mut self, object: &Map<String, Json>, depth: usize) -> Result<Json, String> {
        let mut out = Map::new();
        if let Some(properties) = object.get("properties").and_then(Json::as_object) {
            for (name, schema) in properties {
                out.insert(name.clone(), self.of(schema, depth + 1)?);
            }
        }
        // Required names without a property schema take any value.
        if let Some(required) = object.get("required").and_then(Json::as_array) {
            for name in required.iter().filter_map(Json::as_str) {
                if !out.contains_key(name) {
                    out.insert(name.to_owned(), Json::String(self.draw.word()));
                }
            }
        }
        Ok(Json::Object(out))
    }

    fn array(&mut self, object: &Map<String, Json>, depth: usize) -> Result<Json, String> {
        let min = object.get("minItems").and_then(Json::as_u64).unwrap_or(1);
        let max = object
            .get("maxItems")
            .and_then(Json::as_u64)
            .unwrap_or(min.max(2));
        if max < min {
            return Err("a JSON schema's maxItems is below its minItems".into());
        }
        let count = min.max(1).min(max);
        let prefix = object
            .get("prefixItems")
            .and_then(Json::as_array)
            .cloned()
            .unwrap_or_default();
        let items = object.get("items").cloned().unwrap_or(Json::Bool(true));
        let mut out = Vec::new();
        for i in 0..count.max(prefix.len() as u64) {
            let schema = prefix.get(i as usize).unwrap_or(&items);
            out.push(self.of(schema, depth + 1)?);
        }
        Ok(Json::Array(out))
    }

    fn string(&mut self, object: &Map<String, Json>) -> String {
        let base = match object.get("format").and_then(Json::as_str) {
            Some("date-time") => "2026-12-02T00:00:00Z".to_owned(),
            Some("date") => "2026-12-02".to_owned(),
            Some("time") => "12:00:00".to_owned(),
            Some("email") => format!("{}@example.com", self.draw.word()),
            Some("uri") => format!("https://example.com/{}", self.draw.word()),
            Some("uuid") => format!("00000000-0000-4000-8000-{:012x}", self.draw.below(1 << 48)),
            _ => self.draw.word(),
        };
        let min = object.get("minLength").and_then(Json::as_u64).unwrap_or(0) as usize;
        let max = object
            .get("maxLength")
            .and_then(Json::as_u64)
            .map(|m| m as usize);
        let mut text = base;
        while text.chars().count() < min {
            text.push('x');
        }
        if let Some(max) = max {
            text = text.chars().take(max).collect();
        }
        text
    }

    fn integer(&mut self, object: &Map<String, Json>) -> i64 {
        let bound = |key: &str| object.get(key).and_then(Json::as_f64);
        let low = bound("minimum")
            .or_else(|| bound("exclusiveMinimum").map(|x| x.floor() + 1.0))
            .unwrap_or(0.0);
        let high = bound("maximum")
            .or_else(|| bound("exclusiveMaximum").map(|x| x.ceil() - 1.0))
            .unwrap_or(low + 100.0);
        let (low, high) = (low.ceil() as i64, high.floor() as i64);
        if high <= low {
            return low;
        }
        low + self.draw.below((high - low + 1) as u64) as i64
    }
}

/// The schema a local `$ref` (`#/$defs/x`) points to.
fn resolve<'a>(root: &'a Json, reference: &str) -> Result<&'a Json, String> {
    let pointer = reference
        .strip_prefix('#')
        .ok_or_else(|| format!("the simulator resolves only local $refs, not {reference}"))?;
    root.pointer(pointer)
        .ok_or_else(|| format!("the JSON schema's $ref {reference} points nowhere"))
}

/// `option` with the keywords of `parent` it does not set (but not `key` itself).
fn merge(parent: &Map<String, Json>, option: &Json, key: &str) -> Json {
    let mut merged = match option {
        Json::Object(o) => o.clone(),
        other => return other.clone(),
    };
    for (k, v) in parent {
        if k != key {
            merged.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    Json::Object(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema_answer(schema: Json, seed: u64) -> Json {
        serde_json::from_str(&answer(&Guided::JsonSchema(schema.to_string()), seed).unwrap())
            .unwrap()
    }

    #[test]
    fn schema_instances_have_the_shape_asked_and_depend_only_on_the_seed() {
        let schema = json!({"type": "object", "properties": {
            "name": {"type": "string", "minLength": 8},
            "age": {"type": "integer", "minimum": 18, "maximum": 20},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 2},
            "kind": {"const": "person"},
            "address": {"$ref": "#/$defs/address"},
            "nick": {"type": ["string", "null"]},
            "score": {"anyOf": [{"type": "number"}, {"type": "boolean"}]}},
            "required": ["name", "age"],
            "$defs": {"address": {"type": "object", "properties": {"city": {"type": "string"}}}}});
        for seed in 0..20 {
            let v = schema_answer(schema.clone(), seed);
            assert!(v["name"].as_str().unwrap().len() >= 8, "{v}");
            let age = v["age"].as_i64().unwrap();
            assert!((18..=20).contains(&age), "{v}");
            assert!(v["tags"].as_array().unwrap().len() >= 2);
            assert!(
                v["tags"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|t| t == "a" || t == "b")
            );
            assert_eq!(v["kind"], "person");
            assert!(v["address"]["city"].is_string(), "{v}");
            assert!(v["nick"].is_string());
            assert!(v["score"].is_number() || v["score"].is_boolean());
            assert_eq!(v, schema_answer(schema.clone(), seed), "deterministic");
        }
    }

    #[test]
    fn choices_and_objects_and_refusals() {
        let choices = Guided::Choice(vec!["yes".into(), "no".into()]);
        for seed in 0..10 {
            let a = answer(&choices, seed).unwrap();
            assert!(a == "yes" || a == "no");
        }
        let object: Json = serde_json::from_str(&answer(&Guided::JsonObject, 3).unwrap()).unwrap();
        assert!(object.is_object());
        for refused in [
            Guided::Regex("[a-z]+".into()),
            Guided::Grammar("root ::= \"a\"".into()),
            Guided::JsonSchema(json!({"type": "string", "pattern": "^a+$"}).to_string()),
            Guided::JsonSchema("{not json".into()),
            Guided::JsonSchema(json!({"$ref": "https://x/y"}).to_string()),
        ] {
            let err = answer(&refused, 1).unwrap_err();
            assert!(!err.is_empty());
        }
    }
}
