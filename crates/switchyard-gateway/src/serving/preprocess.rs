//! Preprocessing glue: which tokenizer serves which model, and running it off the reactor.
//!
//! Rendering a chat template and tokenizing a long prompt are CPU work; they run on tokio's
//! blocking pool so a 100k-token prompt cannot stall every other request on the reactor. Inputs
//! up to 16 KiB are encoded inline: the hop would cost more than the work.
//!
//! Agent sessions resend their whole growing history every turn, so requests are tokenized
//! through each model's [`SessionTokenizer`]: by session id (`x-session-id`) or, without one, by
//! finding the session whose previous text the new one extends, only the new suffix (from a safe
//! point before the seam) is tokenized. A turn with no earlier turn of its own (a session's
//! first, a sub-agent's) takes its opening from the tokenizer's cross-request prefix cache
//! instead. The result always equals a full tokenization; a sample of turns is checked against
//! one.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use switchyard_core::TokenId;
use switchyard_tokenize::{
    ChatMessage, ChatRequest, Fault, MessageContent, ModelDir, PrefixStats, SessionConfig,
    SessionStats, SessionTokenizer, TokenizeError,
};

use crate::error::ApiError;
use crate::observe::metrics::Metrics;
use crate::serving::routing::{BlockNaming, PromptHashes};

/// A model's tokenizer, chat template and session cache.
#[derive(Debug)]
pub struct ModelTokenizer {
    pub dir: Arc<ModelDir>,
    pub sessions: SessionTokenizer,
}

impl ModelTokenizer {
    fn new(dir: ModelDir, sessions: &SessionConfig) -> Self {
        let dir = Arc::new(dir);
        let sessions = SessionTokenizer::new(Arc::clone(dir.tokenizer()), sessions.clone());
        Self { dir, sessions }
    }
}

/// Tokenizers by model name, with a default for models not named.
#[derive(Debug, Clone)]
pub struct Tokenizers {
    default: Arc<ModelTokenizer>,
    per_model: BTreeMap<String, Arc<ModelTokenizer>>,
}

/// Whether a tokenization goes through the session cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sessions {
    /// A turn of a session: the id the client gave, or `None` to find it by prefix.
    Track(Option<String>),
    /// A one-off (the admin API's explain): leaves the session cache alone.
    Bypass,
}

fn load_spec(spec: &str) -> Result<ModelDir, String> {
    match ModelDir::from_builtin_spec(spec) {
        Some(dir) => Ok(dir),
        None => ModelDir::load(Path::new(spec)).map_err(|e| e.to_string()),
    }
}

impl Tokenizers {
    /// Loads the default and the per-model tokenizers; an error names the one that failed.
    pub fn load(
        default: &str,
        per_model: &BTreeMap<String, String>,
        sessions: &SessionConfig,
    ) -> Result<Self, String> {
        let default = Arc::new(ModelTokenizer::new(
            load_spec(default).map_err(|e| format!("tokenizer {default}: {e}"))?,
            sessions,
        ));
        let mut models = BTreeMap::new();
        for (model, spec) in per_model {
            let dir = load_spec(spec)
                .map_err(|e| format!("tokenizer for model {model} ({spec}): {e}"))?;
            models.insert(model.clone(), Arc::new(ModelTokenizer::new(dir, sessions)));
        }
        Ok(Self {
            default,
            per_model: models,
        })
    }

    pub fn for_model(&self, model: &str) -> Arc<ModelTokenizer> {
        self.per_model
            .get(model)
            .cloned()
            .unwrap_or_else(|| Arc::clone(&self.default))
    }

    /// Models configured explicitly.
    pub fn configured_models(&self) -> impl Iterator<Item = &String> {
        self.per_model.keys()
    }

    fn all(&self) -> impl Iterator<Item = &Arc<ModelTokenizer>> {
        std::iter::once(&self.default).chain(self.per_model.values())
    }

    /// Prefix-cache counters summed over every tokenizer.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.all().map(|t| t.sessions.prefix_stats()).sum()
    }

    /// Session-cache counters summed over every tokenizer.
    pub fn session_stats(&self) -> SessionStats {
        self.all().map(|t| t.sessions.stats()).sum()
    }
}

/// The most prompt tokens a model with a context of `context` tokens takes: the prompt must
/// leave room for at least one generated token.
pub fn prompt_limit(context: u64) -> usize {
    usize::try_from(context.saturating_sub(1)).unwrap_or(usize::MAX)
}

/// A request the template or tokenizer refuses is the client's fault (400); broken model files
/// or a failed tokenizer task are ours (500).
fn tokenize_error(err: TokenizeError) -> ApiError {
    if let TokenizeError::TooManyTokens { at_least, max } = err {
        // Found before tokenizing the whole prompt, so only a lower bound is known.
        return ApiError::bad_request(format!(
            "This model's maximum context length is {} tokens. However, your prompt has at least {at_least} tokens.",
            max.saturating_add(1)
        ));
    }
    match err.fault() {
        Fault::Request => ApiError::bad_request(err.to_string()),
        Fault::ModelFiles | Fault::Internal => ApiError::Internal(err.to_string()),
    }
}

