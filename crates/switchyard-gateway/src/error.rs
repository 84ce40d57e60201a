//! The gateway's errors and their one mapping to HTTP statuses and OpenAI error objects.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// Why a request failed. Each variant maps to exactly one HTTP status (see [`ApiError::status`]).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// The client sent something the API does not accept. Retrying it unchanged cannot help.
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<String>,
    },
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    #[error("request body is larger than the limit of {0} bytes")]
    PayloadTooLarge(usize),
    #[error("missing or invalid bearer token")]
    Unauthorized,
    /// `/v1` needs an API key and the request carried none.
    #[error(
        "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
    )]
    MissingApiKey,
    /// The request's API key is not one of the gateway's (it is not echoed).
    #[error("Incorrect API key provided.")]
    InvalidApiKey,
    #[error("{0}")]
    NotFound(String),
    /// Too much work queued; the client should retry after the given number of seconds.
    #[error("the server is saturated; retry after {retry_after_secs} s")]
    Saturated { retry_after_secs: u64 },
    /// The client already has as many requests in flight as one client may.
    #[error(
        "this client already has {0} requests in flight, the most the gateway allows one client (max_requests_per_client); retry after 1 s"
    )]
    ClientLimit(usize),
    /// The request's tenant is over one of its fleet-wide quotas ([`crate::access::quota`]).
    #[error("this tenant is over its quota {limit}; retry after {retry_after_secs} s")]
    QuotaExceeded {
        limit: &'static str,
        retry_after_secs: u64,
    },
    /// The quota store did not answer and the gateway is configured to fail closed.
    #[error("the quota store is unavailable and quotas fail closed; retry after 1 s")]
    QuotaStoreDown,
    /// The gateway has as many connections open as it may.
    #[error("the gateway has its limit of {0} connections open (max_connections); retry after 1 s")]
    TooManyConnections(usize),
    /// The request body did not arrive in time.
    #[error("the request body did not arrive within {0} s")]
    BodyTimeout(u64),
    /// No worker can serve the model now (none registered, all draining or failing).
    #[error("{0}")]
    Unavailable(String),
    #[error("request timed out after {0} s")]
    Timeout(u64),
    /// A worker failed in a way retries could not hide.
    #[error("{0}")]
    Upstream(String),
    #[error("internal error: {0}")]
    Internal(String),
}

#[derive(Debug, Serialize)]
struct ErrorBody<'a> {
    error: ErrorObject<'a>,
}

/// The OpenAI error object.
#[derive(Debug, Serialize)]
pub struct ErrorObject<'a> {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

/// The serving sequence's errors, by who is at fault.
impl From<switchyard_router::serve::ServeError> for ApiError {
    fn from(err: switchyard_router::serve::ServeError) -> Self {
        use switchyard_router::serve::ServeError;
        match err {
            ServeError::BadRequest(message) => ApiError::bad_request(message),
            ServeError::Unavailable(message) => ApiError::Unavailable(message),
            ServeError::Upstream(message) => ApiError::Upstream(message),
            ServeError::Internal(message) => ApiError::Internal(message),
        }
    }
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: None,
        }
    }

    pub fn bad_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Unauthorized | ApiError::MissingApiKey | ApiError::InvalidApiKey => {
                StatusCode::UNAUTHORIZED
            }
            ApiError::Saturated { .. }
            | ApiError::ClientLimit(_)
            | ApiError::QuotaExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_)
            | ApiError::TooManyConnections(_)
            | ApiError::QuotaStoreDown => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Upstream(_) => StatusCode::BAD_GATEWAY,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind_and_code(&self) -> (&'static str, Option<&'static str>) {
        match self {
            ApiError::BadRequest { .. } => ("invalid_request_error", None),
            ApiError::PayloadTooLarge(_) => ("invalid_request_error", Some("payload_too_large")),
            ApiError::ModelNotFound(_) => ("invalid_request_error", Some("model_not_found")),
            ApiError::NotFound(_) => ("invalid_request_error", Some("not_found")),
            ApiError::Unauthorized => ("authentication_error", Some("invalid_api_key")),
            // As OpenAI answers them.
            ApiError::MissingApiKey => ("invalid_request_error", None),
            ApiError::InvalidApiKey => ("invalid_request_error", Some("invalid_api_key")),
            ApiError::Saturated { .. } => ("rate_limit_error", Some("rate_limit_exceeded")),
            ApiError::ClientLimit(_) => ("rate_limit_error", Some("too_many_concurrent_requests")),
            ApiError::QuotaExceeded { .. } => ("rate_limit_error", Some("quota_exceeded")),
            ApiError::QuotaStoreDown => {
                ("service_unavailable_error", Some("quota_store_unavailable"))
            }
            ApiError::Unavailable(_) => ("service_unavailable_error", Some("no_worker_available")),
            ApiError::TooManyConnections(_) => {
                ("service_unavailable_error", Some("too_many_connections"))
            }
            ApiError::BodyTimeout(_) => ("invalid_request_error", Some("request_timeout")),
            ApiError::Timeout(_) => ("timeout_error", Some("timeout")),
            ApiError::Upstream(_) => ("server_error", Some("upstream_error")),
            ApiError::Internal(_) => ("server_error", None),
        }
    }

    /// The OpenAI error object, for JSON bodies and for error events inside a stream.
    pub fn to_json(&self) -> serde_json::Value {
        let (kind, code) = self.kind_and_code();
        let param = match self {
            ApiError::BadRequest { param, .. } => param.as_deref(),
            ApiError::ModelNotFound(_) => Some("model"),
            _ => None,
        };
        serde_json::json!(ErrorBody {
            error: ErrorObject {
                message: self.to_string(),
                kind,
                param,
                code,
            }
        })
    }

    /// Whether another attempt (on another worker, or later) may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ApiError::Saturated { .. }
                | ApiError::ClientLimit(_)
                | ApiError::QuotaExceeded { .. }
                | ApiError::QuotaStoreDown
                | ApiError::TooManyConnections(_)
                | ApiError::Unavailable(_)
                | ApiError::Upstream(_)
        )
    }

    /// Label for the requests-by-status metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ApiError::BadRequest { .. } => "bad_request",
            ApiError::PayloadTooLarge(_) => "payload_too_large",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::NotFound(_) => "not_found",
            ApiError::Unauthorized => "unauthorized",
            ApiError::MissingApiKey => "missing_api_key",
            ApiError::InvalidApiKey => "invalid_api_key",
            ApiError::Saturated { .. } => "saturated",
            ApiError::ClientLimit(_) => "client_limit",
            ApiError::QuotaExceeded { .. } => "quota_exceeded",
            ApiError::QuotaStoreDown => "quota_store_unavailable",
            ApiError::TooManyConnections(_) => "too_many_connections",
            ApiError::BodyTimeout(_) => "body_timeout",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::Timeout(_) => "timeout",
            ApiError::Upstream(_) => "upstream_error",
            ApiError::Internal(_) => "internal_error",
        }
    }
}

