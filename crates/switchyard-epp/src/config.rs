//! The endpoint picker's own settings (`[epp]` of its config file, `--epp-*` flags,
//! `SWITCHYARD_EPP_*`): where the ext_proc server listens, how the proxy sends bodies, what to
//! do with a body it cannot read, how many fallbacks to hand out. Routing, tokenizers, admission
//! and the admin API are the gateway's configuration, shared as is.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use serde::Deserialize;

pub use switchyard_config::ConfigError;

/// How the proxy sends one direction's body, as Envoy's `ProcessingMode.BodySendMode` names it.
/// A stream's own `protocol_config` (sent by Envoy 1.34 and later) wins over this setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BodyMode {
    /// No body is sent.
    None,
    /// Chunks as they arrive, each answered before the next; the destination must be chosen
    /// at the headers, before any of the prompt is seen.
    Streamed,
    /// The whole body in one message, after the headers were answered.
    Buffered,
    /// As much as fits Envoy's buffer in one message.
    BufferedPartial,
    /// Chunks as they arrive, unanswered; the picker answers the headers once it has chosen
    /// and streams the body back (the Gateway API Inference Extension's mode).
    FullDuplexStreamed,
}

impl BodyMode {
    /// The mode a stream's `protocol_config` names (`None` for values this picker cannot serve:
    /// gRPC bodies).
    pub fn from_wire(mode: i32) -> Option<Self> {
        use crate::proto::mode::processing_mode::BodySendMode as Wire;
        match Wire::try_from(mode).ok()? {
            Wire::None => Some(Self::None),
            Wire::Streamed => Some(Self::Streamed),
            Wire::Buffered => Some(Self::Buffered),
            Wire::BufferedPartial => Some(Self::BufferedPartial),
            Wire::FullDuplexStreamed => Some(Self::FullDuplexStreamed),
            Wire::Grpc => None,
        }
    }
}

impl FromStr for BodyMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "none" => Ok(Self::None),
            "streamed" => Ok(Self::Streamed),
            "buffered" => Ok(Self::Buffered),
            "buffered-partial" => Ok(Self::BufferedPartial),
            "full-duplex-streamed" | "full-duplex" => Ok(Self::FullDuplexStreamed),
            _ => Err(format!(
                "unknown body mode {s:?} (none, streamed, buffered, buffered-partial or full-duplex-streamed)"
            )),
        }
    }
}

/// What the picker does with a request whose prompt it cannot read (a body that is not an
/// OpenAI completion or chat request, or one its tokenizer refuses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    /// Pick anyway, by load alone (the prompt counts as unknown), and let the model server
    /// judge the request.
    Open,
    /// Answer the proxy with a 400 and the reason.
    Closed,
}

impl FromStr for FailureMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "open" => Ok(Self::Open),
            "closed" => Ok(Self::Closed),
            _ => Err(format!("unknown failure mode {s:?} (open or closed)")),
        }
    }
}

/// The endpoint picker's settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EppConfig {
    /// The ext_proc gRPC server (and its gRPC health service). 9002 is the Gateway API
    /// Inference Extension's conventional port.
    #[serde(deserialize_with = "switchyard_config::listen_addr::deserialize")]
    pub listen: SocketAddr,
    /// Request body mode when a stream does not say.
    pub request_body_mode: BodyMode,
    /// Response body mode when a stream does not say.
    pub response_body_mode: BodyMode,
    /// A body the picker cannot read a prompt from: pick by load (`open`) or refuse (`closed`).
    pub failure_mode: FailureMode,
    /// Endpoints handed out after the chosen one, best first, for the proxy to go down when
    /// the first cannot be reached.
    pub fallbacks: usize,
}

impl Default for EppConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 9002)),
            request_body_mode: BodyMode::FullDuplexStreamed,
            response_body_mode: BodyMode::FullDuplexStreamed,
            failure_mode: FailureMode::Closed,
            fallbacks: 2,
        }
    }
}

