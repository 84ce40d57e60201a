//! The decode side of disaggregated serving: a `Generate` that carries a `KvSource`.
//!
//! The prefill worker computes the prompt's blocks and samples the first token. This worker
//! pulls the blocks over the prefill worker's `PullKv` (its own client, so the gateway never
//! relays KV) and imports them chunk by chunk as they arrive (the engine announces them as
//! `Stored` on this worker's event stream and charges each chunk's transfer). With a pipelined
//! source the chunks arrive while the prefill still runs, so each chunk's transfer overlaps the
//! computation of the next and only the last one stays on the critical path; the first token
//! comes with the last chunk. Then it emits the first token and continues generation after it:
//! the engine runs `prompt + [first token]`, whose prompt part is now a prefix hit, for
//! `max_tokens - 1` more tokens. The imported blocks stay held until that continuation has
//! been admitted, so requests queued meanwhile cannot evict them; a pull that fails half way
//! releases them. Counts are rewritten so the client sees one request: prompt tokens of the
//! original prompt, completion tokens including the first. The first chunk carries the prefill
//! worker's KV layout: the import is planned from it (see `kv_layout`), and one of another model
//! shape refuses the request before a block is imported.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt, stream};
use switchyard_core::{BlockHash, BlockSize};
use switchyard_proto::{ErrorCode, v1};
use switchyard_security::Dialer;
use switchyard_telemetry::{WORKER_SPANS, record_error};
use tonic::Status;
use tracing::Instrument;
use tracing::field::Empty;

use crate::engine::{
    Engine, EngineError, FinishReason, GenerateParams, GenerationChunk, HeldBlock, KvImport,
    KvImporter,
};
use crate::metrics::{PullFailure, WorkerMetrics};

/// A failed pull: why (for the metrics) and what the caller is told.
type PullError = (PullFailure, Status);

/// The engine's chunks, whichever path produced them.
pub(crate) type ChunkStream =
    Pin<Box<dyn Stream<Item = Result<GenerationChunk, EngineError>> + Send + 'static>>;

