//! A model as the gateway needs it: tokenizer, chat template, stop ids and context length,
//! loaded from a Hugging Face model directory or built in.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value as Json;
use switchyard_core::TokenId;

use crate::builtin;
use crate::chat::{ChatRequest, ChatTemplate};
use crate::error::TokenizeError;
use crate::tokenizer::Tokenizer;

const TOKENIZER_JSON: &str = "tokenizer.json";
const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";
const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";
const GENERATION_CONFIG_JSON: &str = "generation_config.json";
const CONFIG_JSON: &str = "config.json";

/// `model_max_length` above this is `transformers`' "no limit" sentinel, not a length.
const MAX_PLAUSIBLE_CONTEXT: u64 = 1 << 32;

/// A loaded model: everything needed to turn a request into token ids and back.
#[derive(Debug)]
pub struct ModelDir {
    name: String,
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<ChatTemplate>,
    eos_token_ids: Vec<TokenId>,
    context_length: Option<u64>,
}

impl ModelDir {
    /// Loads a Hugging Face model directory: `tokenizer.json` (required),
    /// `tokenizer_config.json` (chat template, bos/eos tokens), `chat_template.jinja` (newer
    /// layout; wins over the config's template), and `generation_config.json`/`config.json`
    /// when present (eos ids, `max_position_embeddings`). The model is named after the
    /// directory.
    pub fn load(dir: &Path) -> Result<Self, TokenizeError> {
        let tokenizer_path = dir.join(TOKENIZER_JSON);
        if !tokenizer_path.is_file() {
            return Err(TokenizeError::MissingFile {
                dir: dir.to_owned(),
                file: TOKENIZER_JSON,
            });
        }
        let tokenizer = Tokenizer::from_hf_file(&tokenizer_path)?;
        let config_path = dir.join(TOKENIZER_CONFIG_JSON);
        let tokenizer_config = read_json_opt(&config_path)?.unwrap_or(Json::Null);
        let bos_token = special_token_text(&tokenizer_config, "bos_token", &config_path)?;
        let eos_token = special_token_text(&tokenizer_config, "eos_token", &config_path)?;

        let jinja_path = dir.join(CHAT_TEMPLATE_JINJA);
        let templates = if jinja_path.is_file() {
            let source =
                std::fs::read_to_string(&jinja_path).map_err(|source| TokenizeError::Io {
                    path: jinja_path.clone(),
                    source,
                })?;
            Some(vec![("default".to_owned(), source)])
        } else {
            chat_templates(&tokenizer_config, &config_path)?
        };
        let chat_template = templates
            .map(|templates| ChatTemplate::named(templates, bos_token.clone(), eos_token.clone()))
            .transpose()?;

        let generation_config = read_json_opt(&dir.join(GENERATION_CONFIG_JSON))?;
        let model_config = read_json_opt(&dir.join(CONFIG_JSON))?;
        let mut eos_token_ids = Vec::new();
        for config in [&generation_config, &model_config].into_iter().flatten() {
            for id in ids_of(config.get("eos_token_id")) {
                push_unique(&mut eos_token_ids, id);
            }
        }
        if let Some(id) = eos_token
            .as_deref()
            .and_then(|t| token_id(&tokenizer, &tokenizer_config, t))
        {
            push_unique(&mut eos_token_ids, id);
        }

        let context_length = model_config
            .as_ref()
            .and_then(|c| {
                [
                    "max_position_embeddings",
                    "max_sequence_length",
                    "seq_length",
                    "n_positions",
                ]
                .iter()
                .find_map(|key| c.get(*key).and_then(Json::as_u64))
            })
            .or_else(|| {
                tokenizer_config
                    .get("model_max_length")
                    .and_then(Json::as_u64)
                    .filter(|&n| n < MAX_PLAUSIBLE_CONTEXT)
            });

        let name = dir.file_name().map_or_else(
            || dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        Ok(Self {
            name,
            tokenizer: Arc::new(tokenizer),
            chat_template,
            eos_token_ids,
            context_length,
        })
    }

    /// The offline default: model `sim-8b`, tokenizer `builtin:cl100k`, ChatML template.
    pub fn builtin() -> Self {
        Self::builtin_vocab(builtin::BuiltinVocab::Cl100k)
    }

    /// The built-in model a tokenizer setting names (`builtin`, `builtin:cl100k`,
    /// `builtin:o200k`); `None` when the setting is not one of those (a model directory).
    pub fn from_builtin_spec(spec: &str) -> Option<Self> {
        builtin::BuiltinVocab::from_spec(spec).map(Self::builtin_vocab)
    }

    /// Model `sim-8b` with a built-in vocabulary and the ChatML template.
    pub fn builtin_vocab(vocab: builtin::BuiltinVocab) -> Self {
        let chat_template = ChatTemplate::new(
            builtin::BUILTIN_CHAT_TEMPLATE,
            None,
            Some("<|im_end|>".into()),
        );
        Self {
            name: builtin::BUILTIN_MODEL_NAME.to_owned(),
            tokenizer: Arc::new(Tokenizer::builtin(vocab)),
            // The built-in template is a constant covered by tests; it always compiles.
            chat_template: chat_template.ok(),
            eos_token_ids: vocab.eos_token_ids().to_vec(),
            context_length: Some(builtin::BUILTIN_CONTEXT_LENGTH),
        }
    }

    /// Renames the model (the name clients put in `"model"`).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Ids that end generation, most authoritative source first.
    pub fn eos_token_ids(&self) -> &[TokenId] {
        &self.eos_token_ids
    }

    /// The model's context window in tokens, when its files say.
    pub fn context_length(&self) -> Option<u64> {
        self.context_length
    }

    /// Renders the chat prompt. Blocking: call from a blocking thread for long prompts.
    pub fn render_chat(&self, request: &ChatRequest) -> Result<String, TokenizeError> {
        match &self.chat_template {
            Some(template) => template.render(request),
            None => Err(TokenizeError::NoChatTemplate {
                model: self.name.clone(),
            }),
        }
    }

    /// Renders and tokenizes the chat prompt. Blocking, as [`render_chat`](Self::render_chat).
    pub fn encode_chat(&self, request: &ChatRequest) -> Result<Vec<TokenId>, TokenizeError> {
        let text = self.render_chat(request)?;
        self.tokenizer.encode(&text)
    }
}

fn read_json_opt(path: &Path) -> Result<Option<Json>, TokenizeError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TokenizeError::Io {
                path: path.to_owned(),
                source,
            });
        }
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|source| TokenizeError::InvalidJson {
            path: path.to_owned(),
            source,
        })
}

