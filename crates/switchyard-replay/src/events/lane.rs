//! One policy's lane of a KV-event replay: its own serving core (the live gateway's
//! [`ServingCore`], with the policy as its live policy), fed the recorded load reports and the
//! bookkeeping of its *own* bookings, and serving each recorded request with
//! [`ServingCore::serve`] under the recorded serving settings.
//!
//! Every lane serves over the model's one [`PrefixIndex`] (the workers' real caches): the
//! index is lent to the lane's core for the call, so the KV events are applied once, not once
//! per policy.

use std::collections::BTreeMap;

use switchyard_core::{BlockSize, WorkerId};
use switchyard_router::recording::{RouteRecord, ServedAs};
use switchyard_router::serve::{
    Booking, ServeOutcome, ServeSettings, Served, ServingCore, WorkerFacts,
};
use switchyard_router::{
    Decision, IndexConfig, LoadConfig, PolicyConfig, PolicyKind, PrefixIndex, RouteError,
    RouteRequest, Tick,
};

/// What a lane decided for one recorded request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub stage: ServedAs,
    /// The generating worker and the prompt blocks it held.
    pub decode: (WorkerId, u32),
    /// The prefill worker and the prompt blocks it held, when served disaggregated.
    pub prefill: Option<(WorkerId, u32)>,
}

impl Outcome {
    /// The live gateway's decision, as its record says.
    pub fn live(record: &RouteRecord) -> Self {
        let prefill = match (&record.served, &record.prefill) {
            (ServedAs::Disaggregated, Some(p)) => {
                p.chosen.clone().map(|worker| (worker, p.cached_blocks))
            }
            _ => None,
        };
        Self {
            stage: record.served,
            decode: (record.chosen.clone(), record.cached_blocks),
            prefill,
        }
    }
}

/// One policy's serving core and the bookings it holds for the recording's requests.
#[derive(Debug)]
pub struct Lane {
    core: ServingCore,
    /// Decode bookings by the recorded route key.
    decode: BTreeMap<u64, Booking>,
    /// Prefill bookings of requests the live gateway served aggregated, by the recorded decode
    /// key: they end with the decode's first token (or its end).
    unlinked: BTreeMap<u64, Booking>,
    /// Prefill bookings of requests the live gateway prefilled too, by the recorded prefill
    /// key (their own `prefill_done`/`finished` records follow), with the decode key.
    linked: BTreeMap<u64, (u64, Booking)>,
}

impl Lane {
    pub fn new(
        kind: PolicyKind,
        settings: &PolicyConfig,
        block_size: BlockSize,
    ) -> Result<Self, RouteError> {
        let core = ServingCore::new(
            block_size,
            IndexConfig::new(block_size),
            LoadConfig::default(),
            kind,
            settings,
        )?;
        Ok(Self {
            core,
            decode: BTreeMap::new(),
            unlinked: BTreeMap::new(),
            linked: BTreeMap::new(),
        })
    }

    pub fn load_report(
        &mut self,
        worker: &WorkerId,
        stats: switchyard_core::LoadStats,
        tick: Tick,
    ) {
        self.core.load.report(worker, stats, tick);
    }

    /// The worker left: its load and whatever the policies remember of it go (the shared
    /// index forgets it once, in the caller).
    pub fn remove_worker(&mut self, worker: &WorkerId) {
        self.core.remove_worker(worker);
    }

    /// Serves the recorded request over `workers` (its decode candidates, then the prefill
    /// pool) with the shared `index`.
    pub fn serve(
        &mut self,
        index: &mut PrefixIndex,
        settings: &ServeSettings,
        record: &RouteRecord,
        request: &RouteRequest,
        workers: &[WorkerFacts<'_>],
    ) -> Result<Outcome, RouteError> {
        std::mem::swap(index, &mut self.core.index);
        let served = self
            .core
            .serve(settings, request, record.max_tokens, workers);
        std::mem::swap(index, &mut self.core.index);
        let ServeOutcome {
            served,
            rerouted_from,
        } = served?;
        if let Some(first) = rerouted_from
            && record.served == ServedAs::Rerouted
        {
            // The live gateway rerouted too: its next route record is the second attempt,
            // replayed on its own, so this attempt holds nothing.
            self.release(&served);
            return Ok(Outcome {
                stage: ServedAs::Rerouted,
                decode: (first.worker.clone(), cached(&first)),
                prefill: None,
            });
        }
        let linked_key = record.prefill.as_ref().and_then(|p| p.key);
        Ok(match served {
            Served::Aggregated {
                decision, booking, ..
            } => {
                self.decode.insert(record.key, booking);
                Outcome {
                    stage: ServedAs::Aggregated,
                    decode: (decision.worker.clone(), cached(&decision)),
                    prefill: None,
                }
            }
            Served::Disaggregated {
                decision,
                decode,
                prefill_decision,
                prefill,
            } => {
                self.decode.insert(record.key, decode);
                match linked_key {
                    Some(key) => {
                        self.linked.insert(key, (record.key, prefill));
                    }
                    None => {
                        self.unlinked.insert(record.key, prefill);
                    }
                }
                Outcome {
                    stage: ServedAs::Disaggregated,
                    decode: (decision.worker.clone(), cached(&decision)),
                    prefill: Some((prefill_decision.worker.clone(), cached(&prefill_decision))),
                }
            }
            Served::Refused { decision, .. } => Outcome {
                stage: ServedAs::Refused,
                decode: (decision.worker.clone(), cached(&decision)),
                prefill: None,
            },
        })
    }

    fn release(&mut self, served: &Served) {
        match served {
            Served::Aggregated { booking, .. } => self.core.finished(booking),
            Served::Disaggregated {
                decode, prefill, ..
            } => {
                self.core.finished(decode);
                self.core.finished(prefill);
            }
            Served::Refused { .. } => {}
        }
    }

    /// The request (or prefill) recorded as `key` had its first token (finished its prefill).
    pub fn prefill_done(&mut self, key: u64) {
        if let Some(decode) = self.decode.get(&key) {
            self.core.prefill_done(decode);
            if let Some(prefill) = self.unlinked.remove(&key) {
                self.core.finished(&prefill);
            }
        } else if let Some((_, prefill)) = self.linked.get(&key) {
            self.core.prefill_done(prefill);
        }
    }

    /// The request (or prefill) recorded as `key` ended.
    pub fn finished(&mut self, key: u64) {
        if let Some(decode) = self.decode.remove(&key) {
            self.core.finished(&decode);
            if let Some(prefill) = self.unlinked.remove(&key) {
                self.core.finished(&prefill);
            }
        } else if let Some((_, prefill)) = self.linked.remove(&key) {
            self.core.finished(&prefill);
        }
    }

    /// The prefill recorded as `key` failed: the decode request computes its prompt itself.
    pub fn prefill_failed(&mut self, key: u64) {
        let Some((decode_key, prefill)) = self.linked.remove(&key) else {
            return;
        };
        match self.decode.get_mut(&decode_key) {
            Some(decode) => self.core.prefill_failed(&prefill, decode),
            None => self.core.finished(&prefill),
        }
    }
}

fn cached(decision: &Decision) -> u32 {
    decision.chosen().map_or(0, |c| c.overlap.device)
}
