//! Helpers shared by the simulator's tests: a driver that checks every event against a naive
//! model of the cache as it goes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use switchyard_core::{BlockHash, BlockSize, KvEvent, StorageTier};

use crate::{SimConfig, SimRequest, Simulator, StepOutcome, TokenOutput};

pub(crate) fn bs(n: u32) -> BlockSize {
    BlockSize::new(n).unwrap()
}

/// A config with `blocks` device blocks of `block` tokens and otherwise the defaults.
pub(crate) fn tiny(block: u32, blocks: u64) -> SimConfig {
    SimConfig {
        block_size: bs(block),
        num_device_blocks: blocks,
        ..SimConfig::default()
    }
}

pub(crate) fn req(id: u64, prompt: Vec<u32>, max_tokens: u32) -> SimRequest {
    SimRequest {
        ignore_eos: true,
        ..SimRequest::new(id, prompt, max_tokens)
    }
}

/// Runs a simulator while mirroring its events into a set of `(tier, hash)`.
pub(crate) struct Driver {
    pub(crate) sim: Simulator,
    pub(crate) model: BTreeSet<(StorageTier, BlockHash)>,
    pub(crate) steps: Vec<StepOutcome>,
    pub(crate) now: Duration,
    /// Per request: every output with the simulated time at the end of its step.
    pub(crate) outputs: BTreeMap<u64, Vec<(Duration, TokenOutput)>>,
}

impl Driver {
    pub(crate) fn new(config: SimConfig) -> Self {
        Self {
            sim: Simulator::new(config).unwrap(),
            model: BTreeSet::new(),
            steps: Vec::new(),
            now: Duration::ZERO,
            outputs: BTreeMap::new(),
        }
    }

    pub(crate) fn add(&mut self, r: SimRequest) {
        self.sim.add_request(r).unwrap();
    }

    /// Imports blocks, applying the import's events to the model like a step's.
    pub(crate) fn import(
        &mut self,
        blocks: &[(switchyard_core::BlockHash, Vec<u32>)],
    ) -> crate::ImportOutcome {
        self.import_held(None, None, blocks)
    }

    /// Imports blocks under an optional hold, continuing the chain after `parent`.
    pub(crate) fn import_held(
        &mut self,
        hold: Option<u64>,
        parent: Option<switchyard_core::BlockHash>,
        blocks: &[(switchyard_core::BlockHash, Vec<u32>)],
    ) -> crate::ImportOutcome {
        let outcome = self.sim.import_blocks(hold, parent, blocks);
        self.apply(&outcome.events);
        self.check_model();
        outcome
    }

    /// Steps once, checking every event validates and applies cleanly to the model.
    pub(crate) fn step(&mut self) -> &StepOutcome {
        self.sim.set_clock(self.now);
        let out = self.sim.step();
        self.apply(&out.events);
        self.now += out.duration;
        for o in &out.outputs {
            self.outputs
                .entry(o.id)
                .or_default()
                .push((self.now, o.clone()));
        }
        self.steps.push(out);
        self.steps.last().unwrap()
    }

    fn apply(&mut self, events: &[KvEvent]) {
        let block_size = self.sim.config().block_size;
        for event in events {
            event.validate(block_size).unwrap();
            match event {
                KvEvent::Stored { blocks, tier, .. } => {
                    for b in blocks {
                        assert!(
                            self.model.insert((*tier, b.hash)),
                            "stored twice: {tier:?} {}",
                            b.hash
                        );
                    }
                }
                KvEvent::Removed { blocks, tier } => {
                    for h in blocks {
                        assert!(self.model.remove(&(*tier, *h)), "removed unknown {h}");
                    }
                }
                KvEvent::Cleared => self.model.clear(),
            }
        }
    }

    /// Steps until no work is left (at most `limit` steps) and checks the model matches.
    pub(crate) fn run(&mut self, limit: usize) {
        for _ in 0..limit {
            if !self.sim.has_work() {
                break;
            }
            self.step();
        }
        assert!(!self.sim.has_work(), "still busy after {limit} steps");
        self.check_model();
    }

    pub(crate) fn check_model(&self) {
        let actual: BTreeSet<_> = self
            .sim
            .cached_blocks()
            .into_iter()
            .map(|b| (b.tier, b.hash))
            .collect();
        assert_eq!(actual, self.model);
    }

    pub(crate) fn tokens_of(&self, id: u64) -> Vec<u32> {
        self.outputs
            .get(&id)
            .map(|v| v.iter().map(|(_, o)| o.token).collect())
            .unwrap_or_default()
    }

    /// Simulated time at which request `id` got its first token.
    pub(crate) fn ttft(&self, id: u64) -> Duration {
        self.outputs[&id][0].0
    }
}
