//! One choice's answer as its tokens arrive: incremental detokenization, stop strings, counts,
//! and log probabilities in the endpoint's shape.

use std::sync::Arc;
use std::time::Instant;

use switchyard_core::{TokenId, TokenLogprob};
use switchyard_tokenize::{IncrementalDecoder, Tokenizer};

use super::pipeline::prepared::{Prepared, PromptPlan};
use super::state::AppState;
use crate::access::quota::QuotaPass;
use crate::api::chat_output::{Piece as OutputPiece, Shaper, ToolCallOut, prompt_tail};
use crate::api::openai::{ChatMessageOut, LogprobsOut, Usage};
use crate::api::stop::{StopMatcher, StopOutcome};
use crate::observe::metrics::ModelLabels;
use crate::serving::dispatch::Finish;

/// Turns one choice's dispatch events into text, counts and log probabilities.
pub(super) struct ChoiceText {
    /// Taken when the generation finishes and the decoder flushes.
    decoder: Option<IncrementalDecoder>,
    tokenizer: Arc<Tokenizer>,
    stop: StopMatcher,
    pub(super) prompt_tokens: u32,
    pub(super) cached_tokens: u32,
    pub(super) completion_tokens: u32,
    pub(super) finish: Option<&'static str>,
    last_token_at: Option<Instant>,
    /// Log probabilities not yet written, when the request asked for them.
    logprobs: Option<LogprobsOut>,
    /// Characters of the choice's text so far (the echoed prompt included): where the next
    /// token's text starts, for a text completion's `text_offset`.
    offset: u32,
    /// Chat answers: reasoning and tool calls read from the text.
    shaper: Option<Shaper>,
    /// The request's quota, charged with this choice's tokens when it is counted.
    quota: Arc<QuotaPass>,
}

impl ChoiceText {
    pub(super) fn new(p: &Prepared, prompt: &PromptPlan) -> Self {
        let tokenizer = Arc::clone(p.model_dir.tokenizer());
        Self {
            decoder: Some(IncrementalDecoder::new(
                Arc::clone(&tokenizer),
                prompt.sampling.skip_special_tokens.unwrap_or(true),
            )),
            tokenizer,
            stop: StopMatcher::new(prompt.sampling.stop.clone())
                .including_the_stop(prompt.sampling.include_stop_str_in_output.unwrap_or(false)),
            prompt_tokens: prompt.tokens.len() as u32,
            cached_tokens: 0,
            completion_tokens: 0,
            finish: None,
            last_token_at: None,
            logprobs: p
                .asks
                .logprobs
                .map(|_| LogprobsOut::new(p.api.shape.is_chat())),
            offset: prompt
                .echo
                .as_deref()
                .map_or(0, |e| e.chars().count() as u32),
            shaper: p.api.shape.is_chat().then(|| {
                Shaper::new(
                    &p.output,
                    &p.completion_id,
                    &prompt_tail(&p.model_dir, &prompt.tokens),
                )
            }),
            quota: Arc::clone(&p.quota),
        }
    }

