//! Test support (being written).
