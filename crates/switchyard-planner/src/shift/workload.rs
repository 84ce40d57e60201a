//! The bench's traffic: phases of steady Poisson arrivals, the same for every configuration,
//! as a replay [`Workload`] (open loop: completions send nothing new).

use switchyard_core::rng::SplitMix64;
use switchyard_replay::synth::PromptSpec;
use switchyard_replay::{Micros, Outbox, RequestSpec, Workload};

use super::ShiftSettings;

/// One request of the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Arrival {
    pub seconds: f64,
    pub phase: usize,
    pub input_tokens: u32,
    pub output_tokens: u32,
}

/// The requests of the whole run, in arrival order (request id = index).
pub(super) fn arrivals(settings: &ShiftSettings) -> Vec<Arrival> {
    let mut rng = SplitMix64::new(settings.seed);
    let mut out = Vec::new();
    let mut start = 0.0;
    for (i, phase) in settings.phases.iter().enumerate() {
        let mut t = start;
        if phase.rate > 0.0 {
            loop {
                t += -rng.next_f64_open().ln() / phase.rate;
                if t >= start + phase.seconds {
                    break;
                }
                out.push(Arrival {
                    seconds: t,
                    phase: i,
                    input_tokens: phase.input_tokens,
                    output_tokens: phase.output_tokens.max(1),
                });
            }
        }
        start += phase.seconds;
    }
    out
}

/// Sends every arrival at its time. Prompts share nothing (each request's tokens are its own).
#[derive(Debug)]
pub(super) struct PhaseWorkload {
    arrivals: Vec<Arrival>,
    seed: u64,
}

impl PhaseWorkload {
    pub fn new(arrivals: Vec<Arrival>, seed: u64) -> Self {
        Self { arrivals, seed }
    }
}

impl Workload for PhaseWorkload {
    fn start(&mut self, out: &mut Outbox) {
        for (id, a) in self.arrivals.iter().enumerate() {
            let id = id as u64;
            out.send_at(
                (a.seconds * 1e6) as Micros,
                RequestSpec {
                    id,
                    prompt: PromptSpec {
                        namespace: id + 1,
                        block_size: 512,
                        hash_ids: Vec::new(),
                        input_tokens: u64::from(a.input_tokens),
                        tail_seed: self.seed ^ id.wrapping_mul(0x9E37_79B9),
                    },
                    max_tokens: a.output_tokens,
                    session: None,
                },
            );
        }
    }

    fn on_finished(&mut self, _id: u64, _ok: bool, _now: Micros, _out: &mut Outbox) {}

    fn expected_requests(&self) -> Option<u64> {
        Some(self.arrivals.len() as u64)
    }

    fn sessions_completed(&self) -> u64 {
        0
    }
}
