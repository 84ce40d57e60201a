//! A cluster of simulated workers in virtual time, serving disaggregated the way the gateway
//! does (`auto`): a prompt with at least `disagg_min_tokens` uncached tokens is prefilled on the
//! prefill worker with the least queued prefill, its blocks move to the decode worker (charged
//! at the KV transfer bandwidth) and decode continues there; a shorter one runs on the decode
//! worker alone. Workers change role the way the local connector moves them: drained (no new
//! work), switched when idle.

use std::collections::BTreeMap;

use switchyard_core::{BlockHash, Role, TokenId};
use switchyard_engine_sim::{SimConfig, SimError, SimRequest, Simulator, TokenOutput};

/// One simulated worker.
#[derive(Debug)]
pub(super) struct Worker {
    pub sim: Simulator,
    pub role: Role,
    /// The role it moves to once idle; while set, it takes no new work.
    pub moving_to: Option<Role>,
    /// Virtual time its running step ends, with that step's outputs.
    pub step: Option<(f64, Vec<TokenOutput>)>,
    /// Requests assigned and not finished (the drain condition).
    pub assigned: usize,
}

/// Where a request is in its life.
#[derive(Debug, Clone)]
pub(super) struct Flight {
    pub arrival: f64,
    pub phase: usize,
    pub prompt: Vec<TokenId>,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub first_token: Option<f64>,
    pub last_token: Option<f64>,
    pub tokens: u32,
    pub cached: u32,
}

/// A finished request's figures.
#[derive(Debug, Clone, Copy)]
pub(super) struct Finished {
    pub phase: usize,
    pub ttft: f64,
    /// Mean time between tokens after the first; `None` for one-token outputs.
    pub itl: Option<f64>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub cached_tokens: u32,
}

/// A prompt's blocks on their way to a decode worker.
#[derive(Debug)]
struct Transfer {
    /// Virtual time the blocks land.
    at: f64,
    request: u64,
    decode_worker: usize,
    blocks: Vec<(BlockHash, Vec<TokenId>)>,
}

#[derive(Debug)]
pub(super) struct Cluster {
    pub workers: Vec<Worker>,
    flights: BTreeMap<u64, Flight>,
    /// Prefill ids → the request and the worker holding its blocks.
    prefills: BTreeMap<u64, (u64, usize)>,
    /// KV transfers under way.
    transfers: Vec<Transfer>,
    pub finished: Vec<Finished>,
    pub failed: usize,
    next_prefill_id: u64,
    disagg_min_tokens: usize,
    /// Seconds per transferred token plus per block (descriptor overhead).
    transfer_per_token: f64,
    transfer_per_block: f64,
}

const PREFILL_ID_BASE: u64 = 1 << 62;

impl Cluster {
    pub fn new(
        config: &SimConfig,
        roles: &[Role],
        disagg_min_tokens: usize,
        kv_bytes_per_token: f64,
    ) -> Result<Self, SimError> {
        let workers = roles
            .iter()
            .enumerate()
            .map(|(i, &role)| {
                let mut c = config.clone();
                c.seed = config.seed + i as u64;
                Ok(Worker {
                    sim: Simulator::new(c)?,
                    role,
                    moving_to: None,
                    step: None,
                    assigned: 0,
                })
            })
            .collect::<Result<Vec<_>, SimError>>()?;
        let timing = &config.timing;
        Ok(Self {
            workers,
            flights: BTreeMap::new(),
            prefills: BTreeMap::new(),
            transfers: Vec::new(),
            finished: Vec::new(),
            failed: 0,
            next_prefill_id: PREFILL_ID_BASE,
            disagg_min_tokens,
            transfer_per_token: kv_bytes_per_token * 8.0 / (timing.kv_transfer_gbps * 1e9),
            transfer_per_block: timing.kv_descriptor_overhead_us / 1e6,
        })
    }

