//! The decode side of disaggregated serving: a `Generate` that carries a `KvSource`.
//!
//! The prefill worker already computed the prompt's blocks and sampled the first token. This
//! worker pulls the blocks over the prefill worker's `PullKv` (its own client, so the gateway
//! never relays KV), imports them into its engine (which announces them as `Stored` on this
//! worker's event stream and charges the transfer), emits the prefill's first token, and
//! continues generation after it: the engine runs `prompt + [first token]`, whose prompt part is
//! now a prefix hit, for `max_tokens - 1` more tokens. Counts are rewritten so the client sees
//! one request: prompt tokens of the original prompt, completion tokens including the first.

use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt, stream};
use switchyard_core::{BlockSize, block_hashes};
use switchyard_proto::v1;
use switchyard_telemetry::{WORKER_SPANS, record_error};
use tonic::Status;
use tonic::transport::Endpoint;
use tracing::Instrument;
use tracing::field::Empty;

use crate::engine::pd::moves_kv_itself;
use crate::engine::{
    Engine, EngineError, FinishReason, GenerateParams, GenerationChunk, HeldBlock,
};

/// The engine's chunks, whichever path produced them.
pub(crate) type ChunkStream =
    Pin<Box<dyn Stream<Item = Result<GenerationChunk, EngineError>> + Send + 'static>>;

/// Pulls, imports and generates; see the module docs. Pull failures (prefill worker gone,
/// handle expired or already pulled, timeout) are `UNAVAILABLE` so the caller can retry
/// elsewhere; a source whose blocks are not the prompt's is `INVALID_ARGUMENT`.
pub(crate) async fn generate_from_source(
    engine: &dyn Engine,
    params: GenerateParams,
    source: v1::KvSource,
    pull_timeout: Duration,
) -> Result<ChunkStream, Status> {
    // Engines that move KV themselves take the prefill engine's parameters instead of a pull.
    if !source.engine_transfer_params.is_empty() || moves_kv_itself(engine.spec().kind) {
        return crate::engine_transfer::generate(engine, params, source).await;
    }
    let handle = source
        .handle
        .map(|h| h.id)
        .filter(|id| !id.is_empty())
        .ok_or_else(|| Status::invalid_argument("kv_source.handle is missing"))?;
    if source.address.is_empty() {
        return Err(Status::invalid_argument("kv_source.address is missing"));
    }
    let span = tracing::info_span!(
        target: WORKER_SPANS,
        "transfer",
        source = source.address.as_str(),
        blocks = Empty,
        tokens = Empty,
        bytes = Empty,
    );
    transfer(
        engine,
        &source.address,
        &handle,
        &params.prompt,
        pull_timeout,
    )
    .instrument(span.clone())
    .await
    .inspect_err(|status| record_error(&span, status.message()))?;
    drop(span);

    let prompt_tokens = params.prompt.len() as u32;
    let cached = source.cached_prompt_tokens.min(prompt_tokens);
    let first = source.first_token_id;
    let chunk = |tokens: Vec<u32>, finish, completion_tokens| GenerationChunk {
        tokens,
        finish,
        prompt_tokens,
        cached_prompt_tokens: cached,
        completion_tokens,
    };
    // A stop token ends the request at once and, like any stop token, is not emitted.
    if params.stop_token_ids.contains(&first) {
        return Ok(Box::pin(stream::iter([Ok(chunk(
            Vec::new(),
            Some(FinishReason::Stop),
            0,
        ))])));
    }
    if params.max_tokens <= 1 {
        return Ok(Box::pin(stream::iter([Ok(chunk(
            vec![first],
            Some(FinishReason::Length),
            1,
        ))])));
    }
    let mut prompt = params.prompt;
    prompt.push(first);
    let rest = engine
        .generate(GenerateParams {
            prompt,
            max_tokens: params.max_tokens - 1,
            ..params
        })
        .await?;
    let rest = rest.map(move |item| {
        item.map(|c| GenerationChunk {
            prompt_tokens,
            cached_prompt_tokens: cached,
            completion_tokens: c.completion_tokens + 1,
            ..c
        })
    });
    let head = stream::iter([Ok(chunk(vec![first], None, 1))]);
    Ok(Box::pin(head.chain(rest)))
}

/// The KV transfer of one request, in its `transfer` span: pull the blocks from the prefill
/// worker, check they are the prompt's, import them into the engine.
async fn transfer(
    engine: &dyn Engine,
    address: &str,
    handle: &str,
    prompt: &[u32],
    pull_timeout: Duration,
) -> Result<(), Status> {
    let blocks = tokio::time::timeout(pull_timeout, pull(address, handle))
        .await
        .map_err(|_| {
            Status::unavailable(format!(
                "pulling kv handle {handle} from {address} timed out after {pull_timeout:?}"
            ))
        })??;
    check_prefix(&blocks, prompt, engine.spec().block_size)?;
    let tokens: u64 = blocks.iter().map(|b| b.tokens.len() as u64).sum();
    let span = tracing::Span::current();
    span.record("blocks", blocks.len() as i64);
    span.record("tokens", tokens as i64);
    span.record(
        "bytes",
        tokens.saturating_mul(engine.spec().kv_bytes_per_token) as i64,
    );
    engine.import_kv(blocks).await?;
    Ok(())
}

/// Reads the whole `PullKv` stream. Reading to the end and dropping the stream is what
/// releases the prefill worker's hold on the blocks.
async fn pull(address: &str, handle: &str) -> Result<Vec<HeldBlock>, Status> {
    let unavailable =
        |what: String| Status::unavailable(format!("pulling kv from {address}: {what}"));
    let url = if address.starts_with("http://") || address.starts_with("https://") {
        address.to_owned()
    } else {
        format!("http://{address}")
    };
    let channel = Endpoint::from_shared(url)
        .map_err(|e| Status::invalid_argument(format!("kv_source.address {address:?}: {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    let mut client =
        v1::worker_client::WorkerClient::new(channel).max_decoding_message_size(256 * 1024 * 1024);
    let mut chunks = client
        .pull_kv(v1::PullKvRequest {
            handle: Some(v1::KvHandle {
                id: handle.to_owned(),
            }),
            blocks_per_chunk: 0,
        })
        .await
        .map_err(|s| unavailable(format!("{:?}: {}", s.code(), s.message())))?
        .into_inner();
    let mut blocks = Vec::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|s| unavailable(format!("{:?}: {}", s.code(), s.message())))?;
        blocks.extend(chunk.blocks.into_iter().map(|b| HeldBlock {
            hash: switchyard_core::BlockHash(b.hash),
            tokens: b.token_ids,
        }));
        if chunk.last {
            return Ok(blocks);
        }
    }
    Err(unavailable("stream ended before the last chunk".into()))
}

/// The pulled blocks must be the leading full blocks of this prompt under this worker's block
/// size; anything else (a wrong handle, a prefill worker with another block size) would put
/// foreign KV under the prompt's hashes.
fn check_prefix(blocks: &[HeldBlock], prompt: &[u32], block_size: BlockSize) -> Result<(), Status> {
    let expected = block_hashes(prompt, block_size);
    let matches =
        blocks.len() <= expected.len() && blocks.iter().zip(&expected).all(|(b, h)| b.hash == *h);
    if matches {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "kv_source blocks ({}) are not the prompt's leading blocks under block size {}",
            blocks.len(),
            block_size.get()
        )))
    }
}
