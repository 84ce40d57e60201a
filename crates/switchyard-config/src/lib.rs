//! What the configurations of the binary's roles (gateway, worker, planner) share.
//!
//! Each role keeps its own serde configuration struct, flattened into clap, with the precedence
//! defaults < config file < `SWITCHYARD_*` environment < flags, validated once at start. This
//! crate holds the two pieces that are the same for all of them: [`ConfigError`], the
//! one-sentence error a bad configuration exits with (code 64), and [`load_toml`], the file layer.
//! [`admin_authorized`] checks a request against the `admin_token` setting the gateway and the
//! planner both carry; [`listen_addr`] reads listen addresses (`localhost:8000` included).

mod admin_token;
pub mod listen_addr;

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

pub use admin_token::admin_authorized;
pub use listen_addr::parse_listen_addr;

/// A configuration problem, always the operator's to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is invalid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Reads a TOML configuration file into `T`; unknown keys are refused when `T` says
/// `deny_unknown_fields`, as every role's configuration does.
pub fn load_toml<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.to_owned(),
        message: e.message().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        listen: String,
    }

    #[test]
    fn reads_a_file_and_names_the_file_in_each_error() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.toml");
        std::fs::write(&good, "listen = \"0.0.0.0:8000\"\n").unwrap();
        let sample: Sample = load_toml(&good).unwrap();
        assert_eq!(sample.listen, "0.0.0.0:8000");

        let unknown = dir.path().join("unknown.toml");
        std::fs::write(&unknown, "listen = \"x\"\nlisten_port = 1\n").unwrap();
        let err = load_toml::<Sample>(&unknown).unwrap_err().to_string();
        assert!(
            err.contains("unknown.toml") && err.contains("listen_port"),
            "{err}"
        );

        let missing = dir.path().join("missing.toml");
        let err = load_toml::<Sample>(&missing).unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }), "{err}");
        assert!(err.to_string().contains("missing.toml"));
    }
}