impl EppConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.request_body_mode == BodyMode::None {
            return Err(ConfigError::Invalid(
                "request_body_mode none leaves the picker without the prompt; use buffered or full-duplex-streamed (or streamed, which picks by load alone)".into(),
            ));
        }
        if self.fallbacks > 16 {
            return Err(ConfigError::Invalid(format!(
                "fallbacks {} is more than 16; a proxy goes down a short list",
                self.fallbacks
            )));
        }
        Ok(())
    }
}

/// Flags and `SWITCHYARD_EPP_*` environment variables of the endpoint picker.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EppArgs {
    /// TOML file of the picker's own settings; environment variables and flags override it.
    #[arg(long = "epp-config", env = "SWITCHYARD_EPP_CONFIG")]
    pub epp_config: Option<PathBuf>,
    /// ext_proc gRPC listen address (default 0.0.0.0:9002).
    #[arg(long = "grpc", env = "SWITCHYARD_EPP_GRPC", value_parser = switchyard_config::parse_listen_addr)]
    pub grpc: Option<SocketAddr>,
    /// Request body mode when Envoy does not say: buffered, streamed, full-duplex-streamed.
    #[arg(long, env = "SWITCHYARD_EPP_REQUEST_BODY_MODE")]
    pub request_body_mode: Option<BodyMode>,
    /// Response body mode when Envoy does not say: none, streamed, buffered, full-duplex-streamed.
    #[arg(long, env = "SWITCHYARD_EPP_RESPONSE_BODY_MODE")]
    pub response_body_mode: Option<BodyMode>,
    /// A body without a readable prompt: open (pick by load) or closed (400).
    #[arg(long, env = "SWITCHYARD_EPP_FAILURE_MODE")]
    pub failure_mode: Option<FailureMode>,
    /// Fallback endpoints handed out after the chosen one.
    #[arg(long, env = "SWITCHYARD_EPP_FALLBACKS")]
    pub fallbacks: Option<usize>,
}

impl EppArgs {
    /// Defaults, then the file, then environment and flags; validated.
    pub fn resolve(&self) -> Result<EppConfig, ConfigError> {
        let mut config = match &self.epp_config {
            Some(path) => switchyard_config::load_toml(path)?,
            None => EppConfig::default(),
        };
        if let Some(v) = self.grpc {
            config.listen = v;
        }
        if let Some(v) = self.request_body_mode {
            config.request_body_mode = v;
        }
        if let Some(v) = self.response_body_mode {
            config.response_body_mode = v;
        }
        if let Some(v) = self.failure_mode {
            config.failure_mode = v;
        }
        if let Some(v) = self.fallbacks {
            config.fallbacks = v;
        }
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn flags_win_over_the_file_and_bad_values_are_named() {
        let dir = std::env::temp_dir().join(format!("epp-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("epp.toml");
        std::fs::write(
            &file,
            "request_body_mode = \"buffered\"\nfailure_mode = \"open\"\nfallbacks = 3\n",
        )
        .unwrap();
        let args = EppArgs {
            epp_config: Some(file.clone()),
            fallbacks: Some(1),
            ..EppArgs::default()
        };
        let config = args.resolve().unwrap();
        assert_eq!(config.request_body_mode, BodyMode::Buffered);
        assert_eq!(config.failure_mode, FailureMode::Open);
        assert_eq!(config.fallbacks, 1);
        std::fs::write(&file, "request_body_mode = \"chunked\"\n").unwrap();
        let err = args.resolve().unwrap_err().to_string();
        assert!(err.contains("chunked"), "{err}");
        std::fs::write(&file, "unknown = 1\n").unwrap();
        assert!(args.resolve().is_err());
        let none = EppArgs {
            request_body_mode: Some(BodyMode::None),
            ..EppArgs::default()
        };
        assert!(none.resolve().unwrap_err().to_string().contains("prompt"));
        assert_eq!(
            "full_duplex_streamed".parse(),
            Ok(BodyMode::FullDuplexStreamed)
        );
        assert!("sideways".parse::<FailureMode>().is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
