//! Measuring a [`PerformanceProfile`] against a live worker over gRPC `Generate`
//! (`switchyard planner profile --worker host:port --out profile.json`).
//!
//! - **Prefill**: for each input length, a fresh prompt (no prefix cache hit) with
//!   `max_tokens = 1`; the time to the first streamed token is the prefill time. The median of
//!   `repeats` runs is kept.
//! - **Decode**: for each (context, concurrency), that many fresh prompts of that length decode
//!   `decode_tokens` tokens together; the inter-token latency is measured over the second half
//!   of each stream (when every prompt of the batch has been prefilled) and averaged.
//!
//! Prompts are pseudo-random token ids below 30,000, valid in any common vocabulary, and differ
//! between requests so no request hits another's cache. Measure an idle worker: other traffic
//! shows up in the figures.

use futures::StreamExt;
use switchyard_core::rng::SplitMix64;
use switchyard_proto::v1;
use switchyard_security::AuthChannel;
use tokio::time::Instant;

use crate::observe::worker_endpoint;
use crate::profile::{DecodePoint, PerformanceProfile, PrefillPoint};

/// Why a measurement failed.
#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    #[error("worker address {0:?} is not a valid host:port")]
    Address(String),
    #[error("cannot connect to worker {address}: {source}")]
    Connect {
        address: String,
        source: switchyard_security::SecurityError,
    },
    #[error("worker refused a measurement request: {0}")]
    Refused(String),
    #[error("no measurement succeeded (every shape exceeded the worker's context?)")]
    Empty,
}

/// The shapes to measure.
#[derive(Debug, Clone)]
pub struct MeasureSettings {
    pub prefill_lengths: Vec<u64>,
    pub decode_contexts: Vec<u64>,
    pub decode_concurrency: Vec<u64>,
    pub decode_tokens: u32,
    pub repeats: u32,
    /// How the worker is dialed: measuring sends `Generate`, which a secured worker takes from
    /// gateways only, so this carries a gateway's credential there.
    pub dialer: switchyard_security::Dialer,
}

impl Default for MeasureSettings {
    fn default() -> Self {
        Self {
            prefill_lengths: vec![256, 1024, 4096, 8192],
            decode_contexts: vec![512, 2048, 8192],
            decode_concurrency: vec![1, 8, 32, 64],
            decode_tokens: 64,
            repeats: 3,
            dialer: switchyard_security::Dialer::open(switchyard_security::Identity::new(
                "default",
                switchyard_security::PeerRole::Gateway,
            )),
        }
    }
}

/// Fresh, distinct prompts.
#[derive(Debug)]
struct Prompts {
    rng: SplitMix64,
}

impl Prompts {
    fn next(&mut self, len: u64) -> Vec<u32> {
        (0..len)
            .map(|_| {
                // SplitMix64: cheap, and no two prompts share a leading block.
                100 + (self.rng.next_u64() % 29_900) as u32
            })
            .collect()
    }
}

/// Token arrival times of one generation.
async fn generate(
    channel: AuthChannel,
    prompt: Vec<u32>,
    max_tokens: u32,
    id: String,
) -> Result<Vec<Instant>, tonic::Status> {
    let mut client = v1::worker_client::WorkerClient::new(channel);
    let mut stream = client
        .generate(v1::GenerateRequest {
            request_id: id,
            prompt_token_ids: prompt,
            sampling: Some(v1::SamplingParams {
                max_tokens,
                temperature: Some(0.0),
                ignore_eos: true,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut times = Vec::new();
    while let Some(message) = stream.next().await {
        let message = message?;
        let now = Instant::now();
        times.extend(message.token_ids.iter().map(|_| now));
    }
    Ok(times)
}

/// Measures the worker at `address`; `progress` hears about each point as it is measured.
pub async fn measure(
    address: &str,
    settings: &MeasureSettings,
    mut progress: impl FnMut(&str),
) -> Result<PerformanceProfile, MeasureError> {
    let dialer = &settings.dialer;
    let endpoint = worker_endpoint(dialer, address)
        .ok_or_else(|| MeasureError::Address(address.to_owned()))?;
    let channel = dialer
        .connect(endpoint)
        .await
        .map_err(|source| MeasureError::Connect {
            address: address.to_owned(),
            source,
        })?;
    let mut prompts = Prompts {
        rng: SplitMix64::new(0x5157),
    };
    let mut seq = 0u64;
    let mut next_id = || {
        seq += 1;
        format!("profile-{seq}")
    };
    let mut prefill = Vec::new();
    for &len in &settings.prefill_lengths {
        let mut samples = Vec::new();
        for _ in 0..settings.repeats.max(1) {
            let start = Instant::now();
            match generate(channel.clone(), prompts.next(len), 1, next_id()).await {
                Ok(times) if !times.is_empty() => {
                    samples.push(times[0].duration_since(start).as_secs_f64())
                }
                Ok(_) => {}
                Err(status) if status.code() == tonic::Code::InvalidArgument => break,
                Err(status) => return Err(MeasureError::Refused(status.message().to_owned())),
            }
        }
        if samples.is_empty() {
            progress(&format!("prefill {len} tokens: skipped (refused)"));
            continue;
        }
        samples.sort_by(f64::total_cmp);
        let seconds = samples[samples.len() / 2];
        progress(&format!("prefill {len} tokens: {:.1} ms", seconds * 1e3));
        prefill.push(PrefillPoint {
            input_tokens: len,
            seconds,
        });
    }
    let mut decode = Vec::new();
    let tokens = settings.decode_tokens.max(4);
    for &context in &settings.decode_contexts {
        for &batch in &settings.decode_concurrency {
            let runs = (0..batch.max(1))
                .map(|_| generate(channel.clone(), prompts.next(context), tokens, next_id()));
            let results = futures::future::join_all(runs.collect::<Vec<_>>()).await;
            let mut itls = Vec::new();
            for result in results {
                match result {
                    Ok(times) if times.len() >= 4 => {
                        let tail = &times[times.len() / 2..];
                        let span = tail[tail.len() - 1].duration_since(tail[0]);
                        itls.push(span.as_secs_f64() / (tail.len() - 1) as f64);
                    }
                    Ok(_) => {}
                    Err(status) if status.code() == tonic::Code::InvalidArgument => {}
                    Err(status) => return Err(MeasureError::Refused(status.message().to_owned())),
                }
            }
            if itls.is_empty() {
                progress(&format!(
                    "decode {batch} x {context} tokens: skipped (refused)"
                ));
                continue;
            }
            let itl = itls.iter().sum::<f64>() / itls.len() as f64;
            progress(&format!(
                "decode {batch} x {context} tokens: ITL {:.2} ms",
                itl * 1e3
            ));
            decode.push(DecodePoint {
                concurrency: batch,
                context_tokens: context,
                // A profile refuses zero: a clock too coarse to see the gap still means "fast".
                itl_seconds: itl.max(1e-9),
            });
        }
    }
    if prefill.is_empty() || decode.is_empty() {
        return Err(MeasureError::Empty);
    }
    Ok(PerformanceProfile {
        version: PerformanceProfile::VERSION,
        source: format!("measured against {address}"),
        prefill,
        decode,
    })
}