fn invalid(path: &Path, message: impl Into<String>) -> TokenizeError {
    TokenizeError::InvalidConfig {
        path: path.to_owned(),
        message: message.into(),
    }
}

/// `bos_token`/`eos_token`: absent, null, a string, or an AddedToken object with `content`.
fn special_token_text(
    config: &Json,
    key: &str,
    path: &Path,
) -> Result<Option<String>, TokenizeError> {
    match config.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(text)) => Ok(Some(text.clone())),
        Some(Json::Object(obj)) => match obj.get("content") {
            Some(Json::String(text)) => Ok(Some(text.clone())),
            _ => Err(invalid(
                path,
                format!("{key} is an object without a string \"content\""),
            )),
        },
        Some(_) => Err(invalid(
            path,
            format!("{key} must be a string or an AddedToken object"),
        )),
    }
}

/// `chat_template`: absent, a string, or a list of `{"name", "template"}`.
fn chat_templates(
    config: &Json,
    path: &Path,
) -> Result<Option<Vec<(String, String)>>, TokenizeError> {
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(source)) => Ok(Some(vec![("default".to_owned(), source.clone())])),
        Some(Json::Array(items)) => {
            let mut templates = Vec::with_capacity(items.len());
            for item in items {
                let name = item.get("name").and_then(Json::as_str);
                let source = item.get("template").and_then(Json::as_str);
                let (Some(name), Some(source)) = (name, source) else {
                    return Err(invalid(
                        path,
                        "each chat_template entry needs string \"name\" and \"template\"",
                    ));
                };
                templates.push((name.to_owned(), source.to_owned()));
            }
            if templates.is_empty() {
                return Err(invalid(path, "chat_template is an empty list"));
            }
            Ok(Some(templates))
        }
        Some(_) => Err(invalid(
            path,
            "chat_template must be a string or a list of named templates",
        )),
    }
}

/// `eos_token_id`: an integer or a list of integers.
fn ids_of(value: Option<&Json>) -> Vec<TokenId> {
    let as_id = |v: &Json| v.as_u64().and_then(|n| TokenId::try_from(n).ok());
    match value {
        Some(Json::Array(items)) => items.iter().filter_map(as_id).collect(),
        Some(v) => as_id(v).into_iter().collect(),
        None => Vec::new(),
    }
}

/// A token's id from `tokenizer.json`, else from `tokenizer_config.json`'s
/// `added_tokens_decoder` (`{"151645": {"content": "<|im_end|>", ...}}`).
fn token_id(tokenizer: &Tokenizer, config: &Json, token: &str) -> Option<TokenId> {
    tokenizer.token_to_id(token).or_else(|| {
        config
            .get("added_tokens_decoder")?
            .as_object()?
            .iter()
            .find_map(|(id, entry)| {
                (entry.get("content")?.as_str()? == token)
                    .then(|| id.parse().ok())
                    .flatten()
            })
    })
}

fn push_unique(ids: &mut Vec<TokenId>, id: TokenId) {
    if !ids.contains(&id) {
        ids.push(id);
    }
}