    fn accepting(&self, role: Role) -> impl Iterator<Item = usize> + '_ {
        self.workers
            .iter()
            .enumerate()
            .filter(move |(_, w)| w.moving_to.is_none() && w.role == role)
            .map(|(i, _)| i)
    }

    /// The decode worker with the fewest running sequences.
    fn pick_decode(&self) -> Option<usize> {
        self.accepting(Role::Decode).min_by_key(|&i| {
            self.workers[i].sim.load().running_requests
                + self.workers[i].sim.load().waiting_requests
        })
    }

    /// The prefill worker with the least queued prefill.
    fn pick_prefill(&self) -> Option<usize> {
        self.accepting(Role::Prefill)
            .min_by_key(|&i| self.workers[i].sim.load().queued_prefill_tokens)
    }

    pub fn admit(&mut self, id: u64, flight: Flight) {
        let long = flight.prompt.len() >= self.disagg_min_tokens;
        let prefill = if long { self.pick_prefill() } else { None };
        let result = match (prefill, self.pick_decode()) {
            (_, None) => None,
            (Some(p), Some(_)) => {
                let pid = self.next_prefill_id;
                self.next_prefill_id += 1;
                let req = SimRequest {
                    hold_blocks: true,
                    ignore_eos: true,
                    ..SimRequest::new(pid, flight.prompt.clone(), 1)
                };
                self.workers[p].sim.add_request(req).ok().map(|()| {
                    self.workers[p].assigned += 1;
                    self.prefills.insert(pid, (id, p));
                })
            }
            (None, Some(d)) => {
                let req = SimRequest {
                    ignore_eos: true,
                    ..SimRequest::new(id, flight.prompt.clone(), flight.max_tokens)
                };
                self.workers[d].sim.add_request(req).ok().map(|()| {
                    self.workers[d].assigned += 1;
                })
            }
        };
        match result {
            Some(()) => {
                self.flights.insert(id, flight);
            }
            None => self.failed += 1,
        }
    }

    /// The next time something happens inside the cluster (a step ends, a transfer lands).
    pub fn next_event(&self) -> Option<f64> {
        let steps = self
            .workers
            .iter()
            .filter_map(|w| w.step.as_ref().map(|s| s.0));
        let transfers = self.transfers.iter().map(|t| t.at);
        steps.chain(transfers).min_by(f64::total_cmp)
    }

    /// Starts a step on every idle worker with work.
    pub fn start_steps(&mut self, now: f64) {
        for w in &mut self.workers {
            if w.step.is_none() && w.sim.has_work() {
                let outcome = w.sim.step();
                if !outcome.is_idle() {
                    w.step = Some((now + outcome.duration.as_secs_f64(), outcome.outputs));
                }
            }
        }
    }

    /// Completes the steps and transfers due at `now`.
    pub fn complete(&mut self, now: f64) {
        for i in 0..self.workers.len() {
            let due = matches!(&self.workers[i].step, Some((t, _)) if *t <= now);
            if !due {
                continue;
            }
            let Some((_, outputs)) = self.workers[i].step.take() else {
                continue;
            };
            for out in outputs {
                self.token(i, now, &out);
            }
        }
        let (ready, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.transfers)
            .into_iter()
            .partition(|t| t.at <= now);
        self.transfers = later;
        for t in ready {
            self.land(t.request, t.decode_worker, &t.blocks);
        }
        self.settle_moves();
    }

    fn token(&mut self, worker: usize, now: f64, out: &TokenOutput) {
        if let Some((id, p)) = self.prefills.remove(&out.id) {
            // The prefill's token is the request's first; its blocks go to a decode worker.
            let blocks = self.workers[p].sim.held_blocks(out.id).unwrap_or_default();
            self.workers[p].sim.release_hold(out.id);
            self.workers[p].assigned = self.workers[p].assigned.saturating_sub(1);
            let Some(flight) = self.flights.get_mut(&id) else {
                return;
            };
            flight.first_token = Some(now);
            flight.last_token = Some(now);
            flight.tokens = 1;
            flight.cached = out.cached_prompt_tokens;
            flight.prompt.push(out.token);
            if flight.max_tokens <= 1 {
                self.finish(id);
                return;
            }
            match self.pick_decode() {
                Some(d) => {
                    let tokens = blocks.iter().map(|b| b.1.len()).sum::<usize>() as f64;
                    let at = now
                        + tokens * self.transfer_per_token
                        + blocks.len() as f64 * self.transfer_per_block;
                    self.workers[d].assigned += 1;
                    self.transfers.push(Transfer {
                        at,
                        request: id,
                        decode_worker: d,
                        blocks,
                    });
                }
                None => {
                    self.flights.remove(&id);
                    self.failed += 1;
                }
            }
            return;
        }
        let Some(flight) = self.flights.get_mut(&out.id) else {
            return;
        };
        if flight.first_token.is_none() {
            flight.first_token = Some(now);
            flight.cached = out.cached_prompt_tokens;
        }
        flight.last_token = Some(now);
        flight.tokens += 1;
        if out.finish.is_some() || flight.tokens >= flight.max_tokens {
            self.workers[worker].assigned = self.workers[worker].assigned.saturating_sub(1);
            self.finish(out.id);
        }
    }

    fn land(&mut self, id: u64, d: usize, blocks: &[(BlockHash, Vec<TokenId>)]) {
        let Some(flight) = self.flights.get(&id) else {
            return;
        };
        self.workers[d].sim.import_blocks(None, None, blocks);
        let req = SimRequest {
            ignore_eos: true,
            ..SimRequest::new(id, flight.prompt.clone(), flight.max_tokens - 1)
        };
        if self.workers[d].sim.add_request(req).is_err() {
            self.workers[d].assigned = self.workers[d].assigned.saturating_sub(1);
            self.flights.remove(&id);
            self.failed += 1;
        }
    }

    fn finish(&mut self, id: u64) {
        let Some(f) = self.flights.remove(&id) else {
            return;
        };
        let (Some(first), Some(last)) = (f.first_token, f.last_token) else {
            return;
        };
        self.finished.push(Finished {
            phase: f.phase,
            ttft: first - f.arrival,
            itl: (f.tokens > 1).then(|| (last - first) / f64::from(f.tokens - 1)),
            prompt_tokens: f.prompt_tokens,
            output_tokens: f.tokens,
            cached_tokens: f.cached,
        });
    }

    /// Starts moving `worker` to `role`: it takes no new work and switches once idle.
    pub fn move_worker(&mut self, worker: usize, role: Role) {
        if let Some(w) = self.workers.get_mut(worker) {
            w.moving_to = Some(role);
        }
        self.settle_moves();
    }

    fn settle_moves(&mut self) {
        for w in &mut self.workers {
            if let Some(role) = w.moving_to
                && w.assigned == 0
                && !w.sim.has_work()
                && w.step.is_none()
            {
                w.role = role;
                w.moving_to = None;
            }
        }
    }

    /// Pool sizes as the connector would report them (a moving worker counts in its old pool).
    pub fn pools(&self) -> (u32, u32) {
        let count = |r| self.workers.iter().filter(|w| w.role == r).count() as u32;
        (count(Role::Prefill), count(Role::Decode))
    }

    pub fn active_decode_sequences(&self) -> u64 {
        self.workers
            .iter()
            .filter(|w| w.role == Role::Decode)
            .map(|w| w.sim.load().active_decode_sequences)
            .sum()
    }

    pub fn prefill_pool_queued_tokens(&self) -> u64 {
        self.workers
            .iter()
            .filter(|w| w.role == Role::Prefill)
            .map(|w| w.sim.load().queued_prefill_tokens)
            .sum()
    }

    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }
}
