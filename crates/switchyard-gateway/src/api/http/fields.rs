//! The field policy: every field and header a client sends has one of four outcomes, the same
//! on all four APIs (the tables in `docs/openai-api.md` and `docs/anthropic-api.md`):
//!
//! * **honoured** by the gateway (routing, sessions, stop strings, the template switches);
//! * **carried** to the engine (the sampling fields, under each engine's own names);
//! * **advisory**: it cannot change the tokens (`metadata`, `store: false`, `service_tier`,
//!   betas that only name the client, ...) — accepted, recorded with the request's decisions
//!   and counted in `switchyard_ignored_fields_total{api,field}`;
//! * **refused** with a 400 naming it, only where ignoring it would change what the client
//!   relies on.
//!
//! A field nobody told the gateway about is accepted and counted as advisory by default
//! (`[api] unknown_fields = "accept"`) and logged once per name; `refuse` is the strict mode,
//! a 400 naming it. Each API's parser notes what it saw in a [`FieldNotes`]; the shared
//! pipeline applies the policy, counts, and carries the notes to the decision log.

use std::collections::BTreeSet;

use axum::http::HeaderMap;
use serde::Deserialize;
use serde_json::{Map, Value as Json};

use switchyard_tokenize::ChatTemplate;

use crate::error::ApiError;

/// What the gateway does with a request field (or an `anthropic-beta` name) it does not know.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum UnknownFields {
    /// Accepted, counted as advisory, logged once per name (clients add fields every month).
    #[default]
    Accept,
    /// A 400 naming the field: for operators who want every field accounted for.
    Refuse,
}

/// `[api]`: the field policy's settings.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    pub unknown_fields: UnknownFields,
}

/// Where a request's session key came from, most explicit first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionSource {
    /// Switchyard's own `x-session-id`.
    SessionHeader,
    /// Claude Code's `X-Claude-Code-Session-Id`.
    ClaudeCodeHeader,
    /// Codex's `session-id` (its thread's id).
    CodexHeader,
    /// OpenAI's `prompt_cache_key` (Codex sets it to its session id).
    PromptCacheKey,
    /// Anthropic `metadata.user_id` written as Claude Code writes it: a JSON object holding
    /// `session_id`.
    MetadataSession,
}

impl SessionSource {
    pub fn name(self) -> &'static str {
        match self {
            SessionSource::SessionHeader => "x-session-id",
            SessionSource::ClaudeCodeHeader => "x-claude-code-session-id",
            SessionSource::CodexHeader => "session-id",
            SessionSource::PromptCacheKey => "prompt_cache_key",
            SessionSource::MetadataSession => "metadata.user_id.session_id",
        }
    }
}

/// The headers that name a session, in the order they are believed.
const SESSION_HEADERS: [(&str, SessionSource); 3] = [
    ("x-session-id", SessionSource::SessionHeader),
    ("x-claude-code-session-id", SessionSource::ClaudeCodeHeader),
    ("session-id", SessionSource::CodexHeader),
];

/// Longest session key taken from a client; a longer one is hashed down to this.
const MAX_SESSION_LEN: usize = 256;

/// The session a request's headers name, and which header named it.
pub fn session_header(headers: &HeaderMap) -> Option<(SessionSource, String)> {
    SESSION_HEADERS.iter().find_map(|(name, source)| {
        headers
            .get(*name)
            .and_then(|v| v.to_str().ok())
            .and_then(session_key)
            .map(|key| (*source, key))
    })
}

/// A client's session id as a key: trimmed, non-empty, bounded.
pub fn session_key(raw: &str) -> Option<String> {
    let raw = raw.trim();
    if raw.is_empty() {
        return None;
    }
    if raw.len() <= MAX_SESSION_LEN {
        return Some(raw.to_owned());
    }
    Some(format!(
        "h{:016x}",
        xxhash_rust::xxh3::xxh3_64(raw.as_bytes())
    ))
}

/// What a request said besides what the gateway serves it from: the advisory and unknown
/// fields it carried, the template variables its reasoning controls set, and the session its
/// body names.
#[derive(Debug, Clone, Default)]
pub struct FieldNotes {
    advisory: BTreeSet<String>,
    unknown: BTreeSet<String>,
    /// Variables for the model's chat template: `chat_template_kwargs` as given, and the
    /// reasoning controls mapped onto each family's switch ([`Reasoning::template_kwargs`]).
    pub template_kwargs: Map<String, Json>,
    /// `add_generation_prompt` (chat; default true).
    pub add_generation_prompt: Option<bool>,
    /// The session the body names (`prompt_cache_key`, Claude Code's `metadata.user_id`).
    pub session: Option<(SessionSource, String)>,
    /// The reasoning the request asked for, in any API's words, and the field that asked.
    reasoning: Option<(Reasoning, &'static str)>,
    /// The scheduling `priority` (vLLM's extension: lower is scheduled earlier, 0 the
    /// default), carried to the workers, which send it to engines that schedule by it.
    pub priority: Option<i32>,
}

impl FieldNotes {
    /// Reads a request's `priority`: an integer in the 32-bit range (vLLM's engine reads any
    /// integer, and no scheduler needs more than that), else a 400 naming the field.
    pub fn note_priority(&mut self, field: &str, value: &Json) -> Result<(), ApiError> {
        let priority = value
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| {
                ApiError::bad_param(
                    field.to_owned(),
                    format!(
                        "`{field}` must be an integer from {} to {} (lower is scheduled earlier; 0 is the default), got {value}",
                        i32::MIN,
                        i32::MAX
                    ),
                )
            })?;
        self.priority = Some(priority);
        Ok(())
    }