impl ApiError {
    /// The headers this error's response carries besides its JSON body: `Retry-After` when a
    /// retry may succeed later, the limit's name for a quota refusal, the auth scheme for an
    /// authentication failure. The gateway's answers and the endpoint picker's immediate
    /// responses carry the same.
    pub fn headers(&self) -> Vec<(header::HeaderName, HeaderValue)> {
        let mut headers = Vec::new();
        let retry_after = match self {
            ApiError::Saturated { retry_after_secs }
            | ApiError::QuotaExceeded {
                retry_after_secs, ..
            } => Some(*retry_after_secs),
            ApiError::ClientLimit(_)
            | ApiError::TooManyConnections(_)
            | ApiError::QuotaStoreDown => Some(1),
            _ => None,
        };
        if let Some(secs) = retry_after {
            headers.push((header::RETRY_AFTER, HeaderValue::from(secs)));
        }
        if let ApiError::QuotaExceeded { limit, .. } = self {
            headers.push((
                header::HeaderName::from_static("x-switchyard-quota-limit"),
                HeaderValue::from_static(limit),
            ));
        }
        if matches!(
            self,
            ApiError::Unauthorized | ApiError::MissingApiKey | ApiError::InvalidApiKey
        ) {
            headers.push((header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")));
        }
        headers
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), axum::Json(self.to_json())).into_response();
        response.headers_mut().extend(self.headers());
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_render_as_openai_error_objects() {
        let err = ApiError::ModelNotFound("gpt-x".into());
        assert_eq!(err.status(), StatusCode::NOT_FOUND);
        let json = err.to_json();
        assert_eq!(json["error"]["type"], "invalid_request_error");
        assert_eq!(json["error"]["code"], "model_not_found");
        assert_eq!(json["error"]["param"], "model");
        assert!(json["error"]["message"].as_str().unwrap().contains("gpt-x"));
    }

    #[test]
    fn saturation_carries_retry_after() {
        let response = ApiError::Saturated {
            retry_after_secs: 2,
        }
        .into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
    }

    #[test]
    fn a_quota_refusal_names_its_limit() {
        let err = ApiError::QuotaExceeded {
            limit: "requests_per_window",
            retry_after_secs: 7,
        };
        let json = err.to_json();
        assert_eq!(json["error"]["code"], "quota_exceeded");
        assert!(
            json["error"]["message"]
                .as_str()
                .unwrap()
                .contains("requests_per_window")
        );
        let response = err.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "7");
        assert_eq!(
            response.headers()["x-switchyard-quota-limit"],
            "requests_per_window"
        );
        let down = ApiError::QuotaStoreDown.into_response();
        assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(down.headers()[header::RETRY_AFTER], "1");
    }
}
