//! What the planner sees each interval: the gateways' traffic figures (scraped from their
//! `/metrics`) and every worker's load (one report from its `LoadStats` stream).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde::Serialize;
use switchyard_core::{LoadStats, Role, WorkerId, WorkerInfo};
use switchyard_proto::v1;
use switchyard_registry::Registry;
use switchyard_security::{AuthChannel, Dialer};
use tokio::time::Instant;

use crate::predict::Load;
use crate::promtext::Scrape;

/// How long one gateway scrape or one worker report may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// One interval's observation.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Observation {
    /// Seconds the figures cover (since the previous observation).
    pub seconds: f64,
    pub load: Load,
    /// Requests completed in the interval.
    pub requests: f64,
    /// Requests waiting for admission plus being served, summed over the gateways.
    pub queue_depth: f64,
    /// Prompt and output length distribution of the interval's requests (tokens).
    pub input_tokens_p50: Option<f64>,
    pub input_tokens_p99: Option<f64>,
    pub output_tokens_p50: Option<f64>,
    pub output_tokens_p99: Option<f64>,
    pub ttft_p50_seconds: Option<f64>,
    pub ttft_p99_seconds: Option<f64>,
    pub itl_p50_seconds: Option<f64>,
    pub itl_p99_seconds: Option<f64>,
    /// Mean TTFT and ITL of the interval (histogram sum over count): what the profile
    /// correction compares with the profile's prediction.
    pub ttft_mean_seconds: Option<f64>,
    pub itl_mean_seconds: Option<f64>,
    pub gateways_answered: usize,
    pub gateways_failed: usize,
    pub workers: WorkerFigures,
}

/// The workers' reports, summed per pool.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WorkerFigures {
    pub prefill: u32,
    pub decode: u32,
    pub both: u32,
    pub draining: u32,
    pub unreachable: u32,
    pub queued_prefill_tokens: u64,
    /// Prefill tokens queued on the prefill pool's workers alone.
    pub prefill_pool_queued_tokens: u64,
    pub active_decode_sequences: u64,
    pub running_requests: u64,
}

/// A worker as last seen.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSnapshot {
    pub info: WorkerInfo,
    pub load: Option<LoadStats>,
    pub draining: bool,
}

/// The latest snapshot of every worker, shared with the local connector so it can move the
/// least busy workers.
pub type WorkerBoard = Arc<Mutex<BTreeMap<WorkerId, WorkerSnapshot>>>;

/// Scrapes gateways and polls workers.
#[derive(Debug)]
pub struct Observer {
    gateways: Vec<String>,
    http: reqwest::Client,
    registry: Arc<dyn Registry>,
    board: WorkerBoard,
    channels: BTreeMap<String, AuthChannel>,
    last: Option<(Instant, BTreeMap<String, Scrape>)>,
    dialer: Dialer,
    /// Sent as a bearer token to the gateways' `/metrics`.
    metrics_token: Option<String>,
}

impl Observer {
    pub fn new(gateways: Vec<String>, registry: Arc<dyn Registry>, board: WorkerBoard) -> Self {
        Self {
            gateways: gateways
                .into_iter()
                .map(|g| g.trim_end_matches('/').to_owned())
                .collect(),
            http: reqwest::Client::builder()
                .timeout(PROBE_TIMEOUT)
                .build()
                .unwrap_or_default(),
            registry,
            board,
            channels: BTreeMap::new(),
            last: None,
            dialer: open_dialer(),
            metrics_token: None,
        }
    }

    /// The same observer, reading `https://` gateways with `tls` (trusting their CA).
    pub fn with_gateway_tls(mut self, tls: rustls::ClientConfig) -> Self {
        match reqwest::Client::builder()
            .timeout(PROBE_TIMEOUT)
            .use_preconfigured_tls(tls)
            .build()
        {
            Ok(http) => self.http = http,
            // Only a TLS backend missing from the build fails here, never input.
            Err(err) => tracing::error!(error = %err, "cannot set up HTTPS toward the gateways"),
        }
        self
    }

    /// The same observer, reading gateways' `/metrics` with `token`.
    pub fn with_metrics_token(mut self, token: Option<String>) -> Self {
        self.metrics_token = token;
        self
    }

