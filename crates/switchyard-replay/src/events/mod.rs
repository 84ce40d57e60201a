//! KV-event replay: a gateway recording (`docs/kv-recording.md`) replayed against several
//! routing policies side by side.
//!
//! The recording holds every input the live router saw, in the order it applied them. Replay
//! rebuilds one [`PrefixIndex`] per model from the recorded events and snapshots (the workers'
//! real cache state, shared by every policy), and gives each policy its own lane
//! ([`lane::Lane`]): a serving core — the one the live gateway runs — fed the recorded load
//! reports and the in-flight bookkeeping of the policy's *own* bookings. At each recorded
//! routing request every lane serves the request with [`ServingCore::serve`] under the
//! recorded serving settings (disaggregation mode and thresholds), over the recorded decode
//! candidates and prefill pool; the report says how often it agreed with the live decision
//! (decode worker, serving mode, prefill worker), how many prompt blocks its choice had cached
//! (a prediction against the real caches: a policy that routed differently would, over time,
//! have built different caches, which a recording cannot show) and how evenly it spread the
//! requests. Policies that sample are seeded, so the same file and seed give the same report.
//!
//! [`ServingCore::serve`]: switchyard_router::serve::ServingCore::serve

mod lane;
mod report;

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use switchyard_core::{BlockSize, EngineKind, Role, WorkerId, WorkerInfo};
use switchyard_router::serve::{Disaggregation, ServeSettings, WorkerFacts};
use switchyard_router::{
    ApplyOutcome, IndexConfig, PolicyConfig, PolicyKind, PrefixIndex, RouteRequest,
};

use crate::error::ReplayError;
use crate::events_filter::RouteFilter;
use lane::{Lane, Outcome};
use report::Tally;
pub use report::{EventsReport, IndexCounts, PolicyReport};

/// The format name a recording's header must carry, and the newest version read.
pub use switchyard_router::recording::{FORMAT, MIN_VERSION, VERSION};
use switchyard_router::recording::{Record as Line, RouteRecord};

#[derive(Debug)]
struct ModelState {
    index: PrefixIndex,
    /// The model's workers as registered (role and engine decide the serving core's
    /// candidates).
    workers: BTreeMap<WorkerId, WorkerInfo>,
    lanes: Vec<Lane>,
}

struct Replayer {
    kinds: Vec<PolicyKind>,
    settings: PolicyConfig,
    serve: ServeSettings,
    models: BTreeMap<String, ModelState>,
    tallies: Vec<Tally>,
    live: Tally,
    counts: IndexCounts,
    filter: RouteFilter,
}

impl Replayer {
    fn model(&mut self, name: &str, block_size: BlockSize) -> Result<&mut ModelState, ReplayError> {
        if !self.models.contains_key(name) {
            let mut lanes = Vec::with_capacity(self.kinds.len());
            for kind in &self.kinds {
                lanes.push(
                    Lane::new(*kind, &self.settings, block_size)
                        .map_err(|e| ReplayError::InvalidConfig(e.to_string()))?,
                );
            }
            let state = ModelState {
                index: PrefixIndex::new(IndexConfig::new(block_size)),
                workers: BTreeMap::new(),
                lanes,
            };
            self.models.insert(name.to_owned(), state);
        }
        self.models
            .get_mut(name)
            .ok_or_else(|| ReplayError::InvalidConfig(format!("model {name} vanished")))
    }

    fn joined(&mut self, worker: WorkerInfo) -> Result<(), ReplayError> {
        let model = self.model(&worker.model, worker.block_size)?;
        model.workers.insert(worker.id.clone(), worker);
        Ok(())
    }

    fn lanes(&mut self, model: &str, mut each: impl FnMut(&mut Lane)) {
        if let Some(m) = self.models.get_mut(model) {
            m.lanes.iter_mut().for_each(&mut each);
        }
    }

