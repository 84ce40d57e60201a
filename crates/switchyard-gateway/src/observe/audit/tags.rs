//! Who a generation is for, as its decisions are tagged and queried, and the request id a
//! client may give.

/// Who a generation is for, as its decisions are tagged and queried.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestTags {
    /// The HTTP request's id (`x-request-id`).
    pub request_id: String,
    /// Which of the request's choices (prompts × n) this generation is, when it has several.
    pub choice: Option<u32>,
    pub session: Option<String>,
    /// The fairness tenant (`user:…`, `key:…`, `ip:…` or `anonymous`).
    pub tenant: Option<String>,
    /// What named the session: `x-session-id`, `x-claude-code-session-id`, `session-id`,
    /// `prompt_cache_key` or `metadata.user_id.session_id`.
    pub session_source: Option<&'static str>,
    /// Fields the request carried without effect (advisory, or unknown and accepted).
    pub ignored_fields: Vec<String>,
    /// How long session scheduling held the request between turns, when it did.
    pub session_hold: Option<SessionHold>,
}

/// A request session scheduling held before routing it (`serving::sessions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SessionHold {
    /// How long it waited, in milliseconds.
    pub held_ms: u64,
    /// What let it go: `room` (a session left, a worker joined) or `aged` (its aging bound).
    pub released: &'static str,
}

impl RequestTags {
    /// Tags naming only a request id.
    pub fn new(request_id: impl Into<String>) -> Self {
        Self {
            request_id: request_id.into(),
            ..Self::default()
        }
    }
}

/// Longest `x-request-id` taken from a client.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Checks a client's `x-request-id`: 1 to 128 characters of `[A-Za-z0-9._:-]` (what is safe in
/// logs, metrics exemplars and URLs without escaping).
pub fn check_request_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("x-request-id is empty".to_owned());
    }
    if id.len() > MAX_REQUEST_ID_LEN {
        return Err(format!(
            "x-request-id is {} characters long; at most {MAX_REQUEST_ID_LEN} are accepted",
            id.len()
        ));
    }
    if let Some(bad) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
    {
        return Err(format!(
            "x-request-id contains {bad:?}; only ASCII letters, digits, '.', '_', ':' and '-' are accepted"
        ));
    }
    Ok(())
}

pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
