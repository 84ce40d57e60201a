//! The `/v1` API key check, shared by the OpenAI and the Anthropic routes; each words its
//! refusal in its own API's shape.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::Response;

use super::state::{ApiTenant, AppState};
use crate::error::ApiError;

/// What the check needs: the gateway's keys and metrics, and how the routes it guards word a
/// refusal.
#[derive(Clone)]
pub(super) struct KeyCheck {
    pub(super) state: Arc<AppState>,
    pub(super) refuse: fn(ApiError) -> Response,
}

/// With an API key file, `/v1` takes only requests carrying one of its keys (401 otherwise, in
/// the API's shape) and shares the slots by the key's tenant. The key comes as
/// `Authorization: Bearer <key>` or, as Anthropic's clients send it, `x-api-key: <key>`.
pub(super) async fn require_api_key(
    State(KeyCheck { state, refuse }): State<KeyCheck>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(keys) = &state.access.api_keys else {
        return next.run(request).await;
    };
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let x_api_key = request
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty());
    let refused = match crate::access::api_keys::bearer(authorization).or(x_api_key) {
        None => ApiError::MissingApiKey,
        Some(key) => match keys.tenant(key) {
            Some(tenant) => {
                request.extensions_mut().insert(ApiTenant(tenant));
                return next.run(request).await;
            }
            None => ApiError::InvalidApiKey,
        },
    };
    state
        .observers
        .metrics
        .api_key_refused(refused.metric_label());
    refuse(refused)
}