    /// The same observer, dialing workers with `dialer`.
    pub fn with_dialer(mut self, dialer: Dialer) -> Self {
        self.dialer = dialer;
        self
    }

    pub fn set_gateways(&mut self, gateways: Vec<String>) {
        self.gateways = gateways
            .into_iter()
            .map(|g| g.trim_end_matches('/').to_owned())
            .collect();
        self.last = None;
    }

    /// Observes once. The first call only sets the baseline for the gateway counters, so its
    /// traffic figures are zero (`seconds == 0`).
    pub async fn observe(&mut self) -> Observation {
        let now = Instant::now();
        let scrapes = self.scrape_gateways().await;
        let mut obs = Observation {
            gateways_answered: scrapes.len(),
            gateways_failed: self.gateways.len().saturating_sub(scrapes.len()),
            ..Observation::default()
        };
        let mut gauges = Scrape::default();
        for scrape in scrapes.values() {
            gauges.add(scrape);
        }
        obs.queue_depth = gauges.value("switchyard_requests_queued")
            + gauges.value("switchyard_requests_in_flight");
        if let Some((then, previous)) = &self.last {
            let mut delta = Scrape::default();
            for (url, scrape) in &scrapes {
                // A gateway that did not answer last time has no baseline yet.
                if let Some(before) = previous.get(url) {
                    delta.add(&scrape.since(before));
                }
            }
            obs.seconds = now.saturating_duration_since(*then).as_secs_f64();
            fill_traffic(&mut obs, &delta);
        }
        // Keep the baseline of a gateway that failed this time, so its next delta is whole.
        let mut baseline = self.last.take().map(|(_, s)| s).unwrap_or_default();
        baseline.extend(scrapes);
        self.last = Some((now, baseline));
        obs.workers = self.poll_workers().await;
        obs
    }

