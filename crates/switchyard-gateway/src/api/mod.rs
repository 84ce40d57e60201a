//! What clients see: the HTTP listener and the four APIs it serves.
//!
//! [`http`] reads a request, runs it through the one request pipeline
//! ([`http::pipeline`]: read, split, validate, quota, admission, tokenize, prepare, record,
//! fail) and renders the serving path's events as each API's answer (`http::render`: chat,
//! completions, Responses, Messages), JSON or server-sent events; its admin routes answer
//! operators. [`openai`] holds the OpenAI request types and field tables, [`chat_output`] the
//! parsing of a model's text into tool calls and reasoning, [`stop`] stop strings, [`forward`]
//! the `/v1` middleware that sends a session's turn to the replica owning it. Nothing here routes or
//! calls a worker: that is [`crate::serving`].

pub mod chat_output;
pub mod forward;
pub mod http;
pub mod openai;
pub mod stop;
