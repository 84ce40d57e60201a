//! Errors of the replay crate.

use std::path::PathBuf;

/// Why a replay could not run or finish.
///
/// Trace and configuration errors are the caller's fault and a retry cannot help; HTTP errors in
/// live mode are the endpoint's (a retry may help once it is up).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// A trace or output file could not be read or written.
    #[error("cannot access {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A trace line is not valid JSON of the expected shape.
    #[error("{path}:{line}: invalid trace record: {source}")]
    TraceParse {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    /// A trace record parses but makes no sense (zero block size, subagent without calls, …).
    #[error("{path}:{line}: {reason}")]
    TraceInvalid {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    /// A replay setting is out of range (the operator's fault).
    #[error("invalid replay configuration: {0}")]
    InvalidConfig(String),
    /// The simulated cluster could not be built (bad simulator or policy settings).
    #[error("cannot build the simulated cluster: {0}")]
    Cluster(String),
    /// Writing a report (JSON, CSV, SVG) failed.
    #[error("cannot write the report: {0}")]
    Report(String),
    /// Live mode: the endpoint could not be reached or answered with an error.
    #[error("endpoint error: {0}")]
    Http(String),
}

impl ReplayError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
