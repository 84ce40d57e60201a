//! An Anthropic Messages request taken apart into the chat pipeline's request: the messages
//! become chat messages ([`super::blocks`]), the tools and `tool_choice` OpenAI's, the sampling
//! fields the chat fields. Each field has one outcome of the field policy
//! ([`crate::api::http::fields`]): what cannot be honoured and would change what the client relies
//! on is refused with a 400 naming it, the path included (`tools.0.type`), as Anthropic names
//! fields in its own errors; what cannot change the tokens is advisory (noted and counted).

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Map, Value as Json, json};
use switchyard_tokenize::ChatMessage;

pub use super::blocks::chat_messages;
use super::blocks::{bad, cache_control, object, only, string};
use crate::api::http::fields::{Effort, FieldNotes, Reasoning, SessionSource, session_key};
use crate::api::openai::{SamplingFields, StopSpec, StreamOptions};
use crate::error::ApiError;

/// `POST /v1/messages` (and, without `max_tokens`, `/v1/messages/count_tokens`).
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    pub max_tokens: Option<u32>,
    pub messages: Option<Vec<Json>>,
    pub system: Option<Json>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: bool,
    pub metadata: Option<Json>,
    pub thinking: Option<Json>,
    /// `{"format": {"type": "json_schema", "schema"}}`: structured output.
    pub output_config: Option<Json>,
    /// Top-level cache control (a breakpoint on the last block): see [`cache_control`].
    pub cache_control: Option<Json>,
    /// `{"edits": [...]}`: see [`context_edits`].
    pub context_management: Option<Json>,
    /// Fields outside this struct: advisory when listed in [`ADVISORY`], refused when in
    /// [`REFUSED`], else unknown (the field policy decides).
    #[serde(flatten)]
    pub unknown: BTreeMap<String, Json>,
}

/// Fields that cannot change the tokens: accepted and counted.
const ADVISORY: [&str; 3] = ["service_tier", "container_upload", "inference_geo"];
/// Fields whose absence from the answer the client would notice: work only Anthropic's servers
/// do, and log probabilities.
const REFUSED: [(&str, &str); 3] = [
    (
        "top_logprobs",
        "log probabilities are not served on /v1/messages",
    ),
    (
        "container",
        "code execution containers run on Anthropic's servers, not behind this gateway",
    ),
    (
        "mcp_servers",
        "remote MCP servers are called by Anthropic's servers, not by this gateway",
    ),
];

/// The chat request a Messages request is.
#[derive(Debug)]
pub struct ChatAsk {
    pub messages: Vec<ChatMessage>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub parallel_tool_calls: Option<bool>,
    pub sampling: SamplingFields,
    /// The stop sequences, to tell `stop_sequence` from `end_turn` in the answer.
    pub stop_sequences: Vec<String>,
    /// `thinking: {"type": "enabled"}`: the model must have a reasoning parser.
    pub thinking: Thinking,
    /// `thinking.display: "omitted"`: thinking blocks come back without their text.
    pub omit_thinking: bool,
    /// The advisory fields, the template switches and the session the request carried.
    pub notes: FieldNotes,
}

/// What the request said about extended thinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Thinking {
    /// Not asked: the model's reasoning, if its parser finds any, still comes back.
    Unset,
    /// Asked for: refused for a model without a reasoning parser.
    Enabled,
    /// The model decides: its reasoning comes back when its parser finds any.
    Adaptive,
    /// Switched off: refused for a model with a reasoning parser (it cannot be turned off).
    Disabled,
}

/// Anthropic's limits on the fields it checks itself.
const MIN_THINKING_BUDGET: u64 = 1024;
/// The stop matcher holds at most this many strings.
const MAX_STOP_SEQUENCES: usize = 4;

