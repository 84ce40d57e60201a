//! OpenAI-style chat messages and their rendering through a model's Jinja chat template.
//!
//! Templates are rendered the way Hugging Face `transformers` renders them
//! (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, Python string methods,
//! Python's `tojson`) and messages are normalised the way vLLM does before rendering (text
//! parts joined with newlines, tool-call arguments given as a JSON string parsed into an
//! object), so the prompt matches what a Python engine would build from the same request.

use std::borrow::Cow;

use minijinja::value::{Serde, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use crate::error::TokenizeError;
use crate::output::{ReasoningFormat, ToolCallFormat};

/// One chat message as the OpenAI API sends it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Json>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Earlier reasoning of an assistant turn (DeepSeek/Qwen style), passed to the template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The same under vLLM's name (clients echo back whichever they were given, or both);
    /// used when `reasoning_content` is absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
}

impl ChatMessage {
    /// A message with plain text content.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            name: None,
            tool_calls: None,
            tool_call_id: None,
            reasoning_content: None,
            reasoning: None,
        }
    }
}

/// Message content: a string or a list of typed parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One content part. Only `{"type": "text", "text": ...}` is supported; others are refused
/// at render time with a clear error rather than silently dropped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// What to render: the conversation, the tools offered, and template switches.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Json>>,
    /// End with the assistant's turn opener; `true` for a chat completion.
    #[serde(default = "default_true")]
    pub add_generation_prompt: bool,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking: false`).
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub template_kwargs: Map<String, Json>,
}

fn default_true() -> bool {
    true
}

impl ChatRequest {
    /// A request for `messages` with the generation prompt and no tools.
    pub fn new(messages: Vec<ChatMessage>) -> Self {
        Self {
            messages,
            tools: None,
            add_generation_prompt: true,
            template_kwargs: Map::new(),
        }
    }

    /// Total bytes of text, to decide whether rendering is worth moving off the reactor.
    pub(crate) fn approx_len(&self) -> usize {
        let content: usize = self
            .messages
            .iter()
            .map(|m| match &m.content {
                Some(MessageContent::Text(t)) => t.len(),
                Some(MessageContent::Parts(parts)) => parts
                    .iter()
                    .map(|p| p.text.as_deref().map_or(0, str::len))
                    .sum(),
                None => 0,
            })
            .sum();
        // Tools and tool calls are small next to long prompts; count them roughly.
        let extra = self.tools.as_ref().map_or(0, |t| t.len() * 256);
        content + extra
    }
}

const DEFAULT_NAME: &str = "default";
const TOOL_USE_NAME: &str = "tool_use";

/// The output formats a chat template implies: a template that renders assistant tool calls
/// as `<tool_call>` expects the model to write them so, and one that knows `<think>` serves a
/// reasoning model. Operators can override both per model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutputFormats {
    pub tool_call: Option<ToolCallFormat>,
    pub reasoning: Option<ReasoningFormat>,
}

impl OutputFormats {
    /// Reads the formats from the templates' text (most specific marker first).
    pub fn detect<'a>(sources: impl Iterator<Item = &'a str> + Clone) -> Self {
        let any = |needle: &str| sources.clone().any(|s| s.contains(needle));
        let tool_call = if any("<tool_call>") && any("<function=") {
            Some(ToolCallFormat::Qwen3Coder)
        } else if any("tool▁calls▁begin") {
            Some(ToolCallFormat::DeepSeekV3)
        } else if any("[TOOL_CALLS]") {
            Some(ToolCallFormat::Mistral)
        } else if any("<tool_call>") {
            Some(ToolCallFormat::Hermes)
        } else if any("<|python_tag|>") || any("Given the following functions") {
            Some(ToolCallFormat::Llama3Json)
        } else {
            None
        };
        let reasoning = if !any("<think>") {
            None
        } else if any("<｜Assistant｜>") {
            Some(ReasoningFormat::DeepSeekR1)
        } else {
            Some(ReasoningFormat::Think)
        };
        Self {
            tool_call,
            reasoning,
        }
    }
}

/// A compiled chat template (or the named set a `tokenizer_config.json` may hold), with the
/// `bos_token`/`eos_token` strings it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    has_tool_use: bool,
    formats: OutputFormats,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// The variables its templates read from their context (`enable_thinking`,
    /// `reasoning_effort`, ...), so a request's switches can be told honoured or not.
    variables: std::collections::BTreeSet<String>,
}

impl ChatTemplate {
    /// Compiles a single template.
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TokenizeError> {
        Self::named(
            vec![(DEFAULT_NAME.to_owned(), source.into())],
            bos_token,
            eos_token,
        )
    }

    /// Compiles named templates as `tokenizer_config.json` lists them. `default` is used,
    /// and `tool_use` when the request offers tools; a list without `default` uses its first.
    pub fn named(
        templates: Vec<(String, String)>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TokenizeError> {
        let mut env = hf_environment()?;
        let Some((first_name, first_source)) = templates.first().cloned() else {
            return Err(TokenizeError::TemplateSyntax {
                name: DEFAULT_NAME.to_owned(),
                source: Error::new(ErrorKind::TemplateNotFound, "the template list is empty"),
            });
        };
        let has_default = templates.iter().any(|(name, _)| name == DEFAULT_NAME);
        let has_tool_use = templates.iter().any(|(name, _)| name == TOOL_USE_NAME);
        let formats = OutputFormats::detect(templates.iter().map(|(_, source)| source.as_str()));
        let fallback = (!has_default).then(|| (DEFAULT_NAME.to_owned(), first_source));
        for (name, source) in templates.into_iter().chain(fallback) {
            // Name the template as the config does, also for the `default` copy of the first.
            let shown = if has_default || name != DEFAULT_NAME {
                name.clone()
            } else {
                first_name.clone()
            };
            env.add_template_owned(name, source).map_err(|source| {
                TokenizeError::TemplateSyntax {
                    name: shown,
                    source,
                }
            })?;
        }
        let variables = env
            .templates()
            .flat_map(|(_, template)| template.undeclared_variables(false))
            .collect();
        Ok(Self {
            env,
            has_tool_use,
            formats,
            bos_token,
            eos_token,
            variables,
        })
    }

    /// Whether the template reads `variable` from its context (a `chat_template_kwargs`
    /// switch such as `enable_thinking` changes its prompt only then).
    pub fn reads(&self, variable: &str) -> bool {
        self.variables.contains(variable)
    }

    /// The tool-call and reasoning formats this template writes, as far as its text tells.
    pub fn output_formats(&self) -> OutputFormats {
        self.formats
    }

    /// Renders the prompt text for `request`, within the fuel budget of its size
    /// ([`render_fuel`]).
    pub fn render(&self, request: &ChatRequest) -> Result<String, TokenizeError> {
        self.render_with_fuel(request, render_fuel(request))
    }

    fn render_with_fuel(&self, request: &ChatRequest, fuel: u64) -> Result<String, TokenizeError> {
        let messages = request
            .messages
            .iter()
            .enumerate()
            .map(|(index, message)| TemplateMessage::new(index, message))
            .collect::<Result<Vec<_>, _>>()?;
        let tools = request.tools.as_deref().filter(|tools| !tools.is_empty());
        let name = if tools.is_some() && self.has_tool_use {
            TOOL_USE_NAME
        } else {
            DEFAULT_NAME
        };
        let context = TemplateContext {
            kwargs: &request.template_kwargs,
            messages: &messages,
            tools,
            add_generation_prompt: request.add_generation_prompt,
            bos_token: self.bos_token.as_deref(),
            eos_token: self.eos_token.as_deref(),
        };
        let render = |source: Error| match source.kind() {
            ErrorKind::OutOfFuel => TokenizeError::TemplateBudget {
                fuel,
                messages: request.messages.len(),
                bytes: request.approx_len(),
            },
            _ => TokenizeError::TemplateRender { source },
        };
        // Fuel is the environment's; a copy per render carries this render's budget (the
        // compiled templates, filters and functions inside are shared, not copied).
        let mut env = self.env.clone();
        env.set_fuel(Some(fuel));
        let template = env.get_template(name).map_err(render)?;
        template
            .render(Value::from(Serde(&context)))
            .map_err(render)
    }
}

/// Fuel every render may use, whatever the conversation's size.
const BASE_FUEL: u64 = 2_000_000;
/// Further fuel per message of the conversation.
const FUEL_PER_MESSAGE: u64 = 1_000;
/// Further fuel per byte of the conversation's text.
const FUEL_PER_BYTE: u64 = 16;

/// The work budget of one render of `request`, in minijinja fuel units (about one instruction,
/// or 64 bytes allocated, each). A template comes from the model directory, which an operator
/// may take from anywhere, and a Jinja template can loop for as long as it likes (`range` nested
/// in `range`) or build strings far larger than its input; the budget bounds both. Real
/// templates fit with room to spare at every size: Qwen3's uses about 65 units per message plus
/// one per 18 bytes of text, the built-in ChatML one less (measured by the `budget_tests`), so
/// the budget is 15 times what they need per message and hundreds of times per byte.
pub fn render_fuel(request: &ChatRequest) -> u64 {
    let messages = request.messages.len() as u64;
    let bytes = request.approx_len() as u64;
    BASE_FUEL
        .saturating_add(messages.saturating_mul(FUEL_PER_MESSAGE))
        .saturating_add(bytes.saturating_mul(FUEL_PER_BYTE))
}

/// A minijinja environment configured as `transformers` configures Jinja for chat templates.
fn hf_environment() -> Result<Environment<'static>, TokenizeError> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|source| TokenizeError::TemplateSyntax {
            name: "syntax".into(),
            source,
        })?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", crate::pyjson::tojson_filter);
    env.add_function("raise_exception", raise_exception);
    Ok(env)
}

/// `raise_exception(msg)`: templates call it to refuse a conversation (e.g. roles that do not
/// alternate). It becomes a render error whose message is the template's.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// The variables a template is rendered with: the request's `chat_template_kwargs`, then
/// `messages`, `tools`, `add_generation_prompt`, `bos_token` and `eos_token` (a kwarg of one
/// of those names keeps its place and takes our value). Serialized straight into the
/// template's values from the request's own text: the messages' text is copied once, into
/// the template's strings, not first into JSON values.
struct TemplateContext<'a> {
    kwargs: &'a Map<String, Json>,
    messages: &'a [TemplateMessage<'a>],
    tools: Option<&'a [Json]>,
    add_generation_prompt: bool,
    bos_token: Option<&'a str>,
    eos_token: Option<&'a str>,
}

const CONTEXT_KEYS: [&str; 5] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

impl TemplateContext<'_> {
    fn entry<S: serde::ser::SerializeMap>(&self, key: &str, map: &mut S) -> Result<(), S::Error> {
        match key {
            "messages" => map.serialize_entry(key, self.messages),
            "tools" => map.serialize_entry(key, &self.tools),
            "add_generation_prompt" => map.serialize_entry(key, &self.add_generation_prompt),
            "bos_token" => map.serialize_entry(key, &self.bos_token),
            _ => map.serialize_entry(key, &self.eos_token),
        }
    }
}

impl Serialize for TemplateContext<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let ours_taken = CONTEXT_KEYS
            .iter()
            .filter(|key| self.kwargs.contains_key(**key))
            .count();
        let mut map =
            serializer.serialize_map(Some(self.kwargs.len() + CONTEXT_KEYS.len() - ours_taken))?;
        for (key, value) in self.kwargs {
            if CONTEXT_KEYS.contains(&key.as_str()) {
                self.entry(key, &mut map)?;
            } else {
                map.serialize_entry(key, value)?;
            }
        }
        for key in CONTEXT_KEYS {
            if !self.kwargs.contains_key(key) {
                self.entry(key, &mut map)?;
            }
        }
        map.end()
    }
}

/// The message as the template sees it: content flattened to a string, absent fields left
/// out (so `is defined` works as in Python), tool-call arguments parsed from JSON text. Its
/// keys in this order: `role`, `content`, `name`, `tool_calls`, `tool_call_id`,
/// `reasoning_content`.
struct TemplateMessage<'a> {
    role: &'a str,
    content: Cow<'a, str>,
    name: Option<&'a str>,
    tool_calls: Option<Vec<Json>>,
    tool_call_id: Option<&'a str>,
    reasoning_content: Option<&'a str>,
}

impl<'a> TemplateMessage<'a> {
    fn new(index: usize, message: &'a ChatMessage) -> Result<Self, TokenizeError> {
        let content = match &message.content {
            None => Cow::Borrowed(""),
            Some(MessageContent::Text(text)) => Cow::Borrowed(text.as_str()),
            Some(MessageContent::Parts(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for part in parts {
                    if part.kind != "text" {
                        return Err(TokenizeError::UnsupportedContentPart {
                            index,
                            kind: part.kind.clone(),
                        });
                    }
                    let text = part
                        .text
                        .as_deref()
                        .ok_or(TokenizeError::MissingPartText { index })?;
                    texts.push(text);
                }
                Cow::Owned(texts.join("\n"))
            }
        };
        Ok(Self {
            role: &message.role,
            content,
            name: message.name.as_deref(),
            tool_calls: message
                .tool_calls
                .as_ref()
                .map(|calls| calls.iter().map(parse_arguments).collect()),
            tool_call_id: message.tool_call_id.as_deref(),
            reasoning_content: message
                .reasoning_content
                .as_deref()
                .or(message.reasoning.as_deref()),
        })
    }
}

impl Serialize for TemplateMessage<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let len = 2
            + usize::from(self.name.is_some())
            + usize::from(self.tool_calls.is_some())
            + usize::from(self.tool_call_id.is_some())
            + usize::from(self.reasoning_content.is_some());
        let mut map = serializer.serialize_map(Some(len))?;
        map.serialize_entry("role", self.role)?;
        map.serialize_entry("content", &*self.content)?;
        if let Some(name) = self.name {
            map.serialize_entry("name", name)?;
        }
        if let Some(calls) = &self.tool_calls {
            map.serialize_entry("tool_calls", calls)?;
        }
        if let Some(id) = self.tool_call_id {
            map.serialize_entry("tool_call_id", id)?;
        }
        if let Some(reasoning) = self.reasoning_content {
            map.serialize_entry("reasoning_content", reasoning)?;
        }
        map.end()
    }
}

/// OpenAI sends `function.arguments` as JSON text; templates (and vLLM before rendering)
/// treat it as an object. Text that is not a JSON object is left as it is.
fn parse_arguments(call: &Json) -> Json {
    let mut call = call.clone();
    if let Some(arguments) = call.pointer_mut("/function/arguments")
        && let Some(Ok(parsed @ Json::Object(_))) =
            arguments.as_str().map(serde_json::from_str::<Json>)
    {
        *arguments = parsed;
    }
    call
}

#[cfg(test)]
#[path = "chat_budget_tests.rs"]
mod budget_tests;
