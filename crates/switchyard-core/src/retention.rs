//! A retention hint: a request asks the worker to keep its prefix cached for a while after it
//! ends, because the same session will send its next turn (a tool call's pause later) on top
//! of it. Engines treat it as an eviction preference within a budget, never as a reservation:
//! a pinned prefix can always be evicted to admit new work.

use serde::{Deserialize, Serialize};

/// Keep this request's prompt and output blocks for `ttl_ms` after it ends, preferring them
/// over unpinned blocks at eviction; among pinned blocks a lower `priority` goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Retention {
    /// How long after the request ends, in milliseconds; 0 asks for nothing.
    pub ttl_ms: u64,
    /// Higher is kept longer when pinned blocks must be evicted.
    pub priority: u8,
}

impl Retention {
    /// Whether the hint asks for anything.
    pub fn is_some(&self) -> bool {
        self.ttl_ms > 0
    }
}