/// Anthropic tools (`name`, `description`, `input_schema`) as OpenAI function tools.
/// Server tools (`web_search_20250305`, `code_execution_…`, ...) run on Anthropic's servers:
/// the model behind this gateway cannot call them, so each is left out of the prompt and noted
/// as advisory (the model answers without it). Client tools' extra keys (`defer_loading`,
/// `strict`, `input_examples`, `eager_input_streaming`, ...) cannot change the tokens either:
/// every tool is shown to the model.
pub fn chat_tools(
    tools: Option<&[Json]>,
    notes: &mut FieldNotes,
) -> Result<Option<Vec<Json>>, ApiError> {
    const TOOL_ADVISORY: [&str; 5] = [
        "defer_loading",
        "strict",
        "input_examples",
        "eager_input_streaming",
        "allowed_callers",
    ];
    let Some(tools) = tools else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let path = format!("tools.{i}");
        let tool = object(tool, &path)?;
        match tool.get("type").and_then(Json::as_str) {
            None | Some("custom") => {}
            Some(kind) => {
                notes.advisory(format!("tools.{kind}"));
                continue;
            }
        }
        for key in tool.keys().filter(|k| TOOL_ADVISORY.contains(&k.as_str())) {
            notes.advisory(format!("tools.{key}"));
        }
        let keys: Vec<&str> = [
            "type",
            "name",
            "description",
            "input_schema",
            "cache_control",
        ]
        .into_iter()
        .chain(TOOL_ADVISORY)
        .collect();
        out.push(client_tool(tool, &path, &keys)?);
    }
    Ok(Some(out))
}

/// One client tool as an OpenAI function tool.
fn client_tool(tool: &Map<String, Json>, path: &str, keys: &[&str]) -> Result<Json, ApiError> {
    only(tool, path, keys)?;
    cache_control(tool, path)?;
    let name = string(tool, path, "name")?;
    let schema = tool
        .get("input_schema")
        .filter(|s| s.is_object())
        .ok_or_else(|| {
            bad(
                format!("{path}.input_schema"),
                "Field required (a JSON schema object)",
            )
        })?;
    let mut function = json!({"name": name, "parameters": schema});
    if let Some(description) = tool.get("description").filter(|d| !d.is_null()) {
        function["description"] = description.clone();
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `tool_choice` as OpenAI's, and `disable_parallel_tool_use` as `parallel_tool_calls: false`.
pub fn chat_tool_choice(choice: Option<&Json>) -> Result<(Option<Json>, Option<bool>), ApiError> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else {
        return Ok((None, None));
    };
    let path = "tool_choice";
    let choice = object(choice, path)?;
    only(choice, path, &["type", "name", "disable_parallel_tool_use"])?;
    let parallel = match choice.get("disable_parallel_tool_use") {
        None | Some(Json::Null) => None,
        Some(Json::Bool(disable)) => Some(!disable),
        Some(_) => {
            return Err(bad(
                "tool_choice.disable_parallel_tool_use",
                "expected a boolean",
            ));
        }
    };
    let kind = choice.get("type").and_then(Json::as_str);
    if kind != Some("tool") && choice.contains_key("name") {
        return Err(bad("tool_choice.name", "only a `tool` choice names a tool"));
    }
    let openai = match kind {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            json!({"type": "function", "function": {"name": string(choice, path, "name")?}})
        }
        _ => {
            return Err(bad(
                "tool_choice.type",
                "must be \"auto\", \"any\", \"tool\" or \"none\"",
            ));
        }
    };
    Ok((Some(openai), parallel))
}

/// `thinking`: `{"type": "enabled", "budget_tokens"}`, `{"type": "adaptive"}` or
/// `{"type": "disabled"}`, each with an optional `display` (`summarized`, the thinking
/// returned as written; `omitted`, its blocks without text). Returns the ask and whether the
/// text is omitted.
pub fn thinking_of(thinking: Option<&Json>, max_tokens: u32) -> Result<(Thinking, bool), ApiError> {
    let Some(thinking) = thinking.filter(|t| !t.is_null()) else {
        return Ok((Thinking::Unset, false));
    };
    let t = object(thinking, "thinking")?;
    let omit = match t.get("display") {
        None | Some(Json::Null) => false,
        Some(display) if display == "summarized" => false,
        Some(display) if display == "omitted" => true,
        Some(_) => {
            return Err(bad(
                "thinking.display",
                "must be \"summarized\" or \"omitted\"",
            ));
        }
    };
    let ask = match t.get("type").and_then(Json::as_str) {
        Some("disabled") => {
            only(t, "thinking", &["type", "display"])?;
            Thinking::Disabled
        }
        Some("adaptive") => {
            only(t, "thinking", &["type", "display"])?;
            Thinking::Adaptive
        }
        Some("enabled") => {
            only(t, "thinking", &["type", "budget_tokens", "display"])?;
            let budget = t
                .get("budget_tokens")
                .and_then(Json::as_u64)
                .ok_or_else(|| bad("thinking.budget_tokens", "Field required (an integer)"))?;
            if budget < MIN_THINKING_BUDGET {
                return Err(bad(
                    "thinking.budget_tokens",
                    format!("must be at least {MIN_THINKING_BUDGET}"),
                ));
            }
            if budget >= u64::from(max_tokens) {
                return Err(bad(
                    "thinking.budget_tokens",
                    "must be less than max_tokens",
                ));
            }
            Thinking::Enabled
        }
        _ => {
            return Err(bad(
                "thinking.type",
                "must be \"enabled\", \"adaptive\" or \"disabled\"",
            ));
        }
    };
    Ok((ask, omit))
}