    /// `field` was sent and cannot change the tokens: accepted, recorded and counted.
    pub fn advisory(&mut self, field: impl Into<String>) {
        self.advisory.insert(field.into());
    }

    /// `field` is one the gateway does not know (accepted or refused by the policy).
    pub fn unknown(&mut self, field: impl Into<String>) {
        self.unknown.insert(field.into());
    }

    /// The fields taken without effect, advisory and unknown alike, sorted.
    pub fn ignored(&self) -> Vec<String> {
        self.advisory.union(&self.unknown).cloned().collect()
    }

    /// Applies the policy to the unknown fields: under `refuse`, a 400 naming the first.
    pub fn check(&self, policy: UnknownFields, docs: &str) -> Result<(), ApiError> {
        match (policy, self.unknown.iter().next()) {
            (UnknownFields::Refuse, Some(field)) => Err(ApiError::bad_param(
                field.clone(),
                format!(
                    "unsupported field `{field}` (unknown_fields = refuse; {docs} lists the fields the gateway takes)"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The unknown fields, for the log-once and the counter's label guard.
    pub fn unknown_names(&self) -> impl Iterator<Item = &str> {
        self.unknown.iter().map(String::as_str)
    }

    pub fn advisory_names(&self) -> impl Iterator<Item = &str> {
        self.advisory.iter().map(String::as_str)
    }

    /// The request asks for `reasoning` through `field` (a later ask refines an earlier one).
    pub fn ask_reasoning(&mut self, reasoning: Reasoning, field: &'static str) {
        self.reasoning = Some((reasoning, field));
    }

    pub fn reasoning(&self) -> Option<Reasoning> {
        self.reasoning.map(|(r, _)| r)
    }

    /// Maps the reasoning ask onto the switches the model's template reads (what the client
    /// put in `chat_template_kwargs` wins); an ask no switch of the template takes is advisory
    /// (the model reasons as its template has it). Returns the template variables to render
    /// with.
    pub fn settle_template(&mut self, template: Option<&ChatTemplate>) -> Map<String, Json> {
        let reads = |name: &str| template.is_some_and(|t| t.reads(name));
        if let Some((reasoning, field)) = self.reasoning {
            let mut honoured = false;
            for (name, value) in reasoning.template_kwargs() {
                if reads(name) {
                    honoured = true;
                    self.template_kwargs.entry(name).or_insert(value);
                }
            }
            if !honoured {
                self.advisory(field);
            }
        }
        self.template_kwargs.clone()
    }
}

/// How much a request asks the model to reason, from any API's control: OpenAI's
/// `reasoning_effort` and Responses `reasoning.effort`, Anthropic's `thinking` and
/// `output_config.effort`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reasoning {
    /// Thinking off (`reasoning_effort: "none"`, `thinking: {"type": "disabled"}`).
    Off,
    /// Thinking on, at this effort.
    On(Effort),
}

/// A reasoning effort, as gpt-oss's template names its levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effort {
    Low,
    Medium,
    High,
}

impl Effort {
    fn name(self) -> &'static str {
        match self {
            Effort::Low => "low",
            Effort::Medium => "medium",
            Effort::High => "high",
        }
    }
}

impl Reasoning {
    /// OpenAI's and Anthropic's effort words: `none` switches thinking off; `minimal` and
    /// `low` are low; `xhigh`, `max` and the like are high.
    pub fn of_effort(effort: &str) -> Option<Reasoning> {
        Some(match effort {
            "none" => Reasoning::Off,
            "minimal" | "low" => Reasoning::On(Effort::Low),
            "medium" => Reasoning::On(Effort::Medium),
            "high" | "xhigh" | "max" | "ultra" => Reasoning::On(Effort::High),
            _ => return None,
        })
    }

    /// The template variables each model family switches reasoning with (a template reads
    /// the ones of its family and no other): Qwen3 and GLM `enable_thinking`, DeepSeek V3.1
    /// `thinking`, gpt-oss `reasoning_effort` (its levels; thinking cannot be off there, so
    /// `Off` asks for the least).
    pub fn template_kwargs(self) -> [(&'static str, Json); 3] {
        let on = matches!(self, Reasoning::On(_));
        let effort = match self {
            Reasoning::On(effort) => effort,
            Reasoning::Off => Effort::Low,
        };
        [
            ("enable_thinking", Json::Bool(on)),
            ("thinking", Json::Bool(on)),
            ("reasoning_effort", Json::String(effort.name().to_owned())),
        ]
    }
}

/// A `chat_template_kwargs` value: an object of template variables. The names the gateway
/// renders itself (`messages`, `tools`, ...) are not the client's to set.
pub fn template_kwargs(value: &Json, field: &str) -> Result<Map<String, Json>, ApiError> {
    const RESERVED: [&str; 5] = [
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
    ];
    match value {
        Json::Null => Ok(Map::new()),
        Json::Object(map) => match map.keys().find(|k| RESERVED.contains(&k.as_str())) {
            Some(key) => Err(ApiError::bad_param(
                format!("{field}.{key}"),
                format!("`{key}` is set by the gateway's rendering, not by {field}"),
            )),
            None => Ok(map.clone()),
        },
        _ => Err(ApiError::bad_param(
            field,
            format!("`{field}` is an object of template variables"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_pass_by_default_and_are_refused_by_name_in_strict_mode() {
        let mut notes = FieldNotes::default();
        notes.advisory("metadata");
        notes.unknown("client_metadata");
        assert!(notes.check(UnknownFields::Accept, "docs").is_ok());
        let Err(ApiError::BadRequest { param, message }) = notes.check(UnknownFields::Refuse, "d")
        else {
            panic!("strict mode refuses");
        };
        assert_eq!(param.as_deref(), Some("client_metadata"));
        assert!(message.contains("`client_metadata`"), "{message}");
        assert_eq!(notes.ignored(), ["client_metadata", "metadata"]);
    }

    #[test]
    fn the_reasoning_ask_sets_only_the_switches_a_template_reads_and_never_the_clients_own() {
        let template = |source: &str| ChatTemplate::new(source, None, None).unwrap();
        let qwen = template("{% if enable_thinking is false %}off{% endif %}{{ thinking }}");
        let mut notes = FieldNotes::default();
        notes.ask_reasoning(Reasoning::Off, "reasoning_effort");
        notes
            .template_kwargs
            .insert("thinking".into(), Json::Bool(true));
        let kwargs = notes.settle_template(Some(&qwen));
        assert_eq!(kwargs["enable_thinking"], Json::Bool(false));
        // The client's own kwarg wins over the mapped one.
        assert_eq!(kwargs["thinking"], Json::Bool(true));
        assert!(!kwargs.contains_key("reasoning_effort"));
        assert!(notes.ignored().is_empty());
        let gpt_oss = template("{{ reasoning_effort }}");
        let mut notes = FieldNotes::default();
        notes.ask_reasoning(Reasoning::of_effort("xhigh").unwrap(), "reasoning.effort");
        assert_eq!(
            notes.settle_template(Some(&gpt_oss))["reasoning_effort"],
            "high"
        );
        // A template without a switch: the ask is advisory, nothing is set.
        let plain = template("{{ messages }}");
        let mut notes = FieldNotes::default();
        notes.ask_reasoning(Reasoning::of_effort("low").unwrap(), "reasoning_effort");
        assert!(notes.settle_template(Some(&plain)).is_empty());
        assert_eq!(notes.ignored(), ["reasoning_effort"]);
        assert_eq!(Reasoning::of_effort("extreme"), None);
    }

    #[test]
    fn template_kwargs_are_an_object_and_leave_the_rendered_names_alone() {
        let ok = template_kwargs(&serde_json::json!({"enable_thinking": false}), "k").unwrap();
        assert_eq!(ok["enable_thinking"], Json::Bool(false));
        assert!(template_kwargs(&serde_json::json!([1]), "k").is_err());
        let Err(ApiError::BadRequest { param, .. }) =
            template_kwargs(&serde_json::json!({"messages": []}), "chat_template_kwargs")
        else {
            panic!("messages is the gateway's");
        };
        assert_eq!(param.as_deref(), Some("chat_template_kwargs.messages"));
    }

    #[test]
    fn sessions_come_from_the_first_header_that_names_one() {
        let mut headers = HeaderMap::new();
        headers.insert("session-id", "codex-thread".parse().unwrap());
        assert_eq!(
            session_header(&headers),
            Some((SessionSource::CodexHeader, "codex-thread".to_owned()))
        );
        headers.insert("x-claude-code-session-id", "cc".parse().unwrap());
        assert_eq!(
            session_header(&headers).unwrap().0,
            SessionSource::ClaudeCodeHeader
        );
        headers.insert("x-session-id", " ".parse().unwrap());
        assert_eq!(session_header(&headers).unwrap().1, "cc");
        let long = "x".repeat(1000);
        assert!(session_key(&long).unwrap().len() < 20);
    }
}