    fn apply(&mut self, line: Line) -> Result<(), ReplayError> {
        match line {
            Line::Header(_) | Line::Trailer { .. } => {}
            Line::WorkerJoined { worker, .. } => self.joined(worker)?,
            Line::WorkerLeft { model, worker, .. } => {
                if let Some(m) = self.models.get_mut(&model) {
                    m.index.remove_worker(&worker);
                    m.workers.remove(&worker);
                    for lane in &mut m.lanes {
                        lane.remove_worker(&worker);
                    }
                }
            }
            Line::Snapshot {
                model,
                worker,
                incarnation,
                next_seq,
                blocks,
                ..
            } => {
                if let Some(m) = self.models.get_mut(&model) {
                    match m
                        .index
                        .apply_snapshot(&worker, incarnation, next_seq, &blocks)
                    {
                        Ok(()) => self.counts.snapshots += 1,
                        Err(_) => self.counts.invalid += 1,
                    }
                }
            }
            Line::KvEvent {
                model,
                worker,
                incarnation,
                seq,
                event,
                ..
            } => {
                if let Some(m) = self.models.get_mut(&model) {
                    match m.index.apply(&worker, incarnation, seq, &event) {
                        Ok(ApplyOutcome::Applied) => self.counts.applied += 1,
                        Ok(ApplyOutcome::Stale { .. }) => self.counts.stale += 1,
                        Ok(ApplyOutcome::ResyncNeeded { .. }) => self.counts.gaps += 1,
                        Err(_) => self.counts.invalid += 1,
                    }
                }
            }
            Line::IndexDropped { model, worker, .. } => {
                if let Some(m) = self.models.get_mut(&model) {
                    m.index.remove_worker(&worker);
                }
            }
            Line::Load {
                tick,
                model,
                worker,
                stats,
            } => self.lanes(&model, |lane| lane.load_report(&worker, stats, tick)),
            Line::Route(record) => self.route(&record)?,
            Line::PrefillDone { model, key, .. } => self.lanes(&model, |l| l.prefill_done(key)),
            Line::Finished { model, key, .. } => self.lanes(&model, |l| l.finished(key)),
            Line::PrefillFailed { model, key, .. } => self.lanes(&model, |l| l.prefill_failed(key)),
        }
        Ok(())
    }

    fn route(&mut self, record: &RouteRecord) -> Result<(), ReplayError> {
        let block_size = BlockSize::new(record.block_size)
            .map_err(|e| ReplayError::InvalidConfig(e.to_string()))?;
        let request = RouteRequest {
            block_hashes: record.block_hashes.clone(),
            prompt_tokens: record.prompt_tokens,
            block_size,
            session: record.session.clone(),
            now: record.tick,
            // The recorded candidates were filtered live (adapter included).
            adapter: None,
        };
        // An attempt that could not use the prefill pool (a migration, log probabilities, or
        // disaggregation off) is served aggregated, as it was live.
        let settings = if record.prefill_pool {
            self.serve
        } else {
            ServeSettings {
                disaggregation: Disaggregation::Off,
                ..self.serve
            }
        };
        let counted = self.filter.matches(record);
        if counted {
            self.live.add(record, &Outcome::live(record));
        }
        let model = self.model(&record.model, block_size)?;
        let workers = worker_facts(record, &model.workers);
        let mut outcomes = Vec::with_capacity(model.lanes.len());
        for lane in &mut model.lanes {
            outcomes.push(
                lane.serve(&mut model.index, &settings, record, &request, &workers)
                    .ok(),
            );
        }
        for (tally, outcome) in self.tallies.iter_mut().zip(outcomes).filter(|_| counted) {
            match outcome {
                Some(outcome) => tally.add(record, &outcome),
                None => tally.failures += 1,
            }
        }
        Ok(())
    }
}

/// The workers a recorded request is served over, in the live gateway's order: its decode
/// candidates, then its prefill pool — the live one when the gateway consulted it, otherwise
/// the model's registered prefill workers (a policy may want the pool where the live one did
/// not).
fn worker_facts<'a>(
    record: &'a RouteRecord,
    known: &'a BTreeMap<WorkerId, WorkerInfo>,
) -> Vec<WorkerFacts<'a>> {
    let facts = |id: &'a WorkerId, fallback: Role| {
        let (role, engine, adapters) = known
            .get(id)
            .map_or((fallback, EngineKind::Sim, &[][..]), |w| {
                (w.role, w.engine, &w.adapters[..])
            });
        WorkerFacts {
            id,
            role,
            engine,
            draining: false,
            adapters,
        }
    };
    let mut workers: Vec<WorkerFacts<'a>> = record
        .candidates
        .iter()
        .map(|id| facts(id, Role::Both))
        .collect();
    match &record.prefill {
        Some(prefill) => {
            workers.extend(prefill.candidates.iter().map(|id| facts(id, Role::Prefill)))
        }
        None => workers.extend(
            known
                .values()
                .filter(|w| w.role == Role::Prefill)
                .map(|w| facts(&w.id, Role::Prefill)),
        ),
    }
    workers
}