    async fn scrape_gateways(&self) -> BTreeMap<String, Scrape> {
        let fetches = self.gateways.iter().map(|url| async move {
            let text = async {
                let request = self.http.get(format!("{url}/metrics"));
                let request = match &self.metrics_token {
                    Some(token) => request.bearer_auth(token),
                    None => request,
                };
                request
                    .send()
                    .await?
                    .error_for_status()?
                    .text()
                    .await
            }
            .await;
            match text {
                Ok(text) => Some((url.clone(), Scrape::parse(&text))),
                Err(err) => {
                    tracing::warn!(gateway = %url, error = %err, "cannot scrape the gateway's metrics");
                    None
                }
            }
        });
        futures::future::join_all(fetches)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    async fn poll_workers(&mut self) -> WorkerFigures {
        let workers = match self.registry.list_workers().await {
            Ok(workers) => workers,
            Err(err) => {
                tracing::warn!(error = %err, "cannot list the workers");
                return WorkerFigures::default();
            }
        };
        let probes = workers.into_iter().map(|info| {
            let channel = self.channel(&info.address);
            async move {
                let load = match channel {
                    Some(channel) => one_report(channel).await,
                    None => None,
                };
                (info, load)
            }
        });
        let results = futures::future::join_all(probes.collect::<Vec<_>>()).await;
        let mut figures = WorkerFigures::default();
        let mut board = BTreeMap::new();
        for (info, report) in results {
            let (role, draining, load) = match &report {
                Some((load, role, draining)) => (*role, *draining, Some(*load)),
                None => {
                    figures.unreachable += 1;
                    (info.role, false, None)
                }
            };
            match role {
                Role::Prefill => figures.prefill += 1,
                Role::Decode => figures.decode += 1,
                Role::Both => figures.both += 1,
            }
            figures.draining += u32::from(draining);
            if let Some(load) = &load {
                figures.queued_prefill_tokens += load.queued_prefill_tokens;
                if role == Role::Prefill {
                    figures.prefill_pool_queued_tokens += load.queued_prefill_tokens;
                }
                figures.active_decode_sequences += load.active_decode_sequences;
                figures.running_requests += load.running_requests;
            }
            board.insert(
                info.id.clone(),
                WorkerSnapshot {
                    info,
                    load,
                    draining,
                },
            );
        }
        self.channels
            .retain(|addr, _| board.values().any(|w| &w.info.address == addr));
        *self.board.lock().unwrap_or_else(|p| p.into_inner()) = board;
        figures
    }

    fn channel(&mut self, address: &str) -> Option<AuthChannel> {
        if let Some(channel) = self.channels.get(address) {
            return Some(channel.clone());
        }
        let channel = self.dialer.lazy(worker_endpoint(&self.dialer, address)?);
        self.channels.insert(address.to_owned(), channel.clone());
        Some(channel)
    }
}

/// A dialer of an open cluster (the planner's default until it is given its own).
pub fn open_dialer() -> Dialer {
    Dialer::open(switchyard_security::Identity::new(
        "default",
        switchyard_security::PeerRole::Planner,
    ))
}

/// The gRPC endpoint of a worker address (`host:port`).
pub fn worker_endpoint(dialer: &Dialer, address: &str) -> Option<tonic::transport::Endpoint> {
    match dialer.endpoint(address) {
        Ok(endpoint) => Some(endpoint.connect_timeout(PROBE_TIMEOUT).tcp_nodelay(true)),
        Err(err) => {
            tracing::warn!(address, error = %err, "worker address is not a valid endpoint");
            None
        }
    }
}

/// The first report of a worker's load stream, with the role and drain state it carries.
async fn one_report(channel: AuthChannel) -> Option<(LoadStats, Role, bool)> {
    let mut client = v1::worker_client::WorkerClient::new(channel);
    let fetch = async {
        let mut stream = client
            .load_stats(v1::LoadStatsRequest {
                interval_ms: 1000,
                push_min_interval_ms: 0,
            })
            .await
            .ok()?
            .into_inner();
        let report = stream.next().await?.ok()?;
        let role = switchyard_proto::convert::role_from_wire(report.role).ok()?;
        Some((LoadStats::from(&report), role, report.draining))
    };
    tokio::time::timeout(PROBE_TIMEOUT, fetch)
        .await
        .ok()
        .flatten()
}

fn fill_traffic(obs: &mut Observation, delta: &Scrape) {
    let requests = delta.value("switchyard_request_prompt_tokens_count");
    obs.requests = requests;
    if obs.seconds > 0.0 {
        obs.load.request_rate = requests / obs.seconds;
    }
    if requests > 0.0 {
        let prompt = delta.value("switchyard_request_prompt_tokens_sum");
        obs.load.input_tokens = prompt / requests;
        obs.load.output_tokens = delta.value("switchyard_request_completion_tokens_sum") / requests;
        if prompt > 0.0 {
            obs.load.cache_hit_rate =
                (delta.value("switchyard_cached_prompt_tokens_total") / prompt).clamp(0.0, 1.0);
        }
    }
    let input = "switchyard_request_prompt_tokens";
    let output = "switchyard_request_completion_tokens";
    obs.input_tokens_p50 = delta.quantile(input, 0.5);
    obs.input_tokens_p99 = delta.quantile(input, 0.99);
    obs.output_tokens_p50 = delta.quantile(output, 0.5);
    obs.output_tokens_p99 = delta.quantile(output, 0.99);
    let ttft = "switchyard_time_to_first_token_seconds";
    let itl = "switchyard_inter_token_latency_seconds";
    obs.ttft_p50_seconds = delta.quantile(ttft, 0.5);
    obs.ttft_p99_seconds = delta.quantile(ttft, 0.99);
    obs.itl_p50_seconds = delta.quantile(itl, 0.5);
    obs.itl_p99_seconds = delta.quantile(itl, 0.99);
    obs.ttft_mean_seconds = mean(delta, ttft);
    obs.itl_mean_seconds = mean(delta, itl);
}

/// A histogram's mean over the interval; `None` without observations.
fn mean(delta: &Scrape, histogram: &str) -> Option<f64> {
    let count = delta.value(&format!("{histogram}_count"));
    let sum = delta.value(&format!("{histogram}_sum"));
    (count > 0.0 && sum.is_finite() && sum >= 0.0).then(|| sum / count)
}