/// `metadata.user_id`: the request's user, as OpenAI's `user` is (the fairness flow). Claude
/// Code writes a JSON object there (`device_id`, `account_uuid`, `session_id`): its account
/// (else its device) is the user, and its `session_id` names the session.
fn user_of(metadata: Option<&Json>, notes: &mut FieldNotes) -> Result<Option<String>, ApiError> {
    let Some(metadata) = metadata.filter(|m| !m.is_null()) else {
        return Ok(None);
    };
    let m = object(metadata, "metadata")?;
    for key in m.keys().filter(|k| *k != "user_id") {
        notes.unknown(format!("metadata.{key}"));
    }
    let user = match m.get("user_id") {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::String(user)) => user,
        Some(_) => return Err(bad("metadata.user_id", "expected a string")),
    };
    let Ok(Json::Object(parts)) = serde_json::from_str::<Json>(user) else {
        return Ok(Some(user.clone()));
    };
    let field = |key: &str| {
        parts
            .get(key)
            .and_then(Json::as_str)
            .filter(|v| !v.is_empty())
    };
    if let Some(session) = field("session_id").and_then(session_key) {
        notes.session = Some((SessionSource::MetadataSession, session));
    }
    Ok(field("account_uuid")
        .or_else(|| field("device_id"))
        .map(str::to_owned)
        .or_else(|| Some(user.clone())))
}

/// `output_config.effort` (`low` to `max`): how much the model reasons, mapped onto the
/// model's template switch like `reasoning_effort` (see [`crate::api::http::fields::Reasoning`]).
fn effort_of(output_config: Option<&Json>) -> Result<Option<Reasoning>, ApiError> {
    let Some(effort) = output_config
        .and_then(|c| c.get("effort"))
        .filter(|e| !e.is_null())
    else {
        return Ok(None);
    };
    effort
        .as_str()
        .and_then(Reasoning::of_effort)
        .filter(|r| *r != Reasoning::Off)
        .map(Some)
        .ok_or_else(|| {
            bad(
                "output_config.effort",
                "must be \"low\", \"medium\", \"high\", \"xhigh\" or \"max\"",
            )
        })
}

/// `thinking` and `output_config.effort` as a reasoning ask: the effort refines an ask for
/// thinking (or makes one, thinking unsaid); it does not turn thinking back on once disabled.
pub fn ask_reasoning(
    thinking: Thinking,
    output_config: Option<&Json>,
    notes: &mut FieldNotes,
) -> Result<(), ApiError> {
    match thinking {
        Thinking::Enabled => notes.ask_reasoning(Reasoning::On(Effort::High), "thinking"),
        Thinking::Disabled => notes.ask_reasoning(Reasoning::Off, "thinking"),
        Thinking::Unset | Thinking::Adaptive => {}
    }
    if let Some(effort) = effort_of(output_config)?
        && thinking != Thinking::Disabled
    {
        notes.ask_reasoning(effort, "output_config.effort");
    }
    Ok(())
}

