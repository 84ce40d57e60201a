//! Worker registry (being written).