    /// The answer pieces of new `text` (reasoning and tool calls taken out of a chat answer);
    /// `done`: the text has ended, so what was held back comes out.
    pub(super) fn shape(&mut self, text: String, done: bool) -> Vec<OutputPiece> {
        let Some(shaper) = self.shaper.as_mut() else {
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![OutputPiece::Content(text)]
            };
        };
        let mut pieces = if text.is_empty() {
            Vec::new()
        } else {
            shaper.push(&text)
        };
        if done {
            pieces.extend(shaper.finish());
        }
        pieces
    }

    /// The finish reason the client sees (`tool_calls` when the model called a tool).
    pub(super) fn finish_reason(&self) -> &'static str {
        let finish = self.finish.unwrap_or("length");
        self.shaper
            .as_ref()
            .map_or(finish, |s| s.finish_reason(finish))
    }

    /// New text from `tokens` (and their log probabilities); sets `finish` when a stop string
    /// matched.
    pub(super) fn tokens(
        &mut self,
        state: &AppState,
        labels: &ModelLabels,
        arrived: Instant,
        tokens: &[TokenId],
        logprobs: &[TokenLogprob],
    ) -> String {
        let now = Instant::now();
        let m = &state.observers.metrics;
        match self.last_token_at {
            None => m
                .ttft
                .get_or_create(labels)
                .observe((now - arrived).as_secs_f64()),
            Some(prev) => m
                .inter_token
                .get_or_create(labels)
                .observe((now - prev).as_secs_f64()),
        }
        self.last_token_at = Some(now);
        self.completion_tokens += tokens.len() as u32;
        if let Some(out) = self.logprobs.as_mut() {
            let tokenizer = &self.tokenizer;
            let text_of = |t: TokenId| tokenizer.decode(&[t], false).unwrap_or_default();
            out.push(logprobs, &text_of, &mut self.offset);
        }
        let mut text = String::new();
        if let Some(decoder) = self.decoder.as_mut() {
            for &t in tokens {
                match decoder.push(t) {
                    Ok(piece) => text.push_str(&piece),
                    Err(err) => {
                        tracing::warn!(token = t, error = %err, "cannot detokenize; skipping")
                    }
                }
            }
        }
        match self.stop.push(&text) {
            StopOutcome::Continue(out) => out,
            StopOutcome::Stopped(out) => {
                self.finish = Some("stop");
                out
            }
        }
    }

    /// Generation ended by itself: flush what the decoder and the stop matcher held.
    pub(super) fn finished(&mut self, finish: Finish) -> String {
        let mut tail = self
            .decoder
            .take()
            .map(|d| d.finish().unwrap_or_default())
            .unwrap_or_default();
        let outcome = self.stop.push(&tail);
        tail = match outcome {
            StopOutcome::Continue(out) => out + &self.stop.finish(),
            StopOutcome::Stopped(out) => {
                self.finish = Some("stop");
                return out;
            }
        };
        self.finish = Some(match finish {
            Finish::Length => "length",
            Finish::Stop => "stop",
        });
        tail
    }

    /// The log probabilities gathered since the last call, when the request asked for them.
    pub(super) fn take_logprobs(&mut self) -> Option<LogprobsOut> {
        self.logprobs.as_mut().map(LogprobsOut::take)
    }

    /// Counts the finished choice in the token metrics: each choice is one generation.
    pub(super) fn count(&self, state: &AppState, labels: &ModelLabels) {
        let m = &state.observers.metrics;
        m.prompt_tokens
            .get_or_create(labels)
            .inc_by(u64::from(self.prompt_tokens));
        m.completion_tokens
            .get_or_create(labels)
            .inc_by(u64::from(self.completion_tokens));
        m.request_prompt_tokens
            .get_or_create(labels)
            .observe(f64::from(self.prompt_tokens));
        m.request_completion_tokens
            .get_or_create(labels)
            .observe(f64::from(self.completion_tokens));
        m.cached_prompt_tokens.inc_by(u64::from(self.cached_tokens));
        self.quota
            .charge(u64::from(self.prompt_tokens) + u64::from(self.completion_tokens));
        if let Some(shaper) = &self.shaper {
            m.tool_calls.inc_by(u64::from(shaper.tool_calls()));
            m.tool_calls_malformed
                .inc_by(shaper.malformed_tool_calls() as u64);
        }
    }
}

/// The usage of a whole request: each prompt counted once (as OpenAI and vLLM count it, with
/// the cached tokens of its first choice), the completions of every choice. `texts` are in
/// choice order, `n` per prompt.
pub(super) fn request_usage(texts: &[ChoiceText], n: u32) -> Usage {
    let mut usage = Usage::new(0, 0, 0);
    for (i, t) in texts.iter().enumerate() {
        let first_of_prompt = (i as u32).is_multiple_of(n.max(1));
        usage = usage.plus(&Usage::new(
            if first_of_prompt { t.prompt_tokens } else { 0 },
            t.completion_tokens,
            if first_of_prompt { t.cached_tokens } else { 0 },
        ));
    }
    usage
}

/// A whole (not streamed) choice's answer, gathered from its pieces.
#[derive(Debug, Default)]
pub(crate) struct Gathered {
    pub(crate) content: String,
    pub(crate) reasoning: Option<String>,
    pub(crate) tool_calls: Vec<ToolCallOut>,
}

impl Gathered {
    /// Starts with `text` (an echoed prompt).
    pub(crate) fn starting_with(text: String) -> Self {
        Self {
            content: text,
            ..Self::default()
        }
    }

    pub(crate) fn extend(&mut self, pieces: Vec<OutputPiece>) {
        for piece in pieces {
            match piece {
                OutputPiece::Content(text) => self.content.push_str(&text),
                OutputPiece::Reasoning(text) => {
                    self.reasoning.get_or_insert_default().push_str(&text)
                }
                OutputPiece::ToolCall(call) => self.tool_calls.push(call),
            }
        }
    }

    /// The chat message: no content (null) when the model only called tools, as OpenAI answers.
    pub(crate) fn message(self) -> ChatMessageOut {
        let called = !self.tool_calls.is_empty();
        ChatMessageOut {
            role: "assistant",
            content: (!called || !self.content.trim().is_empty()).then_some(self.content),
            reasoning_content: self.reasoning.clone(),
            reasoning: self.reasoning,
            tool_calls: called.then_some(self.tool_calls),
        }
    }
}
