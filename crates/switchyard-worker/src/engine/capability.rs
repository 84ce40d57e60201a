//! What an engine can do beyond generating and prefilling, one trait per capability: an
//! [`Engine`](super::Engine) offers the ones it has through its `kv_export`, `kv_import` and
//! `engine_transfer` accessors, and callers ask for the capability, not for the engine kind.
//!
//! - [`KvExport`]: holds a prefill's blocks under a handle for a decode worker to pull over
//!   `PullKv` (the simulator).
//! - [`KvImporter`]: places blocks pulled from a prefill worker into its cache, so the request
//!   that follows finds them as a prefix hit (the simulator).
//! - [`EngineTransfer`]: fetches a prompt's KV from the prefill engine itself, given that
//!   engine's transfer parameters (vLLM's KV connectors, SGLang's bootstrap).

use serde_json::{Map, Value};

use super::{EngineError, GenerateParams, GenerationStream, HeldBlock, KvImport, KvPull};

/// An engine whose prefills hold their blocks for a decode worker to pull.
#[async_trait::async_trait]
pub trait KvExport: Send + Sync {
    /// Claims the blocks held under `handle`; a second claim of the same handle fails.
    async fn pull_kv(&self, handle: &str) -> Result<KvPull, EngineError>;
}

/// An engine that takes a prompt's KV blocks pulled from a prefill worker.
#[async_trait::async_trait]
pub trait KvImporter: Send + Sync {
    /// Starts importing a prompt's KV blocks.
    fn start_import(&self) -> Result<KvImport, EngineError>;

    /// Places the next KV blocks of `import` (continuing its chain, in prompt order) into the
    /// engine's cache, charging their transfer. Returns how many blocks the cache took (a
    /// prefix of `blocks`).
    async fn import_kv(
        &self,
        import: &mut KvImport,
        blocks: Vec<HeldBlock>,
    ) -> Result<usize, EngineError>;
}

/// An engine that moves a disaggregated prompt's KV itself.
#[async_trait::async_trait]
pub trait EngineTransfer: Send + Sync {
    /// Generates the whole completion of a prompt whose KV the engine fetches itself from a
    /// prefill engine, as described by `transfer` (the prefill's
    /// [`PrefillOutcome::engine_transfer_params`](super::PrefillOutcome), a JSON object).
    async fn generate_with_transfer(
        &self,
        params: GenerateParams,
        transfer: Map<String, Value>,
    ) -> Result<GenerationStream, EngineError>;
}