/// Inputs up to this many bytes are rendered and tokenized on the reactor. A trip to the
/// blocking pool (a thread woken, two context switches, the reactor's worker parked and woken
/// again) cost ≈ 60 µs of CPU per request on a 2-core VM, more than the work it moved for a
/// ~3k-token prompt whose opening the session cache holds (≈ 40–75 µs inline; CPU per request
/// 0.32 → 0.25 ms, `docs/BENCHMARKS.md`, "Server CPU per request"). 16 KiB bounds what a reactor
/// thread is kept from its other tasks: ≈ 0.4 ms for text no cache has seen (≈ 40 MB/s), while
/// the other worker threads steal its queued tasks. Longer prompts, and every request offering
/// tools (agent prompts run to hundreds of kilobytes), go to the pool.
const INLINE_MAX_BYTES: usize = 16 * 1024;

async fn off_reactor<T: Send + 'static>(
    metrics: &Metrics,
    size: usize,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let started = Instant::now();
    let result = if size <= INLINE_MAX_BYTES {
        work()
    } else {
        // The work stays in the caller's span (a request's `preprocess`), on whichever thread.
        let span = tracing::Span::current();
        tokio::task::spawn_blocking(move || span.in_scope(work))
            .await
            .map_err(|e| ApiError::Internal(format!("tokenizer task failed: {e}")))?
    };
    metrics.tokenize.observe(started.elapsed().as_secs_f64());
    result
}

/// Text bytes of the messages; a request with tools always goes to the blocking pool.
fn chat_size(messages: &[ChatMessage], tools: &Option<Vec<serde_json::Value>>) -> usize {
    if tools.is_some() {
        return usize::MAX;
    }
    messages
        .iter()
        .map(|m| match &m.content {
            Some(MessageContent::Text(t)) => t.len(),
            Some(MessageContent::Parts(parts)) => parts
                .iter()
                .map(|p| p.text.as_deref().map_or(0, str::len))
                .sum(),
            None => 0,
        } + m.role.len())
        .sum()
}

/// Turns OpenAI message objects into chat messages, naming the first bad one.
pub fn parse_messages(messages: Vec<serde_json::Value>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages must not be empty",
        ));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let mut message = serde_json::from_value::<ChatMessage>(m).map_err(|e| {
                ApiError::bad_param("messages", format!("messages[{i}] is invalid: {e}"))
            })?;
            match message.role.as_str() {
                "system" | "user" | "assistant" | "tool" => {}
                // OpenAI's newer name for system instructions; chat templates know `system`.
                "developer" => message.role = "system".to_owned(),
                role => {
                    return Err(ApiError::bad_param(
                        format!("messages[{i}].role"),
                        format!(
                            "unknown role {role:?} in messages[{i}] (system, developer, user, assistant or tool)"
                        ),
                    ));
                }
            }
            Ok(message)
        })
        .collect()
}

/// Tokenizes `text`, through the session cache unless bypassed, refusing it once it has more
/// than `max` tokens (see [`prompt_limit`]): an over-long prompt is found without tokenizing
/// all of it, and nothing of it is kept. What the cache reused goes on the current span (a
/// request's `preprocess`).
fn encode_with(
    model: &ModelTokenizer,
    text: &str,
    sessions: &Sessions,
    max: usize,
) -> Result<Vec<TokenId>, ApiError> {
    match sessions {
        Sessions::Track(id) => {
            let turn = model
                .sessions
                .encode_turn_within(id.as_deref(), text, max)
                .map_err(tokenize_error)?;
            let span = tracing::Span::current();
            span.record("session_cache_hit", turn.reused_tokens > 0);
            span.record("reused_tokens", turn.reused_tokens as i64);
            span.record("prefix_cache_tokens", turn.prefix_tokens as i64);
            Ok(turn.token_ids)
        }
        Sessions::Bypass => model
            .dir
            .tokenizer()
            .encode_within(text, max)
            .map_err(tokenize_error),
    }
}

/// Renders the chat template for `request` (its messages, tools and template switches) and
/// tokenizes the result (at most `max` tokens).
pub async fn encode_chat(
    metrics: &Metrics,
    model: Arc<ModelTokenizer>,
    request: ChatRequest,
    sessions: Sessions,
    max: usize,
) -> Result<Vec<TokenId>, ApiError> {
    let size = chat_size(&request.messages, &request.tools);
    off_reactor(metrics, size, move || {
        let text = model.dir.render_chat(&request).map_err(tokenize_error)?;
        encode_with(&model, &text, &sessions, max)
    })
    .await
}

