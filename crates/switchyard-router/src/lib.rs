//! KV-aware router (being written).