/// `context_management.edits`: `clear_thinking_20251015` is honoured (the thinking of all but
/// the `keep` most recent assistant turns is left out of the prompt; `keep: "all"` keeps all
/// of it); other edits rewrite the conversation by rules this gateway does not run, and are
/// refused by name. Returns how many recent turns keep their thinking (`None`: all).
pub fn context_edits(context_management: Option<&Json>) -> Result<Option<usize>, ApiError> {
    let Some(cm) = context_management.filter(|c| !c.is_null()) else {
        return Ok(None);
    };
    let cm = object(cm, "context_management")?;
    only(cm, "context_management", &["edits"])?;
    let mut keep: Option<usize> = None;
    let edits = match cm.get("edits") {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::Array(edits)) => edits,
        Some(_) => return Err(bad("context_management.edits", "expected a list")),
    };
    for (i, edit) in edits.iter().enumerate() {
        let path = format!("context_management.edits.{i}");
        let edit = object(edit, &path)?;
        match edit.get("type").and_then(Json::as_str) {
            Some("clear_thinking_20251015") => {
                only(edit, &path, &["type", "keep"])?;
                match edit.get("keep") {
                    None | Some(Json::Null) => keep = Some(1),
                    Some(Json::String(all)) if all == "all" => {}
                    Some(Json::Object(k))
                        if k.get("type").and_then(Json::as_str) == Some("thinking_turns") =>
                    {
                        let turns = k.get("value").and_then(Json::as_u64).ok_or_else(|| {
                            bad(format!("{path}.keep.value"), "expected an integer")
                        })?;
                        keep = Some(usize::try_from(turns).unwrap_or(usize::MAX));
                    }
                    Some(_) => {
                        return Err(bad(
                            format!("{path}.keep"),
                            "must be \"all\" or {\"type\": \"thinking_turns\", \"value\": N}",
                        ));
                    }
                }
            }
            Some(other) => {
                return Err(bad(
                    format!("{path}.type"),
                    format!(
                        "context edit `{other}` is not run by this gateway (clear_thinking_20251015 is)"
                    ),
                ));
            }
            None => return Err(bad(format!("{path}.type"), "Field required")),
        }
    }
    Ok(keep)
}

/// Leaves the thinking out of all but the `keep` most recent assistant turns.
pub fn clear_thinking(messages: &mut [ChatMessage], keep: usize) {
    let older = messages
        .iter_mut()
        .rev()
        .filter(|m| m.role == "assistant")
        .skip(keep);
    for m in older {
        m.reasoning_content = None;
        m.reasoning = None;
    }
}

/// `anthropic-beta`: each beta the client names. Betas switch on request fields (each of which
/// has its own outcome) or only name the client; none changes the tokens by itself, so each is
/// advisory, and one this gateway has never heard of is unknown (the policy decides).
pub fn note_betas(header: Option<&str>, notes: &mut FieldNotes) {
    const KNOWN: [&str; 16] = [
        "claude-code-20250219",
        "interleaved-thinking-2025-05-14",
        "context-management-2025-06-27",
        "fine-grained-tool-streaming-2025-05-14",
        "effort-2025-11-24",
        "advanced-tool-use-2025-11-20",
        "mid-conversation-tool-changes-2026-07-01",
        "thinking-token-count-2026-05-13",
        "token-efficient-tools-2025-02-19",
        "prompt-caching-2024-07-31",
        "output-128k-2025-02-19",
        "extended-cache-ttl-2025-04-11",
        "context-1m-2025-08-07",
        "structured-outputs-2025-11-13",
        "oauth-2025-04-20",
        "search-results-2025-06-09",
    ];
    for beta in header
        .into_iter()
        .flat_map(|h| h.split(','))
        .map(str::trim)
        .filter(|b| !b.is_empty())
    {
        if KNOWN.contains(&beta) {
            notes.advisory(format!("anthropic-beta:{beta}"));
        } else {
            notes.unknown(format!("anthropic-beta:{beta}"));
        }
    }
}

/// `output_config.format` (a JSON schema) as OpenAI's `response_format`: the engine is
/// constrained to write an instance of it.
pub fn response_format(output_config: Option<&Json>) -> Result<Option<Json>, ApiError> {
    let Some(config) = output_config.filter(|c| !c.is_null()) else {
        return Ok(None);
    };
    let config = object(config, "output_config")?;
    only(config, "output_config", &["format", "effort"])?;
    let Some(format) = config.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let format = object(format, "output_config.format")?;
    only(format, "output_config.format", &["type", "schema"])?;
    if format.get("type").and_then(Json::as_str) != Some("json_schema") {
        return Err(bad("output_config.format.type", "must be \"json_schema\""));
    }
    let schema = format
        .get("schema")
        .filter(|s| s.is_object())
        .ok_or_else(|| {
            bad(
                "output_config.format.schema",
                "Field required (a JSON schema object)",
            )
        })?;
    Ok(Some(json!({"type": "json_schema",
        "json_schema": {"name": "output", "schema": schema}})))
}