/// Replays the recording at `path` against `policies`. `seed` overrides the seed of the
/// recorded policy settings (the other settings are the live gateway's).
pub fn replay_recording(
    path: &Path,
    policies: &[PolicyKind],
    seed: Option<u64>,
) -> Result<EventsReport, ReplayError> {
    replay_recording_for(path, policies, seed, &RouteFilter::default())
}

/// [`replay_recording`], counting only the decisions `filter` matches (all are replayed, so
/// each policy's load is that of the whole run).
pub fn replay_recording_for(
    path: &Path,
    policies: &[PolicyKind],
    seed: Option<u64>,
    filter: &RouteFilter,
) -> Result<EventsReport, ReplayError> {
    if policies.is_empty() {
        return Err(ReplayError::InvalidConfig("--policies is empty".into()));
    }
    let file = std::fs::File::open(path).map_err(|e| ReplayError::io(path, e))?;
    let reader = std::io::BufReader::new(file);
    let invalid = |line: usize, reason: String| ReplayError::TraceInvalid {
        path: PathBuf::from(path),
        line,
        reason,
    };
    let mut replayer: Option<Replayer> = None;
    let (mut live_policy, mut used_seed) = (String::new(), 0);
    let (mut records, mut dropped, mut complete) = (0u64, 0u64, false);
    for (i, text) in reader.lines().enumerate() {
        let number = i + 1;
        let text = text.map_err(|e| ReplayError::io(path, e))?;
        if text.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(&text).map_err(|source| ReplayError::TraceParse {
            path: PathBuf::from(path),
            line: number,
            source,
        })?;
        let Some(r) = replayer.as_mut() else {
            let Line::Header(header) = line else {
                return Err(invalid(number, "the first line must be the header".into()));
            };
            if header.format != FORMAT || !(MIN_VERSION..=VERSION).contains(&header.version) {
                return Err(invalid(
                    number,
                    format!(
                        "not a {FORMAT} version {MIN_VERSION} to {VERSION} file (format {:?}, version {})",
                        header.format, header.version
                    ),
                ));
            }
            filter.check_version(header.version)?;
            let mut settings = header.policy_settings;
            settings.seed = seed.unwrap_or(settings.seed);
            (live_policy, used_seed) = (header.policy, settings.seed);
            let mut r = Replayer {
                kinds: policies.to_vec(),
                settings,
                serve: header.serve,
                models: BTreeMap::new(),
                tallies: policies.iter().map(|_| Tally::default()).collect(),
                live: Tally::default(),
                counts: IndexCounts::default(),
                filter: filter.clone(),
            };
            for worker in header.workers {
                r.joined(worker)?;
            }
            replayer = Some(r);
            continue;
        };
        if let Line::Trailer(trailer) = &line {
            (dropped, complete) = (trailer.dropped, trailer.complete);
        } else {
            records += 1;
            complete = false;
        }
        r.apply(line).map_err(|e| invalid(number, e.to_string()))?;
    }
    let Some(r) = replayer else {
        return Err(invalid(0, "the recording is empty".into()));
    };
    let disaggregation = r.serve.disaggregation.to_string();
    let mut reports = vec![r.live.report(format!("live ({live_policy})"))];
    for (kind, tally) in policies.iter().zip(r.tallies) {
        reports.push(tally.report(kind.as_str().to_owned()));
    }
    Ok(EventsReport {
        recording: path.display().to_string(),
        seed: used_seed,
        live_policy,
        disaggregation,
        complete,
        dropped,
        records,
        filter: filter.describe(),
        index: r.counts,
        policies: reports,
    })
}

#[cfg(test)]
mod tests;
