//! Guided (structured) decoding: a constraint on what the engine may generate, carried from the
//! request (`response_format`, vLLM's `structured_outputs`, a forced tool call) to the engine,
//! which enforces it in its own terms (vLLM `structured_outputs`, SGLang `json_schema`/`regex`/
//! `ebnf`, the simulator by writing a valid answer).

use serde::{Deserialize, Serialize};

/// Largest constraint accepted (a schema, a regex, a grammar, or all choices together).
pub const MAX_GUIDED_BYTES: usize = 256 * 1024;
/// Most choices of a [`Guided::Choice`].
pub const MAX_CHOICES: usize = 1024;

/// One constraint on the output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Guided {
    /// Any JSON object (OpenAI's `response_format: json_object`).
    JsonObject,
    /// JSON matching this JSON Schema, given as JSON text.
    JsonSchema(String),
    /// Text matching this regular expression.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text of this EBNF grammar (vLLM's `grammar`, SGLang's `ebnf`).
    Grammar(String),
}

impl Guided {
    /// The constraint's name, as vLLM's `structured_outputs` keys name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Guided::JsonObject => "json_object",
            Guided::JsonSchema(_) => "json",
            Guided::Regex(_) => "regex",
            Guided::Choice(_) => "choice",
            Guided::Grammar(_) => "grammar",
        }
    }

    /// Checks the constraint is usable: not empty, not oversized. (A schema's JSON is parsed by
    /// whoever builds it; the engine judges the rest.)
    pub fn validate(&self) -> Result<(), &'static str> {
        let size = match self {
            Guided::JsonObject => 0,
            Guided::JsonSchema(s) | Guided::Regex(s) | Guided::Grammar(s) => {
                if s.trim().is_empty() {
                    return Err("must not be empty");
                }
                s.len()
            }
            Guided::Choice(choices) => {
                if choices.is_empty() {
                    return Err("needs at least one choice");
                }
                if choices.len() > MAX_CHOICES {
                    return Err("takes at most 1024 choices");
                }
                if choices.iter().any(String::is_empty) {
                    return Err("choices must not be empty strings");
                }
                choices.iter().map(String::len).sum()
            }
        };
        if size > MAX_GUIDED_BYTES {
            return Err("must be at most 256 KiB");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_or_oversized_constraints_are_refused() {
        assert!(Guided::JsonObject.validate().is_ok());
        assert!(Guided::JsonSchema("{}".into()).validate().is_ok());
        assert!(Guided::Regex(" ".into()).validate().is_err());
        assert!(Guided::Choice(vec![]).validate().is_err());
        assert!(Guided::Choice(vec!["".into()]).validate().is_err());
        assert!(
            Guided::Grammar("a".repeat(MAX_GUIDED_BYTES + 1))
                .validate()
                .is_err()
        );
        assert_eq!(Guided::JsonSchema("{}".into()).kind(), "json");
    }
}
