//! The gateway's async face of a model: rendering and tokenizing off the reactor.

use std::sync::Arc;

use switchyard_core::TokenId;
use tokio::sync::Semaphore;

use crate::chat::ChatRequest;
use crate::decode::IncrementalDecoder;
use crate::error::TokenizeError;
use crate::model_dir::ModelDir;
use crate::session::{SessionConfig, SessionStats, SessionTokenizer};

/// Inputs up to this many bytes are handled on the calling task: a few hundred bytes take
/// microseconds, less than the hand-off to a blocking thread costs.
pub const DEFAULT_INLINE_MAX_BYTES: usize = 512;

/// A rendered and tokenized chat prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedPrompt {
    pub text: String,
    pub token_ids: Vec<TokenId>,
}

/// Renders chat templates and tokenizes for one model without blocking the async reactor.
///
/// Larger inputs run on tokio's blocking pool, at most `max_parallel` at once (a semaphore),
/// so a burst of 100k-token prompts neither stalls other requests nor spawns a thread each.
/// Cloning is cheap and clones share the limit.
#[derive(Debug, Clone)]
pub struct Preprocessor {
    model: Arc<ModelDir>,
    permits: Arc<Semaphore>,
    inline_max_bytes: usize,
    sessions: Arc<SessionTokenizer>,
}

impl Preprocessor {
    /// `max_parallel` is clamped to at least 1; the number of cores is a good value.
    pub fn new(model: Arc<ModelDir>, max_parallel: usize) -> Self {
        let sessions =
            SessionTokenizer::new(Arc::clone(model.tokenizer()), SessionConfig::default());
        Self {
            model,
            permits: Arc::new(Semaphore::new(max_parallel.max(1))),
            inline_max_bytes: DEFAULT_INLINE_MAX_BYTES,
            sessions: Arc::new(sessions),
        }
    }

    /// Replaces the session tokenizer's bounds and verification rate (dropping the
    /// sessions held so far); clones made before keep the old one.
    pub fn with_session_config(mut self, config: SessionConfig) -> Self {
        self.sessions = Arc::new(SessionTokenizer::new(
            Arc::clone(self.model.tokenizer()),
            config,
        ));
        self
    }

    /// The incremental session tokenizer shared by this preprocessor's clones.
    pub fn sessions(&self) -> &Arc<SessionTokenizer> {
        &self.sessions
    }

    /// Session state held and hit counts, for metrics.
    pub fn session_stats(&self) -> SessionStats {
        self.sessions.stats()
    }

    /// Changes the size under which work stays on the calling task (0: never).
    pub fn with_inline_max_bytes(mut self, bytes: usize) -> Self {
        self.inline_max_bytes = bytes;
        self
    }

    pub fn model(&self) -> &Arc<ModelDir> {
        &self.model
    }

    /// The model's context window in tokens, when known.
    pub fn context_length(&self) -> Option<u64> {
        self.model.context_length()
    }

    /// Ids that end generation.
    pub fn eos_token_ids(&self) -> &[TokenId] {
        self.model.eos_token_ids()
    }

    /// Renders the chat prompt text.
    pub async fn render_chat(&self, request: ChatRequest) -> Result<String, TokenizeError> {
        let size = request.approx_len();
        self.run(size, move |model| model.render_chat(&request))
            .await
    }

    /// Tokenizes a completion prompt (no special tokens added).
    pub async fn encode(&self, text: String) -> Result<Vec<TokenId>, TokenizeError> {
        self.run(text.len(), move |model| model.tokenizer().encode(&text))
            .await
    }

    /// Renders the chat prompt and tokenizes it, in one trip to the blocking pool.
    pub async fn encode_chat(&self, request: ChatRequest) -> Result<EncodedPrompt, TokenizeError> {
        let size = request.approx_len();
        self.run(size, move |model| {
            let text = model.render_chat(&request)?;
            let token_ids = model.tokenizer().encode(&text)?;
            Ok(EncodedPrompt { text, token_ids })
        })
        .await
    }

    /// Renders the chat prompt and tokenizes it incrementally against the session's previous
    /// turn (`session_id`, e.g. the `x-session-id` header; when `None`, the known session
    /// whose text this one extends), in one trip to the blocking pool. The ids always equal
    /// [`encode_chat`](Self::encode_chat)'s.
    pub async fn encode_chat_session(
        &self,
        session_id: Option<&str>,
        request: ChatRequest,
    ) -> Result<EncodedPrompt, TokenizeError> {
        let size = request.approx_len();
        let sessions = Arc::clone(&self.sessions);
        let session_id = session_id.map(str::to_owned);
        self.run(size, move |model| {
            let text = model.render_chat(&request)?;
            let token_ids = sessions.encode(session_id.as_deref(), &text)?;
            Ok(EncodedPrompt { text, token_ids })
        })
        .await
    }

    /// A detokenizer for one generation, skipping special tokens as OpenAI responses do.
    pub fn decoder(&self) -> IncrementalDecoder {
        IncrementalDecoder::new(Arc::clone(self.model.tokenizer()), true)
    }

    async fn run<T, F>(&self, size: usize, work: F) -> Result<T, TokenizeError>
    where
        T: Send + 'static,
        F: FnOnce(&ModelDir) -> Result<T, TokenizeError> + Send + 'static,
    {
        if size <= self.inline_max_bytes {
            return work(&self.model);
        }
        let permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .map_err(|_| TokenizeError::PoolClosed)?;
        let model = Arc::clone(&self.model);
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work(&model)
        })
        .await
        .map_err(|source| TokenizeError::TaskFailed { source })?
    }
}
