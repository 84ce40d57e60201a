//! The serving path: what happens to an admitted request until its last token.
//!
//! [`model`] resolves what a request names (model or LoRA adapter, cache salt) to a model's
//! routing state; [`preprocess`] applies the chat template and tokenizes (off the reactor); [`routing`] asks
//! the model's serving core (`switchyard-router`: prefix index, load view, policies) for a
//! worker; [`dispatch`] drives the router crate's serving state machine
//! (`switchyard_router::serve::machine`) over [`transport`] (gRPC to the workers): retries
//! before the first token, migration mid-stream, and, with a prefill pool, [`disagg`]'s
//! prefill stage; [`retention`] turns agent hints into retention requests; [`sessions`] holds a
//! session's turn between turns when its working set does not fit (session scheduling). It reads the
//! cluster's state ([`crate::cluster`]) and reports to [`crate::observe`]; it knows no API, and every front that routes (the four
//! APIs, the admin explain, the endpoint picker) goes through it.

pub mod disagg;
pub mod dispatch;
pub mod model;
pub mod preprocess;
pub mod retention;
pub mod routing;
pub mod sessions;
pub mod transport;

#[cfg(test)]
mod needs_prefill_tests;
