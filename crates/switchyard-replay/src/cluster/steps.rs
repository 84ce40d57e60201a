//! A worker's simulated step: starting it, and when it ends, delivering its tokens to their
//! requests' records and its KV events to the index (at once or after the propagation delay).

use std::time::Duration;

use indicatif::ProgressBar;
use switchyard_core::KvEvent;

use super::{Cluster, Event, TokenGap};
use crate::error::ReplayError;
use crate::workload::{Micros, Outbox, Workload};

impl Cluster {
    pub(super) fn start_step(&mut self, w: usize) {
        self.workers[w]
            .sim
            .set_clock(Duration::from_micros(self.now));
        let outcome = self.workers[w].sim.step();
        if outcome.is_idle() {
            return;
        }
        let at = self.now + outcome.duration.as_micros() as Micros;
        self.workers[w].pending = Some(outcome);
        self.schedule(at, Event::StepDone(w));
    }

    pub(super) fn complete_step(
        &mut self,
        w: usize,
        workload: &mut dyn Workload,
        out: &mut Outbox,
        progress: &ProgressBar,
    ) {
        let Some(outcome) = self.workers[w].pending.take() else {
            return;
        };
        self.steps += 1;
        let stats = &mut self.workers[w].stats;
        stats.steps += 1;
        stats.busy_s += outcome.duration.as_secs_f64();
        stats.prefill_tokens += outcome.prefill_tokens as u64;
        stats.preempted += outcome.preempted as u64;
        stats.host_hit_blocks += outcome.host_hit_blocks as u64;
        self.publish(w, outcome.events);
        self.export(&outcome.exports);
        for token in &outcome.outputs {
            if token.completion_tokens == 1 {
                // A sequence's first token: what it had to compute on this worker.
                let computed = token
                    .prompt_tokens
                    .saturating_sub(token.cached_prompt_tokens);
                let stats = &mut self.workers[w].stats;
                stats.longest_prefill = stats.longest_prefill.max(u64::from(computed));
            }
            if self.prefill_done(token) {
                continue;
            }
            let Some(&slot) = self.live.get(&token.id) else {
                continue;
            };
            // A disaggregated request's continuation: its first token was emitted already.
            let offset = self.continued(w, token.id);
            if token.completion_tokens == 1 {
                // Admitted and past its prefill: a copied prefix needs no hold any more.
                self.peer_admitted(token.id);
            }
            let record = &mut self.records[slot];
            if record.first_token.is_none() {
                record.first_token = Some(self.now);
                record.cached_tokens = u64::from(token.cached_prompt_tokens);
                if let Some(booking) = self.bookings.get(&token.id) {
                    self.core.prefill_done(booking);
                }
            }
            record.output_tokens = u64::from(token.completion_tokens) + offset;
            if self.config.token_gaps {
                let last = self.last_token_at.get(slot).copied().unwrap_or(self.now);
                if record.output_tokens > 1 {
                    self.token_gaps.push(TokenGap {
                        prompt_tokens: record.prompt_tokens.min(u64::from(u32::MAX)) as u32,
                        gap_us: self.now.saturating_sub(last).min(u64::from(u32::MAX)) as u32,
                    });
                }
                if let Some(at) = self.last_token_at.get_mut(slot) {
                    *at = self.now;
                }
            }
            if token.finish.is_some() {
                record.finished = Some(self.now);
                record.ok = true;
                self.live.remove(&token.id);
                self.flows.continuations.remove(&token.id);
                if let Some(booking) = self.bookings.remove(&token.id) {
                    self.release(&booking);
                }
                self.finished.push(slot);
                self.session_ended(token.id);
                progress.inc(1);
                workload.on_finished(token.id, true, self.now, out);
            }
        }
        if self.workers[w].sim.has_work() {
            self.start_step(w);
        }
    }

    /// Hands a step's (or an import's) KV events to the index, now or after the delay.
    pub(super) fn publish(&mut self, w: usize, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        if self.config.event_delay_us == 0 {
            // In-process events are well formed; an error here would be a simulator bug, and
            // the index leaves itself unchanged on one.
            let _ = self.apply_events(w, &events);
        } else {
            let at = self.now + self.config.event_delay_us;
            self.schedule(at, Event::KvEvents(w, events));
        }
    }

    pub(super) fn apply_events(&mut self, w: usize, events: &[KvEvent]) -> Result<(), ReplayError> {
        let worker = &mut self.workers[w];
        for event in events {
            let seq = worker.next_event_seq;
            worker.next_event_seq += 1;
            self.kv_events += 1;
            self.core
                .index
                .apply(&worker.id, 0, seq, event)
                .map_err(|e| ReplayError::Cluster(e.to_string()))?;
        }
        Ok(())
    }
}