/// The request's own `cache_control`, checked as a block's is.
pub fn top_cache_control(control: Option<Json>) -> Result<(), ApiError> {
    let mut top = Map::new();
    if let Some(control) = control {
        top.insert("cache_control".into(), control);
    }
    cache_control(&top, "")
}

/// The top-level fields outside [`MessagesRequest`]: advisory, refused, or unknown.
pub fn note_rest(rest: &BTreeMap<String, Json>, notes: &mut FieldNotes) -> Result<(), ApiError> {
    for field in rest.iter().filter(|(_, v)| !v.is_null()).map(|(k, _)| k) {
        if let Some((_, why)) = REFUSED.iter().find(|(name, _)| name == field) {
            return Err(bad(field.clone(), why));
        }
        if ADVISORY.contains(&field.as_str()) {
            notes.advisory(field.clone());
        } else {
            notes.unknown(field.clone());
        }
    }
    Ok(())
}

/// The chat request of a `/v1/messages` body.
pub fn chat_ask(r: MessagesRequest) -> Result<ChatAsk, ApiError> {
    let mut notes = FieldNotes::default();
    note_rest(&r.unknown, &mut notes)?;
    let max_tokens = r
        .max_tokens
        .ok_or_else(|| bad("max_tokens", "Field required"))?;
    if max_tokens == 0 {
        return Err(bad("max_tokens", "must be at least 1"));
    }
    let messages = r
        .messages
        .as_deref()
        .ok_or_else(|| bad("messages", "Field required"))?;
    let mut messages = chat_messages(r.system.as_ref(), messages)?;
    if let Some(keep) = context_edits(r.context_management.as_ref())? {
        clear_thinking(&mut messages, keep);
    }
    if let Some(t) = r.temperature
        && !(0.0..=1.0).contains(&t)
    {
        return Err(bad("temperature", "must be between 0 and 1"));
    }
    let stop_sequences = r.stop_sequences.unwrap_or_default();
    if stop_sequences.len() > MAX_STOP_SEQUENCES {
        return Err(bad(
            "stop_sequences",
            format!("at most {MAX_STOP_SEQUENCES} stop sequences are taken"),
        ));
    }
    if stop_sequences.iter().any(String::is_empty) {
        return Err(bad("stop_sequences", "a stop sequence must not be empty"));
    }
    let tools = chat_tools(r.tools.as_deref(), &mut notes)?;
    let (tool_choice, parallel_tool_calls) = chat_tool_choice(r.tool_choice.as_ref())?;
    let (thinking, omit_thinking) = thinking_of(r.thinking.as_ref(), max_tokens)?;
    ask_reasoning(thinking, r.output_config.as_ref(), &mut notes)?;
    top_cache_control(r.cache_control)?;
    let sampling = SamplingFields {
        response_format: response_format(r.output_config.as_ref())?,
        max_tokens: Some(max_tokens),
        temperature: r.temperature,
        top_p: r.top_p,
        top_k: r.top_k,
        stop: (!stop_sequences.is_empty()).then(|| StopSpec::Many(stop_sequences.clone())),
        // Kept in the text so the answer can say which sequence ended it (and then drops it).
        include_stop_str_in_output: (!stop_sequences.is_empty()).then_some(true),
        stream: r.stream,
        stream_options: r.stream.then_some(StreamOptions {
            include_usage: true,
        }),
        user: user_of(r.metadata.as_ref(), &mut notes)?,
        ..SamplingFields::default()
    };
    Ok(ChatAsk {
        messages,
        tools,
        tool_choice,
        parallel_tool_calls,
        sampling,
        stop_sequences,
        thinking,
        omit_thinking,
        notes,
    })
}

/// `POST /v1/messages/count_tokens`: the fields that shape the prompt (the others of a
/// Messages request are refused by name, as Anthropic's endpoint takes only these).
#[derive(Debug, Clone, Deserialize)]
pub struct CountTokensRequest {
    pub model: String,
    pub messages: Option<Vec<Json>>,
    pub system: Option<Json>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub thinking: Option<Json>,
    /// Checked as a Messages request's; a constraint does not change the prompt.
    pub output_config: Option<Json>,
    pub cache_control: Option<Json>,
    pub context_management: Option<Json>,
    #[serde(flatten)]
    pub unknown: BTreeMap<String, Json>,
}

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
