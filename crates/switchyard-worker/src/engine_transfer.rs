//! The decode side of disaggregated serving when the engines move the KV themselves (vLLM's
//! KV connectors, SGLang's bootstrap): the `KvSource` carries the prefill engine's transfer
//! parameters, which go to this worker's engine with the request (see
//! [`crate::engine::pd`]); nothing is pulled over `PullKv`.
//!
//! The engine generates the whole completion, its first token included, so its stream is passed
//! through as it is (no token is added, none is counted twice). Only the cached prompt tokens are
//! taken from the prefill: the decode engine counts the KV it received as cached, which is not
//! what the client asked about (prompt tokens the prefill found in its prefix cache).

use futures::StreamExt;
use serde_json::Value;
use switchyard_proto::v1;
use tonic::Status;

use crate::engine::{Engine, GenerateParams, GenerationChunk};
use crate::kv_source::ChunkStream;

/// Generates from `source`'s engine transfer parameters. A source without them (a simulator
/// prefill worker's handle) cannot feed an engine that moves KV itself: refused before anything
/// is pulled, as `FAILED_PRECONDITION`, so the gateway tries another pairing.
pub(crate) async fn generate(
    engine: &dyn Engine,
    params: GenerateParams,
    source: v1::KvSource,
) -> Result<ChunkStream, Status> {
    let kind = engine.spec().kind;
    if source.engine_transfer_params.is_empty() {
        return Err(Status::failed_precondition(format!(
            "this worker's {kind} engine fetches KV itself and needs the prefill engine's transfer \
             parameters; the kv_source has none (a prefill worker of another engine kind?)"
        )));
    }
    let transfer = match serde_json::from_str::<Value>(&source.engine_transfer_params) {
        Ok(Value::Object(fields)) => fields,
        Ok(_) | Err(_) => {
            return Err(Status::invalid_argument(
                "kv_source.engine_transfer_params is not a JSON object",
            ));
        }
    };
    let prompt_tokens = u32::try_from(params.prompt.len()).unwrap_or(u32::MAX);
    let cached = source.cached_prompt_tokens.min(prompt_tokens);
    let stream = engine.generate_with_transfer(params, transfer).await?;
    Ok(Box::pin(stream.map(move |item| {
        item.map(|chunk| GenerationChunk {
            cached_prompt_tokens: cached,
            ..chunk
        })
    })))
}