/// [`encode_chat`], and the prompt's block hashes for routing in the same task.
pub async fn encode_chat_named(
    metrics: &Metrics,
    model: Arc<ModelTokenizer>,
    request: ChatRequest,
    sessions: Sessions,
    max: usize,
    naming: BlockNaming,
) -> Result<(Vec<TokenId>, PromptHashes), ApiError> {
    let size = chat_size(&request.messages, &request.tools);
    off_reactor(metrics, size, move || {
        let text = model.dir.render_chat(&request).map_err(tokenize_error)?;
        let tokens = encode_with(&model, &text, &sessions, max)?;
        let hashes = naming.hash(&tokens);
        Ok((tokens, hashes))
    })
    .await
}

/// Renders a chat request as given (its own `add_generation_prompt`) and tokenizes it, outside
/// the session cache (`/tokenize`).
pub async fn encode_chat_request(
    metrics: &Metrics,
    model: Arc<ModelTokenizer>,
    request: ChatRequest,
    max: usize,
) -> Result<Vec<TokenId>, ApiError> {
    let size = chat_size(&request.messages, &request.tools);
    off_reactor(metrics, size, move || {
        let text = model.dir.render_chat(&request).map_err(tokenize_error)?;
        encode_with(&model, &text, &Sessions::Bypass, max)
    })
    .await
}

/// Tokenizes plain text (a completion prompt) into at most `max` tokens.
pub async fn encode_text(
    metrics: &Metrics,
    model: Arc<ModelTokenizer>,
    text: String,
    sessions: Sessions,
    max: usize,
) -> Result<Vec<TokenId>, ApiError> {
    off_reactor(metrics, text.len(), move || {
        encode_with(&model, &text, &sessions, max)
    })
    .await
}

/// [`encode_text`], and the prompt's block hashes for routing in the same task.
pub async fn encode_text_named(
    metrics: &Metrics,
    model: Arc<ModelTokenizer>,
    text: String,
    sessions: Sessions,
    max: usize,
    naming: BlockNaming,
) -> Result<(Vec<TokenId>, PromptHashes), ApiError> {
    off_reactor(metrics, text.len(), move || {
        let tokens = encode_with(&model, &text, &sessions, max)?;
        let hashes = naming.hash(&tokens);
        Ok((tokens, hashes))
    })
    .await
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use switchyard_tokenize::SessionConfig;

    use super::Tokenizers;

    /// Work on inputs up to `INLINE_MAX_BYTES` runs on the calling task's thread; longer goes
    /// to the blocking pool (another thread).
    #[tokio::test(flavor = "current_thread")]
    async fn short_inputs_stay_on_the_reactor_and_long_ones_leave_it() {
        let metrics = crate::observe::metrics::Metrics::new();
        let here = std::thread::current().id();
        for (size, inline) in [
            (0, true),
            (super::INLINE_MAX_BYTES, true),
            (super::INLINE_MAX_BYTES + 1, false),
            (usize::MAX, false),
        ] {
            let ran_on = super::off_reactor(&metrics, size, || Ok(std::thread::current().id()))
                .await
                .unwrap();
            assert_eq!(ran_on == here, inline, "{size} bytes");
        }
    }

    /// The roles the docs list are taken (`developer` as `system`); any other is a 400 naming
    /// the message.
    #[test]
    fn an_unknown_chat_role_is_refused_by_name() {
        let parsed = super::parse_messages(vec![
            serde_json::json!({"role": "developer", "content": "rules"}),
            serde_json::json!({"role": "user", "content": "hi"}),
        ])
        .unwrap();
        assert_eq!(parsed[0].role, "system");
        let Err(crate::error::ApiError::BadRequest { param, message }) =
            super::parse_messages(vec![serde_json::json!({"role": "wizard", "content": "x"})])
        else {
            panic!("wizard is no role");
        };
        assert_eq!(param.as_deref(), Some("messages[0].role"));
        assert!(message.contains("\"wizard\""), "{message}");
    }

    /// Every built-in spelling loads its vocabulary (told apart by the ChatML end id), and a
    /// setting that is neither built in nor a directory is refused with its name.
    #[test]
    fn builtin_specs_load_their_vocabulary() {
        let per_model = BTreeMap::from([("gpt-4o".to_owned(), "builtin:o200k".to_owned())]);
        for (spec, name, im_end) in [
            ("builtin", "builtin:cl100k", 100_265),
            ("builtin:cl100k", "builtin:cl100k", 100_265),
            ("builtin:o200k", "builtin:o200k", 200_265),
        ] {
            let tokenizers = Tokenizers::load(spec, &per_model, &SessionConfig::default())
                .unwrap_or_else(|e| panic!("{spec}: {e}"));
            let default = tokenizers.for_model("sim-8b");
            let tok = default.dir.tokenizer();
            assert_eq!(tok.name(), name);
            assert_eq!(tok.encode("<|im_end|>").unwrap(), [im_end]);
            assert_eq!(default.dir.eos_token_ids()[0], im_end);
            let o200k = tokenizers.for_model("gpt-4o");
            assert_eq!(o200k.dir.tokenizer().name(), "builtin:o200k");
        }
        let err = Tokenizers::load("builtin:o300k", &per_model, &SessionConfig::default())
            .err()
            .unwrap_or_default();
        assert!(err.contains("builtin:o300k"), "{err}");
    }
}