/// Pulls, imports and generates; see the module docs. Pull failures (prefill worker gone or
/// hung, handle expired or already pulled, no chunk within `pull_timeout`) are
/// [`EngineError::KvSource`]: `UNAVAILABLE` marked as the KV source's fault, so the caller can
/// retry with another prefill worker and keep this one; a source whose blocks are not the
/// prompt's, or whose announced layout is another model shape's, is `INVALID_ARGUMENT`.
pub(crate) async fn generate_from_source(
    engine: &dyn Engine,
    params: GenerateParams,
    source: v1::KvSource,
    pull_timeout: Duration,
    metrics: &Arc<WorkerMetrics>,
    dialer: &Dialer,
) -> Result<ChunkStream, Status> {
    // Engines that move KV themselves take the prefill engine's parameters instead of a pull.
    if !source.engine_transfer_params.is_empty() || engine.engine_transfer().is_some() {
        return crate::engine_transfer::generate(engine, params, source, metrics).await;
    }
    let handle = source
        .handle
        .as_ref()
        .map(|h| h.id.clone())
        .filter(|id| !id.is_empty())
        .ok_or_else(|| ErrorCode::InvalidRequest.status("kv_source.handle is missing"))?;
    if source.address.is_empty() {
        return Err(ErrorCode::InvalidRequest.status("kv_source.address is missing"));
    }
    let span = tracing::info_span!(
        target: WORKER_SPANS,
        "transfer",
        source = source.address.as_str(),
        pipelined = source.pipelined,
        blocks = Empty,
        tokens = Empty,
        bytes = Empty,
        descriptors = Empty,
        raw_descriptors = Empty,
        source_tensor_parallel = Empty,
    );
    let expected = params
        .identity
        .block_hashes(&params.prompt, engine.spec().block_size);
    metrics.pull_received();
    let pull_started = tokio::time::Instant::now();
    let failed = |(reason, status): PullError| {
        metrics.pull_failed(reason);
        status
    };
    let importer = engine
        .kv_import()
        .ok_or(EngineError::Unsupported(
            "this engine cannot import KV blocks (disaggregated decode needs the simulator)",
        ))
        .map_err(|e| failed((PullFailure::Import, e.into())))?;
    let mut import = importer
        .start_import()
        .map_err(|e| failed((PullFailure::Import, e.into())))?;
    let end = async {
        let end = pull_and_import(
            engine,
            importer,
            &source.address,
            &handle,
            &expected,
            &mut import,
            pull_timeout,
            dialer,
        )
        .await?;
        import.settle().await;
        Ok::<_, PullError>(end)
    }
    .instrument(span.clone())
    .await
    .map_err(failed)
    .inspect_err(|status| record_error(&span, status.message()))?;
    span.record("blocks", import.imported as i64);
    span.record(
        "tokens",
        import.imported as i64 * i64::from(engine.spec().block_size.get()),
    );
    span.record("bytes", import.stats.bytes as i64);
    span.record("descriptors", import.stats.descriptors as i64);
    span.record("raw_descriptors", import.stats.raw_descriptors as i64);
    if let Some(tp) = import.announced_tensor_parallel() {
        span.record("source_tensor_parallel", i64::from(tp));
    }
    drop(span);
    let (first, cached) = if source.pipelined {
        let first = end.first_token_id.ok_or_else(|| {
            failed((
                PullFailure::Source,
                source_failed(format!(
                    "pulling kv from {}: the pipelined prefill's last chunk carries no first token",
                    source.address
                )),
            ))
        })?;
        (first, end.cached_prompt_tokens)
    } else {
        (source.first_token_id, source.cached_prompt_tokens)
    };
    metrics.import_done(import.imported as u64, import.stats, pull_started.elapsed());
    tracing::info!(
        request = %params.request_id,
        prefill = %source.address,
        pipelined = source.pipelined,
        blocks = import.imported,
        bytes = import.stats.bytes,
        raw_descriptors = import.stats.raw_descriptors,
        coalesced_descriptors = import.stats.descriptors,
        // Absent: the source announced no layout and the configured one was planned from.
        source_tensor_parallel = import.announced_tensor_parallel(),
        "kv imported"
    );

    let prompt_tokens = params.prompt.len() as u32;
    let cached = cached.min(prompt_tokens);
    let chunk = |tokens: Vec<u32>, finish, completion_tokens| GenerationChunk {
        tokens,
        logprobs: Vec::new(),
        finish,
        prompt_tokens,
        cached_prompt_tokens: cached,
        completion_tokens,
    };
    // A stop token ends the request at once and, like any stop token, is not emitted.
    if params.sampling.stop_token_ids.contains(&first)
        && params.sampling.min_tokens.unwrap_or(0) == 0
    {
        return Ok(Box::pin(stream::iter([Ok(chunk(
            Vec::new(),
            Some(FinishReason::Stop),
            0,
        ))])));
    }
    if params.sampling.max_tokens <= 1 {
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
            // The first token is already out: one fewer to generate, and to hold off the end.
            sampling: switchyard_core::Sampling {
                max_tokens: params.sampling.max_tokens - 1,
                min_tokens: params.sampling.min_tokens.map(|m| m.saturating_sub(1)),
                ..params.sampling
            },
            ..params
        })
        .await?;
    // The continuation's first output means it was admitted with its reference on the
    // imported blocks: the import's own hold can go then (or when the stream is dropped).
    let mut held = Some(import);
    let rest = rest.map(move |item| {
        held.take();
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

/// A pull that failed on the prefill side, as the gateway must see it (see
/// [`EngineError::KvSource`]).
fn source_failed(message: String) -> Status {
    Status::from(EngineError::KvSource(message))
}

/// What the last chunk of a pull said.
struct PullEnd {
    first_token_id: Option<u32>,
    cached_prompt_tokens: u32,
}

/// Reads the `PullKv` stream to its last chunk, checking each chunk continues the prompt's
/// blocks and importing it before reading the next. Reading to the end and dropping the
/// stream is what releases the prefill worker's hold on the blocks.
#[allow(clippy::too_many_arguments)]
async fn pull_and_import(
    engine: &dyn Engine,
    importer: &dyn KvImporter,
    address: &str,
    handle: &str,
    expected: &[BlockHash],
    import: &mut KvImport,
    pull_timeout: Duration,
    dialer: &Dialer,
) -> Result<PullEnd, PullError> {
    // What the caller is told names the source and what failed, never what the source (or
    // whatever listens at its address) said: that goes to this worker's log only.
    let unavailable = |what: &str| source_failed(format!("pulling kv from {address}: {what}"));
    let late = || {
        (
            PullFailure::Timeout,
            unavailable(&format!("no answer within {pull_timeout:?}")),
        )
    };
    let source_error = |s: Status| {
        tracing::warn!(source = address, code = ?s.code(), message = s.message(), "kv source refused or broke the pull");
        (
            PullFailure::Source,
            unavailable(&format!("the source answered {:?}", s.code())),
        )
    };
    let endpoint = dialer
        .endpoint(address)
        .map_err(|_| {
            (
                PullFailure::Connect,
                ErrorCode::InvalidRequest.status("kv_source.address is not host:port"),
            )
        })?
        .connect_timeout(pull_timeout.min(Duration::from_secs(2)));
    let channel = dialer.connect(endpoint).await.map_err(|e| {
        tracing::warn!(source = address, error = %e, "cannot connect to the kv source");
        (PullFailure::Connect, unavailable("cannot connect"))
    })?;
    let mut client =
        v1::worker_client::WorkerClient::new(channel).max_decoding_message_size(256 * 1024 * 1024);
    let mut request = tonic::Request::new(v1::PullKvRequest {
        handle: Some(v1::KvHandle {
            id: handle.to_owned(),
        }),
        blocks_per_chunk: 0,
    });
    // This runs in the `transfer` span: the prefill worker's `serve_pull` becomes its child.
    switchyard_telemetry::inject_context(&tracing::Span::current(), request.metadata_mut());
    let call = client.pull_kv(request);
    let mut chunks = tokio::time::timeout(pull_timeout, call)
        .await
        .map_err(|_| late())?
        .map_err(source_error)?
        .into_inner();
    let mut next_block = 0usize;
    loop {
        // The timeout is per chunk: a long pipelined prefill may take minutes in all, but a
        // prefill worker that stops sending (hung, or its host gone) fails the pull in time.
        let chunk = match tokio::time::timeout(pull_timeout, chunks.next()).await {
            Err(_) => return Err(late()),
            Ok(None) => {
                return Err((
                    PullFailure::Truncated,
                    unavailable("stream ended before the last chunk"),
                ));
            }
            Ok(Some(Err(s))) => return Err(source_error(s)),
            Ok(Some(Ok(chunk))) => chunk,
        };
        let blocks: Vec<HeldBlock> = chunk
            .blocks
            .into_iter()
            .map(|b| HeldBlock {
                hash: BlockHash(b.hash),
                tokens: b.token_ids,
            })
            .collect();
        // The layout comes on the first chunk; a newer source might repeat it, which is
        // harmless as long as it still fits.
        if let (Some(announced), Some(own)) = (&chunk.layout, engine.kv_layout()) {
            let source =
                crate::kv_layout::accept(announced, &own, engine.spec().block_size.get(), address)
                    .map_err(|s| (PullFailure::Layout, s))?;
            import.plan_from(source);
        }
        check_continues(
            &blocks,
            chunk.first_block as usize,
            next_block,
            expected,
            engine.spec().block_size,
        )
        .map_err(|s| (PullFailure::Mismatch, s))?;
        next_block += blocks.len();
        importer
            .import_kv(import, blocks)
            .await
            .map_err(|e| (PullFailure::Import, e.into()))?;
        if chunk.last {
            return Ok(PullEnd {
                first_token_id: chunk.first_token_id,
                cached_prompt_tokens: chunk.cached_prompt_tokens,
            });
        }
    }
}

/// Each chunk must continue where the previous one ended with the prompt's next full blocks
/// under this worker's block size; anything else (a wrong handle, a prefill worker with another
/// block size) would put foreign KV under the prompt's hashes.
fn check_continues(
    blocks: &[HeldBlock],
    first_block: usize,
    next_block: usize,
    expected: &[BlockHash],
    block_size: BlockSize,
) -> Result<(), Status> {
    let matches = first_block == next_block
        && expected
            .get(next_block..next_block + blocks.len())
            .is_some_and(|want| blocks.iter().zip(want).all(|(b, h)| b.hash == *h));
    if matches {
        Ok(())
    } else {
        Err(ErrorCode::InvalidRequest.status(format!(
            "kv_source blocks {first_block}..{} are not the prompt's blocks {next_block}.. under block size {}",
            first_block + blocks.len(),
            block_size.get()
        )))
    }
}
