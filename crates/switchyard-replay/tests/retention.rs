//! Retention across think time on the simulated cluster: a session's prefix survives its pause
//! with a host tier or a retention hint, where plain LRU loses it to other traffic, and the
//! report counts host hits and moved bytes.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use switchyard_core::BlockSize;
use switchyard_engine_sim::SimConfig;
use switchyard_replay::synth::PromptSpec;
use switchyard_replay::{
    ClusterConfig, Micros, OfflineRun, Outbox, RequestSpec, Workload, replay_offline,
};
use switchyard_router::serve::RetentionConfig;

/// Session `agent` sends a 64-block turn, pauses 10 s, then sends the next turn on top of it.
/// During the pause anonymous one-shot prompts of 64 distinct blocks each go to the same
/// (single) worker, enough to overwrite a 192-block cache twice.
#[derive(Debug, Default)]
struct PauseThenReturn {
    next_id: u64,
    sent: u64,
    agent_turns: u8,
}

const BLOCK: u32 = 16;
const PAUSE_US: Micros = 10_000_000;

fn prompt(namespace: u64, blocks: u32, extra: u32, tail_seed: u64) -> PromptSpec {
    PromptSpec {
        namespace,
        block_size: BLOCK,
        hash_ids: (0..blocks + extra).collect(),
        input_tokens: u64::from((blocks + extra) * BLOCK),
        tail_seed,
    }
}

impl PauseThenReturn {
    fn send(&mut self, out: &mut Outbox, at: Micros, prompt: PromptSpec, session: Option<&str>) {
        self.next_id += 1;
        self.sent += 1;
        out.send_at(
            at,
            RequestSpec {
                id: self.next_id,
                prompt,
                max_tokens: 2,
                session: session.map(str::to_owned),
            },
        );
    }
}

impl Workload for PauseThenReturn {
    fn start(&mut self, out: &mut Outbox) {
        self.agent_turns = 1;
        self.send(out, 0, prompt(1, 64, 0, 1), Some("agent"));
    }

    fn on_finished(&mut self, id: u64, _ok: bool, now: Micros, out: &mut Outbox) {
        if id == 1 {
            // The agent's tool call: others' traffic now, the agent's next turn after the pause.
            for k in 0..6u64 {
                self.send(
                    out,
                    now + 1 + k * 1_000_000,
                    prompt(100 + k, 64, 0, 100 + k),
                    None,
                );
            }
            self.agent_turns = 2;
            self.send(out, now + PAUSE_US, prompt(1, 64, 4, 2), Some("agent"));
        }
    }

    fn expected_requests(&self) -> Option<u64> {
        Some(8)
    }

    fn sessions_completed(&self) -> u64 {
        0
    }
}

fn run(host_blocks: u64, retention: bool) -> OfflineRun {
    let config = ClusterConfig {
        workers: 1,
        sim: SimConfig {
            block_size: BlockSize::new(BLOCK).unwrap(),
            num_device_blocks: 192,
            num_host_blocks: host_blocks,
            ..SimConfig::default()
        },
        retention: retention.then(RetentionConfig::default),
        ..ClusterConfig::default()
    };
    let mut workload = PauseThenReturn::default();
    let run = replay_offline(
        &mut workload,
        &config,
        1.0,
        &indicatif::ProgressBar::hidden(),
    )
    .unwrap();
    assert_eq!(run.summary.requests_completed, 8);
    run
}

/// Prompt tokens of the agent's second turn served from cache.
fn returning_turn_hit(run: &OfflineRun) -> u64 {
    run.run.records.last().unwrap().cached_tokens
}

#[test]
fn plain_lru_loses_the_paused_prefix() {
    let base = run(0, false);
    assert_eq!(base.summary.label, "kv");
    assert_eq!(returning_turn_hit(&base), 0);
    assert_eq!(base.summary.host_hit_rate, 0.0);
    assert_eq!(base.summary.transferred_bytes, 0);
}

#[test]
fn a_host_tier_brings_the_paused_prefix_back_over_the_link() {
    let base = run(0, false);
    let host = run(1024, false);
    assert_eq!(host.summary.label, "kv+host");
    assert_eq!(returning_turn_hit(&host), 64 * u64::from(BLOCK));
    assert!(host.summary.host_hit_rate > 0.0);
    // 64 blocks of 16 tokens at 128 KiB per token.
    assert!(host.summary.transferred_bytes >= 64 * 16 * 131_072);
    assert!(host.summary.recomputed_tokens < base.summary.recomputed_tokens);
}

#[test]
fn a_retention_hint_keeps_the_paused_prefix_on_the_device() {
    let kept = run(0, true);
    assert_eq!(kept.summary.label, "kv+retention");
    assert_eq!(returning_turn_hit(&kept), 64 * u64::from(BLOCK));
    assert_eq!(kept.summary.transferred_bytes, 0);
    // The other traffic was still admitted and served (the budget is half the cache).
    assert_eq!(kept.summary.requests_failed, 0);
}
