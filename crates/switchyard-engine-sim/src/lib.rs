//! Simulated engine (being written).
